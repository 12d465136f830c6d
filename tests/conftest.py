import os
import signal
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dataset import write_synthetic  # noqa: E402

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


def run(command, env=None, timeout=240):
    """Run a command in the repository root, on the CPU with one thread per process; fail with its output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    result = subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr
