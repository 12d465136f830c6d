"""What a run leaves beside its checkpoint, written by rank 0 alone (several ranks writing one file corrupt it):
metrics.jsonl, best.pth, the pictures, eval.json, with --tensorboard the curves, and at the end the list of where
things are. A write that fails (a full disk) ends the run in one line.

    records.open_tensorboard(args, first_iteration)   # the preflight: TensorBoard's writer, with --tensorboard
    records.draw(iteration, loss, lr, images_per_s)   # main.py's progress lines, as TensorBoard's curves
    picture = records.picture(model, val_loader, device, args)  # rank 0's first val image, predicted again
    records.write_epoch(args, epoch, steps_per_epoch, stats, train_loss, evaluation, picture, state, is_best)
    records.write_eval(args, evaluation, picture, classes, num_images)   # -e
    records.say_where_things_are(args, best_miou)    # the end of training: the files, and what each is
"""
import contextlib
import json
import math
import os
from datetime import timedelta

import torch
from PIL import Image

from . import checks, inference, job, paths, stops
from dataset import CLASS_COLORS, normalize
from .errors import fail
from .job import RUN, is_main_process, log, named



def open_tensorboard(args, first_iteration):
    """Rank 0's TensorBoard writer with --tensorboard, which makes OUTPUT_DIR/tensorboard/ and its first file.
    purge_step: TensorBoard drops what a stopped run drew from that iteration on, so that a resumed run draws no
    stretch twice."""
    RUN.records.update(writer=None, estimated=False)
    if not (args.tensorboard and is_main_process()):
        return
    from torch.utils.tensorboard import SummaryWriter  # optional: the preflight found it installed
    try:
        RUN.records["writer"] = SummaryWriter(os.path.join(args.output_dir, "tensorboard"), purge_step=first_iteration)
    except OSError as error:
        fail(f"cannot write TensorBoard's files in {args.output_dir} ({error})", this_rank=True)


def draw(iteration, loss, lr, images_per_s):
    """The training curves' points into TensorBoard's files (with --tensorboard), at the iteration (continued on
    resume). A write that fails (a full disk) says so once and draws no more: the epoch's checkpoint then stops the
    run with one line."""
    writer = RUN.records["writer"]
    if writer is None:
        return
    try:
        for name, value in (("train/loss", loss), ("train/lr", lr), ("train/images_per_s", images_per_s)):
            writer.add_scalar(name, value, iteration)
    except OSError as error:
        log(f"warning: TensorBoard cannot write ({error}): no curves for the rest of this run")
        RUN.records["writer"] = None


def close_tensorboard():
    writer, RUN.records["writer"] = RUN.records["writer"], None
    if writer is not None:
        with contextlib.suppress(OSError):  # a full disk now: said already
            writer.close()


def iou_dict(iou, names):
    """{class name: IoU}, None for classes absent from the val set (JSON has no NaN)."""
    return {name: (None if math.isnan(value) else value) for name, value in zip(names, iou.tolist())}


def palette(colors):
    """(256, 3) uint8: a colour for every class index, black past the classes (255: ignore)."""
    table = torch.zeros(256, 3, dtype=torch.uint8)
    table[:len(colors)] = torch.tensor(colors, dtype=torch.uint8)
    return table


def colorize(labels, colors=CLASS_COLORS):
    """(H, W) class indices -> (H, W, 3) uint8 in the classes' colours (Cityscapes' by default); ignore is black."""
    return palette(colors)[labels.long()]


@torch.inference_mode()
def picture(model, loader, device, args):
    """Rank 0: (image, label, prediction) of its first val image, for vis/ and TensorBoard; None on the other ranks.
    main.py's evaluation keeps no image, so the model (the one evaluated: unwrapped, with -e's mode) predicts this
    one again, as evaluate() did: the same pixels, the same prediction. No collective."""
    if not is_main_process():
        return None
    image, label = loader.dataset[0]  # the val loader's Subset of rank 0's images: its first is the val set's first
    model.eval()
    with checks.autocast(args, device.type == "cuda")():
        prediction = model(normalize(image[None].to(device))).argmax(1)[0].cpu()
    return image, label, prediction


def save_picture(path, sample, colors):
    """image | ground truth | prediction, side by side, in the classes' colours (ignore in black). -> the picture."""
    image, label, prediction = sample  # image: uint8 (3, H, W), as the data set gives it
    picture = torch.cat([image.permute(1, 2, 0), colorize(label, colors), colorize(prediction, colors)], dim=1)
    Image.fromarray(picture.numpy()).save(path)
    return picture


def write_epoch(args, epoch, steps_per_epoch, stats, train_loss, evaluation, sample, state, is_best):
    """After an epoch's evaluation, before main.py saves checkpoint.pth (rank 0 alone): best.pth when the mIoU is the
    best yet, the picture, a line of metrics.jsonl, TensorBoard's points, and what the user should know. A run
    stopped between these writes resumes before this epoch, and writes them all again (rewrite_run_files_at drops the
    line). A write that fails is told to the ranks' vote after the epoch (stops.write_failed). stats:
    main.EpochStats; evaluation: main.Evaluation; sample: picture()'s; state: the checkpoint about to be saved."""
    if not is_main_process():
        return
    iteration = (epoch + 1) * steps_per_epoch
    record = {"epoch": epoch, "iteration": iteration, "train_loss": train_loss, "lr": stats.lr,
              "miou": evaluation.miou, "iou": iou_dict(evaluation.iou, state["classes"]["names"]),
              "train_img_per_s": stats.images_per_s, "data_wait_fraction": stats.data_wait,
              "epoch_time_s": stats.seconds + evaluation.seconds, "eval_time_s": evaluation.seconds,
              "world_size": job.get_world_size(), "peak_memory_gib": stats.peak_memory_gib}
    try:
        if is_best:
            paths.write_atomically(os.path.join(args.output_dir, "best.pth"), lambda f: torch.save(state, f))
        drawn = save_picture(os.path.join(args.output_dir, "vis", f"epoch_{epoch:03d}.png"), sample,
                             state["classes"]["colors"])
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if RUN.records["writer"] is not None:
            _draw_epoch(record, drawn)
    except (OSError, RuntimeError) as error:  # torch.save says a failed write as a RuntimeError
        if not hasattr(error, "free_mib"):
            paths.note_free_space(error, os.path.join(args.output_dir, "metrics.jsonl"))
        stops.write_failed(f"cannot write in {args.output_dir} ({paths.why_not_written(error)}): free space, then "
                           f"to resume, {job.resume_advice()}")  # every rank stops at the epoch's end, together
        return
    if stats.data_wait > 0.05:
        log(f"note: the training loop waited {stats.data_wait:.0%} of its time for data: raise -j if the machine has "
            "the cores" + ("" if args.cache_dir else ", or decode once with --cache-dir"))
    left = args.epochs - epoch - 1
    if not RUN.records["estimated"] and left:  # after the run's first epoch, so that nobody wonders whether it hangs
        RUN.records["estimated"] = True
        training = stats.seconds * steps_per_epoch / max(stats.steps, 1)  # a whole epoch's, also when it resumed
        estimate = (training + evaluation.seconds) * left
        log(f"the other {left} epoch(s) will take about {timedelta(seconds=round(estimate))}")


def _draw_epoch(record, picture):
    """The epoch's points, at the iteration it ends on (the step curves' x-axis), and its picture."""
    writer, iteration = RUN.records["writer"], record["iteration"]
    for name, value in [("val/mIoU", record["miou"]), ("train/epoch_loss", record["train_loss"]),
                        *((f"val_IoU/{name}", value) for name, value in record["iou"].items())]:
        if value is not None and not math.isnan(value):  # a class absent from val has no IoU
            writer.add_scalar(name, value, iteration)
    writer.add_image("val/image_truth_prediction", picture.numpy(), iteration, dataformats="HWC")
    writer.flush()


def write_eval(args, evaluation, sample, classes, num_images):
    """-e (rank 0 alone): eval.json and the picture of the first val image. An earlier eval.json is replaced with a
    word that says what it held. A write that fails (a full disk) ends in one line."""
    if not is_main_process():
        return
    path = os.path.join(args.output_dir, "eval.json")
    earlier = ""
    try:
        with open(path) as f:
            old = json.load(f)
        earlier = (f"; it replaces the earlier one (mIoU {old['miou']:.4f} of {old.get('checkpoint')}, "
                   f"{old.get('mode')})")
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none, or not one of ours: nothing to say of it
    result = {"miou": evaluation.miou, "iou": iou_dict(evaluation.iou, classes["names"]), "num_images": num_images,
              "checkpoint": args.resume, "eval_time_s": evaluation.seconds,
              "mode": inference.describe(inference.read_mode(args)), "images_per_s": num_images / evaluation.seconds}
    try:
        paths.write_atomically(path, (json.dumps(result, indent=1) + "\n").encode())
        save_picture(os.path.join(args.output_dir, "vis", "eval.png"), sample, classes["colors"])
    except OSError as error:
        fail(f"cannot write in {args.output_dir} ({error.strerror or error}): free space there, or give -e another "
             f"{named('--output-dir')}", this_rank=True)
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
    lines = [f"  {path:<{width}}  {what}" for path, what in found]
    log(f"done: best mIoU {best}. Where things are:\n" + "\n".join(lines))
