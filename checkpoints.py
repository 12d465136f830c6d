"""Checkpoints, their one owner: what one holds, which one a run starts from (decided in one place), reading them
(or saying in one line why one cannot be used), the model they give, and writing them so that a crash never
leaves half of one and a damaged copy is never trusted.

    start = checkpoints.decide_start(args)          # --resume PATH|auto, a torchrun restart, --weights, or afresh
    model = checkpoints.start_model(args, classes, start)   # its weights, or --weights, or the pretrained backbone
    position = checkpoints.resume_training(start, optimizer, scaler, args, world_size)
    checkpoints.continue_run_at(args, start, position)   # metrics from there; a rewind keeps what it drops
    state = checkpoints.state(model, optimizer, scaler, args, world_size, classes, epoch=, step=, ...)
    checkpoints.save(state, path, keep_previous=True)   # its digest added; temporary file, fsync, rename
    model, classes = checkpoints.load_for_inference(path)   # predict.py: everything from the checkpoint

A checkpoint is a dict (weights_only: data, not code): model, optimizer, scaler (GradScaler), epoch and step
(the position: the next optimizer step to run, epochs counted from 0), epoch_loss_sum, best_miou, args (vars),
world_size, batch_size, accum_steps, classes, and digest: a SHA-256 of everything else in it, written with it
in the same file (so atomically), and checked by every reader (read()).
"""
import filecmp
import hashlib
import json
import math
import os
import shutil
from types import SimpleNamespace

import torch
import torch.distributed as dist

import paths
from dataset import CLASS_COLORS, CLASS_NAMES
from models import MODEL_NAMES, build_model
from paths import fail, first_line
from recovery import log

TRAINING_STATE = ("optimizer", "scaler", "epoch", "world_size", "batch_size")  # what resuming training needs
DEFAULT_MODEL, DEFAULT_OUTPUT_STRIDE = "deeplabv3plus_resnet101", 16  # the recipe's, when no checkpoint says


# --- what a checkpoint holds ------------------------------------------------------------------------------------
def state(model, optimizer, scaler, args, world_size, classes, epoch, step, best_miou, epoch_loss_sum):
    """A training checkpoint's dict: plain data, which torch.load(weights_only=True) reads back. epoch, step: the
    position to continue from (the next optimizer step); epoch_loss_sum: the loss summed over the epoch's steps
    so far, over all ranks."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
            "epoch": epoch, "step": step, "epoch_loss_sum": epoch_loss_sum, "best_miou": best_miou,
            "args": vars(args), "world_size": world_size, "batch_size": args.batch_size,
            "accum_steps": args.accum_steps, "classes": classes}


def _to_cpu(value):
    """The same nested data with every tensor on the CPU (a GPU's copied once; the CPU's as they are), to be
    digested and saved."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value


def digest(checkpoint):
    """SHA-256 over everything in a checkpoint but its "digest": each tensor's dtype, shape and bytes, every other
    value's repr, in the dicts' order (which torch.save keeps). torch.load checks no checksum of the bytes it
    reads: a tensor damaged in a bad copy loads without an error. This finds it."""
    sha = hashlib.sha256()

    def walk(value):
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            sha.update(f"tensor {tensor.dtype} {tuple(tensor.shape)}:".encode())
            sha.update(tensor.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            sha.update(b"{")
            for key, item in value.items():
                if value is not checkpoint or key != "digest":
                    sha.update(repr(key).encode() + b":")
                    walk(item)
            sha.update(b"}")
        elif isinstance(value, (list, tuple)):
            sha.update(b"[" if isinstance(value, list) else b"(")
            for item in value:
                walk(item)
            sha.update(b"]")
        else:
            sha.update(repr(value).encode() + b",")
    walk(checkpoint)
    return "sha256:" + sha.hexdigest()


# --- writing ----------------------------------------------------------------------------------------------
def previous_path(path):
    """checkpoint.pth -> checkpoint.prev.pth, in the same folder (the folder's own name is left alone)."""
    stem, extension = os.path.splitext(path)
    return stem + ".prev" + extension


def write_atomically(path, data, before_rename=None):
    """Write a temporary file, fsync, rename over path: a crash mid-write leaves the old file whole, and a
    failed write (a full disk) leaves no half file behind. data: bytes, or a function that writes to a file."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            data(f) if callable(data) else f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(directory)  # the rename itself survives a power cut
    os.close(directory)


def seal(state):
    """The state to save: a copy on the CPU with its digest. Sealed once, saved as often as wanted (an epoch's
    checkpoint.pth and best.pth). The state given is left as it was."""
    sealed = _to_cpu(state)
    sealed["digest"] = digest(sealed)
    return sealed


def save(state, path, keep_previous=False):
    """Written atomically, with its digest (sealed here unless it was). keep_previous: the checkpoint it replaces
    stays as *.prev.pth, a fallback. A write that fails (a full disk) leaves the previous checkpoint as it was and
    ends the run in one line."""
    if "digest" not in state:
        state = seal(state)

    def keep_previous_one():
        if os.path.isfile(path):
            previous = previous_path(path)
            if os.path.exists(previous):
                os.remove(previous)
            os.link(path, previous)  # a second name for the old file: path exists throughout

    try:
        write_atomically(path, lambda f: torch.save(state, f), keep_previous_one if keep_previous else None)
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
        folder = os.path.dirname(os.path.abspath(path))
        kept = os.path.isfile(path)
        # Without a checkpoint, what the epoch wrote before it (its metrics line, best.pth) is a run of its own that
        # the same command would refuse to replace: --overwrite puts it aside.
        again = "./run.sh --overwrite" if paths.named("--output-dir") == "OUTPUT_DIR" else "the same command with --overwrite"
        then = (f"{path} is the last one written. Free space; then, to resume, {paths.resume_advice()}" if kept else
                f"no checkpoint was kept. Free space, then start again: {again} (what this epoch wrote is put aside)")
        fail(f"cannot write {path} ({getattr(error, 'strerror', None) or first_line(error)}; "
             f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB free there): {then}")


# --- reading ----------------------------------------------------------------------------------------------
_unverified = set()  # checkpoints without a digest, said once each


def read(flag, path):
    """The checkpoint at path, given to `flag`, as a dict with at least "model", its digest checked; else one line
    that says what the file is instead. A bare state dict (torch.save(model.state_dict())) is taken as {"model":
    it}, and one saved from the DDP-wrapped model (every key "module.…") without that prefix. A checkpoint without
    a digest (written before checkpoints carried one, or not by main.py) is read, and that is said once."""
    if os.path.isdir(path):
        found = [name for name in ("best.pth", "checkpoint.pth") if os.path.isfile(os.path.join(path, name))]
        fail(f"{flag} {path} is a folder, not a checkpoint: give a checkpoint file"
             + (f", such as {os.path.join(path, found[0])}" if found else ""))
    if not os.path.isfile(path):
        fail(f"{flag} {path}: no such file")
    try:
        # map_location="cpu": otherwise every rank loads onto the GPU the checkpoint was saved from (rank 0's),
        # and that GPU holds a copy per rank. weights_only=True: a checkpoint is data, not code.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        # torch's own advice for what weights_only refuses (load it with weights_only=False) is not ours to give.
        if "Unsupported global" in str(error):  # a pickle of Python objects: code, not data
            fail(f"{flag} {path} holds Python objects beyond plain data, which torch.load(weights_only=True) refuses: "
                 "it is not a checkpoint main.py wrote")
        why = "not a PyTorch file" if "Weights only load failed" in str(error) else first_line(error)
        fail(f"{flag} {path} cannot be read ({type(error).__name__}: {why}): it is truncated, or not a PyTorch "
             "checkpoint")
    if isinstance(checkpoint, dict) and "digest" in checkpoint:
        if checkpoint["digest"] != digest(checkpoint):
            fail(f"{flag} {path} is damaged: what it holds differs from the digest written with it (a bad copy or "
                 "download?); copy it again, or give another checkpoint (one changed on purpose: remove its "
                 "'digest' entry)")
        del checkpoint["digest"]
    elif path not in _unverified:
        _unverified.add(path)
        log(f"note: {path} carries no digest (written before checkpoints had one, or not by main.py): it is read "
            "without a check that it is whole")
    if isinstance(checkpoint, dict) and checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        checkpoint = {"model": checkpoint}
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict) or not checkpoint["model"]:
        fail(f"{flag} {path} holds no model weights (no 'model' state dict): it is not a checkpoint of main.py")
    weights = checkpoint["model"]
    if all(key.startswith("module.") for key in weights):  # torch.save(ddp_model.state_dict())
        checkpoint["model"] = weights = {key[len("module."):]: value for key, value in weights.items()}
    if not any(key.startswith("backbone.") for key in weights):  # every model of models.py has a backbone
        if any(key.startswith(("fc.", "features.", "conv1.")) for key in weights):  # torchvision's classifiers
            fail(f"{flag} {path} holds the weights of a classification network (keys such as {next(iter(weights))}), "
                 f"not of this project's DeepLab: an ImageNet backbone goes to main.py --pretrained-backbone {path}")
        fail(f"{flag} {path} holds the weights of another network (keys such as {next(iter(weights))}), not of "
             "this project's DeepLab")
    return checkpoint


def classes_of(checkpoint):
    """The class names a checkpoint was trained for: main.py saves them; one saved before it did was trained
    on Cityscapes; weights alone (a bare state dict) do not say (None)."""
    if "classes" in checkpoint:
        return list(checkpoint["classes"]["names"])
    return list(CLASS_NAMES) if "args" in checkpoint else None


def _check_model_name(checkpoint, flag, path, model_name):
    saved = checkpoint.get("args", {}).get("model")
    if saved and saved != model_name:
        fail(f"{flag} {path} holds a {saved} model, but --model {model_name} was given: leave --model out (a "
             f"checkpoint's own is the default) or pass --model {saved}")


def _load_fitting(model, weights, flag, path, model_name):
    """Load weights that must fit the model exactly; else one line that says how they differ."""
    own = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in weights.items()
             if k in own and v.shape != own[k].shape]
    missing, unexpected = own.keys() - weights.keys(), weights.keys() - own.keys()
    if wrong or missing or unexpected:
        fail(f"{flag} {path} does not fit {model_name}: {len(wrong)} tensors of another shape (e.g. {wrong[:1]}), "
             f"{len(missing)} missing, {len(unexpected)} unexpected")
    model.load_state_dict(weights)


def load_for_inference(path):
    """predict.py's model: everything from the checkpoint at path (--resume), read and checked as every reader does.
    The model's name and output stride from its args, the number of classes from the classifier, the classes'
    names and colours from "classes" when it has them (else Cityscapes'). -> (model in eval mode, classes)."""
    checkpoint = read("--resume", path)
    saved = checkpoint.get("args") or {}
    if "model" not in saved:
        fail(f"--resume {path} holds weights without the model's name (no args['model']): give a checkpoint "
             "main.py wrote (best.pth or checkpoint.pth)")
    classifier = checkpoint["model"].get("classifier.weight")
    if saved["model"] not in MODEL_NAMES or classifier is None:
        fail(f"--resume {path} is not a checkpoint of this project's DeepLab (model {saved['model']!r})")
    num_classes = classifier.shape[0]
    model = build_model(saved["model"], num_classes, saved.get("output_stride") or DEFAULT_OUTPUT_STRIDE)
    try:
        model.load_state_dict(checkpoint["model"])
    except RuntimeError as error:
        fail(f"--resume {path} does not fit {saved['model']} ({first_line(error)})")
    classes = checkpoint.get("classes") or {"names": CLASS_NAMES, "colors": CLASS_COLORS}
    if len(classes["names"]) != num_classes:
        fail(f"--resume {path} has {num_classes} classes but names for {len(classes['names'])}")
    return model.eval(), classes


# --- the start ----------------------------------------------------------------------------------------------
def decide_start(args):
    """Which run this is, decided here alone (no module rewrites --resume):

    - torchrun restarted a training worker after a failure: the run's own last checkpoint, whatever the flags
      say; none yet: where the first attempt started (--resume PATH, or afresh);
    - --resume auto: OUTPUT_DIR/checkpoint.pth, or the one before it when that cannot be read; neither there: a
      fresh start. With --overwrite: a fresh start (run.sh passes --resume auto every time);
    - --resume PATH: that file (with -e: the model to evaluate, restarted or not).

    A fresh start with --weights reads that file too. --model and --output-stride, when not given, become what
    the checkpoint (or --weights) was trained as: it knows what it holds.

    -> namespace(path, checkpoint, weights): the checkpoint read (all ranks read it, before anything is written),
    or None for a fresh start; weights: --weights' checkpoint, read, or None; auto: whether it is the run's own
    (--resume auto or a restart)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 and not args.evaluate
    explicit = args.resume not in ("", "auto")
    auto = restart or (args.resume == "auto" and not args.overwrite)
    checkpoint = path = weights = None
    if auto:
        checkpoint, path = _find_in_run(args.output_dir, args.evaluate, say_none=not (restart and explicit))
    if checkpoint is None and explicit:
        checkpoint, path = read("--resume", args.resume), args.resume
    if checkpoint is None and args.weights:
        weights = read("--weights", args.weights)
    start = SimpleNamespace(path=path, checkpoint=checkpoint, weights=weights, auto=auto)
    _take_model_from(args, checkpoint if checkpoint is not None else weights)
    if checkpoint is not None and not args.evaluate:
        _check_it_can_resume(start, args)
    return start


def _take_model_from(args, checkpoint):
    """--model and --output-stride as given; else the checkpoint's own (main.py saves its args); else the recipe's."""
    saved = (checkpoint or {}).get("args") or {}
    if args.model is None:
        args.model = saved.get("model") if saved.get("model") in MODEL_NAMES else DEFAULT_MODEL
    if args.output_stride is None:
        args.output_stride = saved.get("output_stride") if saved.get("output_stride") in (8, 16) \
            else DEFAULT_OUTPUT_STRIDE


def _find_in_run(output_dir, evaluate, say_none=True):
    """--resume auto: output_dir/checkpoint.pth, else the one before it. A file there that cannot be read, with
    no usable one before it, stops the run: those files are evidence, not to be replaced."""
    problems = []
    for name in ("checkpoint.pth", "checkpoint.prev.pth"):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            try:
                checkpoint = read("--resume auto:", path)
            except paths.UserError as error:
                problems.append(str(error).removeprefix("--resume auto: "))
                continue
            if problems:
                log(f"warning: {problems[0]}; using the one before it, {path}")
            return checkpoint, path
    if problems:
        fail(f"--resume auto: {'; '.join(problems)}. Nothing usable to resume from, and these files are kept: "
             "move them aside to start afresh, or give --resume a good checkpoint")
    if evaluate:
        fail(f"-e: no checkpoint in {paths.named('--output-dir')} {output_dir} to evaluate: train there first, "
             f"or give {'./run.sh -e' if paths.named('--output-dir') == 'OUTPUT_DIR' else '-e'} --resume PATH")
    if say_none:
        log(f"no checkpoint in {output_dir}: starting afresh")
    return None, None


def _check_it_can_resume(start, args):
    if args.start_epoch and not start.auto:
        fail(f"--start-epoch {args.start_epoch} with --resume: {start.path} says where to start (epoch "
             f"{start.checkpoint.get('epoch', '?')}); drop --start-epoch")
    missing = [key for key in TRAINING_STATE if key not in start.checkpoint]
    if missing:
        fail(f"--resume {start.path} holds no {', '.join(missing)}: it has weights only (evaluate it with -e, or "
             f"fine-tune from it with --weights {start.path}); to continue training, resume a checkpoint.pth that "
             "main.py wrote")


def start_model(args, classes, start):
    """The model this run starts from, for these classes: every layer from start's checkpoint; else from --weights
    (fine-tuning: a classifier for other classes starts afresh); else the pretrained backbone. Pretrained weights
    are fetched only for a fresh start: a checkpoint holds every weight, so -e, a resumed run and a torchrun
    restart make no download attempt (cluster nodes are often offline)."""
    fresh = start.checkpoint is None
    torch.manual_seed(args.seed)  # the same initial weights on every rank, and in every run of this seed
    try:
        model = build_model(args.model, len(classes["names"]), args.output_stride,
                            args.pretrained_backbone if fresh and not args.weights else "none")
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        fail(error)
    if not fresh:
        _load_run_model(model, start, args.model, classes)
        if args.weights:  # a restart, a requeued job: the run's own checkpoint holds newer weights
            log(f"--weights {args.weights} not read: the run continues from its checkpoint {start.path}")
    elif start.weights is not None:
        load_weights(model, start.weights, args.weights, args.model, classes)
    return model


def _load_run_model(model, start, model_name, classes):
    """--resume: the model of the run to continue or evaluate, trained for the classes of --data."""
    path = start.path
    _check_model_name(start.checkpoint, "--resume", path, model_name)
    theirs = classes_of(start.checkpoint)
    if theirs is not None and theirs != list(classes["names"]):
        fail(f"--resume {path} was trained for {len(theirs)} classes ({', '.join(theirs[:3])}, ...), but "
             f"{paths.named('--data')} has {len(classes['names'])} others ({', '.join(classes['names'][:3])}, ...): "
             f"use the model on its own data, or fine-tune it on this data into a new output folder: --weights {path} "
             f"{'with another OUTPUT_DIR' if paths.named('--data') == 'DATA' else '--output-dir NEW'}")
    _load_fitting(model, start.checkpoint["model"], "--resume", path, model_name)


def load_weights(model, checkpoint, path, model_name, classes):
    """--weights (checkpoint: the file at path, read): start from a trained model (fine-tuning). A classifier
    trained for other classes (another number, or other names) is left as built, freshly initialised, and a line
    says so; the rest must fit."""
    _check_model_name(checkpoint, "--weights", path, model_name)
    weights, own = dict(checkpoint["model"]), model.state_dict()
    theirs = classes_of(checkpoint)
    head = [key for key in ("classifier.weight", "classifier.bias") if key in weights and key in own]
    if any(weights[key].shape != own[key].shape for key in head) or theirs not in (None, list(classes["names"])):
        before = f"{len(theirs)} classes ({', '.join(theirs[:3])}, ...)" if theirs else "other classes"
        for key in head:
            weights[key] = own[key]
        log(f"--weights {path}: its classifier, trained for {before}, does not fit the {len(classes['names'])} "
            f"classes of {paths.named('--data')} and starts afresh; every other layer starts from {path}")
    else:
        log(f"--weights {path}: every layer starts from it")
    _load_fitting(model, weights, "--weights", path, model_name)


def resume_training(start, optimizer, scaler, args, world_size):
    """The optimizer, GradScaler and position of start's checkpoint (the model has its weights already).
    -> namespace(epoch, step, best_miou, epoch_loss_sum): where training goes on (epoch --start-epoch, step 0,
    nothing seen yet, for a fresh start)."""
    position = SimpleNamespace(epoch=args.start_epoch, step=0, best_miou=float("-inf"), epoch_loss_sum=0.0)
    checkpoint, start.checkpoint = start.checkpoint, None  # not kept for the whole run: a model and more per rank
    if checkpoint is None or args.evaluate:  # -e: the model's weights are all it needs
        return _same_on_every_rank(position)
    for key in ("epoch", "step", "best_miou", "epoch_loss_sum"):
        setattr(position, key, checkpoint.get(key, getattr(position, key)))
    if position.epoch >= args.epochs:  # finished: main.py says there is nothing to train
        return _same_on_every_rank(position)
    if args.start_epoch:  # --resume auto (run.sh, a restart): the checkpoint wins, and that is said
        log(f"note: --start-epoch {args.start_epoch} is ignored: {start.path} says where to continue")
    where = (f"epoch {position.epoch} after step {position.step}" if position.step else
             f"the start of epoch {position.epoch}")
    best = checkpoint.get("best_miou", float("nan"))
    log(f"resuming from {start.path} at {where} (epochs counted from 0), best mIoU "
        + (f"{best:.4f}" if math.isfinite(best) else "none yet"))
    saved_epochs = (checkpoint.get("args") or {}).get("epochs")
    if saved_epochs and saved_epochs != args.epochs:  # the schedule's length changes: its learning rate jumps
        log(f"note: the run was scheduled over --epochs {saved_epochs}, this one over {args.epochs}: the poly "
            f"learning rate goes on at the same step of the {args.epochs}-epoch schedule, "
            f"{'higher' if args.epochs > saved_epochs else 'lower'} than where the run stopped")
    optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint["scaler"] and scaler.is_enabled():  # empty when saved without --amp fp16
        scaler.load_state_dict(checkpoint["scaler"])
    before = (checkpoint["world_size"], checkpoint["batch_size"], checkpoint.get("accum_steps", 1))
    now = (world_size, args.batch_size, args.accum_steps)
    if math.prod(before) != math.prod(now):
        # Another global batch: another number of optimizer steps an epoch. Finish the epoch from the same number
        # of images seen. (The same global batch in another layout, -b x processes x --accum-steps, sees the same
        # images up to here: its steps are the same; only how they are split differs.)
        position.step = position.step * math.prod(before) // math.prod(now)
        log(f"note: the checkpoint was trained with a global batch of {math.prod(before)} ({before[0]} process(es) "
            f"x -b {before[1]} x --accum-steps {before[2]}); this run's is {math.prod(now)} ({now[0]} x {now[1]} x "
            f"{now[2]}). It continues at the same epoch and learning-rate position, but not bitwise as an "
            "uninterrupted run would")
    return _same_on_every_rank(position)


def _same_on_every_rank(position):
    """Every rank read its start itself: a stale copy on one node's view of a shared filesystem, or a fallback
    to the checkpoint before, would start the ranks at different steps, and their collectives would never
    match (a hang). A collective compares them: any difference ends the run with one line."""
    if dist.is_initialized():
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
        here = torch.tensor([position.epoch, position.step], dtype=torch.float64, device=device)
        low, high = here.clone(), here.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            fail(f"the ranks read different checkpoints (epochs/steps from {low.int().tolist()} to "
                 f"{high.int().tolist()}): is --output-dir on a filesystem every node sees alike? Then resume again")
    return position


# --- where the run's files begin -------------------------------------------------------------------------------
def continue_run_at(args, start, position):
    """Rank 0, before training: the run's files made to begin at `position`. metrics.jsonl keeps the epochs
    before it (the line of an epoch in flight, or one cut short by a crash, goes: that epoch is done again).

    A rewind, a start from an older checkpoint of the run than its latest (--resume OUTPUT_DIR/best.pth, or the
    one before a damaged checkpoint.pth), keeps what it drops under names that say so (the later checkpoints and
    best.pth, the metrics lines of the later epochs) and says where in one line; and its start becomes the
    run's checkpoint.pth, so that a torchrun restart continues the rewound run, not the one it left."""
    out = args.output_dir
    metrics, latest = os.path.join(out, "metrics.jsonl"), os.path.join(out, "checkpoint.pth")
    kept, dropped, total = _split_metrics(metrics, position.epoch)
    # Resuming from another checkpoint of this run rewinds it, unless that one is checkpoint.pth's twin byte for
    # byte (best.pth of the last epoch): nothing came after it, nothing to keep.
    rewind = (start.path is not None and paths.inside(start.path, out) and not paths.inside(start.path, latest)
              and not (os.path.isfile(latest) and filecmp.cmp(start.path, latest, shallow=False)))
    saved = []
    if rewind:
        for name in ("checkpoint.pth", "checkpoint.prev.pth", "best.pth"):
            path = os.path.join(out, name)
            if os.path.isfile(path) and not paths.inside(start.path, path):
                copy = paths.beside(path, "rewound")
                os.link(path, copy)  # a second name: the run replaces the first, this one stays
                saved.append(os.path.basename(copy))
        if os.path.isfile(previous_path(latest)) and not paths.inside(start.path, previous_path(latest)):
            os.remove(previous_path(latest))  # later than the start, and kept above: no fallback to it
        os.link(start.path, latest + ".tmp")
        os.replace(latest + ".tmp", latest)
    if dropped and rewind:
        copy = paths.beside(metrics, "rewound")
        write_atomically(copy, "".join(dropped).encode())
        saved.append(f"{os.path.basename(copy)} ({len(dropped)} later epoch(s))")
    if len(kept) != total:
        write_atomically(metrics, "".join(kept).encode())
    if saved:
        hidden = ("; TensorBoard hides its later points" if os.path.isdir(os.path.join(out, "tensorboard")) else "")
        where = (f"epoch {position.epoch} after step {position.step}" if position.step else
                 f"the start of epoch {position.epoch}")
        log(f"note: resuming from {start.path} ({where}, counted from 0) rewinds this run; what came after it is "
            f"kept in {out}: {', '.join(saved)}{hidden}")


def _split_metrics(path, epoch):
    """metrics.jsonl's lines -> (those of the epochs before `epoch`, the complete ones after, how many lines). A
    line cut short by a crash belonged to the epoch being redone: in neither list."""
    kept, dropped, total = [], [], 0
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                total += 1
                try:
                    (kept if json.loads(line)["epoch"] < epoch else dropped).append(line)
                except (ValueError, KeyError, TypeError):
                    pass
    return kept, dropped, total
