"""Where the programs write, checked in one place before any work: nothing a command reads is written over,
moved or removed, and every output goes where it can be written; one run holds an output folder at a time.
Plain os calls; dataset.py's cache command, synthetic.py, checkpoints.py, records.py, the preflight and
predict.py use it.

    paths.check_folder("--output-dir", out, reads=[("--data", data)])   # a folder, not on or in an input
    paths.make_folder("--output-dir", out)                    # made with its missing parents, and probed
    paths.check_file_and_make_folder("--export", path, reads=[("--resume", ckpt)], replaceable=is_export)
    paths.move_aside(out, RUN_FILES, "replaced")              # --overwrite: the old run put aside, not deleted
    paths.write_atomically(path, data)                        # a file whole, or the old one as it was
    paths.write_folder(path, write)                           # a generated data set: whole, or not at all
    paths.hold_output(args)                                   # one folder, one run: OUTPUT_DIR/.held locked, written
    paths.release_output()                                    # at the end of the run (recovery.guard): .held removed

A name that says check and nothing more only reads; make, move, write, hold and release write.
"""
import errno
import fcntl
import json
import os
import shutil
import socket
import time

from . import job
from .errors import UserError, fail, first_line
from .job import RUN, named


def inside(path, folder):
    """Whether path is folder itself or lies below it, links resolved."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _inputs(reads):
    """reads: [(flag, path)] of what a command reads; the ones given."""
    return [(flag, path) for flag, path in reads if path]


def check_folder(flag, path, reads=()):
    """An output folder: not a file, not an input of the command nor inside one (reads: [(flag, path)]), and
    where it can be made (found without writing anything: make_folder makes it, once every check is done)."""
    _no_broken_link(flag, path)
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"{named(flag)} {path} is a file, not a folder: give a folder")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        why = "is a file" if not os.path.isdir(existing) else "cannot be written"
        fail(f"{named(flag)} {path} cannot be written ({existing} {why}): choose a folder you can write to")
    for read_flag, source in _inputs(reads):
        if inside(path, source):
            where = "is" if os.path.realpath(path) == os.path.realpath(source) else "is inside"
            fail(f"{named(flag)} {path} {where} {named(read_flag)} {source}, which this command reads: outputs never "
                 f"land among the inputs; choose a folder outside it")


def _no_broken_link(flag, path):
    """Neither path nor a folder above it is a symbolic link that leads nowhere or loops back to itself (which
    os.makedirs would report as a file that exists, or as too many levels of links)."""
    place = os.path.abspath(path)
    while place != os.path.dirname(place):
        if os.path.islink(place) and not os.path.exists(place):
            where = "" if place == os.path.abspath(path) else f" ({place}, on its way)"
            fail(f"{named(flag)} {path}{where} is a symbolic link that leads nowhere or loops back to itself: remove "
                 "it, or point it at a folder")
        place = os.path.dirname(place)


def make_folder(flag, path):
    """Make the folder with its missing parents, and write a file into it: a place that cannot be written is
    found now, in one line, not after an epoch of training."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        fail(f"{named(flag)} {path} cannot be written ({error.strerror or error}): choose a folder you can write to")


def check_file_and_make_folder(flag, path, reads=(), replaceable=None):
    """An output file: not a folder, not a file the command reads, not in a folder it reads; an existing file
    only if replaceable(path) says it is an earlier output of the same kind. Its folder is made."""
    _no_broken_link(flag, path)
    if os.path.isdir(path):
        fail(f"{flag} {path} is a folder: give a file name, e.g. {os.path.join(path, 'model.onnx')}")
    for read_flag, source in _inputs(reads):
        if inside(path, source):
            fail(f"{flag} {path} would write over {read_flag} {source}, which this command reads: give another name")
    if os.path.exists(path) and not (replaceable and replaceable(path)):
        fail(f"{flag} {path} exists and is not an earlier output of {flag}: give another name, or move it away")
    make_folder(flag, os.path.dirname(os.path.abspath(path)))


def _unused(folder, name_for, what):
    """The first name_for(suffix) not taken in folder, the suffix "", then "-1", "-2", ..."""
    for attempt in range(1000):
        candidate = os.path.join(folder, name_for(f"-{attempt}" if attempt else ""))
        if not os.path.exists(candidate):
            return candidate
    fail(f"no free name in {folder} to keep {what} under: move the old ones away")


def beside(path, label):
    """A name beside path that says what happened to it and when, not yet taken: checkpoint.pth ->
    checkpoint.rewound-20261130-230405.pth; data -> data.partial-20261130-230405."""
    folder, name = os.path.split(os.path.abspath(path.rstrip(os.sep)))
    stem, extension = (name, "") if os.path.isdir(path) else os.path.splitext(name)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return _unused(folder, lambda suffix: f"{stem}.{label}-{stamp}{suffix}{extension}", name)


def move_aside(folder, names, label):
    """Move the entries `names` of folder (those present, and files kept by a rewind) into a new folder inside
    it whose name says why and when (FOLDER/replaced-DATE-TIME): nothing is deleted, and a rename within one
    folder works on any filesystem, a mount point too. -> that folder, or None when none was present."""
    present = [name for name in os.listdir(folder) if name in names or ".rewound-" in name]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = _unused(folder, lambda suffix: f"{label}-{stamp}{suffix}", "the old run")
    try:
        os.makedirs(target)
        for name in present:
            os.replace(os.path.join(folder, name), os.path.join(target, name))
    except OSError as error:
        fail(f"cannot move the old run in {folder} aside to {target} ({error.strerror or error}); move it yourself")
    return target


def free_mib(folder):
    """Free space where folder is (or its nearest existing parent), in MiB, for a line about a full disk."""
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return shutil.disk_usage(folder).free / 2**20


def write_atomically(path, data):
    """Write a temporary file, fsync, rename over path: a crash mid-write leaves the old file whole, and a failed
    write (a full disk) leaves no half file behind. data: bytes, or a function that writes into a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            data(f) if callable(data) else f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        note_free_space(error, path)
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def note_free_space(error, path):
    """The free space where path is, kept with the error of a write that failed, before its half-written file goes
    (after, the disk no longer looks full)."""
    error.free_mib = free_mib(os.path.dirname(os.path.abspath(path)))


def why_not_written(error):
    """What a failed write's error says, as a person reads it: a full disk as such, also when torch.save says it in its
    own words ("unexpected pos ..." from its zip writer), with the free space when it failed."""
    free = getattr(error, "free_mib", None)
    full = getattr(error, "errno", None) == errno.ENOSPC or (isinstance(error, RuntimeError) and free is not None
                                                              and free < 16)
    why = "no space left on device" if full else getattr(error, "strerror", None) or first_line(error)
    return why + (f"; {free:.0f} MiB free there when it failed" if free is not None else "")


def write_folder(path, write):
    """Make the folder `path` by write(temporary): into a temporary folder beside it, renamed to path when write
    returns. An interrupted run leaves no half-written data set under path. A folder that exists and is not
    empty is refused: what is in it could be real data, and a generator's file names are real ones."""
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"{path} is a file, not a folder: give a new folder")
    if os.path.isdir(path) and os.listdir(path):
        fail(f"{path} is not empty: give a new or empty folder (nothing there is written over)")
    temporary = beside(path, "partial")
    try:
        os.makedirs(temporary)
    except OSError as error:
        fail(f"{path} cannot be made ({error.strerror or error}): choose a folder you can write to")
    try:
        write(temporary)
        if os.path.isdir(path):
            os.rmdir(path)  # empty, checked above
        os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


# --- main.py's folders ----------------------------------------------------------------------------------------
# What a training run writes in its --output-dir; a folder holding one of the first five holds a run.
RUN_FILES = ("checkpoint.pth", "checkpoint.prev.pth", "best.pth", "metrics.jsonl", "eval.json", "vis", "tensorboard")


def check_run_folders(args):
    """main.py's folders (--output-dir, --save-predictions, --cache-dir), checked before anything is read or
    written: none is a file, none is or is inside the data set, each can be made; and the data set is not in a
    place the run writes or --overwrite moves (its vis/, say). (Rank 0 makes them later, after every other
    check: make_run_outputs.)"""
    for flag in ("--output-dir", "--save-predictions", "--cache-dir"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None:
            check_folder(flag, path, reads=[("--data", args.data)])
    for name in RUN_FILES:
        if inside(args.data, os.path.join(args.output_dir, name)):
            fail(f"{named('--data')} {args.data} is inside {os.path.join(args.output_dir, name)}, where the run "
                 f"writes: move the data set out of it, or choose another {named('--output-dir')}")


def check_no_run_replaced(args, start):
    """No other run in --output-dir is replaced without a word, and no file the run reads (--weights) is one that
    --overwrite moves aside. start: checkpoints.Start (whether this run continues one there)."""
    found = [name for name in RUN_FILES[:5] if os.path.exists(os.path.join(args.output_dir, name))]
    if (replacing(args, start) and args.weights and not start.path
            and any(inside(args.weights, os.path.join(args.output_dir, name)) for name in RUN_FILES)):
        fail(f"--weights {args.weights} belongs to the run that --overwrite moves aside from {named('--output-dir')} "
             f"{args.output_dir}: fine-tune into another {named('--output-dir')} instead (the run stays as it is)")
    if not found or args.evaluate or args.overwrite or (start.path and inside(start.path, args.output_dir)):
        return
    what = f"{named('--output-dir')} {args.output_dir} holds another run ({', '.join(found)})"
    replace = "./run.sh --overwrite" if named("--output-dir") == "OUTPUT_DIR" else "--overwrite"
    aside = f"replace it with {replace} (it moves that run aside, nothing is deleted)"
    if start.path:
        fail(f"{what}, and --resume {start.path} is not from it: choose another {named('--output-dir')}, or {aside}")
    if start.auto or named("--output-dir") == "OUTPUT_DIR":
        fail(f"{what}, no checkpoint to continue from: choose another {named('--output-dir')}, or {aside}")
    fail(f"{what}: continue it with --resume auto, choose another --output-dir, or {aside}")


def replacing(args, start):
    """Whether --overwrite moves a run in --output-dir aside: a training run that does not continue one there
    (not a torchrun restart, not a --resume of one of its checkpoints)."""
    return (args.overwrite and not args.evaluate and not start.auto
            and not (start.path and inside(start.path, args.output_dir)))


def make_run_outputs(args, start):
    """Rank 0, after every check, before the process group (the other ranks wait for it there): the folders made
    and probed, --output-dir held (when it was new); with --overwrite, a run already there moved into a folder
    inside it (nothing deleted), so the new run's files and pictures are its own."""
    make_folder("--output-dir", args.output_dir)
    hold_output(args)
    if replacing(args, start):
        moved = move_aside(args.output_dir, RUN_FILES, "replaced")
        if moved:
            print(f"--overwrite: the run that was in {args.output_dir} is now in {moved}", flush=True)
    os.makedirs(os.path.join(args.output_dir, "vis"), exist_ok=True)
    for flag in ("--save-predictions", "--cache-dir"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None:
            make_folder(flag, path)


# --- one folder, one run ------------------------------------------------------------------------------------------
HOLD = ".held"  # in --output-dir: an advisory lock (flock), and who holds it (the run's: job.RUN.held)


class Held(UserError):
    """--output-dir is held by another run: said in one line, and recorded nowhere inside that folder."""


def _holder(path):
    """The holder's record in the lock file at path ({"host", "pid", "since", ...}), or None."""
    try:
        with open(path) as f:
            return json.loads(f.read() or "null")
    except (OSError, ValueError):
        return None


def _refuse(args, holder):
    who = (f"host {holder.get('host')}, process {holder.get('pid')}, since {holder.get('since')}" if holder else
           "a process that has not said who it is")
    out = args.output_dir
    raise Held(f"{named('--output-dir')} {out} is in use by another run ({who}): wait for it to end, or give another "
               f"{named('--output-dir')}" + (" (-e writes eval.json there)" if args.evaluate else ""))


def _lock(fd, path, args):
    """flock, not waiting; except for a torchrun restart whose own job's earlier attempt still holds it (its machine
    lost: a network filesystem frees the lock when the machine's lease runs out), which waits for it up to
    --dist-timeout, saying so."""
    run_id, restarted = job.env().run_id, job.env().restarts > 0
    deadline = time.time() + 60 * getattr(args, "dist_timeout", 5.0)
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _holder(path) or {}
            if not (restarted and run_id and holder.get("run_id") == run_id) or time.time() > deadline:
                raise
            if not said:
                print(f"note: {args.output_dir} is still held by this job's attempt before the restart (host "
                      f"{holder.get('host')}, process {holder.get('pid')}): waiting for it to be let go, up to "
                      "--dist-timeout", flush=True)
                said = True
            time.sleep(2)


def hold_output(args):
    """One folder, one run: global rank 0 of a run (training or -e) holds --output-dir for its whole life through an
    advisory lock (flock) on OUTPUT_DIR/.held, and writes who it is there. Another run that would write there is
    refused in one line naming the holder. The kernel lets go of the lock when its process ends, however it ends
    (a kill -9; on a network filesystem, a lost node after the server's lease), so a dead holder never blocks the
    next run, which says that it takes over. --check-only only looks (run.sh's preflight refuses before torchrun
    starts). A folder that does not exist yet is held when it is made (make_run_outputs)."""
    if job.env().rank != 0 or RUN.held is not None:
        return
    path = os.path.join(args.output_dir, HOLD)
    if args.check_only:
        _refuse_if_held(args, path)
        return
    if not os.path.isdir(args.output_dir):
        return
    fd = _open_and_lock(args, path)
    if fd is None:
        return  # a filesystem without locks: said
    before = _holder(path)
    run_id = job.env().run_id
    if before and not (run_id and before.get("run_id") == run_id):  # (a torchrun restart of this job: its own)
        print(f"note: {args.output_dir} was held by host {before.get('host')}, process {before.get('pid')} (since "
              f"{before.get('since')}), which ended without letting go (killed, or its machine lost): taken over",
              flush=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "run_id": run_id}
    RUN.held = (fd, path)  # held: let go at the end (release_output), also if the line below fails
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError as error:
        fail(f"{named('--output-dir')} {args.output_dir} cannot be written ({error.strerror or error}): free space "
             "there, or choose another folder")


def _refuse_if_held(args, path):
    """--check-only: another run that holds the lock file at path is refused, found by a probe's lock, which ends
    with its descriptor. Nothing is written to find out."""
    try:
        fd = os.open(path, os.O_RDWR if os.access(path, os.W_OK) else os.O_RDONLY)
    except OSError:
        return  # no lock file: no holder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _refuse(args, _holder(path))
    except OSError:
        pass  # no locks on this filesystem: the run says so when it starts
    finally:
        os.close(fd)


def _open_and_lock(args, path):
    """The lock file at path, made when missing, opened and locked (_lock). -> its descriptor, or None on a
    filesystem without locks (said). Another run's lock refuses this run (Held)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            fail(f"{named('--output-dir')} {args.output_dir} cannot be written ({error.strerror or error}): choose a "
                 "folder you can write to")
        try:
            _lock(fd, path, args)
        except BlockingIOError:
            os.close(fd)
            _refuse(args, _holder(path))
        except OSError as error:  # a filesystem without locks (Lustre mounted with noflock, some FUSE ones)
            os.close(fd)
            print(f"note: {args.output_dir} cannot be locked ({error.strerror or error}): nothing keeps another run "
                  "from writing there at the same time (docs/troubleshooting.md, one folder, one run)", flush=True)
            return None
        # The holder before removes the file as it lets go: this one must be the file the path names now.
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _held(folder):
    """Whether a live run holds folder: its lock file is there and locked (a probe's lock ends with its descriptor)."""
    try:
        fd = os.open(os.path.join(folder, HOLD), os.O_RDONLY)
    except OSError:
        return False
    try:  # shared: it needs no write access (a network filesystem turns flock into byte-range locks, which do)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False  # no locks on this filesystem: nothing to tell
    finally:
        os.close(fd)


def check_not_held(flag, path):
    """predict.py: path is neither a folder a run holds (training, or -e) nor inside one (its pictures would land
    among that run's files as it writes them)."""
    place = os.path.abspath(path)
    while True:
        if _held(place):
            holder = _holder(os.path.join(place, HOLD)) or {}
            where = "is" if place == os.path.abspath(path) else f"is inside {place}, which is"
            fail(f"{flag} {path} {where} in use by another run (host {holder.get('host')}, process "
                 f"{holder.get('pid')}): give another {flag}, or wait for that run to end")
        if os.path.dirname(place) == place:
            return
        place = os.path.dirname(place)


def forget_hold():
    """In a forked child (a DataLoader worker): close this process's copy of the lock's descriptor. The parent's
    still holds it; the child's would hold it on after the parent was killed."""
    if RUN.held is not None:
        os.close(RUN.held[0])
        RUN.held = None


def release_output():
    """The end of a run that held --output-dir: the lock file removed (while still held, so that no other run
    locks a file about to go), then let go."""
    if RUN.held is None:
        return
    (fd, path), RUN.held = RUN.held, None
    try:
        os.remove(path)
    except OSError:
        pass  # gone (the folder moved), or a full, read-only disk: the next holder reads a stale record, no more
    os.close(fd)
