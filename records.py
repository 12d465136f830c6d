"""What a run leaves behind, written by rank 0 alone (several ranks writing one file corrupt it): the per-class
IoU table, metrics.jsonl, the pictures, the checkpoints after each epoch, eval.json, and with --tensorboard the
curves. main.py decides what to record; this module writes it, and turns a failed write into one line.

    records.print_iou_table(miou, iou, names)
    writer = records.open_writer(args, first_iteration)        # TensorBoard's, or None
    writer = records.draw(writer, iteration, {"train/loss": 0.3})
    problem = records.write_epoch(args, state, is_best, sample, record, writer)   # None, or why it failed
    records.write_eval(args, result, sample, colors)           # -e
    records.say_where_things_are(args, best_miou)              # the end of training: the files, and what each is
    records.say_nothing_to_train(args, checkpoint_path)        # a run that had finished
"""
import contextlib
import json
import math
import os
import resource
from datetime import timedelta

import torch
from PIL import Image

import checkpoints
import paths
from dataset import CLASS_COLORS
from paths import fail
from recovery import is_main_process, log


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


def iou_dict(iou, names):
    """{class name: IoU}, None for classes absent from the val set (JSON has no NaN)."""
    return {name: (None if math.isnan(value) else value) for name, value in zip(names, iou.tolist())}


def print_iou_table(miou, iou, names):
    lines = [f"  {name:<14} {value * 100:6.2f}" if not math.isnan(value) else f"  {name:<14}    n/a"
             for name, value in zip(names, iou.tolist())]
    log("per-class IoU (%):\n" + "\n".join(lines) + f"\n  {'mIoU':<14} {miou * 100:6.2f}")


def peak_memory_gib(device):
    """This process's peak memory: allocated on its GPU, or resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # resident set, KiB on Linux


def palette(colors):
    """(256, 3) uint8: a colour for every class index, black past the classes (255: ignore)."""
    table = torch.zeros(256, 3, dtype=torch.uint8)
    table[:len(colors)] = torch.tensor(colors, dtype=torch.uint8)
    return table


def colorize(labels, colors=CLASS_COLORS):
    """(H, W) class indices -> (H, W, 3) uint8 in the classes' colours (Cityscapes' by default); ignore is black."""
    return palette(colors)[labels.long()]


def save_picture(path, sample, colors):
    """image | ground truth | prediction, side by side, in the classes' colours (ignore in black). -> the picture."""
    image, label, prediction = sample  # image: uint8 (3, H, W), as the data set gives it
    picture = torch.cat([image.permute(1, 2, 0), colorize(label, colors), colorize(prediction, colors)], dim=1)
    Image.fromarray(picture.numpy()).save(path)
    return picture


def open_writer(args, first_iteration):
    """Rank 0's TensorBoard writer with --tensorboard, else None. purge_step: TensorBoard drops what a stopped
    run drew from that iteration on, so that a resumed run draws no stretch twice."""
    if not (args.tensorboard and is_main_process()):
        return None
    from torch.utils.tensorboard import SummaryWriter  # optional: check_args found it installed
    try:
        return SummaryWriter(os.path.join(args.output_dir, "tensorboard"), purge_step=first_iteration)
    except OSError as error:
        fail(f"cannot write TensorBoard's files in {args.output_dir} ({error})", this_rank=True)


def write_epoch(args, state, is_best, sample, record, writer=None, estimate=None):
    """After an epoch (rank 0 alone: several ranks writing one file corrupt it): checkpoint.pth (the one it
    replaces kept as checkpoint.prev.pth), best.pth when the mIoU is the best yet, the picture, a line of
    metrics.jsonl, TensorBoard's points (writer), and what the user should know. -> None, or why a file could
    not be written (a full disk), which every rank then stops on. estimate: after the run's first epoch, the
    fraction of it this run trained (less than 1 when it resumed part-way), for the time the others will take."""
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
                if value is not None and not math.isnan(value):  # a class absent from val has no IoU
                    writer.add_scalar(name, value, record["iteration"])
            writer.add_image("val/image_truth_prediction", picture.numpy(), record["iteration"], dataformats="HWC")
            writer.flush()
        state = checkpoints.seal(state)  # its digest, computed once for both files
        if is_best:
            checkpoints.save(state, os.path.join(args.output_dir, "best.pth"))
        checkpoints.save(state, checkpoint_path, keep_previous=True)
    except (OSError, paths.UserError) as error:
        return str(error) if isinstance(error, paths.UserError) else f"cannot write in {args.output_dir} ({error})"
    miou = "undefined (no val pixel of any class)" if math.isnan(record["miou"]) else f"{record['miou']:.4f}"
    log(f"epoch {record['epoch']}: train loss {record['train_loss']:.4f}, {record['train_img_per_s']:.1f} img/s, "
        f"mIoU {miou} (best {best_text(state['best_miou'])}); saved {checkpoint_path}")
    if record["data_wait_fraction"] > 0.05:
        log(f"note: the training loop waited {record['data_wait_fraction']:.0%} of its time for data: raise -j if "
            "the machine has the cores" + ("" if args.cache_dir else ", or decode once with --cache-dir"))
    left = args.epochs - record["epoch"] - 1
    if estimate and left:  # after the first epoch, so that nobody wonders whether it hangs
        training = (record["epoch_time_s"] - record["eval_time_s"]) / estimate  # the whole epoch's training
        per_epoch = training + record["eval_time_s"]
        log(f"the other {left} epoch(s) will take about {timedelta(seconds=round(per_epoch * left))}")


def best_text(miou):
    """The best mIoU so far, as a person reads it: none before the first evaluation."""
    return f"{miou:.4f}" if math.isfinite(miou) else "none yet"


def write_eval(args, result, sample, colors):
    """-e: eval.json and the picture of the first val image. An earlier eval.json is replaced with a word that
    says what it held. A write that fails (a full disk) ends in one line."""
    path = os.path.join(args.output_dir, "eval.json")
    earlier = ""
    try:
        with open(path) as f:
            old = json.load(f)
        earlier = f"; it replaces the earlier one (mIoU {old['miou']:.4f} of {old.get('checkpoint')}, {old.get('mode')})"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none, or not one of ours: nothing to say of it
    try:
        checkpoints.write_atomically(path, (json.dumps(result, indent=1) + "\n").encode())
        save_picture(os.path.join(args.output_dir, "vis", "eval.png"), sample, colors)
    except OSError as error:
        fail(f"cannot write in {args.output_dir} ({error.strerror or error}): free space there, or give -e another "
             f"{paths.named('--output-dir')}", this_rank=True)
    log(f"wrote {path}" + (f" and predictions to {args.save_predictions}" if args.save_predictions else "") + earlier)


def say_where_things_are(args, best_miou):
    """The end of training: the best mIoU, then each file the run wrote and what it is (the README shows this)."""
    if not is_main_process():
        return
    out = args.output_dir
    files = [("checkpoint.pth", "the last epoch: model, optimizer, GradScaler, position; run again to go on"),
             ("checkpoint.prev.pth", "the one before it, kept in case checkpoint.pth is damaged"),
             ("best.pth", "the epoch with the best val mIoU: for -e, predict.py, --weights"),
             ("metrics.jsonl", "one line per epoch: loss, lr, mIoU, IoU per class, images/s, data wait, memory"),
             ("vis/", "epoch_NNN.png: image | ground truth | prediction"),
             ("tensorboard/", f"the curves: tensorboard --logdir {out}")]
    found = [(os.path.join(out, name), what) for name, what in files if os.path.exists(os.path.join(out, name))]
    if args.save_predictions:
        found.append((args.save_predictions.rstrip("/") + "/", "the last epoch's val predictions"))
    width = max((len(path) for path, _ in found), default=0)
    best = f"{best_miou:.4f}" if math.isfinite(best_miou) else "undefined (no val pixel of any class)"
    log(f"done: best mIoU {best}. Where things are:\n" + "\n".join(f"  {path:<{width}}  {what}" for path, what in found))


def say_nothing_to_train(args, checkpoint_path, done):
    """A run that had finished (done: its epochs), started again (a requeued job, run.sh's second call)."""
    finished = (f"has finished all {done} epochs of --epochs {args.epochs}" if done == args.epochs else
                f"has finished {done} epochs, as many as --epochs {args.epochs} asks or more")
    log(f"nothing to train: {checkpoint_path} {finished}; raise --epochs to train longer, or evaluate it with -e"
        + ("; --tensorboard draws the curves of a run as it trains: give it to a new run, in another "
           f"{paths.named('--output-dir')}" if args.tensorboard else ""))


def close_writer(writer):
    if writer is not None:
        with contextlib.suppress(OSError):  # a full disk now: said already, by the epoch's failed save
            writer.close()
