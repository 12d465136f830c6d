"""The harness: what a real run needs beside main.py's lesson, attached through whole statements of main.py (each
marked `harness`) that a learner can delete. main.py imports it in one statement; the lesson's own modules
(models.py, dataset.py, images.py) import nothing from here.

    preflight    everything a user can get wrong, found before any work; the output folder held
    checks       the flags' ranges and what several flags say together, after parsing
    checkpoints  which checkpoint a run starts from; every reader's CRC-32 check; --weights; saving on a stop
    stops        stopping together: signals, the ranks' vote each step, DataLoader workers that leave a stop
                 to their parent
    recovery     how a run ends: one-line errors, out of memory, a lost peer named; waits that say what they wait for
    rendezvous   run.sh's wait for the other nodes, in a process of its own (torch.distributed alone)
    records      what rank 0 writes beside the checkpoint: metrics, best.pth, pictures, eval.json, TensorBoard
    inference    multi-scale, flip and sliding-window evaluation (main.py -e, predict.py)
    paths        every path a program writes, checked in one place; one run per output folder
    job          this process's place in the job, read once from the launcher's environment; and RUN, a run's state
    errors       the error types
    cache        `python harness/cache.py`: fill dataset.py's decode cache before training

A run's state lives in one object, job.RUN (harness/job.py): a field per concern (the environment, the command, the
stop signals and the ranks' vote, the held --output-dir, the checkpoint the run starts from, TensorBoard's writer,
...), each written by one module alone. Every other module-level name is a constant, but cache.py's _preparing:
the data set being cached, set in the parent once per split and in each Pool worker as it starts.

Names say when a function writes or waits for the other ranks: one whose name begins with ranks_ is a collective
(every rank calls it, at the same point); write, make, move, hold, rewrite or save in a name: it writes files; a
name that says check and nothing more only reads.

Its promises, each with its one owner and the tests that hold it: harness/README.md.
"""
import errno
import os
import sys
import tempfile


def program_name():
    """The program this process runs, as its lines name it: main.py, harness/cache.py (python -c and -m: python)."""
    path = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else os.path.basename(path) or "python"


def _cannot_write(folder):
    """Why a file with something in it cannot be made in folder (its errno's words), or None."""
    probe = os.path.join(folder, f".deeplab-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"probe")  # (a full filesystem may still make an empty file)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as error:
        return os.strerror(error.errno) if error.errno else str(error)
    return None


def _temporary_folder_problem():
    """What keeps torch from the temporary folder it needs, or None. torchvision's import asks tempfile for one
    (a read-only root filesystem with TMPDIR unset fails there, in a long traceback). (Its path's length matters
    to DataLoader workers: checks.check_worker_sockets.)"""
    given = os.environ.get("TMPDIR")
    why = _cannot_write(given) if given else None
    fix = "free space there, or " if why == os.strerror(errno.ENOSPC) else ""
    if why:  # (tempfile would take /tmp instead, without a word)
        return f"TMPDIR={given} cannot be used ({why}): {fix}set TMPDIR to a folder of this machine you can write"
    try:
        folder = tempfile.gettempdir()  # the first of TMPDIR, TEMP, TMP, /tmp, /var/tmp, /usr/tmp, "." it can write
    except FileNotFoundError:
        why = _cannot_write("/tmp")
        fix = "free space there, or " if why == os.strerror(errno.ENOSPC) else ""
        return (f"no folder for temporary files can be written (/tmp: {why}; TMPDIR unset), and PyTorch needs one: "
                f"{fix}set TMPDIR to a folder of this machine you can write (a read-only root filesystem: mount a "
                "writable volume at /tmp)")
    stats = os.statvfs(folder)
    if stats.f_bavail * stats.f_frsize < 16 * 2**20:
        return (f"the temporary folder {folder} has {stats.f_bavail * stats.f_frsize // 1024} KiB free: free space "
                "there, or set TMPDIR to a folder with room")
    return None


def check_temporary_folder():
    """Every program's first check, as it imports the harness (before torchvision): a temporary folder torch can
    use, or one line and exit 1, said by each machine's first process (its folder is that machine's)."""
    problem = _temporary_folder_problem()
    if problem:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"{program_name()}: error: {problem}", file=sys.stderr, flush=True)
        sys.exit(1)


check_temporary_folder()
