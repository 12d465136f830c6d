"""The flags, checked after parsing: every number within its range, what several flags say together, and what this
machine can do. main.py and predict.py parse with plain argparse types (int, float); these checks then say a
mistake in one line that names the flag and its bound (errors.fail), before a model or a process group exists.

    checks.check_numbers(args, checks.MAIN)   # each number flag within its range (checks.PREDICT: predict.py's)
    checks.check_args(args, use_cuda)          # main.py: what several flags say together, and this machine
    checks.check_worker_sockets(args.workers)  # predict.py: -j's workers can hand batches over (check_args: main.py)
    checks.check_model_fits(args)              # again once --output-stride is known (a checkpoint's)
    autocast = checks.autocast(args, use_cuda) # predict.py's --amp context (main.py's lesson makes its own)
"""
import contextlib
import functools
import importlib
import math
import operator
import sys
import tempfile

import torch

from . import inference, job, paths
from .errors import fail


# A number flag's bounds, each (words, number): the words say it in the line, and name its test here.
BOUNDS = {"at least": operator.ge, "above": operator.gt, "at most": operator.le, "below": operator.lt}

# main.py's number flags: {dest: (the flag as --help names it, its bounds...)}. The numbers of --eval-* are
# inference.py's. --dist-timeout: at least 6 s, as a shorter one can fail the healthy collectives of a slow machine
# (and the line then blames a lost peer). At most a week: a hung peer could hold every GPU idle that long.
MAIN = {
    "crop_size": ("--crop-size", ("at least", 1)), "scale_range": ("--scale-range", ("above", 0)),
    "color_jitter": ("--color-jitter", ("at least", 0), ("at most", 1)), "workers": ("-j/--workers", ("at least", 0)),
    "epochs": ("--epochs", ("at least", 1)), "start_epoch": ("--start-epoch", ("at least", 0)),
    "batch_size": ("-b/--batch-size", ("at least", 1)), "accum_steps": ("--accum-steps", ("at least", 1)),
    "base_batch": ("--base-batch", ("at least", 1)),
    "lr": ("--lr", ("above", 0)), "backbone_lr": ("--backbone-lr", ("at least", 0)),
    "momentum": ("--momentum", ("at least", 0), ("below", 1)),  # a momentum of 1 never forgets, above 1 diverges
    "weight_decay": ("--wd/--weight-decay", ("at least", 0)), "print_freq": ("-p/--print-freq", ("at least", 1)),
    "seed": ("--seed", ("at least", 0)), "dist_timeout": ("--dist-timeout", ("at least", 0.1), ("at most", 7 * 24 * 60)),
    "check_only": ("--check-only", ("at least", 1)), "local_rank": ("--local-rank", ("at least", 0)),
    "eval_scales": ("--eval-scales", ("above", 0)), "eval_crop": ("--eval-crop", ("at least", 8)),
    "eval_stride": ("--eval-stride", ("at least", 1)),
}
PREDICT = {key: MAIN[key] for key in ("workers", "dist_timeout", "eval_scales", "eval_crop", "eval_stride")} | {
    "alpha": ("--alpha", ("at least", 0), ("at most", 1)), "batch_size": ("-b/--batch-size", ("at least", 1))}


def check_numbers(args, ranges):
    """Every number flag of args finite and within its bounds (a flag given several numbers: each of them); else one
    line."""
    for dest, (flag, *bounds) in ranges.items():
        value = getattr(args, dest, None)
        for number in value if isinstance(value, (list, tuple)) else [value]:
            if number is not None and not (math.isfinite(number) and all(BOUNDS[words](number, bound)
                                                                         for words, bound in bounds)):
                said = f"{number:g}" if isinstance(number, float) else number
                fail(f"{flag}: {said} must be {' and '.join(f'{words} {bound:g}' for words, bound in bounds)}")


def native_amp(use_cuda):
    """What --amp given alone means for this process: bf16 where it runs natively (the CPU; NVIDIA compute
    capability 8.0 and later), else fp16 (V100, T4 and RTX 20xx emulate bfloat16, slowly). main.py's native_bf16,
    for the harness (predict.py, whose ranks share no gradients; the out-of-memory advice)."""
    native_bf16 = not use_cuda or torch.cuda.is_bf16_supported(including_emulation=False)
    return "bf16" if native_bf16 else "fp16"


def autocast(args, use_cuda):
    """--amp: -> a function that opens its autocast context (one that does nothing without --amp, or with --amp off).
    fp16 only with CUDA is this program's choice, not torch's limit (torch's CPU autocast takes float16, and
    GradScaler("cpu") works): on the CPU, bfloat16 is autocast's own default, and it needs no GradScaler."""
    amp = native_amp(use_cuda) if args.amp == "auto" else args.amp
    if amp == "fp16" and not use_cuda:
        fail("--amp fp16 runs on CUDA only in this program; on the CPU use --amp bf16 or no --amp")
    if amp in (None, "off"):
        return contextlib.nullcontext
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    return functools.partial(torch.autocast, "cuda" if use_cuda else "cpu", dtype=dtype)


# The longest path of an AF_UNIX socket (sun_path, less its NUL): Linux's, and macOS's and the BSDs'.
_SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
# What multiprocessing adds to the temporary folder for the socket a DataLoader worker hands a batch over through
# (torch's file_descriptor sharing): /pymp-XXXXXXXX/listener-XXXXXXXX.
_SOCKET_SUFFIX = len("/pymp-12345678/listener-12345678")


def check_worker_sockets(workers):
    """-j other than 0 (None: the default, at least 1 worker): a temporary folder short enough for the sockets
    DataLoader workers pass their batches' shared memory through."""
    folder = tempfile.gettempdir()
    if workers != 0 and len(folder) + _SOCKET_SUFFIX > _SOCKET_PATH_MAX:
        fail(f"the temporary folder {folder} is {len(folder)} characters long, more than the "
             f"{_SOCKET_PATH_MAX - _SOCKET_SUFFIX} that DataLoader workers' sockets in it allow: set TMPDIR to a "
             "shorter path (/tmp, say)")


def check_args(args, use_cuda):
    """What several of main.py's flags say together, what this machine can do, and the folders they name
    (paths.py)."""
    if min(crop(args)) < 8:
        fail(f"--crop-size {' '.join(map(str, args.crop_size))}: give numbers of at least 8")
    if args.scale_range[0] > args.scale_range[1]:
        fail(f"--scale-range {args.scale_range[0]:g} {args.scale_range[1]:g}: the first is the smallest scale")
    # DistributedSampler seeds its shuffle with --seed + epoch, and torch.Generator.manual_seed takes at most
    # 2**64 - 1 (torch.manual_seed, at the model's start, takes as much; numpy's SeedSequence any size).
    if args.seed + args.epochs - 1 > 2**64 - 1:
        fail(f"--seed {args.seed} with --epochs {args.epochs}: the sampler's seed of the last epoch (--seed + epoch) "
             f"would pass 2**64 - 1, the most torch's generators take; give a --seed of at most {2**64 - args.epochs}")
    check_worker_sockets(args.workers)
    autocast(args, use_cuda)  # --amp fp16 only with CUDA (this program's choice)
    local_rank = job.env().local_rank if args.local_rank is None else args.local_rank
    if use_cuda and not args.check_only and local_rank >= torch.cuda.device_count():
        fail(f"local rank {local_rank} but only {torch.cuda.device_count()} GPUs visible: start at most one "
             "process per GPU", this_rank=True)  # only the ranks past the last GPU see it
    if args.sync_bn and not use_cuda:
        fail("--sync-bn needs CUDA: DDP refuses SyncBatchNorm on the CPU; drop the flag")
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
    check_model_fits(args)
    paths.check_run_folders(args)  # --output-dir, --save-predictions, --cache-dir: not files, not in the data


def crop(args):
    """--crop-size as (height, width): one number is a square (inference.pair, as --eval-crop takes it)."""
    return inference.pair("--crop-size", args.crop_size)


def check_model_fits(args):
    """The model can be built at this output stride, and the crop holds enough for BatchNorm: with the flags
    (check_args), and again once --model and --output-stride are known (given, or the checkpoint's). The deepest
    feature map is the crop over the output stride; with one image and one value per channel there, BatchNorm
    cannot compute batch statistics (ASPP's pooling branch is built for this; the rest not)."""
    if args.model and "mobilenet" in args.model and args.output_stride == 8:
        fail(f"--output-stride 8 with --model {args.model}: MobileNetV3's backbone has output stride 16 only")
    # Not known yet (a checkpoint's): MobileNetV3's one stride, or the ResNets' smaller; checked again once known.
    stride = args.output_stride or (16 if args.model and "mobilenet" in args.model else 8)
    height, width = crop(args)
    deepest = math.ceil(height / stride) * math.ceil(width / stride)
    if not args.evaluate and args.batch_size * deepest < 2:
        fail(f"--crop-size {' '.join(map(str, args.crop_size))} with -b {args.batch_size}: the deepest feature map "
             f"is 1x1 for one image, too little for BatchNorm; use a crop of at least {2 * stride} or -b 2")
