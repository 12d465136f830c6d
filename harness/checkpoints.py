"""Checkpoints, around main.py's own torch.save and torch.load: which one a run starts from, a damaged or wrong one
said in one line instead of trusted, --weights, the checkpoint kept before the last, and a rewind's files.

    start = checkpoints.decide_start(args)        # --resume PATH|auto, a torchrun restart: Start(path, auto)
    checkpoint = checkpoints.checked(checkpoint, args, classes)   # what main.py loaded, made what it reads
    checkpoints.load_weights(model, args, classes)   # --weights: fine-tuning from a trained model
    @checkpoints.keeping_previous                    # around main.py's save: *.prev.pth kept, a full disk said
    checkpoints.ranks_compare_start(epoch, step)     # a collective: every rank read the same start
    checkpoints.rewrite_run_files_at(args, start, epoch, step)   # metrics from there; a rewind keeps what it drops
    model, classes = checkpoints.load_for_inference(path)   # predict.py: everything from the checkpoint

A checkpoint is the dict main.py's checkpoint_state() makes (weights_only: data, not code). Every reader first
checks the CRC-32 that torch.save writes for each record of its zip file and torch.load does not check (verify()):
a checkpoint damaged in a bad copy is refused, not trained from (BENCHMARKS.md: what that costs).
"""
import filecmp
import functools
import json
import math
import os
import zipfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import job, paths, stops
from dataset import CLASS_COLORS, CLASS_NAMES
from .errors import UserError, fail, first_line
from .job import RUN, log, named
from models import MODEL_NAMES, build_model

TRAINING_STATE = ("optimizer", "scaler", "epoch", "step", "best_miou")  # what resuming training needs
DEFAULT_MODEL, DEFAULT_OUTPUT_STRIDE = "deeplabv3plus_resnet101", 16  # main.py's, when no checkpoint says


@dataclass(frozen=True)
class Start:
    """Where a run starts. path: the checkpoint it continues or evaluates ('' for a fresh start); auto: the run
    looked for its own last checkpoint (--resume auto, or a torchrun restart), found or not."""
    path: str = ""
    auto: bool = False


# --- reading ------------------------------------------------------------------------------------------------------
def verify(flag, path):
    """The file at path is one a checkpoint can be read from, its bytes as torch.save wrote them: each record's
    CRC-32 (zipfile's testzip reads every record and compares). -> whether it was checked: a file written without
    them (torch's legacy format, or set_crc32_options(False)), or not a zip file at all, is left to torch.load."""
    if os.path.isdir(path):
        found = [name for name in ("best.pth", "checkpoint.pth") if os.path.isfile(os.path.join(path, name))]
        fail(f"{flag} {path} is a folder, not a checkpoint: give a checkpoint file"
             + (f", such as {os.path.join(path, found[0])}" if found else ""))
    if not os.path.isfile(path):
        fail(f"{flag} {path}: no such file")
    if not zipfile.is_zipfile(path):
        checksums = False
    else:
        try:
            with zipfile.ZipFile(path) as archive:
                records = archive.infolist()
                checksums = any(info.CRC for info in records)  # all 0: written without them
                damaged = archive.testzip() if checksums else None
        except Exception as error:  # zipfile's BadZipFile, an encrypted record's RuntimeError, a cut file's EOFError
            fail(f"{flag} {path} cannot be read ({first_line(error)}): it is truncated or damaged; copy it again, or "
                 "give another checkpoint")
        # One bit the CRC-32s do not cover changes what torch reads: a record's "folder" attribute (torch.save writes
        # none; torch's reader then takes the record for a folder and reads other bytes for its tensor).
        folder = next((info.filename for info in records if info.external_attr & 0x10), None)
        if damaged is not None or folder is not None:
            why = (f"its record {damaged} differs from the CRC-32 torch.save wrote for it" if damaged else
                   f"its record {folder} is marked as a folder, which torch.save never writes")
            fail(f"{flag} {path} is damaged: {why} (a bad copy or download?); copy it again, or give another "
                 "checkpoint")
    return checksums


def read(flag, path):
    """The checkpoint at path, given to `flag`, verified and loaded, as a dict with at least "model"; else one line
    that says what the file is instead. A bare state dict (torch.save(model.state_dict())) is taken as {"model":
    it}, and one saved from the DDP-wrapped model (every key "module.…") without that prefix. One without CRC-32s is
    read, and that is said once. A zip file's tensors are mapped, not read (mmap): what is checked of them is their
    shapes, and the bytes are read once, where they are used (main.py's own torch.load, a model's load_state_dict)."""
    checked = verify(flag, path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as error:
        # torch's own advice for what weights_only refuses (load it with weights_only=False) is not ours to give.
        if "Unsupported global" in str(error):  # a pickle of Python objects: code, not data
            fail(f"{flag} {path} holds Python objects beyond plain data, which torch.load(weights_only=True) refuses: "
                 "it is not a checkpoint main.py wrote")
        why = "not a PyTorch file" if "Weights only load failed" in str(error) else first_line(error)
        fail(f"{flag} {path} cannot be read ({type(error).__name__}: {why}): it is truncated, or not a PyTorch "
             "checkpoint")
    if not checked and path not in RUN.unchecked:  # said once each
        RUN.unchecked.add(path)
        log(f"note: {path} carries no CRC-32s (torch's legacy format, or saved with "
            "torch.serialization.set_crc32_options(False)): it is read without a check that it is whole")
    return normalized(checkpoint, flag, path)


def normalized(checkpoint, flag="--resume", path=""):
    """A checkpoint as main.py reads it: a dict with "model"; a bare state dict is {"model": it}, a DDP model's
    "module." keys lose the prefix. What holds no DeepLab weights is said in one line."""
    if isinstance(checkpoint, dict) and checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        checkpoint = {"model": checkpoint}
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict) or not checkpoint["model"]:
        fail(f"{flag} {path} holds no model weights (no 'model' state dict): it is not a checkpoint of main.py")
    weights = checkpoint["model"]
    if all(key.startswith("module.") for key in weights):  # torch.save(ddp_model.state_dict())
        checkpoint = {**checkpoint, "model": {key[len("module."):]: value for key, value in weights.items()}}
        weights = checkpoint["model"]
    if any(key.startswith(("classifier.0.convs.", "aux_classifier.")) for key in weights):
        fail(f"{flag} {path} holds torchvision's own DeepLab (torchvision.models.segmentation: keys such as "
             f"{next(k for k in weights if k.startswith(('classifier.0', 'aux_classifier')))}), not this project's, "
             "whose head is built and named otherwise: train this project's from an ImageNet backbone "
             "(--pretrained-backbone) instead")
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


def saved_args(checkpoint):
    return (checkpoint or {}).get("args") or {}


def _check_model_name(checkpoint, flag, path, model_name):
    saved = saved_args(checkpoint).get("model")
    if saved and saved != model_name:
        fail(f"{flag} {path} holds a {saved} model, but --model {model_name} was given: leave --model out (a "
             f"checkpoint's own is the default) or pass --model {saved}")


def _misfits(weights, model_name, num_classes, output_stride):
    """How weights differ from the model's own, built on the meta device (no memory, no time): [wrong shapes],
    missing keys, unexpected keys."""
    with torch.device("meta"):
        own = build_model(model_name, num_classes, output_stride).state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in weights.items()
             if k in own and v.shape != own[k].shape]
    return wrong, own.keys() - weights.keys(), weights.keys() - own.keys()


def fitting_model(weights):
    """The --model that weights fit (its classes counted from the classifier), or None."""
    classifier = weights.get("classifier.weight")
    if classifier is None:
        return None
    return next((name for name in MODEL_NAMES if not any(_misfits(weights, name, classifier.shape[0], 16))), None)


def check_fits(weights, flag, path, model_name, num_classes, output_stride):
    """Weights that must fit the model exactly; else one line that says how they differ, and which --model they
    fit when one does (weights alone do not say)."""
    wrong, missing, unexpected = _misfits(weights, model_name, num_classes, output_stride)
    if wrong or missing or unexpected:
        other = fitting_model(weights) if missing or unexpected else None
        fail(f"{flag} {path} does not fit {model_name}: {len(wrong)} tensors of another shape (e.g. {wrong[:1]}), "
             f"{len(missing)} missing, {len(unexpected)} unexpected"
             + (f"; it fits {other}: give --model {other}" if other and other != model_name else ""))


# --- the start ----------------------------------------------------------------------------------------------
def decide_start(args):
    """Which checkpoint this run starts from, decided here alone, and read (on every rank, before anything is
    written) so that a damaged or wrong one is said now:

    - torchrun restarted a training worker after a failure: the run's own last checkpoint, whatever the flags
      say; none yet: where the first attempt started (--resume PATH, or afresh);
    - --resume auto: OUTPUT_DIR/checkpoint.pth, or the one before it when that cannot be read; neither there: a
      fresh start. With --overwrite: a fresh start (run.sh passes --resume auto every time);
    - --resume PATH: that file (with -e: the model to evaluate, restarted or not)."""
    RUN.weights.clear()  # (a --weights read by an earlier run in this process: not this run's)
    restart = job.env().restarts > 0 and not args.evaluate
    explicit = args.resume not in ("", "auto")
    auto = restart or (args.resume == "auto" and not args.overwrite)
    path = checkpoint = None
    if auto:
        path, checkpoint = _find_in_run(args.output_dir, args.evaluate, say_none=not (restart and explicit))
    if path is None and explicit:
        path, checkpoint = args.resume, read("--resume", args.resume)
    if checkpoint is not None and not args.evaluate:
        _check_it_can_resume(checkpoint, path, args, auto)
    return Start(path or "", auto)


def _check_it_can_resume(checkpoint, path, args, auto):
    if args.start_epoch and not auto:
        fail(f"--start-epoch {args.start_epoch} with --resume: {path} says where to start (epoch "
             f"{checkpoint.get('epoch', '?')}); drop --start-epoch")
    missing = [key for key in TRAINING_STATE if key not in checkpoint]
    if missing:
        fits = saved_args(checkpoint).get("model") or fitting_model(checkpoint["model"])
        if fits is None:  # -e and --weights would refuse it too
            fail(f"--resume {path} holds no {', '.join(missing)}, and its weights fit no model of this project "
                 f"(--model {', '.join(MODEL_NAMES)}): give a checkpoint.pth that main.py wrote")
        model = "" if (args.model or DEFAULT_MODEL) == fits else f" --model {fits}"  # the model the advice builds
        fail(f"--resume {path} holds no {', '.join(missing)}: it has weights only ({fits}; evaluate it with "
             f"-e{model} --resume {path}, or fine-tune from it with{model} --weights {path}); to continue training, "
             "resume a checkpoint.pth that main.py wrote")


def _find_in_run(output_dir, evaluate, say_none=True):
    """--resume auto: output_dir/checkpoint.pth, else the one before it. A file there that cannot be read, with
    no usable one before it, stops the run: those files are evidence, not to be replaced."""
    problems = []
    for path in (job.checkpoint_path(output_dir), previous_path(job.checkpoint_path(output_dir))):
        if os.path.isfile(path):
            try:
                checkpoint = read("--resume auto:", path)
            except UserError as error:
                problems.append(str(error).removeprefix("--resume auto: "))
                continue
            if problems:
                log(f"warning: {problems[0]}; using the one before it, {path}")
            return path, checkpoint
    if problems:
        fail(f"--resume auto: {'; '.join(problems)}. Nothing usable to resume from, and these files are kept: "
             "move them aside to start afresh, or give --resume a good checkpoint")
    if evaluate:
        fail(f"-e: no checkpoint in {named('--output-dir')} {output_dir} to evaluate: train there first, "
             f"or give {'./run.sh -e' if named('--output-dir') == 'OUTPUT_DIR' else '-e'} --resume PATH")
    if say_none:
        log(f"no checkpoint in {output_dir}: starting afresh")
    return None, None


def checked(checkpoint, args, classes):
    """main.py's checkpoint (what its torch.load returned, or None) made what main.py reads, or one line that says
    why it cannot be: normalized(); its model and classes this run's, its weights fitting (decide_start checked
    that it can resume). Trained with another global batch, it continues at the step that has seen as many images.
    Says where the run goes on."""
    if checkpoint is None:
        return None
    path = args.resume
    if args.model not in MODEL_NAMES or args.output_stride not in (8, 16):
        fail(f"--resume {path} says its model is {args.model!r} at output stride {args.output_stride!r}, which this "
             f"version does not build: give --model (one of {', '.join(MODEL_NAMES)}) and --output-stride (8 or 16)")
    checkpoint = normalized(checkpoint, "--resume", path)
    _check_model_name(checkpoint, "--resume", path, args.model)
    theirs = classes_of(checkpoint)
    if theirs is not None and theirs != list(classes["names"]):
        fail(f"--resume {path} was trained for {len(theirs)} classes ({', '.join(theirs[:3])}, ...), but "
             f"{named('--data')} has {len(classes['names'])} others ({', '.join(classes['names'][:3])}, ...): "
             f"use the model on its own data, or fine-tune it on this data into a new output folder: --weights {path} "
             f"{'with another OUTPUT_DIR' if named('--data') == 'DATA' else '--output-dir NEW'}")
    check_fits(checkpoint["model"], "--resume", path, args.model, len(classes["names"]), args.output_stride)
    return checkpoint if args.evaluate else _continued(dict(checkpoint), args)


def _continued(checkpoint, args):
    """The position a checkpoint's run goes on from, said; in another global batch, the step rescaled."""
    path, epoch, step = args.resume, checkpoint["epoch"], checkpoint["step"]
    if epoch >= args.epochs:
        return checkpoint  # finished: main.py says there is nothing to train
    if args.start_epoch:  # --resume auto (run.sh, a restart): the checkpoint wins (decide_start refused a PATH's)
        log(f"note: --start-epoch {args.start_epoch} is ignored: {path} says where to continue")
    saved = saved_args(checkpoint)
    before = (checkpoint.get("world_size", 1), saved.get("batch_size", checkpoint.get("batch_size", 1)),
              saved.get("accum_steps", checkpoint.get("accum_steps", 1)))  # its global batch, in its layout
    now = (job.get_world_size(), args.batch_size, args.accum_steps)
    if math.prod(before) != job.global_batch(args):
        # Another global batch: another number of optimizer steps an epoch. Finish the epoch from the same number
        # of images seen. (The same global batch in another layout, -b x processes x --accum-steps, sees the same
        # images up to here: its steps are the same; only how they are split differs.)
        checkpoint["step"] = step = step * math.prod(before) // job.global_batch(args)
        log(f"note: the checkpoint was trained with a global batch of {math.prod(before)} ({before[0]} process(es) "
            f"x -b {before[1]} x --accum-steps {before[2]}); this run's is {job.global_batch(args)} ({now[0]} x "
            f"{now[1]} x {now[2]}). It continues at the same epoch and learning-rate position, but not bitwise as an "
            "uninterrupted run would")
    where = f"epoch {epoch} after step {step}" if step else f"the start of epoch {epoch}"
    best = checkpoint["best_miou"]
    log(f"resuming from {path} at {where} (epochs counted from 0), best mIoU "
        + (f"{best:.4f}" if math.isfinite(best) else "none yet"))
    if saved.get("epochs") and saved["epochs"] != args.epochs:  # the schedule's length changes: its learning rate jumps
        log(f"note: the run was scheduled over --epochs {saved['epochs']}, this one over {args.epochs}: the poly "
            f"learning rate goes on at the same step of the {args.epochs}-epoch schedule, "
            f"{'higher' if args.epochs > saved['epochs'] else 'lower'} than where the run stopped")
    return checkpoint


def ranks_compare_start(epoch, step):
    """A collective, on every rank. Every rank read its start itself: a stale copy on one node's view of a shared
    filesystem, or a fallback to the checkpoint before, would start the ranks at different steps, and their
    collectives would never match (a hang). Two all_reduces compare them: any difference ends the run with one
    line."""
    if dist.is_initialized():
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
        here = torch.tensor([epoch, step], dtype=torch.float64, device=device)
        low, high = here.clone(), here.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            fail(f"the ranks read different checkpoints (epochs/steps from {low.int().tolist()} to "
                 f"{high.int().tolist()}): is --output-dir on a filesystem every node sees alike? Then resume again")


# --- fine-tuning ------------------------------------------------------------------------------------------------
def weights_of(args):
    """--weights' checkpoint, read once (the preflight reads it first, for the model it holds)."""
    if args.weights not in RUN.weights:
        RUN.weights.clear()
        RUN.weights[args.weights] = read("--weights", args.weights)
    return RUN.weights[args.weights]


def load_weights(model, args, classes):
    """--weights: start from a trained model (fine-tuning), on a fresh start only (a run that continues from its
    checkpoint has newer weights; main.py loads them). A classifier trained for other classes (another number, or
    other names) is left as built, freshly initialised, and a line says so; the rest must fit."""
    if not args.weights:
        return
    if args.resume:  # a restart, a requeued job: the run's own checkpoint holds newer weights
        log(f"--weights {args.weights} not read: the run continues from its checkpoint {args.resume}")
        return
    path = args.weights
    checkpoint = weights_of(args)
    RUN.weights.clear()  # (read once, used once: not kept for the whole run)
    _check_model_name(checkpoint, "--weights", path, args.model)
    weights, own = dict(checkpoint["model"]), model.state_dict()
    theirs = classes_of(checkpoint)
    head = [key for key in ("classifier.weight", "classifier.bias") if key in weights and key in own]
    if any(weights[key].shape != own[key].shape for key in head) or theirs not in (None, list(classes["names"])):
        before = f"{len(theirs)} classes ({', '.join(theirs[:3])}, ...)" if theirs else "other classes"
        for key in head:
            weights[key] = own[key]
        log(f"--weights {path}: its classifier, trained for {before}, does not fit the {len(classes['names'])} "
            f"classes of {named('--data')} and starts afresh; every other layer starts from {path}")
    else:
        log(f"--weights {path}: every layer starts from it")
    check_fits(weights, "--weights", path, args.model, len(classes["names"]), args.output_stride)
    model.load_state_dict(weights)


# --- writing ----------------------------------------------------------------------------------------------
def previous_path(path):
    """checkpoint.pth -> checkpoint.prev.pth, in the same folder (the folder's own name is left alone)."""
    stem, extension = os.path.splitext(path)
    return stem + ".prev" + extension


def keeping_previous(save):
    """A decorator for main.py's save(state, path), which writes path + ".tmp" and renames it over path: the
    checkpoint it replaces stays as *.prev.pth (a fallback for --resume auto when the new one is damaged), the
    rename reaches the disk (the folder is synced), and a write that fails (a full disk) leaves the previous
    checkpoint as it was and no temporary file, and is told to the ranks' next vote (stops.write_failed), which
    ends every rank together, rank 0 saying why in one line."""
    @functools.wraps(save)
    def save_keeping_the_previous(state, path):
        # This epoch's other files failed: no checkpoint after them, the epoch is redone.
        if stops.pending_write_failure():
            return
        keep = f"{previous_path(path)}.{os.getpid()}.tmp"  # a second name for the old file, until the new is whole
        try:
            if os.path.isfile(path):
                os.link(path, keep)
            save(state, path)
            if os.path.exists(keep):
                os.replace(keep, previous_path(path))
            folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
            os.fsync(folder)  # the renames themselves survive a power cut
            os.close(folder)
        except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
            paths.note_free_space(error, path)
            for leftover in (keep, path + ".tmp"):
                if os.path.exists(leftover):
                    os.remove(leftover)
            stops.write_failed(_cannot_write(path, error))
    return save_keeping_the_previous


def _cannot_write(path, error):
    """The line for a checkpoint that could not be written: what, why, the space left, and what to do."""
    kept = os.path.isfile(path)
    # Without a checkpoint, what the epoch wrote before it (its metrics line, best.pth) is a run of its own that the
    # same command would refuse to replace: --overwrite puts it aside.
    again = "./run.sh --overwrite" if named("--output-dir") == "OUTPUT_DIR" else "the same command with --overwrite"
    then = (f"{path} is the last one written. Free space; then, to resume, {job.resume_advice()}" if kept else
            f"no checkpoint was kept. Free space, then start again: {again} (what this epoch wrote is put aside)")
    return f"cannot write {path} ({paths.why_not_written(error)}): {then}"


# --- predict.py -------------------------------------------------------------------------------------------------
def load_for_inference(path):
    """predict.py's model: everything from the checkpoint at path (--resume), read and checked as every reader does.
    The model's name and output stride from its args, the number of classes from the classifier, the classes'
    names and colours from "classes" when it has them (else Cityscapes'). -> (model in eval mode, classes)."""
    checkpoint = read("--resume", path)
    saved = saved_args(checkpoint)
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


# --- where the run's files begin -------------------------------------------------------------------------------
def rewrite_run_files_at(args, start, epoch, step):
    """Rank 0, before training: the run's files rewritten to begin at (epoch, step). metrics.jsonl keeps the epochs
    before it (the line of an epoch in flight, or one cut short by a crash, goes: that epoch is done again).

    A rewind, a start from an older checkpoint of the run than its latest (--resume OUTPUT_DIR/best.pth, or the
    one before a damaged checkpoint.pth), keeps what it drops under names that say so (the later checkpoints and
    best.pth, the metrics lines of the later epochs) and says where in one line; and its start becomes the
    run's checkpoint.pth, so that a torchrun restart continues the rewound run, not the one it left."""
    out = args.output_dir
    metrics, latest = os.path.join(out, "metrics.jsonl"), job.checkpoint_path(out)
    kept, dropped, total = _split_metrics(metrics, epoch)
    # Resuming from another checkpoint of this run rewinds it, unless that one is checkpoint.pth's twin byte for
    # byte (best.pth of the last epoch): nothing came after it, nothing to keep.
    rewind = (bool(start.path) and paths.inside(start.path, out) and not paths.inside(start.path, latest)
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
        paths.write_atomically(copy, "".join(dropped).encode())
        saved.append(f"{os.path.basename(copy)} ({len(dropped)} later epoch(s))")
    if len(kept) != total:
        paths.write_atomically(metrics, "".join(kept).encode())
    if saved:
        hidden = ("; TensorBoard hides its later points" if os.path.isdir(os.path.join(out, "tensorboard")) else "")
        where = f"epoch {epoch} after step {step}" if step else f"the start of epoch {epoch}"
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
