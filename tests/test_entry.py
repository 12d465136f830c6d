"""Every program enters through one guard: the temporary folder torch needs is checked as the harness is imported,
before torchvision (harness/__init__.py); the project's folder is found under python -I and PYTHONSAFEPATH; a
stop or Ctrl-C ends each program in one line (recovery.guard). Each program is started as a user starts it."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, write_synthetic

PROGRAMS = ["main.py", "predict.py", "synthetic.py", "bench.py", "harness/cache.py"]
pytestmark = pytest.mark.launch


def _started(command, env=None, cwd=ROOT, timeout=120):
    result = subprocess.run(command, cwd=cwd, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})},
                            capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def _in_a_mount_namespace(script):
    """script run by sh as root in a mount namespace of its own (unshare -m), where it may mount what it likes
    without touching this machine's mounts; skipped where that is refused (not root, a container without
    CAP_SYS_ADMIN)."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /mnt"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unshare -m with a tmpfs mount is refused here: " + probe.stderr.decode().strip())
    # mount by its real path: PATH's links to it (conftest.py) live in the temporary folder, which script may hide
    return ["unshare", "-m", "sh", "-c", script.replace("mount ", os.path.realpath(shutil.which("mount")) + " ")]


@pytest.mark.parametrize("program", PROGRAMS)
def test_each_program_finds_its_modules_under_python_minus_I_and_says_an_unusable_tmpdir_before_torchvision(program,
                                                                                                          tmp_path):
    """Started from another folder under python -I (main.py, predict.py) or PYTHONSAFEPATH=1 (the others; both are
    the same path rule), each program finds the harness (not "No module named 'harness'"), whose import says that
    TMPDIR cannot be used: one line, before torchvision loads. The others run as a second machine's first process
    (RANK 3, LOCAL_RANK 0): its temporary folder is its own, so it says the line itself, though its RANK is 3."""
    isolated = program in ("main.py", "predict.py")
    command = [sys.executable, *(["-I"] if isolated else []), os.path.join(ROOT, program), "--help"]
    gone = tmp_path / "gone"
    environment = {"TMPDIR": str(gone), **({} if isolated else {"PYTHONSAFEPATH": "1", "RANK": "3", "LOCAL_RANK": "0"})}
    status, said = _started(command, environment, cwd=tmp_path)
    assert status == 1 and said.strip().splitlines() == [
        f"{program}: error: TMPDIR={gone} cannot be used (No such file or directory): set TMPDIR to a folder of this "
        "machine you can write"], said


@pytest.mark.parametrize("mounts, expect", [
    # Kubernetes' readOnlyRootFilesystem with TMPDIR unset: every place tempfile looks is read-only.
    # The project read-only too (tempfile's last resort is the current folder), at /mnt: a clone in /tmp is hidden.
    (f"mount --bind {ROOT} /mnt; mount -o remount,bind,ro /mnt; P=/mnt; unset TMPDIR; "
     "for d in /tmp /var/tmp /usr/tmp; do [ -d $d ] && mount -t tmpfs -o ro tmpfs $d; done",
     "main.py: error: no folder for temporary files can be written (/tmp: Read-only file system; TMPDIR unset), "
     "and PyTorch needs one: set TMPDIR to a folder of this machine you can write (a read-only root filesystem: "
     "mount a writable volume at /tmp)"),
    ("mount -t tmpfs -o size=64k tmpfs /mnt && head -c 1M /dev/zero > /mnt/fill 2>/dev/null; export TMPDIR=/mnt",
     "main.py: error: TMPDIR=/mnt cannot be used (No space left on device): free space there, or set TMPDIR to a "
     "folder of this machine you can write"),
])
def test_a_temporary_folder_torch_cannot_use_is_said_in_one_line(mounts, expect):
    command = _in_a_mount_namespace(f'{mounts}; cd "${{P:-{ROOT}}}" && exec "$0" main.py --help')
    status, said = _started(command[:-1] + [command[-1], sys.executable])
    assert status == 1 and said.strip().splitlines() == [expect], said


def test_run_sh_names_a_full_tmpdir_not_the_python_install():
    command = _in_a_mount_namespace("mount -t tmpfs -o size=64k tmpfs /mnt && head -c 1M /dev/zero > /mnt/fill "
                                    f"2>/dev/null; TMPDIR=/mnt NPROC=1 exec {ROOT}/run.sh --epochs 1")
    environment = dict(os.environ)
    environment.pop("CUDA_VISIBLE_DEVICES", None)  # (hidden GPUs: run.sh counts none, and makes no folder there)
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120)
    status, said = result.returncode, result.stdout + result.stderr
    assert status == 1 and said.strip().splitlines() == [
        "run.sh: error: TMPDIR=/mnt cannot be written (No space left on device): free space there, or set TMPDIR "
        "to another folder"], said


def _stopped_after(command, line, signum, made=None):
    """command started as from a terminal: a session of its own, SIGINT at its default (a suite run in the
    background of a script ignores it, and so would the command); signum sent to all its processes (a terminal's
    Ctrl-C reaches every one) once it printed a line holding line, or made has something in it.
    -> its exit status and output."""
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    said = []
    if made:
        while not os.listdir(made) and process.poll() is None:
            time.sleep(0.05)
        time.sleep(0.5)
    else:
        for each in process.stdout:
            said.append(each)
            if line in each:
                break
    os.killpg(process.pid, signum)
    said.append(process.stdout.read())
    return process.wait(timeout=60), "".join(said)


@pytest.mark.parametrize("program, signum", [("harness/cache.py", signal.SIGINT), ("bench.py", signal.SIGINT),
                                             ("synthetic.py", signal.SIGTERM)])
def test_a_stop_ends_each_tool_in_one_line_and_leaves_nothing_half_written(program, signum, tmp_path):
    data = str(tmp_path / "data")
    if program == "harness/cache.py":
        write_synthetic(data, num_train=300, num_val=2, size=(128, 64), seed=1)
        command, line = [program, str(tmp_path / "cache"), "--data", data, "-j", "2"], "100/300"
    elif program == "bench.py":
        command, line = [program, "--data", "--quick"], "CPU:"
    else:
        command, line = [program, data, "--num-train", "2000", "-j", "2"], None
    status, said = _stopped_after([sys.executable, "-u", *command], line, signum, made=None if line else tmp_path)
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert status == 130 and said.strip().splitlines()[-1] == f"{program}: stopped ({name})", said
    assert "Traceback" not in said, said
    if program == "synthetic.py":
        assert not os.listdir(tmp_path), os.listdir(tmp_path)  # the data set is written whole, or not at all
