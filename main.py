"""Train DeepLab (V3, V3+) on Cityscapes, or your own data, with DistributedDataParallel: the DDP tutorial's four
steps with its holes fixed, each marked "Step N". The tutorial is the widely read guide to DDP on one machine with
several GPUs: 1. a --local_rank argument, 2. init_process_group(backend="nccl"), 3. DistributedDataParallel(model,
device_ids=[local_rank], output_device=local_rank), 4. a DistributedSampler given to the DataLoader with
shuffle=False, then `CUDA_VISIBLE_DEVICES=0,1 python -m torch.distributed.launch --nproc_per_node=2 main.py`.
Three ways to launch this one (a process per GPU; no GPU: gloo on the CPU), and any of them evaluates a checkpoint
with -e --resume PATH instead of training:

    torchrun --standalone --nproc_per_node=2 main.py --data data/cityscapes
    python -m torch.distributed.launch --nproc_per_node=2 main.py --data data/cityscapes   # deprecated
    python main.py --data data/cityscapes                                # one process, no process group

A fourth, CUDA_VISIBLE_DEVICES=0,1 ./run.sh, runs torchrun (one process per visible GPU) after the harness's checks.

The lesson is this file with its harness taken out: every statement that names the package harness/, each marked
"harness". What remains (Steps 1-4, the training step with gradient accumulation, the exact evaluation, saving a
checkpoint and resuming from one) runs on torch, models.py and dataset.py (which reads files through images.py):
`python tests/tools/lesson.py` prints it (docs/lesson.py), and the tests run it. The harness attaches what a real run
needs beside it: every mistake found before any work and said in one line, a stop that saves where the ranks are,
a lost peer named, --resume auto, metrics and pictures.

What the lesson asks of a data set and a model, all of it. A data set and a model of your own replace dataset.py
and models.py, and nothing else changes. Both are made on the CPU (touch no CUDA: Step 1 comes after them).

dataset.py gives open_dataset(root, split, ...) -> a map-style torch Dataset (__len__ and __getitem__), picklable
(DataLoader workers start by spawn on macOS and Windows, by forkserver on Linux from Python 3.14).
- Training: open_dataset(root, "train", crop_size=[height, width], seed=N, cache_dir=DIR or None,
  scale_range=(low, high), color_jitter=S), from the flags of the same names. A data set may ignore an option it
  has no use for, but not crop_size: every training sample has that size, so that a batch stacks. It holds at
  least one global batch (-b x processes x --accum-steps) of samples.
- Evaluation: open_dataset(root, "val", cache_dir=DIR or None), at full size, one image a batch. Its labels index
  the training set's classes. -e opens this split alone: a folder without training images can be evaluated.
- dataset[i] -> (image, label), torch tensors. image: uint8 (3, H, W), RGB, not normalised (the lesson normalises
  each batch on the device with ImageNet's mean and std: normalize below). label: (H, W) class indices, 255
  (IGNORE_INDEX) where no class is known.
- .classes (the same on both splits): {"names": [each class's name, in index order]}, plain data (lists, strings,
  numbers): a checkpoint keeps it, and torch.load(weights_only=True) reads back only plain data and tensors.
- .epoch: the lesson sets it before each epoch. Draw a training sample's augmentation from (seed, epoch, index)
  alone, not from torch's or numpy's global generator: a resumed run then draws what an uninterrupted one would.
  With -j > 0 the loader's workers last from epoch to epoch, each with a copy of the data set made when it started,
  so keep the epoch where they see it change: a property over torch.zeros((), dtype=torch.int64).share_memory_(),
  read with int() and set with fill_(). A plain attribute would freeze their augmentation at the first epoch's.
- Optional, for --save-predictions alone: .save_prediction(index, prediction, folder) writes val sample index's
  prediction ((H, W) class indices, a CPU tensor) into folder, in the last epoch's evaluation or -e's.

models.py gives build_model(name, num_classes, output_stride, pretrained) -> an nn.Module, and MODEL_NAMES.
- name: one of MODEL_NAMES, --model's choices; the first is the default. output_stride: 8 or 16 (a model without
  one ignores it). pretrained: "imagenet" (the default), a path or "none", from --pretrained-backbone; a model with
  no pretrained weights ignores it.
- forward(images): float (N, 3, H, W), normalised -> logits (N, num_classes, H, W), at the input's size. Random
  numbers (dropout) come from torch's global generator, which the lesson seeds before each forward.
- Every parameter gets a gradient in every step (else give --find-unused-parameters).
- .backbone: a module, whose parameters learn at --backbone-lr times --lr, the rest at --lr. It holds the layers
  that start pretrained, if any (an empty nn.Sequential() gives every layer --lr).

The harness uses more of dataset.py and models.py than this: check_files, largest, save_prediction (always) and
names of both modules. With a data set or a model of your own, start from the lesson (docs/lesson.py).
"""
import argparse
import contextlib
import os
import sys
import time
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))  # models.py and dataset.py under python -I too
from harness import checkpoints, inference, preflight, records, recovery, stops
from dataset import open_dataset
from models import MODEL_NAMES, build_model

try:
    import resource  # the peak memory on the CPU: Linux and macOS have it, Windows not
except ImportError:
    resource = None

IGNORE_INDEX = 255  # a label's value where no class is known: no loss, not counted in the mIoU
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's: the pretrained backbones learned with them


def get_args_parser():
    # The tutorial reads args.lr, args.momentum and args.weight_decay but never defines them. Here every setting
    # is a flag, with pytorch/examples imagenet's names. The defaults are one published recipe for Cityscapes,
    # VainF/DeepLabV3Plus-Pytorch's (docs/cityscapes.md): torchvision's ImageNet ResNet-101 at output stride 16,
    # crop 768, global batch 16, SGD lr 0.1 (the backbone at 0.1x), momentum 0.9, weight decay 1e-4, poly(0.9)
    # over 30k iterations.
    parser = argparse.ArgumentParser(prog="main.py", description="DDP DeepLab on Cityscapes", allow_abbrev=False)
    parser.add_argument("--data", default="data/cityscapes", help="Cityscapes (leftImg8bit/, gtFine/) or your own "
                        "data (images/, masks/, classes.json) (default: %(default)s)")
    parser.add_argument("--model", choices=MODEL_NAMES, metavar="NAME", help=f"{', '.join(MODEL_NAMES)} (default: "
                        f"{MODEL_NAMES[0]}; with --resume: the checkpoint's)")
    parser.add_argument("--output-stride", type=int, choices=(8, 16), help="(default: 16; with --resume: the "
                        "checkpoint's)")
    parser.add_argument("--pretrained-backbone", default="imagenet", metavar="imagenet|PATH|none",
                        help="a fresh start's backbone: torchvision's ImageNet weights (downloaded once), a .pth, "
                        "none (default: %(default)s)")
    parser.add_argument("--crop-size", type=int, nargs="+", default=[768], metavar="N",
                        help="training crop: one number (square) or two (height width) (default: 768)")
    parser.add_argument("--scale-range", type=float, nargs=2, default=(1.0, 1.0), metavar=("MIN", "MAX"),
                        help="random rescaling before the crop (default: 1 1, the recipe's: none; DeepLab's papers: "
                        "0.5 2.0)")
    parser.add_argument("--color-jitter", type=float, default=0.5, metavar="S", help="random brightness, contrast "
                        "and saturation factors in [1-S, 1+S]; 0: off (default: %(default)s)")
    parser.add_argument("--cache-dir", metavar="DIR", help="keep each decoded frame there: decoded once")
    parser.add_argument("-j", "--workers", type=int, help="data loading workers per process; 0: in the process "
                        "itself (default: its share of the cores, less one)")
    parser.add_argument("--epochs", type=int, default=162, help="total epochs, also the length of the poly learning "
                        "rate schedule (default: %(default)s, the recipe's 30k iterations)")
    parser.add_argument("--start-epoch", type=int, default=0, help="first epoch, counted from 0 (default: "
                        "%(default)s; --resume sets it)")
    parser.add_argument("-b", "--batch-size", type=int, default=8, help="images per process per forward (default: "
                        "%(default)s)")
    parser.add_argument("--accum-steps", type=int, default=1, metavar="N", help="gradient accumulation: one optimizer "
                        "step per N batches; the global batch is -b x processes x N (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.1, help="initial learning rate, decayed by poly(0.9) "
                        "(default: %(default)s)")
    parser.add_argument("--base-batch", type=int, metavar="N", help="the global batch --lr is meant for: another "
                        "global batch scales it linearly, lr x global batch / N (default: none, --lr as given; "
                        "run.sh: 16)")
    parser.add_argument("--backbone-lr", type=float, default=0.1, metavar="FACTOR", help="the backbone's learning "
                        "rate as a fraction of --lr (pretrained layers move slower) (default: %(default)s)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD's (default: %(default)s)")
    parser.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay",
                        help="(default: %(default)s)")
    parser.add_argument("-p", "--print-freq", type=int, default=10, help="print every N steps (default: %(default)s)")
    parser.add_argument("--resume", default="", metavar="PATH", help="a checkpoint to resume training from (with -e: "
                        "the model to evaluate)")
    parser.add_argument("-e", "--evaluate", action="store_true", help="evaluate --resume's model, no training")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--output-dir", default="output", help="(default: %(default)s)")
    parser.add_argument("--save-predictions", metavar="DIR",
                        help="write each val prediction as a PNG (Cityscapes: labelIds, the official evaluation's)")
    preflight.add_arguments(parser)  # harness: --weights, --overwrite, --tensorboard, --check-only, --eval-*
    add_launch_arguments(parser)
    return parser


def add_launch_arguments(parser):
    """How the processes run: precision, the process group, DDP's and the GPU's options, Step 1's local rank."""
    parser.add_argument("--amp", nargs="?", const="auto", choices=("auto", "bf16", "fp16", "off"),
                        help="mixed precision. Given alone: bf16 where the GPU runs it natively (A100, RTX 30xx and "
                        "later; the CPU), else fp16 (V100, T4). fp16 takes a GradScaler and CUDA (this program's "
                        "choice). off: float32 (default: off; with -e: the checkpoint's)")
    parser.add_argument("--dist-backend", choices=("nccl", "gloo"), help="(default: nccl with CUDA, gloo on the CPU)")
    parser.add_argument("--dist-timeout", type=float, default=5.0, metavar="MINUTES", help="a collective that waits "
                        "longer than this (a lost peer) ends the job (default: %(default)s; PyTorch's own: 30 for "
                        "gloo, 10 for NCCL)")
    parser.add_argument("--sync-bn", action=argparse.BooleanOptionalAction,
                        help="SyncBatchNorm (default: on with CUDA and more than one process)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction,
                        help="NHWC memory layout (default: on with CUDA; measured 1.36x with bf16 on an H200)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    parser.add_argument("--find-unused-parameters", action="store_true",
                        help="only for models with parameters that get no gradient; costs a graph walk a step")
    # Step 1: the local rank, the GPU this process drives. The tutorial reads --local_rank; since PyTorch 2.0
    # torch.distributed.launch passes --local-rank, and torchrun passes no argument at all, only environment
    # variables (LOCAL_RANK among them). Accept both spellings; without either, main() reads the environment.
    parser.add_argument("--local-rank", "--local_rank", type=int, dest="local_rank",
                        help="(default: $LOCAL_RANK, else 0)")
    return parser


# Who is who. Before init_process_group (Step 2) every process calls itself rank 0 of 1, so log() would print in
# every process: main() logs nothing before Step 2.
def get_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process():
    """Global rank 0, not local rank 0: with several nodes that would be one per node."""
    return get_rank() == 0


def log(*message):
    """Rank 0 alone prints: the other ranks' lines would say the same again."""
    if is_main_process():
        print(*message, flush=True)


def global_batch(args):
    """Images per optimizer step over every process: -b x processes x --accum-steps."""
    return args.batch_size * get_world_size() * args.accum_steps


def scaled_lr(args):
    """The learning rate for this run's global batch. --lr was tuned for a global batch of --base-batch (the recipe's
    16); where the processes cannot make exactly that (6 GPUs: -b 3 makes 18), the rate scales linearly with the
    global batch, the convention of detectron2 (REFERENCE_WORLD_SIZE) and mmengine (auto_scale_lr). The number of
    epochs, so the images seen, stays; the number of steps changes with the batch. Without --base-batch, --lr."""
    if args.base_batch is None:
        return args.lr
    return args.lr * global_batch(args) / args.base_batch


def all_reduce(tensor, op=dist.ReduceOp.SUM):
    """In place over all ranks (a no-op in one plain process). A collective: every rank must call it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor


def peak_memory_gib(device):
    """This process's peak memory: allocated on its GPU, or resident on the CPU; NaN where the OS does not say
    (Windows)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if resource is None:
        return float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the peak resident set: bytes on macOS, KiB on Linux
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def normalize(images):
    """uint8 images (N, 3, H, W) or (3, H, W), on any device -> float32 normalised with ImageNet's mean and std. Called
    after the copy to the device: the workers and the copy move uint8, a quarter of float32's bytes."""
    mean = torch.tensor(MEAN, device=images.device).view(-1, 1, 1)
    std = torch.tensor(STD, device=images.device).view(-1, 1, 1)
    return (images.float() * (1 / 255) - mean) / std  # (torchvision.transforms.v2's arithmetic: its floats)


def native_bf16(device):
    """Whether the device runs bfloat16 natively: the CPU; NVIDIA GPUs of compute capability 8.0 and later (A100,
    RTX 30xx and on). V100, T4 and RTX 20xx emulate it, slowly: their mixed precision is float16."""
    return device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)


def amp_of_the_job(amp, device):
    """--amp as given; given alone ("auto"): "bf16" where every rank's device runs it natively, else "fp16" on every
    rank. One choice for the job: a rank in float16 scales its loss (and skips a step on an overflow) while one in
    bfloat16 does not, and DDP would average their gradients. A collective for "auto": every rank calls it."""
    if amp != "auto":
        return amp
    native = all_reduce(torch.tensor(int(native_bf16(device)), device=device), dist.ReduceOp.MIN)
    return "bf16" if native.item() else "fp16"


def autocast(args, device):
    """--amp's mixed precision (a context that does nothing without it, or with --amp off). bfloat16 has float32's
    range; float16 does not, and needs the GradScaler train() makes for it."""
    dtype = torch.float16 if args.amp == "fp16" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=args.amp in ("bf16", "fp16"))


def criterion(logits, labels):
    """Cross-entropy over labelled pixels. Mean over the labelled pixels, as F.cross_entropy does, but a
    batch with no labelled pixel gives 0 instead of 0/0 = NaN. Computed in float32 even under autocast."""
    loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / (labels != IGNORE_INDEX).sum().clamp(min=1)


def seed_step(seed, epoch, step, place):
    """Seed the random numbers a forward draws (dropout) from its position alone: an uninterrupted run and a
    resumed one then draw the same numbers. place: the batch's place in the global batch (rank x --accum-steps +
    the batch's number in its step): one process accumulating two batches draws for them what two processes
    draw for one each."""
    torch.manual_seed(int(np.random.SeedSequence([seed, epoch, step, place]).generate_state(1)[0]))


def adjust_learning_rate(optimizer, base_lr, step, total_steps):
    """Poly decay, lr = base_lr * (1 - step / total_steps) ** 0.9, set before every step (times each
    group's lr_mult). Computed from the position in training, so a resumed run, even with another number
    of processes, continues it (from base_lr, which --base-batch scales with the global batch); with a larger
    --epochs (total_steps), it continues a longer schedule, whose rate at this step is higher. Returns the head's
    rate."""
    lr = base_lr * (1 - min(step, total_steps - 1) / total_steps) ** 0.9
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
    return lr


class EpochStats(NamedTuple):
    """What train_one_epoch measured, the same on every rank (train() prints it)."""
    loss_sum: float          # the loss summed over the steps and the ranks
    steps: int               # optimizer steps done (a resumed epoch's first part was done before)
    lr: float                # the last step's
    images_per_s: float      # over all ranks
    data_wait: float         # the largest fraction of its time a rank waited for data
    peak_memory_gib: list    # each rank's: rank 0 should carry no more than the others (DataParallel's first GPU did)
    seconds: float           # the time it took


def train_one_epoch(model, optimizer, scaler, loader, device, epoch, first_step, steps_per_epoch, args):
    """Train on this rank's shard of one epoch, from optimizer step first_step on (the loader yields only the
    batches not yet seen); each step takes --accum-steps batches. -> EpochStats."""
    model.train()
    world_size, rank = get_world_size(), get_rank()
    images_per_step = global_batch(args)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)  # a plain model (no DDP) never all-reduces anyway
    loss_sum = torch.zeros((), device=device)
    start = time.time()
    steps = 0  # optimizer steps done
    data_wait = 0.0  # seconds this rank waited for batches
    lr = 0.0
    printed = (start, 0, 0.0)  # (time, steps, data_wait) when the last line was printed
    batches = iter(loader)
    for step in range(first_step, steps_per_epoch):
        lr = adjust_learning_rate(optimizer, scaled_lr(args), epoch * steps_per_epoch + step,
                                  args.epochs * steps_per_epoch)
        # In place, not set_to_none: DDP's gradients are views of its all-reduce buckets (gradient_as_bucket_view),
        # and a gradient set to None comes back as a new tensor that DDP copies into its bucket every step.
        optimizer.zero_grad(set_to_none=False)
        loss = torch.zeros((), device=device)
        for micro_step in range(args.accum_steps):
            waited = time.time()
            images, labels = next(batches)  # the loop waits for data here (a GPU may still run queued work)
            data_wait += time.time() - waited
            seed_step(args.seed, epoch, step, rank * args.accum_steps + micro_step)
            # uint8 from the workers (a quarter of float32's bytes to move), made float and normalised here.
            images = normalize(images.to(device, non_blocking=True, memory_format=memory_format))
            labels = labels.to(device, non_blocking=True).long()
            # Gradient accumulation (--accum-steps N): N batches make one optimizer step. DDP all-reduces the gradients
            # in every backward; inside model.no_sync() it only adds them up on this rank, so DDP's gradient all-reduce
            # runs in the last batch's backward alone (SyncBatchNorm's all-gather in each forward and all-reduce in each
            # backward run in every batch, no_sync or not). Each loss is divided by N: N batches on one process give the
            # gradient of one batch on each of N processes, except for BatchNorm, whose statistics come from each
            # forward's own batch (-b x processes images with SyncBatchNorm), never from the N batches together.
            last = micro_step == args.accum_steps - 1
            with contextlib.nullcontext() if last else no_sync():
                with autocast(args, device):
                    micro_loss = criterion(model(images), labels) / args.accum_steps
                scaler.scale(micro_loss).backward()  # the last: DDP all-reduces (averages) gradients, bucket by bucket
            loss += micro_loss.detach()
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss
        steps += 1
        if (step + 1) % args.print_freq == 0 or step + 1 == steps_per_epoch:
            # The mean over ranks, not rank 0's alone: every rank joins this. (.item() waits for the step to finish:
            # only on the steps that print.) A data time near the step time means the GPU starves.
            mean_loss = all_reduce(loss.clone()).item() / world_size
            now = time.time()
            then, steps_then, waited_then = printed
            step_time = (now - then) / (steps - steps_then)
            data_time = (data_wait - waited_then) / (steps - steps_then)
            eta = (now - start) / steps * (steps_per_epoch - step - 1 + (args.epochs - epoch - 1) * steps_per_epoch)
            log(f"epoch {epoch} step {step + 1}/{steps_per_epoch} loss {mean_loss:.4f} lr {lr:.5f} "
                f"{images_per_step / step_time:.1f} img/s time {step_time:.3f} s (data {data_time:.3f} s) "
                f"eta {timedelta(seconds=round(eta))} peak mem {peak_memory_gib(device):.2f} GiB")
            records.draw(epoch * steps_per_epoch + step + 1, mean_loss, lr, images_per_step / step_time)  # harness
            printed = (now, steps, data_wait)
        if stops.ranks_vote_to_stop(loss):  # harness: every rank stops at the same step: a signal, or a NaN
            break
    return epoch_stats(loss_sum, steps, lr, data_wait, start, args, device)


def epoch_stats(loss_sum, steps, lr, data_wait, start, args, device):
    """train_one_epoch's measures, gathered from every rank (collectives: every rank calls this). -> EpochStats."""
    elapsed = max(time.time() - start, 1e-9)
    sums = torch.zeros(get_world_size() + 1, device=device)  # the loss, and each rank's peak memory in its own place
    sums[0] = loss_sum
    sums[1 + get_rank()] = peak_memory_gib(device)
    all_reduce(sums)
    slowest_wait = all_reduce(torch.tensor([data_wait / elapsed], device=device), dist.ReduceOp.MAX)
    return EpochStats(sums[0].item(), steps, lr, steps * global_batch(args) / elapsed, slowest_wait.item(),
                      sums[1:].tolist(), elapsed)


def sync_buffers(model):
    """Give every rank rank 0's buffers (BatchNorm running statistics), so that every rank evaluates the model rank
    0 saves. DDP broadcasts rank 0's buffers at the start of a forward that follows a gradient-enabled forward
    outside no_sync (once a step with --accum-steps), and each rank's batches then move its own copy: after the
    last step every rank holds rank 0's statistics moved by its own batches of that step. (SyncBatchNorm on CUDA
    moves them alike on every rank; plain BatchNorm on the CPU does not.)"""
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def eval_shard(dataset_size, rank, world_size):
    """The val images this rank evaluates: every world_size-th. Each image exactly once over all ranks.
    (DistributedSampler would pad the shards to equal length by repeating images, counting them twice.)"""
    return list(range(rank, dataset_size, world_size))


@torch.inference_mode()
def evaluate(model, loader, device, num_classes, args, save_dir=None):
    """Confusion matrix (true class x predicted class) over this rank's val images, summed over all ranks.
    model: the unwrapped one. Through DDP, the first forward after training would broadcast rank 0's buffers (a
    collective hidden in the loop: sync_buffers did that already), and without gradients DDP adds nothing. The
    only collective is the final all_reduce, so ranks may hold different numbers of images. loader: Subset(val
    set, this rank's indices), batch size 1. save_dir: write each prediction there. -> the confusion matrix."""
    model.eval()
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
    for position, (images, labels) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True).long()
        with autocast(args, device):
            predictions = model(normalize(images)).argmax(1)  # full resolution: the model upsamples its logits
        labelled = labels != IGNORE_INDEX
        confusion += torch.bincount(labels[labelled] * num_classes + predictions[labelled],
                                    minlength=num_classes * num_classes)
        if save_dir is not None:  # each rank its own images' files (Cityscapes: labelIds, as the evaluation wants)
            loader.dataset.dataset.save_prediction(loader.dataset.indices[position], predictions[0].cpu(), save_dir)
    all_reduce(confusion)
    return confusion.view(num_classes, num_classes).cpu()


def iou_from_confusion(confusion):
    """Per-class IoU = TP / (TP + FP + FN) over the whole set; mIoU over the classes that occur
    (TP + FP + FN > 0), as the official Cityscapes evaluation does. Absent classes are NaN."""
    true_positive = confusion.diag().double()
    union = confusion.sum(0).double() + confusion.sum(1).double() - true_positive
    iou = true_positive / union  # 0/0 = NaN for absent classes
    present = union > 0
    miou = iou[present].mean().item() if present.any() else float("nan")
    return miou, iou


class Evaluation(NamedTuple):
    miou: float
    iou: torch.Tensor        # per class, NaN for a class absent from val: printed by validate(), kept for a record
    seconds: float


def validate(model, loader, device, classes, args, save_dir=None):
    """evaluate(), then the per-class IoU table printed. -> Evaluation."""
    start = time.time()
    confusion = evaluate(model, loader, device, len(classes["names"]), args, save_dir)
    miou, iou = iou_from_confusion(confusion)
    lines = [f"  {name:<14} {value * 100:6.2f}" for name, value in zip(classes["names"], iou.tolist())]
    log("per-class IoU (%, nan: not in val):\n" + "\n".join(lines) + f"\n  {'mIoU':<14} {miou * 100:6.2f}")
    return Evaluation(miou, iou, time.time() - start)


def checkpoint_state(model, optimizer, scaler, args, classes, epoch, step, best_miou, epoch_loss_sum):
    """What a checkpoint holds: plain data, which torch.load(weights_only=True) reads back (vars(args), not the
    Namespace). epoch, step: the next optimizer step to run; epoch_loss_sum: the loss summed so far in that epoch.
    A checkpoint also says what it is, for whoever uses it later: its classes (what each output channel means) and
    the number of processes it was trained on."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
            "epoch": epoch, "step": step, "best_miou": best_miou, "epoch_loss_sum": epoch_loss_sum,
            "args": vars(args), "world_size": get_world_size(), "classes": classes}


@checkpoints.keeping_previous  # harness: the one it replaces kept as checkpoint.prev.pth; a full disk in one line
def save_checkpoint(state, path):
    """Into a temporary file, flushed to the disk, then renamed over the old one: a crash mid-write leaves the old
    checkpoint whole. Rank 0 alone calls it: several ranks writing one file corrupt it."""
    # A new name each save (a container's first process has id 1 in every run). Mode "x" creates the file, or
    # fails where anything has that name: never a write through a symbolic link someone left there.
    temporary = f"{path}.{os.getpid()}-{time.time_ns()}.tmp"
    f = open(temporary, "xb")
    try:
        with f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:  # a full disk, Ctrl-C: nothing half-written left (a kill -9 leaves a checkpoint.pth.*.tmp)
        os.remove(temporary)
        raise


def build(args):
    """The data, the checkpoint a run starts from (--resume) and the model, read the same way on every rank, on
    the CPU. -> (train_set, or None with -e; val_set, model, checkpoint or None)."""
    checkpoint = None
    if args.resume:
        # map_location="cpu": otherwise every rank loads onto the GPU the checkpoint was saved from (rank 0's),
        # and that GPU holds a copy per rank. weights_only=True: a checkpoint is data, not code.
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=True)
    saved = checkpoint.get("args") or {} if checkpoint else {}  # the flags it was trained with: it knows its model
    args.model = args.model or saved.get("model", MODEL_NAMES[0])
    args.output_stride = args.output_stride or saved.get("output_stride", 16)
    if args.evaluate:  # -e evaluates in the precision the run evaluated in, unless --amp is given
        args.amp = args.amp or saved.get("amp")
    crop_size = args.crop_size * 2 if len(args.crop_size) == 1 else args.crop_size  # one number: a square
    train_set = None  # -e reads the val images alone
    if not args.evaluate:
        train_set = open_dataset(args.data, "train", crop_size=crop_size, seed=args.seed, cache_dir=args.cache_dir,
                                 scale_range=args.scale_range, color_jitter=args.color_jitter)
    val_set = open_dataset(args.data, "val", cache_dir=args.cache_dir)  # the same classes as train_set
    checkpoint = checkpoints.checked(checkpoint, args, train_set, val_set)  # harness: this model's, fitting this data
    torch.manual_seed(args.seed)  # the same initial weights on every rank, and in every run of this seed
    # A checkpoint holds every weight: only a fresh start fetches the pretrained backbone.
    model = build_model(args.model, len(val_set.classes["names"]), args.output_stride,
                        "none" if checkpoint else args.pretrained_backbone)
    checkpoints.load_weights(model, args, val_set.classes)  # harness: --weights, fine-tuning from a trained model
    if checkpoint:
        model.load_state_dict(checkpoint.pop("model"))  # copied into the model: not kept a second time
    return train_set, val_set, model, checkpoint


def make_optimizer(model, args):
    """SGD with the recipe's two learning rates: the pretrained backbone moves at --backbone-lr times the
    head's (each group's lr_mult, applied by adjust_learning_rate)."""
    backbone = list(model.backbone.parameters())
    head = [p for p in model.parameters() if id(p) not in {id(q) for q in backbone}]
    return torch.optim.SGD([{"params": backbone, "lr_mult": args.backbone_lr}, {"params": head, "lr_mult": 1.0}],
                           lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


@recovery.guarded("main.py")  # harness: a mistake in one line, a lost peer named, signals (harness/recovery.py)
def main(args):
    args.resume = preflight.check_flags_and_hold_output(args)  # harness: --resume auto, a torchrun restart: a path
    # The data, the checkpoint and the model, read on the CPU: nothing here touches CUDA, so Step 1 may come after.
    train_set, val_set, model, checkpoint = build(args)
    preflight.check_data_and_make_outputs(args, train_set, val_set, checkpoint)  # harness: --check-only ends here

    # Step 1 (continued): the GPU this process drives, --local-rank or torchrun's LOCAL_RANK. Before anything
    # touches CUDA: this process's CUDA context, its "cuda" tensors and NCCL's work then go to its own GPU, not
    # all to GPU 0.
    local_rank = args.local_rank if args.local_rank is not None else int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    # Step 2: the process group. The tutorial hard-codes nccl, which needs GPUs; gloo runs on the CPU. The
    # launchers set RANK and WORLD_SIZE; without them this is one plain process, which needs no group. (Under a
    # launcher even one process takes the DDP path, as eight would.) A collective that waits for a lost peer
    # fails after the timeout: PyTorch's default is 30 minutes for gloo and 10 for NCCL; --dist-timeout, 5.
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:
        recovery.start_heartbeat(args.dist_timeout)  # harness: says what it waits for; then each rank's heartbeat
        dist.init_process_group(backend=args.dist_backend or ("nccl" if use_cuda else "gloo"),
                                timeout=timedelta(minutes=args.dist_timeout))
        stops.enter("training")  # harness: from here a stop saves first (during init_process_group, one ends it)
    args.amp = amp_of_the_job(args.amp, device)  # --amp alone: bf16 where every GPU runs it natively, else fp16
    log(f"{get_world_size()} process(es), backend {dist.get_backend() if distributed else 'none'}, device "
        f"{device.type}, global batch {global_batch(args)} (-b {args.batch_size} x {get_world_size()} process(es) "
        f"x --accum-steps {args.accum_steps})")

    model, model_without_ddp = wrap_model(model, args, device, distributed)  # Step 3, below
    loaders = make_loaders(train_set, val_set, args, use_cuda)  # Step 4, below
    stops.shield_workers(loaders.train, loaders.val)  # harness: a stop to every process of the job is this one's
    # evaluate() takes the unwrapped model. A name of its own: evaluation may wrap it (test-time augmentation, as -e
    # does with the --eval-* flags) and leave the model that trains and is saved as it is.
    model_to_evaluate = model_without_ddp
    model_to_evaluate = inference.wrap(model_to_evaluate, args)  # harness: -e's multi-scale, flip, sliding window
    if args.evaluate:
        evaluation = validate(model_to_evaluate, loaders.val, device, val_set.classes, args, args.save_predictions)
        log(f"evaluated {args.resume} on {len(val_set)} images in {evaluation.seconds:.1f} s: mIoU "
            f"{evaluation.miou:.4f}")
        picture = records.picture(model_to_evaluate, loaders.val, device, args, normalize)  # harness: val image 0
        records.write_eval(args, evaluation, picture, val_set.classes, len(val_set))  # harness: eval.json
    else:
        train(args, model, model_without_ddp, model_to_evaluate, checkpoint, train_set, loaders, device)
    if distributed:
        recovery.stop_heartbeat()  # harness: before the process group goes (it writes into the group's store)
        dist.destroy_process_group()  # without it NCCL warns of leaked resources at exit


def wrap_model(model, args, device, distributed):
    """-> (the model to train, the same model without DDP)."""
    # Step 3: the model, wrapped in DDP. build() made it, with the weights it starts from, the same on every rank
    # (DDP would also broadcast rank 0's when it wraps it). channels_last (NHWC): measured 1.36x faster with bf16
    # on an H200 (BENCHMARKS.md; fp32 not measured yet).
    use_cuda = device.type == "cuda"
    args.channels_last = use_cuda if args.channels_last is None else args.channels_last
    model = model.to(device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    if use_cuda:
        # cuDNN times its kernels for each new input size once. Training crops have one size, and so do
        # Cityscapes' val images; a folder data set's val images of many sizes are timed once per size.
        torch.backends.cudnn.benchmark = True
    sync_bn = use_cuda if args.sync_bn is None else args.sync_bn
    if sync_bn and get_world_size() > 1:
        # Batch statistics over every process's images of a forward, not over each GPU's 2-8: segmentation batches
        # per GPU are small, and BatchNorm on them is noisy. Not on the CPU: DDP refuses SyncBatchNorm there. Not
        # with one process: on a GPU it is then plain BatchNorm, and ASPP's pooling BatchNorm keeps its case of one
        # image.
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model_without_ddp = model
    if distributed:
        # device_ids: the one GPU of this process; on the CPU it must be None. The tutorial sets
        # find_unused_parameters=True, which makes DDP walk the autograd graph after every gradient-enabled
        # forward (outside no_sync) to find parameters without gradients; DeepLab has none, so it is off.
        # gradient_as_bucket_view: the gradients are views of DDP's all-reduce buckets, not a second copy
        # (zeroed in place in train_one_epoch, so that they stay views).
        model = DDP(model, device_ids=[device.index] if use_cuda else None,
                    output_device=device.index if use_cuda else None,
                    find_unused_parameters=args.find_unused_parameters, gradient_as_bucket_view=True)
        model_without_ddp = model.module
    if args.compile:
        # The DDP model, as PyTorch's DDP notes say: TorchDynamo's DDPOptimizer then compiles one graph per DDP bucket,
        # so a bucket's all-reduce starts when its graph's backward ends, not after the whole backward.
        model = torch.compile(model)
    return model, model_without_ddp


def default_workers():
    """DataLoader workers for one training process: its share of the cores it may run on, less one for the
    process itself (at least 1, at most 16). torchrun sets LOCAL_WORLD_SIZE, the processes on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(16, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - 1))


class SkipFirst(torch.utils.data.Sampler):
    """A sampler's order from an offset on, for a checkpoint saved mid-epoch. This file saves at each epoch's end
    (step 0 of the next); a run that also saves on a stop (Ctrl-C, a preemption: main.py's full program does) resumes
    at its next batch. Set `skip` (samples) before each epoch, and the loader yields only the batches not yet seen:
    the wrapped sampler still decides the order, so the rest is what the stopped run would have seen."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.skip = 0

    def __iter__(self):
        return iter(list(self.sampler)[self.skip:])

    def __len__(self):
        return max(0, len(self.sampler) - self.skip)


class Loaders(NamedTuple):
    train: DataLoader        # None, and the two samplers, with -e
    train_sampler: DistributedSampler
    resumable: SkipFirst     # the sampler the train loader reads: train_sampler from a resumed epoch's next batch on
    val: DataLoader


def make_loaders(train_set, val_set, args, use_cuda):
    """-> Loaders; with -e (train_set None), the val loader alone."""
    workers = args.workers if args.workers is not None else default_workers()
    val_shard = Subset(val_set, eval_shard(len(val_set), get_rank(), get_world_size()))
    val_loader = DataLoader(val_shard, batch_size=1, num_workers=workers, pin_memory=use_cuda)
    if train_set is None:
        return Loaders(None, None, None, val_loader)
    # Step 4: DistributedSampler gives each rank its own part of the training set, so the DataLoader must not
    # shuffle (shuffle=False): the sampler shuffles, with the same seed on every rank.
    train_sampler = DistributedSampler(train_set, num_replicas=get_world_size(), rank=get_rank(), shuffle=True,
                                       seed=args.seed)
    resumable = SkipFirst(train_sampler)  # the tutorial passes train_sampler; a resumed epoch skips what it has seen
    # The sampler pads every rank's share to the same length, so every rank runs the same number of steps, which
    # DDP needs; drop_last keeps every batch full. Augmentation is drawn from (seed, epoch, image index), so no
    # worker needs a seed of its own and a resumed run draws what an uninterrupted one would. pin_memory:
    # page-locked batches, whose copy to the GPU (non_blocking) does not make this process wait: it goes on
    # queueing the step's work while the copy runs. persistent_workers: training keeps its workers from
    # epoch to epoch; evaluation's exist only while it runs.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=False, sampler=resumable,
                              drop_last=True, num_workers=workers, pin_memory=use_cuda,
                              persistent_workers=workers > 0)
    return Loaders(train_loader, train_sampler, resumable, val_loader)


# What the lesson says where a run has finished its --epochs.
TRAIN_LONGER = ("evaluate it with -e, or train longer with a larger --epochs: --epochs is also the poly schedule's "
                "length, so the learning rate rises again (at twice the epochs, to about half of --lr)")


class Start(NamedTuple):
    """Where training starts: the next optimizer step to run, and what the run had reached before it."""
    epoch: int
    step: int               # above 0: a checkpoint saved mid-epoch (on a stop) resumes at its next batch
    best_miou: float
    epoch_loss_sum: float   # the loss summed over that epoch's steps so far


def restore(checkpoint, optimizer, scaler, args):
    """The optimizer's and the GradScaler's state, and where to start, from --resume's checkpoint; without one, a
    fresh start at --start-epoch. -> Start."""
    if not checkpoint:
        return Start(args.start_epoch, 0, float("-inf"), 0.0)
    optimizer.load_state_dict(checkpoint.pop("optimizer"))
    if checkpoint["scaler"]:  # empty when saved without --amp fp16
        scaler.load_state_dict(checkpoint["scaler"])
    return Start(checkpoint["epoch"], checkpoint["step"], checkpoint["best_miou"], checkpoint["epoch_loss_sum"])


def train(args, model, model_without_ddp, model_to_evaluate, checkpoint, train_set, loaders, device):
    """The epochs: train, evaluate, save (rank 0), from where the checkpoint (or --start-epoch) says."""
    world_size = get_world_size()
    optimizer = make_optimizer(model_without_ddp, args)
    # float16 needs loss scaling against underflow; bfloat16 has float32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    start = restore(checkpoint, optimizer, scaler, args)
    checkpoints.ranks_compare_start(start.epoch, start.step)  # harness: a stale copy on one node would hang the run
    if start.epoch >= args.epochs:  # a requeued job that had finished: not a failure, nothing to do
        log(f"nothing to train: {args.resume} has finished {start.epoch} epochs, as many as --epochs {args.epochs} "
            f"asks or more; {TRAIN_LONGER}")
        return
    best_miou = start.best_miou
    epoch_loss_sum = start.epoch_loss_sum
    # Optimizer steps: the position, the schedule and --epochs count them. An epoch has as many as the training set
    # holds global batches (-b x processes x --accum-steps), the same on every layout of that batch; every rank's
    # share (DistributedSampler's, padded) holds at least that many. What makes no whole step is left out, as
    # drop_last leaves out a partial batch.
    steps_per_epoch = len(train_set) // global_batch(args)
    checkpoint_path = os.path.join(args.output_dir, "checkpoint.pth")
    if is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
    log(f"training {args.model} on {len(train_set)} images ({steps_per_epoch} steps/epoch), epochs "
        f"{start.epoch}..{args.epochs - 1} (counted from 0), evaluating on {len(loaders.val.dataset.dataset)}")
    if scaled_lr(args) != args.lr:
        log(f"note: global batch {global_batch(args)}, not --base-batch {args.base_batch}: the learning rate is "
            f"scaled with it, --lr {args.lr:g} x {global_batch(args)}/{args.base_batch} = {scaled_lr(args):g}")
    for epoch in range(start.epoch, args.epochs):
        # Step 4 (continued): the tutorial never calls set_epoch. The sampler seeds its shuffle with
        # seed + epoch; without this call every epoch visits the images in the same order.
        loaders.train_sampler.set_epoch(epoch)
        first_step = start.step if epoch == start.epoch else 0
        loaders.resumable.skip = first_step * args.batch_size * args.accum_steps  # those a checkpoint had seen
        train_set.epoch = epoch  # the augmentation's draw (the data set keeps it where persistent workers see it)
        stats = train_one_epoch(model, optimizer, scaler, loaders.train, device, epoch, first_step, steps_per_epoch,
                                args)
        epoch_loss_sum += stats.loss_sum
        sync_buffers(model_without_ddp)  # every rank evaluates, and rank 0 saves, rank 0's BatchNorm statistics
        stops.save_if_stopped(epoch, first_step + stats.steps, steps_per_epoch, lambda step: save_checkpoint(  # harness
            checkpoint_state(model_without_ddp, optimizer, scaler, args, train_set.classes, epoch, step, best_miou,
                             epoch_loss_sum), checkpoint_path))
        evaluation = validate(model_to_evaluate, loaders.val, device, train_set.classes, args,
                              args.save_predictions if epoch == args.epochs - 1 else None)
        is_best = evaluation.miou > best_miou  # NaN (no val pixel to measure) is never the best
        best_miou = evaluation.miou if is_best else best_miou
        train_loss = epoch_loss_sum / (steps_per_epoch * world_size)
        # A data wait near 100% means the GPUs starve for data; a rank 0 that needs more memory than the others
        # would say that something gathers on it (DataParallel's first GPU did).
        log(f"epoch {epoch}: train loss {train_loss:.4f}, {stats.steps} steps in {stats.seconds:.0f} s (lr at the last "
            f"{stats.lr:.5f}), {stats.images_per_s:.1f} img/s, data wait {stats.data_wait:.0%}, peak memory "
            f"{stats.peak_memory_gib[0]:.2f} GiB (rank 0) / {max(stats.peak_memory_gib):.2f} (largest), mIoU "
            f"{evaluation.miou:.4f} (best {best_miou:.4f})")
        state = checkpoint_state(model_without_ddp, optimizer, scaler, args, train_set.classes, epoch + 1, 0,
                                 best_miou, 0.0)
        picture = records.picture(model_to_evaluate, loaders.val, device, args, normalize)  # harness: val image 0
        records.write_epoch(args, epoch, steps_per_epoch, stats, train_loss, evaluation, picture, state,  # harness
                            is_best)
        if is_main_process():
            save_checkpoint(state, checkpoint_path)
        epoch_loss_sum = 0.0
        stops.ranks_vote_after_epoch(last=epoch == args.epochs - 1)  # harness: a signal during the evaluation
    records.say_where_things_are(args, best_miou)  # harness: the files and what each is


if __name__ == "__main__":
    main(get_args_parser().parse_args())
