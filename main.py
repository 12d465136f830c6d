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
Your own data: --data DIR with images/, masks/ and classes.json; --weights best.pth to fine-tune (README.md).

The output folder (--output-dir) holds checkpoint.pth (latest) and checkpoint.prev.pth (the one before),
best.pth, metrics.jsonl (one line per epoch), eval.json (after -e), vis/*.png (image | ground truth |
prediction) and, with --tensorboard, tensorboard/. Surviving faults (signals, a lost peer, checkpoints,
one-line errors) lives in recovery.py.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import resource
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

import checks
import inference
import recovery
from dataset import IGNORE_INDEX, BadInput, colorize, default_workers, normalize, open_dataset
from models import MODEL_NAMES, build_model
from checks import at_least, fraction, non_negative, positive
from recovery import fail, get_rank, get_world_size, is_main_process, log


def get_args_parser():
    # The tutorial reads args.lr, args.momentum and args.weight_decay but never defines them. Here every
    # setting is a flag, with pytorch/examples imagenet's names. The defaults are one published recipe,
    # VainF/DeepLabV3Plus-Pytorch's for Cityscapes (76.2 mIoU on val with DeepLabV3+ ResNet-101, README.md):
    # torchvision's ImageNet ResNet-101 at output stride 16, crop 768, global batch 16, SGD lr 0.1 (the
    # backbone at 0.1x), momentum 0.9, weight decay 1e-4, poly(0.9) over 30k iterations.
    parser = argparse.ArgumentParser(prog="main.py", description="DDP DeepLab on Cityscapes", allow_abbrev=False)
    parser.add_argument("--data", default="data/cityscapes",
                        help="Cityscapes (leftImg8bit/, gtFine/) or your own data (images/, masks/, classes.json)")
    parser.add_argument("--model", default="deeplabv3plus_resnet101", choices=MODEL_NAMES)
    parser.add_argument("--output-stride", type=int, default=16, choices=(8, 16))
    parser.add_argument("--pretrained-backbone", default="imagenet", metavar="imagenet|PATH|none",
                        help="backbone weights: torchvision's ImageNet ones (downloaded once), a local .pth, or none")
    parser.add_argument("--weights", default=None, metavar="PATH",
                        help="start from a trained model (best.pth), e.g. to fine-tune on your data; a classifier "
                             "for other classes is started afresh (--pretrained-backbone is then not used)")
    parser.add_argument("--crop-size", type=at_least(1), nargs="+", default=[768], metavar="N",
                        help="training crop: one number (square) or two (height width)")
    parser.add_argument("--scale-range", type=positive(), nargs=2, default=(1.0, 1.0), metavar=("MIN", "MAX"),
                        help="random rescaling of the training image before the crop (the recipe: none; DeepLab's "
                             "papers: 0.5 2.0)")
    parser.add_argument("--color-jitter", type=fraction(high_open=False), default=0.5, metavar="S",
                        help="random brightness, contrast and saturation factors in [1-S, 1+S]; 0: off")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="keep each decoded frame there (uncompressed, ~29 GB for Cityscapes): decoded once")
    parser.add_argument("-j", "--workers", type=at_least(0), default=None,
                        help="data loading workers per process (default: this process's share of the cores, less one)")
    parser.add_argument("--epochs", type=at_least(1), default=162, help="total epochs (162 x 185-186 steps of 16 "
                        "images: the recipe's 30k iterations)")
    parser.add_argument("--start-epoch", type=at_least(0), default=0, help="first epoch (--resume sets it)")
    parser.add_argument("-b", "--batch-size", type=at_least(1), default=8, help="images per process per step")
    parser.add_argument("--lr", type=positive(), default=0.1, help="initial learning rate, decayed by poly(0.9)")
    parser.add_argument("--backbone-lr", type=non_negative(), default=0.1, metavar="FACTOR",
                        help="the backbone's learning rate as a fraction of --lr (pretrained layers move slower)")
    parser.add_argument("--momentum", type=fraction(), default=0.9)
    parser.add_argument("--wd", "--weight-decay", type=non_negative(), default=1e-4, dest="weight_decay")
    parser.add_argument("-p", "--print-freq", type=at_least(1), default=10, help="print every N steps")
    parser.add_argument("--resume", default="", metavar="PATH|auto",
                        help="checkpoint to resume from; 'auto': OUTPUT_DIR/checkpoint.pth if it exists")
    parser.add_argument("-e", "--evaluate", action="store_true", help="evaluate --resume's model, no training")
    parser.add_argument("--seed", type=at_least(0, 2**32 - 1), default=0)
    parser.add_argument("--output-dir", default="output")
    parser.add_argument("--overwrite", action="store_true",
                        help="train afresh into an --output-dir that holds another run, replacing its files")
    parser.add_argument("--amp", nargs="?", const="bf16", choices=("bf16", "fp16"), default=None,
                        help="mixed precision: bf16 (default when given alone) or fp16 (with a GradScaler)")
    parser.add_argument("--save-predictions", default=None, metavar="DIR",
                        help="write each val prediction as a PNG (Cityscapes: labelIds, the official evaluation's)")
    parser.add_argument("--tensorboard", action="store_true",
                        help="also write loss, lr, mIoU, per-class IoU and pictures for TensorBoard into --output-dir")
    parser.add_argument("--dist-backend", default=None, choices=("nccl", "gloo"),
                        help="default: nccl with CUDA, gloo on the CPU")
    parser.add_argument("--dist-timeout", type=positive(7 * 24 * 60), default=5.0, metavar="MINUTES",
                        help="a collective that waits longer than this (a lost peer) ends the job")
    parser.add_argument("--check-only", type=at_least(1), default=None, metavar="WORLD_SIZE",
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
    inference.add_arguments(parser)  # -e with multi-scale, flip, sliding window: --eval-scales, ... (inference.py)
    # Step 1: the local rank, the GPU this process drives. The tutorial reads --local_rank; since
    # PyTorch 2.0 torch.distributed.launch passes --local-rank, and torchrun passes no argument at all,
    # only the environment variable LOCAL_RANK. Accept both spellings, and fall back to the environment.
    parser.add_argument("--local-rank", "--local_rank", type=at_least(0), dest="local_rank",
                        default=int(os.environ.get("LOCAL_RANK", 0)))
    return parser


def all_reduce(tensor, op=dist.ReduceOp.SUM):
    """In place over all ranks (a no-op in one plain process). A collective: every rank must call it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor


def agree(*flags, device):
    """For each flag (a bool, or a tensor still on the GPU): True on every rank if true on any rank."""
    flags = torch.stack([torch.as_tensor(flag, device=device).float() for flag in flags])
    return [bool(flag) for flag in all_reduce(flags, dist.ReduceOp.MAX).tolist()]  # waits for the step


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
    """Poly decay, lr = base_lr * (1 - step / total_steps) ** 0.9, set before every step (times each
    group's lr_mult). Computed from the position in training, so a resumed run, even with another number
    of processes, continues it. Returns the head's rate."""
    lr = base_lr * (1 - min(step, total_steps - 1) / total_steps) ** 0.9
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
    return lr


def draw(writer, iteration, scalars):
    """TensorBoard's points (writer: rank 0's with --tensorboard, else None). -> the writer, or None once it
    cannot write: a full disk, which this epoch's checkpoint then stops every rank on, with one line."""
    if writer is None:
        return None
    try:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
    except OSError as error:
        log(f"warning: TensorBoard cannot write ({error}): no curves for the rest of this epoch")
        return None
    return writer


def train_one_epoch(model, optimizer, scaler, loader, device, epoch, first_step, steps_per_epoch, args,
                    autocast=contextlib.nullcontext, memory_format=torch.contiguous_format, writer=None):
    """Train on this rank's shard of one epoch, from step first_step on (a resumed epoch: loader yields
    only the batches it has not seen). writer: TensorBoard's, on rank 0 with --tensorboard (else None).

    Returns {"loss_sum": over ranks and steps, "steps": done, "lr": the last, "images_per_s": over all ranks,
    "data_wait": the largest fraction of its time a rank waited for data, "stopped": None, "signal" or
    "nonfinite"}."""
    model.train()
    world_size, rank = get_world_size(), get_rank()
    total_steps = args.epochs * steps_per_epoch
    loss_sum = torch.zeros((), device=device)
    start = window_start = time.time()
    window_images, data_wait, window_wait, step, lr, stopped = 0, 0.0, 0.0, first_step - 1, 0.0, None
    batches = iter(loader)
    for step in range(first_step, steps_per_epoch):
        waited = time.time()
        images, labels = next(batches)  # the time spent here is data wait: the GPU has nothing to do
        waited = time.time() - waited
        data_wait, window_wait = data_wait + waited, window_wait + waited
        recovery.note_step(epoch * steps_per_epoch + step)
        seed_step(args.seed, epoch, step, rank)
        lr = adjust_learning_rate(optimizer, args.lr, epoch * steps_per_epoch + step, total_steps)
        # uint8 from the workers (a quarter of float32's bytes to move), made float and normalised here.
        images = normalize(images.to(device, non_blocking=True, memory_format=memory_format))
        labels = labels.to(device, non_blocking=True).long()
        with autocast():
            loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces (averages) gradients here, bucket by bucket
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach()
        window_images += images.shape[0]
        # All ranks agree, after every step, whether to stop: a signal reached some rank (preemption), or
        # some rank's loss is NaN or infinite. One small all_reduce.
        signal_seen, nonfinite = agree(recovery.stop_signal() is not None, ~torch.isfinite(loss), device=device)
        if nonfinite:
            stopped = "nonfinite"
            break
        if (step + 1) % args.print_freq == 0 or step + 1 == steps_per_epoch:
            # The loss printed is the mean over ranks, not rank 0's alone: every rank joins this.
            mean_loss = all_reduce(loss.detach().clone()).item() / world_size
            now, window_steps = time.time(), window_images // images.shape[0]
            images_per_s = window_images * world_size / (now - window_start)
            eta = (now - start) / (step + 1 - first_step) * (steps_per_epoch - step - 1
                                                             + (args.epochs - epoch - 1) * steps_per_epoch)
            # Step time and, within it, the wait for data (as torchvision's MetricLogger shows them): a data
            # time near the step time means the GPU starves.
            log(f"epoch {epoch} step {step + 1}/{steps_per_epoch} loss {mean_loss:.4f} lr {lr:.5f} "
                f"{images_per_s:.1f} img/s time {(now - window_start) / window_steps:.3f} s "
                f"(data {window_wait / window_steps:.3f} s) eta {timedelta(seconds=round(eta))} "
                f"peak mem {peak_memory_gib(device):.2f} GiB")
            window_start, window_images, window_wait = now, 0, 0.0
            writer = draw(writer, epoch * steps_per_epoch + step + 1,  # x: the iteration, continued on resume
                          {"train/loss": mean_loss, "train/lr": lr, "train/images_per_s": images_per_s})
        if signal_seen:
            stopped = "signal"
            break
    steps_done = step + 1 - first_step if stopped != "nonfinite" else step - first_step
    elapsed = max(time.time() - start, 1e-9)
    # The epoch's sums over the ranks; the largest data wait; and each rank's peak memory (GPU: allocated,
    # CPU: resident), to see that rank 0 carries no more than the others, as DataParallel's first GPU did.
    sums = torch.zeros(world_size + 1, device=device)
    sums[0], sums[1 + rank] = loss_sum, peak_memory_gib(device)
    all_reduce(sums)
    data_wait = all_reduce(torch.tensor([data_wait / elapsed], device=device), dist.ReduceOp.MAX)
    return {"loss_sum": sums[0].item(), "steps": steps_done, "lr": lr, "data_wait": data_wait.item(),
            "images_per_s": steps_done * args.batch_size * world_size / elapsed, "stopped": stopped,
            "peak_memory_gib": sums[1:].tolist()}


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
def evaluate(model, loader, device, num_classes, autocast=contextlib.nullcontext, save_dir=None):
    """Confusion matrix (true class x predicted class) over this rank's val images, summed over all ranks.

    Runs on the unwrapped model: DDP's forward would broadcast buffers, a collective that ranks with
    fewer images would never join, and the job would hang. The only collective is the final all_reduce.
    loader: Subset(val set, this rank's indices), batch size 1. save_dir: write each prediction there.
    Returns (confusion, (image, label, prediction) of this rank's first image, for the picture)."""
    model.eval()
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
    first = None
    for position, (images, labels) in enumerate(loader):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True).long()
        with autocast():
            predictions = model(normalize(images)).argmax(1)  # full resolution: the model upsamples its logits
        labelled = labels != IGNORE_INDEX
        confusion += torch.bincount(labels[labelled] * num_classes + predictions[labelled],
                                    minlength=num_classes * num_classes)
        if first is None:
            first = (images[0].cpu(), labels[0].cpu(), predictions[0].cpu())
        if save_dir is not None:  # each rank its own images' files (Cityscapes: labelIds, as the evaluation wants)
            loader.dataset.dataset.save_prediction(loader.dataset.indices[position], predictions[0].cpu(), save_dir)
    all_reduce(confusion)
    return confusion.view(num_classes, num_classes).cpu(), first


def iou_from_confusion(confusion):
    """Per-class IoU = TP / (TP + FP + FN) over the whole set; mIoU over the classes that occur
    (TP + FP + FN > 0), as the official Cityscapes evaluation does. Absent classes are NaN."""
    true_positive = confusion.diag().double()
    union = confusion.sum(0).double() + confusion.sum(1).double() - true_positive
    iou = true_positive / union  # 0/0 = NaN for absent classes
    present = union > 0
    miou = iou[present].mean().item() if present.any() else float("nan")
    return miou, iou


def iou_dict(iou, names):
    """{class name: IoU}, None for classes absent from the val set (JSON has no NaN)."""
    return {name: (None if math.isnan(value) else value) for name, value in zip(names, iou.tolist())}


def print_iou_table(miou, iou, names):
    lines = [f"  {name:<14} {value * 100:6.2f}" if not math.isnan(value) else f"  {name:<14}    n/a"
             for name, value in zip(names, iou.tolist())]
    log("per-class IoU (%):\n" + "\n".join(lines) + f"\n  {'mIoU':<14} {miou * 100:6.2f}")


def save_picture(path, sample, colors):
    """image | ground truth | prediction, side by side, in the classes' colours (ignore in black). -> the picture."""
    image, label, prediction = sample  # image: uint8 (3, H, W), as the data set gives it
    picture = torch.cat([image.permute(1, 2, 0), colorize(label, colors), colorize(prediction, colors)], dim=1)
    Image.fromarray(picture.numpy()).save(path)
    return picture


def load_datasets(args, crop_size, world_size):
    """The train and val sets, every file's header read, and every val label decoded (every mask of your own
    data): a missing label, a damaged file or a bad value is found here, before any training time is spent,
    the same way on every rank."""
    try:
        train_set = open_dataset(args.data, "train", crop_size=crop_size, seed=args.seed, cache_dir=args.cache_dir,
                                 scale_range=args.scale_range, color_jitter=args.color_jitter)
        val_set = open_dataset(args.data, "val", cache_dir=args.cache_dir)  # the same classes: one classes.json
        train_set.check_files()
        val_set.check_files(decode_labels=True)  # found now, not after the first epoch
    except BadInput as error:
        fail(error)
    if world_size > len(val_set):
        fail(f"{world_size} processes but only {len(val_set)} val images: use at most {len(val_set)} processes")
    share = math.ceil(len(train_set) / world_size)  # DistributedSampler's, padded
    if not args.evaluate and share < args.batch_size:
        fail(f"--batch-size {args.batch_size} is more than a process's share of the {len(train_set)} training "
             f"images ({share} with {world_size} processes): use a smaller batch or fewer processes")
    return train_set, val_set


def make_model(args, classes):
    """The model for these classes: its backbone from --pretrained-backbone, or every layer (but a classifier
    for other classes) from --weights, a trained model to fine-tune. --resume, when there is one, wins later."""
    try:
        model = build_model(args.model, len(classes["names"]), args.output_stride,
                            "none" if args.weights else args.pretrained_backbone)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        fail(error)
    resuming = args.resume == "auto" and any(os.path.isfile(os.path.join(args.output_dir, name))
                                             for name in ("checkpoint.pth", "checkpoint.prev.pth"))
    if args.weights and resuming:  # a restart, a requeued job: the run's own checkpoint holds newer weights
        log(f"--weights {args.weights} not read: the run continues from its checkpoint in {args.output_dir}")
    elif args.weights:
        recovery.load_weights(model, args.weights, args.model, classes)
    return model


def make_optimizer(model, args):
    """SGD with the recipe's two learning rates: the pretrained backbone moves at --backbone-lr times the
    head's (each group's lr_mult, applied by adjust_learning_rate)."""
    backbone = list(model.backbone.parameters())
    head = [p for p in model.parameters() if id(p) not in {id(q) for q in backbone}]
    return torch.optim.SGD([{"params": backbone, "lr_mult": args.backbone_lr}, {"params": head, "lr_mult": 1.0}],
                           lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def evaluate_checkpoint(args, model, val_loader, classes, device, autocast, num_images, checkpoint):
    """-e: evaluate --resume's model on val, print the table; rank 0 writes eval.json and the picture."""
    start, mode = time.time(), inference.read_mode(args)
    confusion, sample = evaluate(inference.wrap(model, mode), val_loader, device, len(classes["names"]), autocast,
                                 args.save_predictions)
    miou, iou = iou_from_confusion(confusion)
    print_iou_table(miou, iou, classes["names"])
    if is_main_process():
        elapsed = time.time() - start
        result = {"miou": miou, "iou": iou_dict(iou, classes["names"]), "num_images": num_images,  # each once
                  "checkpoint": checkpoint, "eval_time_s": elapsed, "mode": inference.describe(mode),
                  "images_per_s": num_images / elapsed}
        with open(os.path.join(args.output_dir, "eval.json"), "w") as f:
            json.dump(result, f, indent=1)
        save_picture(os.path.join(args.output_dir, "vis", "eval.png"), sample, classes["colors"])
        log(f"wrote {os.path.join(args.output_dir, 'eval.json')}"
            + (f" and predictions to {args.save_predictions}" if args.save_predictions else ""))


def record_epoch(args, state, is_best, sample, record, writer=None, estimate=False):
    """After an epoch (rank 0 alone: several ranks writing one file corrupt it): checkpoint.pth (the one it
    replaces kept as checkpoint.prev.pth), best.pth when the mIoU is the best yet, the picture, a line of
    metrics.jsonl, TensorBoard's points (writer), and what the user should know. -> None, or why a file could
    not be written (a full disk), which every rank then stops on."""
    # checkpoint.pth last: a run stopped between these writes resumes before this epoch, and redoes them all.
    checkpoint_path = os.path.join(args.output_dir, "checkpoint.pth")
    try:
        picture = save_picture(os.path.join(args.output_dir, "vis", f"epoch_{record['epoch']:03d}.png"), sample,
                               state["classes"]["colors"])
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if writer is not None:  # at the iteration the epoch ends on, the x-axis of the step curves
            for name, value in [("val/mIoU", record["miou"]), ("train/epoch_loss", record["train_loss"]),
                                *((f"val_IoU/{name}", value) for name, value in record["iou"].items())]:
                if value is not None:  # a class absent from val has no IoU
                    writer.add_scalar(name, value, record["iteration"])
            writer.add_image("val/image_truth_prediction", picture.numpy(), record["iteration"], dataformats="HWC")
            writer.flush()
        if is_best:
            recovery.save_checkpoint(state, os.path.join(args.output_dir, "best.pth"))
        recovery.save_checkpoint(state, checkpoint_path, keep_previous=True)
    except (OSError, recovery.UserError) as error:
        return str(error) if isinstance(error, recovery.UserError) else f"cannot write in {args.output_dir} ({error})"
    log(f"epoch {record['epoch']}: train loss {record['train_loss']:.4f}, {record['train_img_per_s']:.1f} img/s, "
        f"mIoU {record['miou']:.4f} (best {state['best_miou']:.4f}); saved {checkpoint_path}")
    if record["data_wait_fraction"] > 0.05:
        log(f"note: the training loop waited {record['data_wait_fraction']:.0%} of its time for data: raise -j if "
            "the machine has the cores, or decode once with --cache-dir")
    left = args.epochs - record["epoch"] - 1
    if estimate and left:  # after the first epoch, so that nobody wonders whether it hangs
        log(f"the other {left} epoch(s) will take about {timedelta(seconds=round(record['epoch_time_s'] * left))}")


@recovery.guarded  # around the run: a mistake ends in one line, a lost peer is named (recovery.py)
def main(args):
    use_cuda = torch.cuda.is_available()
    crop_size = checks.check_args(args, use_cuda)
    inference.read_mode(args, applies=args.evaluate)  # a mistake in --eval-* is found before any work
    recovery.set_quiet(bool(args.check_only))
    checks.check_output(args, is_writer=is_main_process())  # a restart resumes; no other run is replaced

    # Step 1 (continued): the launchers set RANK and WORLD_SIZE; without them this is one plain process,
    # with no process group. Under a launcher even one process takes the DDP path, as eight would.
    local_rank = args.local_rank
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not args.check_only
    device = torch.device("cpu")
    if use_cuda and not args.check_only:
        if local_rank >= torch.cuda.device_count():
            fail(f"local rank {local_rank} but only {torch.cuda.device_count()} GPUs visible: "
                 "start at most one process per GPU", this_rank=True)  # only the ranks past the last GPU see it
        # Before init_process_group, so that NCCL sets up on this GPU, not on GPU 0 for every rank.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)

    # Step 2: the process group. The tutorial hard-codes nccl, which needs GPUs; gloo runs on the CPU.
    # The timeout turns a lost peer into an error instead of a job that waits forever.
    if distributed:
        backend = args.dist_backend or ("nccl" if use_cuda else "gloo")
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=args.dist_timeout))
        recovery.start_heartbeat()  # every rank's step, so that a lost peer can be named
    rank, world_size = get_rank(), args.check_only or get_world_size()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    log(f"{world_size} process(es), backend {dist.get_backend() if distributed else 'none'}, device {device.type}, "
        f"global batch {args.batch_size * world_size}" + (f", restart {restarts} by torchrun" if restarts else ""))
    train_set, val_set = load_datasets(args, crop_size, world_size)

    # Step 3: the model, wrapped in DDP. The same seed on every rank gives the same initial weights
    # (DDP would also broadcast rank 0's when it wraps the model).
    torch.manual_seed(args.seed)
    classes = train_set.classes  # {"names", "colors"}: Cityscapes' 19, or those of your classes.json
    model = make_model(args, classes)
    # Precision and memory layout, resolved once. channels_last (NHWC): faster convolutions on GPUs.
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    autocast = functools.partial(torch.autocast, device.type, dtype=amp_dtype, enabled=amp_dtype is not None)
    channels_last = args.channels_last if args.channels_last is not None else use_cuda
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model.to(device, memory_format=memory_format)
    if use_cuda:
        torch.backends.cudnn.benchmark = True  # crops and val images have fixed sizes: time kernels once
    if args.sync_bn if args.sync_bn is not None else (use_cuda and world_size > 1):
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
    # (recovery.ResumableSampler is PyTorch's DistributedSampler that can also begin an epoch part-way.)
    train_sampler = recovery.ResumableSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                              seed=args.seed)
    # drop_last: every batch full, and every rank runs the same number of steps, which DDP needs.
    # Augmentation is drawn from (seed, epoch, image index), so no worker needs a seed of its own and a
    # resumed run draws what an uninterrupted one would. pin_memory: page-locked batches, so that the
    # copy to the GPU (non_blocking) overlaps with compute. persistent_workers: training keeps its
    # workers from epoch to epoch; evaluation's exist only while it runs.
    workers = args.workers if args.workers is not None else default_workers()  # dataset.py
    loader_args = dict(num_workers=workers, pin_memory=use_cuda, worker_init_fn=recovery.ignore_sigint)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=False, sampler=train_sampler,
                              drop_last=True, persistent_workers=workers > 0, **loader_args)
    val_shard = eval_shard(len(val_set), rank, world_size)
    val_loader = DataLoader(Subset(val_set, val_shard), batch_size=1, **loader_args)
    steps_per_epoch = len(train_loader)

    optimizer = make_optimizer(model_without_ddp, args)
    # float16 needs loss scaling against underflow; bfloat16 has float32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    position, resumed_from = recovery.resume(args, model_without_ddp, optimizer, scaler, world_size, classes)
    if args.check_only:
        return
    checkpoint_path = os.path.join(args.output_dir, "checkpoint.pth")
    if is_main_process() and not args.evaluate and position["epoch"] < args.epochs:
        recovery.trim_metrics(os.path.join(args.output_dir, "metrics.jsonl"), position["epoch"])
    recovery.install_signal_handlers()
    writer = None  # --tensorboard, on rank 0. purge_step: TensorBoard drops what a stopped run drew after this
    if args.tensorboard and is_main_process():
        from torch.utils.tensorboard import SummaryWriter  # optional: check_args found it installed
        try:
            writer = SummaryWriter(os.path.join(args.output_dir, "tensorboard"),
                                   purge_step=position["epoch"] * steps_per_epoch + position["step"] + 1)
        except OSError as error:
            fail(f"cannot write TensorBoard's files in {args.output_dir} ({error})", this_rank=True)

    if args.evaluate:
        evaluate_checkpoint(args, model_without_ddp, val_loader, classes, device, autocast, len(val_set),
                            resumed_from)
    elif position["epoch"] >= args.epochs:  # a requeued job that had finished: not a failure, nothing to do
        log(f"nothing to train: {resumed_from} has finished epoch {position['epoch']} of --epochs {args.epochs} "
            f"(best mIoU {position['best_miou']:.4f}); raise --epochs to train longer, or -e to evaluate it")
    else:
        first_epoch, start_step = position["epoch"], position["step"]
        best_miou, epoch_loss_sum = position["best_miou"], position["epoch_loss_sum"]
        log(f"training {args.model} on {len(train_set)} images ({steps_per_epoch} steps/epoch), epochs "
            f"{first_epoch}..{args.epochs - 1}, evaluating on {len(val_set)}")
        for epoch in range(first_epoch, args.epochs):
            # Step 4 (continued): the tutorial never calls set_epoch. The sampler seeds its shuffle with
            # seed + epoch; without this call every epoch visits the images in the same order.
            train_sampler.set_epoch(epoch)
            train_sampler.skip = start_step * args.batch_size  # a resumed epoch: only the batches not yet seen
            train_set.epoch = epoch
            epoch_start = time.time()
            trained = train_one_epoch(model, optimizer, scaler, train_loader, device, epoch, start_step,
                                      steps_per_epoch, args, autocast, memory_format, writer)
            train_sampler.skip = 0
            if trained["stopped"] == "nonfinite":
                fail(f"the loss became NaN or infinite in epoch {epoch}: stopped without saving; "
                     f"{checkpoint_path if os.path.isfile(checkpoint_path) else 'no checkpoint'} is the last "
                     "good one. Try a lower --lr, or --amp bf16 instead of fp16")
            epoch_loss_sum += trained["loss_sum"]
            sync_buffers(model_without_ddp)
            state = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "best_miou": best_miou, "args": vars(args),
                     "world_size": world_size, "batch_size": args.batch_size, "classes": classes}  # weights_only
            if trained["stopped"] == "signal":
                step = start_step + trained["steps"]
                if is_main_process():
                    state.update(epoch=epoch, step=step, epoch_loss_sum=epoch_loss_sum)
                    recovery.save_checkpoint(state, checkpoint_path, keep_previous=True)
                log(f"stopped by signal {recovery.stop_signal() or 'on another rank'} at epoch {epoch} step "
                    f"{step}/{steps_per_epoch}; saved {checkpoint_path}. Resume with the same command and "
                    "--resume auto")
                break
            eval_start = time.time()
            confusion, sample = evaluate(model_without_ddp, val_loader, device, len(classes["names"]), autocast,
                                         args.save_predictions if epoch == args.epochs - 1 else None)
            miou, iou = iou_from_confusion(confusion)
            print_iou_table(miou, iou, classes["names"])
            is_best, best_miou = miou > best_miou, max(miou, best_miou)
            train_loss = epoch_loss_sum / (steps_per_epoch * world_size)
            not_written = None
            if is_main_process():
                state.update(best_miou=best_miou, epoch=epoch + 1, step=0, epoch_loss_sum=0.0)
                not_written = record_epoch(args, state, is_best, sample, {
                    "epoch": epoch, "iteration": (epoch + 1) * steps_per_epoch, "train_loss": train_loss,
                    "lr": trained["lr"], "miou": miou, "iou": iou_dict(iou, classes["names"]),
                    "train_img_per_s": trained["images_per_s"], "data_wait_fraction": trained["data_wait"],
                    "epoch_time_s": time.time() - epoch_start, "eval_time_s": time.time() - eval_start,
                    "world_size": world_size, "peak_memory_gib": trained["peak_memory_gib"]},
                    writer, estimate=epoch == first_epoch)
            start_step, epoch_loss_sum = 0, 0.0
            # Every rank learns whether rank 0 could write (a full disk), and whether a signal came during
            # evaluation: all stop together, rank 0 saying why.
            signal_seen, write_failed = agree(recovery.stop_signal() is not None, not_written is not None,
                                              device=device)
            if write_failed:
                fail(not_written or "rank 0 could not write this epoch's files")
            if signal_seen:
                log(f"stopped by signal after epoch {epoch}; saved {checkpoint_path}. Resume with the same "
                    "command and --resume auto")
                break
        else:
            log(f"done: best mIoU {best_miou:.4f}. Checkpoints in {args.output_dir}/ (checkpoint.pth, best.pth), "
                f"pictures in {args.output_dir}/vis/, metrics in {args.output_dir}/metrics.jsonl")
    if writer is not None:
        with contextlib.suppress(OSError):  # a full disk now: said already by the epoch's failed save
            writer.close()
    if distributed:
        recovery.stop_heartbeat()
        dist.destroy_process_group()  # without it NCCL warns of leaked resources at exit


if __name__ == "__main__":
    main(get_args_parser().parse_args())
