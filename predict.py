"""The trained model on any images: colour masks, overlays and label maps; or the model exported (ONNX, or a
torch.export program that torch alone loads).

    python predict.py --resume output/best.pth photos/ --output-dir predictions/
    python predict.py --resume output/best.pth 'frames/**/*.jpg' --eval-scales 0.75 1.0 1.25 --eval-flip
    torchrun --standalone --nproc_per_node=2 predict.py --resume output/best.pth data/cityscapes/leftImg8bit/test \
        --format labelid --what label          # each rank predicts every second image
    python predict.py --resume output/best.pth --export model.onnx
    python predict.py --resume output/best.pth --export model.pt2   # torch.export.load("model.pt2").module()

INPUT: image files, folders (searched recursively; the output folder is left out) or glob patterns; JPEG,
PNG, WebP, BMP, TIFF in any mode and size, turned as their EXIF orientation says (as a viewer shows them).
Everything the model needs (its name, output stride, classes) comes from the checkpoint.

Output, each prediction at its input's size, one folder per kind, each mirroring the inputs' folders:

    predictions/color/<path>.png       the classes in their colours
    predictions/overlay/<path>.png     the image with the colours blended in (--alpha)
    predictions/trainIds/<path>.png    the class of each pixel (--format labelid: labelIds/, Cityscapes' ids,
                                       what cityscapesScripts' evaluation reads; a model trained on your own
                                       data: labels/, the indices of its classes.json)

<path> is the input's path below the folder common to all inputs, with its extension kept (a.jpg ->
a.jpg.png), so two frame.png in different folders, or a.jpg and a.png in one, never collide. A file that
cannot be decoded is named and skipped; the others are still written, and the exit status says how many
could not be read.
"""
import argparse
import concurrent.futures
import glob
import importlib.util
import os
import sys
import time
import zipfile
from datetime import timedelta

import torch
import torch.distributed as dist
from PIL import Image
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))  # this folder's modules under python -I too
from harness import checkpoints, checks, inference, job, paths, records, recovery, stops
from dataset import CLASS_NAMES, TRAINID_TO_ID
from harness.errors import fail, first_line
from images import float_pixels, input_files, not_a_file, read_image
from main import default_workers, normalize  # the lesson's: normalize gives the input the model learned on

EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
# Picture kinds a folder may hold that are skipped there and said (a GIF's first frame alone would be predicted);
# other files are skipped silently. A file named by itself goes to the reader: what PIL decodes (a GIF: its first
# frame; not SVG or HEIC).
SKIPPED_KINDS = (".gif", ".apng", ".ppm", ".pgm", ".pbm", ".heic", ".heif", ".avif", ".jp2", ".svg")
KINDS = ("color", "overlay", "label")


def get_args_parser():
    parser = argparse.ArgumentParser(prog="predict.py", description="DeepLab predictions on any images",
                                     allow_abbrev=False)
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="image files, folders or glob patterns")
    parser.add_argument("--resume", required=True, metavar="PATH", help="a checkpoint main.py wrote (best.pth)")
    parser.add_argument("--output-dir", default="predictions", help="(default: %(default)s)")
    parser.add_argument("--what", nargs="+", choices=KINDS, default=list(KINDS),
                        help="which outputs to write (default: all three)")
    parser.add_argument("--format", choices=("trainid", "labelid"), default="trainid",
                        help="label maps of the model's class indices (Cityscapes': trainIds) or Cityscapes' labelIds "
                        "(default: %(default)s)")
    parser.add_argument("--alpha", type=float, default=0.5,
                        help="the colours' weight in the overlay (default: %(default)s)")
    parser.add_argument("-b", "--batch-size", type=int, default=4,
                        help="images of one size per forward (default: %(default)s)")
    parser.add_argument("-j", "--workers", type=int, default=None, help="decoding workers per process; 0: "
                        "in the process itself (default: its share of the cores, less one)")
    parser.add_argument("--amp", nargs="?", const="auto", choices=("auto", "bf16", "fp16", "off"),
                        help="mixed precision. Given alone: bf16 where the GPU runs it natively (A100, RTX 30xx and "
                        "later; the CPU), else fp16 (V100, T4; CUDA only, by this program's choice). off: float32 "
                        "(the default)")
    parser.add_argument("--dist-timeout", type=float, default=5.0, metavar="MINUTES",
                        help="under torchrun: a rank that waits longer than this for the others ends (default: "
                        "%(default)s)")
    parser.add_argument("--export", default=None, metavar="FILE.onnx|FILE.pt2",
                        help="write the model instead of predicting (dynamic batch, height, width): FILE.pt2 as a "
                        "torch.export program, which torch alone loads; any other name as ONNX")
    inference.add_arguments(parser)
    return parser


def find_images(inputs, output_dir):
    """-> sorted [(path, name)]: every image the inputs name, each once; name: its path below the folder
    common to all inputs. Folders and glob patterns yield the files with an image's extension; a file named
    by itself is taken whatever its extension. Nothing inside the output folder is ever an input."""
    output_dir = os.path.realpath(output_dir)

    def in_output(path):
        real = os.path.realpath(path)
        return real == output_dir or real.startswith(output_dir + os.sep)

    files, roots, skipped, not_files = {}, [], [], []
    for text in inputs:
        named = os.path.exists(text)
        matches = [text] if named else sorted(glob.glob(text, recursive=True))
        if not matches:
            fail(f"{text}: no such file or folder, and no file matches it as a pattern")
        for match in matches:
            if in_output(match):
                if named:
                    fail(f"{text} is inside --output-dir {output_dir}: predictions are never written among the "
                         "inputs; give another --output-dir")
                continue  # a pattern's match in the output folder: an earlier run's prediction
            if os.path.isdir(match):
                roots.append(os.path.abspath(match))
                found, others = input_files(match, leave_out=in_output)  # (one lister for every program's inputs)
                not_files += others
                files.update((os.path.abspath(path), True) for path in found if path.lower().endswith(EXTENSIONS))
                skipped += [path for path in found if path.lower().endswith(SKIPPED_KINDS)]
            elif (named or match.lower().endswith(EXTENSIONS)) and not_a_file(match):
                not_files.append((match, not_a_file(match)))
            elif named or match.lower().endswith(EXTENSIONS):
                roots.append(os.path.dirname(os.path.abspath(match)))
                files[os.path.abspath(match)] = True
    if not_files:
        job.log(f"note: {len(not_files)} input(s) skipped: not files to read (e.g. {not_files[0][0]}, "
                f"{not_files[0][1]})")
    if skipped:
        job.log(f"note: {len(skipped)} picture(s) of a kind predict.py does not take from a folder skipped (e.g. "
                f"{skipped[0]}): convert them to PNG (a GIF named by itself: its first frame)")
    if not files:
        fail(f"no images ({', '.join(e[1:] for e in EXTENSIONS)}) in {' '.join(inputs)}")
    root = os.path.commonpath(roots)
    return sorted((path, os.path.relpath(path, root)) for path in files)


class ImageFiles(Dataset):
    """Decoded in DataLoader workers. Item: (index, uint8 image or None, why it could not be read)."""

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        try:
            # uint8 (3, H, W), decoded as training decodes its files (images.py): as a viewer shows the file
            return index, torch.from_numpy(read_image(self.paths[index]).copy()).permute(2, 0, 1), ""
        except Exception as error:  # the main loop names the file and goes on with the others
            return index, None, getattr(error, "cause", None) or first_line(error)


def output_paths(output_dir, name, what, label_folder):
    folders = {"color": "color", "overlay": "overlay", "label": label_folder}
    return {kind: os.path.join(output_dir, folders[kind], name + ".png") for kind in what}


def write_outputs(prediction, image, outputs, palette, args):
    """prediction: (H, W) class indices; image: uint8 (3, H, W). Runs in a writer thread (PNG encoding lets
    go of the GIL), beside the next forward."""
    prediction = prediction.long()  # an index: uint8 would be read as a mask
    for kind, path in outputs.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if kind == "color":
            picture = palette[prediction]
        elif kind == "overlay":
            blended = image.permute(1, 2, 0).float() * (1 - args.alpha) + palette[prediction].float() * args.alpha
            picture = blended.round().to(torch.uint8)
        elif args.format == "labelid":
            picture = TRAINID_TO_ID[prediction]
        else:
            picture = prediction.to(torch.uint8)
        # Whole or not at all, under a new name renamed into place: never written through a link left at path.
        paths.write_atomically(path, lambda f: Image.fromarray(picture.numpy()).save(f, format="PNG"), durable=False)


def is_export(path):
    """Whether the file at path is an earlier --export, judged by its bytes: a torch.export archive (a zip file that
    says it is one), or an ONNX model with this project's input and output."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/archive_format") and archive.read(name) == b"pt2" for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):  # not a zip file: ONNX, or something else
        pass
    try:
        import onnx
        graph = onnx.load(path, load_external_data=False).graph
        return [i.name for i in graph.input] == ["images"] and [o.name for o in graph.output] == ["logits"]
    except Exception:  # not ONNX (or onnx not installed: then nothing is replaced)
        return False


def export_model(model, path, replacing=False):
    """The plain model: input "images", float32 (N, 3, H, W) normalised as in training (ImageNet mean and std);
    output "logits", float32 (N, classes, H, W); batch, height and width dynamic. FILE.pt2: a torch.export program
    (torch.export.load(FILE).module() runs it, with torch alone). Any other name: ONNX, which needs onnx and
    onnxscript (requirements-test.txt), not training. Written whole under a new name, then renamed: an export that fails (a
    full disk, a kill) leaves an earlier one as it was."""
    dynamic = torch.export.Dim.DYNAMIC
    shapes = {"images": {0: dynamic, 2: dynamic, 3: dynamic}}
    example = torch.randn(2, 3, 96, 160)  # batch 2, not 1: an example of size 1 would be fixed as a constant
    if path.lower().endswith(".pt2"):
        program = torch.export.export(model, (example,), dynamic_shapes=shapes)
        data = lambda f: torch.export.save(program, f)  # noqa: E731
    else:
        try:
            program = torch.onnx.export(model, (example,), input_names=["images"], output_names=["logits"],
                                        dynamic_shapes=shapes, dynamo=True, external_data=False, verbose=False)
        except ImportError as error:
            fail(f"--export needs onnx and onnxscript ({error}): pip install -r requirements-test.txt")
        data = program.model_proto.SerializeToString()
    try:
        paths.write_atomically(path, data)
    except (OSError, RuntimeError) as error:  # torch's writers report a failed write as a RuntimeError too
        as_it_was = "the earlier export there is as it was. " if replacing else "nothing was written. "
        fail(paths.cannot_write(f"--export {path}", error, path, before=as_it_was))
    print(f"wrote {path}: images float32 (N, 3, H, W), ImageNet-normalised -> logits float32 (N, classes, H, W)"
          + (" (the earlier export there is replaced)" if replacing else ""))


def hold_and_check_outputs(args, images, label_folder):
    """--output-dir held for this run (rank 0), then checked: no output lands on an input, not on an image (checked
    by name), not on the checkpoint. -> how many files of an earlier prediction these outputs replace (said, not
    refused: predicting again into one folder is common)."""
    paths.check_folder("--output-dir", args.output_dir, reads=[("--resume", args.resume)])
    if job.env().rank == 0:  # (which holds it for the job: the other ranks would find it held, by rank 0)
        paths.check_not_held("--output-dir", args.output_dir)  # a run writes there now, or in a folder above it
        paths.hold("--output-dir", args.output_dir, args)  # one folder, one run: held before anything there is read
    inputs = {os.path.realpath(path) for path, _ in images} | {os.path.realpath(args.resume)}
    replaced = 0
    for _, name in images:
        for path in output_paths(args.output_dir, name, args.what, label_folder).values():
            if os.path.realpath(path) in inputs:
                fail(f"{path} is an input and would be written over: choose another --output-dir")
            replaced += os.path.exists(path)
    return replaced


def predict_all(args, model, classes, shard, mode, device, autocast, label_folder):
    """Predict this rank's images and write their files. -> (images written, images that could not be read)."""
    workers = args.workers if args.workers is not None else default_workers()
    loader = DataLoader(ImageFiles([path for path, _ in shard]), batch_size=None, num_workers=workers,
                        pin_memory=device.type == "cuda")
    stops.shield_workers(loader)  # a stop to the whole job is this process's to act on, not the workers'
    palette, writer = records.palette(classes["colors"]), Writer(args)
    unreadable, done = [], 0
    start = last_report = time.time()
    for batch in same_size_batches(loader, args.batch_size, shard, unreadable):
        predictions = run_batch(model, batch, mode, device, autocast)
        for (index, image), prediction in zip(batch, predictions):
            outputs = output_paths(args.output_dir, shard[index][1], args.what, label_folder)
            writer.submit(write_outputs, prediction, image, outputs, palette, args)
        done += len(batch)
        if time.time() - last_report > 2 or done + len(unreadable) == len(shard):
            last_report = report_progress(done, len(unreadable), len(shard), start)
    writer.finish()
    return done, len(unreadable)


def same_size_batches(loader, batch_size, shard, unreadable):
    """The decoded images in batches of one size, for one forward each: an image waits in its size's bucket until
    the bucket holds batch_size, and the buckets left at the end go as they are. An image that cannot be decoded
    is named, skipped, and its index added to unreadable. -> yields [(index, image)]."""
    buckets = {}
    for index, image, problem in loader:
        if image is None:
            print(f"predict.py: {shard[index][0]} cannot be read ({problem}): skipped", file=sys.stderr, flush=True)
            unreadable.append(index)
            continue
        bucket = buckets.setdefault(tuple(image.shape[-2:]), [])
        bucket.append((index, image))
        if len(bucket) == batch_size:
            yield buckets.pop(tuple(image.shape[-2:]))
    yield from buckets.values()


@torch.inference_mode()
def run_batch(model, batch, mode, device, autocast):
    """batch: [(index, image)] of one size: one forward. -> the predictions, uint8 (N, H, W) on the CPU."""
    stacked = torch.stack([image for _, image in batch]).to(device, non_blocking=True)
    with autocast():
        return inference.predict(model, normalize(stacked), mode).argmax(1).to(torch.uint8).cpu()


class Writer:
    """Each image's files written by two threads (PNG encoding lets go of the GIL), beside the next forward. A write
    that failed (a full disk) stops this rank with one line."""

    def __init__(self, args):
        self.output_dir, self.most_pending = args.output_dir, 4 * args.batch_size
        self.threads, self.pending = concurrent.futures.ThreadPoolExecutor(max_workers=2), []

    def submit(self, write, *arguments):
        self.pending.append(self.threads.submit(write, *arguments))
        while len(self.pending) > self.most_pending:  # the threads may lag: do not let images pile up in memory
            self._wait(self.pending.pop(0))

    def finish(self):
        for write in self.pending:
            self._wait(write)
        self.threads.shutdown()

    def _wait(self, write):
        try:
            write.result()
        except OSError as error:
            self.threads.shutdown(wait=False, cancel_futures=True)
            fail(paths.cannot_write(f"in --output-dir {self.output_dir}", error, self.output_dir), this_rank=True)


def report_progress(done, unreadable, total, start):
    """Rank 0's line: this rank's images done, the rate, the time left. -> when it was said."""
    now, world_size = time.time(), job.get_world_size()
    rate = done / (now - start)
    eta = (total - done - unreadable) / max(rate, 1e-9)
    ranks = f" on rank 0 (x{world_size} processes)" if world_size > 1 else ""
    job.log(f"{done}/{total} images{ranks}, {rate:.2f} images/s, eta {timedelta(seconds=round(eta))}")
    return now


def export(args, mode):
    """--export: the plain model written as ONNX or torch.export's .pt2, once nothing stands in its way (no INPUT,
    no --eval-*, onnx installed for ONNX, a file that is no input and no other file)."""
    if args.inputs or mode:
        fail("--export writes the plain model and exits: give it no INPUT and no --eval-* flag")
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing and not args.export.lower().endswith(".pt2"):  # found before the model is loaded, not after
        fail(f"--export needs {' and '.join(missing)}, which training does not: pip install -r "
             "requirements-test.txt")
    paths.check_file_and_make_folder("--export", args.export, reads=[("--resume", args.resume)],
                                     replaceable=is_export)
    replacing = os.path.exists(args.export)
    model, _ = checkpoints.load_for_inference(args.resume)
    export_model(model, args.export, replacing)


@recovery.guarded("predict.py")  # a mistake ends in one line, said once (harness/recovery.py)
def main(args):
    checks.check_numbers(args, checks.PREDICT)
    checks.check_worker_sockets(args.workers)
    mode = inference.read_mode(args)
    if args.export is not None:
        export(args, mode)
        return
    if not args.inputs:
        fail("no INPUT: name image files, folders or glob patterns (or --export FILE.onnx or FILE.pt2)")
    autocast = checks.autocast(args, torch.cuda.is_available())
    model, classes = checkpoints.load_for_inference(args.resume)
    cityscapes = list(classes["names"]) == list(CLASS_NAMES)
    if args.format == "labelid" and not cityscapes:
        fail("--format labelid writes Cityscapes' labelIds, but this model's classes are not Cityscapes': use "
             "--format trainid")
    # The label maps' folder: Cityscapes' labelIds or trainIds, or the class indices of another model's classes.
    label_folder = "labelIds" if args.format == "labelid" else "trainIds" if cityscapes else "labels"
    images = find_images(args.inputs, args.output_dir)
    floats = [path for path, _ in images if float_pixels(path)]
    if floats:  # no scale is standard for them: the one taken is said
        job.log(f"note: {len(floats)} image(s) hold floating-point pixels (e.g. {floats[0]}): values all within 0-1 "
                "are scaled by 255, others clipped to 0-255")
    replaced = hold_and_check_outputs(args, images, label_folder)
    paths.make_folder("--output-dir", args.output_dir)
    if replaced:
        job.log(f"note: {args.output_dir} holds an earlier prediction: {replaced} of its files are replaced")

    # Under torchrun: each rank predicts every world_size-th image of the sorted list, so each image
    # exactly once. The only collective is the count at the end: gloo, on CPU tensors, GPUs or not.
    distributed = job.env().distributed
    if distributed:
        recovery.start_heartbeat(args.dist_timeout)  # says what it waits for, if it waits
        dist.init_process_group("gloo", timeout=timedelta(minutes=args.dist_timeout))
    rank, world_size = job.get_rank(), job.get_world_size()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", job.env().local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    model.to(device)
    job.log(f"predicting {len(images)} images with {os.path.basename(args.resume)} "
            f"({inference.describe(mode)}), {world_size} process(es), device {device.type}")
    start = time.time()
    counts = torch.tensor(predict_all(args, model, classes, images[rank::world_size], mode, device, autocast,
                                      label_folder))
    if distributed:
        dist.all_reduce(counts)  # the sum over ranks: each image counted once
        recovery.stop_heartbeat()
        dist.destroy_process_group()
    written, unreadable = counts.tolist()
    elapsed = time.time() - start
    job.log(f"wrote {written} predictions to {args.output_dir} in {timedelta(seconds=round(elapsed))} "
            f"({written / elapsed:.2f} images/s)")
    if unreadable:
        fail(f"{unreadable} of {written + unreadable} images could not be read (named above)"
             + ("; the others were written" if written else ": is each an image (PNG, JPEG, ...)?"))


if __name__ == "__main__":
    main(get_args_parser().parse_args())
