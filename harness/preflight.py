"""Everything a user can get wrong, found in this process before any work, and only then the run's folders made.
run.sh runs main.py with --check-only first, which ends after these checks: a mistake is said once, not by every
worker and again after each of torchrun's restarts. main.py calls it twice, before Step 1:

    args.resume = preflight.check_flags_and_hold_output(args)
    preflight.check_data_and_make_outputs(args, train_set, val_set, checkpoint)

The first holds --output-dir, reads the checkpoint the run starts from and completes args (after it, the harness
changes nothing of args); the second checks the data, ends --check-only, and makes the run's folders.
"""
import hashlib
import os
from types import SimpleNamespace

import torch

from . import checkpoints, checks, inference, job, paths, records, stops
from dataset import IGNORE_INDEX
from .errors import NOTHING_TO_TRAIN, Finished, fail
from .job import RUN, log, named
from models import MODEL_NAMES

# main.py's TRAIN_LONGER, word for word (the lesson imports nothing of the harness, nor the harness main.py):
# --check-only says what main.py would (tests/test_lesson.py compares the two).
TRAIN_LONGER = ("evaluate it with -e, or train longer with a larger --epochs: --epochs is also the poly schedule's "
                "length, so the learning rate rises again (at twice the epochs, to about half of --lr)")


def add_arguments(parser):
    """The flags of what the harness adds to main.py's lesson."""
    parser.add_argument("--weights", metavar="PATH", help="start from a trained model (fine-tuning); a classifier for "
                        "other classes starts afresh (--pretrained-backbone is then not used)")
    parser.add_argument("--overwrite", action="store_true", help="train afresh into an --output-dir that holds "
                        "another run, which is moved into OUTPUT_DIR/replaced-DATE/ (nothing is deleted)")
    parser.add_argument("--tensorboard", action="store_true", help="curves and pictures in OUTPUT_DIR/tensorboard")
    parser.add_argument("--check-only", type=int, metavar="WORLD_SIZE", help="check flags, data and checkpoints "
                        "for WORLD_SIZE processes, then exit (run.sh does, before torchrun)")
    inference.add_arguments(parser)  # -e with multi-scale, flip, sliding window: --eval-scales, ... (inference.py)
    resume = parser._option_string_actions["--resume"]  # the lesson's flag; the harness adds 'auto' to it
    resume.metavar = "PATH|auto"
    resume.help += "; 'auto': OUTPUT_DIR/checkpoint.pth if it exists"


def check_flags_and_hold_output(args):
    """The flags, every number and what they say together; --output-dir held for this run before anything there
    is read or decided (one folder, one run: paths.hold_output writes OUTPUT_DIR/.held), and what is there checked
    against what the run writes (paths.check_run_files); the checkpoint the run starts from decided and read
    (checkpoints.decide_start); args completed (_complete_args), the harness's only change to it. -> the
    checkpoint's path for --resume ('' for a fresh start)."""
    job.remember_command(args, quiet=bool(args.check_only))
    checks.check_numbers(args, checks.MAIN)
    checks.check_args(args, torch.cuda.is_available())
    inference.read_mode(args, training=not args.evaluate)  # a mistake in --eval-* found before any work
    with stops.deferred():  # a stop while it takes the folder: once it holds it (let go at the end), not half-way
        paths.hold_output(args)  # before anything there is read: no other run writes there while this one does
        if args.save_predictions:  # (its files are read before any is written: records.check_predictions_folder)
            paths.hold("--save-predictions", args.save_predictions, args)
    paths.check_run_files(args)  # what is there in the way of the run's files: named now, not after an epoch
    RUN.start = start = checkpoints.decide_start(args)
    _complete_args(args, start)  # after this, args is read-only: the harness changes none of its flags again
    RUN.start = start = paths.check_no_run_replaced(args, start)  # another run there is continued, or moved aside
    return start.path


def _complete_args(args, start):
    """What --weights says of other flags, before any work. A fresh start takes the model it holds unless --model
    says otherwise, and fetches no pretrained backbone: it holds every layer."""
    if args.weights and not start.path:
        saved = checkpoints.saved_args(checkpoints.weights_of(args))
        if args.model is None and saved.get("model") in MODEL_NAMES:
            args.model = saved["model"]
        if args.output_stride is None and saved.get("output_stride") in (8, 16):
            args.output_stride = saved["output_stride"]
    if args.weights:
        args.pretrained_backbone = "none"
    if args.evaluate:
        _evaluate_as_the_run_did(args, start.saved, start.path)


def _evaluate_as_the_run_did(args, saved, path):
    """-e evaluates as the run did after each epoch, so that it finds the mIoU the run logged: in the run's precision
    (main.py's build() takes its --amp; fp16, which runs on CUDA alone here, is bf16 on the CPU) and in its window
    (--eval-crop, --eval-stride), unless given here. One line says what it takes from the checkpoint, or how it
    evaluates otherwise than the run did."""
    crop, stride = saved.get("eval_crop"), saved.get("eval_stride")
    run_mode = inference.read_mode(SimpleNamespace(eval_crop=crop, eval_scales=None, eval_stride=stride,
                                                   eval_flip=False))
    if args.eval_stride is None:  # the run's window, unless one is given
        if args.eval_crop is None:
            args.eval_crop = crop
        if run_mode and inference.read_mode(args).crop == run_mode.crop:  # (perhaps written another way): its stride
            args.eval_stride = stride
    mode = inference.read_mode(args)
    theirs = saved.get("amp") or "off"
    if args.amp is None and theirs == "fp16" and not torch.cuda.is_available():
        args.amp = "bf16"  # (checks.autocast: fp16 on CUDA alone)
    ours = checks.native_amp(torch.cuda.is_available()) if args.amp == "auto" else args.amp or theirs
    differs = ([f"--amp {ours} (the run's: {theirs})"] if ours != theirs else []) + \
        ([f"{inference.describe(mode)} (the run's: {inference.describe(run_mode)})"] if mode != run_mode else [])
    kept = ([f"--amp {theirs}"] if theirs != "off" else []) + ([inference.describe(run_mode)] if run_mode else [])
    if differs:
        log(f"note: -e evaluates with {' and '.join(differs)}: its mIoU may differ from the one the run logged")
    elif kept:
        log(f"note: -e evaluates as the run did ({', '.join(kept)}, from {path}); a flag given wins")


def check_data_and_make_outputs(args, train_set, val_set, checkpoint):
    """The data and the model, once main.py has opened and built them (on every rank, before the process group):
    the checks of check_data, the crop against the model's output stride. --check-only ends here, having written
    nothing: exit 0, or errors.NOTHING_TO_TRAIN where the run it would resume has finished. Then rank 0, with every
    check passed, makes the output folders (before init_process_group, which the other ranks wait in), rewrites the
    run's files to begin at the checkpoint's position, and opens TensorBoard's writer; and from here a stop saves
    first (the stop phases' next: stops.PHASES)."""
    checks.check_model_fits(args)  # --model is known now: the checkpoint's, unless given
    world_size = args.check_only or job.get_world_size()
    check_data(args, train_set, val_set, world_size)
    records.check_predictions_folder(args, val_set)  # no data set's masks replaced by predictions
    resuming = checkpoint and not args.evaluate
    if args.check_only:
        # main.py train()'s test for a resumed checkpoint, and its line word for word
        if resuming and checkpoint["epoch"] >= args.epochs:
            print(f"nothing to train: {args.resume} has finished {checkpoint['epoch']} epochs, as many as --epochs "
                  f"{args.epochs} asks or more; {TRAIN_LONGER}", flush=True)
            raise Finished(NOTHING_TO_TRAIN)
        raise Finished
    start = RUN.start
    epoch, step = (checkpoint["epoch"], checkpoint["step"]) if resuming else (args.start_epoch, 0)
    with stops.deferred():  # a stop while rank 0 moves an old run aside or rewinds one: after, not half-way
        if job.is_main_process():
            paths.make_run_outputs(args, start)
            if not args.evaluate:
                checkpoints.rewrite_run_files_at(args, start, epoch, step)  # a rewind keeps what it drops
    if train_set is not None:  # (-e: no training set, and no TensorBoard)
        steps_per_epoch = len(train_set) // job.global_batch(args, world_size)
        records.open_tensorboard(args, epoch * steps_per_epoch + step + 1)
    records.watch_predictions(val_set)  # a prediction that cannot be written costs the predictions, not the epoch
    stops.enter("meeting" if job.env().distributed else "training")
    if job.env().restarts and not args.evaluate:
        log(f"note: restart {job.env().restarts} by torchrun after a failure: the run goes on from "
            f"{args.resume or 'its start (no checkpoint was written before it)'}")


def check_data(args, train_set, val_set, world_size):
    """The val set (and the train set, but with -e, which opens none), checked the same way on every rank before any
    training time is spent: every file's header read, every val label decoded (and every mask of your own data); a
    val set with no labelled pixel refused; classes that no training mask shows, masks that are mostly ignore, and
    crops larger than every image said; the processes and the global batch against the images."""
    val_counts, _ = val_set.check_files(decode_labels=True)  # found now, not after the first epoch (BadInput)
    names, data = val_set.classes["names"], named("--data")
    if not val_counts[:len(names)].any():
        fail(f"the val labels of {data} {args.data} hold no pixel of any class, only ignored ones: mIoU would be "
             "undefined; label the val images (or check ignore_index in classes.json)")
    skipped = [entry for data in (train_set, val_set) if data is not None for entry in data.not_files]
    if skipped:
        log(f"note: {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} of {args.data} skipped: not files to read "
            f"(e.g. {skipped[0][0]}, {skipped[0][1]})")
    in_all = " in all (NPROC x NNODES)" if job.env().under_run_sh else ""
    if world_size > len(val_set):
        fail(f"{world_size} processes but only {len(val_set)} val images: use at most {len(val_set)} processes{in_all}")
    if train_set is not None:
        _check_training_data(args, train_set, val_set, world_size)


def _check_training_data(args, train_set, val_set, world_size):
    """check_data's part for training: the train set's files; what it lacks or holds twice said; the global batch."""
    train_counts, mostly_ignored = train_set.check_files()
    names, data = train_set.classes["names"], named("--data")
    if train_counts is not None:  # your own data: every mask decoded
        absent = [name for index, name in enumerate(names) if not train_counts[index]]
        if absent:
            ignored = train_counts[IGNORE_INDEX] > 0  # (the masks' ignore_index, mapped to 255)
            log(f"warning: no training mask of {args.data} has a pixel of {', '.join(map(repr, absent))}: the model "
                "cannot learn it; add images that show it, or remove it from classes.json (and renumber the masks)"
                + (f". If the masks draw it with ignore_index {train_set.ignore_value} (masks saved as 0 and 255, "
                   "say), save it as its class index instead" if ignored else ""))
        if mostly_ignored:
            log(f"warning: {len(mostly_ignored)} of {len(train_set)} training masks are more than half "
                f"ignore_index {train_set.ignore_value} (e.g. {mostly_ignored[0]}), which the loss skips: if that "
                "value marks a class (masks saved as 0 and 255), save them with its class index instead")
    shared = _val_images_in_train(train_set, val_set) if job.is_main_process() else []
    if shared:
        log(f"warning: {len(shared)} of the {len(val_set)} val images of {data} {args.data} are also training images, "
            f"byte for byte (e.g. {shared[0][0]} and {shared[0][1]}): the val mIoU then measures what the model has "
            "seen, not how it does on new images; keep each image in one split")
    largest = train_set.largest  # (height, width), from the headers check_files read
    reach, crop_size = [side * args.scale_range[1] for side in largest], checks.crop(args)
    if crop_size[0] > reach[0] or crop_size[1] > reach[1]:
        fits = f"{int(min(crop_size[0], reach[0]))} {int(min(crop_size[1], reach[1]))}"
        scaled = f", scaled up to {args.scale_range[1]:g}x" if args.scale_range[1] != 1 else ""
        log(f"warning: --crop-size {' '.join(map(str, args.crop_size))} is larger than every training image of "
            f"{data} (at most {largest[1]}x{largest[0]}{scaled}): the crops are mostly padding, which the loss "
            f"ignores, and a step costs what the crop does; --crop-size {fits} trains on image alone")
    check_global_batch(args, len(train_set), world_size)


def _val_images_in_train(train_set, val_set):
    """The val images whose files hold the same bytes as a training image's (a copy, a link, a split made twice):
    [(val path, train path)]. Compared by size first, from the directory alone; only files of a size both splits
    have are read and hashed, which different images almost never share."""
    def sizes(paths):
        found = {}
        for path in paths:
            found.setdefault(os.path.getsize(path), []).append(path)
        return found

    def digest(path):
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha1").hexdigest()

    if not (hasattr(train_set, "images") and hasattr(val_set, "images")):  # a data set of your own: its files unknown
        return []
    train, val = sizes(train_set.images), sizes(val_set.images)
    shared = []
    for size in val.keys() & train.keys():
        seen = {}
        for path in train[size]:
            seen.setdefault(digest(path), path)
        for path in val[size]:
            twin = seen.get(digest(path))
            if twin is not None:
                shared.append((path, twin))
    return sorted(shared)


def check_global_batch(args, images, world_size):
    """At least one optimizer step an epoch: the global batch (-b x processes x --accum-steps) no larger than the
    training set. The advice is one that works: a smaller -b, else fewer --accum-steps, else fewer processes."""
    accum, global_batch = args.accum_steps, job.global_batch(args, world_size)
    if global_batch <= images:
        return
    run_sh = job.env().under_run_sh  # run.sh chooses -b and --accum-steps itself: the user sets them after ./run.sh
    what = f"--batch-size {args.batch_size} x {world_size} process(es)" + (f" x --accum-steps {accum}" if accum > 1
                                                                          else "")
    if images >= world_size * accum:
        advice = f"{'./run.sh -b' if run_sh else '--batch-size'} {images // (world_size * accum)} or less"
    elif images >= world_size:
        advice = f"{'./run.sh ' if run_sh else ''}-b 1 --accum-steps {images // world_size} or less"
    else:
        advice = (f"at most {images} process(es){' in all (NPROC x NNODES)' if run_sh else ''}, or more training "
                  "images")
    fail(f"{what} makes a global batch of {global_batch}, more than the {images} training images: give "
         f"{advice}")
