import contextlib
import errno
import fcntl
import hashlib
import importlib
import itertools
import json
import multiprocessing
import multiprocessing.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))  # lesson.py, gpu_check.py: the tests read them too


# Tiny everything: 64x32 images, models.py's tiny DeepLabV3+ (its checkpoints 4 MB), one thread per process.
TRAIN_ARGS = ["--model", "deeplabv3plus_mobilenet_tiny", "--crop-size", "32", "-b", "2", "-j", "0",
              "--pretrained-backbone", "none", "-p", "1"]


# An interpreter's name: python, python3, python3.12 (and the old python3.7m).
PYTHON_NAME = re.compile(r"python[0-9.]*m?")


def write_synthetic(*args, **kwargs):
    """synthetic.write_synthetic, imported at its first call: pytest's own process imports this file too, runs no
    test under -n 2, and would spend 3 s importing torchvision (synthetic.py's) before it starts the workers."""
    from synthetic import write_synthetic as write
    return write(*args, **kwargs)


def path_without_python(path, links):
    """PATH with each folder that holds a Python replaced by a folder (in links) of links to everything else in
    it: bash, nproc, setsid and the rest are found as before; `python` is found nowhere."""
    folders = []
    for number, folder in enumerate(path.split(os.pathsep)):
        try:
            names = os.listdir(folder)
        except OSError:  # a folder on PATH that is not there (or "", the current folder, which moves)
            continue
        if not any(PYTHON_NAME.fullmatch(name) for name in names):
            folders.append(folder)
            continue
        copy = os.path.join(links, str(number))
        os.mkdir(copy)
        for name in names:
            if not PYTHON_NAME.fullmatch(name):
                os.symlink(os.path.join(os.path.abspath(folder), name), os.path.join(copy, name))
        folders.append(copy)
    return os.pathsep.join(folders)


SAVED_ENVIRON = pytest.StashKey[tuple]()  # the folder of links, and PATH, PYTHON and PYTHONPATH as they were
INTERPRETERS = os.path.join(ROOT, "tests", "interpreters")  # its sitecustomize.py: every Python the tests start


def pytest_configure(config):
    """Every program a test starts runs on the Python that runs pytest: sys.executable in the command, run.sh's
    steps through PYTHON. With the Python of a virtual environment not activated, `python` on PATH is another one,
    without torch; here PATH holds none, so that a command that reaches for it fails in every test that runs it.
    Each of them skips the garbage collections at its exit (tests/interpreters/sitecustomize.py). Set before the
    test modules are imported: their environments (CPU_ENV) are copies of os.environ."""
    links = tempfile.mkdtemp(prefix="deeplab-tests-path-")
    config.stash[SAVED_ENVIRON] = links, {name: os.environ.get(name) for name in ("PATH", "PYTHON", "PYTHONPATH")}
    os.environ["PATH"] = path_without_python(os.environ.get("PATH", ""), links)
    os.environ["PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [INTERPRETERS, os.environ.get("PYTHONPATH")]))


def pytest_collection_modifyitems(config, items):
    """The longest tests first: those that launch programs, and the few others that take 5 s or more (marked
    long). Two workers then end together, instead of one finishing a minute's launch, or a wait of 10 s,
    while the other has nothing left (each worker takes the next test as it ends one: pytest.ini). In each group,
    the files' order, with one exception: of the tests that read one of READS_A_LAUNCH, the first keeps its place
    and the others come after the rest of their group. Side by side, two such tests went to the two workers at once,
    and one waited idle while the other built the launch: about 10 s of each run, for the killed ranks and for the
    ONNX export. (A module fixture that serves tests of both groups is made once for each: test_predict's
    checkpoint, a torch.save.)"""
    def later(item):
        return not any(item.get_closest_marker(name) for name in ("launch", "long"))
    items.sort(key=later)
    read, waits = set(), {}
    for item in items:
        reads = READS_A_LAUNCH & set(item.fixturenames)
        waits[item] = bool(reads & read)
        read |= reads
    items.sort(key=lambda item: (later(item), waits[item]))


# The module fixtures that build a launch once for the whole run (built_once), which several tests then read.
READS_A_LAUNCH = {"two_agreeing_ranks", "two_process_run", "exported", "killed_twice", "launched"}


def pytest_unconfigure(config):
    links, saved = config.stash[SAVED_ENVIRON]
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(links, ignore_errors=True)


def processes_mentioning(text, *more):
    """PIDs of processes whose command line contains text (a test's own folder) and each of more: with parallel
    workers (pytest -n), another test's processes run beside this one's, and only the folder tells them apart."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read()
            if all(part.encode() in line for part in (text, *more)) and int(pid) != os.getpid():
                pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.fixture(autouse=True)
def a_fresh_run():
    """Each test begins with the harness's state (job.RUN) as a new process has it: a run sets its fields afresh as
    it starts, but a test that calls one function directly would read what the test before it left (a --check-only
    run's quiet, seen to hide predict.py's note from the next test in that worker)."""
    from harness import job, paths, records, recovery, stops
    # First let go of what an earlier test left on job.RUN: signal handlers and the stdout/stderr wrappers, the
    # heartbeat, the TensorBoard writer, the output folder's hold.
    stops.restore()
    recovery.stop_heartbeat()
    records.close_tensorboard()
    paths.release_output()
    job.begin_run()  # the program's own reset, as recovery.guard calls it where a run starts


# The machine's temporary folder, as the session found it: each test's own is made there (a_temporary_folder_of_its_own).
SESSION_TMP = tempfile.gettempdir()


@pytest.fixture(autouse=True)
def a_temporary_folder_of_its_own(tmp_path, monkeypatch):
    """Each test runs with a new, empty TMPDIR of its own, so that what a program keeps there (paths.private_folder's
    TMPDIR/deeplab-UID: a mistake's record, the heartbeats) is never another test's, nor that of a suite running
    beside this one (seen: one suite's record read by the other's test as its peer's). Set in os.environ, which every
    program a test starts inherits (cpu_env and run() copy it at the call; a forked rank keeps it), and in tempfile,
    which caches gettempdir(). Short (/tmp/tXXXXXXXX): the programs a test starts keep their DataLoader workers'
    sockets there, and a socket's path must fit in 108 bytes. pytest's own folders (tmp_path) and multiprocessing's
    folder for this process's sockets (made once a process, and inherited by a DataLoader worker forked from it) are
    made first, and stay the session's. Removed after the test, once its processes are ended
    (no_process_left_behind)."""
    multiprocessing.util.get_temp_dir()
    folder = tempfile.mkdtemp(prefix="t", dir=SESSION_TMP)
    monkeypatch.setenv("TMPDIR", folder)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_process_left_behind(tmp_path, a_temporary_folder_of_its_own):
    """run.sh starts torchrun in a session of its own: a test that fails or times out must not leave it,
    or its workers, running into the next tests (which a_temporary_folder_of_its_own's removal waits for)."""
    yield
    for pid in processes_mentioning(str(tmp_path)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def built_once(tmp_path_factory, name, build):
    """A session fixture's folder, built once for the whole run: by the first of pytest-xdist's workers to ask (they
    share the parent of their temporary folders), while the others wait on a lock; then read by all. build(folder)
    makes it; a build that failed or was killed half-way is done again by the next to ask. -> the folder."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    shared = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.getbasetemp()
    folder, done = shared / name, shared / f"{name}.built"
    with open(shared / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(str(folder))
            done.touch()
    return str(folder)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """8 train and 5 val images (5: divisible by neither 2 nor 3), in the official layout."""
    return built_once(tmp_path_factory, "cityscapes", lambda root: write_synthetic(root, num_train=8, num_val=5,
                                                                                    size=(64, 32), seed=3))


PORTS = itertools.count()  # this worker's ports handed out so far


def free_port():
    """A port for a program a test starts, free now: from a slice of 20000-32767 of this pytest-xdist worker's own
    (gw0, gw1, ...), below Linux's ephemeral ports (from 32768 by default, which the kernel gives out for port 0),
    so that neither another worker nor the kernel gives it out before the program binds it. (Port 0's answer, let go
    at once, was such a race: both workers could be given the same port.) A second suite running beside this one
    walks the same ports: the bind below skips those in use, not one that is about to be."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    width = 12768 // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    while True:
        port = 20000 + width * worker + next(PORTS) % width
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (another program, or a run of the suite beside this one)
                continue
            return port


def cpu_env(**more):
    """The environment for a program a test starts: os.environ as the suite set it (pytest_configure), on the CPU
    with one thread a process, and more."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **more}


def metrics(out):
    """OUTPUT_DIR/metrics.jsonl's records."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def checkpoint_of(out, name="checkpoint.pth"):
    """OUTPUT_DIR/name, loaded as main.py loads one."""
    import torch
    return torch.load(os.path.join(out, name), map_location="cpu", weights_only=True)


def fingerprint(folder):
    """{path relative to folder: sha1} of every file under folder: what a test compares before and after."""
    found = {}
    for place, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(place, name), "rb") as f:
                found[os.path.relpath(os.path.join(place, name), folder)] = hashlib.sha1(f.read()).hexdigest()
    return found


def no_space(*args, **kwargs):
    """A write that a full disk refuses, to monkeypatch in place of one."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def on_the_cpu(monkeypatch):
    """The CPU's rules, also on a GPU machine (pytestmark = pytest.mark.usefixtures("on_the_cpu"))."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def one_error_line(capsys, prefix="main.py: error: "):
    """What the test printed holds one error line, starting with prefix, and no traceback. -> that line."""
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(prefix), output
    return errors[0]


def run_main(argv, capsys=None, code=None, program="main"):
    """main() of the module program (main.py's, predict.py's) on argv, parsed by its own parser, in this process: as
    its command line runs it, without the seconds a fresh interpreter takes to import torch. code: the exit status
    it must end with (SystemExit), None for none. -> what it printed on stdout, with capsys (read, so that the
    next read starts after it)."""
    module = importlib.import_module(program)
    if code is None:
        module.main(module.get_args_parser().parse_args(argv))
    else:
        with pytest.raises(SystemExit) as exit_info:
            module.main(module.get_args_parser().parse_args(argv))
        assert exit_info.value.code == code
    return capsys.readouterr().out if capsys else None


def main_fails(argv, capsys, code=1, program="main"):
    """run_main(argv) ends with exit code `code` and one error line. -> that line."""
    run_main(argv, code=code, program=program)
    return one_error_line(capsys, f"{program}.py: error: ")


def no_shared_memory_in_workers(monkeypatch, words="unable to allocate shared memory(shm) for file </torch_4242_0_1>: "
                                                  "No space left on device (28)"):
    """torch's storages refuse to move into shared memory in a DataLoader worker, with torch's words for a full
    /dev/shm: as a batch's tensors meet it in the queue's feeder thread (seen with a 1 MB /dev/shm, a mount namespace's
    own: that hung predict.py)."""
    import torch
    real = torch.UntypedStorage._share_fd_cpu_

    def refused(self, *args, **kwargs):
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(words)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(torch.UntypedStorage, "_share_fd_cpu_", refused)
    # The parent notices a worker gone after a wait for its queue of MP_STATUS_CHECK_INTERVAL (5 s), bound as a
    # default argument: half a second here, the same path.
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    monkeypatch.setattr(_MultiProcessingDataLoaderIter._try_get_data, "__defaults__", (0.5,))


def varied_model(seed=0):
    """The tests' tiny DeepLab with random weights, made to predict many classes: random weights alone give
    logits whose mean differs far more from class to class than from pixel to pixel (one class everywhere),
    so the classifier's bias takes each class's mean logit away."""
    import torch
    from models import build_model
    torch.manual_seed(seed)
    model = build_model(TRAIN_ARGS[1], 19, 16)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.normal_(0, 0.1)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.normal_(0, 0.5)
    model.eval()
    with torch.no_grad():
        model.classifier.bias -= model(torch.rand(1, 3, 32, 64) * 4 - 2).mean((0, 2, 3))
    return model


def run(command, env=None, timeout=240, cwd=ROOT):
    """Run a command (in the repository root), on the CPU with one thread per process; fail with its output."""
    full_env = cpu_env(**(env or {}))
    result = subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


# Crops of 192 (the 64x32 images padded) make a step slow enough (about 0.17 s) to signal a run in the middle of an
# epoch.
SLOW_ARGS = [a if a != "32" else "192" for a in TRAIN_ARGS]


@pytest.fixture(scope="session")
def data24(tmp_path_factory):
    """24 train images: 6 steps an epoch with 2 processes of 2 images."""
    return built_once(tmp_path_factory, "data24", lambda root: write_synthetic(root, num_train=24, num_val=3,
                                                                                size=(64, 32), seed=4))


class ForkedRank(NamedTuple):
    """One rank that fork_ranks started."""
    process: multiprocessing.process.BaseProcess  # .pid, .join(timeout), .exitcode, .kill()
    output: str  # the file its stdout and stderr go to


def _run_rank(argv, environment, output, own_group=False, program="main"):
    """A forked rank's life: its own variables and files (and process group, own_group: as a shell starts a
    command), main(argv) of the module program (main.py's, predict.py's, or a lesson this process imported:
    test_lesson), then os._exit with its status, at once:
    the child is a copy of pytest, none of whose exit code may run there, and multiprocessing's own ending would
    wait for any non-daemon thread left running. (A fork that ended Python's normal way would also hang there:
    faulthandler's timer, which pytest.ini arms around each test, waits at exit for its timer thread to release a
    lock, and a forked child has no such thread: seen to wait past the timer's time.)"""
    code = 1
    try:
        if own_group:
            os.setpgrp()
        os.environ.update(environment)
        import torch
        torch.set_num_threads(1)
        # pytest's capture replaced sys.stdout in the parent; the rank writes to a real file, and so does
        # whatever writes to descriptors 1 and 2 directly.
        sys.stdout = sys.stderr = open(output, "w", buffering=1)
        os.dup2(sys.stdout.fileno(), 1)
        os.dup2(sys.stdout.fileno(), 2)
        module = importlib.import_module(program)
        module.main(module.get_args_parser().parse_args(argv))
        code = 0
    except SystemExit as stop:  # as Python ends on it: None is 0, a number itself, anything else said and 1
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)


def fork_ranks(argv, outputs, world_size=2, program="main"):
    """world_size ranks of one job on this machine, each a forked copy of this process running main(argv) of the
    module program (_run_rank), with the variables a launcher gives its workers (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; none of torchrun's TORCHELASTIC_ ones) and one thread each, as run()
    gives: the job, without the seconds a fresh interpreter takes to import torch. Each rank's output goes to
    outputs/rank_N.log."""
    os.makedirs(outputs, exist_ok=True)
    context = multiprocessing.get_context("fork")
    port = str(free_port())
    ranks = []
    for rank in range(world_size):
        environment = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                       "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        output = os.path.join(outputs, f"rank_{rank}.log")
        open(output, "w").close()  # there before the rank starts: a test may read it at once
        process = context.Process(target=_run_rank, args=(argv, environment, output, False, program))
        process.start()
        ranks.append(ForkedRank(process, output))
    return ranks


def fork_main(argv, output, environment=(), own_group=False, program="main"):
    """main(argv) of the module program (main.py's, or predict.py's) in one forked copy of this process, as a program
    started by hand: a process of its own, with environment's variables added (none of a launcher's unless given),
    one thread, its output to the file output, and with own_group the leader of a process group of its own. What it
    does with signals is main.py's: a fresh interpreter would add only the seconds it takes to import torch.
    -> ForkedRank."""
    open(output, "w").close()  # there before the process starts: a test may read it at once
    process = multiprocessing.get_context("fork").Process(
        target=_run_rank, args=(argv, {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **dict(environment)},
                                output, own_group, program))
    process.start()
    return ForkedRank(process, output)


def wait_in_file(path, text, timeout=120):
    """Read a file another process writes until it holds text; -> what it held."""
    deadline = time.time() + timeout
    while True:
        with open(path) as f:
            seen = f.read()
        if text in seen:
            return seen
        assert time.time() < deadline, f"{text!r} never appeared:\n{seen}"
        time.sleep(0.05)


def finish_ranks(ranks, timeout=240):
    """Wait for fork_ranks' ranks to end; fail with what each said unless every one exited 0; -> what each said."""
    deadline = time.time() + timeout
    for rank in ranks:
        rank.process.join(timeout=max(0, deadline - time.time()))
    for rank in ranks:  # every rank ended first (one still running after the timeout killed), then their logs read
        rank.process.kill()
        rank.process.join()
    said = []
    for rank in ranks:
        with open(rank.output) as f:
            said.append(f.read())
    if any(rank.process.exitcode != 0 for rank in ranks):
        pytest.fail("".join(f"rank {number} exited {rank.process.exitcode}:\n{text}\n"
                            for number, (rank, text) in enumerate(zip(ranks, said))))
    return said


def run_sh_workers_line(data, out, *more):
    """main.py's arguments as run.sh gives them to each of its two workers on the CPU: DATA and OUTPUT_DIR,
    --resume auto, the recipe's global batch of 16 as -b 8 --accum-steps 1 --base-batch 16, then the user's (more),
    which win."""
    return ["--data", data, "--output-dir", out, "--resume", "auto", "-b", "8", "--accum-steps", "1", "--base-batch",
            "16", *more]


@pytest.fixture(scope="session")
def straight(data24, tmp_path_factory):
    """The reference: 2 epochs, 2 processes on one node, without interruption. Forked ranks on the arguments
    run.sh gives its workers (its -b and --accum-steps first, ours after): the tests that compare against it
    launch run.sh themselves."""
    logs = str(tmp_path_factory.mktemp("straight_logs"))
    return built_once(tmp_path_factory, "straight", lambda out: finish_ranks(fork_ranks(
        run_sh_workers_line(data24, out, "--epochs", "2", *SLOW_ARGS), logs)))


@pytest.fixture(scope="session")
def trained(tiny_data, tmp_path_factory):
    """A real run's output folder: one epoch on tiny_data, in-process, one process (Cityscapes' 19 classes)."""
    return built_once(tmp_path_factory, "trained", lambda out: run_main(["--data", tiny_data, "--output-dir", out,
                                                                          "--epochs", "1", *TRAIN_ARGS]))


@pytest.fixture(scope="session")
def folder_data(tmp_path_factory):
    """Your own data as synthetic.py --layout folder writes it: 8 train and 5 val JPEGs, palette masks, and
    classes.json with Cityscapes' 7 categories as the classes."""
    return built_once(tmp_path_factory, "own_data", lambda root: write_synthetic(
        root, num_train=8, num_val=5, size=(64, 32), seed=3, layout="folder"))


@pytest.fixture
def previous_run(tmp_path):
    """An output folder holding a finished run's files (small stand-ins)."""
    out = tmp_path / "out"
    (out / "vis").mkdir(parents=True)
    for name in ("checkpoint.pth", "best.pth", "metrics.jsonl", "vis/epoch_000.png"):
        (out / name).write_bytes(f"the previous run's {name}".encode())
    return str(out)


def fingerprints(*folders):
    """{folder: fingerprint(folder)} of each folder: what a test compares before and after."""
    return {folder: fingerprint(folder) for folder in folders}


def own_data(tmp_path, masks, names=("background", "cat"), ignore=255, image_size=(6, 4), suffix=".png"):
    """A folder data set: for each split, images of image_size and these masks (lists of rows)."""
    import numpy as np
    from PIL import Image
    root = tmp_path / "own"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "masks" / split).mkdir(parents=True)
        for i, mask in enumerate(masks):
            Image.new("RGB", image_size, (100, 120, 140)).save(root / "images" / split / f"x{i}{suffix}")
            Image.fromarray(np.array(mask, np.uint8)).save(root / "masks" / split / f"x{i}.png")
    (root / "classes.json").write_text(json.dumps({"names": list(names), "ignore_index": ignore}))
    return str(root)
