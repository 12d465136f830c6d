"""Checkpoints, around main.py's own torch.save and torch.load: which one a run starts from, a damaged or wrong one
said in one line instead of trusted, --weights, the checkpoint kept before the last, and a rewind's files.

    start = checkpoints.decide_start(args)        # --resume PATH|auto, a torchrun restart: Start(path, auto)
    checkpoint = checkpoints.checked(checkpoint, args, train_set, val_set)  # what main.py loaded, made what it reads
    checkpoints.load_weights(model, args, classes)   # --weights: fine-tuning from a trained model
    @checkpoints.keeping_previous                    # around main.py's save: *.prev.pth kept, a full disk said
    checkpoints.ranks_compare_start(epoch, step)     # a collective: every rank read the same start
    checkpoints.rewrite_run_files_at(args, start, epoch, step)   # metrics from there; a rewind keeps what it drops
    model, classes = checkpoints.load_for_inference(path)   # predict.py: everything from the checkpoint

A checkpoint is the dict main.py's checkpoint_state() makes (weights_only: data, not code). Every reader first
checks the CRC-32 that torch.save writes for each record of its zip file and torch.load does not check (verify()):
a checkpoint damaged in a bad copy is refused, not trained from (BENCHMARKS.md: what that costs). Then what it
holds is checked before any of it is used:

- read(): its format number, and the few plain fields a reader reads before it builds a model;
- check_fits: the weights against the model;
- for training, its position, and _check_restore: its optimizer's and scaler's state loaded into SGD and a
  GradScaler over the model on the meta device. torch's own error is said in one line with the file.

The harness's saves add this version's format number ("format", stamped()).
"""
import filecmp
import functools
import hashlib
import json
import math
import os
import pickle
import zipfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import job, paths, stops
from dataset import CLASS_COLORS, CLASS_NAMES, default_colors
from .errors import UserError, fail, first_line
from .job import RUN, log, named
from models import MODEL_NAMES, build_model

TRAINING_STATE = ("optimizer", "scaler", "epoch", "step", "best_miou")  # what resuming training needs
DEFAULT_MODEL = "deeplabv3plus_resnet101"  # main.py's, when no checkpoint says
# The layout of what main.py's checkpoint_state() holds, written into every checkpoint as "format" (stamped()):
# raised whenever that layout changes, so that a version reading a checkpoint of a newer one says so. A checkpoint
# without it was written before checkpoints carried it (or by the lesson alone): read as format 1 when it fits.
FORMAT = 1


@dataclass(frozen=True)
class Start:
    """Where a run starts. path: the checkpoint it continues or evaluates ('' for a fresh start); auto: the run
    looked for its own last checkpoint (--resume auto, or a torchrun restart), found or not."""
    path: str = ""
    auto: bool = False
    model_given: bool = False  # --model was typed (else the model is the checkpoint's, or the default): said in lines
    afresh: bool = False       # --output-dir holds what a first epoch stopped before its checkpoint wrote: moved aside
    saved: dict = field(default_factory=dict, compare=False)  # the flags the checkpoint's run was given (its "args")


def stamped(state):
    """A checkpoint about to be written, with this version's format number (the harness's saves call it), and what
    identifies its training list (training_list): a mid-epoch resume on another list is then told (_continued)."""
    return {**state, "format": FORMAT, **({"train_list": RUN.train_list} if RUN.train_list else {})}


def training_list(train_set, root):
    """{"images": how many, "fingerprint": a hash of their paths below root, or None} of a training set: a data set
    with a list of its images' paths (.images, as dataset.py's have) gets a fingerprint, any other its count alone.
    Paths below --data: the same data set mounted elsewhere (another node, a copy) is the same list."""
    names = getattr(train_set, "images", None)
    listed = "\n".join(os.path.relpath(name, root) for name in names) if isinstance(names, (list, tuple)) else None
    return {"images": len(train_set), "fingerprint": listed and hashlib.sha1(listed.encode()).hexdigest()[:16]}


# --- reading ------------------------------------------------------------------------------------------------------
def verify(flag, path):
    """The file at path is one a checkpoint can be read from, its bytes as torch.save wrote them: each record's
    CRC-32 (zipfile's testzip reads every record and compares). -> whether it was checked: a file written without
    them (torch's legacy format, or set_crc32_options(False)), or not a zip file at all, is left to torch.load."""
    if not os.path.isfile(path):
        found = paths.kind(path)  # a folder, a named pipe, a socket, a device, a link to nothing: named as what it is
        inside = [name for name in (f"{path}/best.pth", f"{path}/checkpoint.pth") if os.path.isfile(name)]
        fail(f"{flag} {path}: no such file" if found is None else
             f"{flag} {path} is {found}, not a checkpoint: give a checkpoint file"
             + (f", such as {inside[0]}" if inside else ""))
    paths.check_readable(flag, path)  # (zipfile.is_zipfile would take a file it may not open for no zip file)
    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
            checksums = any(info.CRC for info in entries)  # all 0: written without them
            damaged = archive.testzip() if checksums else None
    except Exception as error:  # zipfile's BadZipFile, an encrypted record's RuntimeError, a cut file's EOFError
        fail(f"{flag} {path} cannot be read ({first_line(error)}): it is truncated or damaged; copy it again, or "
             "give another checkpoint")
    # One bit the CRC-32s do not cover changes what torch reads: a record's "folder" attribute (torch.save writes
    # none; torch's reader then takes the record for a folder and reads other bytes for its tensor).
    folder = next((info.filename for info in entries if info.external_attr & 0x10), None)
    if damaged or folder:
        why = ("differs from the CRC-32 torch.save wrote for it" if damaged else
               "is marked as a folder, which torch.save never writes")
        fail(f"{flag} {path} is damaged: its record {damaged or folder} {why} (a bad copy or download?); copy it "
             "again, or give another checkpoint")
    return checksums


def read(flag, path):
    """The checkpoint at path, given to `flag`, verified and loaded, as a dict with at least "model"; else one line
    that says what the file is instead. A bare state dict (torch.save(model.state_dict())) is taken as {"model":
    it}, and one saved from the DDP-wrapped model (every key "module.…") without that prefix. One without CRC-32s is
    read, and that is said once. A zip file's tensors are mapped, not read (mmap): what is checked of them is their
    shapes, and the bytes are read once, where they are used (main.py's own torch.load, a model's load_state_dict)."""
    seen = _identity(path)  # before any check: a file changed from here on is not the one checked (checked())
    checked = verify(flag, path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as error:
        # torch's own advice for what weights_only refuses (load it with weights_only=False) is not ours to give.
        # Objects, code: refused, not damaged (the pickle passed its CRC-32, where it has one): torch names the
        # GLOBAL it refuses, a class or a function.
        if isinstance(error, pickle.UnpicklingError) and "GLOBAL " in str(error):
            fail(f"{flag} {path} holds Python objects beyond plain data, which torch.load(weights_only=True) refuses: "
                 "not loaded; it is not a checkpoint main.py wrote")
        why = "not a PyTorch file" if "Weights only load failed" in str(error) else first_line(error)
        fail(f"{flag} {path} cannot be read ({type(error).__name__}: {why}): it is truncated, or not a PyTorch "
             "checkpoint")
    if not checked and path not in RUN.unchecked:  # said once each
        RUN.unchecked.add(path)
        log(f"note: {path} carries no CRC-32s (torch's legacy format, or saved with "
            "torch.serialization.set_crc32_options(False)): it is read without a check that it is whole")
    checkpoint = normalized(checkpoint, flag, path)
    _check_contents(checkpoint, flag, path)
    RUN.verified[os.path.abspath(path)] = seen
    return checkpoint


def _identity(path):
    """What tells a file from any other, or from itself rewritten: its device, inode, size, last write, its count of
    names and last change (ctime, which no one can set back: a copy over it that keeps its size and times changes
    it); None where nothing opens. Read from the file opened: the open makes a network filesystem check its
    attributes with the server (NFS's close-to-open), where a stat of the name may answer from its cache.
    O_NONBLOCK: a named pipe would wait for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_nlink, info.st_ctime_ns


def _changed_since_read(path):
    """Whether the file read() checked at path is gone or changed since. A new name for it or one taken away (a
    rewind's second name, made by rank 0 while another rank reads) changes its count of names and its ctime alone:
    unchanged."""
    before, now = RUN.verified.get(os.path.abspath(path)), _identity(path)
    return before is not None and (now is None or before[:4] != now[:4] or now[4] == before[4] and now[5] != before[5])


def normalized(checkpoint, flag="--resume", path=""):
    """A checkpoint as main.py reads it: a dict with "model"; a bare state dict is {"model": it}, a DDP model's
    "module." keys lose the prefix. What holds no DeepLab weights is said in one line."""
    if isinstance(checkpoint, dict) and "model" not in checkpoint:  # torch.save(model.state_dict())
        checkpoint = {"model": checkpoint}
    weights = checkpoint.get("model") if isinstance(checkpoint, dict) else None
    if not (isinstance(weights, dict) and weights and all(isinstance(v, torch.Tensor) for v in weights.values())):
        fail(f"{flag} {path} holds no model weights (no 'model' state dict of tensors): it is not a checkpoint of "
             "main.py")
    if all(key.startswith("module.") for key in weights):  # torch.save(ddp_model.state_dict())
        weights = {key[len("module."):]: value for key, value in weights.items()}
        checkpoint = {**checkpoint, "model": weights}
    vision = [key for key in weights if key.startswith(("classifier.0.convs.", "aux_classifier."))]
    if vision:
        fail(f"{flag} {path} holds torchvision's own DeepLab (torchvision.models.segmentation: keys such as "
             f"{vision[0]}), not this project's, whose head is built and named otherwise: train this project's from "
             "an ImageNet backbone (--pretrained-backbone) instead")
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


# --- what a checkpoint holds ------------------------------------------------------------------------------------
# Checked before any of it is used: a checkpoint of another version (or changed by hand) that passes its CRC-32s
# would otherwise end in a traceback, some of them after training has begun.
def _whole(value, low=0):
    """A whole number of at least low. (A bool is an int to Python, not to a checkpoint.)"""
    return type(value) is int and value >= low


def _writer(checkpoint):
    """Which version wrote a checkpoint, as far as it says."""
    number = checkpoint.get("format")
    if number is None:
        return "it carries no format number: an earlier version of main.py wrote it, or another program"
    if number == FORMAT:
        return f"it says format {FORMAT}, this version's: was it changed after it was written?"
    return f"format {number}, an earlier version's"


def _check_contents(checkpoint, flag, path):
    """What every reader takes from a checkpoint before it builds a model (read() calls it): its format (a newer
    version's is refused, as what it holds may mean something else), its flags a dict, the model and output stride
    they name ones this version builds, a name for each class. Else one line naming each misfit and the version
    that wrote it. The weights and the training state are tried where they are loaded (check_fits, _check_restore,
    load_for_inference)."""
    number = checkpoint.get("format", FORMAT)
    if _whole(number, FORMAT + 1):
        fail(f"{flag} {path} was written by a newer version of this program (checkpoint format {number}; this one "
             f"reads up to {FORMAT}): use that version, or update this one")
    saved, names = checkpoint.get("args", {}), checkpoint.get("classes", {"names": ["?"]})
    names = names.get("names") if isinstance(names, dict) else None
    flags = saved if isinstance(saved, dict) else {}
    model, stride = flags.get("model", DEFAULT_MODEL), flags.get("output_stride", 16)
    problems = [words for wrong, words in (
        (not _whole(number, 1), f"its format number is {number!r}, which no version of main.py writes"),
        (flags is not saved, f"its args are a {type(saved).__name__}, not a dict of flags"),
        (model not in MODEL_NAMES, f"its model is {model!r}, which this version does not build (it builds "
                                   f"{', '.join(MODEL_NAMES)})"),
        (stride not in (8, 16), f"its output stride is {stride!r}, not 8 or 16"),
        (not (isinstance(names, list) and names and all(isinstance(name, str) and name for name in names)),
         "its classes are not {'names': [...], 'colors': [...]} with a name for each class")) if wrong]
    if problems:
        fail(f"{flag} {path} is not a checkpoint this version of main.py reads: {'; '.join(problems)} "
             f"({_writer(checkpoint)}): use the version that wrote it, or give another checkpoint")


def _training_misfits(checkpoint):
    """What main.py's train() and _continued read of a checkpoint's position and global batch (TRAINING_STATE
    present), each of the type and range this version writes. -> [what does not fit]."""
    names = ("epoch", "step", "world_size", "batch_size", "accum_steps", "epochs")
    values = [checkpoint["epoch"], checkpoint["step"], *_layout(checkpoint), saved_args(checkpoint).get("epochs", 1)]
    problems = [f"its {name} is {value!r}, not a whole number of at least {low}" for name, value, low in
                zip(names, values, (0, 0, 1, 1, 1, 1)) if not _whole(value, low)]
    best, loss = checkpoint["best_miou"], checkpoint.get("epoch_loss_sum", 0.0)
    if not (type(best) in (int, float) and (best == -math.inf or 0 <= best <= 1)):
        problems.append(f"its best_miou is {best!r}, neither an mIoU from 0 to 1 nor -inf (none yet)")
    if not (type(loss) in (int, float) and 0 <= loss < math.inf):
        problems.append(f"its epoch_loss_sum is {loss!r}, not a loss of at least 0")
    if "epoch_loss_sum" not in checkpoint and checkpoint["step"] != 0:  # at an epoch's start the sum is 0
        problems.append(f"it holds no epoch_loss_sum, the loss of the steps of its epoch done (step "
                        f"{checkpoint['step']!r})")
    return problems


def _layout(checkpoint):
    """The global batch a checkpoint was trained with: [processes, -b, --accum-steps], 1 where it does not say (the
    layout before 2026-11-30 kept -b beside its args too)."""
    saved = saved_args(checkpoint)
    return [saved.get(key, checkpoint.get(key, 1)) for key in ("world_size", "batch_size", "accum_steps")]


def _on_meta(model_name, num_classes, output_stride):
    """The model built on the meta device: its parameters' shapes, no memory, no time."""
    with torch.device("meta"):
        return build_model(model_name, num_classes, output_stride)


def _check_restore(checkpoint, path, model):
    """main.py's restore(), tried first where it costs nothing: the optimizer's state loaded into SGD's two groups
    (make_optimizer's: the backbone's, then the rest) over model (_on_meta's), and one step taken there (a momentum
    buffer of another shape fails it); the scaler's into a GradScaler. torch's own error, or another optimizer's
    state beside SGD's momentum, refuses the checkpoint in one line."""
    backbone = list(model.backbone.parameters())
    head = [p for p in model.parameters() if id(p) not in {id(q) for q in backbone}]
    optimizer = torch.optim.SGD([{"params": backbone}, {"params": head}])
    try:
        optimizer.load_state_dict(checkpoint["optimizer"])
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
        other = {key for state in optimizer.state.values() for key in state} - {"momentum_buffer"}
        if other:
            raise ValueError(f"another optimizer's state: it holds {', '.join(sorted(other))}")
        if checkpoint["scaler"]:  # empty when saved without --amp fp16, and not loaded (restore())
            torch.amp.GradScaler("cpu").load_state_dict(checkpoint["scaler"])
    except Exception as error:  # whatever restore() would meet: this dry run touches no data and no device
        _refuse_training(checkpoint, path, [f"its optimizer or scaler does not load into main.py's SGD and "
                                            f"GradScaler ({_said(error)})"])


def _said(error):
    """torch's own error in one line, cut at 300 characters (load_state_dict's lists every key it missed)."""
    words = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return words if len(words) <= 300 else words[:297] + "..."


def _refuse_training(checkpoint, path, problems):
    """The line for a checkpoint whose weights may serve but whose training state cannot go on here."""
    again = "with another OUTPUT_DIR" if named("--output-dir") == "OUTPUT_DIR" else "--output-dir NEW"
    fail(f"--resume {path} cannot resume training in this version of main.py: {'; '.join(problems)} "
         f"({_writer(checkpoint)}). Its weights still serve -e --resume {path}, and fine-tuning into a new run: "
         f"--weights {path} {again}")


def _chosen(model_name, checkpoint):
    """Where the model a line names came from: --model as typed, the checkpoint's own args, or main.py's default."""
    if getattr(RUN.start, "model_given", False):
        return f"--model {model_name}"
    if saved_args(checkpoint).get("model") == model_name:
        return f"{model_name}, the model it names"
    return f"{model_name}, the default model (no --model given, and it names none)"


def _check_model_name(checkpoint, flag, path, model_name):
    saved = saved_args(checkpoint).get("model")
    if saved and saved != model_name:
        chosen = _chosen(model_name, checkpoint)
        given = f"{chosen} was given" if chosen.startswith("--model") else f"this run builds {chosen}"
        fail(f"{flag} {path} holds a {saved} model, but {given}: leave --model out (a checkpoint's own is the "
             f"default) or pass --model {saved}")


def _misfits(weights, model):
    """How weights differ from model's own (_on_meta's): [wrong shapes], missing keys, unexpected keys."""
    own = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in weights.items()
             if k in own and v.shape != own[k].shape]
    return wrong, own.keys() - weights.keys(), weights.keys() - own.keys()


def fitting_model(weights):
    """The --model that weights fit (its classes counted from the classifier), or None."""
    classifier = weights.get("classifier.weight")
    if classifier is None:
        return None
    return next((name for name in MODEL_NAMES if not any(_misfits(weights, _on_meta(name, len(classifier), 16)))),
                None)


def check_fits(weights, flag, path, model_name, num_classes, output_stride, checkpoint=None):
    """Weights that must fit the model exactly; else one line that says how they differ, where the model's name came
    from (checkpoint: the one that holds the weights), and which --model they fit when one does (weights alone do
    not say). -> the model, on the meta device."""
    model = _on_meta(model_name, num_classes, output_stride)
    wrong, missing, unexpected = _misfits(weights, model)
    if wrong or missing or unexpected:
        other = fitting_model(weights) if missing or unexpected else None
        fail(f"{flag} {path} does not fit {_chosen(model_name, checkpoint)}: {len(wrong)} tensors of another shape "
             f"(e.g. {wrong[:1]}), {len(missing)} missing, {len(unexpected)} unexpected"
             + (f"; it fits {other}: give --model {other}" if other and other != model_name else ""))
    return model


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
    return Start(path or "", auto, model_given=args.model is not None,  # (before args are completed)
                 saved=dict(saved_args(checkpoint)))


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
    problems = _training_misfits(checkpoint)
    if problems:
        _refuse_training(checkpoint, path, problems)


def _find_in_run(output_dir, evaluate, say_none=True):
    """--resume auto: output_dir/checkpoint.pth, else the one before it. A file there that cannot be read, with
    no usable one before it, stops the run: those files are evidence, not to be replaced."""
    problems = []
    for path in (job.checkpoint_path(output_dir), previous_path(job.checkpoint_path(output_dir))):
        if os.path.isfile(path):
            try:
                checkpoint = read("--resume auto:", path)
            except paths.Unreadable:
                raise  # a file this user may not read is not damaged: said as such, not rewound past
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


def checked(checkpoint, args, train_set, val_set):
    """main.py's checkpoint (what its torch.load returned, or None) made what main.py reads, or one line that says
    why it cannot be: the file read() checked, normalized(); its model and classes this data's, its weights fitting,
    and for training its optimizer and scaler loading (_check_restore; decide_start checked its position). Trained
    with another global batch, it continues at the step that has seen as many images. Says where the run goes on."""
    if train_set is not None:  # (-e opens the val set alone)
        RUN.train_list = training_list(train_set, args.data)  # written into every checkpoint of this run (stamped)
    if checkpoint is None:
        return None
    path, names = args.resume, list(val_set.classes["names"])
    if _changed_since_read(path):  # main.py read it again after the preflight checked it (read())
        fail(f"--resume {path} changed after this run checked it (replaced, or written to, as the run started): run "
             "again once nothing writes it")
    checkpoint = normalized(checkpoint, "--resume", path)
    _check_model_name(checkpoint, "--resume", path, args.model)
    theirs = classes_of(checkpoint)
    if theirs not in (None, names):
        fail(f"--resume {path} was trained for {len(theirs)} classes ({', '.join(theirs[:3])}, ...), but "
             f"{named('--data')} has {len(names)} others ({', '.join(names[:3])}, ...): use the model on its own "
             f"data, or fine-tune it on this data into a new output folder: --weights {path} "
             f"{'with another OUTPUT_DIR' if named('--data') == 'DATA' else '--output-dir NEW'}")
    model = check_fits(checkpoint["model"], "--resume", path, args.model, len(names), args.output_stride, checkpoint)
    if args.evaluate:
        return checkpoint
    _check_restore(checkpoint, path, model)
    return _continued(dict(checkpoint), args, len(train_set))


def _continued(checkpoint, args, images):
    """The position a checkpoint's run goes on from, said; in another global batch, the step rescaled. A position
    past the end of its epoch (the epoch has fewer steps now: fewer training images, or a larger global batch), or
    part-way through an epoch of another training list (the rest of its shuffle would show some images twice and
    others never), is that epoch's end: its training is done, and main.py evaluates and saves it before the next.
    images: the training set's."""
    checkpoint.setdefault("epoch_loss_sum", 0.0)  # at an epoch's start (_training_misfits refused one part-way)
    path, epoch, step = args.resume, checkpoint["epoch"], checkpoint["step"]
    if epoch >= args.epochs:
        return checkpoint  # finished: main.py says there is nothing to train
    if args.start_epoch:  # --resume auto (run.sh, a restart): the checkpoint wins (decide_start refused a PATH's)
        log(f"note: --start-epoch {args.start_epoch} is ignored: {path} says where to continue")
    saved, before, batch = saved_args(checkpoint), _layout(checkpoint), job.global_batch(args)
    if math.prod(before) != batch:
        # Another global batch: another number of optimizer steps an epoch. Finish the epoch from the same number
        # of images seen. (The same global batch in another layout, -b x processes x --accum-steps, sees the same
        # images up to here: its steps are the same; only how they are split differs.)
        checkpoint["step"] = step = step * math.prod(before) // batch
        log(f"note: the checkpoint was trained with a global batch of {math.prod(before)} ({before[0]} process(es) "
            f"x -b {before[1]} x --accum-steps {before[2]}); this run's is {batch} ({job.get_world_size()} x "
            f"{args.batch_size} x {args.accum_steps}). It continues at the same epoch and learning-rate position, "
            "but not bitwise as an uninterrupted run would")
    steps_per_epoch, then = images // batch, checkpoint.get("train_list")
    if 0 < steps_per_epoch <= step:  # (0: a global batch larger than the data, which the preflight says next)
        log(f"note: {path} is at step {step} of epoch {epoch}, and an epoch has {steps_per_epoch} steps now ("
            f"{images} training images, a global batch of {batch}): epoch {epoch}'s training is done; it is "
            "evaluated and saved, and the run goes on with the next")
        checkpoint["step"] = step = steps_per_epoch
    elif 0 < step < steps_per_epoch and isinstance(then, dict) and then != RUN.train_list:
        other = (f"{then.get('images')} images then, {images} now" if then.get("images") != images else
                 f"{images} images then and now, not the same ones")
        log(f"note: {path} was saved part-way through epoch {epoch} on another training list ({other}): epoch "
            f"{epoch}'s training ends at its step {step} (the rest of its shuffle is of the old list); it is "
            f"evaluated and saved, and epoch {epoch + 1} draws from this list")
        checkpoint["step"] = step = steps_per_epoch
    where = f"epoch {epoch} after step {step}" if step else f"the start of epoch {epoch}"
    best = checkpoint["best_miou"]
    log(f"resuming from {path} at {where} (epochs counted from 0), best mIoU "
        + (f"{best:.4f}" if math.isfinite(best) else "none yet"))
    then, now = _base_lr(saved, math.prod(before)), _base_lr(vars(args), batch)
    if isinstance(then, (int, float)) and not math.isclose(then, now):  # --lr, or --base-batch's scaling, changed
        log(f"note: the learning rate's base is {now:g} now, {then:g} before (--lr {args.lr:g}"
            + (f" x {batch}/{args.base_batch}" if args.base_batch else "") + "): the poly schedule goes on from "
            "this one")
    if saved.get("epochs", args.epochs) != args.epochs:  # the schedule's length changes: its learning rate jumps
        log(f"note: the run was scheduled over --epochs {saved['epochs']}, this one over {args.epochs}: the poly "
            f"learning rate goes on at the same step of the {args.epochs}-epoch schedule, "
            f"{'higher' if args.epochs > saved['epochs'] else 'lower'} than where the run stopped")
    return checkpoint


def _base_lr(flags, global_batch):
    """main.py's scaled_lr from a run's flags: --lr, scaled by global batch / --base-batch where it is given."""
    lr, base = flags.get("lr"), flags.get("base_batch")
    return lr * global_batch / base if isinstance(lr, (int, float)) and base else lr


def ranks_compare_start(epoch, step):
    """A collective, on every rank. Every rank read its start itself: a stale copy on one node's view of a shared
    filesystem, or a fallback to the checkpoint before, would start the ranks at different steps, and their
    collectives would never match (a hang). Two all_reduces compare them: any difference ends the run with one
    line."""
    if dist.is_initialized():
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
        low = torch.tensor([epoch, step], dtype=torch.float64, device=device)
        high = low.clone()
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
    path, names = args.weights, list(classes["names"])
    checkpoint = weights_of(args)
    RUN.weights.clear()  # (read once, used once: not kept for the whole run)
    _check_model_name(checkpoint, "--weights", path, args.model)
    weights, own = dict(checkpoint["model"]), model.state_dict()
    theirs = classes_of(checkpoint)
    head = [key for key in ("classifier.weight", "classifier.bias") if key in weights]  # (every model has both)
    if any(weights[key].shape != own[key].shape for key in head) or theirs not in (None, names):
        before = f"{len(theirs)} classes ({', '.join(theirs[:3])}, ...)" if theirs else "other classes"
        weights.update({key: own[key] for key in head})
        log(f"--weights {path}: its classifier, trained for {before}, does not fit the {len(names)} classes of "
            f"{named('--data')} and starts afresh; every other layer starts from {path}")
    else:
        log(f"--weights {path}: every layer starts from it")
    check_fits(weights, "--weights", path, args.model, len(names), args.output_stride, checkpoint)
    model.load_state_dict(weights)


# --- writing ----------------------------------------------------------------------------------------------
def previous_path(path):
    """checkpoint.pth -> checkpoint.prev.pth, in the same folder (the folder's own name is left alone)."""
    stem, extension = os.path.splitext(path)
    return stem + ".prev" + extension


def keeping_previous(save):
    """A decorator for main.py's save(state, path), which writes a temporary file of its own beside path, renames it
    over path, and removes that file when the write fails. The checkpoint it replaces stays as *.prev.pth (a fallback
    for --resume auto when the new one is damaged), the rename reaches the disk (the folder is synced), and a write
    that fails (a full disk) leaves the previous checkpoint as it was, and is told to the ranks' next vote
    (stops.write_failed), which ends every rank together, rank 0 saying why in one line. No name it uses can be met
    by a later save: the second name is new each time (paths.temporary_name), and gone when the save returns, also
    where it and *.prev.pth were already one file (a rewind's, or links a backup made)."""
    @functools.wraps(save)
    def save_keeping_the_previous(state, path):
        # This epoch's other files failed: no checkpoint after them, the epoch is redone.
        if stops.pending_write_failure():
            return
        keep = paths.temporary_name(previous_path(path))  # a second name for the old file, until the new is whole
        try:
            if os.path.isfile(path):
                # The file itself, where checkpoint.pth is a link to it: the link as *.prev.pth would lead to
                # nothing once checkpoint.pth is a file, or to itself (a link to checkpoint.prev.pth).
                paths.second_name(os.path.realpath(path), keep)
            save(stamped(state), path)  # with this version's format number, which the lesson does not write
            if os.path.lexists(keep):
                os.replace(keep, previous_path(path))
            if os.path.lexists(keep):  # rename(2) of one name of a file onto another of its names does nothing
                os.remove(keep)
            paths.sync_folder(os.path.dirname(os.path.abspath(path)))  # the renames themselves survive a power cut
        except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
            paths.note_free_space(error, path)
            if os.path.isfile(keep):
                os.remove(keep)
            stops.write_failed(paths.cannot_write(getattr(error, "filename2", None) or path, error, path,
                                                  checkpoint=path))  # (filename2: the rename onto .prev.pth, say)
    return save_keeping_the_previous


# --- predict.py -------------------------------------------------------------------------------------------------
def load_for_inference(path):
    """predict.py's model: everything from the checkpoint at path (--resume), read and checked as every reader does.
    The model's name and output stride from its args; its classes' names and colours from "classes" when it has
    them (else those of the classes: Cityscapes' own, or a classes.json's without colours). The weights loaded, and
    the colours made uint8 [r, g, b] for each class as predict.py's palette takes them, here: what does not fit is
    torch's own error, said in one line before any image is read. -> (model in eval mode, classes)."""
    checkpoint = read("--resume", path)
    saved, names = saved_args(checkpoint), classes_of(checkpoint)
    if saved.get("model") is None:
        fail(f"--resume {path} holds weights without the model's name (no args['model']): give a checkpoint "
             "main.py wrote (best.pth or checkpoint.pth)")
    colors = checkpoint.get("classes", {}).get("colors")
    if colors is None:
        colors = CLASS_COLORS if names == CLASS_NAMES else default_colors(len(names))
    model = build_model(saved["model"], len(names), saved.get("output_stride", 16))
    try:
        model.load_state_dict(checkpoint["model"])
        torch.tensor(colors, dtype=torch.uint8).view(len(names), 3)  # what records.palette makes of them
    except (RuntimeError, TypeError, ValueError) as error:
        fail(f"--resume {path} does not fit {saved['model']} with its {len(names)} classes and their colours "
             f"({_said(error)})")
    return model.eval(), {"names": names, "colors": colors}


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
    rewind = (bool(start.path) and paths.names_in(start.path, out) and not paths.same_name(start.path, latest)
              and not (os.path.isfile(latest) and filecmp.cmp(start.path, latest, shallow=False)))
    saved = []
    for path in (latest, previous_path(latest), os.path.join(out, "best.pth")) if rewind else ():
        if os.path.isfile(path) and not paths.same_name(start.path, path):
            copy = paths.beside(path, "rewound")
            paths.second_name(path, copy)  # the run replaces the first name, this one stays
            saved.append(os.path.basename(copy))
            if path == previous_path(latest):
                os.remove(path)  # later than the start, and kept above: no fallback to it
    if rewind:
        # checkpoint.pth becomes a second name of the start (no copy), through a temporary name no leftover holds;
        # the next save gives it a file of its own (keeping_previous copes with the two names).
        temporary = paths.temporary_name(latest)
        paths.second_name(start.path, temporary)
        os.replace(temporary, latest)
        if dropped:
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
    """metrics.jsonl's lines -> (those kept: the records of the epochs before `epoch`, and every line that is not a
    record of this program, such as a note a user added, in its place; the records of the epochs after; how many
    lines). A record is what records.write_epoch wrote: a JSON object with a whole number as its epoch. One cut
    short by a crash (the last line, unended) belonged to the epoch being redone: in neither."""
    kept, dropped, total = [], [], 0
    if not os.path.isfile(path):
        return kept, dropped, total
    with open(path) as f:
        for total, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            recorded = record["epoch"] if isinstance(record, dict) and type(record.get("epoch")) is int else None
            if recorded is None and not line.endswith("\n") and line.startswith('{"epoch": '):
                continue  # what records.write_epoch began: cut short
            (kept if recorded is None or recorded < epoch else dropped).append(line)
    return kept, dropped, total
