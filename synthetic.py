"""A synthetic data set where no real one is at hand: procedural street scenes, for the demo, the tests and
the benchmarks. Cityscapes' official layout and file naming with its labelIds (the 19 classes), or the folder
layout of your own data (images/, masks/, classes.json) with Cityscapes' 7 categories as classes.

    python synthetic.py data/cityscapes_synthetic --num-train 300 --num-val 60 --size 192 96
    python synthetic.py data/my_streets --layout folder
    python synthetic.py frames --size 2048 1024 --photo --unique 8 -j 16    # as slow to decode as real frames

--photo gives frames the texture and noise of photographs, so that files are as large and as slow to decode
as real ones. --unique N draws N scenes a split and links the rest to them: decoding costs the same for every
file read, so a large set for measuring the data pipeline is written in seconds. The folder must be new or
empty; it appears, whole, when writing ends.
"""
import argparse
import json
import multiprocessing
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))  # this folder's modules under python -I too
from harness import paths, recovery, stops  # (before torchvision: it checks the temporary folder its import needs)
from harness.checks import check_numbers
import numpy as np
import torchvision
from PIL import Image, ImageDraw

from dataset import IGNORE_INDEX, palette_of

_TABLE = torchvision.datasets.Cityscapes.classes  # the official label table: ids, categories, colours

_ID = {c.name: c.id for c in _TABLE}
_TRAIN_CITIES = ("aachen", "bochum", "bremen")
_VAL_CITIES = ("frankfurt", "lindau", "munster")
_TEST_CITIES = ("berlin", "bielefeld", "bonn")
SPLITS = ("train", "val", "test")


def _jitter(rng, color, amount=25):
    return tuple(int(np.clip(v + rng.integers(-amount, amount + 1), 0, 255)) for v in color)


def photo_texture(rng, height, width):
    """What photographs have and drawings lack, as (H, W, 3) float32 to add to an image: texture whose power
    falls with spatial frequency f as 1/f^1.8, as in natural images (white noise shaped in the Fourier
    domain), half of it shared by the three channels as brightness is, and sensor noise of sigma 1.
    A street scene with it saves to a PNG about as large as a real frame of its size, so
    decoding it costs about what a real frame's does (BENCHMARKS.md); a drawing's flat areas compress away."""
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
    """One street scene: (RGB uint8 array, labelId uint8 array, instanceId uint16 array). Shapes, not just
    colours, tell the classes apart: colours are jittered per object, overlap between classes, and carry noise
    (photo=True: photo_texture's instead of plain Gaussian noise of sigma 8). instanceIds as Cityscapes has them
    (what its official evaluation reads for iIoU): labelId * 1000 + the object's number for each person and car,
    the labelId elsewhere."""
    image = Image.new("RGB", (width, height))
    label = Image.new("L", (width, height), _ID["unlabeled"])
    instances = Image.new("I", (width, height), _ID["unlabeled"])
    paint, mark, number = ImageDraw.Draw(image), ImageDraw.Draw(label), ImageDraw.Draw(instances)
    objects = []

    def shape(kind, box, color, name, instance=None):
        getattr(paint, kind)(box, fill=color)
        getattr(mark, kind)(box, fill=_ID[name])
        getattr(number, kind)(box, fill=_ID[name] if instance is None else _ID[name] * 1000 + instance)

    def new_object():  # one person or car: its shapes share a number
        objects.append(None)
        return len(objects) - 1

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
        person = new_object()
        shape("rectangle", [px - h * 0.14, feet - h * 0.8, px + h * 0.14, feet], clothes, "person", person)
        shape("ellipse", [px - h * 0.1, feet - h, px + h * 0.1, feet - h * 0.78], _jitter(rng, (220, 180, 150)),
              "person", person)
    # Cars on the road, far ones first so near ones cover them.
    for base in sorted(horizon + (height - horizon) * rng.uniform(0.1, 0.95, int(rng.integers(1, 5)))):
        cx = road_x(base, rng.uniform(0.15, 0.85))
        w = (base - horizon) / (height - horizon) * width * 0.35 + 6
        h = w * 0.55
        body = _jitter(rng, tuple(int(v) for v in rng.integers(0, 256, 3)), 0)
        car = new_object()
        shape("rectangle", [cx - w / 2, base - h * 0.6, cx + w / 2, base - h * 0.1], body, "car", car)
        shape("rectangle", [cx - w * 0.35, base - h, cx + w * 0.35, base - h * 0.55], body, "car", car)
        paint.rectangle([cx - w * 0.3, base - h * 0.92, cx + w * 0.3, base - h * 0.62], fill=(60, 70, 90))
        for wx in (cx - w * 0.32, cx + w * 0.32):
            shape("ellipse", [wx - h * 0.17, base - h * 0.3, wx + h * 0.17, base], (20, 20, 20), "car", car)
    # The ego vehicle's bonnet at the bottom, void in Cityscapes: it teaches the loss to ignore.
    shape("rectangle", [0, int(height * 0.94), width, height], _jitter(rng, (30, 30, 35), 10), "ego vehicle")

    pixels = np.asarray(image, dtype=np.float32) * np.float32(rng.uniform(0.75, 1.2))
    if photo:
        pixels += photo_texture(rng, height, width)
    else:
        pixels += rng.standard_normal(pixels.shape, dtype=np.float32) * 8
    return np.clip(pixels, 0, 255).astype(np.uint8), np.asarray(label), np.asarray(instances).astype(np.uint16)


# The folder layout has other classes than Cityscapes' 19: its 7 categories (flat, construction, object, nature,
# sky, human, vehicle), each coloured as its first train class. Void (category 0) is ignored.
CATEGORY_NAMES = [name for _, name in sorted({(c.category_id, c.category) for c in _TABLE if c.category_id > 0})]
_ID_TO_CATEGORY = np.full(256, IGNORE_INDEX, dtype=np.uint8)
for _c in _TABLE:
    if _c.id >= 0 and _c.category_id > 0:
        _ID_TO_CATEGORY[_c.id] = _c.category_id - 1
CATEGORY_COLORS = [list(next(c.color for c in _TABLE if c.category == name and 0 <= c.train_id < 255))
                   for name in CATEGORY_NAMES]


def _names(layout, split, i):
    """The image's and the label's path below the root for scene i of a split."""
    if layout == "folder":
        return os.path.join("images", split, f"street_{i:04d}.jpg"), os.path.join("masks", split, f"street_{i:04d}.png")
    cities = {"train": _TRAIN_CITIES, "val": _VAL_CITIES, "test": _TEST_CITIES}[split]
    city = cities[i % len(cities)]
    stem = f"{city}_{i // len(cities):06d}_{19:06d}"
    return (os.path.join("leftImg8bit", split, city, f"{stem}_leftImg8bit.png"),
            os.path.join("gtFine", split, city, f"{stem}_gtFine_labelIds.png"))


def _files(layout, split, i):
    """Every file of scene i below the root: its image, its label, and in Cityscapes' layout its instanceIds."""
    image, label = _names(layout, split, i)
    return [image, label] + ([label.replace("_labelIds.png", "_instanceIds.png")] if layout != "folder" else [])


def _write_scene(job):
    """Draw scene i of a split and write its image and label, and Cityscapes' instanceIds (a worker's task)."""
    root, layout, split, i, seed, size, photo = job
    image, label, instances = draw_street(np.random.default_rng([seed, SPLITS.index(split), i]), *size, photo)
    image_path, label_path = (os.path.join(root, name) for name in _names(layout, split, i))
    for path in (image_path, label_path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if layout == "folder":
        Image.fromarray(image).save(image_path, quality=90)
        mask = Image.fromarray(_ID_TO_CATEGORY[label])
        mask.putpalette(palette_of(CATEGORY_COLORS))  # a "P" image: the classes in their colours
        mask.save(label_path)
    else:
        # compress_level=1: noisy images barely compress anyway, and writing is several times faster. Photo-like
        # frames get PNG's default (6), as real ones have.
        Image.fromarray(image).save(image_path, compress_level=6 if photo else 1)
        Image.fromarray(label).save(label_path)
        Image.fromarray(instances).save(os.path.join(root, _files(layout, split, i)[2]), compress_level=1)


def write_synthetic(root, num_train=200, num_val=50, size=(256, 128), seed=0, photo=False, layout="cityscapes",
                    workers=1, unique=None, num_test=0):
    """Write a synthetic data set into the new (or empty) folder root, deterministic for a seed. size: (width,
    height). workers: processes drawing at once. unique: scenes drawn per split, the others hard links to them.
    num_test: a test split too (Cityscapes' test images are for predictions: predict.py)."""
    def write(folder):
        if layout == "folder":
            with open(os.path.join(folder, "classes.json"), "w") as f:
                json.dump({"names": CATEGORY_NAMES, "colors": CATEGORY_COLORS, "ignore_index": IGNORE_INDEX}, f,
                          indent=1)
        counts = {"train": num_train, "val": num_val, "test": num_test}
        drawn = {split: min(count, unique or count) for split, count in counts.items()}
        jobs = [(folder, layout, split, i, seed, size, photo) for split in counts for i in range(drawn[split])]
        if workers > 1 and len(jobs) > 1:
            with multiprocessing.get_context("fork").Pool(workers, initializer=stops.quiet_pool_worker) as pool:
                list(pool.imap_unordered(_write_scene, jobs))
        else:
            for job in jobs:
                _write_scene(job)
        for split, count in counts.items():
            for i in range(drawn[split], count):  # the same bytes under another scene's name
                for source, target in zip(_files(layout, split, i % drawn[split]), _files(layout, split, i)):
                    os.makedirs(os.path.dirname(os.path.join(folder, target)), exist_ok=True)
                    os.link(os.path.join(folder, source), os.path.join(folder, target))

    paths.write_folder(root, write)


def get_args_parser():
    parser = argparse.ArgumentParser(prog="synthetic.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("folder", metavar="DIR", help="a new or empty folder to write the data set into")
    parser.add_argument("--num-train", type=int, default=200, help="(default: %(default)s)")
    parser.add_argument("--num-val", type=int, default=50, help="(default: %(default)s)")
    parser.add_argument("--num-test", type=int, default=0, help="a test split too (default: none)")
    parser.add_argument("--size", type=int, nargs=2, default=(256, 128), metavar=("W", "H"),
                        help="(default: 256 128)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--layout", choices=("cityscapes", "folder"), default="cityscapes",
                        help="Cityscapes' layout (19 classes), or images/, masks/ and classes.json (7 classes) "
                        "(default: %(default)s)")
    parser.add_argument("--photo", action="store_true", help="photo-like: as large and slow to decode as real frames")
    parser.add_argument("--unique", type=int, default=None, metavar="N",
                        help="draw N scenes a split and link the others to them (default: all drawn)")
    parser.add_argument("-j", "--workers", type=int, default=1,
                        help="processes drawing at once (0, 1: this one) (default: %(default)s)")
    return parser


RANGES = {"num_train": ("--num-train", ("at least", 1)), "num_val": ("--num-val", ("at least", 1)),
          "num_test": ("--num-test", ("at least", 0)), "size": ("--size", ("at least", 16)),
          "seed": ("--seed", ("at least", 0)), "unique": ("--unique", ("at least", 1)),
          "workers": ("-j/--workers", ("at least", 0))}


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    with recovery.guard("synthetic.py"):  # a mistake, a full disk or a stop in one line; nothing half-written left
        check_numbers(args, RANGES)
        write_synthetic(args.folder, args.num_train, args.num_val, tuple(args.size), args.seed, args.photo,
                        args.layout, args.workers, args.unique, args.num_test)
        test = f", {args.num_test} test" if args.num_test else ""
        print(f"wrote {args.num_train} train, {args.num_val} val{test} {'photo-like ' if args.photo else ''}images "
              f"({args.size[0]}x{args.size[1]}) to {args.folder}, {args.layout} layout")
