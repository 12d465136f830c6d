"""Train DeepLab (V3, V3+) on Cityscapes, or your own data, with DistributedDataParallel: the DDP tutorial's four
steps with its holes fixed, each marked "Step N". It launches four ways (a process per GPU; no GPU: gloo on the CPU):

    CUDA_VISIBLE_DEVICES=0,1 ./run.sh                                    # torchrun, one process per GPU
    torchrun --standalone --nproc_per_node=2 main.py --data data/cityscapes
    python -m torch.distributed.launch --nproc_per_node=2 main.py --data data/cityscapes   # deprecated
    python main.py --data data/cityscapes                                # one process, no process group
    torchrun --standalone --nproc_per_node=2 main.py -e --resume output/best.pth   # evaluate a checkpoint

Stopped (SIGTERM, Ctrl-C, a crash)? The same command with --resume auto carries on where it stopped. Beside
the lesson: checks.py (flags), paths.py (the folders written), checkpoints.py (what a run starts from),
recovery.py (signals, a lost peer, one-line errors), records.py (what a run writes), dataset.py, models.py.
"""
import argparse
import contextlib
import os
import time
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import checkpoints
import checks
import inference
import paths
import records
import recovery
from checks import at_least, fraction, non_negative, positive
from dataset import IGNORE_INDEX, SkipFirst, default_workers, normalize, open_datasets
from models import MODEL_NAMES
from recovery import get_rank, get_world_size, is_main_process, log


def get_args_parser():
    # The tutorial reads args.lr, args.momentum and args.weight_decay but never defines them. Here every setting
    # is a flag, with pytorch/examples imagenet's names. The defaults are one published recipe for Cityscapes,
    # VainF/DeepLabV3Plus-Pytorch's (docs/cityscapes.md): torchvision's ImageNet ResNet-101 at output stride 16,
    # crop 768, global batch 16, SGD lr 0.1 (the backbone at 0.1x), momentum 0.9, weight decay 1e-4, poly(0.9)
    # over 30k iterations.
    parser = argparse.ArgumentParser(prog="main.py", description="DDP DeepLab on Cityscapes", allow_abbrev=False)
    parser.add_argument("--data", default="data/cityscapes", help="Cityscapes (leftImg8bit/, gtFine/) or your own "
                        "data (images/, masks/, classes.json) (default: %(default)s)")
    parser.add_argument("--model", choices=MODEL_NAMES, metavar="NAME", help="deeplabv3[plus]_resnet50, _resnet101 or "
                        "_mobilenet_v3_large (default: deeplabv3plus_resnet101; a run that starts from a checkpoint, "
                        "--resume or --weights: the checkpoint's model)")
    parser.add_argument("--output-stride", type=int, choices=(8, 16), help="(default: 16; from a checkpoint: its own)")
    parser.add_argument("--pretrained-backbone", default="imagenet", metavar="imagenet|PATH|none",
                        help="a fresh start's backbone: torchvision's ImageNet weights (downloaded once), a .pth, "
                        "none (default: %(default)s)")
    parser.add_argument("--weights", metavar="PATH", help="start from a trained model (fine-tuning); a classifier for "
                        "other classes starts afresh (--pretrained-backbone is then not used)")
    parser.add_argument("--crop-size", type=at_least(1), nargs="+", default=[768], metavar="N",
                        help="training crop: one number (square) or two (height width) (default: 768)")
    parser.add_argument("--scale-range", type=positive(), nargs=2, default=(1.0, 1.0), metavar=("MIN", "MAX"),
                        help="random rescaling before the crop (default: 1 1, the recipe's: none; DeepLab's papers: "
                        "0.5 2.0)")
    parser.add_argument("--color-jitter", type=fraction(high_open=False), default=0.5, metavar="S",
                        help="random brightness, contrast and saturation factors in [1-S, 1+S]; 0: off (default: "
                        "%(default)s)")
    parser.add_argument("--cache-dir", metavar="DIR", help="keep each decoded frame there: decoded once")
    parser.add_argument("-j", "--workers", type=at_least(0), help="data loading workers per process; 0: in the "
                        "process itself (default: its share of the cores, less one)")
    parser.add_argument("--epochs", type=at_least(1), default=162,
                        help="total epochs (default: %(default)s, the recipe's 30k iterations)")
    parser.add_argument("--start-epoch", type=at_least(0), default=0,
                        help="first epoch, counted from 0 (default: %(default)s; --resume sets it)")
    parser.add_argument("-b", "--batch-size", type=at_least(1), default=8,
                        help="images per process per forward (default: %(default)s)")
    parser.add_argument("--accum-steps", type=at_least(1), default=1, metavar="N",
                        help="gradient accumulation: one optimizer step per N batches; the global batch is -b x "
                        "processes x N (default: %(default)s)")
    parser.add_argument("--lr", type=positive(), default=0.1,
                        help="initial learning rate, decayed by poly(0.9) (default: %(default)s)")
    parser.add_argument("--backbone-lr", type=non_negative(), default=0.1, metavar="FACTOR",
                        help="the backbone's learning rate as a fraction of --lr (pretrained layers move slower) "
                        "(default: %(default)s)")
    parser.add_argument("--momentum", type=fraction(), default=0.9, help="SGD's (default: %(default)s)")
    parser.add_argument("--wd", "--weight-decay", type=non_negative(), default=1e-4, dest="weight_decay",
                        help="(default: %(default)s)")
    parser.add_argument("-p", "--print-freq", type=at_least(1), default=10, help="print every N steps (default: "
                        "%(default)s)")
    parser.add_argument("--resume", default="", metavar="PATH|auto",
                        help="checkpoint to resume from; 'auto': OUTPUT_DIR/checkpoint.pth if it exists")
    parser.add_argument("-e", "--evaluate", action="store_true", help="evaluate --resume's model, no training")
    parser.add_argument("--seed", type=at_least(0, 2**32 - 1), default=0, help="(default: %(default)s)")
    parser.add_argument("--output-dir", default="output", help="(default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="train afresh into an --output-dir that holds "
                        "another run, which is moved into OUTPUT_DIR/replaced-DATE/ (nothing is deleted)")
    checks.add_amp_argument(parser)  # --amp [bf16|fp16], as predict.py has it (checks.py)
    parser.add_argument("--save-predictions", metavar="DIR",
                        help="write each val prediction as a PNG (Cityscapes: labelIds, the official evaluation's)")
    parser.add_argument("--tensorboard", action="store_true", help="curves and pictures in OUTPUT_DIR/tensorboard")
    parser.add_argument("--dist-backend", choices=("nccl", "gloo"), help="(default: nccl with CUDA, gloo on the CPU)")
    parser.add_argument("--dist-timeout", type=positive(7 * 24 * 60), default=5.0, metavar="MINUTES",
                        help="a collective that waits longer than this (a lost peer) ends the job (default: "
                        "%(default)s; PyTorch's own: 30 for gloo, 10 for NCCL)")
    parser.add_argument("--check-only", type=at_least(1), metavar="WORLD_SIZE", help="check flags, data and "
                        "checkpoints for WORLD_SIZE processes, then exit (run.sh does, before torchrun)")
    parser.add_argument("--sync-bn", action=argparse.BooleanOptionalAction,
                        help="SyncBatchNorm (default: on with CUDA and more than one process)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction,
                        help="NHWC memory layout (default: on with CUDA; measured 1.36x with bf16 on an H200)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    parser.add_argument("--find-unused-parameters", action="store_true",
                        help="only for models with parameters that get no gradient; costs a graph walk a step")
    inference.add_arguments(parser)  # -e with multi-scale, flip, sliding window: --eval-scales, ... (inference.py)
    # Step 1: the local rank, the GPU this process drives. The tutorial reads --local_rank; since PyTorch 2.0
    # torch.distributed.launch passes --local-rank, and torchrun passes no argument at all, only the
    # environment variable LOCAL_RANK. Accept both spellings, and fall back to the environment.
    parser.add_argument("--local-rank", "--local_rank", type=at_least(0), dest="local_rank",
                        default=int(os.environ.get("LOCAL_RANK", 0)), help="(default: $LOCAL_RANK, else 0)")
    return parser


def all_reduce(tensor, op=dist.ReduceOp.SUM):
    """In place over all ranks (a no-op in one plain process). A collective: every rank must call it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor


def criterion(logits, labels):
    """Cross-entropy over labelled pixels. Mean over the labelled pixels, as F.cross_entropy does, but a
    crop with no labelled pixel gives 0 instead of 0/0 = NaN. Computed in float32 even under autocast."""
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
    of processes, continues it. Returns the head's rate."""
    lr = base_lr * (1 - min(step, total_steps - 1) / total_steps) ** 0.9
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
    return lr


def train_one_epoch(model, optimizer, scaler, loader, device, epoch, first_step, steps_per_epoch, args,
                    autocast=contextlib.nullcontext, memory_format=torch.contiguous_format, writer=None):
    """Train on this rank's shard of one epoch from optimizer step first_step on (loader yields only the batches not
    seen; each step takes --accum-steps of them). writer: TensorBoard's, or None. -> {"loss_sum": over ranks and
    steps, "steps": done, "lr": the last, "images_per_s": over all ranks, "data_wait": the largest fraction of its
    time a rank waited for data, "stopped": None, "signal" or "nonfinite", "peak_memory_gib": each rank's}."""
    model.train()
    world_size, rank = get_world_size(), get_rank()
    images_per_step = args.batch_size * args.accum_steps * world_size  # the global batch
    loss_sum = torch.zeros((), device=device)
    vote = recovery.StopVote(device)
    # A plain model (one process, no DDP) has no no_sync: it never all-reduces anyway.
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    start = window_start = time.time()
    steps = 0
    window_steps = 0
    data_wait = 0.0
    window_wait = 0.0
    lr = 0.0
    stopped = None
    batches = iter(loader)
    for step in range(first_step, steps_per_epoch):
        recovery.note_step(epoch * steps_per_epoch + step)
        lr = adjust_learning_rate(optimizer, args.lr, epoch * steps_per_epoch + step, args.epochs * steps_per_epoch)
        # In place, not set_to_none: DDP's gradients are views of its all-reduce buckets (gradient_as_bucket_view),
        # and a gradient set to None comes back as a new tensor that DDP copies into its bucket every step.
        optimizer.zero_grad(set_to_none=False)
        loss = torch.zeros((), device=device)
        for micro_step in range(args.accum_steps):
            waited = time.time()
            images, labels = next(batches)  # the loop waits for data here (a GPU may still run queued work)
            waited = time.time() - waited
            data_wait += waited
            window_wait += waited
            seed_step(args.seed, epoch, step, rank * args.accum_steps + micro_step)
            # uint8 from the workers (a quarter of float32's bytes to move), made float and normalised here.
            images = normalize(images.to(device, non_blocking=True, memory_format=memory_format))
            labels = labels.to(device, non_blocking=True).long()
            # Gradient accumulation (--accum-steps N): N batches make one optimizer step. DDP all-reduces the
            # gradients in every backward; inside model.no_sync() it only adds them up on this rank, so only the
            # last batch's backward pays for the all-reduce. Each loss is divided by N: N batches on one process
            # then give the update of one batch on each of N processes.
            last = micro_step == args.accum_steps - 1
            with contextlib.nullcontext() if last else no_sync():
                with autocast():
                    micro_loss = criterion(model(images), labels) / args.accum_steps
                scaler.scale(micro_loss).backward()  # the last: DDP all-reduces (averages) gradients, bucket by bucket
            loss += micro_loss.detach()
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss
        steps += 1
        window_steps += 1
        # The ranks agree whether to stop: a signal reached one (preemption), or one's loss is NaN or infinite.
        # Each optimizer step votes, and the vote of the step before is read, long done: the GPU never waits for it.
        # A signal during an accumulation is read after its step: the step is finished, never half done.
        stopped = vote.cast(loss)
        if (step + 1) % args.print_freq == 0 or step + 1 == steps_per_epoch:
            # The loss printed is the mean over ranks, not rank 0's alone: every rank joins this. (.item() waits
            # for the step to finish: only on the steps that print.)
            mean_loss = all_reduce(loss.clone()).item() / world_size
            now = time.time()
            images_per_s = window_steps * images_per_step / (now - window_start)
            eta = (now - start) / steps * (steps_per_epoch - step - 1 + (args.epochs - epoch - 1) * steps_per_epoch)
            # Step time and, within it, the wait for data (as the MetricLogger of torchvision's reference scripts
            # shows them): a data time near the step time means the GPU starves.
            log(f"epoch {epoch} step {step + 1}/{steps_per_epoch} loss {mean_loss:.4f} lr {lr:.5f} "
                f"{images_per_s:.1f} img/s time {(now - window_start) / window_steps:.3f} s (data "
                f"{window_wait / window_steps:.3f} s) eta {timedelta(seconds=round(eta))} peak mem "
                f"{records.peak_memory_gib(device):.2f} GiB")
            writer = records.draw(writer, epoch * steps_per_epoch + step + 1,  # x: the iteration, continued on resume
                                  {"train/loss": mean_loss, "train/lr": lr, "train/images_per_s": images_per_s})
            window_start = now
            window_steps = 0
            window_wait = 0.0
        if stopped and step + 1 < steps_per_epoch:  # at the last step the epoch is done: evaluated, then stopped
            break
    else:  # every step done: a NaN in the last votes still stops it; a signal, after the evaluation
        stopped = "nonfinite" if "nonfinite" in (stopped, vote.result()) else None
    elapsed = max(time.time() - start, 1e-9)
    # The epoch's sums over the ranks; the largest data wait; and each rank's peak memory (GPU: allocated,
    # CPU: resident), to see that rank 0 carries no more than the others, as DataParallel's first GPU did.
    sums = torch.zeros(world_size + 1, device=device)
    sums[0] = loss_sum
    sums[1 + rank] = records.peak_memory_gib(device)
    all_reduce(sums)
    data_wait = all_reduce(torch.tensor([data_wait / elapsed], device=device), dist.ReduceOp.MAX)
    return {"loss_sum": sums[0].item(), "steps": steps, "lr": lr, "data_wait": data_wait.item(),
            "images_per_s": steps * images_per_step / elapsed, "stopped": stopped,
            "peak_memory_gib": sums[1:].tolist()}


def sync_buffers(model):
    """Give every rank rank 0's buffers (BatchNorm running statistics), so that every rank evaluates the model rank
    0 saves. DDP broadcasts rank 0's buffers at the start of a training forward that follows one outside no_sync
    (each forward without --accum-steps; the first batch of each step with it), and each rank's forwards then move
    them with its own batches: after the last step every rank holds rank 0's statistics moved by its own last
    batches. (SyncBatchNorm on CUDA moves them alike on every rank; plain BatchNorm on the CPU does not.)"""
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
    Runs on the unwrapped model: without gradients DDP adds nothing, and its first forward after training would
    broadcast rank 0's buffers, a collective hidden in the loop (sync_buffers did that already). The only
    collective is the final all_reduce, so ranks may hold different numbers of images. loader:
    Subset(val set, this rank's indices), batch size 1. save_dir: write each prediction there.
    -> (confusion, (image, label, prediction) of this rank's first image, for the picture)."""
    model.eval()
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
    first = None
    for position, (images, labels) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True).long()
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


def prepare(args):
    """Everything a user can get wrong, found in this process alone before Step 1, and before anything is
    written: the flags, the checkpoint the run starts from, the data, the model, the output folders. -> what
    the run needs. (Rank 0 makes the folders last, with every check passed; run.sh's --check-only stops before.)"""
    use_cuda = torch.cuda.is_available()
    crop_size = checks.check_args(args, use_cuda)
    autocast = checks.autocast(args, use_cuda)
    eval_mode = inference.read_mode(args, training=not args.evaluate)  # a mistake in --eval-* found before any work
    recovery.set_quiet(bool(args.check_only))
    paths.hold_output(args)  # no other run writes into --output-dir while this one does (paths.py)
    start = checkpoints.decide_start(args)  # --resume PATH|auto, a restart, --weights: read now, on every rank
    checks.check_model_fits(args, crop_size)  # --model is known now: the checkpoint's, unless given
    paths.check_no_run_replaced(args, start)  # another run in --output-dir is continued, or moved aside
    train_set, val_set = open_datasets(args, crop_size, args.check_only or get_world_size())  # read, checked
    model = checkpoints.start_model(args, train_set.classes, start)  # on the CPU, with the weights it starts from
    if is_main_process() and not args.check_only:  # before init_process_group, which the other ranks wait in
        paths.make_run_outputs(args, start)
    channels_last = args.channels_last if args.channels_last is not None else use_cuda
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return SimpleNamespace(train_set=train_set, val_set=val_set, classes=train_set.classes, model=model, start=start,
                           autocast=autocast, memory_format=memory_format, eval_mode=eval_mode)


def make_optimizer(model, args):
    """SGD with the recipe's two learning rates: the pretrained backbone moves at --backbone-lr times the
    head's (each group's lr_mult, applied by adjust_learning_rate)."""
    backbone = list(model.backbone.parameters())
    head = [p for p in model.parameters() if id(p) not in {id(q) for q in backbone}]
    return torch.optim.SGD([{"params": backbone, "lr_mult": args.backbone_lr}, {"params": head, "lr_mult": 1.0}],
                           lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def evaluate_checkpoint(args, model, val_loader, run, device):
    """-e: evaluate --resume's model on val, print the table; rank 0 writes eval.json and the picture."""
    start = time.time()
    names = run.classes["names"]
    confusion, sample = evaluate(inference.wrap(model, run.eval_mode), val_loader, device, len(names), run.autocast,
                                 args.save_predictions)
    miou, iou = iou_from_confusion(confusion)
    records.print_iou_table(miou, iou, names)
    elapsed = time.time() - start
    num_images = len(run.val_set)  # each image once over the ranks
    if is_main_process():
        records.write_eval(args, {"miou": miou, "iou": records.iou_dict(iou, names), "num_images": num_images,
                                  "checkpoint": run.start.path, "eval_time_s": elapsed,
                                  "mode": inference.describe(run.eval_mode), "images_per_s": num_images / elapsed},
                           sample, run.classes["colors"])


@recovery.guarded("main.py", folder="output_dir")  # a mistake ends in one line, a lost peer is named (recovery.py)
def main(args):
    # Before the tutorial's steps, every mistake a user can make is found in this one process, before any GPU or
    # process group is touched and before anything is written. run.sh runs this part alone first (--check-only),
    # so that a mistake is said once, not by every worker and again after each of torchrun's restarts.
    run = prepare(args)
    if args.check_only:
        return

    # Step 1 (continued): the GPU this process drives, local_rank (parsed in get_args_parser). Before anything
    # touches CUDA: this process's CUDA context, its "cuda" tensors and NCCL's work then go to its own GPU, not
    # all to GPU 0.
    local_rank = args.local_rank
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
        with recovery.waiting_for_peers(args.dist_timeout):  # says what it waits for, if it waits (recovery.py)
            dist.init_process_group(backend=args.dist_backend or ("nccl" if use_cuda else "gloo"),
                                    timeout=timedelta(minutes=args.dist_timeout))
        recovery.start_heartbeat()  # every rank's step, so that a lost peer can be named (recovery.py)
    rank, world_size = get_rank(), get_world_size()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # torchrun's count of restarts after a failure
    log(f"{world_size} process(es), backend {dist.get_backend() if distributed else 'none'}, device {device.type}, "
        f"global batch {args.batch_size * world_size * args.accum_steps} (-b {args.batch_size} x {world_size} "
        f"process(es) x --accum-steps {args.accum_steps})" + (f", restart {restarts} by torchrun" if restarts else ""))

    # Step 3: the model, wrapped in DDP. prepare() built it, with the weights it starts from, the same on every
    # rank (DDP would also broadcast rank 0's when it wraps it). channels_last (NHWC): measured 1.36x faster with
    # bf16 on an H200 (BENCHMARKS.md; fp32 not measured yet).
    model = run.model.to(device, memory_format=run.memory_format)
    if use_cuda:
        # cuDNN times its kernels for each new input size once. Training crops have one size, and so do
        # Cityscapes' val images; a folder data set's val images of many sizes are timed once per size.
        torch.backends.cudnn.benchmark = True
    sync_bn = args.sync_bn if args.sync_bn is not None else use_cuda
    if sync_bn and world_size > 1:
        # Batch statistics over the global batch, not over each GPU's 2-8 images: segmentation batches per GPU
        # are small, and BatchNorm on them is noisy. Not on the CPU: DDP refuses SyncBatchNorm there. Not with
        # one process: on a GPU it is then plain BatchNorm, and ASPP's pooling BatchNorm keeps its case of one image.
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model_without_ddp = model
    if distributed:
        # device_ids: the one GPU of this process; on the CPU it must be None. The tutorial sets
        # find_unused_parameters=True, which makes DDP walk the autograd graph after every forward to
        # find parameters without gradients; DeepLab has none, so it is off unless asked for.
        # gradient_as_bucket_view: the gradients are views of DDP's all-reduce buckets, not a second copy
        # (zeroed in place in train_one_epoch, so that they stay views).
        model = DDP(model, device_ids=[local_rank] if use_cuda else None,
                    output_device=local_rank if use_cuda else None,
                    find_unused_parameters=args.find_unused_parameters, gradient_as_bucket_view=True)
        model_without_ddp = model.module
    if args.compile:
        # The DDP model, as PyTorch's DDP docs say: torch.compile then splits its graph at DDP's buckets, so that
        # the all-reduce still overlaps with the backward.
        model = torch.compile(model)

    # Step 4: DistributedSampler gives each rank its own part of the training set, so the DataLoader
    # must not shuffle (shuffle=False): the sampler shuffles, with the same seed on every rank.
    train_sampler = DistributedSampler(run.train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=args.seed)
    resumable = SkipFirst(train_sampler)  # the tutorial passes train_sampler; a resumed epoch skips what it has seen
    # The sampler pads every rank's share to the same length, so every rank runs the same number of steps, which
    # DDP needs; drop_last keeps every batch full. Augmentation is drawn from (seed, epoch, image index), so no
    # worker needs a seed of its own and a resumed run draws what an uninterrupted one would. pin_memory:
    # page-locked batches, whose copy to the GPU (non_blocking) does not make this process wait: it goes on
    # queueing the step's work while the copy runs. persistent_workers: training keeps its workers from
    # epoch to epoch; evaluation's exist only while it runs.
    workers = args.workers if args.workers is not None else default_workers()  # dataset.py
    loader_args = dict(num_workers=workers, pin_memory=use_cuda, worker_init_fn=recovery.worker_init)
    train_loader = DataLoader(run.train_set, batch_size=args.batch_size, shuffle=False, sampler=resumable,
                              drop_last=True, persistent_workers=workers > 0, **loader_args)
    val_shard = eval_shard(len(run.val_set), rank, world_size)
    val_loader = DataLoader(Subset(run.val_set, val_shard), batch_size=1, **loader_args)

    optimizer = make_optimizer(model_without_ddp, args)
    # float16 needs loss scaling against underflow; bfloat16 has float32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    position = checkpoints.resume_training(run.start, optimizer, scaler, args, world_size)
    if args.evaluate:
        evaluate_checkpoint(args, model_without_ddp, val_loader, run, device)
    elif position.epoch >= args.epochs:  # a requeued job that had finished: not a failure, nothing to do
        records.say_nothing_to_train(args, run.start.path, position.epoch)
    else:
        train(args, run, model, model_without_ddp, optimizer, scaler, train_loader, val_loader, train_sampler,
              resumable, position, device)
    if distributed:
        recovery.stop_heartbeat()  # before the process group goes: it writes into the group's store
        dist.destroy_process_group()  # without it NCCL warns of leaked resources at exit


def train(args, run, model, model_without_ddp, optimizer, scaler, train_loader, val_loader, train_sampler,
          resumable, position, device):
    """The epochs: train, evaluate, record (rank 0), and stop together when something asks."""
    # Optimizer steps: the position, the schedule and --epochs count them. An epoch has as many as the training set
    # holds global batches (-b x processes x --accum-steps), the same on every layout of that batch; every rank's
    # share (DistributedSampler's, padded) holds at least that many. What makes no whole step is left out, as
    # drop_last leaves out a partial batch.
    world_size = get_world_size()
    steps_per_epoch = len(run.train_set) // (args.batch_size * world_size * args.accum_steps)
    checkpoint_path = os.path.join(args.output_dir, "checkpoint.pth")
    if is_main_process():
        checkpoints.continue_run_at(args, run.start, position)  # metrics from here; a rewind keeps what it drops
    recovery.install_signal_handlers()  # SIGTERM / Ctrl-C: finish the step, save, exit 0 (recovery.py)
    writer = records.open_writer(args, position.epoch * steps_per_epoch + position.step + 1)
    best_miou = position.best_miou
    epoch_loss_sum = position.epoch_loss_sum
    log(f"training {args.model} on {len(run.train_set)} images ({steps_per_epoch} steps/epoch), epochs "
        f"{position.epoch}..{args.epochs - 1} (counted from 0), evaluating on {len(run.val_set)}")
    for epoch in range(position.epoch, args.epochs):
        # Step 4 (continued): the tutorial never calls set_epoch. The sampler seeds its shuffle with
        # seed + epoch; without this call every epoch visits the images in the same order.
        train_sampler.set_epoch(epoch)
        first_step = position.step if epoch == position.epoch else 0
        resumable.skip = first_step * args.batch_size * args.accum_steps  # a resumed epoch: the batches not yet seen
        run.train_set.epoch = epoch  # the augmentation's draw; persistent workers see it (shared memory)
        epoch_start = time.time()
        trained = train_one_epoch(model, optimizer, scaler, train_loader, device, epoch, first_step,
                                  steps_per_epoch, args, run.autocast, run.memory_format, writer)
        epoch_loss_sum += trained["loss_sum"]
        sync_buffers(model_without_ddp)  # every rank evaluates, and rank 0 saves, rank 0's BatchNorm statistics
        if trained["stopped"]:  # a signal: rank 0 saves where the ranks are, all exit 0; a NaN: nothing saved
            step = first_step + trained["steps"]
            recovery.stop_in_epoch(trained["stopped"], epoch, step, steps_per_epoch, checkpoint_path,
                                   lambda: checkpoints.save(checkpoints.state(
                                       model_without_ddp, optimizer, scaler, args, world_size, run.classes,
                                       epoch=epoch, step=step, best_miou=best_miou, epoch_loss_sum=epoch_loss_sum),
                                       checkpoint_path, keep_previous=True))
            break
        eval_start = time.time()
        confusion, sample = evaluate(inference.wrap(model_without_ddp, run.eval_mode), val_loader, device,
                                     len(run.classes["names"]), run.autocast,
                                     args.save_predictions if epoch == args.epochs - 1 else None)
        miou, iou = iou_from_confusion(confusion)
        records.print_iou_table(miou, iou, run.classes["names"])
        is_best = miou > best_miou  # NaN (no val pixel to measure) is never the best
        best_miou = miou if is_best else best_miou
        problem = None
        if is_main_process():
            state = checkpoints.state(model_without_ddp, optimizer, scaler, args, world_size, run.classes,
                                      epoch=epoch + 1, step=0, best_miou=best_miou, epoch_loss_sum=0.0)
            problem = records.write_epoch(args, state, is_best, sample, {
                "epoch": epoch, "iteration": (epoch + 1) * steps_per_epoch,
                "train_loss": epoch_loss_sum / (steps_per_epoch * world_size), "lr": trained["lr"], "miou": miou,
                "iou": records.iou_dict(iou, run.classes["names"]), "train_img_per_s": trained["images_per_s"],
                "data_wait_fraction": trained["data_wait"], "epoch_time_s": time.time() - epoch_start,
                "eval_time_s": time.time() - eval_start, "world_size": world_size,
                "peak_memory_gib": trained["peak_memory_gib"]}, writer,
                estimate=trained["steps"] / steps_per_epoch if epoch == position.epoch else None)
        epoch_loss_sum = 0.0
        # Every rank learns whether rank 0 could write (a full disk) and whether a signal came during the
        # evaluation: all stop together, rank 0 saying why.
        if recovery.stop_after_epoch(problem, device, checkpoint_path, last=epoch == args.epochs - 1):
            break
    else:
        records.say_where_things_are(args, best_miou)
    records.close_writer(writer)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
