"""Fill dataset.py's decode cache before training: every frame of the splits decoded once into CACHE_DIR
(optional: training fills the cache as it reads). From the repository's root, or as a file from any folder:

    python -m harness.cache data/cache --data data/cityscapes --split train val
    python path/to/harness/cache.py data/cache --data data/cityscapes

It lives in the harness, not in dataset.py, because it checks its folder the way every writer of this project
does (paths.py: not the data set nor inside it); dataset.py itself imports nothing of the harness.
"""
import argparse
import contextlib
import multiprocessing
import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file, python path/to/harness/cache.py, from any folder:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, for dataset
    __package__ = "harness"  # and for this module's relative imports below

from . import paths, recovery, stops  # noqa: E402 (first: the package checks the temporary folder torch needs)
from dataset import open_dataset  # noqa: E402

_preparing = None  # the data set a worker process fills the cache for (set once per process by the Pool)


def _set_preparing(data):
    global _preparing
    _preparing = data


def _start_worker(data):
    stops.quiet_pool_worker()  # Ctrl-C is the parent's to act on: a worker's traceback would say nothing more
    _set_preparing(data)


def _cache_frame(index):
    _preparing.frame(index)  # returns nothing: no pixels travel back to the parent process


def prepare_cache(root, cache_dir, splits, workers):
    """Decode every frame of the splits into cache_dir, `workers` processes at a time (0: in this one). Writes
    files. The cache folder is checked first: not the data set nor inside it, made where it is missing."""
    paths.check_folder("CACHE_DIR", cache_dir, reads=[("--data", root)])
    sets = [open_dataset(root, split, cache_dir=cache_dir) for split in splits]  # every split found, then written
    paths.make_folder("CACHE_DIR", cache_dir)
    for split, data in zip(splits, sets):
        _set_preparing(data)
        pool = multiprocessing.Pool(workers, initializer=_start_worker, initargs=(data,)) if workers else None
        with pool or contextlib.nullcontext():
            frames = pool.imap_unordered(_cache_frame, range(len(data)), chunksize=4) if pool else \
                map(_cache_frame, range(len(data)))
            for done, _ in enumerate(frames, 1):
                if done % 100 == 0 or done == len(data):
                    print(f"{split}: {done}/{len(data)} frames cached", flush=True)
    size = sum(os.path.getsize(os.path.join(cache_dir, f)) for f in os.listdir(cache_dir) if f.endswith(".npy"))
    print(f"{cache_dir} holds {size / 2**30:.2f} GiB")


def get_args_parser():
    parser = argparse.ArgumentParser(prog="harness/cache.py", description="Fill the decode cache: every "
                                     "frame of --data's splits decoded once into CACHE_DIR (optional: training "
                                     "fills it as it reads). Train with --cache-dir CACHE_DIR.")
    parser.add_argument("cache_dir", metavar="CACHE_DIR", help="the cache folder (main.py's --cache-dir)")
    parser.add_argument("--data", default="data/cityscapes", help="the data set's root (default: %(default)s)")
    parser.add_argument("--split", nargs="+", choices=("train", "val", "test"), default=["train", "val"],
                        help="(default: train val)")
    parser.add_argument("-j", "--workers", type=int, default=os.cpu_count(),
                        help="processes decoding at once; 0: this one (default: the cores, %(default)s)")
    return parser


if __name__ == "__main__":
    parser = get_args_parser()
    args = parser.parse_args()
    if args.workers < 0:
        parser.error(f"argument -j/--workers: {args.workers} must be at least 0")
    with recovery.guard("harness/cache.py"):  # a mistake, a file it cannot read, or a stop: one line
        prepare_cache(args.data, args.cache_dir, args.split, args.workers)
