"""Train DeepLab (V3, V3+) on Cityscapes with DistributedDataParallel: the DDP tutorial's four steps,
with its holes fixed, each step marked "Step N" below.

Launch it one of four ways (a process per GPU; with no GPU, gloo processes on the CPU):

    CUDA_VISIBLE_DEVICES=0,1 ./run.sh                                    # torchrun, one process per GPU
    torchrun --standalone --nproc_per_node=2 main.py --data data/cityscapes
    python -m torch.distributed.launch --nproc_per_node=2 main.py --data data/cityscapes   # deprecated
    python main.py --data data/cityscapes                                # one process, no process group

Evaluate a checkpoint, and write predictions for the official Cityscapes evaluation:

    torchrun --standalone --nproc_per_node=2 main.py -e --resume output/best.pth --save-predictions preds/

The output folder (--output-dir) holds checkpoint.pth (latest), best.pth, metrics.jsonl (one line per
epoch), eval.json (after -e) and vis/*.png (image | ground truth | prediction).
"""
import argparse
import json
import math
import os
import resource
import sys
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

from dataset import (CLASS_NAMES, IGNORE_INDEX, MEAN, NUM_CLASSES, STD, TRAINID_TO_ID, Cityscapes,
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
    parser.add_argument("--dist-timeout", type=float, default=10.0, metavar="MINUTES",
                        help="a collective that waits longer than this (a lost peer) ends the job")
    parser.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=None,
                        help="SyncBatchNorm (default: on with CUDA and more than one process)")
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


def log(*message):
    if is_main_process():
        print(*message, flush=True)


def fail(message):
    """A mistake the user can fix: one line, no traceback. Every rank sees the same input and fails too."""
    log(f"main.py: error: {message}")
    sys.exit(1)


def all_reduce_sum(tensor):
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def criterion(logits, labels):
    """Cross-entropy over labelled pixels. Mean over the labelled pixels, as F.cross_entropy does, but a
    crop with no labelled pixel gives 0 instead of 0/0 = NaN. Computed in float32 even under autocast."""
    loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / (labels != IGNORE_INDEX).sum().clamp(min=1)


def peak_memory_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # resident set, KiB on Linux


def train_one_epoch(model, optimizer, scheduler, scaler, loader, device, epoch, args):
    """One pass over this rank's shard. Returns (mean loss over all ranks, the last step's learning rate,
    training images per second over all ranks)."""
    model.train()
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.amp]
    loss_sum = torch.zeros((), device=device)
    steps, start = len(loader), time.time()
    window_start, window_images = start, 0
    for step, (images, labels) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True).long()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces (averages) gradients here, bucket by bucket
        scaler.step(optimizer)
        scaler.update()
        lr = optimizer.param_groups[0]["lr"]  # the rate this step used
        scheduler.step()  # poly decay, stepped every iteration, not every epoch
        loss_sum += loss.detach()  # no .item(): that would wait for the GPU every step
        window_images += images.shape[0]
        if (step + 1) % args.print_freq == 0 or step + 1 == steps:
            # The loss printed is the mean over ranks, not rank 0's alone. Every rank joins this
            # all_reduce, not just the one that prints; it is also where we wait for the GPU.
            mean_loss = all_reduce_sum(loss.detach().clone()).item() / world_size
            now = time.time()
            images_per_s = window_images * world_size / (now - window_start)
            seconds_per_step = (now - start) / (step + 1)
            eta = seconds_per_step * ((steps - step - 1) + (args.epochs - epoch - 1) * steps)
            log(f"epoch {epoch} step {step + 1}/{steps} loss {mean_loss:.4f} "
                f"lr {lr:.5f} {images_per_s:.1f} img/s "
                f"eta {timedelta(seconds=round(eta))} peak mem {peak_memory_gib(device):.2f} GiB")
            window_start, window_images = now, 0
    elapsed = time.time() - start
    mean_loss = all_reduce_sum(loss_sum).item() / (steps * world_size)
    return mean_loss, lr, steps * args.batch_size * world_size / elapsed


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


def save_checkpoint(state, path):
    """Write to a temporary file, then rename it over path: a crash mid-write leaves the last good one."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(args):
    crop_size = args.crop_size * 2 if len(args.crop_size) == 1 else args.crop_size
    if len(crop_size) != 2 or min(crop_size) < 8:
        fail(f"--crop-size {' '.join(map(str, args.crop_size))}: give one or two numbers of at least 8")
    use_cuda = torch.cuda.is_available()
    if args.amp == "fp16" and not use_cuda:
        fail("--amp fp16 needs CUDA; on the CPU use --amp bf16 or no --amp")
    if args.sync_bn and not use_cuda:
        fail("--sync-bn needs CUDA: SyncBatchNorm does not run on the CPU")
    if args.evaluate and not args.resume:
        fail("-e/--evaluate evaluates a trained model: give it --resume PATH")

    # Step 1 (continued): the launchers set RANK and WORLD_SIZE; without them this is one plain process,
    # with no process group. Under a launcher even one process takes the DDP path, as eight would.
    local_rank = args.local_rank
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if use_cuda:
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
    world_size = dist.get_world_size() if distributed else 1
    log(f"{world_size} process(es), backend {dist.get_backend() if distributed else 'none'}, "
        f"device {device.type}, global batch {args.batch_size * world_size}")

    try:
        train_set = Cityscapes(args.data, "train", crop_size=crop_size, seed=args.seed)
        val_set = Cityscapes(args.data, "val")
    except FileNotFoundError as error:
        fail(error)
    if world_size > len(val_set):
        fail(f"{world_size} processes but only {len(val_set)} val images: use at most {len(val_set)}")

    # Step 3: the model, wrapped in DDP. The same seed on every rank gives the same initial weights
    # (DDP would also broadcast rank 0's when it wraps the model).
    torch.manual_seed(args.seed)
    try:
        model = build_model(args.model, NUM_CLASSES, args.output_stride, args.pretrained_backbone)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        fail(error)
    model.to(device)
    sync_bn = args.sync_bn if args.sync_bn is not None else (use_cuda and distributed)
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

    # Step 4: DistributedSampler gives each rank its own part of the training set, so the DataLoader
    # must not shuffle (shuffle=False): the sampler shuffles, with the same seed on every rank.
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=args.seed)
    # drop_last: every batch full (BatchNorm on one image fails in ASPP's pooling branch), and every rank
    # runs the same number of steps, which DDP needs. Workers are not persistent so that each epoch's
    # workers see train_set.epoch; augmentation is drawn from (seed, epoch, image index), so no worker
    # needs seeding of its own and no two workers share random numbers.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=False, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=use_cuda, drop_last=True)
    val_loader = DataLoader(Subset(val_set, eval_shard(len(val_set), rank, world_size)), batch_size=1,
                            num_workers=args.workers, pin_memory=use_cuda)
    if not args.evaluate and len(train_loader) == 0:
        fail(f"--batch-size {args.batch_size} is more than a process's share of the "
             f"{len(train_set)} training images ({len(train_sampler)}): use a smaller batch or fewer processes")

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    total_steps = max(1, args.epochs * len(train_loader))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: (1 - min(step, total_steps - 1) / total_steps) ** 0.9)
    # float16 needs loss scaling against underflow; bfloat16 has float32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    os.makedirs(args.output_dir, exist_ok=True)
    os.makedirs(os.path.join(args.output_dir, "vis"), exist_ok=True)
    checkpoint_path = os.path.join(args.output_dir, "checkpoint.pth")
    resume = args.resume
    if resume == "auto":
        resume = checkpoint_path if os.path.isfile(checkpoint_path) else ""
        log(f"resuming from {resume}" if resume else f"no checkpoint in {args.output_dir}: starting afresh")
    best_miou, start_epoch = float("-inf"), args.start_epoch
    if resume:
        if not os.path.isfile(resume):
            fail(f"--resume {resume}: no such file")
        # map_location="cpu": otherwise every rank loads onto the GPU the checkpoint was saved from
        # (rank 0's), and that GPU holds a copy per rank. weights_only=True: a checkpoint is data, not code.
        checkpoint = torch.load(resume, map_location="cpu", weights_only=True)
        model_without_ddp.load_state_dict(checkpoint["model"])
        if not args.evaluate:
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            if checkpoint["scaler"] and scaler.is_enabled():  # empty when saved without --amp fp16
                scaler.load_state_dict(checkpoint["scaler"])
            start_epoch = checkpoint["epoch"] + 1
            best_miou = checkpoint["best_miou"]
        log(f"loaded {resume} (epoch {checkpoint['epoch']}, best mIoU {checkpoint['best_miou']:.4f})")

    save_dir = args.save_predictions
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        if is_main_process() and any(not n.endswith("_pred_labelIds.png") for n in os.listdir(save_dir)):
            log(f"warning: {save_dir} holds other files; the official evaluation wants only predictions there")

    if args.evaluate:
        start = time.time()
        confusion, sample = evaluate(model_without_ddp, val_loader, device, args.amp, save_dir)
        miou, iou = iou_from_confusion(confusion)
        print_iou_table(miou, iou)
        if is_main_process():
            result = {"miou": miou, "iou": {n: (None if math.isnan(v) else v) for n, v in zip(CLASS_NAMES, iou.tolist())},
                      "num_images": int(sum(len(eval_shard(len(val_set), r, world_size)) for r in range(world_size))),
                      "checkpoint": resume, "eval_time_s": time.time() - start}
            with open(os.path.join(args.output_dir, "eval.json"), "w") as f:
                json.dump(result, f, indent=1)
            save_picture(os.path.join(args.output_dir, "vis", "eval.png"), sample)
            log(f"wrote {os.path.join(args.output_dir, 'eval.json')}"
                + (f" and predictions to {save_dir}" if save_dir else ""))
        if distributed:
            dist.destroy_process_group()
        return

    log(f"training {args.model} on {len(train_set)} images ({len(train_loader)} steps/epoch), "
        f"epochs {start_epoch}..{args.epochs - 1}, evaluating on {len(val_set)}")
    for epoch in range(start_epoch, args.epochs):
        # Step 4 (continued): the tutorial never calls set_epoch. The sampler seeds its shuffle with
        # seed + epoch; without this call every epoch visits the images in the same order.
        train_sampler.set_epoch(epoch)
        train_set.epoch = epoch
        epoch_start = time.time()
        train_loss, lr, images_per_s = train_one_epoch(model, optimizer, scheduler, scaler, train_loader,
                                                   device, epoch, args)
        sync_buffers(model_without_ddp)
        eval_start = time.time()
        last = epoch == args.epochs - 1
        confusion, sample = evaluate(model_without_ddp, val_loader, device, args.amp,
                                     save_dir if last else None)
        eval_time = time.time() - eval_start
        miou, iou = iou_from_confusion(confusion)
        print_iou_table(miou, iou)
        is_best = miou > best_miou
        best_miou = max(miou, best_miou)
        if is_main_process():
            # Only global rank 0 writes: several ranks writing one file corrupt it.
            state = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch,
                     "best_miou": best_miou, "args": vars(args)}  # vars(): weights_only can load a dict
            save_checkpoint(state, checkpoint_path)
            if is_best:
                save_checkpoint(state, os.path.join(args.output_dir, "best.pth"))
            picture = os.path.join(args.output_dir, "vis", f"epoch_{epoch:03d}.png")
            save_picture(picture, sample)
            record = {"epoch": epoch, "train_loss": train_loss, "lr": lr,
                      "miou": miou, "iou": {n: (None if math.isnan(v) else v)
                                            for n, v in zip(CLASS_NAMES, iou.tolist())},
                      "train_img_per_s": images_per_s, "epoch_time_s": time.time() - epoch_start,
                      "eval_time_s": eval_time, "world_size": world_size}
            with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
            log(f"epoch {epoch}: train loss {train_loss:.4f}, {images_per_s:.1f} img/s, mIoU {miou:.4f} "
                f"(best {best_miou:.4f}); saved {checkpoint_path} and {picture}")
    log(f"done: best mIoU {best_miou:.4f}. Checkpoints in {args.output_dir}/ (checkpoint.pth, best.pth), "
        f"pictures in {args.output_dir}/vis/, metrics in {args.output_dir}/metrics.jsonl")
    if distributed:
        dist.destroy_process_group()  # without it NCCL warns of leaked resources at exit


if __name__ == "__main__":
    main(get_args_parser().parse_args())
