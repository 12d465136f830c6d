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
    paths.hold("--save-predictions", folder, args)            # the same for any folder a run writes (predict.py's)
    paths.check_run_files(args)                               # nothing there in the way of what the run writes
    paths.why_not_written(error), paths.what_to_do(error, path)   # a failed write's reason, and advice from its errno
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

from . import job
from .errors import UserError, fail, first_line
from .job import RUN, log, named


def inside(path, folder):
    """Whether path is folder itself or lies below it, links resolved."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


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
_MARKS = ((0x10, "immutable", "i"), (0x20, "append-only", "a"))  # FS_IMMUTABLE_FL, FS_APPEND_FL


def marked(path):
    """(mark, chattr letter) when the file at path is marked immutable or append-only (chattr +i, +a), which no
    rename, removal or rewrite passes, root's neither; else None (also where the filesystem keeps no such marks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        flags = int.from_bytes(fcntl.ioctl(fd, _GET_FLAGS, bytes(8))[:4], sys.byteorder)
    except OSError:
        return None
    finally:
        os.close(fd)
    return next(((name, letter) for bit, name, letter in _MARKS if flags & bit), None)


def temporary_name(path):
    """A name beside path for its next version while it is written, which neither another write nor the leftover
    of a killed one holds: the process's id alone repeats (a container's first process has id 1 in every run)."""
    return f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


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
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)  # a new name: nothing there is written over
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        fail(f"{named(flag)} {path} cannot be written ({why_not_written(error)}): {what_to_do(error, path)}, or "
             "choose another folder")


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


def write_atomically(path, data, durable=True):
    """Write a temporary file, fsync, rename over path: a crash mid-write leaves the old file whole, and a failed
    write (a full disk) leaves no half file behind. The temporary file is made exclusively under a new name: no write
    follows a link someone left at path or beside it (the rename replaces a link at path, not what it leads to).
    data: bytes, or a function that writes into a file. durable=False: no fsync (a heartbeat, rewritten every
    minute)."""
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


def _os_error(error):
    """The OSError of a write that failed: the error itself, or the one it was raised on (torch.save into a file
    object raises a RuntimeError of its own, "unexpected pos ...", with the file's OSError as its context)."""
    for _ in range(8):  # (a chain, not a loop)
        if error is None or isinstance(error, OSError) and error.errno:
            return error
        error = error.__cause__ or error.__context__
    return None


def _errno(error):
    """The errno of a write that failed (_os_error's). torch.save writing a path itself says a full disk in its own
    words alone: taken for ENOSPC when the disk was nearly full as it failed."""
    cause = _os_error(error)
    if cause is not None:
        return cause.errno
    free = getattr(error, "free_mib", None)
    return errno.ENOSPC if isinstance(error, RuntimeError) and free is not None and free < 16 else None


def _names(error, path):
    """The names a failed call gave its OSError (a rename's two, the second first), then path."""
    cause = _os_error(error)
    given = (getattr(cause, "filename2", None), getattr(cause, "filename", None)) if cause is not None else ()
    return [os.fsdecode(name) for name in given if isinstance(name, (str, bytes))] + [path]


def why_not_written(error):
    """What a failed write's error says, as a person reads it (its errno's words; a full disk as such, with the
    free space when it failed)."""
    number = _errno(error)
    if number in (errno.ENOSPC, errno.EDQUOT):
        free = getattr(error, "free_mib", None)
        why = "no space left on device" if number == errno.ENOSPC else "disk quota exceeded"
        return why + (f"; {free:.0f} MiB free there when it failed" if free is not None else "")
    return os.strerror(number) if number else first_line(error)


def _in_the_way(error, path):
    """The entry that stands where a write needed another kind (EISDIR, ENOTDIR, EEXIST, ENOTEMPTY): of the names
    the error gives (a rename's two, else path), the first that is a folder where a file goes, or a file where a
    folder goes (the nearest such folder above the name), or, for EEXIST, the one that exists."""
    names = _names(error, path)
    number = _errno(error)
    for name in names:
        if number == errno.ENOTDIR:
            place = os.path.dirname(os.path.abspath(name))
            while place != os.path.dirname(place) and not os.path.exists(place):
                place = os.path.dirname(place)
            if os.path.exists(place) and not os.path.isdir(place):
                return place
        elif os.path.isdir(name) or (number == errno.EEXIST and os.path.lexists(name)):
            return name
    return names[0]


_REFUSED_CHARACTERS = '\\ : * ? " < > |'


def _name_refused(path):
    """Whether the last part of path holds a character FAT, exFAT and SMB refuse in a name (Linux's own filesystems
    take any but / and NUL): then a write there that fails as an invalid argument is the name's fault."""
    name = os.path.basename(os.path.normpath(path))
    return any(c in name for c in _REFUSED_CHARACTERS.split())


def _refused_name(path):
    return (f"its filesystem refuses the name {os.path.basename(os.path.normpath(path))} (FAT, exFAT and SMB allow "
            f"none of {_REFUSED_CHARACTERS} in a name): choose another name")


def what_to_do(error, path):
    """The advice for a write at path that failed, chosen from the error's errno alone, whichever writer met it:
    a full disk, a folder or file in the way (named), permissions or a chattr mark (named), a read-only filesystem,
    the file-size limit (ulimit -f). Words that go after "cannot write ... (why): "."""
    number = _errno(error)
    names = _names(error, path)
    if number in (errno.ENOSPC, errno.EDQUOT):
        return "free space there" + (" (or raise your quota)" if number == errno.EDQUOT else "")
    if number in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY):
        thing = _in_the_way(error, path)
        return f"{thing} is {kind(thing) or 'there'}, in the way of the run's own: move it away"
    # A name FAT, exFAT or SMB refuse: vfat says EINVAL; some FUSE mounts EPERM, in a folder this user may write.
    # Only a name the failed call made (its own, not path) and that is not there (one there, the filesystem took).
    refused = next((name for name in names[:-1] if _name_refused(name) and not os.path.lexists(name)), None)
    if number == errno.EINVAL and refused:
        return _refused_name(refused)
    if number == errno.ENAMETOOLONG:
        return "the name is longer than its filesystem allows: choose a shorter one"
    if number in (errno.EPERM, errno.EACCES):
        mark = next(((name, found) for name in names if (found := marked(name))), None)
        if mark:
            return f"{mark[0]} is marked {mark[1][0]} (lsattr): clear it with chattr -{mark[1][1]} {mark[0]}"
        folder = os.path.dirname(os.path.abspath(names[0]))  # where the failed call wrote: its name's folder
        if refused and os.access(os.path.dirname(os.path.abspath(refused)), os.W_OK | os.X_OK):
            return _refused_name(refused)
        return f"give this user write permission to {folder} and the files in it (ls -l {folder})"
    if number == errno.EROFS:
        return "its filesystem is mounted read-only: choose a folder on another one"
    if number == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return (f"this process may write files of at most {limit / 2**20:.1f} MiB (the shell's file-size limit, "
                    "ulimit -f): raise it, ulimit -f unlimited, in the shell that starts the run")
        return "the file is larger than its filesystem allows: choose a folder on another filesystem"
    if number == errno.EIO:
        return "the device or network filesystem failed (dmesg says more): see to it, or choose another folder"
    return "see to its cause, or choose another folder"


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
    """Give the file at path the second name new (not followed, when path is a link: the link itself): a hard link,
    or a copy of its bytes where the filesystem makes none. link(2) says EPERM where a filesystem has no hard links
    (FAT, exFAT, SMB, many FUSE mounts), as for a link Linux's protected_hardlinks forbids; a folder this user may
    not write is EACCES, and is raised. The copy is of the bytes alone: some of those filesystems refuse a chmod to a
    mode they cannot hold, which copying the permissions would make."""
    try:
        os.link(path, new, follow_symlinks=False)
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        if os.path.islink(path):
            os.symlink(os.readlink(path), new)  # (fails where anything has the name new, as link() does)
            return
        with open(path, "rb") as source, open(new, "xb") as copy:  # "x": never through a link left at new
            shutil.copyfileobj(source, copy)


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
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(error, OSError):
            fail(f"cannot write {path} ({why_not_written(error)}); nothing half-written is left: "
                 f"{what_to_do(error, path)}")
        raise


# --- this user's own folder in TMPDIR -----------------------------------------------------------------------------
def _private_path():
    return os.path.join(tempfile.gettempdir(), f"deeplab-{os.getuid()}")


def _not_private(path):
    """Why the folder at path is not this user's own, or None when it is: a symbolic link, not a folder, another
    user's, or one others may write in. (lstat: the name itself, no link followed.)"""
    try:
        info = os.lstat(path)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid != os.getuid():
        return f"belongs to another user (uid {info.st_uid})"
    if info.st_mode & 0o022:
        return f"may be written by other users (mode {stat.S_IMODE(info.st_mode):o})"
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
    why = _not_private(path) if os.path.lexists(path) else None
    if not why:
        return
    own = "mkdir -p ~/tmp && export TMPDIR=~/tmp, then run again"
    try:
        mine = os.lstat(path).st_uid == os.getuid()
    except OSError:  # gone meanwhile
        mine = False
    if why.startswith("may be written"):  # this user's own folder
        advice = f"chmod 700 {path}, or {own}"
    elif mine:  # this user's own link or file
        advice = f"remove it (rm {path}), or {own}"
    else:
        advice = own  # another user's: not this user's to remove (/tmp's sticky bit)
    fail(f"{path} {why}, where this program keeps this user's records of a run (heartbeats, a mistake for "
         f"torchrun's restarts): {advice}")


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
    found = [name for name in RECORDS if os.path.exists(os.path.join(args.output_dir, name))]
    if (found and not (args.evaluate or args.overwrite) and start.auto and not start.path
            and _first_epoch_only(args.output_dir, found)):
        start = dataclasses.replace(start, afresh=True)  # the same command starts it again (make_run_outputs)
    moves = "--overwrite moves" if args.overwrite else "is moved"
    if (replacing(args, start) and args.weights and not start.path
            and any(inside(args.weights, os.path.join(args.output_dir, name)) for name in RUN_FILES)):
        fail(f"--weights {args.weights} belongs to the run that {moves} aside from {named('--output-dir')} "
             f"{args.output_dir}: fine-tune into another {named('--output-dir')} instead (the run stays as it is)")
    if not found or args.evaluate or args.overwrite or start.afresh or (start.path and names_in(start.path,
                                                                                                  args.output_dir)):
        return start
    what = f"{named('--output-dir')} {args.output_dir} holds another run ({', '.join(found)})"
    replace = "./run.sh --overwrite" if named("--output-dir") == "OUTPUT_DIR" else "--overwrite"
    aside = f"replace it with {replace} (it moves that run aside, nothing is deleted)"
    if start.path:
        fail(f"{what}, and --resume {start.path} is not from it: choose another {named('--output-dir')}, or {aside}")
    if start.auto or named("--output-dir") == "OUTPUT_DIR":
        fail(f"{what}, no checkpoint to continue from: choose another {named('--output-dir')}, or {aside}")
    fail(f"{what}: continue it with --resume auto, choose another --output-dir, or {aside}")


def _first_epoch_only(folder, found):
    """Whether the run files in folder (found: their names) are what a first epoch stopped before its checkpoint
    wrote: best.pth of that epoch, metrics.jsonl with its line alone. Nothing else of a run is there to continue."""
    if not set(found) <= {"best.pth", "metrics.jsonl"}:
        return False
    try:
        with open(os.path.join(folder, "metrics.jsonl"), "rb") as f:
            lines = f.read().split(b"\n")
        if lines[-1].startswith(b'{"epoch": '):
            lines.pop()  # an unended last line that begins a record: a write the stop cut short
        records = [json.loads(line) for line in lines if line.strip()]
    except FileNotFoundError:
        records = []
    except (OSError, ValueError):
        return False
    if len(records) > 1 or any(not isinstance(record, dict) or record.get("epoch") != 0 for record in records):
        return False
    if "best.pth" not in found:
        return True
    import torch  # (here alone: the other writers of this module need no torch)
    try:
        best = torch.load(os.path.join(folder, "best.pth"), map_location="cpu", weights_only=True, mmap=True)
        return best.get("epoch") == 1 and best.get("step") == 0
    except Exception:  # damaged, or not a checkpoint: a person's to look at
        return False


def replacing(args, start):
    """Whether a run in --output-dir is moved aside: with --overwrite, a training run that does not continue one
    there (not a torchrun restart, not a --resume of one of its checkpoints); or what a first epoch stopped before
    its checkpoint left (start.afresh)."""
    return start.afresh or (args.overwrite and not args.evaluate and not start.auto
                            and not (start.path and names_in(start.path, args.output_dir)))


def make_run_outputs(args, start):
    """Rank 0, after every check, before the process group (the other ranks wait for it there): the folders made
    and probed, --output-dir held (when it was new); with --overwrite, a run already there moved into a folder
    inside it (nothing deleted), so the new run's files and pictures are its own."""
    make_folder("--output-dir", args.output_dir)
    hold_output(args)
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


def _leftover(name):
    """A temporary file of a write that was killed: a run file's name, a dot, anything, ".tmp" (main.py's
    checkpoint.pth.PID-TIME.tmp, temporary_name()'s)."""
    return name.endswith(".tmp") and any(name.startswith(f"{run_file}.") for run_file in RECORDS)


def remove_leftovers(folder):
    """Rank 0, holding folder: the temporary files of writes that a kill cut short are removed. No live run writes
    there (this one holds it), and a killed save's second name for an old checkpoint keeps its blocks on the disk."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if _leftover(name) and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)


def check_run_files(args):
    """Before anything is read in --output-dir, and before any step: every name the run will write there that is
    there already is what the run writes (a file, a folder), not marked immutable or append-only, and writable
    where the run writes into it (metrics.jsonl, vis/, tensorboard/). One line names the first that is not and
    what to do, instead of a failed save after an epoch. What --overwrite moves aside is not checked: it goes."""
    out = args.output_dir
    explicit = args.resume not in ("", "auto")
    if not os.path.isdir(out) or (args.overwrite and not args.evaluate and job.env().restarts == 0
                                  and not (explicit and names_in(args.resume, out))):  # replacing(), said early
        return
    if args.evaluate:
        writes = EVALUATION_WRITES
    else:  # training: every name but -e's eval.json
        writes = [name for name in RUN_FILES if name != "eval.json" and (name != "tensorboard" or args.tensorboard)]
    for name in writes:
        wanted = RUN_FILES[name]
        path = os.path.join(out, name)
        found = kind(path)
        if found not in (None, wanted):
            fail(f"{path} is {found}, where the run writes {wanted} of its own: move it away")
        mark = marked(path) if found == "a file" else None
        if mark:
            fail(f"{path} is marked {mark[0]} (lsattr), and the run replaces it: clear the mark, chattr -{mark[1]} "
                 f"{path}, or move it away")
        if name == "metrics.jsonl" and os.path.islink(path):  # (the other files are replaced: a link at them goes)
            fail(f"{path} is a symbolic link (to {os.readlink(path)}), and the run appends to it: move it away, or "
                 "replace it with a copy of the file it leads to")
        written_into = name == "metrics.jsonl" or wanted == "a folder"  # appended to, or files made in it
        if found and written_into and not os.access(path, os.W_OK | (os.X_OK if wanted == "a folder" else 0)):
            fail(f"{path} cannot be written by this user, and the run writes to it: give this user write "
                 f"permission (ls -ld {path}), or move it away")
    checkpoint = job.checkpoint_path(out)
    if not args.evaluate and os.path.islink(checkpoint) and kind(checkpoint) == "a file":
        log(f"note: {checkpoint} is a symbolic link to {os.path.realpath(checkpoint)}: the run reads it, and its "
            "next save replaces the link with a file of its own (the file it leads to stays as it is)")


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


def _lock(fd, path, folder, args):
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
                print(f"note: {folder} is still held by this job's attempt before the restart (host "
                      f"{holder.get('host')}, process {holder.get('pid')}): waiting for it to be let go, up to "
                      "--dist-timeout", flush=True)
                said = True
            time.sleep(2)


def process_stat(pid):
    """The fields of /proc/PID/stat after the process's name (the 3rd field first: its state), or None where /proc
    cannot say (no such process, not Linux). The name, in parentheses, may hold spaces and parentheses itself."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _started(pid):
    """When the process pid started, in clock ticks since the machine booted (/proc/PID/stat's 22nd field): with the
    host and the process id, what tells a live holder from a process id used again. None where /proc cannot say."""
    fields = process_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 and fields[19].isdigit() else None


def hold_output(args):
    """One folder, one run: --output-dir held (hold)."""
    hold("--output-dir", args.output_dir, args)


def hold(flag, folder, args):
    """One folder, one run: global rank 0 of a run (training, -e, predict.py) holds the folder it writes, for its
    whole life, through an advisory lock (flock) on FOLDER/.held, and writes who it is there. Another run that would
    write there is refused in one line naming the holder. The kernel lets go of the lock when its process ends,
    however it ends (a kill -9; on a network filesystem, a lost node after the server's lease), so a dead holder
    never blocks the next run, which says that it takes over (unless the record is a copy: _taken_over). --check-only
    only looks (run.sh's preflight refuses before torchrun starts). Held before anything in the folder is read or
    decided: a folder that does not exist yet is made for it (and removed again, with the parents made for it, when
    the run lets go of it empty: release_output), so that no other run can begin and end there between this run's
    checks and its first write."""
    place = os.path.realpath(folder)
    if job.env().rank != 0 or any(os.path.realpath(os.path.dirname(p)) == place for _, p, _ in RUN.held):
        return
    path = os.path.join(folder, HOLD)
    if getattr(args, "check_only", None):
        _refuse_if_held(flag, folder, args, path)
        return
    while True:
        made = _make_for_holding(flag, folder)
        try:
            fd = _open_and_lock(flag, folder, args, path)
            break
        except FileNotFoundError:  # a run that had made the folder let go of it empty, and removed it, meanwhile
            continue
    if fd is None:
        return  # a filesystem without locks: said
    _taken_over(folder, _holder(path))
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "run_id": job.env().run_id}
    RUN.held.append((fd, path, made))  # held: let go at the end (release_output), also if the line below fails
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError as error:
        fail(f"{named(flag)} {folder} cannot be written ({why_not_written(error)}): {what_to_do(error, path)}")


def _taken_over(folder, before):
    """Say what the record of a holder that no longer holds the folder was: a run killed (or its machine lost), or,
    where its process lives on, on this host, started when the record says, a copy of another folder's record (a
    backup, cp -a, taken while a run held it): that run holds its own folder, and is not called killed."""
    run_id = job.env().run_id
    if not before or (run_id and before.get("run_id") == run_id):  # (a torchrun restart of this job: its own)
        return
    pid = before.get("pid")
    alive = (before.get("host") == socket.gethostname() and isinstance(pid, int) and pid > 0
             and before.get("started") is not None and _started(pid) == before.get("started"))
    if alive:
        return  # a copy: nothing of this folder's to say
    print(f"note: {folder} was held by host {before.get('host')}, process {pid} (since {before.get('since')}), "
          "which ended without letting go (killed, or its machine lost): taken over", flush=True)


def _make_for_holding(flag, folder):
    """The folder made with its missing parents, one level at a time. -> the levels this process made, deepest
    first (a level another process made meanwhile is not this run's)."""
    missing = []
    place = os.path.abspath(folder)
    while not os.path.exists(place):
        missing.append(place)
        place = os.path.dirname(place)
    made = []
    try:
        for level in reversed(missing):
            try:
                os.mkdir(level)
                made.insert(0, level)
            except FileExistsError:
                pass
    except OSError as error:
        fail(f"{named(flag)} {folder} cannot be made ({why_not_written(error)}): "
             f"{what_to_do(error, folder)}, or choose another folder")
    return made


def _check_lock_file(path):
    """The lock file's name holds a file or nothing: anything else there is named, a symbolic link too (the lock
    record would be written into the file it leads to)."""
    if os.path.islink(path):
        fail(f"{path} is a symbolic link (to {os.readlink(path)}), where this program keeps its lock file (one folder, "
             "one run): remove the link, then run again")
    found = kind(path)
    if found not in (None, "a file"):
        fail(f"{path} is {found}, where this program keeps its lock file (one folder, one run): remove it, then run "
             "again")


def _refuse_if_held(flag, folder, args, path):
    """--check-only: another run that holds the lock file at path is refused, found by a probe's lock, which ends
    with its descriptor. Nothing is written to find out."""
    _check_lock_file(path)
    try:
        fd = os.open(path, os.O_RDWR if os.access(path, os.W_OK) else os.O_RDONLY)
    except OSError:
        return  # no lock file: no holder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _refuse(flag, folder, args, _holder(path))
    except OSError:
        pass  # no locks on this filesystem: the run says so when it starts
    finally:
        os.close(fd)


def _open_and_lock(flag, folder, args, path):
    """The lock file at path, made when missing, opened and locked (_lock). -> its descriptor, or None on a
    filesystem without locks (said). Another run's lock refuses this run (Held)."""
    while True:
        _check_lock_file(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # (a link made meanwhile: ELOOP)
        except FileNotFoundError:
            raise  # the folder is gone: hold_output makes it again
        except OSError as error:
            fail(f"{named(flag)} {folder} cannot be written ({why_not_written(error)}): "
                 f"{what_to_do(error, path)}, or choose another folder")
        try:
            _lock(fd, path, folder, args)
        except BlockingIOError:
            os.close(fd)
            _refuse(flag, folder, args, _holder(path))
        except OSError as error:  # a filesystem without locks (Lustre mounted with noflock, some FUSE ones)
            os.close(fd)
            print(f"note: {folder} cannot be locked ({error.strerror or error}): nothing keeps another run "
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
