import os
import signal
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from synthetic import write_synthetic  # noqa: E402

# Tiny everything: 64x32 images, a MobileNet DeepLab, one thread per process.
TRAIN_ARGS = ["--model", "deeplabv3plus_mobilenet_v3_large", "--crop-size", "32", "-b", "2", "-j", "0",
              "--pretrained-backbone", "none", "-p", "1"]


def processes_mentioning(text):
    """PIDs of processes whose command line contains text (a test's own folder)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read() and int(pid) != os.getpid():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.fixture(autouse=True)
def no_process_left_behind(tmp_path):
    """run.sh starts torchrun in a session of its own: a test that fails or times out must not leave it,
    or its workers, running into the next tests."""
    yield
    for pid in processes_mentioning(str(tmp_path)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """8 train and 5 val images (5: divisible by neither 2 nor 3), in the official layout."""
    root = str(tmp_path_factory.mktemp("cityscapes"))
    write_synthetic(root, num_train=8, num_val=5, size=(64, 32), seed=3)
    return root


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command, env=None, timeout=240, cwd=ROOT):
    """Run a command (in the repository root), on the CPU with one thread per process; fail with its output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    result = subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


# Crops of 64 make a step slow enough (about 0.15 s) to signal a run in the middle of an epoch.
SLOW_ARGS = [a if a != "32" else "64" for a in TRAIN_ARGS]


@pytest.fixture(scope="session")
def data24(tmp_path_factory):
    """24 train images: 6 steps an epoch with 2 processes of 2 images."""
    root = str(tmp_path_factory.mktemp("data24"))
    write_synthetic(root, num_train=24, num_val=3, size=(64, 32), seed=4)
    return root


@pytest.fixture(scope="session")
def straight(data24, tmp_path_factory):
    """The reference: 2 epochs, 2 processes on one node, without interruption."""
    out = str(tmp_path_factory.mktemp("straight"))
    run(["./run.sh", "--epochs", "2", *SLOW_ARGS],
        env={"DATA": data24, "OUTPUT_DIR": out, "NPROC": "2", "MASTER_PORT": str(free_port())})
    return out


@pytest.fixture(scope="session")
def trained(tiny_data, tmp_path_factory):
    """A real run's output folder: one epoch on tiny_data, in-process, one process (Cityscapes' 19 classes)."""
    import main
    out = str(tmp_path_factory.mktemp("trained"))
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", out, "--epochs", "1",
                                                 *TRAIN_ARGS]))
    return out


@pytest.fixture(scope="session")
def folder_data(tmp_path_factory):
    """Your own data as synthetic.py --layout folder writes it: 8 train and 5 val JPEGs, palette masks, and
    classes.json with Cityscapes' 7 categories as the classes."""
    root = str(tmp_path_factory.mktemp("own_data"))
    write_synthetic(root, num_train=8, num_val=5, size=(64, 32), seed=3, layout="folder")
    return root
