"""Train DeepLab (V3, V3+) on Cityscapes with DistributedDataParallel: the DDP tutorial's four steps,
with its holes fixed, each step marked "Step N" below.

Launch it one of four ways (a process per GPU; with no GPU, gloo processes on the CPU):

    CUDA_VISIBLE_DEVICES=0,1 ./run.sh                                    # torchrun, one process per GPU
    torchrun --standalone --nproc_per_node=2 main.py --data data/cityscapes
    python -m torch.distributed.launch --nproc_per_node=2 main.py --data data/cityscapes   # deprecated
    python main.py --data data/cityscapes                                # one process, no process group

Evaluate a checkpoint, and write predictions for the official Cityscapes evaluation:

    torchrun --standalone --nproc_per_node=2 main.py -e --resume output/best.pth --save-predictions preds/

Stopped (SIGTERM, Ctrl-C, a crash)? The same command with --resume auto carries on where it stopped.

The output folder (--output-dir) holds checkpoint.pth (latest) and checkpoint.prev.pth (the one before),
best.pth, metrics.jsonl (one line per epoch), eval.json (after -e) and vis/*.png (image | ground truth |
prediction).
"""
import argparse
import json
import math
import os
import resource
import signal
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from dataset import (CLASS_NAMES, IGNORE_INDEX, MEAN, NUM_CLASSES, STD, TRAINID_TO_ID, BadInput, Cityscapes,
                     colorize)
from models import MODEL_NAMES, build_model


def get_args_parser():
    # The tutorial reads args.lr, args.momentum and args.weight_decay but never defines them. Here every
    # setting is defined, with pytorch/examples imagenet's names. Defaults: the published Cityscapes
    # recipe (DeepLabV3+ ResNet-101, output stride 16, crop 768, global batch 16 on 2 GPUs, lr 0.01).
    parser = argparse.ArgumentParser(description="DDP DeepLab on Cityscapes", allow_abbrev=False)
    parser.add_argument("--data", default="data/cityscapes", help="Cityscapes root (leftImg8bit/, gtFine/)")
    parser.add_argument("--model", default="deeplabv3plus_resnet101", choices=MODEL_NAMES)
    parser.add_argument("--output-stride", type=int, default=16, choices=(8, 16))
    parser.add_argument("--pretrained-backbone", default=None, metavar="imagenet|PATH",
                        help="ImageNet backbone weights: 'imagenet' downloads torchvision's, or a local .pth")
    parser.add_argument("--crop-size", type=int, nargs="+", default=[768], metavar="N",
                        help="training crop: one number (square) or two (height width)")
    parser.add_argument("-j", "--workers", type=int, default=4, help="data loading workers per process")
    parser.add_argument("--epochs", type=int, default=200, help="total epochs (200 x 2975 images ~ 37k "
                        "iterations at global batch 16)")
    parser.add_argument("--start-epoch", type=int, default=0, help="first epoch (--resume sets it)")
    parser.add_argument("-b", "--batch-size", type=int, default=8, help="images per process per step")
    parser.add_argument("--lr", type=float, default=0.01, help="initial learning rate, decayed by poly(0.9)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay")
    parser.add_argument("-p", "--print-freq", type=int, default=10, help="print every N steps")
    parser.add_argument("--resume", default="", metavar="PATH|auto",
                        help="checkpoint to resume from; 'auto': OUTPUT_DIR/checkpoint.pth if it exists")
    parser.add_argument("-e", "--evaluate", action="store_true", help="evaluate --resume's model, no training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="output")
    parser.add_argument("--amp", nargs="?", const="bf16", choices=("bf16", "fp16"), default=None,
                        help="mixed precision: bf16 (default when given alone) or fp16 (with a GradScaler)")
    parser.add_argument("--save-predictions", default=None, metavar="DIR",
                        help="write each val prediction as a labelIds PNG, the official evaluation's input")
    parser.add_argument("--dist-backend", default=None, choices=("nccl", "gloo"),
                        help="default: nccl with CUDA, gloo on the CPU")
    parser.add_argument("--dist-timeout", type=float, default=5.0, metavar="MINUTES",
                        help="a collective that waits longer than this (a lost peer) ends the job")
    parser.add_argument("--check-only", type=int, default=0, metavar="WORLD_SIZE",
                        help="check arguments, data and --resume for a run of WORLD_SIZE processes, then exit "
                             "(run.sh does this before it starts torchrun)")
    parser.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=None,
                        help="SyncBatchNorm (default: on with CUDA and more than one process)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                        help="NHWC memory layout (default: on with CUDA; 1.36x with bf16 on an H200, BENCHMARKS.md)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the DDP model (off: slower than channels_last alone on an H200)")
    parser.add_argument("--find-unused-parameters", action="store_true",
                        help="only for models with parameters that get no gradient; costs a graph walk a step")
    # Step 1: the local rank, the GPU this process drives. The tutorial reads --local_rank; since
    # PyTorch 2.0 torch.distributed.launch passes --local-rank, and torchrun passes no argument at all,
    # only the environment variable LOCAL_RANK. Accept both spellings, and fall back to the environment.
    parser.add_argument("--local-rank", "--local_rank", type=int, dest="local_rank",
                        default=int(os.environ.get("LOCAL_RANK", 0)))
    return parser


def is_main_process():
    """Global rank 0 (not local rank 0: with several nodes that would be one per node). Before the process
    group exists, the launcher's RANK says it."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", 0)) == 0


_QUIET = {"on": False}  # --check-only reports mistakes only


def log(*message):
    if is_main_process() and not _QUIET["on"]:
        print(*message, flush=True)


def fail(message):
    """A mistake the user can fix: one line, no traceback. Every rank sees the same input and fails too."""
    if is_main_process():
        print(f"main.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def all_reduce_sum(tensor):
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def agree(flag, device):
    """True on every rank if flag is true on any rank. A collective: every rank must call it."""
    flag = torch.tensor([float(flag)], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def criterion(logits, labels):
    """Cross-entropy over labelled pixels. Mean over the labelled pixels, as F.cross_entropy does, but a
    crop with no labelled pixel gives 0 instead of 0/0 = NaN. Computed in float32 even under autocast."""
    loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / (labels != IGNORE_INDEX).sum().clamp(min=1)


def peak_memory_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # resident set, KiB on Linux


def seed_step(seed, epoch, step, rank):
    """Seed the random numbers a training step draws (dropout) from its position alone: an uninterrupted
    run and a resumed one then draw the same numbers. Each rank gets its own."""
    torch.manual_seed(int(np.random.SeedSequence([seed, epoch, step, rank]).generate_state(1)[0]))


def adjust_learning_rate(optimizer, base_lr, step, total_steps):
    """Poly decay, lr = base_lr * (1 - step / total_steps) ** 0.9, set before every step. Computed from
    the position in training, so a resumed run, even with another number of processes, continues it."""
    lr = base_lr * (1 - min(step, total_steps - 1) / total_steps) ** 0.9
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def train_one_epoch(model, optimizer, scaler, loader, device, epoch, first_step, steps_per_epoch, args,
                    progress=None):
    """Train on this rank's shard of one epoch, from step first_step on (a resumed epoch skips the
    batches it has seen: loader then holds only the rest).

    Returns (sum over ranks and steps of the loss, steps done, last learning rate, training images per
    second over all ranks, why it stopped early: None, "signal" or "nonfinite")."""
    model.train()
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.amp]
    memory_format = torch.channels_last if getattr(args, "channels_last", False) else torch.contiguous_format
    total_steps = args.epochs * steps_per_epoch
    loss_sum = torch.zeros((), device=device)
    start = window_start = time.time()
    window_images, step, lr, stopped = 0, first_step - 1, 0.0, None
    for step, (images, labels) in enumerate(loader, start=first_step):
        if progress is not None:
            progress["step"] = epoch * steps_per_epoch + step  # read by the heartbeat thread
        seed_step(args.seed, epoch, step, rank)
        lr = adjust_learning_rate(optimizer, args.lr, epoch * steps_per_epoch + step, total_steps)
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        labels = labels.to(device, non_blocking=True).long()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces (averages) gradients here, bucket by bucket
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach()
        window_images += images.shape[0]
        # All ranks agree, after every step, whether to stop: a signal reached some rank (preemption),
        # or some rank's loss is NaN or infinite. One small all_reduce; reading it waits for the step.
        flags = torch.tensor([float(stop_signal() is not None), float(not torch.isfinite(loss))], device=device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signal_seen, nonfinite = flags.tolist()
        if nonfinite:
            stopped = "nonfinite"
            break
        if (step + 1) % args.print_freq == 0 or step + 1 == steps_per_epoch:
            # The loss printed is the mean over ranks, not rank 0's alone: every rank joins this.
            mean_loss = all_reduce_sum(loss.detach().clone()).item() / world_size
            now = time.time()
            images_per_s = window_images * world_size / (now - window_start)
            seconds_per_step = (now - start) / (step + 1 - first_step)
            eta = seconds_per_step * ((steps_per_epoch - step - 1) + (args.epochs - epoch - 1) * steps_per_epoch)
            log(f"epoch {epoch} step {step + 1}/{steps_per_epoch} loss {mean_loss:.4f} lr {lr:.5f} "
                f"{images_per_s:.1f} img/s eta {timedelta(seconds=round(eta))} "
                f"peak mem {peak_memory_gib(device):.2f} GiB")
            window_start, window_images = now, 0
        if signal_seen:
            stopped = "signal"
            break
    steps_done = step + 1 - first_step if stopped != "nonfinite" else step - first_step
    elapsed = time.time() - start
    return (all_reduce_sum(loss_sum).item(), steps_done, lr,
            steps_done * args.batch_size * world_size / max(elapsed, 1e-9), stopped)


def sync_buffers(model):
    """Give every rank rank 0's buffers (BatchNorm running statistics).

    DDP copies rank 0's buffers to the others at the start of each forward, so after the last step every
    rank still holds the statistics of its own last batch. Rank 0 saves its own; evaluation runs on every
    rank; without this, ranks would evaluate slightly different models. (SyncBatchNorm on CUDA keeps the
    buffers equal already; plain BatchNorm on the CPU does not.)"""
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def eval_shard(dataset_size, rank, world_size):
    """The val images this rank evaluates: every world_size-th. Each image exactly once over all ranks.
    (DistributedSampler would pad the shards to equal length by repeating images, counting them twice.)"""
    return list(range(rank, dataset_size, world_size))


@torch.inference_mode()
def evaluate(model, loader, device, amp=None, save_dir=None):
    """Confusion matrix (true class x predicted class) over this rank's val images, summed over all ranks.

    Runs on the unwrapped model: DDP's forward would broadcast buffers, a collective that ranks with
    fewer images would never join, and the job would hang. The only collective is the final all_reduce.
    Returns (confusion, (image, label, prediction) of this rank's first image, for the picture)."""
    model.eval()
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[amp]
    dataset, indices = loader.dataset.dataset, loader.dataset.indices
    confusion = torch.zeros(NUM_CLASSES * NUM_CLASSES, dtype=torch.int64, device=device)
    first = None
    for position, (images, labels) in enumerate(loader):  # batch size 1, in order: position -> image
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True).long()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            predictions = model(images).argmax(1)  # full resolution: the model upsamples its logits
        labelled = labels != IGNORE_INDEX
        confusion += torch.bincount(labels[labelled] * NUM_CLASSES + predictions[labelled],
                                    minlength=NUM_CLASSES * NUM_CLASSES)
        if first is None:
            first = (images[0].cpu(), labels[0].cpu(), predictions[0].cpu())
        if save_dir is not None:
            # The official evaluation wants labelIds, not trainIds, one PNG per image, named by image.
            # Each rank writes the files of its own images; no two ranks write the same file.
            label_ids = TRAINID_TO_ID[predictions[0].cpu()].numpy()
            name = f"{dataset.image_id(indices[position])}_pred_labelIds.png"
            Image.fromarray(label_ids).save(os.path.join(save_dir, name))
    all_reduce_sum(confusion)
    return confusion.view(NUM_CLASSES, NUM_CLASSES).cpu(), first


def iou_from_confusion(confusion):
    """Per-class IoU = TP / (TP + FP + FN) over the whole set; mIoU over the classes that occur
    (TP + FP + FN > 0), as the official Cityscapes evaluation does. Absent classes are NaN."""
    true_positive = confusion.diag().double()
    union = confusion.sum(0).double() + confusion.sum(1).double() - true_positive
    iou = true_positive / union  # 0/0 = NaN for absent classes
    present = union > 0
    miou = iou[present].mean().item() if present.any() else float("nan")
    return miou, iou


def iou_dict(iou):
    """{class name: IoU}, None for classes absent from the val set (JSON has no NaN)."""
    return {name: (None if math.isnan(value) else value) for name, value in zip(CLASS_NAMES, iou.tolist())}


def print_iou_table(miou, iou):
    lines = [f"  {name:<14} {value * 100:6.2f}" if not math.isnan(value) else f"  {name:<14}    n/a"
             for name, value in zip(CLASS_NAMES, iou.tolist())]
    log("per-class IoU (%):\n" + "\n".join(lines) + f"\n  {'mIoU':<14} {miou * 100:6.2f}")


def save_picture(path, sample):
    """image | ground truth | prediction, side by side, in Cityscapes colours (ignore in black)."""
    image, label, prediction = sample
    image = image.float() * torch.tensor(STD).view(3, 1, 1) + torch.tensor(MEAN).view(3, 1, 1)
    image = (image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0)
    Image.fromarray(torch.cat([image, colorize(label), colorize(prediction)], dim=1).numpy()).save(path)


# --- stopping on a signal ------------------------------------------------------------------------------
_STOP = {"signal": None, "time": 0.0}


def _on_signal(signum, frame):
    if _STOP["signal"] is None:
        _STOP["signal"], _STOP["time"] = signum, time.time()
    elif time.time() - _STOP["time"] > 1.0:  # a second signal (not a copy of the first, which a
        signal.signal(signum, signal.SIG_DFL)  # scheduler and a launcher may both send): stop now
        os.kill(os.getpid(), signum)


def stop_signal():
    return _STOP["signal"]


def ignore_sigint(worker_id):
    """A Ctrl-C in a terminal reaches every process of the group, DataLoader workers too: they leave it to
    the training process, which must still read the batch in flight. (SIGTERM stays fatal for them:
    multiprocessing uses it to end them when the training process exits.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# --- a lost peer -----------------------------------------------------------------------------------------
HEARTBEAT_S = 2.0


def start_heartbeat(progress):
    """Every HEARTBEAT_S, write (time, training step) of this rank into the launcher's key-value store,
    from a thread: a rank that is stopped, killed or cut off falls silent, one stuck in its own work
    falls behind. When a collective fails, describe_peers() reads this to name the rank at fault."""
    store = dist.distributed_c10d._get_default_store()  # the store init_process_group rendezvoused with
    key = f"heartbeat/{dist.get_rank()}"

    def beat():
        while True:
            try:
                store.set(key, f"{time.time()} {progress['step']}")
            except Exception:  # the store is gone: the job is ending
                return
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, daemon=True, name="heartbeat").start()
    return store


def describe_peers(store, world_size):
    if store is None:
        return "no heartbeat to tell which rank"
    now, beats = time.time(), {}
    store.set_timeout(timedelta(seconds=5))  # the launcher may be tearing the store down: do not wait on it
    for rank in range(world_size):
        try:
            if store.check([f"heartbeat/{rank}"]):
                stamp, step = store.get(f"heartbeat/{rank}").decode().split()
                beats[rank] = (now - float(stamp), int(step))
        except Exception:
            pass
    silent = {r: age for r, (age, _) in beats.items() if age > 3 * HEARTBEAT_S}
    missing = [r for r in range(world_size) if r not in beats]
    if silent or missing:
        parts = [f"rank {r} silent for {age:.0f} s" for r, age in sorted(silent.items())]
        parts += [f"rank {r} never reported" for r in missing]
        return ", ".join(parts) + " (stopped, killed, or cut off)"
    steps = {r: step for r, (_, step) in beats.items()}
    if len(set(steps.values())) > 1:
        low = min(steps.values())
        behind = [r for r, step in steps.items() if step == low]
        return f"rank(s) {behind} behind at step {low}, others at {max(steps.values())} (stuck in their own work)"
    return "every rank alive and at the same step: a rank is stuck inside a collective, or the network failed"


def is_communication_error(error):
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(
        word in text for word in ("gloo", "nccl", "timed out", "timeout", "connection", "peer"))


# --- checkpoints -----------------------------------------------------------------------------------------
def save_checkpoint(state, path, keep_previous=False):
    """Write to a temporary file, fsync, then rename over path: a crash mid-write leaves the last whole
    checkpoint in place. keep_previous: the one being replaced stays as *.prev.pth, a fallback."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if keep_previous and os.path.isfile(path):
        previous = path.replace(".pth", ".prev.pth")
        if os.path.exists(previous):
            os.remove(previous)
        os.link(path, previous)  # a second name for the old file: checkpoint.pth exists throughout
    os.replace(tmp, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(directory)  # the rename itself survives a power cut
    os.close(directory)


def read_checkpoint(path):
    """-> (checkpoint dict, None) or (None, why it cannot be used)."""
    try:
        # map_location="cpu": otherwise every rank loads onto the GPU the checkpoint was saved from
        # (rank 0's), and that GPU holds a copy per rank. weights_only=True: a checkpoint is data, not code.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        return None, f"cannot be read ({str(error).splitlines()[0][:150]}): truncated or not a checkpoint"
    if not isinstance(checkpoint, dict) or not {"model", "epoch"} <= checkpoint.keys():
        return None, "is not a checkpoint of main.py (no 'model' and 'epoch' in it)"
    return checkpoint, None


def find_checkpoint(resume, output_dir):
    """--resume PATH: that file, or a clear error. --resume auto: output_dir/checkpoint.pth, else the
    one before it (checkpoint.prev.pth), else nothing: a fresh start. -> (checkpoint, path) or (None, "")"""
    if resume != "auto":
        if not os.path.isfile(resume):
            fail(f"--resume {resume}: no such file")
        checkpoint, problem = read_checkpoint(resume)
        if problem:
            fail(f"--resume {resume} {problem}")
        return checkpoint, resume
    for name in ("checkpoint.pth", "checkpoint.prev.pth"):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            checkpoint, problem = read_checkpoint(path)
            if checkpoint is not None:
                return checkpoint, path
            log(f"warning: {path} {problem}; trying the one before it")
    log(f"no usable checkpoint in {output_dir}: starting afresh")
    return None, ""


def load_model_state(model, checkpoint, path, model_name):
    saved = checkpoint.get("args", {}).get("model")
    if saved and saved != model_name:
        fail(f"--resume {path} holds a {saved} model, but this run builds {model_name}: pass --model {saved}")
    own = model.state_dict()
    theirs = checkpoint["model"]
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in theirs.items()
             if k in own and v.shape != own[k].shape]
    missing, unexpected = own.keys() - theirs.keys(), theirs.keys() - own.keys()
    if wrong or missing or unexpected:
        fail(f"--resume {path} does not fit {model_name} with {NUM_CLASSES} classes: {len(wrong)} tensors of "
             f"another shape (e.g. {wrong[:1]}), {len(missing)} missing, {len(unexpected)} unexpected")
    model.load_state_dict(theirs)


def metrics_before(path, epoch):
    """Keep the metrics of epochs before `epoch`: a resumed run rewrites those after it."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["epoch"] < epoch]
    with open(path, "w") as f:
        f.writelines(kept)


def main(args):
    crop_size = args.crop_size * 2 if len(args.crop_size) == 1 else args.crop_size
    if len(crop_size) != 2 or min(crop_size) < 8:
        fail(f"--crop-size {' '.join(map(str, args.crop_size))}: give one or two numbers of at least 8")
    use_cuda = torch.cuda.is_available()
    if args.amp == "fp16" and not use_cuda:
        fail("--amp fp16 needs CUDA; on the CPU use --amp bf16 or no --amp")
    if args.sync_bn and not use_cuda:
        fail("--sync-bn needs CUDA: SyncBatchNorm does not run on the CPU; drop the flag")
    if args.evaluate and not args.resume:
        fail("-e/--evaluate evaluates a trained model: give it --resume PATH")
    if args.start_epoch >= args.epochs and not args.resume:
        fail(f"--start-epoch {args.start_epoch} is not below --epochs {args.epochs}: nothing to train")
    _QUIET["on"] = bool(args.check_only)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restarts and not args.resume:
        args.resume = "auto"  # torchrun restarted us after a failure: carry on from the last checkpoint

    # Step 1 (continued): the launchers set RANK and WORLD_SIZE; without them this is one plain process,
    # with no process group. Under a launcher even one process takes the DDP path, as eight would.
    local_rank = args.local_rank
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not args.check_only
    if use_cuda and not args.check_only:
        if local_rank >= torch.cuda.device_count():
            fail(f"local rank {local_rank} but only {torch.cuda.device_count()} GPUs visible: "
                 "start at most one process per GPU")
        # Before init_process_group, so that NCCL sets up on this GPU, not on GPU 0 for every rank.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    # Step 2: the process group. The tutorial hard-codes nccl, which needs GPUs; gloo runs on the CPU.
    # The timeout turns a lost peer into an error instead of a job that waits forever.
    if distributed:
        backend = args.dist_backend or ("nccl" if use_cuda else "gloo")
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=args.dist_timeout))
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else (args.check_only or 1)
    log(f"{world_size} process(es), backend {dist.get_backend() if distributed else 'none'}, "
        f"device {device.type}, global batch {args.batch_size * world_size}"
        + (f", restart {restarts} by torchrun" if restarts else ""))

    # Everything the user can get wrong is checked before any training time is spent.
    try:
        train_set = Cityscapes(args.data, "train", crop_size=crop_size, seed=args.seed)
        val_set = Cityscapes(args.data, "val")
        train_set.check_files()
        val_set.check_files()
    except BadInput as error:
        fail(error)
    if world_size > len(val_set):
        fail(f"{world_size} processes but only {len(val_set)} val images: use at most {len(val_set)} processes")

    # Step 3: the model, wrapped in DDP. The same seed on every rank gives the same initial weights
    # (DDP would also broadcast rank 0's when it wraps the model).
    torch.manual_seed(args.seed)
    try:
        model = build_model(args.model, NUM_CLASSES, args.output_stride, args.pretrained_backbone)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        fail(error)
    channels_last = args.channels_last if args.channels_last is not None else use_cuda
    args.channels_last = channels_last  # resolved: train_one_epoch reads it, the checkpoint records it
    model.to(device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    if use_cuda:
        torch.backends.cudnn.benchmark = True  # crops and val images have fixed sizes: time kernels once
    sync_bn = args.sync_bn if args.sync_bn is not None else (use_cuda and world_size > 1)
    if sync_bn:
        # Batch statistics over the global batch, not over each GPU's 2-8 images: segmentation batches
        # per GPU are small, and BatchNorm on them is noisy. Not on the CPU: it only runs on CUDA.
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model_without_ddp = model
    if distributed:
        # device_ids: the one GPU of this process; on the CPU it must be None. The tutorial sets
        # find_unused_parameters=True, which makes DDP walk the autograd graph after every forward to
        # find parameters without gradients; DeepLab has none, so it is off unless asked for.
        # gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, one copy fewer a step.
        model = DDP(model, device_ids=[local_rank] if use_cuda else None,
                    output_device=local_rank if use_cuda else None,
                    find_unused_parameters=args.find_unused_parameters, gradient_as_bucket_view=True)
        model_without_ddp = model.module
    if args.compile:
        model = torch.compile(model)  # the DDP model: DDP's hooks stay outside the compiled graphs

    # Step 4: DistributedSampler gives each rank its own part of the training set, so the DataLoader
    # must not shuffle (shuffle=False): the sampler shuffles, with the same seed on every rank.
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=args.seed)
    # drop_last: every batch full, and every rank runs the same number of steps, which DDP needs.
    # Augmentation is drawn from (seed, epoch, image index), so no worker needs a seed of its own and a
    # resumed run draws what an uninterrupted one would. pin_memory: page-locked batches, so that the copy
    # to the GPU (non_blocking) overlaps with compute. persistent_workers: no new worker processes each epoch.
    loader_args = dict(batch_size=args.batch_size, num_workers=args.workers, pin_memory=use_cuda,
                       worker_init_fn=ignore_sigint)
    train_loader = DataLoader(train_set, shuffle=False, sampler=train_sampler, drop_last=True,
                              persistent_workers=args.workers > 0, **loader_args)
    val_loader = DataLoader(Subset(val_set, eval_shard(len(val_set), rank, world_size)),
                            persistent_workers=args.workers > 0, **{**loader_args, "batch_size": 1})
    steps_per_epoch = len(train_loader)
    if not args.evaluate and steps_per_epoch == 0:
        fail(f"--batch-size {args.batch_size} is more than a process's share of the {len(train_set)} training "
             f"images ({len(train_sampler)} with {world_size} processes): use a smaller batch or fewer processes")

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    # float16 needs loss scaling against underflow; bfloat16 has float32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    checkpoint_path = os.path.join(args.output_dir, "checkpoint.pth")
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    best_miou, start_epoch, start_step, epoch_loss_sum = float("-inf"), args.start_epoch, 0, 0.0
    resume = ""
    if args.resume:
        checkpoint, resume = find_checkpoint(args.resume, args.output_dir)
        if checkpoint is not None:
            load_model_state(model_without_ddp, checkpoint, resume, args.model)
            if not args.evaluate:
                optimizer.load_state_dict(checkpoint["optimizer"])
                if checkpoint["scaler"] and scaler.is_enabled():  # empty when saved without --amp fp16
                    scaler.load_state_dict(checkpoint["scaler"])
                start_epoch, start_step = checkpoint["epoch"], checkpoint["step"]
                best_miou, epoch_loss_sum = checkpoint["best_miou"], checkpoint["epoch_loss_sum"]
                before = (checkpoint["world_size"], checkpoint["batch_size"])
                if before != (world_size, args.batch_size) and start_step:
                    # Another order of images: finish the epoch from the same number of images seen.
                    start_step = start_step * before[0] * before[1] // (world_size * args.batch_size)
                if before != (world_size, args.batch_size):
                    log(f"note: the checkpoint was trained with {before[0]} process(es) x {before[1]} images; "
                        f"this run has {world_size} x {args.batch_size}. It continues at the same epoch and "
                        "learning-rate position, but not bitwise as an uninterrupted run would")
            where = f"epoch {checkpoint['epoch']}" + (f" step {checkpoint['step']}" if checkpoint["step"] else "")
            log(f"resuming from {resume} at {where}, best mIoU {checkpoint['best_miou']:.4f}")
    if args.check_only:
        return

    save_dir = args.save_predictions
    if is_main_process():
        os.makedirs(os.path.join(args.output_dir, "vis"), exist_ok=True)
        if save_dir is not None:
            os.makedirs(save_dir, exist_ok=True)
            if any(not name.endswith("_pred_labelIds.png") for name in os.listdir(save_dir)):
                log(f"warning: {save_dir} holds other files; the official evaluation wants only predictions there")
    if distributed:
        dist.barrier()  # the folders exist before any rank writes into them

    # SIGTERM (a scheduler's preemption, torchrun passing one on) or SIGINT (Ctrl-C): finish the step,
    # agree with the other ranks, save where we are, exit 0. A second signal exits at once.
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    progress = {"step": start_epoch * steps_per_epoch + start_step}
    store = start_heartbeat(progress) if distributed else None

    try:
        if args.evaluate:
            start = time.time()
            confusion, sample = evaluate(model_without_ddp, val_loader, device, args.amp, save_dir)
            miou, iou = iou_from_confusion(confusion)
            print_iou_table(miou, iou)
            if is_main_process():
                result = {"miou": miou, "iou": iou_dict(iou), "num_images": len(val_set),  # each once
                          "checkpoint": resume, "eval_time_s": time.time() - start}
                with open(os.path.join(args.output_dir, "eval.json"), "w") as f:
                    json.dump(result, f, indent=1)
                save_picture(os.path.join(args.output_dir, "vis", "eval.png"), sample)
                log(f"wrote {os.path.join(args.output_dir, 'eval.json')}"
                    + (f" and predictions to {save_dir}" if save_dir else ""))
        else:
            if is_main_process():
                metrics_before(metrics_path, start_epoch)
            log(f"training {args.model} on {len(train_set)} images ({steps_per_epoch} steps/epoch), epochs "
                f"{start_epoch}..{args.epochs - 1}, evaluating on {len(val_set)}")
            for epoch in range(start_epoch, args.epochs):
                # Step 4 (continued): the tutorial never calls set_epoch. The sampler seeds its shuffle with
                # seed + epoch; without this call every epoch visits the images in the same order.
                train_sampler.set_epoch(epoch)
                train_set.epoch = epoch
                loader = train_loader
                if start_step:  # a resumed epoch: only the batches it has not seen, in the same order
                    loader = DataLoader(train_set, sampler=list(train_sampler)[start_step * args.batch_size:],
                                        drop_last=True, **loader_args)
                epoch_start = time.time()
                loss_sum, steps_done, lr, images_per_s, stopped = train_one_epoch(
                    model, optimizer, scaler, loader, device, epoch, start_step, steps_per_epoch, args, progress)
                if stopped == "nonfinite":
                    fail(f"the loss became NaN or infinite in epoch {epoch}: stopped without saving; "
                         f"{checkpoint_path if os.path.isfile(checkpoint_path) else 'no checkpoint'} is the last "
                         "good one. Try a lower --lr, or --amp bf16 instead of fp16")
                epoch_loss_sum += loss_sum
                sync_buffers(model_without_ddp)
                state = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "best_miou": best_miou, "args": vars(args),
                         "world_size": world_size, "batch_size": args.batch_size}  # vars(): loads weights_only
                if stopped == "signal":
                    position = start_step + steps_done
                    if is_main_process():
                        save_checkpoint({**state, "epoch": epoch, "step": position, "epoch_loss_sum": epoch_loss_sum},
                                        checkpoint_path, keep_previous=True)
                    log(f"stopped by signal {stop_signal() or 'on another rank'} at epoch {epoch} step "
                        f"{position}/{steps_per_epoch}; saved {checkpoint_path}. "
                        "Resume with the same command and --resume auto")
                    break
                eval_start = time.time()
                last = epoch == args.epochs - 1
                confusion, sample = evaluate(model_without_ddp, val_loader, device, args.amp,
                                             save_dir if last else None)
                eval_time = time.time() - eval_start
                miou, iou = iou_from_confusion(confusion)
                print_iou_table(miou, iou)
                # Every rank's peak memory so far (GPU: allocated; CPU: resident), to see that rank 0 carries
                # no more than the others, as DataParallel's first GPU did.
                peak_memory = torch.zeros(world_size, device=device)
                peak_memory[rank] = peak_memory_gib(device)
                peak_memory = all_reduce_sum(peak_memory).tolist()
                is_best = miou > best_miou
                best_miou = max(miou, best_miou)
                train_loss = epoch_loss_sum / (steps_per_epoch * world_size)
                if is_main_process():
                    # Only global rank 0 writes: several ranks writing one file corrupt it.
                    state.update(best_miou=best_miou, epoch=epoch + 1, step=0, epoch_loss_sum=0.0)
                    save_checkpoint(state, checkpoint_path, keep_previous=True)
                    if is_best:
                        save_checkpoint(state, os.path.join(args.output_dir, "best.pth"))
                    picture = os.path.join(args.output_dir, "vis", f"epoch_{epoch:03d}.png")
                    save_picture(picture, sample)
                    record = {"epoch": epoch, "train_loss": train_loss, "lr": lr, "miou": miou, "iou": iou_dict(iou),
                              "train_img_per_s": images_per_s, "epoch_time_s": time.time() - epoch_start,
                              "eval_time_s": eval_time, "world_size": world_size, "peak_memory_gib": peak_memory}
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                    log(f"epoch {epoch}: train loss {train_loss:.4f}, {images_per_s:.1f} img/s, mIoU {miou:.4f} "
                        f"(best {best_miou:.4f}); saved {checkpoint_path} and {picture}")
                start_step, epoch_loss_sum = 0, 0.0
                if agree(stop_signal() is not None, device):  # a signal during evaluation: stop here
                    log(f"stopped by signal after epoch {epoch}; saved {checkpoint_path}. "
                        "Resume with the same command and --resume auto")
                    break
            else:
                log(f"done: best mIoU {best_miou:.4f}. Checkpoints in {args.output_dir}/ (checkpoint.pth, "
                    f"best.pth), pictures in {args.output_dir}/vis/, metrics in {metrics_path}")
    except BadInput as error:  # a bad file found when read; the DataLoader wraps the message in a traceback
        fail(str(error).rstrip().splitlines()[-1].split("BadInput: ", 1)[-1])
    except RuntimeError as error:
        if not (distributed and is_communication_error(error)):
            raise
        # Every rank that sees it says so: rank 0 may be the one that is gone.
        print(f"main.py: error: rank {rank}: a collective failed or waited more than --dist-timeout "
              f"{args.dist_timeout:g} min ({str(error).splitlines()[0][:120]}). {describe_peers(store, world_size)}. "
              f"The last checkpoint: {checkpoint_path}; restart with --resume auto", file=sys.stderr, flush=True)
        os._exit(1)  # not sys.exit: tearing down a broken process group can hang
    if distributed:
        dist.destroy_process_group()  # without it NCCL warns of leaked resources at exit


if __name__ == "__main__":
    main(get_args_parser().parse_args())
