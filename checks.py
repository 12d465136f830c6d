"""The flags: every number checked where it is parsed, what several flags tell together, and the precision
setting that main.py and predict.py share.

    parser.add_argument("-b", type=checks.at_least(1))   # argparse: its usage line and one error line
    checks.add_amp_argument(parser)                      # --amp [bf16|fp16], in both programs
    crop_size = checks.check_args(args, use_cuda)        # what several flags tell together
    checks.check_model_fits(args, crop_size)             # again once --output-stride is known (a checkpoint's)
    autocast = checks.autocast(args, use_cuda)           # --amp's context; fp16 needs CUDA

Each mistake ends in one line that names it and says what to do (paths.fail), before a process group,
a model or a data loader exists. The folders the programs write are checked in paths.py.
"""
import argparse
import contextlib
import functools
import importlib
import math

import torch

import paths
from paths import fail


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


def add_amp_argument(parser):
    parser.add_argument("--amp", nargs="?", const="bf16", choices=("bf16", "fp16"), default=None,
                        help="mixed precision: bf16 (the default when given alone) or fp16 (CUDA only; with a "
                             "GradScaler when training)")


def autocast(args, use_cuda):
    """--amp: -> a function that opens its autocast context (one that does nothing without --amp). float16 needs
    CUDA; bfloat16 runs on the CPU too."""
    if args.amp == "fp16" and not use_cuda:
        fail("--amp fp16 needs CUDA; on the CPU use --amp bf16 or no --amp")
    if args.amp is None:
        return contextlib.nullcontext
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    return functools.partial(torch.autocast, "cuda" if use_cuda else "cpu", dtype=dtype)


def check_args(args, use_cuda):
    """What several flags tell together, what this machine can do, and the folders they name (paths.py).
    -> the crop as (height, width)."""
    crop_size = args.crop_size * 2 if len(args.crop_size) == 1 else args.crop_size
    if len(crop_size) != 2 or min(crop_size) < 8:
        fail(f"--crop-size {' '.join(map(str, args.crop_size))}: give one or two numbers of at least 8")
    if args.scale_range[0] > args.scale_range[1]:
        fail(f"--scale-range {args.scale_range[0]:g} {args.scale_range[1]:g}: the first is the smallest scale")
    if use_cuda and not args.check_only and args.local_rank >= torch.cuda.device_count():
        fail(f"local rank {args.local_rank} but only {torch.cuda.device_count()} GPUs visible: start at most one "
             "process per GPU", this_rank=True)  # only the ranks past the last GPU see it
    if args.sync_bn and not use_cuda:
        fail("--sync-bn needs CUDA: SyncBatchNorm does not run on the CPU; drop the flag")
    if args.dist_backend == "nccl" and not use_cuda:
        fail("--dist-backend nccl needs CUDA GPUs; on the CPU use --dist-backend gloo (the default there)")
    if args.evaluate and not args.resume:
        fail("-e/--evaluate evaluates a trained model: give it --resume PATH")
    if args.evaluate and args.overwrite:
        fail("--overwrite replaces a training run in --output-dir; -e trains nothing: drop --overwrite")
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
    check_model_fits(args, crop_size)
    paths.check_run_folders(args)  # --output-dir, --save-predictions, --cache-dir: not files, not in the data
    return crop_size


def check_model_fits(args, crop_size):
    """The crop holds enough for BatchNorm: with the flags (check_args), and again once --output-stride is known
    (given, or the checkpoint's). The deepest feature map is the crop over the output stride; with one image and one value per
    channel there, BatchNorm cannot compute batch statistics (ASPP's pooling branch is built for this; the rest
    not)."""
    # Not known yet (a checkpoint's): MobileNetV3's one stride, or the ResNets' smaller; checked again once known.
    stride = args.output_stride or (16 if args.model and "mobilenet" in args.model else 8)
    deepest = math.ceil(crop_size[0] / stride) * math.ceil(crop_size[1] / stride)
    if not args.evaluate and args.batch_size * deepest < 2:
        fail(f"--crop-size {' '.join(map(str, args.crop_size))} with -b {args.batch_size}: the deepest feature map "
             f"is 1x1 for one image, too little for BatchNorm; use a crop of at least {2 * stride} or -b 2")
