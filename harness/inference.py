"""Better numbers from the same model at test time: multi-scale, flip, sliding window. Used by main.py's -e
and by predict.py. The evaluation after each training epoch takes a sliding window only (full-resolution
images that do not fit in a GPU's memory), never scales or flips (it only ranks epochs).

    inference.add_arguments(parser)            # --eval-scales, --eval-flip, --eval-crop, --eval-stride
    mode = inference.read_mode(args)           # None: plain, one forward of the whole image
    scores = inference.predict(model, images, mode)    # (N, classes, H, W); argmax over classes: the prediction
    model = inference.wrap(model, args)        # main.py: a model whose forward predicts so (itself when plain)

Every view (each scale, flipped or not) gives softmax probabilities at the input's resolution, and they are
averaged. A sliding window (mmsegmentation's "slide" mode: crop 769, stride 513 on Cityscapes) runs the
model on overlapping crops of each view and averages the probabilities where crops overlap. A single view
(one scale, no flip, one window) is scored by its logits, as the plain evaluation is: argmax of the softmax
is argmax of the logits only in exact arithmetic, and softmax's rounding can make two near-equal logits
equal probabilities. So one scale of 1.0 without flip, or a window as large as the image, gives exactly
the plain evaluation's predictions.
"""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .errors import fail


class Mode(NamedTuple):
    """How to predict: the scales, with or without a flip, in a sliding window or not."""
    scales: list                  # factors the image is resized by; [1.0]: its own size
    flip: bool                    # its mirror image too
    crop: tuple | None            # the window, (height, width); None: the whole image
    stride: tuple | None          # the window's step, (height, width)


def add_arguments(parser):
    group = parser.add_argument_group("test-time augmentation (main.py -e and predict.py; costs time: docs/predict.md)")
    group.add_argument("--eval-scales", type=float, nargs="+", default=None, metavar="S",
                       help="average over the image resized by each factor (mmsegmentation's Cityscapes set: "
                            "0.5 0.75 1.0 1.25 1.5 1.75)")
    group.add_argument("--eval-flip", action="store_true", help="average over the image and its mirror image too")
    group.add_argument("--eval-crop", type=int, nargs="+", default=None, metavar="N",
                       help="sliding window of this size, one number (square) or two (height width); an image "
                            "smaller than it is evaluated whole (mmsegmentation: 769)")
    group.add_argument("--eval-stride", type=int, nargs="+", default=None, metavar="N",
                       help="the window's step, one number or two (default: two thirds of the window; 769 -> 513)")


def pair(flag, values):
    """One number or two, as --crop-size takes them -> (height, width); None stays None."""
    if values is None:
        return None
    if len(values) in (1, 2):
        return (values[0], values[-1])
    fail(f"{flag} {' '.join(map(str, values))}: give one number (square) or two (height width)")


def read_mode(args, training=False):
    """The --eval-* flags, checked: None for the plain evaluation, else a Mode. training: main.py evaluates after
    each epoch, where a window has its place (memory) and scales and flips do not; giving them is a mistake, said
    in one line."""
    crop, stride = pair("--eval-crop", args.eval_crop), pair("--eval-stride", args.eval_stride)
    if stride and not crop:
        fail("--eval-stride without --eval-crop: give the window's size as well")
    if crop and not stride:
        stride = tuple(math.ceil(size * 2 / 3) for size in crop)
    if crop and (stride[0] > crop[0] or stride[1] > crop[1]):
        fail(f"--eval-stride {stride[0]} {stride[1]} is larger than the window {crop[0]} {crop[1]}: pixels between "
             "windows would never be seen")
    if args.eval_scales is None and not args.eval_flip and crop is None:
        return None
    if training and (args.eval_scales is not None or args.eval_flip):
        fail("--eval-scales and --eval-flip are for -e (evaluating a checkpoint); the evaluation after each training "
             "epoch stays single-scale (--eval-crop, a sliding window, is taken)")
    return Mode(list(args.eval_scales or [1.0]), args.eval_flip, crop, stride)


def describe(mode):
    """A short name of the mode, for eval.json and the logs."""
    if mode is None:
        return "single-scale"
    parts = []
    if mode.scales != [1.0]:
        parts.append("scales " + ",".join(f"{scale:g}" for scale in mode.scales))
    if mode.flip:
        parts.append("flip")
    if mode.crop:
        parts.append(f"window {mode.crop[0]}x{mode.crop[1]} stride {mode.stride[0]}x{mode.stride[1]}")
    return " + ".join(parts) or "scales 1"


def _window_starts(size, window, stride):
    """Where the windows start along one side: every stride, and the last one moved back so that it ends at
    the edge (never past it). A side shorter than the window: one window, the whole side."""
    if size <= window:
        return [0]
    return list(range(0, size - window, stride)) + [size - window]


def slide(model, images, crop, stride):
    """Softmax probabilities of overlapping crop-sized windows, averaged where they overlap. (N, C, H, W)."""
    height, width = images.shape[-2:]
    sums, counts = None, images.new_zeros((1, 1, height, width), dtype=torch.float32)
    for top in _window_starts(height, crop[0], stride[0]):
        for left in _window_starts(width, crop[1], stride[1]):
            window = (..., slice(top, top + crop[0]), slice(left, left + crop[1]))
            probabilities = model(images[window]).float().softmax(1)
            if sums is None:
                sums = probabilities.new_zeros((*probabilities.shape[:2], height, width))
            sums[window] += probabilities
            counts[window] += 1
    return sums / counts


def _one_view(mode, size):
    """Whether mode is a single forward of the whole image at its size: one scale of 1, no flip, and no window or
    one as large as the image."""
    whole = mode.crop is None or (mode.crop[0] >= size[0] and mode.crop[1] >= size[1])
    return mode.scales == [1.0] and not mode.flip and whole


def predict(model, images, mode=None):
    """images: normalised float (N, 3, H, W). -> float (N, C, H, W) whose argmax over C is the prediction: the
    logits for the plain evaluation (mode None, or a mode of one view of the whole image), else the softmax
    probabilities averaged over every view."""
    if mode is None or _one_view(mode, images.shape[-2:]):
        return model(images)
    height, width = images.shape[-2:]
    total, views = 0, 0
    for scale in mode.scales:
        size = (max(1, int(height * scale + 0.5)), max(1, int(width * scale + 0.5)))  # rounded as mmsegmentation does
        scaled = images if size == (height, width) else F.interpolate(images, size, mode="bilinear",
                                                                      align_corners=False)
        for flip in (False, True) if mode.flip else (False,):
            view = scaled.flip(-1) if flip else scaled
            if mode.crop:
                probabilities = slide(model, view, mode.crop, mode.stride)
            else:
                probabilities = model(view).float().softmax(1)
            if flip:
                probabilities = probabilities.flip(-1)
            if size != (height, width):  # bilinear: each pixel a convex mix, so probabilities stay probabilities
                probabilities = F.interpolate(probabilities, (height, width), mode="bilinear", align_corners=False)
            total, views = total + probabilities, views + 1
    return total / views


class WithMode(torch.nn.Module):
    """model(images) that predicts with a mode: for code written for a plain model (main.py's evaluate())."""

    def __init__(self, model, mode):
        super().__init__()
        self.model, self.mode = model, mode

    def forward(self, images):
        return predict(self.model, images, self.mode)


def wrap(model, args):
    """model, or one whose forward predicts with the --eval-* flags' mode (for code written for a plain model:
    main.py's evaluate())."""
    mode = read_mode(args)
    return model if mode is None else WithMode(model, mode)
