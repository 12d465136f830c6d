"""The data: Cityscapes (its official layout, the 19 train classes) or your own (images/, masks/ and
classes.json in plain folders), and the augmentation.

    from dataset import open_dataset, normalize
    train_set = open_dataset("data/cityscapes", "train", crop_size=(768, 768), cache_dir="data/cache")
    image, label = train_set[0]     # uint8 image (3, 768, 768); uint8 class indices (768, 768), 255 = ignore
    train_set.classes               # {"names": [...], "colors": [[r, g, b], ...]}, Cityscapes' 19 here
    images = normalize(images.cuda(non_blocking=True))  # float32, ImageNet mean/std, on the GPU

Workers hand over uint8 (4 bytes a pixel with the label, not 13) and leave the float conversion to the
GPU. With cache_dir, each frame is decoded once and then read as an uncompressed array, memory-mapped:
a worker reads only the rows of its crop, and the page cache is shared by every worker and rank.
Fill the cache before training (optional: the first epoch fills it too):

    python dataset.py --prepare-cache data/cache --data data/cityscapes --split train val

No real data at hand? Write a synthetic set in exactly the official layout and file naming (--photo: with
the texture and noise of photographs, so that files are as large and as slow to decode as real ones):

    python dataset.py --synthetic data/cityscapes_synthetic --num-train 200 --num-val 50 --size 256 128
    python dataset.py --synthetic data/my_streets --layout folder   # the folder layout (FolderDataset)
"""
import argparse
import glob
import hashlib
import json
import multiprocessing
import os
import secrets
import sys

import numpy as np
import torch
import torchvision
from PIL import Image, ImageDraw, ImageOps
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

try:  # torchcodec: the decoder torchvision 0.29 names as its successor; bundles libpng, needs no FFmpeg
    from torchcodec.decoders import decode_image as _torchcodec_decode
except (ImportError, OSError, RuntimeError):  # not installed, or built for another torch: PIL decodes
    _torchcodec_decode = None

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
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's: the backbones were trained with them


def sample_generator(seed, epoch, index):
    """A random generator for one sample of one epoch. Augmentation drawn from it depends on nothing
    else: not on the rank, the worker, or what the process did before, so a run is reproducible."""
    state = np.random.SeedSequence([seed, epoch, index]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> 1))


def train_transform(image, label, crop_size, generator, scale_range=(0.5, 2.0)):
    """Random scale, random crop, horizontal flip, applied to image and label together: crop_window and
    resize_pad_flip in one call, on a whole decoded frame (Cityscapes.__getitem__ calls the two itself, to
    copy only the crop's region out of the frame or the cache).

    Equivalent to "resize the whole image by a random factor, then take a random crop", but it cuts the
    crop's region out of the source first and resizes only that: on a 2048x1024 image with a 768 crop that
    is several times less work. Where the scaled image is smaller than the crop, the
    image is padded with 0 and the label with 255 (ignore), never with 0, which is the class "road".
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


def default_workers():
    """DataLoader workers for one training process: its share of the cores it may run on, less one for the
    process itself (at least 1, at most 16). torchrun sets LOCAL_WORLD_SIZE, the processes on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(16, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - 1))


def normalize(images):
    """uint8 images (N, 3, H, W) or (3, H, W), on any device -> float32 normalised with ImageNet's mean and
    std. The trainer calls it on the GPU after the copy: workers and the copy move a quarter of the bytes."""
    return F.normalize(F.to_dtype(images, torch.float32, scale=True), MEAN, STD)


class BadInput(ValueError):
    """A data problem the user can fix: main.py prints its message as one line, without a traceback."""


# ---------------------------------------------------------------------------------------------------
# Decoding. Both readers return numpy arrays, (H, W, 3) and (H, W) uint8, so that a crop can be sliced
# out of them, or out of the cache's memory maps, before anything is copied.

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_image(path):
    """(H, W, 3) uint8, bitwise the pixels PIL gives. torchcodec decodes a photo-like 2048x1024 PNG in
    28 ms, PIL in 35 (AMD EPYC, one thread). Its (3, H, W) result is returned as a strided (H, W, 3) view:
    only the crop is copied into (H, W, 3) order, the order torchvision's uint8 resize is fastest on."""
    try:
        if _torchcodec_decode is not None:
            return _torchcodec_decode(path, mode="RGB").permute(1, 2, 0).numpy()
        with Image.open(path) as f:
            f = ImageOps.exif_transpose(f)  # a phone's JPEG turned as a viewer shows it, as torchcodec does
            return np.asarray(f if f.mode == "RGB" else f.convert("RGB"))
    except Exception as error:
        raise BadInput(f"{path} cannot be decoded ({str(error).splitlines()[0][:200]}); replace it, or remove "
                       "the image and its label") from None


def decode_label(path):
    """(H, W) label values as the file holds them, unchecked. torchcodec only for 8-bit greyscale PNGs
    (Cityscapes' own): on a palette PNG it would return the palette's colours, not the indices, so anything
    else goes to PIL."""
    try:
        with open(path, "rb") as f:
            header = f.read(26)  # signature, IHDR: width, height, bit depth (byte 24), colour type (byte 25)
        if header[:8] == _PNG_SIGNATURE and header[25] == 0 and header[24] < 8:
            raise ValueError(f"a {header[24]}-bit greyscale PNG, whose values PIL would scale to 0-255; save it as "
                             "8-bit")
        if _torchcodec_decode is not None and header[:8] == _PNG_SIGNATURE and header[24:26] == b"\x08\x00":
            return _torchcodec_decode(path, mode="UNCHANGED")[0].numpy()
        with Image.open(path) as f:
            return np.asarray(f)  # mode "P": the indices; "L": the values
    except Exception as error:
        raise BadInput(f"{path} cannot be decoded ({str(error).splitlines()[0][:200]}); replace it, or remove "
                       "the image and its label") from None


def read_label(path):
    """(H, W) uint8 Cityscapes labelIds, checked."""
    label_ids = decode_label(path)
    if label_ids.ndim != 2 or label_ids.dtype != np.uint8 or int(label_ids.max()) > MAX_LABEL_ID:
        raise BadInput(f"{path} is not a Cityscapes labelIds image (8-bit, values 0-{MAX_LABEL_ID}): "
                       f"it holds {label_ids.dtype} values up to {int(label_ids.max())}, shape "
                       f"{label_ids.shape}. Use the *_gtFine_labelIds.png files")
    return label_ids


# ---------------------------------------------------------------------------------------------------
# The decode cache: each frame decoded once, kept as an uncompressed .npy, read through a memory map.

def cache_path(cache_dir, source, checked=""):
    """The cache file of a source file. Its name holds a hash of the source's path and one of its size and
    modification time: a source that changes gets a new name, so a stale entry is never read. checked: what
    the entry was checked against when it was decoded (a mask's classes), also part of the name."""
    stat = os.stat(source)
    where = hashlib.sha1(os.path.abspath(source).encode()).hexdigest()[:10]
    version = hashlib.sha1(f"{stat.st_size}:{stat.st_mtime_ns}{checked}".encode()).hexdigest()[:10]
    stem = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(cache_dir, f"{stem}.{where}.{version}.npy")


def cached(cache_dir, source, read, checked=""):
    """read(source) as an array, from the cache when it holds a sound copy (a memory map: nothing is read
    until sliced), else decoded and written there. Safe with many processes at once: each writes a file
    of its own name and renames it into place (atomic), so a reader sees no file or a whole one; two that
    miss together both decode and write the same bytes."""
    try:
        path = cache_path(cache_dir, source, checked)
    except OSError as error:
        raise BadInput(f"{source} cannot be read ({error}); replace it, or remove the image and its label") from None
    try:
        array = np.load(path, mmap_mode="r")
        if array.dtype == np.uint8 and array.offset + array.nbytes == os.path.getsize(path):
            return array
    except (ValueError, OSError, EOFError):  # none yet, or damaged (truncated, overwritten): decoded below
        pass
    array = read(source)
    temporary = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"  # unique per process and thread
    try:
        with open(temporary, "xb") as f:
            np.save(f, array)  # no fsync: a file cut short by a crash fails the size check and is rebuilt
        os.replace(temporary, path)
    except OSError as error:
        raise BadInput(f"cannot write the decode cache {path} ({error}); free space there or use another "
                       "cache folder") from None
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    # Earlier versions of this source (it changed since) are garbage now.
    for old in glob.glob(path[:path.rindex(".", 0, -4)] + ".*.npy"):
        if old != path:
            try:
                os.remove(old)
            except FileNotFoundError:  # another process removed it first
                pass
    return array


def _folder_entries(folder, folders=True):
    """The sub-folders (or the files) of folder, sorted; other entries ignored. A link that leads nowhere
    or to itself (a loop) is named: it is a mistake in the data folder, not something to skip quietly."""
    entries = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.islink(path) and not os.path.exists(path):
            raise BadInput(f"{path} is a symbolic link that leads nowhere or loops back to itself; fix or remove it")
        if os.path.isdir(path) if folders else os.path.isfile(path):
            entries.append(path)
    return entries


class SegmentationFiles(torch.utils.data.Dataset):
    """Pairs of image and label files, and what is done with them whatever their layout: decoding (or the
    decode cache), the training augmentation, label values mapped to class indices, the checks. Cityscapes
    and FolderDataset below say which files, and set what differs between layouts:

        classes       {"names": [...], "colors": [[r, g, b], ...]}: the classes a model learns, in index order
        label_table   numpy uint8 (256,): a label file's value -> class index, 255 = ignore
        read_label    path -> the label file's (H, W) uint8 values, checked

    Training augmentation (with crop_size): a random scale in scale_range, a random crop, a flip, and with
    color_jitter > 0 a random brightness, contrast and saturation (jitter_colors).
    Returns (image, label): image uint8 (3, H, W), to be normalised with normalize() where it is used;
    label uint8 (H, W) of class indices, 255 where ignored. With crop_size=None (evaluation) the full
    resolution. With cache_dir, decoded frames are kept there (see cached()), and the output is the same.
    """
    classes, label_table = None, None
    checks_every_label = False  # check_files decodes every label, train's too
    label_check = ""  # what read_label checks values against, for the cache's names (cached())

    def __init__(self, images, labels, crop_size=None, seed=0, cache_dir=None, scale_range=(0.5, 2.0),
                 color_jitter=0.0):
        self.images, self.labels = images, labels
        self.crop_size, self.seed, self.cache_dir = crop_size, seed, cache_dir
        self.scale_range, self.color_jitter = scale_range, color_jitter
        if cache_dir is not None:
            try:
                os.makedirs(cache_dir, exist_ok=True)
            except OSError as error:
                raise BadInput(f"cannot make the decode cache folder {cache_dir} ({error}); use another") from None
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
        """Read every file's header (not its pixels: about 0.1 ms a pair): each opens as an image, and each
        label has its image's size. Catches most bad files before any training time is spent.
        decode_labels (or checks_every_label): also decode every label and check its values (val's: a few
        seconds for Cityscapes' 500)."""
        for image_path, label_path in zip(self.images, self.labels):
            if decode_labels or self.checks_every_label:
                self.read_label(label_path)
            sizes = []
            for path in (image_path, label_path):
                try:
                    with Image.open(path) as f:
                        has_exif = f.format == "JPEG" or "exif" in f.info  # a PNG's eXIf chunk, if before IDAT
                        turned = has_exif and f.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # EXIF orientation
                        sizes.append(f.size[::-1] if turned else f.size)  # as read_image turns it
                except Exception as error:
                    raise BadInput(f"{path} cannot be read as an image ({error}); replace it, or remove the image "
                                   "and its label") from None
            if sizes[0] != sizes[1]:
                raise BadInput(f"{label_path} is {sizes[1][0]}x{sizes[1][1]} but its image is "
                               f"{sizes[0][0]}x{sizes[0][1]}; they must match")

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
            # in (H, W, 3) order, in which torchvision's uint8 resize is fastest (3-4x).
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


class Cityscapes(SegmentationFiles):
    """Cityscapes in its official layout (leftImg8bit/, gtFine/): labelIds mapped to the 19 trainIds by
    torchvision's label table. Listed here, not by torchvision.datasets.Cityscapes: its listing fails on a
    stray file beside the city folders (a .DS_Store, a README), and its order (os.listdir) is not the same
    on every machine; this one is sorted, the same on every rank."""
    classes = {"names": CLASS_NAMES, "colors": CLASS_COLORS}
    label_table = _ID_TO_TRAINID_NP

    def __init__(self, root, split="train", **options):
        get = "README.md says how to get Cityscapes; ./run.sh writes a synthetic set for a demo"
        for sub in ("leftImg8bit", "gtFine"):
            if not os.path.isdir(os.path.join(root, sub, split)):
                raise BadInput(f"{os.path.join(root, sub, split)} not found: {root} should hold Cityscapes "
                               f"(leftImg8bit/ and gtFine/) or your own data (images/, masks/, classes.json). {get}")
        pairs = []
        for city in _folder_entries(os.path.join(root, "leftImg8bit", split)):
            for name in _folder_entries(city, folders=False):
                if name.endswith("_leftImg8bit.png"):
                    label = name.replace("_leftImg8bit.png", "_gtFine_labelIds.png")
                    pairs.append((name, os.path.join(root, "gtFine", split, os.path.basename(city),
                                                     os.path.basename(label))))
        if not pairs:
            raise BadInput(f"{os.path.join(root, 'leftImg8bit', split)} holds no *_leftImg8bit.png images. {get}")
        missing = [t for _, t in pairs if not os.path.isfile(t)]
        if missing:
            raise BadInput(f"{len(missing)} {split} image(s) have no label file, e.g. {missing[0]} is missing; "
                           "add the gtFine labels or remove those images")
        labels = glob.glob(os.path.join(root, "gtFine", split, "*", "*_gtFine_labelIds.png"))
        orphans = sorted(set(labels) - {t for _, t in pairs})
        if orphans:
            raise BadInput(f"{len(orphans)} {split} label(s) have no image, e.g. {orphans[0]}; "
                           "add the leftImg8bit images or remove those labels")
        super().__init__([image for image, _ in pairs], [label for _, label in pairs], **options)

    def read_label(self, path):
        return read_label(path)

    def image_id(self, index):
        """'{city}_{seq}_{frame}', the key the official evaluation matches predictions by."""
        return os.path.basename(self.images[index]).replace("_leftImg8bit.png", "")

    def save_prediction(self, index, prediction, folder):
        """(H, W) trainIds -> a labelIds PNG named after the image: what the official evaluation reads."""
        Image.fromarray(TRAINID_TO_ID[prediction].numpy()).save(
            os.path.join(folder, f"{self.image_id(index)}_pred_labelIds.png"))


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


def read_classes(root):
    """DIR/classes.json -> ({"names", "colors"}, the mask value that means ignore), checked."""
    path = os.path.join(root, "classes.json")
    try:
        with open(path) as f:
            spec = json.load(f)
    except FileNotFoundError:
        raise BadInput(f"{path} not found: a data set in images/ and masks/ names its classes there, as "
                       f"{_CLASSES_EXAMPLE}") from None
    except (OSError, ValueError) as error:
        raise BadInput(f"{path} cannot be read as JSON ({str(error).splitlines()[0][:150]}); write it as "
                       f"{_CLASSES_EXAMPLE}") from None
    if not isinstance(spec, dict) or set(spec) - {"names", "colors", "ignore_index"}:
        extra = sorted(set(spec) - {"names", "colors", "ignore_index"}) if isinstance(spec, dict) else spec
        raise BadInput(f"{path} holds {extra!r}, not only names, colors and ignore_index; write it as "
                       f"{_CLASSES_EXAMPLE}")
    names = spec.get("names")
    if (not isinstance(names, list) or len(names) < 2 or len(set(map(str, names))) != len(names)
            or not all(isinstance(name, str) and name for name in names)):
        raise BadInput(f'{path}: "names" must list at least 2 different class names, in the order of their '
                       f"indices in the masks; write it as {_CLASSES_EXAMPLE}")
    ignore = spec.get("ignore_index", IGNORE_INDEX)
    if type(ignore) is not int or not len(names) <= ignore <= 255:
        raise BadInput(f'{path}: "ignore_index" {ignore!r} must be a whole number from {len(names)} to 255: '
                       f"0-{len(names) - 1} are the classes' indices")
    colors = spec.get("colors", default_colors(len(names)))
    if not (isinstance(colors, list) and len(colors) == len(names) and all(
            isinstance(c, list) and len(c) == 3 and all(type(v) is int and 0 <= v <= 255 for v in c) for c in colors)):
        raise BadInput(f'{path}: "colors" must hold one [r, g, b] of 0-255 for each of the {len(names)} names')
    return {"names": names, "colors": colors}, ignore


def _files_below(folder, extensions):
    """Paths below folder (sub-folders included, linked ones too) of files with those extensions, relative to
    it, sorted."""
    found, seen = [], set()
    for parent, subfolders, names in os.walk(folder, followlinks=True):
        if os.path.realpath(parent) in seen:
            raise BadInput(f"{parent} leads back to a folder already listed (a symbolic link loop); fix or remove it")
        seen.add(os.path.realpath(parent))
        subfolders.sort()
        for name in names:
            path = os.path.join(parent, name)
            if os.path.islink(path) and not os.path.exists(path):
                raise BadInput(f"{path} is a symbolic link that leads nowhere or loops back to itself; fix or "
                               "remove it")
            if name.lower().endswith(extensions):
                found.append(os.path.relpath(path, folder))
    return sorted(found)


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
                               f"images/{split}/ and their masks in masks/{split}/ (README.md, 'Your own data')")
        images = {}
        for name in _files_below(self.image_root, IMAGE_EXTENSIONS):
            stem = os.path.splitext(name)[0]
            if stem in images:
                raise BadInput(f"{self.image_root}: {images[stem]} and {name} would share one mask, {stem}.png; "
                               "rename one")
            images[stem] = name
        masks = {os.path.splitext(name)[0]: name for name in _files_below(mask_root, (".png",))}
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
        top = int(mask.max())  # fast (0.05 ms for 2 M pixels); the second pass only where ignore is the largest
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

    def save_prediction(self, index, prediction, folder):
        """(H, W) class indices -> a mask as the data set's own: a palette PNG, the classes in their colours."""
        path = os.path.join(folder, self.image_id(index) + ".png")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        mask = Image.fromarray(prediction.to(torch.uint8).numpy())
        mask.putpalette(palette_of(self.classes["colors"]))
        mask.save(path)


def palette_of(colors):
    """A PNG palette of 256 entries, the classes' colours first, black after. All 256: with fewer, PIL writes
    fewer bits a pixel, and an index past them (255, ignore) would be changed."""
    return [value for color in colors for value in color] + [0] * (3 * (256 - len(colors)))


def open_dataset(root, split="train", **options):
    """The data set at root: your own (FolderDataset) where root holds classes.json or images/, else Cityscapes.
    options: SegmentationFiles' (crop_size, seed, cache_dir, scale_range, color_jitter)."""
    own = os.path.exists(os.path.join(root, "classes.json")) or os.path.isdir(os.path.join(root, "images"))
    return (FolderDataset if own else Cityscapes)(root, split, **options)


def colorize(labels, colors=CLASS_COLORS):
    """(H, W) class indices -> (H, W, 3) uint8 in the classes' colours (Cityscapes' by default); ignore is black."""
    palette = torch.zeros(256, 3, dtype=torch.uint8)
    palette[:len(colors)] = torch.tensor(colors, dtype=torch.uint8)
    return palette[labels.long()]


# ---------------------------------------------------------------------------------------------------
# A synthetic Cityscapes: procedural street scenes, written in the official layout.

_ID = {c.name: c.id for c in _TABLE}
_TRAIN_CITIES = ("aachen", "bochum", "bremen")
_VAL_CITIES = ("frankfurt", "lindau", "munster")


def _jitter(rng, color, amount=25):
    return tuple(int(np.clip(v + rng.integers(-amount, amount + 1), 0, 255)) for v in color)


def photo_texture(rng, height, width):
    """What photographs have and drawings lack, as (H, W, 3) float32 to add to an image: texture whose power
    falls with spatial frequency f as 1/f^1.8, as in natural images (white noise shaped in the Fourier
    domain), half of it shared by the three channels as brightness is, and sensor noise of sigma 1.
    A 2048x1024 street scene with it saves to a PNG of about 2.3 MB, as a real frame (about 2.2 MB), so
    decoding it costs about what a real frame's does; a drawing's flat areas compress away and decode fast."""
    fy = np.fft.fftfreq(height).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(width).astype(np.float32)[None, :]
    radius = np.sqrt(fy * fy + fx * fx)
    radius[0, 0] = np.inf  # no constant term: the scene keeps its mean colour

    def texture():
        field = np.fft.irfft2(np.fft.rfft2(rng.standard_normal((height, width), dtype=np.float32)) / radius ** 1.8,
                              s=(height, width))
        return (field / field.std()).astype(np.float32)

    shared = texture()
    amplitude = 8  # grey levels per unit of each half: visible shading that leaves classes recognisable
    channels = [amplitude * (shared + texture()) for _ in range(3)]
    return np.stack(channels, axis=-1) + rng.standard_normal((height, width, 3), dtype=np.float32)


def draw_street(rng, width, height, photo=False):
    """One street scene: (RGB uint8 array, labelId uint8 array). Shapes, not just colours, tell the
    classes apart: colours are jittered per object, overlap between classes, and carry noise (photo=True:
    photo_texture's instead of plain Gaussian noise of sigma 8)."""
    image = Image.new("RGB", (width, height))
    label = Image.new("L", (width, height), _ID["unlabeled"])
    paint, mark = ImageDraw.Draw(image), ImageDraw.Draw(label)

    def shape(kind, box, color, name):
        getattr(paint, kind)(box, fill=color)
        getattr(mark, kind)(box, fill=_ID[name])

    horizon = int(height * rng.uniform(0.35, 0.5))
    sky = _jitter(rng, (70, 130, 180), 30)
    shape("rectangle", [0, 0, width, horizon], sky, "sky")
    # Buildings and trees along the horizon.
    x = -int(rng.integers(0, width // 10 + 1))
    while x < width:
        w = int(width * rng.uniform(0.08, 0.25))
        top = horizon - int(height * rng.uniform(0.12, 0.38))
        if rng.random() < 0.7:
            wall = _jitter(rng, rng.choice([(70, 70, 70), (120, 100, 80), (150, 140, 130)]), 30)
            shape("rectangle", [x, top, x + w, horizon + 2], wall, "building")
            cell = max(4, w // 5)
            glass = _jitter(rng, (40, 50, 70), 20)
            for wy in range(top + cell // 2, horizon - cell, cell):
                for wx in range(x + cell // 3, x + w - cell // 2, cell):
                    paint.rectangle([wx, wy, wx + cell // 2, wy + cell // 2], fill=glass)
        else:
            trunk = max(2, w // 10)
            shape("rectangle", [x + w // 2 - trunk // 2, top + (horizon - top) // 2, x + w // 2 + trunk // 2,
                                horizon + 2], _jitter(rng, (90, 70, 40)), "vegetation")
            shape("ellipse", [x, top, x + w, top + (horizon - top) * 3 // 4], _jitter(rng, (107, 142, 35), 30),
                  "vegetation")
        x += w
    # Ground: sidewalk or terrain on both sides, the road in perspective towards a vanishing point.
    ground = "terrain" if rng.random() < 0.3 else "sidewalk"
    ground_color = (152, 200, 120) if ground == "terrain" else (190, 160, 170)
    shape("rectangle", [0, horizon, width, height], _jitter(rng, ground_color, 20), ground)
    vanish = width * rng.uniform(0.35, 0.65)
    left_edge, right_edge = width * rng.uniform(-0.4, 0.1), width * rng.uniform(0.9, 1.4)
    road = [(vanish - 2, horizon), (vanish + 2, horizon), (right_edge, height), (left_edge, height)]
    shape("polygon", road, _jitter(rng, (110, 80, 110), 20), "road")
    for t in np.arange(0.1, 1.0, 0.2):  # lane marks: paint on the road, still labelled road
        y0, y1 = horizon + (height - horizon) * t, horizon + (height - horizon) * (t + 0.08)
        x0, x1 = vanish + (width / 2 - vanish) * t, vanish + (width / 2 - vanish) * (t + 0.08)
        paint.line([(x0, y0), (x1, y1)], fill=(230, 230, 230), width=max(1, int(3 * t)))

    def road_x(y, frac):  # a point at fraction frac across the road at row y
        t = (y - horizon) / (height - horizon)
        lo, hi = vanish + (left_edge - vanish) * t, vanish + (right_edge - vanish) * t
        return lo + (hi - lo) * frac

    # Poles with signs or traffic lights, and people, beside the road.
    for _ in range(int(rng.integers(1, 4))):
        base = horizon + (height - horizon) * rng.uniform(0.2, 0.7)
        side = rng.choice([-0.15, 1.15])
        px = road_x(base, side)
        size = (base - horizon) / (height - horizon) * height * 0.5 + 6
        pw, top = max(2, size * 0.08), base - size * 1.6
        shape("rectangle", [px - pw, top, px + pw, base], _jitter(rng, (153, 153, 153), 15), "pole")
        if rng.random() < 0.6:
            s = size * 0.25
            color = _jitter(rng, rng.choice([(220, 220, 0), (200, 30, 30), (30, 60, 200)]), 20)
            shape("ellipse" if rng.random() < 0.5 else "rectangle", [px - s, top - s, px + s, top + s], color,
                  "traffic sign")
        else:
            s = size * 0.15
            shape("rectangle", [px - s, top, px + s, top + 5 * s], _jitter(rng, (40, 40, 30), 10), "traffic light")
            lamp = [(220, 30, 30), (250, 170, 30), (30, 200, 60)][int(rng.integers(0, 3))]
            paint.ellipse([px - s * 0.6, top + s * 0.6, px + s * 0.6, top + s * 1.8], fill=lamp)
    for _ in range(int(rng.integers(0, 4))):
        feet = horizon + (height - horizon) * rng.uniform(0.15, 0.9)
        px = road_x(feet, rng.choice([-0.1, 1.1]) + rng.uniform(-0.05, 0.05))
        h = (feet - horizon) / (height - horizon) * height * 0.45 + 8
        clothes = _jitter(rng, tuple(int(v) for v in rng.integers(0, 256, 3)), 0)
        shape("rectangle", [px - h * 0.14, feet - h * 0.8, px + h * 0.14, feet], clothes, "person")
        shape("ellipse", [px - h * 0.1, feet - h, px + h * 0.1, feet - h * 0.78], _jitter(rng, (220, 180, 150)),
              "person")
    # Cars on the road, far ones first so near ones cover them.
    for base in sorted(horizon + (height - horizon) * rng.uniform(0.1, 0.95, int(rng.integers(1, 5)))):
        cx = road_x(base, rng.uniform(0.15, 0.85))
        w = (base - horizon) / (height - horizon) * width * 0.35 + 6
        h = w * 0.55
        body = _jitter(rng, tuple(int(v) for v in rng.integers(0, 256, 3)), 0)
        shape("rectangle", [cx - w / 2, base - h * 0.6, cx + w / 2, base - h * 0.1], body, "car")
        shape("rectangle", [cx - w * 0.35, base - h, cx + w * 0.35, base - h * 0.55], body, "car")
        paint.rectangle([cx - w * 0.3, base - h * 0.92, cx + w * 0.3, base - h * 0.62], fill=(60, 70, 90))
        for wx in (cx - w * 0.32, cx + w * 0.32):
            shape("ellipse", [wx - h * 0.17, base - h * 0.3, wx + h * 0.17, base], (20, 20, 20), "car")
    # The ego vehicle's bonnet at the bottom, void in Cityscapes: it teaches the loss to ignore.
    shape("rectangle", [0, int(height * 0.94), width, height], _jitter(rng, (30, 30, 35), 10), "ego vehicle")

    pixels = np.asarray(image, dtype=np.float32) * np.float32(rng.uniform(0.75, 1.2))
    if photo:
        pixels += photo_texture(rng, height, width)
    else:
        pixels += rng.standard_normal(pixels.shape, dtype=np.float32) * 8
    return np.clip(pixels, 0, 255).astype(np.uint8), np.asarray(label)


# The folder layout's synthetic set has other classes than Cityscapes' 19: its 7 categories (flat, construction,
# object, nature, sky, human, vehicle), each coloured as its first class. Void (category 0) is ignored.
CATEGORY_NAMES = [name for _, name in sorted({(c.category_id, c.category) for c in _TABLE if c.category_id > 0})]
_ID_TO_CATEGORY = np.full(256, IGNORE_INDEX, dtype=np.uint8)
for _c in _TABLE:
    if _c.id >= 0 and _c.category_id > 0:
        _ID_TO_CATEGORY[_c.id] = _c.category_id - 1
CATEGORY_COLORS = [list(next(c.color for c in _TRAIN_CLASSES if c.category == name)) for name in CATEGORY_NAMES]


def write_synthetic(root, num_train=200, num_val=50, size=(256, 128), seed=0, photo=False, layout="cityscapes"):
    """Write a synthetic data set under root. Deterministic for a seed.
    layout="cityscapes": Cityscapes' official layout and naming, labelIds (the 19 classes).
    layout="folder": FolderDataset's (images/, masks/, classes.json) with Cityscapes' 7 categories as classes;
    JPEG images, and palette-PNG masks that show the classes in their colours.
    photo=True: photo-like frames (photo_texture), for measuring decoding; about 1.5 s a 2048x1024 frame."""
    width, height = size
    if layout == "folder":
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, "classes.json"), "w") as f:
            json.dump({"names": CATEGORY_NAMES, "colors": CATEGORY_COLORS, "ignore_index": IGNORE_INDEX}, f, indent=1)
    for split_index, (split, count, cities) in enumerate(
            (("train", num_train, _TRAIN_CITIES), ("val", num_val, _VAL_CITIES))):
        for i in range(count):
            image, label = draw_street(np.random.default_rng([seed, split_index, i]), width, height, photo)
            if layout == "folder":
                for sub in ("images", "masks"):
                    os.makedirs(os.path.join(root, sub, split), exist_ok=True)
                Image.fromarray(image).save(os.path.join(root, "images", split, f"street_{i:04d}.jpg"), quality=90)
                mask = Image.fromarray(_ID_TO_CATEGORY[label])
                mask.putpalette(palette_of(CATEGORY_COLORS))  # a "P" image now
                mask.save(os.path.join(root, "masks", split, f"street_{i:04d}.png"))
                continue
            city = cities[i % len(cities)]
            stem = f"{city}_{i // len(cities):06d}_{19:06d}"
            image_dir = os.path.join(root, "leftImg8bit", split, city)
            label_dir = os.path.join(root, "gtFine", split, city)
            os.makedirs(image_dir, exist_ok=True)
            os.makedirs(label_dir, exist_ok=True)
            # compress_level=1: noisy images barely compress anyway, and writing is 5x faster. Photo-like
            # frames get PNG's default (6), as real ones: 2.3 MB instead of 2.7, decoded as fast.
            Image.fromarray(image).save(os.path.join(image_dir, f"{stem}_leftImg8bit.png"),
                                        compress_level=6 if photo else 1)
            Image.fromarray(label).save(os.path.join(label_dir, f"{stem}_gtFine_labelIds.png"))


_preparing = None  # the data set a prepare_cache worker process fills the cache for


def _set_preparing(data):
    global _preparing
    _preparing = data


def _cache_frame(index):
    _preparing.frame(index)  # returns nothing: no pixels travel back to the parent process


def prepare_cache(root, cache_dir, splits, workers):
    """Decode every frame of the splits into cache_dir, `workers` processes at a time."""
    for split in splits:
        data = open_dataset(root, split, cache_dir=cache_dir)
        with multiprocessing.Pool(workers, initializer=_set_preparing, initargs=(data,)) as pool:
            for done, _ in enumerate(pool.imap_unordered(_cache_frame, range(len(data)), chunksize=4), 1):
                if done % 100 == 0 or done == len(data):
                    print(f"{split}: {done}/{len(data)} frames cached", flush=True)
    size = sum(os.path.getsize(os.path.join(cache_dir, f)) for f in os.listdir(cache_dir) if f.endswith(".npy"))
    print(f"{cache_dir} holds {size / 2**30:.2f} GiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write a synthetic data set (Cityscapes' official layout, or the "
                                                 "folder layout of your own data), or fill a decode cache.")
    task = parser.add_mutually_exclusive_group(required=True)
    task.add_argument("--synthetic", metavar="DIR", help="folder to write a synthetic data set into")
    task.add_argument("--prepare-cache", metavar="CACHE_DIR", help="decode --data's frames into this folder")
    parser.add_argument("--num-train", type=int, default=200)
    parser.add_argument("--num-val", type=int, default=50)
    parser.add_argument("--size", type=int, nargs=2, default=(256, 128), metavar=("W", "H"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=("cityscapes", "folder"), default="cityscapes",
                        help="with --synthetic: Cityscapes' layout (19 classes), or images/, masks/ and classes.json "
                             "(Cityscapes' 7 categories as classes)")
    parser.add_argument("--photo", action="store_true", help="photo-like frames: as large and slow to decode "
                                                             "as real ones (about 1.5 s each to write at 2048x1024)")
    parser.add_argument("--data", default="data/cityscapes", help="with --prepare-cache: the data set's root")
    parser.add_argument("--split", nargs="+", default=["train", "val"], help="with --prepare-cache")
    parser.add_argument("-j", "--workers", type=int, default=os.cpu_count(), help="with --prepare-cache")
    args = parser.parse_args()
    if args.prepare_cache:
        try:
            prepare_cache(args.data, args.prepare_cache, args.split, args.workers)
        except BadInput as error:
            sys.exit(f"dataset.py: {error}")
        sys.exit()
    if min(args.size) < 16 or args.num_train < 1 or args.num_val < 1:
        sys.exit("dataset.py: --size must be at least 16 16 and --num-train, --num-val at least 1")
    write_synthetic(args.synthetic, args.num_train, args.num_val, tuple(args.size), args.seed, args.photo, args.layout)
    print(f"wrote {args.num_train} train and {args.num_val} val {'photo-like ' if args.photo else ''}images "
          f"({args.size[0]}x{args.size[1]}) to {args.synthetic}, {args.layout} layout")
