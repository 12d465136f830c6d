"""Checkpoints: which one a run starts from, decided in one place; reading them (or saying in one line why one
cannot be used); the model they give; writing them so that a crash never leaves half of one.

    start = checkpoints.decide_start(args)          # --resume PATH|auto, a torchrun restart, or a fresh start
    model = checkpoints.start_model(args, classes, start)   # its weights, or --weights, or the pretrained backbone
    position = checkpoints.resume_training(start, optimizer, scaler, args, world_size)
    checkpoints.continue_run_at(args, start, position)   # metrics from there; a rewind keeps what it drops
    checkpoints.save(state, path, keep_previous=True)   # temporary file, fsync, rename

A checkpoint is a dict (weights_only: data, not code): model, optimizer, scaler (GradScaler), epoch and step
(the position: the next step to run), epoch_loss_sum, best_miou, args (vars), world_size, batch_size, classes.
"""
import json
import os
import shutil
from types import SimpleNamespace

import torch
import torch.distributed as dist

import paths
from dataset import CLASS_NAMES
from models import build_model
from paths import fail, first_line
from recovery import log

TRAINING_STATE = ("optimizer", "scaler", "epoch", "world_size", "batch_size")  # what resuming training needs


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


def save(state, path, keep_previous=False):
    """Written atomically. keep_previous: the checkpoint it replaces stays as *.prev.pth, a fallback. A write
    that fails (a full disk) leaves the previous checkpoint as it was and ends the run in one line."""
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
        kept = f"{path} is the last one written" if os.path.isfile(path) else "no checkpoint was kept"
        fail(f"cannot write {path} ({getattr(error, 'strerror', None) or first_line(error)}; "
             f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB free there): {kept}. Free space; then, to resume, "
             f"{paths.resume_advice()}")


# --- reading ----------------------------------------------------------------------------------------------
def read(flag, path):
    """The checkpoint at path, given to `flag`, as a dict with at least "model"; else one line that says what the
    file is instead. A bare state dict (torch.save(model.state_dict())) is taken as {"model": it}, and one saved
    from the DDP-wrapped model (every key "module.…") without that prefix."""
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
        fail(f"{flag} {path} cannot be read ({first_line(error)}): it is truncated, or not a PyTorch checkpoint")
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
                 f"not of this project's DeepLab: an ImageNet backbone goes to --pretrained-backbone {path}")
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
        fail(f"{flag} {path} holds a {saved} model, but this run builds {model_name}: pass --model {saved}")


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


# --- the start ----------------------------------------------------------------------------------------------
def decide_start(args):
    """Which run this is, decided here alone (no module rewrites --resume):

    - torchrun restarted a training worker after a failure: the run's own last checkpoint, whatever the flags
      say; none yet: where the first attempt started (--resume PATH, or afresh);
    - --resume auto: OUTPUT_DIR/checkpoint.pth, or the one before it when that cannot be read; neither there: a
      fresh start. With --overwrite: a fresh start (run.sh passes --resume auto every time);
    - --resume PATH: that file (with -e: the model to evaluate, restarted or not).

    -> namespace(path, checkpoint): the checkpoint read (all ranks read it, before anything is written), or
    None for a fresh start; auto: whether it is the run's own (--resume auto or a restart)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 and not args.evaluate
    explicit = args.resume not in ("", "auto")
    auto = restart or (args.resume == "auto" and not args.overwrite)
    checkpoint = path = None
    if auto:
        checkpoint, path = _find_in_run(args.output_dir, args.evaluate, say_none=not (restart and explicit))
    if checkpoint is None and explicit:
        checkpoint, path = read("--resume", args.resume), args.resume
    start = SimpleNamespace(path=path, checkpoint=checkpoint, auto=auto)
    if checkpoint is not None and not args.evaluate:
        _check_it_can_resume(start, args)
    return start


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
    elif args.weights:
        load_weights(model, args.weights, args.model, classes)
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


def load_weights(model, path, model_name, classes):
    """--weights: start from a trained model (fine-tuning). A classifier trained for other classes (another
    number, or other names) is left as built, freshly initialised, and a line says so; the rest must fit."""
    checkpoint = read("--weights", path)
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
    if args.start_epoch:  # --resume auto (run.sh, a restart): the checkpoint wins, and that is said
        log(f"note: --start-epoch {args.start_epoch} is ignored: {start.path} says where to continue")
    where = f"epoch {checkpoint['epoch']}" + (f" step {checkpoint['step']}" if checkpoint.get("step") else "")
    log(f"resuming from {start.path} at {where}, best mIoU {checkpoint.get('best_miou', float('nan')):.4f}")
    optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint["scaler"] and scaler.is_enabled():  # empty when saved without --amp fp16
        scaler.load_state_dict(checkpoint["scaler"])
    for key in ("epoch", "step", "best_miou", "epoch_loss_sum"):
        setattr(position, key, checkpoint.get(key, getattr(position, key)))
    before = (checkpoint["world_size"], checkpoint["batch_size"])
    if before != (world_size, args.batch_size):
        # Another order of images: finish the epoch from the same number of images seen.
        position.step = position.step * before[0] * before[1] // (world_size * args.batch_size)
        log(f"note: the checkpoint was trained with {before[0]} process(es) x {before[1]} images; this run has "
            f"{world_size} x {args.batch_size}. It continues at the same epoch and learning-rate position, but "
            "not bitwise as an uninterrupted run would")
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
    rewind = start.path is not None and paths.inside(start.path, out) and not paths.inside(start.path, latest)
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
        log(f"note: resuming from {start.path} (epoch {position.epoch}) rewinds this run; what came after it is kept "
            f"in {out}: {', '.join(saved)}{hidden}")


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
