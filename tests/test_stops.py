"""A user's stop is honoured at every moment (said where it stopped; the same command afterwards carries on or
says there is nothing to do), and a wait says what it waits for. In-process where a launcher is not the point."""
import contextlib
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import dataset
import main
from harness import checkpoints, job, paths, stops
from harness.errors import UserError
from conftest import (ROOT, TRAIN_ARGS, cpu_env, fingerprint, finish_ranks, fork_main, fork_ranks, free_port,
                      no_shared_memory_in_workers, one_error_line, processes_mentioning, run_main, wait_in_file)



def _signal_on_a_read(monkeypatch, evaluation, at=1):
    """A SIGTERM, as the scheduler sends it, when the data set is read for the at-th time (in training, or in
    evaluation)."""
    reads, read = [], dataset.SegmentationFiles.__getitem__

    def read_and_signal(self, index):
        if (self.crop_size is None) == evaluation:
            reads.append(index)
            if len(reads) == at:
                stops._on_signal(signal.SIGTERM, None)
        return read(self, index)
    monkeypatch.setattr(dataset.SegmentationFiles, "__getitem__", read_and_signal)
    return lambda: monkeypatch.setattr(dataset.SegmentationFiles, "__getitem__", read)


def test_a_stop_during_the_evaluation_and_during_the_last_ones(tiny_data, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "out")
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2", "--resume", "auto"]
    restore = _signal_on_a_read(monkeypatch, evaluation=True)
    said = run_main(common, capsys)  # the first epoch's evaluation: the epoch is finished, saved, and the run stops
    assert "stopped by signal after an epoch; saved" in said and "run the same command with --resume auto" in said
    assert checkpoints.read("--resume", os.path.join(out, "checkpoint.pth"))["epoch"] == 1
    restore()
    restore = _signal_on_a_read(monkeypatch, evaluation=True)
    # The advice followed; stopped again during the last epoch's evaluation: training is done.
    said = run_main(common, capsys)
    assert "at the start of epoch 1" in said and "training had finished, nothing is left to stop" in said, said
    assert "done: best mIoU" in said
    restore()
    run_main(common)
    assert "nothing to train" in capsys.readouterr().out


def test_a_stop_before_training_began_ends_at_once_and_writes_nothing(tiny_data, tmp_path, monkeypatch, capsys):
    check = dataset.SegmentationFiles.check_files

    def signal_while_the_data_is_checked(self, *args, **kwargs):  # a Ctrl-C during a long preflight
        stops._on_signal(signal.SIGINT, None)
        return check(self, *args, **kwargs)
    monkeypatch.setattr(dataset.SegmentationFiles, "check_files", signal_while_the_data_is_checked)
    out = tmp_path / "out"
    said = run_main(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "1"], capsys)
    assert "stopped by signal 2 before training began: nothing was trained" in said and not out.exists(), said


def test_a_stop_while_a_checkpoint_is_written_keeps_it_whole(tiny_data, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "out")
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2", "--resume", "auto"]
    save = torch.save

    def signal_in_the_middle(state, f, *args, **kwargs):
        if job.RUN.stops.signal is None:  # one signal, as the first file is written (a second would stop at once)
            stops._on_signal(signal.SIGTERM, None)
        return save(state, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", signal_in_the_middle)
    run_main(common)
    monkeypatch.setattr(torch, "save", save)
    assert "stopped by signal after an epoch" in capsys.readouterr().out
    assert checkpoints.read("--resume", os.path.join(out, "checkpoint.pth"))["epoch"] == 1  # whole: its CRC-32s good
    said = run_main(common, capsys)
    assert "at the start of epoch 1" in said and "done:" in said, said


def test_the_stop_phases_are_one_table_that_enter_alone_switches():
    """stops.PHASES says what a training run's stop signals do in each phase, and stops.enter switches them: the
    handler the table names, or, while the ranks meet, what each did before the run (one ignored stays ignored). A
    stop during the preflight's writes ends the run once they are done; restore() gives the signals back."""
    before = signal.getsignal(signal.SIGTERM)
    ignored = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as run.sh has torchrun ignore it
    earlier = {signum: signal.getsignal(signum) for signum in stops.STOP_SIGNALS}  # SIGINT: ignored in a background job
    try:
        stops.install(training=True)
        for phase, handler in stops.PHASES.items():
            stops.enter(phase)
            for signum in stops.STOP_SIGNALS:
                meeting = signal.SIG_IGN if earlier[signum] == signal.SIG_IGN else signal.SIG_DFL
                assert signal.getsignal(signum) == (handler or meeting), (phase, signum)
        stops.enter("writing")
        stops._on_signal(signal.SIGTERM, None)  # noted, not raised: the writes go on
        with pytest.raises(stops.Interrupted):
            stops.enter("preflight")
        stops.restore()
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == before
    finally:
        stops.restore()
        signal.signal(signal.SIGUSR1, ignored)


def test_a_stop_where_it_ends_the_program_at_once_is_taken_once_and_a_mistake_is_not_said_as_a_stop(monkeypatch):
    """One process (-e, predict.py, the tools): Ctrl-C and SIGTERM each end it at once, as a KeyboardInterrupt, and
    once: a second stop is ignored while it cleans up. Under a launcher (WORLD_SIZE 2) SIGTERM keeps its default, so
    that torchrun's stop after another rank failed ends a rank in a collective too. A mistake met while the
    preflight's writes defer a stop is said as the mistake, not as the stop."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stops.install(training=False)
        assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == stops._stop_now
        with pytest.raises(KeyboardInterrupt):
            stops._stop_now(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        stops.restore()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        monkeypatch.setenv("WORLD_SIZE", "2")
        stops.install(training=False)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        stops.restore()
        stops.install(training=True)
        with pytest.raises(UserError, match="a mistake"):  # (not stops.Interrupted)
            with stops.deferred():
                stops._on_signal(signal.SIGTERM, None)
                stops.fail("a mistake")
    finally:
        stops.restore()
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _start_in_its_own_group(command, env, cwd=ROOT):
    """As a terminal starts a command: its own process group, SIGINT at its default (a process started in the
    background from a script would ignore it, and so would a stop sent to it)."""
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_process(text, *more, timeout=60):
    deadline = time.time() + timeout
    while not processes_mentioning(text, *more):
        assert time.time() < deadline, f"no process with {text}"
        time.sleep(0.1)


@pytest.mark.parametrize("moment", ["counting the GPUs", "writing the synthetic set",
                                    "checking the arguments and the data"])
@pytest.mark.launch
def test_ctrl_c_while_run_sh_prepares_says_so_in_one_line_and_leaves_nothing(moment, tiny_data, tmp_path):
    out, synthetic = str(tmp_path / "out"), str(tmp_path / "synthetic")
    # Writing the synthetic set: run where there is no data/cityscapes, DATA not set (the demo's case).
    env = {**cpu_env(), "OUTPUT_DIR": out, "SYNTHETIC": synthetic} | ({} if moment.startswith("writing") else
                                                                   {"DATA": tiny_data})
    marker = {"counting the GPUs": "time.sleep(600)", "writing the synthetic set": "synthetic.py"}.get(moment,
                                                                                                     "--check-only")
    if moment == "counting the GPUs":  # a GPU driver that never answers: a stop must not wait for it
        fake = tmp_path / "python"
        fake.write_text(f'#!/bin/bash\n[ "$1" != -c ] || exec {sys.executable} -c "import time; time.sleep(600)" "$0"\n'
                        f'exec {sys.executable} "$@"\n')
        fake.chmod(0o755)
        env |= {"PYTHON": str(fake), "CUDA_VISIBLE_DEVICES": "0"}
    process = _start_in_its_own_group([os.path.join(ROOT, "run.sh")], env, cwd=str(tmp_path))
    _wait_for_process(marker, str(tmp_path))  # this test's step, not another test's (pytest -n runs two at once)
    time.sleep(1.0)  # inside Python: importing torch, or drawing scenes
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole foreground group
    output = process.communicate(timeout=20)[0]  # at once: no step is waited for
    assert process.returncode == 130 and "Traceback" not in output, output
    assert f"run.sh: stopped while {moment}" in output and "Run the same ./run.sh line again" in output, output
    assert not os.path.exists(out)  # nothing written, and no half-written data set under any name
    assert not any(".partial-" in name or name == "synthetic" for name in os.listdir(tmp_path)), os.listdir(tmp_path)
    assert not processes_mentioning(str(tmp_path))  # the step (it names the test's folder) and all else


def test_a_stop_to_the_whole_process_group_saves_and_exits_0(data24, tmp_path):
    """`timeout`, `kill -- -PGID` and schedulers signal every process of a job, the DataLoader's workers too (here
    SIGUSR1, as Slurm's --signal=USR1 sends it, and a SIGTERM right after it): they leave the stop to the training
    process, which saves where it is. main.py forked, leading a process group of its own, as a shell starts it."""
    out = str(tmp_path / "out")
    process, said = fork_main(["--data", data24, "--output-dir", out, "--epochs", "1", *TRAIN_ARGS, "-j", "1"],
                              str(tmp_path / "said.log"), own_group=True)  # a worker (the last -j wins)
    try:
        wait_in_file(said, "step 2/")
        os.killpg(process.pid, signal.SIGUSR1)
        os.killpg(process.pid, signal.SIGTERM)  # within a second: the same stop, sent again
        process.join(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.join()
    with open(said) as f:
        output = f.read()
    assert process.exitcode == 0 and "Traceback" not in output, output
    assert f"stopped by signal {int(signal.SIGUSR1)} at epoch 0 step" in output, output
    assert 2 <= checkpoints.read("--resume", os.path.join(out, "checkpoint.pth"))["step"] < 12


@pytest.mark.launch
def test_gpu_check_stopped_stops_the_commands_it_started(tmp_path):
    out = str(tmp_path / "check")
    process = _start_in_its_own_group([sys.executable, "tests/tools/gpu_check.py", "--dry-run", "--out", out],
                                      cpu_env())
    _wait_for_process(os.path.join(out, "work", "full"))  # synthetic.py writing the step's data
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=60)[0]
    assert process.returncode == 128 + signal.SIGTERM and "gpu_check: stopped by signal 15" in output, output
    time.sleep(0.5)
    assert not processes_mentioning(out)  # nothing it started runs on
    assert not any(".partial-" in name for name in os.listdir(os.path.join(out, "work")))


@pytest.mark.launch
def test_waits_for_other_nodes_and_processes_say_what_they_wait_for(tiny_data, tmp_path):
    """A node of two whose partner never comes, and rank 0 of two processes started by hand without rank 1: each
    says within seconds what it waits for, where, and when it gives up; run.sh stopped then stops at once."""
    port, alone_port = str(free_port()), str(free_port())
    node = _start_in_its_own_group(["./run.sh", "--epochs", "1", *TRAIN_ARGS], {
        **cpu_env(), "DATA": tiny_data, "OUTPUT_DIR": str(tmp_path / "nodes"), "NPROC": "1", "NNODES": "2",
        "NODE_RANK": "0", "MASTER_PORT": port, "RDZV_ID": f"wait{port}"})
    # The two ranks started by hand are forked copies of this process (main.py's waits are the point, not a fresh
    # interpreter's start).
    rank0 = fork_main(["--data", tiny_data, "--output-dir", str(tmp_path / "alone"), "--epochs", "1",
                       "--dist-timeout", "0.15", *TRAIN_ARGS], str(tmp_path / "rank0.log"),
                      {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": alone_port})
    # Rank 1 of 2 started by hand, rank 0 never: stopped while it waits, it ends at once, not after --dist-timeout.
    rank1 = fork_main(["--data", tiny_data, "--output-dir", str(tmp_path / "one"), "--epochs", "1", "--dist-timeout",
                       "10", *TRAIN_ARGS], str(tmp_path / "rank1.log"),
                      {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})
    try:
        wait_in_file(rank1.output, "waiting")
        os.kill(rank1.process.pid, signal.SIGTERM)
        rank1.process.join(timeout=10)
        assert rank1.process.exitcode == -signal.SIGTERM, rank1.process.exitcode
        seen = []
        for line in node.stdout:
            seen.append(line)
            if "run.sh: waiting" in line:
                break
        assert f"for 2 nodes to meet at 127.0.0.1:{port} (rendezvous wait{port}): 1 of 2 node(s) have joined; " \
               "torchrun gives up at" in seen[-1] and "(JOIN_TIMEOUT=600 s)" in seen[-1], "".join(seen)
        node.send_signal(signal.SIGTERM)  # as a scheduler would, to run.sh: nothing to save, torchrun stops
        rest = node.communicate(timeout=60)[0]
        assert "got SIGTERM while no worker ran: stopping torchrun; what was saved stays" in rest, rest
        rank0.process.join(timeout=60)
        with open(rank0.output) as f:
            said = f.read()
        line = next((line for line in said.splitlines() if "waiting" in line), said)
        # After 5 s (6, where a busy machine woke the waiting thread late), as the seconds it has waited.
        assert re.search(f"main.py: rank 0: waiting [56] s for the 2 processes to meet at 127.0.0.1:{alone_port} "
                         r"\(the process group\); it gives up at", line) and "(--dist-timeout 0.15 min)" in line, line
        rest = said.split(line, 1)[1]  # and at that time it does, in one line
        errors = [line for line in rest.splitlines() if "error:" in line]
        assert rank0.process.exitcode == 1 and "Traceback" not in rest and len(errors) == 1, rest
        # --dist-timeout's 9 s, not gloo's default: the seconds it waited, as it measured them (11 on a busy machine).
        assert re.match(f"main.py: error: rank 0: the 2 processes did not all meet at 127.0.0.1:{alone_port} "
                        r"within (9|10|11) s ", errors[0]), errors[0]
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        node.communicate()
        for rank in (rank0, rank1):
            rank.process.kill()
            rank.process.join()


def _descendants(pid):
    """Every process started under pid, in whatever session (run.sh's torchrun and its workers have their own): what
    Slurm counts as a job step's processes."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.launch
def test_the_slurm_script_saves_at_the_time_limit_requeues_itself_and_goes_on(data24, tmp_path):
    """docs/cityscapes.md's sbatch script, run as Slurm runs it on one node, with stand-ins for srun (it runs its
    command) and scontrol (it records what it is asked): SIGTERM to every process of the job step mid-epoch, as
    --signal=TERM@120 sends it, saves and exits 0 in every worker and in torchrun, without a traceback; run.sh
    exits STOP_STATUS and the script requeues the job. A launch: run.sh, torchrun and the signal are the point. The
    requeued job runs run.sh with a stand-in for Python that records run.sh's line and exits 0: the script does not
    requeue it again. Two ranks forked on that line carry on from the next step and finish."""
    from conftest import SLOW_ARGS
    with open(os.path.join(ROOT, "docs", "cityscapes.md")) as f:
        script = next(block for block in f.read().split("```bash\n")[1:] if block.startswith("#!/bin/bash\n#SBATCH"))
    script, out = script.split("```", 1)[0], str(tmp_path / "out")
    for line, ours in [("cd /path/to/this/repo", f"cd {ROOT}"),
                       ("export DATA=/shared/cityscapes OUTPUT_DIR=/shared/runs/r101",
                        f"export DATA={data24} OUTPUT_DIR={out}"),
                       ("  --amp --pretrained-backbone /shared/weights/resnet101-63fe2227.pth",
                        "  --epochs 1 " + " ".join(SLOW_ARGS))]:
        assert line in script, f"docs/cityscapes.md's Slurm script has no line {line!r}: change this test with it"
        script = script.replace(line, ours)
    (tmp_path / "job.sh").write_text(script)
    stand_ins, asked = tmp_path / "bin", tmp_path / "scontrol.log"
    stand_ins.mkdir()
    (stand_ins / "srun").write_text('#!/bin/bash\nexport SLURM_NODEID=0\nexec "$@"\n')  # one node: task 0 there
    (stand_ins / "scontrol").write_text(f'#!/bin/bash\nif [ "$1" = show ]; then echo 127.0.0.1; '
                                        f'else echo "$*" >> {asked}; fi\n')
    for name in ("srun", "scontrol"):
        (stand_ins / name).chmod(0o755)
    env = {**cpu_env(), "PATH": f"{stand_ins}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost"}
    job = _start_in_its_own_group(["bash", str(tmp_path / "job.sh")], env, cwd=str(tmp_path))
    seen = []
    for line in job.stdout:
        seen.append(line)
        if "epoch 0 step 2/" in line:
            break
    for pid in _descendants(job.pid):  # the step, not the batch script: Slurm's --signal without B:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    output = "".join(seen) + job.communicate(timeout=120)[0]
    assert job.returncode == 75 and "Traceback" not in output, output
    assert "stopped by signal 15 at epoch 0 step" in output, output
    assert asked.read_text() == "requeue 4242\n", output
    step = checkpoints.read("--resume", os.path.join(out, "checkpoint.pth"))["step"]
    assert 2 <= step < 6, step

    started, fake = tmp_path / "started", tmp_path / "python"  # the requeued job, its Python a stand-in
    fake.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" >> "{started}"\nexit 0\n')  # one argument a line
    fake.chmod(0o755)
    job = _start_in_its_own_group(["bash", str(tmp_path / "job.sh")], {**env, "PYTHON": str(fake)}, cwd=str(tmp_path))
    output = job.communicate(timeout=60)[0]
    assert job.returncode == 0 and asked.read_text() == "requeue 4242\n", output  # finished: not requeued again
    line = started.read_text().splitlines()  # run.sh's check first: the workers' line, then --check-only 2
    assert line[0] == os.path.join(ROOT, "main.py") and line[line.index("--check-only") + 1] == "2", line
    line = line[1:line.index("--check-only")]
    said = finish_ranks(fork_ranks(line, str(tmp_path / "logs")))[0]
    assert f"epoch 0 step {step + 1}/6" in said and "done: best mIoU" in said, said


def test_a_run_under_run_sh_takes_back_the_sigterm_its_torchrun_leaves_ignored(tiny_data, tmp_path, monkeypatch):
    """run.sh starts torchrun with SIGTERM ignored, and the workers inherit that: a program of run.sh's takes SIGTERM
    back as it starts, so that -e, the preflight and ranks still meeting end on it as anywhere else (training saves
    on it: its handler is installed after). In-process: the signal's disposition is the point."""
    monkeypatch.setenv("DEEPLAB_RUN_SH", "1")
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        run_main(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--check-only", "1"])
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
        job.RUN.env = job.Environment()  # (the next test's run reads its own)


# /dev/shm a tmpfs of 1 MiB in a mount namespace of its own (as root, or where user namespaces allow it): the rest
# of the machine keeps its own.
SMALL_DEV_SHM = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1M tmpfs /dev/shm && exec "$@"', "sh"]


def _in_a_small_dev_shm(command):
    """command run with a /dev/shm of 1 MiB (SMALL_DEV_SHM); skipped, with the reason, where this machine refuses
    a mount namespace or the mount. -> (its exit status, all it printed)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here (util-linux), to give a command a small /dev/shm of its own")
    probe = subprocess.run(SMALL_DEV_SHM + ["true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"a mount namespace with a small /dev/shm of its own is refused here ({probe.stderr.strip()})")
    result = subprocess.run(SMALL_DEV_SHM + command, cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                            timeout=120)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("how", ["killed", pytest.param("shared memory", marks=pytest.mark.launch),
                                 "a batch not handed over", "too many open files", "another cause"])
def test_a_data_worker_that_dies_or_finds_no_shared_memory_ends_in_one_line(tiny_data, tmp_path, monkeypatch,
                                                                            capsys, how):
    """A DataLoader worker killed (SIGKILL: the out-of-memory killer's signal) or short of shared memory (a small
    /dev/shm: Docker's 64 MB) ended in torch's traceback, or hung where the batch was lost in the queue's feeder
    thread. Now one line that names the cause and what to change (-j, memory, --shm-size) and keeps the checkpoint.
    The worker here kills itself; or main.py runs with a real /dev/shm of 1 MiB, where its batches of 256x256 crops
    do not fit; or torch's words for a full /dev/shm, or for another failure, are met as its batch is put on the
    queue (no_shared_memory_in_workers)."""
    argv = ["--data", tiny_data, "--output-dir", str(tmp_path / "out"), "--epochs", "1", *TRAIN_ARGS, "-j", "2"]
    if how == "shared memory":  # a fresh main.py: the mount namespace is a process's own
        code, output = _in_a_small_dev_shm([sys.executable, "main.py", *argv, "--crop-size", "256"])
        errors = [line for line in output.splitlines() if "error:" in line]
        assert code == 1 and "Traceback" not in output and len(errors) == 1, output
        [line] = errors
        assert re.search(r"shared memory \(/dev/shm, [01] MiB free\) is most likely too small", line), line
        assert "--shm-size=8g" in line and "give -j 1 or -j 0" in line, line
        assert "run the same command with --resume auto" in line, line
        return
    if how == "a batch not handed over":
        no_shared_memory_in_workers(monkeypatch)
    if how == "too many open files":  # a batch that fails in the feeder thread for another reason: said as it is
        no_shared_memory_in_workers(monkeypatch, "unable to open shared memory object </torch_4242_0> in read-write "
                                                 "mode: Too many open files (24)")  # (torch's words)
    if how == "another cause":
        no_shared_memory_in_workers(monkeypatch, "unable to open shared memory object </torch_4242_0> in read-write "
                                                 "mode: Permission denied (13)")

    def fail_in_a_worker(self, index):
        if how == "killed" and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, index)
    real = dataset.SegmentationFiles.__getitem__
    monkeypatch.setattr(dataset.SegmentationFiles, "__getitem__", fail_in_a_worker)
    before = set(multiprocessing.active_children())
    with pytest.raises(SystemExit) as stop:
        run_main(argv)
    assert stop.value.code == 1
    # Its workers have ended with main(), though the error that ended it is still held here (stop): not kept until a
    # garbage collection, which would take 5 s for each (recovery._say_record_and_exit).
    assert set(multiprocessing.active_children()) <= before
    line = one_error_line(capsys)
    if how == "killed":
        assert "a data loading worker was killed or ended unexpectedly (DataLoader worker (pid" in line, line
        assert "most likely by the out-of-memory killer" in line, line
    elif how == "too many open files":
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        most = "unlimited" if hard == resource.RLIM_INFINITY else hard
        limit = (f"this shell's open-files limit is at its most ({most}): ask for a higher one" if soft == hard else
                 f"raise this shell's open-files limit to its most (now {soft}): ulimit -Sn {most}")
        assert ("a data loading worker could not hand over a batch (unable to open shared memory object "
                f"</torch_4242_0> in read-write mode: Too many open files (24)): {limit}, or give -j 0 (no "
                "hand-over).") in line, line
    elif how == "another cause":
        assert ("a data loading worker could not hand over a batch (unable to open shared memory object "
                "</torch_4242_0> in read-write mode: Permission denied (13)): give -j 0 (no hand-over).") in line, line
    else:
        assert "shared memory (/dev/shm" in line and "--shm-size=8g" in line, line
    assert ("give -j 1 or -j 0" in line or how in ("too many open files", "another cause")) \
        and "run the same command with --resume auto" in line, line


@pytest.mark.usefixtures("on_the_cpu")
def test_the_advice_after_a_stop_continues_the_run_instead_of_starting_over(tiny_data, trained, tmp_path,
                                                                              monkeypatch, capsys):
    import dataset
    import signal
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    read = dataset.SegmentationFiles.__getitem__

    def signal_at_the_first_read(self, index):  # SIGTERM during the first step: the ranks stop one step later
        if self.crop_size is not None and job.RUN.stops.signal is None:
            stops._on_signal(signal.SIGTERM, None)
        return read(self, index)
    monkeypatch.setattr(dataset.SegmentationFiles, "__getitem__", signal_at_the_first_read)
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2"]
    best = os.path.join(out, "best.pth")
    said = run_main(common + ["--resume", best], capsys)
    assert "stopped by signal 15 at epoch 1 step 2/4" in said, said
    assert f"run the same command with --resume auto in place of --resume {best}" in said, said
    monkeypatch.setattr(dataset.SegmentationFiles, "__getitem__", read)
    stop = tmp_path / "stop"
    stop.write_text("TERM")  # run.sh writes the first signal here: a worker started (again) after it ends at once
    monkeypatch.setenv("DEEPLAB_STOP_FILE", str(stop))
    before = fingerprint(out)
    said = run_main(common + ["--resume", "auto"], capsys, code=0)
    assert "stopped before it began its work" in said and fingerprint(out) == before, said
    monkeypatch.delenv("DEEPLAB_STOP_FILE")
    said = run_main(common + ["--resume", "auto"], capsys)  # the advice, followed
    assert f"resuming from {os.path.join(out, 'checkpoint.pth')} at epoch 1 after step 2" in said, said


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("moment, target", [
    ("taking the output folder", (paths, "_open_and_lock")),
    ("checking a checkpoint's CRC-32s", (__import__("zipfile").ZipFile, "testzip")),
    ("reading a checkpoint", (torch, "load")),
    ("checking the data", (__import__("dataset"), "seen_size")),
    ("building the model", (main, "build_model")),
])
def test_a_stop_at_any_moment_before_training_ends_the_run_and_changes_nothing(moment, target, tiny_data, trained,
                                                                                tmp_path, monkeypatch, capsys):
    """The stop signal, sent to this process at that moment, ends the run there: never taken for a damaged file
    by code that catches errors (the checkpoint rewound to the one before it, a good image called unreadable)."""
    import signal
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    shutil.copy(os.path.join(out, "checkpoint.pth"), os.path.join(out, "checkpoint.prev.pth"))
    before = fingerprint(out)
    owner, name = target
    real, sent = getattr(owner, name), []

    def stopped_there(*args, **kwargs):
        if not sent:
            sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode: in here
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, stopped_there)
    run_main(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2", "--resume", "auto"])
    said = capsys.readouterr()
    assert sent and "Traceback" not in said.err, said
    assert f"stopped by signal {int(signal.SIGTERM)} before training began: nothing was trained" in said.out, said
    assert not any(word in said.out + said.err for word in ("warning", "damaged", "cannot", "error")), said
    assert fingerprint(out) == before  # no rewind, nothing set aside, the folder let go
