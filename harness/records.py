"""What a run leaves beside its checkpoint, written by rank 0 alone (several ranks writing one file corrupt it):
metrics.jsonl, best.pth, the pictures, eval.json, with --tensorboard the curves, and at the end the list of where
things are. A write that fails (a full disk) ends the run in one line; TensorBoard's curves and --save-predictions
(which every rank writes, through the data set) cost only themselves, never the epoch's checkpoint.

    records.check_predictions_folder(args, val_set)   # the preflight: no data set's files replaced by predictions
    records.open_tensorboard(args, first_iteration)   # the preflight: TensorBoard's writer, with --tensorboard
    records.watch_predictions(val_set)                # the preflight: a prediction that cannot be written, noted
    records.draw(iteration, loss, lr, images_per_s)   # main.py's progress lines, as TensorBoard's curves
    picture = records.picture(model, val_loader, device, args, normalize)  # rank 0's first val image, predicted again
    records.write_epoch(args, epoch, steps_per_epoch, stats, train_loss, evaluation, picture, state, is_best)
    records.write_eval(args, evaluation, picture, classes, num_images)   # -e
    records.say_where_things_are(args, best_miou)    # the end of training: the files, and what each is
"""
import contextlib
import json
import math
import os
import pathlib
from datetime import timedelta

import torch
from PIL import Image

from . import checkpoints, checks, inference, job, paths, stops
from dataset import is_prediction
from .errors import fail
from .job import RUN, is_main_process, log, named



def open_tensorboard(args, first_iteration):
    """Rank 0's TensorBoard writer with --tensorboard, which makes OUTPUT_DIR/tensorboard/ and its first file.
    purge_step: TensorBoard drops what a stopped run drew from that iteration on, so that a resumed run draws no
    stretch twice. (job.begin_run reset RUN.records, and the writer before it with them.)"""
    if not (args.tensorboard and is_main_process()):
        return
    from torch.utils.tensorboard import SummaryWriter  # optional: the preflight found it installed
    folder = os.path.join(args.output_dir, "tensorboard")
    try:
        RUN.records.writer = SummaryWriter(folder, purge_step=first_iteration)
    except OSError as error:
        fail(paths.cannot_write(f"TensorBoard's files in {args.output_dir}", error, folder), this_rank=True)


def draw(iteration, loss, lr, images_per_s):
    """main.py's progress lines' numbers, as TensorBoard's training curves (_draw)."""
    _draw(iteration, [("train/loss", loss), ("train/lr", lr), ("train/images_per_s", images_per_s)])


def _draw(iteration, points, picture=None):
    """Points (name, value), and a picture, into TensorBoard's files (with --tensorboard), at the iteration (continued
    on resume). A value that is None or NaN is left out (a class absent from val has no IoU). A write that fails (a
    full disk) says so once and draws no more. The curves are not the run's: the run goes on, and its checkpoint says
    whether the disk is full for it too."""
    writer = RUN.records.writer
    if writer is None:
        return
    try:
        for name, value in points:
            if value is not None and not math.isnan(value):
                writer.add_scalar(name, value, iteration)
        if picture is not None:
            writer.add_image("val/image_truth_prediction", picture.numpy(), iteration, dataformats="HWC")
            writer.flush()
    except OSError as error:
        log(f"warning: TensorBoard cannot write ({error}): no curves for the rest of this run")
        RUN.records.writer = None


def close_tensorboard():
    writer, RUN.records.writer = RUN.records.writer, None
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


@torch.inference_mode()
def picture(model, loader, device, args, normalize):
    """Rank 0: (image, label, prediction) of its first val image, for vis/ and TensorBoard; None on the other ranks.
    main.py's evaluation keeps no image, so the model (the one evaluated: unwrapped, with -e's mode) predicts this
    one again, as evaluate() did: the same pixels (normalize: main.py's), the same prediction. No collective."""
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
    table = palette(colors)  # (H, W) class indices -> (H, W, 3) colours: table[indices]
    picture = torch.cat([image.permute(1, 2, 0), table[label.long()], table[prediction.long()]], dim=1)
    paths.write_atomically(path, lambda f: Image.fromarray(picture.numpy()).save(f, format="PNG"), durable=False)
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
    out = args.output_dir
    metrics = os.path.join(out, "metrics.jsonl")
    try:
        if is_best:
            paths.write_atomically(os.path.join(out, "best.pth"), lambda f: torch.save(checkpoints.stamped(state), f))
        drawn = save_picture(os.path.join(out, "vis", f"epoch_{epoch:03d}.png"), sample, state["classes"]["colors"])
        # Written whole, as every file is, never through a link left there: its lines, then the record (on a line of
        # its own below a note a user appended without a newline).
        lines = pathlib.Path(metrics).read_bytes().splitlines() if os.path.exists(metrics) else []
        paths.write_atomically(metrics, b"\n".join(lines + [json.dumps(record).encode()]) + b"\n")
    except (OSError, RuntimeError) as error:  # torch.save says a failed write as a RuntimeError
        if not hasattr(error, "free_mib"):
            paths.note_free_space(error, metrics)
        # every rank stops at the epoch's end, together
        stops.write_failed(paths.cannot_write(f"in {out}", error, metrics, checkpoint=job.checkpoint_path(out)))
        return
    _draw(iteration, [("val/mIoU", evaluation.miou), ("train/epoch_loss", train_loss),
                      *((f"val_IoU/{name}", value) for name, value in record["iou"].items())], drawn)
    if stats.data_wait > 0.05:
        log(f"note: the training loop waited {stats.data_wait:.0%} of its time for data: raise -j if the machine has "
            "the cores" + ("" if args.cache_dir else ", or decode once with --cache-dir"))
    left = args.epochs - epoch - 1
    if not RUN.records.estimated and left and stats.steps:  # after the run's first epoch that trained a step, so
        # that nobody wonders whether it hangs
        RUN.records.estimated = True
        training = stats.seconds * steps_per_epoch / stats.steps  # a whole epoch's, also when it resumed
        estimate = (training + evaluation.seconds) * left
        log(f"the other {left} epoch(s) will take about {timedelta(seconds=round(estimate))}")


def write_eval(args, evaluation, sample, classes, num_images):
    """-e (rank 0): the picture of the first val image, then eval.json. An earlier eval.json is replaced with a word
    that says what it held, and only by a whole new one: a write that fails (a full disk) leaves it as it was, and
    ends in one line that says so. Then, on every rank, predictions that could not be written end the run in one
    line (say_lost_predictions)."""
    if is_main_process():
        path = os.path.join(args.output_dir, "eval.json")
        earlier = ""
        try:
            with open(path) as f:
                old = json.load(f)
            earlier = (f"; it replaces the earlier one (mIoU {old['miou']:.4f} of {old.get('checkpoint')}, "
                       f"{old.get('mode')})")
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none, or not one of ours: nothing to say of it
        result = {"miou": evaluation.miou, "iou": iou_dict(evaluation.iou, classes["names"]),
                  "num_images": num_images, "checkpoint": args.resume, "eval_time_s": evaluation.seconds,
                  "mode": inference.describe(inference.read_mode(args)),
                  "images_per_s": num_images / evaluation.seconds}
        try:
            save_picture(os.path.join(args.output_dir, "vis", "eval.png"), sample, classes["colors"])
            paths.write_atomically(path, (json.dumps(result, indent=1) + "\n").encode())  # last: replaced whole, or not
        except OSError as error:
            as_it_was = "eval.json is as it was" if os.path.isfile(path) else "no eval.json was written"
            fail(paths.cannot_write(f"in {args.output_dir}", error, path, f"{as_it_was}; ",
                                    f", or give -e another {named('--output-dir')}"), this_rank=True)
        lost = RUN.records.lost_predictions
        written = f" and predictions to {args.save_predictions}" if args.save_predictions and not lost else ""
        log(f"wrote {path}{written}" + earlier)
    say_lost_predictions(args)


def say_where_things_are(args, best_miou):
    """The end of training: the best mIoU, then each file the run wrote and what it is (the README shows this). On
    every rank, predictions that could not be written end the run in one line instead (say_lost_predictions)."""
    say_lost_predictions(args)
    if not is_main_process():
        return
    out = args.output_dir
    files = [("checkpoint.pth", "the last epoch: model, optimizer, GradScaler, position; run again to go on"),
             ("checkpoint.prev.pth", "the one before it, kept in case checkpoint.pth is damaged"),
             ("best.pth", "the epoch with the best val mIoU: for -e, predict.py, --weights"),
             ("metrics.jsonl", "one line per epoch: loss, lr, mIoU, IoU per class, images/s, data wait, memory"),
             ("vis/", "epoch_NNN.png: image | ground truth | prediction"),
             ("tensorboard/", f"the curves: tensorboard --logdir {out}")]
    found = [(path, what) for name, what in files if os.path.exists(path := os.path.join(out, name))]
    if args.save_predictions:
        found.append((args.save_predictions.rstrip("/") + "/", "the last epoch's val predictions"))
    width = max((len(path) for path, _ in found), default=0)
    best = f"{best_miou:.4f}" if math.isfinite(best_miou) else "undefined (no val pixel of any class)"
    lines = [f"  {path:<{width}}  {what}" for path, what in found]
    log(f"done: best mIoU {best}. Where things are:\n" + "\n".join(lines))


# --- --save-predictions ----------------------------------------------------------------------------------------
def check_predictions_folder(args, val_set):
    """--save-predictions, before any work (every rank): neither a data set's folder nor inside one (any data set's,
    not --data's alone: another one's masks/val/ is its ground truth), and holding no file that a prediction would
    replace unless save_prediction wrote it (its PNG says so: dataset.is_prediction). val_set: where each prediction
    goes (prediction_path; a data set of your own without it: the first check alone)."""
    folder = args.save_predictions
    if folder is None:
        return
    real = os.path.realpath(folder)
    for place in paths.above(real):
        found = [name for name in ("classes.json", "leftImg8bit") if os.path.exists(os.path.join(place, name))]
        if found:
            where = "is" if place == real else "is inside"
            fail(f"--save-predictions {folder} {where} the data set {place} (it holds {found[0]}): predictions would "
                 "land among its files, and a data set's masks are its ground truth; give a folder outside every "
                 "data set")
    if not hasattr(val_set, "prediction_path"):
        return
    there = [path for path in (val_set.prediction_path(index, folder) for index in range(len(val_set)))
             if os.path.lexists(path) and not is_prediction(path)]
    if there:
        fail(f"--save-predictions {folder} holds {len(there)} file(s) that the predictions would replace (e.g. "
             f"{there[0]}), which no --save-predictions wrote: give a new or empty folder")


def watch_predictions(val_set):
    """val_set's save_prediction, which main.py's evaluate() calls on every rank, made to note a write that fails (a
    full disk) instead of raising it out of the evaluation: the evaluation finishes, the epoch is saved (or -e's
    eval.json written), and say_lost_predictions then ends the run in one line. After a first failure the rest are
    counted, not tried; a file half written is removed."""
    save = val_set.save_prediction

    def save_or_note(index, prediction, folder):
        lost = RUN.records.lost_predictions
        if lost is not None:
            lost[1] += 1
            return
        try:
            save(index, prediction, folder)
        except OSError as error:
            paths.note_free_space(error, folder)
            RUN.records.lost_predictions = [error, 1]
            if hasattr(val_set, "prediction_path"):
                with contextlib.suppress(OSError):
                    os.remove(val_set.prediction_path(index, folder))
    val_set.save_prediction = save_or_note


def say_lost_predictions(args):
    """Predictions this rank could not write, in one line (every rank says its own), once what the run had to keep
    is kept: the last epoch's checkpoint, or -e's eval.json. With how to write them again, which works as written."""
    lost = RUN.records.lost_predictions
    if lost is None:
        return
    error, count = lost
    folder = args.save_predictions
    if args.evaluate:
        before, after = "the evaluation is in eval.json; ", ", then run the same command again"
    else:
        checkpoint = job.checkpoint_path(args.output_dir)
        again = (f"./run.sh -e --resume {checkpoint} --save-predictions {folder}" if job.env().under_run_sh else
                 f"-e --resume {checkpoint} --data {args.data} --output-dir {args.output_dir} --save-predictions "
                 f"{folder}")
        before, after = f"the last epoch's checkpoint, {checkpoint}, is kept; ", f", then write them from it: {again}"
    # The advice from the errno: a full disk, permissions, the file-size limit...
    fail(paths.cannot_write(f"{count} prediction(s) in {folder}", error, folder, before, after), this_rank=True)
