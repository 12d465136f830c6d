"""The data: Cityscapes (its official layout, the 19 train classes) or your own (images/, masks/ and
classes.json in plain folders), and the augmentation.

    from dataset import open_dataset
    train_set = open_dataset("data/cityscapes", "train", crop_size=(768, 768), cache_dir="data/cache")
    image, label = train_set[0]     # uint8 image (3, 768, 768); uint8 class indices (768, 768), 255 = ignore
    train_set.classes               # {"names": [...], "colors": [[r, g, b], ...]}, Cityscapes' 19 here

What main.py asks of a data set is said in its docstring; this module gives that and more (the checks, the
prediction files). Workers hand over uint8 (4 bytes a pixel with the label, not 13) and leave the float
conversion to the GPU (main.normalize). With cache_dir, each frame is decoded once and then read as an
uncompressed array, memory-mapped: a worker reads only the rows of its crop, and the page cache is shared
by every worker and rank. Fill the cache before training (optional: the first epoch fills it too):

    python harness/cache.py data/cache --data data/cityscapes --split train val

No real data at hand? synthetic.py writes a set in either layout.
"""
import errno
import glob
import json
import os

import numpy as np
import torch
import torchvision
from PIL import Image, PngImagePlugin
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from images import (BadInput, cached, cannot_list, check_label_bytes, decode_label, input_files, not_a_file,
                    read_image, seen_size)

# The label table: torchvision carries the official one (cityscapesScripts' labels.py), so we read it
# rather than typing it again. The 19 classes a model learns are those with 0 <= train_id < 255.
_TABLE = torchvision.datasets.Cityscapes.classes
_TRAIN_CLASSES = sorted((c for c in _TABLE if 0 <= c.train_id < 255), key=lambda c: c.train_id)
NUM_CLASSES = len(_TRAIN_CLASSES)  # 19
CLASS_NAMES = [c.name for c in _TRAIN_CLASSES]
CLASS_COLORS = [c.color for c in _TRAIN_CLASSES]
IGNORE_INDEX = 255

# ID_TO_TRAINID[labelId] -> trainId, for every possible uint8 value; void classes and unknown ids -> 255.
ID_TO_TRAINID = torch.full((256,), IGNORE_INDEX, dtype=torch.uint8)
for _c in _TRAIN_CLASSES:
    ID_TO_TRAINID[_c.id] = _c.train_id
_ID_TO_TRAINID_NP = ID_TO_TRAINID.numpy()  # the same table; numpy indexes with uint8 arrays directly
# TRAINID_TO_ID[trainId] -> labelId: predictions for the official evaluation are written as labelIds.
TRAINID_TO_ID = torch.tensor([c.id for c in _TRAIN_CLASSES], dtype=torch.uint8)

MAX_LABEL_ID = max(c.id for c in _TABLE)  # 33; an 8-bit labelIds PNG holds nothing larger


def sample_generator(seed, epoch, index):
    """A random generator for one sample of one epoch. Augmentation drawn from it depends on nothing
    else: not on the rank, the worker, or what the process did before, so a run is reproducible."""
    state = np.random.SeedSequence([seed, epoch, index]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> 1))


def train_transform(image, label, crop_size, generator, scale_range=(0.5, 2.0)):
    """Random scale, random crop, horizontal flip, applied to image and label together: crop_window and
    resize_pad_flip in one call, on a whole decoded frame (Cityscapes.__getitem__ calls the two itself, to
    copy only the crop's region out of the frame or the cache).

    About the same in distribution as "resize the whole image by a random factor, then take a random crop",
    not pixel for pixel: it cuts the crop's region out of the source first, snapped to whole source pixels,
    and resizes only that. On a 2048x1024 image with a 768 crop that is several times
    less work. Where the scaled image is smaller than the crop, the image is padded with 0 and the label
    with 255 (ignore), never with 0, which is the class "road".
    """
    (top, left, height, width), out_size, flip = crop_window(image.shape[-2:], crop_size, generator, scale_range)
    return resize_pad_flip(F.crop(image, top, left, height, width), F.crop(label, top, left, height, width),
                           out_size, crop_size, flip)


def crop_window(size, crop_size, generator, scale_range=(0.5, 2.0)):
    """train_transform's random draw: ((top, left, height, width) of the source region, the size it is
    resized to, whether to flip). Known before any pixel is read, so only the region need be read."""
    crop_h, crop_w = crop_size
    height, width = size
    u = torch.rand(4, generator=generator).tolist()
    scale = scale_range[0] + u[0] * (scale_range[1] - scale_range[0])
    scaled_h, scaled_w = round(height * scale), round(width * scale)
    # The crop window in the scaled image, and what of it lies on the image.
    top = int(u[1] * (max(scaled_h - crop_h, 0) + 1))
    left = int(u[2] * (max(scaled_w - crop_w, 0) + 1))
    out_h, out_w = min(crop_h, scaled_h), min(crop_w, scaled_w)
    # The same window in source pixels.
    src_top, src_left = int(top / scale), int(left / scale)
    src_h = max(1, min(round(out_h / scale), height - src_top))
    src_w = max(1, min(round(out_w / scale), width - src_left))
    return (src_top, src_left, src_h, src_w), (out_h, out_w), u[3] < 0.5


def resize_pad_flip(image, label, out_size, crop_size, flip):
    """The rest of train_transform, on the region crop_window chose: image uint8 (3, h, w), label a Mask."""
    (out_h, out_w), (crop_h, crop_w) = out_size, crop_size
    image = F.resize(image, [out_h, out_w])
    label = F.resize(label, [out_h, out_w])  # a Mask: nearest
    if out_h < crop_h or out_w < crop_w:
        padding = [0, 0, crop_w - out_w, crop_h - out_h]  # left, top, right, bottom
        image = F.pad(image, padding, fill=0)
        label = F.pad(label, padding, fill=IGNORE_INDEX)
    if flip:
        image, label = F.horizontal_flip(image), F.horizontal_flip(label)
    return image, label


def jitter_colors(image, strength, generator):
    """Brightness, contrast and saturation, each scaled by a factor drawn from [1 - strength, 1 + strength]
    (torchvision's ColorJitter with those three set to strength, applied in this fixed order), on uint8."""
    brightness, contrast, saturation = (1 + strength * (2 * torch.rand(3, generator=generator) - 1)).tolist()
    image = F.adjust_brightness(image, brightness)
    image = F.adjust_contrast(image, contrast)
    return F.adjust_saturation(image, saturation)


def _listing(folder):
    """os.listdir(folder), or a BadInput that names the folder and what to do."""
    try:
        return os.listdir(folder)
    except OSError as error:
        raise BadInput(cannot_list(folder, error)) from None


def _folder_entries(folder):
    """The sub-folders of folder, sorted; other entries ignored. A link that leads nowhere or to itself (a loop)
    is named: it is a mistake in the data folder, not something to skip quietly."""
    return [os.path.join(folder, name) for name in sorted(_listing(folder))
            if not_a_file(os.path.join(folder, name)) is None and os.path.isdir(os.path.join(folder, name))]


class SegmentationFiles(torch.utils.data.Dataset):
    """Pairs of image and label files, and what is done with them whatever their layout: decoding (or the
    decode cache), the training augmentation, label values mapped to class indices, the checks. Cityscapes
    and FolderDataset below say which files, and set what differs between layouts:

        classes       {"names": [...], "colors": [[r, g, b], ...]}: the classes a model learns, in index order
        label_table   numpy uint8 (256,): a label file's value -> class index, 255 = ignore
        read_label    path -> the label file's (H, W) uint8 values, checked

    Training augmentation (with crop_size): a random scale in scale_range, a random crop, a flip, and with
    color_jitter > 0 a random brightness, contrast and saturation (jitter_colors).
    Returns (image, label): image uint8 (3, H, W), to be normalised where it is used (main.normalize);
    label uint8 (H, W) of class indices, 255 where ignored. With crop_size=None (evaluation) the full
    resolution. With cache_dir, decoded frames are kept there (see cached()), and the output is the same.
    """
    classes, label_table = None, None
    checks_every_label = False  # check_files decodes every label, train's too
    label_check = ""  # what read_label checks values against, for the cache's names (cached())
    not_files = ()  # what the listing found that is no file to read, skipped: [(path, what it is)]

    def __init__(self, images, labels, crop_size=None, seed=0, cache_dir=None, scale_range=(0.5, 2.0),
                 color_jitter=0.0):
        self.images, self.labels = images, labels
        self.crop_size, self.seed, self.cache_dir = crop_size, seed, cache_dir
        self.scale_range, self.color_jitter = scale_range, color_jitter
        # The epoch lives in shared memory: DataLoader workers that persist across epochs see main.py set it.
        # Augmentation is drawn from (seed, epoch, index).
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def __len__(self):
        return len(self.images)

    @property
    def num_classes(self):
        return len(self.classes["names"])

    @property
    def epoch(self):
        return int(self._epoch)

    @epoch.setter
    def epoch(self, value):
        self._epoch.fill_(value)

    def check_files(self, decode_labels=False):
        """Read every file's header (not its pixels: cheap for thousands of pairs): each opens as an image, each
        label holds a PNG's bytes (check_label_bytes) and has its image's size as read_image turns it. Catches most
        bad files before any training time is spent. decode_labels (or checks_every_label): also decode every label
        and check its values. -> (pixels of each class index in the decoded labels, numpy (256,), 255: ignored; the
        labels more than half ignored), or (None, []) when none was decoded."""
        counts, mostly_ignored = None, []
        self.largest = (0, 0)  # the tallest and the widest image, (height, width)
        for image_path, label_path in zip(self.images, self.labels):
            if decode_labels or self.checks_every_label:
                found = np.bincount(self.label_table[self.read_label(label_path)].ravel(), minlength=256)
                counts = found if counts is None else counts + found
                if found[IGNORE_INDEX] * 2 > found.sum():
                    mostly_ignored.append(label_path)
            try:
                check_label_bytes(label_path)  # a label's format from its bytes, whatever its name: a PNG's
                (width, height, turned), (label_width, label_height, _) = seen_size(image_path), seen_size(label_path)
            except BadInput:
                raise
            except Exception as error:
                raise BadInput(f"{image_path} or its label cannot be read as an image ({error}); replace it, or "
                               "remove the image and its label") from None
            self.largest = (max(self.largest[0], height), max(self.largest[1], width))
            if (width, height) != (label_width, label_height):
                turn = (f" as its EXIF orientation turns it (stored {height}x{width}); draw the mask on the image as "
                        "it is seen, or remove the orientation tag" if turned else "; they must match")
                raise BadInput(f"{label_path} is {label_width}x{label_height} but its image is {width}x{height}{turn}")
        return counts, mostly_ignored

    def frame(self, index):
        """The decoded (image (H, W, 3), label values (H, W)) of one sample: arrays, or the cache's memory maps."""
        image_path, label_path = self.images[index], self.labels[index]
        if self.cache_dir is None:
            image, label_values = read_image(image_path), self.read_label(label_path)
        else:
            image = cached(self.cache_dir, image_path, read_image)
            label_values = cached(self.cache_dir, label_path, self.read_label, self.label_check)
        if image.shape[:2] != label_values.shape:
            raise BadInput(f"{label_path} is {label_values.shape[1]}x{label_values.shape[0]} but its image is "
                           f"{image.shape[1]}x{image.shape[0]}; they must match")
        return image, label_values

    def __getitem__(self, index):
        image, label_values = self.frame(index)
        if self.crop_size is None:
            image = torch.from_numpy(np.array(image)).permute(2, 0, 1)  # np.array copies, even a memory map
        else:
            generator = sample_generator(self.seed, self.epoch, index)
            (top, left, height, width), out_size, flip = crop_window(image.shape[:2], self.crop_size, generator,
                                                                     self.scale_range)
            # Slice, then copy (np.array): from a memory map only the region's rows are read. The copy is
            # in (H, W, 3) order, in which torchvision's uint8 resize is fastest.
            region = np.array(image[top:top + height, left:left + width])
            label_region = np.array(label_values[top:top + height, left:left + width])
            image, label = resize_pad_flip(tv_tensors.Image(torch.from_numpy(region).permute(2, 0, 1)),
                                           tv_tensors.Mask(torch.from_numpy(label_region)[None]),
                                           out_size, self.crop_size, flip)
            label_values = label[0].numpy()  # padding is 255, which every label_table maps to 255
            if self.color_jitter:
                image = jitter_colors(image, self.color_jitter, generator)
        # Values -> class indices after the crop (on 0.6 M pixels, not 2 M), by a numpy table lookup.
        return image.as_subclass(torch.Tensor), torch.from_numpy(self.label_table[np.asarray(label_values)])


def read_label(path):
    """(H, W) uint8 Cityscapes labelIds, checked."""
    label_ids = decode_label(path)
    if label_ids.ndim != 2 or label_ids.dtype != np.uint8 or int(label_ids.max()) > MAX_LABEL_ID:
        raise BadInput(f"{path} is not a Cityscapes labelIds image (8-bit, values 0-{MAX_LABEL_ID}): "
                       f"it holds {label_ids.dtype} values up to {int(label_ids.max())}, shape "
                       f"{label_ids.shape}. Use the *_gtFine_labelIds.png files")
    return label_ids


class Cityscapes(SegmentationFiles):
    """Cityscapes in its official layout (leftImg8bit/, gtFine/): labelIds mapped to the 19 trainIds by
    torchvision's label table. Listed here, not by torchvision.datasets.Cityscapes: its listing fails on a
    stray file beside the city folders (a .DS_Store, a README), and its order (os.listdir) is not the same
    on every machine; this one is sorted, the same on every rank."""
    classes = {"names": CLASS_NAMES, "colors": CLASS_COLORS}
    label_table = _ID_TO_TRAINID_NP

    def __init__(self, root, split="train", **options):
        get = ("docs/cityscapes.md says how to get Cityscapes; for a demo on a synthetic set, ./run.sh without DATA "
               "(where data/cityscapes is empty)")
        for sub in ("leftImg8bit", "gtFine"):
            if not os.path.isdir(os.path.join(root, sub, split)):
                raise BadInput(f"{os.path.join(root, sub, split)} not found: {root} should hold Cityscapes "
                               f"(leftImg8bit/ and gtFine/) or your own data (images/, masks/, classes.json). {get}")
        pairs, self.not_files = [], []  # not_files: what is no file to read, skipped (images.input_files)
        for city in _folder_entries(os.path.join(root, "leftImg8bit", split)):
            files, others = input_files(city, recursive=False)
            self.not_files += others
            for name in files:
                if name.endswith("_leftImg8bit.png"):
                    label = name.replace("_leftImg8bit.png", "_gtFine_labelIds.png")
                    pairs.append((name, os.path.join(root, "gtFine", split, os.path.basename(city),
                                                     os.path.basename(label))))
        if not pairs:
            raise BadInput(f"{os.path.join(root, 'leftImg8bit', split)} holds no *_leftImg8bit.png images. {get}")
        # Listed, not globbed: glob skips a city folder it cannot list without a word, and its labels look missing.
        labels = {name for city in _folder_entries(os.path.join(root, "gtFine", split))
                  for name in input_files(city, recursive=False)[0] if name.endswith("_gtFine_labelIds.png")}
        missing = [t for _, t in pairs if t not in labels]
        if missing:
            raise BadInput(f"{len(missing)} {split} image(s) have no label file, e.g. {missing[0]} is missing; "
                           "add the gtFine labels or remove those images")
        orphans = sorted(labels - {t for _, t in pairs})
        if orphans:
            raise BadInput(f"{len(orphans)} {split} label(s) have no image, e.g. {orphans[0]}; "
                           "add the leftImg8bit images or remove those labels")
        super().__init__([image for image, _ in pairs], [label for _, label in pairs], **options)

    def read_label(self, path):
        return read_label(path)

    def image_id(self, index):
        """'{city}_{seq}_{frame}', the key the official evaluation matches predictions by."""
        return os.path.basename(self.images[index]).replace("_leftImg8bit.png", "")

    def prediction_path(self, index, folder):
        """Where save_prediction writes the image's prediction."""
        return os.path.join(folder, f"{self.image_id(index)}_pred_labelIds.png")

    def save_prediction(self, index, prediction, folder):
        """(H, W) trainIds -> a labelIds PNG named after the image: what the official evaluation reads."""
        os.makedirs(folder, exist_ok=True)  # each rank writes its own images' files, on its own node too
        Image.fromarray(TRAINID_TO_ID[prediction].numpy()).save(self.prediction_path(index, folder),
                                                                 pnginfo=prediction_tag())


# ---------------------------------------------------------------------------------------------------
# Your own data: images, masks and classes.json in plain folders.

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
_CLASSES_EXAMPLE = ('{"names": ["background", "cat"], "colors": [[0, 0, 0], [255, 0, 0]], "ignore_index": 255} '
                    "(colors and ignore_index may be left out)")


def default_colors(count):
    """A colour per class, for a classes.json without "colors": PASCAL VOC's palette (the bits of each index
    spread over r, g and b, high bits first), from its second entry on: black stays for ignored pixels."""
    colors = []
    for index in range(1, count + 1):
        rgb, bits = [0, 0, 0], index
        for shift in range(7, -1, -1):
            for channel in range(3):
                rgb[channel] |= ((bits >> channel) & 1) << shift
            bits >>= 3
        colors.append(rgb)
    return colors


def _no_key_twice(pairs):
    """json's object hook: a key given twice is an error (json alone keeps the last, and the first is lost unseen)."""
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise BadInput(f"{', '.join(map(repr, twice))} given more than once (Python's json keeps only the last): keep "
                       "one")
    return dict(pairs)


def read_classes(root):
    """DIR/classes.json -> ({"names", "colors"}, the mask value that means ignore), checked."""
    path = os.path.join(root, "classes.json")
    if os.path.exists(path) and not_a_file(path):  # (opening a named pipe would wait for ever)
        raise BadInput(f"{path} is {not_a_file(path)}, not a file: write classes.json as {_CLASSES_EXAMPLE}")
    try:
        with open(path) as f:
            spec = json.load(f, object_pairs_hook=_no_key_twice)
    except FileNotFoundError:
        raise BadInput(f"{path} not found: a data set in images/ and masks/ names its classes there, as "
                       f"{_CLASSES_EXAMPLE}") from None
    except BadInput as error:
        raise BadInput(f"{path}: {error}") from None
    except (OSError, ValueError, RecursionError) as error:  # (RecursionError: nested past Python's recursion limit)
        raise BadInput(f"{path} cannot be read as JSON ({str(error).splitlines()[0]}); write it as "
                       f"{_CLASSES_EXAMPLE}") from None
    if not isinstance(spec, dict) or set(spec) - {"names", "colors", "ignore_index"}:
        extra = sorted(set(spec) - {"names", "colors", "ignore_index"}) if isinstance(spec, dict) else spec
        raise BadInput(f"{path} holds {extra!r}, not only names, colors and ignore_index; write it as "
                       f"{_CLASSES_EXAMPLE}")
    names = spec.get("names")
    if not isinstance(names, list) or len(names) < 2 or not all(isinstance(name, str) and name for name in names):
        raise BadInput(f'{path}: "names" must list at least 2 class names, in the order of their indices in the '
                       f"masks; write it as {_CLASSES_EXAMPLE}")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise BadInput(f'{path}: "names" lists {", ".join(map(repr, twice))} more than once (indices '
                       f"{', '.join(str(i) for i, name in enumerate(names) if name in twice)}): give each class one "
                       "name, and a mask value one class")
    if len(names) > 255:
        raise BadInput(f'{path} names {len(names)} classes, but a mask of 8 bits a pixel holds at most 255 classes '
                       "beside its ignore_index: merge classes, or train on at most 255")
    ignore = spec.get("ignore_index", IGNORE_INDEX)
    if type(ignore) is float and ignore.is_integer():  # 255.0 is the whole number 255, as JSON writers may put it
        ignore = int(ignore)
    if type(ignore) is not int or not len(names) <= ignore <= 255:
        raise BadInput(f'{path}: "ignore_index" {ignore!r} must be a whole number from {len(names)} to 255: '
                       f"0-{len(names) - 1} are the classes' indices")
    colors = spec.get("colors", default_colors(len(names)))
    if not (isinstance(colors, list) and len(colors) == len(names) and all(
            isinstance(c, list) and len(c) == 3 and all(type(v) is int and 0 <= v <= 255 for v in c) for c in colors)):
        raise BadInput(f'{path}: "colors" must hold one [r, g, b] of 0-255 for each of the {len(names)} names')
    return {"names": names, "colors": colors}, ignore


OTHER_IMAGE_FORMATS = (".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".jpg", ".jpeg", ".png")


def _files_below(folder, extensions, what, not_files):
    """Paths below folder (sub-folders included, linked ones too) of files with those extensions, relative to
    it, sorted; what is no file to read is added to not_files. An image in another format is named: training
    does not read it (what: "images" or "masks")."""
    found, others = input_files(folder)
    not_files += others
    for path in found:
        name = os.path.basename(path)
        if name.lower().endswith(OTHER_IMAGE_FORMATS) and not name.lower().endswith(extensions):
            why = ("are PNGs: JPEG's compression changes class indices" if what == "masks" else
                   f"are {', '.join(extensions)} files")
            again = os.path.splitext(name)[0] + (".png" if what == "masks" else ".jpg or .png")
            raise BadInput(f"{path}: {what} {why}, and this format is not read; save it as {again}, or remove it")
    return [os.path.relpath(path, folder) for path in found if path.lower().endswith(extensions)]


class FolderDataset(SegmentationFiles):
    """Your own data, in plain folders (sub-folders allowed: images/train/a/x.jpg pairs with masks/train/a/x.png):

        DIR/classes.json                   {"names": [...], "colors": [[r, g, b], ...], "ignore_index": 255}
        DIR/images/{train,val}/NAME.jpg    (or .jpeg, .png)
        DIR/masks/{train,val}/NAME.png     one class index per pixel (0 is names[0]), ignore_index where
                                           unlabelled; 8-bit greyscale, or a palette PNG (its indices count,
                                           not its colours)

    The classes, their names and colours come from classes.json ("colors" and "ignore_index" optional).
    Images are read as a viewer shows them (EXIF orientation applied): their masks must match that.
    Every mask is read whole at start (check_files): a stray value in one of yours, from a resize or an
    annotation tool, would otherwise stop training part-way. Cityscapes' train labels are only opened."""
    checks_every_label = True

    def __init__(self, root, split="train", **options):
        self.classes, self.ignore_value = read_classes(root)
        self.classes_path = os.path.join(root, "classes.json")
        self.label_check = f":{self.num_classes}:{self.ignore_value}"  # a cached mask is valid for these alone
        self.label_table = np.full(256, IGNORE_INDEX, dtype=np.uint8)
        self.label_table[:self.num_classes] = np.arange(self.num_classes)
        self.image_root, mask_root = os.path.join(root, "images", split), os.path.join(root, "masks", split)
        for folder in (self.image_root, mask_root):
            if not os.path.isdir(folder):
                raise BadInput(f"{folder} not found: with a classes.json, {root} holds its {split} images in "
                               f"images/{split}/ and their masks in masks/{split}/ (docs/your-data.md)")
        images, self.not_files = {}, []  # not_files: what is no file to read, skipped (images.input_files)
        for name in _files_below(self.image_root, IMAGE_EXTENSIONS, "images", self.not_files):
            stem = os.path.splitext(name)[0]
            if stem in images:
                raise BadInput(f"{self.image_root}: {images[stem]} and {name} would share one mask, {stem}.png; "
                               "rename one")
            images[stem] = name
        masks = {os.path.splitext(name)[0]: name for name in _files_below(mask_root, (".png",), "masks", self.not_files)}
        if not images:
            raise BadInput(f"{self.image_root} holds no images ({', '.join(IMAGE_EXTENSIONS)}): the {split} "
                           "split is empty")
        missing = [stem for stem in images if stem not in masks]
        if missing:
            raise BadInput(f"{len(missing)} {split} image(s) have no mask, e.g. {os.path.join(mask_root, missing[0])}"
                           ".png is missing; add the masks or remove those images")
        orphans = [name for stem, name in masks.items() if stem not in images]
        if orphans:
            raise BadInput(f"{len(orphans)} {split} mask(s) have no image, e.g. {os.path.join(mask_root, orphans[0])}"
                           "; add the images or remove those masks")
        stems = sorted(images)
        super().__init__([os.path.join(self.image_root, images[s]) for s in stems],
                         [os.path.join(mask_root, masks[s]) for s in stems], **options)

    def read_label(self, path):
        """(H, W) uint8 class indices or ignore_index, checked against classes.json."""
        mask = decode_label(path)
        if mask.ndim != 2 or mask.dtype != np.uint8:
            raise BadInput(f"{path} is not a mask of class indices ({mask.dtype}, shape {mask.shape}): a mask is an "
                           "8-bit greyscale or palette PNG holding one class index per pixel")
        top = int(mask.max())  # one fast pass; a second only where ignore is the largest value
        if top == self.ignore_value:
            top = int(np.where(mask == self.ignore_value, 0, mask).max())
        if top >= self.num_classes:
            raise BadInput(f"{path} holds the class index {top}, but {self.classes_path} names {self.num_classes} "
                           f"classes (0-{self.num_classes - 1}) and ignore_index {self.ignore_value}: fix the mask, "
                           "or add the class to classes.json")
        return mask

    def image_id(self, index):
        """The image's path below images/SPLIT/, without its extension."""
        return os.path.splitext(os.path.relpath(self.images[index], self.image_root))[0]

    def prediction_path(self, index, folder):
        """Where save_prediction writes the image's prediction: its path below images/SPLIT/, as a PNG."""
        return os.path.join(folder, self.image_id(index) + ".png")

    def save_prediction(self, index, prediction, folder):
        """(H, W) class indices -> a mask as the data set's own: a palette PNG, the classes in their colours."""
        path = self.prediction_path(index, folder)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        mask = Image.fromarray(prediction.to(torch.uint8).numpy())
        mask.putpalette(palette_of(self.classes["colors"]))
        mask.save(path, pnginfo=prediction_tag())


PREDICTION_SOFTWARE = "save_prediction of DeepLab's dataset.py"  # in each prediction: a PNG's Software text


def prediction_tag():
    """What a prediction PNG says of itself, so that a later run tells its own files from others (a data set's
    masks) before it writes over any."""
    tag = PngImagePlugin.PngInfo()
    tag.add_text("Software", PREDICTION_SOFTWARE)
    return tag


def is_prediction(path):
    """Whether the file at path is a PNG that save_prediction wrote (its header read, not its pixels)."""
    try:
        with Image.open(path) as image:
            return image.format == "PNG" and image.info.get("Software") == PREDICTION_SOFTWARE
    except (OSError, ValueError):
        return False


def palette_of(colors):
    """A PNG palette of 256 entries, the classes' colours first, black after. All 256: with fewer, PIL writes
    fewer bits a pixel, and an index past them (255, ignore) would be changed."""
    return [value for color in colors for value in color] + [0] * (3 * (256 - len(colors)))


def open_dataset(root, split="train", **options):
    """The data set at root: your own (FolderDataset) where root holds classes.json, or images/ without Cityscapes'
    leftImg8bit/ beside it; else Cityscapes. Both classes.json and leftImg8bit/ there: an error, which to read is
    not ours to guess. options: SegmentationFiles' (crop_size, seed, cache_dir, scale_range, color_jitter)."""
    if os.path.isfile(root):
        raise BadInput(f"{root} is a file, not a data set's folder" + (": unzip it into a folder and give that"
                       if root.lower().endswith((".zip", ".tar", ".gz")) else ""))
    if os.path.isdir(root) and not os.access(root, os.R_OK | os.X_OK):  # else every folder in it looks missing
        raise BadInput(cannot_list(root, PermissionError(errno.EACCES, os.strerror(errno.EACCES))))
    archives = glob.glob(os.path.join(root, "*.zip"))
    if archives and not any(os.path.isdir(os.path.join(root, sub)) for sub in ("leftImg8bit", "images")):
        raise BadInput(f"{root} holds {os.path.basename(archives[0])} but no leftImg8bit/ or images/ folder: unzip "
                       "the archives there (docs/cityscapes.md)")
    cityscapes = os.path.isdir(os.path.join(root, "leftImg8bit"))
    named_classes = os.path.exists(os.path.join(root, "classes.json"))
    if cityscapes and named_classes:
        raise BadInput(f"{root} holds both Cityscapes' leftImg8bit/ and a folder data set's classes.json: give each "
                       "data set a folder of its own")
    own = named_classes or (os.path.isdir(os.path.join(root, "images")) and not cityscapes)
    return (FolderDataset if own else Cityscapes)(root, split, **options)
