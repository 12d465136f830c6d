"""Where the programs write, checked in one place before any work: nothing a command reads is written over,
moved or removed, and every output goes where it can be written; one run holds an output folder at a time. And the
one writer of a file, with the one line for a write that failed. Plain os calls; harness/cache.py,
synthetic.py, checkpoints.py, records.py, the preflight and predict.py use it.

    paths.check_folder("--output-dir", out, reads=[("--data", data)])   # a folder, not on or in an input
    paths.make_folder("--output-dir", out)                    # made with its missing parents, and probed
    paths.check_file_and_make_folder("--export", path, reads=[("--resume", ckpt)], replaceable=is_export)
    paths.move_aside(out, RUN_FILES, "replaced")              # --overwrite: the old run put aside, not deleted
    paths.write_atomically(path, data)                        # every file written: whole, or the old one as it was
    paths.write_folder(path, write)                           # a generated data set: whole, or not at all
    paths.cannot_write("--export out.onnx", error, path)      # a failed write's line: why, and what to do
    paths.hold_output(args)                                   # one folder, one run: OUTPUT_DIR/.held locked, written
    paths.hold("--save-predictions", folder, args)            # the same for any folder a run writes (predict.py's)
    paths.check_run_files(args)                               # nothing there in the way of what the run writes
    paths.release_output()                                    # the end of the run (recovery.guard): each .held removed

A name that says check and nothing more only reads; make, move, write, hold and release write.
"""
import dataclasses
import errno
import fcntl
import json
import os
import resource
import secrets
import shutil
import socket
import stat
import struct
import sys
import tempfile
import time
from types import SimpleNamespace

from . import job
from .errors import UserError, fail, first_line
from .job import RUN, log, named


def inside(path, folder):
    """Whether path is folder itself or lies below it, links resolved."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def above(path):
    """path (made absolute) and each folder above it, nearest first."""
    place, places = os.path.abspath(path), []
    while place not in places:  # (the root is its own folder)
        places.append(place)
        place = os.path.dirname(place)
    return places


def names_in(path, folder):
    """Whether the name path lies in folder (the folder's own links resolved, not a link that path itself is): a
    checkpoint.pth in the output folder that links to a file kept elsewhere is the run's own name."""
    return inside(os.path.dirname(os.path.abspath(path)), folder)


def same_name(path, other):
    """Whether path and other name the same entry of one folder (links in the folders resolved, not the last one)."""
    def entry(name):
        return os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(name))), os.path.basename(name))
    return entry(path) == entry(other)


def kind(path):
    """What is at path, as a person names it: "a file", "a folder", "a named pipe (FIFO)", "a socket", "a device",
    "a symbolic link that leads nowhere or loops back to itself"; None when nothing is there. A link is named by what
    it leads to."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a symbolic link that leads nowhere or loops back to itself" if os.path.islink(path) else None
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    return "a socket" if stat.S_ISSOCK(mode) else "a device"


# linux/fs.h: FS_IOC_GETFLAGS is _IOR('f', 1, long); a platform that lays ioctl numbers out otherwise refuses it.
_GET_FLAGS = (2 << 30) | (struct.calcsize("l") << 16) | (ord("f") << 8) | 1


def marked(path):
    """Where what is at path is marked immutable or append-only (chattr +i, +a): the words that say so and how to
    clear it. No rename, removal or rewrite passes such a mark, not even root's. Else None (also where the
    filesystem keeps no such marks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            flags = int.from_bytes(fcntl.ioctl(fd, _GET_FLAGS, bytes(8))[:4], sys.byteorder)
        finally:
            os.close(fd)
    except OSError:
        return None
    for bit, mark in ((0x10, "immutable"), (0x20, "append-only")):  # FS_IMMUTABLE_FL, FS_APPEND_FL
        if flags & bit:
            return f"{path} is marked {mark} (lsattr): clear it with chattr -{mark[0]} {path}"
    return None


def temporary_name(path):
    """A name beside path for its next version while it is written, which neither another write nor the leftover
    of a killed one holds: the process's id alone repeats (a container's first process has id 1 in every run)."""
    return f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def check_folder(flag, path, reads=()):
    """An output folder: not a file, not an input of the command nor inside one (reads: [(flag, path)], a path
    None where not given), and where it can be made (found without writing anything: make_folder makes it, once
    every check is done)."""
    existing = _nearest(flag, path)
    why = "cannot be written" if os.path.isdir(existing) else "is a file"
    if why == "is a file" and existing == os.path.abspath(path):
        fail(f"{named(flag)} {path} is a file, not a folder: give a folder")
    if why == "is a file" or not os.access(existing, os.W_OK | os.X_OK):
        fail(f"{named(flag)} {path} cannot be written ({existing} {why}): choose a folder you can write to")
    for read_flag, source in reads:
        if source and inside(path, source):
            where = "is" if os.path.realpath(path) == os.path.realpath(source) else "is inside"
            fail(f"{named(flag)} {path} {where} {named(read_flag)} {source}, which this command reads: outputs never "
                 f"land among the inputs; choose a folder outside it")


def _nearest(flag, path):
    """The nearest entry at or above path that exists. A symbolic link on the way that leads nowhere or loops back
    to itself is named (os.makedirs would report it as a file that exists, or as too many levels of links)."""
    for place in above(path):
        if os.path.exists(place):
            return place
        if os.path.islink(place):
            where = "" if place == os.path.abspath(path) else f" ({place}, on its way)"
            fail(f"{named(flag)} {path}{where} is a symbolic link that leads nowhere or loops back to itself: remove "
                 "it, or point it at a folder")


def make_folder(flag, path):
    """Make the folder with its missing parents, and write a file into it: a place that cannot be written is
    found now, in one line, not after an epoch of training."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)  # a new name: nothing there is written over
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        fail(cannot_write(f"{named(flag)} {path}", error, path, after=", or choose another folder"))


def check_file_and_make_folder(flag, path, reads=(), replaceable=None):
    """An output file: not a folder, not a file the command reads, not in a folder it reads; an existing file
    only if replaceable(path) says it is an earlier output of the same kind. Its folder is made."""
    _nearest(flag, path)
    if os.path.isdir(path):
        fail(f"{flag} {path} is a folder: give a file name, e.g. {os.path.join(path, 'model.onnx')}")
    for read_flag, source in reads:
        if source and inside(path, source):
            fail(f"{flag} {path} would write over {read_flag} {source}, which this command reads: give another name")
    if os.path.exists(path) and not (replaceable and replaceable(path)):
        fail(f"{flag} {path} exists and is not an earlier output of {flag}: give another name, or move it away")
    make_folder(flag, os.path.dirname(os.path.abspath(path)))


def _unused(folder, head, what, tail=""):
    """The first name HEAD-DATE-TIME-SUFFIX-TAIL not taken in folder (HEAD ends in its own "-"), SUFFIX "", then
    "-1", "-2", ..."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1000):
        suffix = f"-{attempt}" if attempt else ""
        candidate = os.path.join(folder, f"{head}{stamp}{suffix}{tail}")
        if not os.path.exists(candidate):
            return candidate
    fail(f"no free name in {folder} to keep {what} under: move the old ones away")


def beside(path, label):
    """A name beside path that says what happened to it and when, not yet taken: checkpoint.pth ->
    checkpoint.rewound-20261130-230405.pth; data -> data.partial-20261130-230405."""
    folder, name = os.path.split(os.path.abspath(path.rstrip(os.sep)))
    stem, extension = (name, "") if os.path.isdir(path) else os.path.splitext(name)
    return _unused(folder, f"{stem}.{label}-", name, extension)


def move_aside(folder, names, label):
    """Move the entries `names` of folder (those present, and files kept by a rewind) into a new folder inside
    it whose name says why and when (FOLDER/replaced-DATE-TIME): nothing is deleted, and a rename within one
    folder works on any filesystem, a mount point too. -> that folder, or None when none was present."""
    present = [name for name in os.listdir(folder) if name in names or ".rewound-" in name]
    if not present:
        return None
    target = _unused(folder, f"{label}-", "the old run")
    try:
        os.makedirs(target)
        for name in present:
            os.replace(os.path.join(folder, name), os.path.join(target, name))
    except OSError as error:
        fail(cannot_write(f"{target} to move the old run in {folder} aside", error, target,
                          after=", or move it aside yourself"))
    return target


def free_mib(folder):
    """Free space where folder is (or its nearest existing parent), in MiB, for a line about a full disk."""
    return shutil.disk_usage(next(filter(os.path.exists, above(folder)))).free / 2**20


def write_atomically(path, data, durable=True):
    """The one writer of a file: a temporary file beside path, made exclusively under a new name, fsynced, then
    renamed over path. A crash mid-write leaves the old file whole, a failed write (a full disk) leaves no half file
    behind, and no write follows a link someone left at path or beside it (the rename replaces a link at path, not
    what it leads to). data: bytes, or a function that writes into a file. durable=False: no fsync (a picture, a
    heartbeat rewritten every minute)."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "xb") as f:
            data(f) if callable(data) else f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        note_free_space(error, path)
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def sync_folder(folder):
    """fsync a folder, so that the renames in it survive a power cut. Where the filesystem cannot sync a folder
    (fsync(2): EINVAL for a file that does not support synchronization; ENOTSUP from some network mounts), the
    renames are as safe as it makes them: not a failed save."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def note_free_space(error, path):
    """The free space where path is, kept with the error of a write that failed, before its half-written file goes
    (after, the disk no longer looks full)."""
    error.free_mib = free_mib(os.path.dirname(os.path.abspath(path)))


def _failed(error, path=None):
    """(errno, names) of a write that failed: its OSError's number, and the names the failed call gave it (a rename's
    two, the second first), then path. Its OSError: the error itself, or the one it was raised on (torch.save into a
    file object raises a RuntimeError of its own, "unexpected pos ...", with the file's OSError as its context).
    torch.save writing a path itself says a full disk in its own words alone: taken for ENOSPC when the disk was
    nearly full as it failed."""
    cause = error
    for _ in range(8):  # (a chain, not a loop)
        if isinstance(cause, OSError) and cause.errno:
            names = [os.fsdecode(name) for name in (cause.filename2, cause.filename) if isinstance(name, (str, bytes))]
            return cause.errno, names + [path]
        cause = cause and (cause.__cause__ or cause.__context__)
    full = isinstance(error, RuntimeError) and getattr(error, "free_mib", 16) < 16
    return (errno.ENOSPC if full else None), [path]


def cannot_write(what, error, path, before="", after="", checkpoint=None):
    """The one line for a write that failed, whichever writer met it: "cannot write WHAT (why): BEFORE advice AFTER".
    Why and the advice come from the error (why_not_written, what_to_do, which looks at path first for what is in
    the way). The advice begins a sentence where BEFORE ends one. checkpoint: given for an epoch's files, whose
    failed write costs the epoch. The line then names the last checkpoint and how to resume from it. Where none was
    kept, it says to start again with --overwrite: a run's files without their checkpoint are a run the same command
    refuses to replace."""
    if checkpoint and os.path.isfile(checkpoint):
        before, after = f"{checkpoint} is the last one written. ", f"; then, to resume, {job.resume_advice()}"
    elif checkpoint:
        again = "./run.sh --overwrite" if named("--output-dir") == "OUTPUT_DIR" else "the same command with --overwrite"
        before, after = "no checkpoint was kept. ", f", then start again: {again} (what this epoch wrote is put aside)"
    advice = what_to_do(error, path)
    if before.endswith(". "):
        advice = advice[:1].upper() + advice[1:]
    return f"cannot write {what} ({why_not_written(error)}): {before}{advice}{after}"


def why_not_written(error):
    """What a failed write's error says, as a person reads it (its errno's words; a full disk as such, with the
    free space when it failed)."""
    number = _failed(error)[0]
    if number in (errno.ENOSPC, errno.EDQUOT):
        free = getattr(error, "free_mib", None)
        why = "no space left on device" if number == errno.ENOSPC else "disk quota exceeded"
        return why + (f"; {free:.0f} MiB free there when it failed" if free is not None else "")
    return os.strerror(number) if number else first_line(error)


def _in_the_way(number, names):
    """The entry that stands where a write needed another kind (EISDIR, ENOTDIR, EEXIST, ENOTEMPTY): of the names
    a failed call gave (a rename's two, then the path written), the first that is a folder where a file goes, or a
    file where a folder goes (the nearest entry above the name), or, for EEXIST, the one that exists."""
    for name in names:
        if number == errno.ENOTDIR:
            place = next(filter(os.path.lexists, above(os.path.dirname(os.path.abspath(name)))))
            if not os.path.isdir(place):
                return place
        elif os.path.isdir(name) or (number == errno.EEXIST and os.path.lexists(name)):
            return name
    return names[0]


_ADVICE = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there (or raise your quota)",
           errno.ENAMETOOLONG: "the name is longer than its filesystem allows: choose a shorter one",
           errno.EROFS: "its filesystem is mounted read-only: choose a folder on another one",
           errno.EFBIG: "the file is larger than its filesystem allows: choose a folder on another filesystem",
           errno.EIO: "the device or network filesystem failed (dmesg says more): see to it, or choose another folder"}


def what_to_do(error, path):
    """The advice for a write at path that failed, chosen from the error's errno alone, whichever writer met it:
    a full disk, a folder or file in the way (named), a chattr mark (named), a name the filesystem refuses,
    permissions, a read-only filesystem, the file-size limit (ulimit -f). Words that go after "cannot write ... (why):
    " (cannot_write)."""
    number, names = _failed(error, path)
    folder = os.path.dirname(os.path.abspath(names[0]))  # where the failed call wrote: its name's folder
    if number in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY):
        thing = _in_the_way(number, names)
        return f"{thing} is {kind(thing) or 'there'}, in the way of the run's own: move it away"
    mark = number in (errno.EPERM, errno.EACCES) and next(filter(None, map(marked, names + [folder])), None)
    if mark:
        return mark
    # The name the failed call made (a rename's target), not there: where its filesystem refuses it (FAT, exFAT and
    # SMB a ':', say), vfat says EINVAL; some FUSE mounts say EPERM in a folder this user may write.
    made = len(names) > 1 and not os.path.lexists(names[0])
    if made and (number == errno.EINVAL or number == errno.EPERM and os.access(folder, os.W_OK | os.X_OK)):
        return f"its filesystem refuses the name {os.path.basename(names[0])}: choose another name"
    if number in (errno.EPERM, errno.EACCES):
        return f"give this user write permission to {folder} and the files in it (ls -l {folder})"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if number == errno.EFBIG and limit != resource.RLIM_INFINITY:
        return (f"this process may write files of at most {limit / 2**20:.1f} MiB (the shell's file-size limit, "
                "ulimit -f): raise it, ulimit -f unlimited, in the shell that starts the run")
    return _ADVICE.get(number, "see to its cause, or choose another folder")


class Unreadable(UserError):
    """A file the run reads that this user may not open (check_readable): a mistake to fix, not a damaged file."""


def check_readable(flag, path):
    """The file at path opens for reading; else one line with the reason its errno gives, and what to do
    (Unreadable)."""
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EPERM):
            advice = (f"give this user read permission (ls -l {path}; chmod u+r {path} as its owner), or copy it "
                      "somewhere this user may read it")
        elif error.errno == errno.EIO:
            advice = "the device or network filesystem failed (dmesg says more): copy it again from elsewhere"
        else:
            advice = "give another checkpoint"
        raise Unreadable(f"{flag} {path} cannot be read ({error.strerror or error}): {advice}") from None


def second_name(path, new):
    """Give the file at path the second name new, a name not taken: a hard link (of the link itself, when path is
    one), or where the filesystem makes none, a copy of the bytes path reads as, written as every file is.
    link(2) says EPERM where a filesystem has no hard links (FAT, exFAT, SMB, many FUSE mounts), as for a link
    Linux's protected_hardlinks forbids; a folder this user may not write is EACCES, and is raised."""
    try:
        os.link(path, new, follow_symlinks=False)
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        with open(path, "rb") as source:
            write_atomically(new, lambda copy: shutil.copyfileobj(source, copy))


def write_folder(path, write):
    """Make the folder `path` by write(temporary): into a temporary folder beside it, renamed to path when write
    returns. An interrupted run leaves no half-written data set under path; a write that fails ends in one line. A
    folder that exists and is not empty is refused: what is in it could be real data, and a generator's
    file names are real ones."""
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"{path} is a file, not a folder: give a new folder")
    if os.path.isdir(path) and os.listdir(path):
        fail(f"{path} is not empty: give a new or empty folder (nothing there is written over)")
    temporary = beside(path, "partial")
    try:
        os.makedirs(temporary)
        write(temporary)
        os.replace(temporary, path)  # (rename(2) replaces an empty folder, as path is here, or nothing)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(error, OSError):
            fail(cannot_write(path, error, path, before="nothing half-written is left. "))
        raise


# --- this user's own folder in TMPDIR -----------------------------------------------------------------------------
def _private_path():
    return os.path.join(tempfile.gettempdir(), f"deeplab-{os.getuid()}")


def _not_private(path):
    """(why the entry at path is not this user's own folder, what to do first), or None when it is: another user's
    (not this user's to remove: /tmp's sticky bit), a symbolic link or not a folder, or one others may write in.
    (lstat: the name itself, no link followed.)"""
    try:
        info = os.lstat(path)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})", ""
    if info.st_uid != os.getuid():
        return f"belongs to another user (uid {info.st_uid})", ""
    if not stat.S_ISDIR(info.st_mode):
        what = "is a symbolic link" if stat.S_ISLNK(info.st_mode) else "is not a folder"
        return what, f"remove it (rm {path}), or "
    if info.st_mode & 0o022:
        return f"may be written by other users (mode {stat.S_IMODE(info.st_mode):o})", f"chmod 700 {path}, or "
    return None


def private_folder():
    """This user's own folder in the machine's temporary folder (TMPDIR/deeplab-UID), made mode 700 where missing:
    the ranks' heartbeats and the record of a mistake for torchrun's restarts (recovery.py) are kept there and read
    from there alone. Another user on a shared node can make any name in /tmp first: a folder of theirs would hand
    this run records to act on, and links to write through. -> its path; None where it is not this user's own
    (check_private_folder says so as the run starts), or cannot be made: those records are then not kept."""
    path = _private_path()
    try:
        os.mkdir(path, 0o700)
    except OSError:
        pass  # there already (checked below), or TMPDIR cannot be written
    return None if _not_private(path) else path


def check_private_folder():
    """A distributed run's start: where private_folder()'s name is taken by something that is not this user's own
    folder, one line says so, before any rank relies on it."""
    path = _private_path()
    found = os.path.lexists(path) and _not_private(path)
    if found:
        fail(f"{path} {found[0]}, where this program keeps this user's records of a run (heartbeats, a mistake for "
             f"torchrun's restarts): {found[1]}mkdir -p ~/tmp && export TMPDIR=~/tmp, then run again")


# --- main.py's folders ----------------------------------------------------------------------------------------
# Every name a run writes in its --output-dir, once, and what it is. -e writes eval.json and vis/; training the rest
# (tensorboard/ with --tensorboard). A folder holding one of the records (the files) holds a run.
RUN_FILES = {"checkpoint.pth": "a file", "checkpoint.prev.pth": "a file", "best.pth": "a file",
             "metrics.jsonl": "a file", "eval.json": "a file", "vis": "a folder", "tensorboard": "a folder"}
RECORDS = tuple(name for name, what in RUN_FILES.items() if what == "a file")
EVALUATION_WRITES = ("eval.json", "vis")


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
    --overwrite moves aside. start: checkpoints.Start (whether this run continues one there). -> start; with afresh
    set where the folder holds only what a first epoch stopped before its checkpoint wrote, and the command resumes
    automatically (run.sh, a requeued job): that run is then started again."""
    out, run_sh = args.output_dir, named("--output-dir") == "OUTPUT_DIR"
    found = [name for name in RECORDS if os.path.exists(os.path.join(out, name))]
    if found and start.auto and not (args.evaluate or args.overwrite or start.path) and _first_epoch_only(out, found):
        start = dataclasses.replace(start, afresh=True)  # the same command starts it again (make_run_outputs)
    if (replacing(args, start) and args.weights and not start.path
            and any(inside(args.weights, os.path.join(out, name)) for name in RUN_FILES)):
        fail(f"--weights {args.weights} belongs to the run that "
             f"{'--overwrite moves' if args.overwrite else 'is moved'} aside from {named('--output-dir')} "
             f"{out}: fine-tune into another {named('--output-dir')} instead (the run stays as it is)")
    if not found or args.evaluate or args.overwrite or start.afresh or start.path and names_in(start.path, out):
        return start
    what = f"{named('--output-dir')} {out} holds another run ({', '.join(found)})"
    aside = (f"replace it with {'./run.sh --overwrite' if run_sh else '--overwrite'} (it moves that run aside, "
             "nothing is deleted)")
    if start.path:
        fail(f"{what}, and --resume {start.path} is not from it: choose another {named('--output-dir')}, or {aside}")
    if start.auto or run_sh:
        fail(f"{what}, no checkpoint to continue from: choose another {named('--output-dir')}, or {aside}")
    fail(f"{what}: continue it with --resume auto, choose another --output-dir, or {aside}")


def _first_epoch_only(folder, found):
    """Whether the run files in folder (found: their names) are what a first epoch stopped before its checkpoint
    wrote: best.pth of that epoch, and metrics.jsonl with that epoch's line alone (twice, where a second write was
    cut short). Nothing else of a run is there to continue."""
    if not set(found) <= {"best.pth", "metrics.jsonl"}:
        return False
    metrics = os.path.join(folder, "metrics.jsonl")
    try:
        if os.path.exists(metrics):
            with open(metrics, "rb") as f:
                if any(line.strip() and not line.startswith(b'{"epoch": 0,') for line in f):
                    return False
        if "best.pth" not in found:
            return True
        import torch  # (here alone: the other writers of this module need no torch)
        best = torch.load(os.path.join(folder, "best.pth"), map_location="cpu", weights_only=True, mmap=True)
        return best.get("epoch") == 1 and best.get("step") == 0
    except Exception:  # unreadable, damaged, or not a checkpoint: a person's to look at
        return False


def replacing(args, start):
    """Whether a run in --output-dir is moved aside: with --overwrite, a training run that does not continue one
    there (not a torchrun restart, not a --resume of one of its checkpoints); or what a first epoch stopped before
    its checkpoint left (start.afresh)."""
    return start.afresh or (args.overwrite and not args.evaluate and not start.auto
                            and not (start.path and names_in(start.path, args.output_dir)))


def make_run_outputs(args, start):
    """Rank 0, after every check, before the process group (the other ranks wait for it there): the folders made
    and probed (--output-dir was, as the preflight held it: hold); with --overwrite, a run already there moved into a
    folder inside it (nothing deleted), so the new run's files and pictures are its own."""
    remove_leftovers(args.output_dir)
    if replacing(args, start):
        moved = move_aside(args.output_dir, RUN_FILES, "replaced")
        if moved and start.afresh:
            print(f"note: {args.output_dir} held only what a first epoch stopped before its checkpoint wrote: the run "
                  f"starts again from the beginning, and those files are now in {moved}", flush=True)
        elif moved:
            print(f"--overwrite: the run that was in {args.output_dir} is now in {moved}", flush=True)
    os.makedirs(os.path.join(args.output_dir, "vis"), exist_ok=True)
    for flag in ("--save-predictions", "--cache-dir"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None:
            make_folder(flag, path)
    RUN.held = [(fd, lock, []) for fd, lock, _ in RUN.held]  # every check passed: the folders are the run's, kept


def remove_leftovers(folder):
    """Rank 0, holding folder: the temporary files of writes that a kill cut short are removed (a run file's name, a
    dot, anything, ".tmp": main.py's checkpoint.pth.PID-TIME.tmp, temporary_name()'s). No live run writes there
    (this one holds it), and a killed save's second name for an old checkpoint keeps its blocks on the disk."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        leftover = name.endswith(".tmp") and any(name.startswith(f"{run_file}.") for run_file in RECORDS)
        if leftover and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)


def check_run_files(args):
    """Before anything is read in --output-dir, and before any step: every name the run will write there that is
    there already is what the run writes (a file, a folder), not marked immutable or append-only, and a folder
    this user may write into (vis/, tensorboard/). One line names the first that is not and what to do, instead of
    a failed save after an epoch. What --overwrite moves aside is not checked: it goes. Every file is replaced
    whole, never written through a link: a link at its name is no obstacle, and is said."""
    out = args.output_dir
    early = SimpleNamespace(afresh=False, auto=job.env().restarts > 0,
                            path="" if args.resume == "auto" else args.resume)
    if not os.path.isdir(out) or replacing(args, early):  # (replacing() before the start is decided)
        return
    writes = EVALUATION_WRITES if args.evaluate else [
        name for name in RUN_FILES if name != "eval.json" and (name != "tensorboard" or args.tensorboard)]
    for name in writes:
        wanted, path = RUN_FILES[name], os.path.join(out, name)
        found = kind(path)
        if found not in (None, wanted):
            fail(f"{path} is {found}, where the run writes {wanted} of its own: move it away")
        if found == "a file" and marked(path):
            fail(f"{marked(path)}, or move it away")
        if found == "a folder" and not os.access(path, os.W_OK | os.X_OK):
            fail(f"{path} cannot be written by this user, and the run writes to it: give this user write "
                 f"permission (ls -ld {path}), or move it away")
        if found == "a file" and os.path.islink(path):
            log(f"note: {path} is a symbolic link to {os.path.realpath(path)}: the run reads it, and its next write "
                "replaces the link with a file of its own (the file it leads to stays as it is)")


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


def _refuse(flag, folder, args, holder):
    who = (f"host {holder.get('host')}, process {holder.get('pid')}, since {holder.get('since')}" if holder else
           "a process that has not said who it is")
    eval_json = getattr(args, "evaluate", False) and flag == "--output-dir"
    raise Held(f"{named(flag)} {folder} is in use by another run ({who}): wait for it to end, or give another "
               f"{named(flag)}" + (" (-e writes eval.json there)" if eval_json else ""))


def _this_job(holder):
    """Whether a holder's record is this job's own (a torchrun restart's attempt before): the same run id."""
    run_id = job.env().run_id
    return bool(run_id) and holder.get("run_id") == run_id


def process_stat(pid):
    """The fields of /proc/PID/stat after the process's name (the 3rd field first: its state), or None where /proc
    cannot say (no such process, not Linux). The name, in parentheses, may hold spaces and parentheses itself."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def hold_output(args):
    """One folder, one run: --output-dir held (hold)."""
    hold("--output-dir", args.output_dir, args)


def hold(flag, folder, args):
    """One folder, one run: global rank 0 of a run (training, -e, predict.py) holds the folder it writes, for its
    whole life, through an advisory lock (flock) on FOLDER/.held, and writes who it is there. Another run that would
    write there is refused in one line naming the holder. The kernel lets go of the lock when its process ends,
    however it ends (a kill -9; on a network filesystem, a lost node after the server's lease). So a dead holder
    never blocks the next run. That run says it takes over, where the record names this file's inode: a copy of
    another folder's record (cp -a, a backup) is another file. --check-only only looks (_held: run.sh's preflight
    refuses before torchrun starts). Held before anything in the folder is read or decided (_open_and_lock makes
    it): no other run can begin and end there between this run's checks and its first write."""
    path = os.path.join(folder, HOLD)
    if job.env().rank != 0 or any(same_name(path, held) for _, held, _ in RUN.held):
        return
    _check_lock_file(path)
    if getattr(args, "check_only", None):
        if _held(folder):
            _refuse(flag, folder, args, _holder(path))
        return
    fd, made = _open_and_lock(flag, folder, args, path)
    if fd is None:
        return  # a filesystem without locks: said
    before, inode = _holder(path), os.fstat(fd).st_ino
    # (a torchrun restart of this job takes its own back without a word)
    if before and before.get("file") == inode and not _this_job(before):
        print(f"note: {folder} was held by host {before.get('host')}, process {before.get('pid')} (since "
              f"{before.get('since')}), which ended without letting go (killed, or its machine lost): taken over",
              flush=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "run_id": job.env().run_id, "file": inode}
    RUN.held.append((fd, path, made))  # held: let go at the end (release_output), also if the line below fails
    try:  # into the locked file itself (the lock is its own): not a new file renamed over it
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError as error:
        fail(cannot_write(f"{named(flag)} {folder}", error, path))


def _check_lock_file(path):
    """The lock file's name holds a file or nothing: anything else there is named, a symbolic link too (the lock
    record would be written into the file it leads to)."""
    found = f"a symbolic link (to {os.readlink(path)})" if os.path.islink(path) else kind(path)
    if found not in (None, "a file"):
        fail(f"{path} is {found}, where this program keeps its lock file (one folder, one run): remove it, then run "
             "again")


def _open_and_lock(flag, folder, args, path):
    """The folder made with its missing parents (make_folder), and its lock file at path, made when missing, opened
    and locked, not waiting: another run's lock refuses this run (Held). But a torchrun restart whose own job's
    attempt before still holds it (its machine lost: a network filesystem lets go when the machine's lease runs out)
    waits for it up to --dist-timeout, saying so. -> (descriptor, or None on a filesystem without locks (said); the
    folders made for it, deepest first, which release_output removes when the run lets go of them empty)."""
    deadline, said, made = time.time() + 60 * getattr(args, "dist_timeout", 5.0), False, []
    while True:
        made = [place for place in above(folder) if not os.path.exists(place)] or made
        make_folder(flag, folder)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # (a link made meanwhile: ELOOP)
        except FileNotFoundError:  # a run that had made the folder let go of it empty, and removed it, meanwhile
            continue
        except OSError as error:
            fail(cannot_write(f"{named(flag)} {folder}", error, path, after=", or choose another folder"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if not isinstance(error, BlockingIOError):  # no locks here (Lustre mounted with noflock, some FUSE ones)
                print(f"note: {folder} cannot be locked ({error.strerror or error}): nothing keeps another run "
                      "from writing there at the same time (docs/troubleshooting.md, one folder, one run)", flush=True)
                return None, made
            holder = _holder(path) or {}
            if not (job.env().restarts and _this_job(holder)) or time.time() > deadline:
                _refuse(flag, folder, args, holder)
            if not said:
                print(f"note: {folder} is still held by this job's attempt before the restart (host "
                      f"{holder.get('host')}, process {holder.get('pid')}): waiting for it to be let go, up to "
                      "--dist-timeout", flush=True)
                said = True
            time.sleep(2)
            continue
        if os.fstat(fd).st_nlink:  # not the file of a holder that removed it as it let go, meanwhile
            return fd, made
        os.close(fd)


def _held(folder):
    """Whether a live run holds folder: its lock file is there and locked (a probe's lock ends with its descriptor).
    Nothing is written to find out."""
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
        return False  # no locks on this filesystem: nothing to tell (the run says so when it starts)
    finally:
        os.close(fd)


def check_not_held(flag, path):
    """predict.py: path is neither a folder a run holds (training, or -e) nor inside one (its pictures would land
    among that run's files as it writes them)."""
    for place in above(path):
        if _held(place):
            holder = _holder(os.path.join(place, HOLD)) or {}
            where = "is" if place == os.path.abspath(path) else f"is inside {place}, which is"
            fail(f"{flag} {path} {where} in use by another run (host {holder.get('host')}, process "
                 f"{holder.get('pid')}): give another {flag}, or wait for that run to end")


def forget_hold():
    """In a forked child (a DataLoader worker): close this process's copy of the locks' descriptors. The parent's
    still hold them; the child's would hold them on after the parent was killed."""
    for fd, _, _ in RUN.held:
        os.close(fd)
    RUN.held = []


def release_output():
    """The end of a run that held folders: each lock file removed (while still held, so that no other run locks a
    file about to go), then let go; the folders made only to hold it, left empty (a mistake found before any write),
    removed."""
    while RUN.held:
        fd, path, made = RUN.held.pop()
        try:
            os.remove(path)
        except OSError:
            pass  # gone (the folder moved), or a full, read-only disk: the next holder reads a stale record, no more
        os.close(fd)
        for level in made:
            try:
                os.rmdir(level)
            except OSError:
                break  # not empty: the run wrote there, or another run did
