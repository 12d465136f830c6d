"""Files to pixels, the same way in every program (training, evaluation, predict.py), and decoded once at most
(the decode cache).

    image = images.read_image(path)               # (H, W, 3) uint8 as a viewer shows the file
    values = images.decode_label(path)            # (H, W) uint8 as a label file holds them
    width, height, turned = images.seen_size(path)   # from the header alone
    images.check_label_bytes(path)                # a label's first bytes: a PNG's, whatever its name
    array = images.cached("data/cache", path, images.read_image)   # decoded once, then a memory map

Both readers return numpy arrays, so that a crop can be sliced out of them, or out of the cache's memory maps,
before anything is copied.
"""
import errno
import glob
import hashlib
import os
import secrets
import stat
import struct

import numpy as np
from PIL import Image, ImageOps, TiffImagePlugin

# The largest image this program reads: 2**28 pixels (16384 x 16384), 768 MiB as 8-bit RGB. PIL's own limit guards
# a server against hostile uploads (a warning of two lines past 89 million pixels, an error past twice that); here
# the files are the user's own, and aerial or medical images of 14000 x 14000 are real data. Past this limit an
# image is named in one line, with what to do, before it is decoded.
MAX_PIXELS = 2**28
Image.MAX_IMAGE_PIXELS = None  # PIL's check off: _check_size below is this program's, for every reader


class BadInput(ValueError):
    """A file of the data set that cannot be used (damaged, mislabelled), found while reading it: said in one line
    by the rank that read it (recovery.guard), also when a DataLoader worker raised it. The data's own error: this
    module and dataset.py raise it without the harness's modules."""


def first_line(error):
    """An error's own first line, whole (a decoder's messages run over several lines)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def cannot_list(folder, error):
    """The line for a folder of inputs that cannot be listed: which, why, and what to do, from its errno."""
    if error.errno in (errno.EACCES, errno.EPERM):
        advice = (f"give the user that runs the program permission to read it and the folders in it (ls -ld {folder}: "
                  "its owner and mode)")
    elif error.errno == errno.ENOENT:
        advice = "it went away while it was listed: is it being moved or changed? Run again once it is whole"
    elif error.errno == errno.EIO:
        advice = "the disk or network filesystem failed (dmesg says more): see to it, then run again"
    else:
        advice = "see to its cause, then run again"
    return f"{folder} cannot be listed ({error.strerror or error}): {advice}"


def not_a_file(path):
    """What path is when it is not a regular file to read (a named pipe, a socket, a device), else None: opening a
    named pipe waits for a writer for ever, and a device reads without end. A link is judged by what it leads to;
    one that leads nowhere, or loops, is BadInput."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        if os.path.islink(path):
            raise BadInput(f"{path} is a symbolic link that leads nowhere or loops back to itself; fix or remove "
                           "it") from None
        raise BadInput(f"{path} cannot be read ({error.strerror or error})") from None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"


def input_files(top, recursive=True, leave_out=None):
    """Every input a program reads below the folder top, listed one way for all (training's data, predict.py's
    folders): -> (files, others). files: the regular files, sorted paths (sub-folders too where recursive, linked
    ones followed, each once; leave_out(folder) True: that folder left out). others: [(path, what it is)], the
    entries that are not files to read (not_a_file), for the caller to name. macOS's AppleDouble files (._NAME,
    its record of NAME's metadata on a FAT or network disk) are neither. A folder reached again by another link is
    listed once. A folder that cannot be listed (os.walk would skip it, and its files, without a word) or a link
    loop: BadInput."""
    def unlisted(error):
        raise BadInput(cannot_list(error.filename, error))

    files, others, seen = [], [], set()
    for parent, subfolders, names in os.walk(top, onerror=unlisted, followlinks=True):
        real = os.path.realpath(parent)
        if real in seen:  # a second link to a folder (a "latest" link): its files are listed once
            if _inside(parent, real):
                raise BadInput(f"{parent} leads back to a folder already listed (a symbolic link loop); fix or "
                               "remove it")
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = sorted(d for d in subfolders if recursive and not (leave_out and leave_out(
            os.path.join(parent, d))))
        for name in names:
            if name.startswith("._"):
                continue
            path = os.path.join(parent, name)
            what = not_a_file(path)
            if what:
                others.append((path, what))
            else:
                files.append(path)
    return sorted(files), sorted(others)


def _inside(parent, real):
    """Whether parent, a path os.walk made, lies inside the folder real: a link that leads back up, a loop."""
    for _ in range(parent.count(os.sep)):
        parent = os.path.dirname(parent)
        if os.path.realpath(parent or ".") == real:
            return True
    return False


def _check_size(path, width, height):
    if width * height > MAX_PIXELS:
        cause = (f"{width} x {height} pixels, more than the {MAX_PIXELS:,} this program reads (16384 x 16384): cut "
                 "it into tiles, or scale it down")
        bad = BadInput(f"{path} is {cause}")
        bad.cause = cause  # for predict.py, which names the file its own way
        raise bad


try:  # torchcodec: the decoder torchvision 0.29 names as its successor; bundles libpng, needs no FFmpeg
    from torchcodec.decoders import decode_image as _torchcodec_decode
except (ImportError, OSError, RuntimeError):  # not installed, or built for another torch: PIL decodes
    _torchcodec_decode = None

_PNG_SIGNATURE, _JPEG_SIGNATURE = b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff"
ORIENTATION = 0x0112  # the EXIF tag; 5-8 turn the picture a quarter


def _header(path, size=26):
    with open(path, "rb") as f:
        return f.read(size)  # a PNG's: signature, IHDR's width, height, bit depth (byte 24), colour type (25)


def _why(path, error):
    bad = BadInput(f"{path} cannot be decoded ({first_line(error)}); replace it, or remove the image and its label")
    bad.cause = first_line(error)  # for predict.py, which names the file its own way (no label to remove there)
    return bad


def read_image(path):
    """(H, W, 3) uint8 as a viewer shows the file: EXIF orientation applied, any mode made RGB (transparency
    dropped), 16 bits a channel scaled to 8. PNG and JPEG through torchcodec where it is installed (faster:
    BENCHMARKS.md), anything else through PIL: the same pixels either way. torchcodec's (3, H, W) result is returned
    as a strided (H, W, 3) view: only a crop is copied, into the order torchvision's uint8 resize is fastest on."""
    try:
        header = _header(path)
        # torchcodec for PNG and JPEG, but not for 16-bit colour PNGs: PIL reads those as 8 bits itself (the high
        # byte), and torchcodec would round instead, one level apart: the same file gives the same pixels either way.
        torchcodec_png = header.startswith(_PNG_SIGNATURE) and not (header[24] == 16 and header[25] != 0)
        if _torchcodec_decode is not None and (torchcodec_png or header.startswith(_JPEG_SIGNATURE)):
            with Image.open(path) as f:  # the header alone: the size, before torchcodec decodes the pixels
                _check_size(path, *f.size)
            return _torchcodec_decode(path, mode="RGB").permute(1, 2, 0).numpy()
        with Image.open(path) as f:
            _check_size(path, *f.size)
            return _rgb(ImageOps.exif_transpose(f))
    except BadInput:
        raise
    except Exception as error:
        raise _why(path, error) from None


def _rgb(picture):
    """A PIL image of any mode -> (H, W, 3) uint8. Integer modes of more than 8 bits (16-bit greyscale PNGs and
    TIFFs) are scaled to 0-255 and rounded, as torchcodec does; PIL's convert("RGB") would clip them."""
    if picture.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        values = np.clip(np.asarray(picture, dtype=np.int64), 0, 65535)
        grey = ((values * 255 + 32767) // 65535).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    if picture.mode == "F":  # floating-point pixels (a TIFF): values all within 0-1 scaled by 255, else clipped
        values = np.nan_to_num(np.asarray(picture, dtype=np.float64))
        if values.size and values.min() >= 0 and values.max() <= 1:
            values = values * 255
        grey = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    return np.asarray(picture if picture.mode == "RGB" else picture.convert("RGB"))


def float_pixels(path):
    """Whether the image at path holds floating-point pixels (a TIFF of PIL's mode "F"), which read_image scales by
    a rule of its own (_rgb): from its first bytes and its header."""
    try:
        with open(path, "rb") as f:
            if f.read(4) not in TiffImagePlugin.PREFIXES:  # a TIFF's first bytes, as PIL knows them
                return False
        with Image.open(path) as picture:
            return picture.mode == "F"
    except Exception:  # unreadable: read_image says why
        return False


def seen_size(path):
    """(width, height, turned) of an image as read_image returns it, from its header alone: turned when its
    EXIF orientation (a JPEG's, or a PNG's eXIf chunk before its pixels) turns it a quarter."""
    with Image.open(path) as f:
        _check_size(path, *f.size)
        has_exif = f.format == "JPEG" or "exif" in f.info
        turned = has_exif and f.getexif().get(ORIENTATION, 1) in (5, 6, 7, 8)
        return (*(f.size[::-1] if turned else f.size), turned)


def check_label_bytes(path, header=None):
    """A label file must hold a PNG's bytes, whatever its name says. PIL opens a file by its content, so a
    labelIds.png exported again as a JPEG (a careless re-export) would decode, pass every other check and train
    against wrong ground truth: JPEG's compression changes class indices (44% of the pixels of one such file).
    Reads the first bytes alone (or takes header, those already read): cheap enough for every label at start
    (check_files), where Cityscapes' train labels are opened, not decoded."""
    if header is None:
        header = _header(path, len(_PNG_SIGNATURE))
    if header.startswith(_PNG_SIGNATURE):
        return
    try:  # what the bytes hold, as PIL names it: the file is refused either way
        with Image.open(path) as f:
            held = f.format
    except Exception:  # not an image PIL reads (an HTML page: a download that failed), or nothing at all
        if not header:
            raise BadInput(f"{path} is empty (0 bytes): copy or download it again") from None
        raise BadInput(f"{path} is no image PIL reads (it begins {header[:8]!r}): export the label again as a PNG, or "
                       "copy or download it again") from None
    why = ("JPEG's compression changes class indices; converting this file keeps the changed ones" if held == "JPEG"
           else "labels are read as PNGs")
    raise BadInput(f"{path} holds {held} bytes, not a PNG's, whatever its name says: export the label again as a PNG "
                   f"from its source ({why})")


def decode_label(path):
    """(H, W) label values as the file holds them, unchecked. A file that is no PNG by its bytes is refused
    (check_label_bytes). torchcodec only for 8-bit greyscale PNGs (Cityscapes' own): on a palette PNG it would
    return the palette's colours, not the indices, so anything else goes to PIL. A greyscale PNG of fewer than 8
    bits is refused: PIL would scale its values to 0-255."""
    try:
        header = _header(path)
        check_label_bytes(path, header)
        if header[25] == 0 and header[24] < 8:
            raise ValueError(f"a {header[24]}-bit greyscale PNG, whose values PIL would scale to 0-255; save it as "
                             "8-bit")
        if _torchcodec_decode is not None and header[24:26] == b"\x08\x00":
            _check_size(path, *struct.unpack(">II", header[16:24]))  # IHDR's width and height, before decoding
            return _torchcodec_decode(path, mode="UNCHANGED")[0].numpy()
        with Image.open(path) as f:
            _check_size(path, *f.size)
            return np.asarray(f)  # mode "P": the indices; "L": the values
    except BadInput:
        raise
    except Exception as error:
        raise _why(path, error) from None


# --- the decode cache: each frame decoded once, kept as an uncompressed .npy, read through a memory map ------
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
        os.makedirs(cache_dir, exist_ok=True)
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
