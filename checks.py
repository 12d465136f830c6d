"""Mistakes found before any work: every flag, the output folder, the run that is already there.

    parser.add_argument("-b", type=checks.at_least(1))   # argparse: its usage line and one error line
    crop_size = checks.check_args(args, use_cuda)        # what several flags tell together
    checks.check_output(args)                            # folders that can be written, no run destroyed

Each mistake ends in one line that names it and says what to do (recovery.fail), before a process group,
a model or a data loader exists.
"""
import argparse
import importlib
import math
import os
import shutil

from recovery import fail

STARTED_RUN_FILES = ("checkpoint.pth", "checkpoint.prev.pth", "best.pth", "metrics.jsonl", "eval.json")


def _number(kind, low=None, high=None, low_open=False, high_open=False):
    """An argparse type: a finite `kind` within [low, high] (or open at either end)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if not math.isfinite(value) or too_low or too_high:
            bounds = []
            if low is not None:
                bounds.append(f"{'above' if low_open else 'at least'} {low}")
            if high is not None:
                bounds.append(f"{'below' if high_open else 'at most'} {high}")
            raise argparse.ArgumentTypeError(f"{text} must be {' and '.join(bounds) or 'finite'}")
        return value
    parse.__name__ = kind.__name__
    return parse


def at_least(low, high=None):
    """An integer flag of at least low (-b 1, -j 0, ...), at most high (--seed: what torch.manual_seed takes)."""
    return _number(int, low, high)


def positive(high=None):
    """A number above 0 (--lr), at most high (--dist-timeout: a week)."""
    return _number(float, 0, high, low_open=True)


def non_negative():
    return _number(float, 0)


def fraction(high_open=True):
    """A number in [0, 1) (--momentum; a momentum of 1 never forgets, above 1 diverges)."""
    return _number(float, 0, 1, high_open=high_open)


def check_args(args, use_cuda):
    """What several flags tell together, and what this machine can do. -> the crop as (height, width)."""
    crop_size = args.crop_size * 2 if len(args.crop_size) == 1 else args.crop_size
    if len(crop_size) != 2 or min(crop_size) < 8:
        fail(f"--crop-size {' '.join(map(str, args.crop_size))}: give one or two numbers of at least 8")
    # The deepest feature map is the crop over the output stride. With one image and one value per channel
    # there, BatchNorm cannot compute batch statistics (ASPP's pooling branch is built for this; the rest not).
    deepest = math.ceil(crop_size[0] / args.output_stride) * math.ceil(crop_size[1] / args.output_stride)
    if args.batch_size * deepest < 2:
        fail(f"--crop-size {' '.join(map(str, args.crop_size))} with -b {args.batch_size}: the deepest feature map "
             f"is 1x1 for one image, too little for BatchNorm; use a crop of at least {2 * args.output_stride} or -b 2")
    if args.scale_range[0] > args.scale_range[1]:
        fail(f"--scale-range {args.scale_range[0]:g} {args.scale_range[1]:g}: the first is the smallest scale")
    if args.amp == "fp16" and not use_cuda:
        fail("--amp fp16 needs CUDA; on the CPU use --amp bf16 or no --amp")
    if args.sync_bn and not use_cuda:
        fail("--sync-bn needs CUDA: SyncBatchNorm does not run on the CPU; drop the flag")
    if args.dist_backend == "nccl" and not use_cuda:
        fail("--dist-backend nccl needs CUDA GPUs; on the CPU use --dist-backend gloo (the default there)")
    if args.evaluate and not args.resume:
        fail("-e/--evaluate evaluates a trained model: give it --resume PATH")
    if args.start_epoch >= args.epochs:
        fail(f"--start-epoch {args.start_epoch} is not below --epochs {args.epochs}: nothing to train")
    if args.weights and (args.evaluate or args.resume not in ("", "auto")):
        what = "-e evaluates --resume's model" if args.evaluate else "--resume continues a run"
        fail(f"--weights starts a new training run from a trained model, but {what}: give one of the two")
    if args.tensorboard and args.evaluate:
        fail("--tensorboard draws training's curves; -e writes eval.json: drop --tensorboard")
    if args.tensorboard:
        try:
            importlib.import_module("torch.utils.tensorboard")  # optional: not in requirements.txt
        except ImportError:
            fail("--tensorboard needs TensorBoard, which is not installed: pip install tensorboard")
    return crop_size


def _writable_folder(flag, path):
    """Make the folder if it is not there; fail in one line if it cannot be, or cannot be written."""
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"{flag} {path} is a file, not a folder: give a folder")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        fail(f"{flag} {path} cannot be written ({error.strerror}): choose a folder you can write to")


def check_output(args, is_writer):
    """Which run this is, and its output folders. A torchrun restart carries on from the last checkpoint
    (--resume auto). A training run does not silently replace another run's checkpoints and metrics: it
    needs --resume auto (which continues it) or --overwrite (which removes it first, rank 0, not in a
    check). The folders can be written (found now, not after an epoch). is_writer: only rank 0 makes and
    probes folders (the others wait for it in init_process_group)."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if restarted:
        args.resume = "auto"  # torchrun restarted us after a failure: carry on from the last checkpoint
    elif args.overwrite and args.resume == "auto":
        args.resume = ""  # run.sh passes --resume auto; --overwrite says: not this time
    for flag, path in (("--output-dir", args.output_dir), ("--save-predictions", args.save_predictions),
                       ("--cache-dir", args.cache_dir)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            fail(f"{flag} {path} is a file, not a folder: give a folder")
    found = [name for name in STARTED_RUN_FILES if os.path.exists(os.path.join(args.output_dir, name))]
    has_checkpoint = any(name.startswith("checkpoint") for name in found)
    if found and not args.evaluate and not args.overwrite and (not args.resume or
                                                               (args.resume == "auto" and not has_checkpoint)):
        fail(f"--output-dir {args.output_dir} holds another run ({', '.join(found)}"
             f"{'' if has_checkpoint else ', no checkpoint to continue from'}): continue it with --resume auto, "
             "choose another --output-dir, or replace it with --overwrite")
    if is_writer:  # before init_process_group, which every rank waits in: the folders exist after it
        _writable_folder("--output-dir", args.output_dir)
        if args.overwrite and not restarted and not args.check_only and not args.evaluate:
            for name in found:
                os.remove(os.path.join(args.output_dir, name))
            shutil.rmtree(os.path.join(args.output_dir, "tensorboard"), ignore_errors=True)  # its curves too
        os.makedirs(os.path.join(args.output_dir, "vis"), exist_ok=True)
        for flag, path in (("--save-predictions", args.save_predictions), ("--cache-dir", args.cache_dir)):
            if path is not None:
                _writable_folder(flag, path)
