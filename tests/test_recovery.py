"""Nothing lost: exact resume, preemption, a killed or hung rank, bad checkpoints, a diverging loss.
Each runs main.py on the CPU with gloo: as a user would (run.sh, plain processes) where the launch or the signals
are the point, else in this process or in forked copies of it (conftest.fork_ranks, fork_main)."""
import contextlib
import gc
import json
import os
import pathlib
import pty
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import main
from harness import checkpoints, job, paths, recovery, stops
from conftest import (ROOT, SLOW_ARGS, TRAIN_ARGS, built_once, checkpoint_of, cpu_env, finish_ranks, fork_main,
                      fork_ranks, free_port, main_fails, metrics, processes_mentioning, run_main, run_sh_workers_line,
                      wait_in_file)

PY = sys.executable


def _env(data, out, **extra):
    return {"DATA": data, "OUTPUT_DIR": out, "NPROC": "2", "MASTER_PORT": str(free_port()), **extra}




def _assert_same_weights(out_a, out_b):
    a, b = checkpoint_of(out_a)["model"], checkpoint_of(out_b)["model"]
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _start(command, env):
    """Started as from a terminal: SIGINT at its default (a suite run in the background of a script would pass its
    ignored SIGINT on, and a Ctrl-C sent to run.sh would seem lost)."""
    return subprocess.Popen(command, cwd=ROOT, env={**cpu_env(), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(process, text, timeout=120):
    """Read process output until a line contains text; return what was read."""
    seen, deadline = [], time.time() + timeout
    for line in process.stdout:
        seen.append(line)
        if text in line:
            return "".join(seen)
        assert time.time() < deadline, "".join(seen)
    raise AssertionError(f"{text!r} never appeared:\n{''.join(seen)}")


def _read_terminal(terminal, text, timeout=120):
    """Read what a process prints into its terminal (pty.fork's) until a line holds text; -> all that was read."""
    seen, deadline = "", time.time() + timeout
    while text not in seen:
        assert time.time() < deadline and select.select([terminal], [], [], deadline - time.time())[0], seen
        seen += os.read(terminal, 65536).decode(errors="replace")
    return seen


def _wait_until_pending(pid, number, others, timeout=30):
    """Returns once signal `number` is pending for process pid (stopped, it takes none): its pending set in /proc.
    If it never is, or pid is gone, the assertion's message describes pid and each PID in others."""
    deadline = time.time() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/status") as f:
                pending = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
        except OSError:  # gone (reaped)
            pending, deadline = [], 0
        if any(mask >> (number - 1) & 1 for mask in pending):
            return
        if time.time() >= deadline:
            described = _described(dict.fromkeys([pid, *others]))
            raise AssertionError(f"signal {number} never reached process {pid}:\n{described}")
        time.sleep(0.02)


def _described(pids):
    """What a failed wait needs to be understood: each of pids (or "gone"), with its state (T: stopped, Z: exited and
    not yet reaped), its parent, its signals pending, blocked and ignored (bit N-1: signal N), and the start of its
    command line."""
    wanted = ("State:", "PPid:", "SigPnd:", "ShdPnd:", "SigBlk:", "SigIgn:")
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace")[:100]
            with open(f"/proc/{pid}/status") as f:
                status = " ".join(line.split(":")[0] + " " + line.split()[1] for line in f if line.startswith(wanted))
        except OSError:
            lines.append(f"{pid} gone")
            continue
        lines.append(f"{pid} {status} {argv}")
    return "\n".join(lines)


def _exit_status(pid, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"still running after {timeout} s")


def _workers(out):
    """PIDs of the main.py workers (not torchrun, not run.sh's check) writing to out."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"main.py") for a in argv) and out.encode() in argv \
                and not any(b"torch.distributed.run" in a for a in argv) and b"--check-only" not in argv:
            pids.append(int(pid))
    return pids


@pytest.mark.launch
def test_preempted_mid_epoch_resumes_at_next_batch_and_matches(data24, straight, tmp_path):
    """A job stopped twice mid-epoch (a scheduler's signal, then its terminal closing) goes on from the next batch
    each time, and ends with the weights of the straight run. Launches: run.sh, torchrun and the signals they take
    and pass on are the point."""
    out = str(tmp_path / "out")
    env = _env(data24, out)
    # SIGUSR1, as Slurm's --signal=USR1@120 sends it, to one worker and to torchrun (the other worker gets none: the
    # ranks' vote carries it): every rank stops at the same step, rank 0 saves; torchrun, which run.sh starts with
    # SIGUSR1 ignored, is not killed by it, and ends with its workers.
    process = _start(["./run.sh", "--epochs", "2", *SLOW_ARGS], env)
    _wait_for(process, "epoch 0 step 2/6")
    for pid in [max(_workers(out))] + [pid for pid in processes_mentioning(out) if pid not in _workers(out)
                                       and b"torch.distributed.run" in open(f"/proc/{pid}/cmdline", "rb").read()]:
        os.kill(pid, signal.SIGUSR1)
    log = process.communicate(timeout=120)[0]
    assert process.returncode == 0, log
    assert "stopped by signal" in log and "To resume, run the same ./run.sh line again" in log
    first = checkpoint_of(out)
    assert first["epoch"] == 0 and 2 <= first["step"] < 6, log
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # no epoch finished yet

    # The terminal run.sh runs in closes (SIGHUP to run.sh, the session's leader; every write to it fails from then
    # on): run.sh passes it on, the workers save, and nothing fails (no restart is allowed, so none is needed).
    pid, terminal = pty.fork()
    if pid == 0:  # run.sh in a terminal of its own
        # SIGHUP at its default, as a terminal's shell has it. A pytest started under nohup ignores SIGHUP, and
        # bash cannot trap a signal that was ignored when it started: run.sh would not pass the hang-up on.
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.chdir(ROOT)
        os.execve("./run.sh", ["./run.sh", "--epochs", "2", "--resume", "auto", *SLOW_ARGS],
                  {**cpu_env(), **env, "MASTER_PORT": str(free_port()), "MAX_RESTARTS": "0"})
    try:
        log = _read_terminal(terminal, f"epoch 0 step {first['step'] + 1}/6")  # the next unseen batch, not step 1
        assert "epoch 0 step 1/6" not in log
        workers = _workers(out)  # (looked up before the line below: once it appears, every millisecond counts)
        _read_terminal(terminal, "epoch 1 step 1/6")
        # The workers paused while the terminal closes and run.sh passes SIGHUP on, and let go once it is theirs. A
        # stop that comes during a step acts at the end of the next step or the one after (stops.ranks_vote_to_stop),
        # and on a fast machine the epoch's last 5 steps take about 0.1 s each: without the pause, the epoch could
        # end before the signal has come through run.sh.
        for worker in workers:
            os.kill(worker, signal.SIGSTOP)
        os.close(terminal)
        for worker in workers:
            _wait_until_pending(worker, signal.SIGHUP, [pid, *processes_mentioning(out)])
            os.kill(worker, signal.SIGCONT)
        assert _exit_status(pid, timeout=120) == 0
    finally:  # (torchrun and its workers, in a session of their own, go with the test's folder: conftest)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    second = checkpoint_of(out)
    assert second["epoch"] == 1 and 2 <= second["step"] < 6, second["step"]

    # The end of the run: the workers' line (run.sh's -b and --accum-steps first) in forked ranks; run.sh's part, the
    # stops and the resume after each, is above.
    log = finish_ranks(fork_ranks(run_sh_workers_line(data24, out, "--epochs", "2", *SLOW_ARGS),
                                  str(tmp_path / "logs")))[0]
    assert f"epoch 1 step {second['step'] + 1}/6" in log
    _assert_same_weights(straight, out)  # two interruptions, the same weights as no interruption
    for mine, reference in zip(metrics(out), metrics(straight), strict=True):
        assert mine["miou"] == reference["miou"] and mine["lr"] == reference["lr"]
        assert mine["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-6)  # summed in two parts


@pytest.mark.long
def test_second_signal_exits_at_once(data24, tmp_path):
    """main.py's signal handlers in a process of its own (forked), which the second signal ends by its default
    action."""
    # A stop joins the vote of the step it came in (or the next, if that vote was cast), and the vote is read at the
    # end of the step after (stops.ranks_vote_to_stop): it acts a step or two later. Crops of 640 and 4 batches a
    # step: a step of about 3 s with the tests' tiny model on a fast 2-core Xeon (4 forwards of about 0.8 s), so that
    # the second signal, 1.5 s after the first, comes before the first acts (with 640 alone, a step of about 1 s
    # there, it did not always).
    slow = [a if a != "32" else "640" for a in TRAIN_ARGS] + ["--accum-steps", "4"]
    out = str(tmp_path / "out")
    process, output = fork_main(["--data", data24, "--output-dir", out, "--epochs", "50", *slow],
                                str(tmp_path / "said.log"))
    try:
        wait_in_file(output, "step 1/")
        os.kill(process.pid, signal.SIGUSR2)  # noted, as every stop signal (its default would end the process at once)
        # A repeat counts as the same signal (a launcher passing it on) when the two handlers run within 1 s of each
        # other: sent 1.5 s apart, the second still counts as a second signal unless the first handler is delayed
        # 0.5 s or more longer than the second (a slow operation, a core shared).
        time.sleep(1.5)
        os.kill(process.pid, signal.SIGTERM)
        process.join(timeout=60)
        with open(output) as f:
            assert process.exitcode == -signal.SIGTERM, f.read()
    finally:
        process.kill()
        process.join()
    assert not os.path.exists(os.path.join(out, "checkpoint.pth"))


def test_resume_with_another_number_of_processes(data24, straight, tmp_path, capfd):
    out = str(tmp_path / "out")  # epoch 0 done by 2 processes: 6 steps an epoch
    os.makedirs(out)
    shutil.copy(os.path.join(straight, "checkpoint.prev.pth"), os.path.join(out, "checkpoint.pth"))
    # in this process: 1 process, 12 steps an epoch
    run_main(["--data", data24, "--output-dir", out, "--epochs", "2", "--resume", "auto", *SLOW_ARGS])
    log = capfd.readouterr().out
    assert "a global batch of 4 (2 process(es) x -b 2 x --accum-steps 1)" in log and "not bitwise" in log
    records = metrics(out)
    assert [r["epoch"] for r in records] == [1] and records[0]["world_size"] == 1
    # The schedule continues at its position: epoch 1's last step is step 23 of 24.
    assert records[0]["lr"] == pytest.approx(0.1 * (1 - 23 / 24) ** 0.9)  # the default --lr


@pytest.fixture(scope="module")
def killed_twice(data24, tmp_path_factory):
    """One launch for the two kill tests, made once for the whole run (conftest.built_once): run.sh on two processes
    for 2 epochs, MAX_RESTARTS=2, and SIGKILL to a worker twice, mid-epoch 1: rank 0's, then, once torchrun has
    restarted both and they have resumed from epoch 0's checkpoint, rank 1's (each named by the other, in its own
    attempt). -> (exit status, all it printed, its output folder, the workers' GLOO_SOCKET_IFNAME)."""
    def kill_twice(folder):
        out = os.path.join(folder, "out")
        process = _start(["./run.sh", "--epochs", "2", "--dist-timeout", "0.15", *SLOW_ARGS],
                         _env(data24, out, MAX_RESTARTS="2"))
        try:
            log = ""
            for rank in (0, 1):  # the line read after the first kill is the restarted attempt's
                log += _wait_for(process, "epoch 1 step 2/6")
                workers = sorted(_workers(out))
                assert len(workers) == 2, (workers, log)
                with open(f"/proc/{workers[rank]}/environ", "rb") as f:  # (gloo's interface, as run.sh set it)
                    pathlib.Path(folder, "gloo").write_bytes(b"".join(
                        v.split(b"=", 1)[1] for v in f.read().split(b"\0") if v.startswith(b"GLOO_SOCKET_IFNAME=")))
                os.kill(workers[rank], signal.SIGKILL)  # torchrun starts local rank 0 first: the lower PID
            log += process.communicate(timeout=180)[0]
        finally:  # (conftest's clean-up knows a test's own folder, not this one)
            process.kill()
            for pid in processes_mentioning(out):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        pathlib.Path(folder, "said.log").write_text(log)
        pathlib.Path(folder, "status").write_text(str(process.returncode))
    folder = pathlib.Path(built_once(tmp_path_factory, "killed_twice", kill_twice))
    return (int((folder / "status").read_text()), (folder / "said.log").read_text(), str(folder / "out"),
            (folder / "gloo").read_text())


@pytest.mark.launch
def test_torchrun_restarts_a_killed_worker_and_the_run_finishes(killed_twice):
    """A worker of run.sh's two killed mid-epoch, twice (killed_twice: rank 0's, then rank 1's): torchrun restarts
    the workers each time, and they resume and finish, each epoch once. A launch: run.sh's torchrun and its
    restarts are the point."""
    status, log, out, gloo = killed_twice
    assert status == 0, log
    assert "restart 1 by torchrun" in log and "restart 2 by torchrun" in log, log
    assert gloo == "lo"  # one machine: the workers' gloo connections on the loopback alone (run.sh)
    assert [r["epoch"] for r in metrics(out)] == [0, 1]  # each epoch once, none lost
    assert checkpoint_of(out)["epoch"] == 2  # the final checkpoint is after the last epoch


def _assert_named_gone(error, killed):
    """An error line by the rank that outlived the killed one, naming it as gone, not as alive or stuck."""
    assert error.startswith(f"main.py: error: rank {1 - killed}: a collective failed"), error
    assert f"rank {killed}'s process is gone (killed, or it failed" in error, error
    assert "alive" not in error and "never reported" not in error, error


@pytest.mark.launch
def test_a_killed_rank_is_named_gone_by_the_rank_that_outlives_it(killed_twice):
    """SIGKILL to a worker of run.sh's two mid-epoch (killed_twice): once rank 0's, then, in the restarted attempt,
    rank 1's. Each time the other rank names it as gone, once, from its heartbeat, before torchrun stops it to
    restart both. (The store the ranks met at is torchrun's agent's, not rank 0's.) A launch: run.sh's torchrun is
    the point."""
    _, log, _, _ = killed_twice
    errors = [line for line in log.splitlines() if line.startswith("main.py: error:")]
    assert len(errors) == 2, log  # one for each kill, none from the workers torchrun stopped
    _assert_named_gone(errors[0], killed=0)
    _assert_named_gone(errors[1], killed=1)
    # each in its own attempt: the first before torchrun's first restart, the second after it
    assert log.index(errors[0]) < log.index("restart 1 by torchrun") < log.index(errors[1]), log


@pytest.mark.long
def test_a_hung_peer_ends_the_job_naming_the_rank(data24, tmp_path):
    """Two ranks (forked: which launcher started them is not the point); rank 1 stopped mid-epoch, alive but
    answering nothing: rank 0 names it within --dist-timeout and ends."""
    out = str(tmp_path / "out")
    ranks = fork_ranks(["--data", data24, "--output-dir", out, "--epochs", "5", "--dist-timeout", "0.15",
                        *SLOW_ARGS], str(tmp_path / "logs"))
    try:
        wait_in_file(ranks[0].output, "step 2/")
        os.kill(ranks[1].process.pid, signal.SIGSTOP)  # alive, but answers nothing: a hang
        start = time.time()
        ranks[0].process.join(timeout=60)
        assert time.time() - start < 40  # the 9 s timeout, not forever
        with open(ranks[0].output) as f:
            log = f.read()
        assert ranks[0].process.exitcode not in (0, None), log
        assert "rank 1 silent" in log and "No checkpoint was written yet: run the same command again" in log, log
    finally:
        for rank in ranks:
            rank.process.kill()  # (SIGKILL ends a stopped process too)
            rank.process.join()


def test_bad_checkpoints_get_one_clear_line_and_auto_falls_back(data24, straight, tmp_path, capfd):
    tiny_data, out = data24, str(tmp_path / "out")
    shutil.copytree(straight, out)
    path = os.path.join(out, "checkpoint.pth")
    assert checkpoint_of(out, "checkpoint.prev.pth")["epoch"] == 1  # the one before is kept

    shutil.copy(path, tmp_path / "good.pth")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS]
    result = _fails_in_process(common + ["-e", "--resume", path], capfd)
    assert path in result and "truncated" in result
    run_main(common + ["--epochs", "2", "--resume", "auto"])
    log = capfd.readouterr().out
    assert f"{path} cannot be read" in log and "checkpoint.prev.pth at the start of epoch 1" in log

    result = _fails_in_process(common + ["-e", "--resume", str(tmp_path / "good.pth"), "--model",
                                         "deeplabv3_mobilenet_v3_large"], capfd)
    assert "holds a deeplabv3plus_mobilenet_tiny model" in result and "--model" in result
    checkpoint = torch.load(tmp_path / "good.pth", weights_only=True)  # as if trained on 21 classes
    checkpoint["model"]["classifier.weight"] = torch.zeros(21, 32, 1, 1)
    checkpoint["args"].pop("model")
    checkpoint.pop("classes")  # (names for 19 beside a classifier of 21 would be refused as such, before the fit)
    torch.save(checkpoint, tmp_path / "other.pth")
    result = _fails_in_process(common + ["-e", "--resume", str(tmp_path / "other.pth")], capfd)
    assert "does not fit" in result and "classifier.weight (21, 32, 1, 1) vs (19, 32, 1, 1)" in result


def test_a_diverging_loss_stops_and_keeps_the_last_good_checkpoint(tiny_data, trained, tmp_path, capfd):
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)  # one good epoch
    with open(os.path.join(out, "checkpoint.pth"), "rb") as f:
        good = f.read()
    result = _fails_in_process(["--data", tiny_data, "--output-dir", out, "--epochs", "3", "--resume", "auto",
                                *TRAIN_ARGS, "--lr", "1e38"], capfd)
    assert "NaN or infinite" in result and "checkpoint.pth is the last good one" in result
    with open(os.path.join(out, "checkpoint.pth"), "rb") as f:
        assert f.read() == good




def _copy_data(source, tmp_path):
    target = str(tmp_path / "data")
    shutil.copytree(source, target)
    return target


def _some(root, split, kind):
    folder = os.path.join(root, "leftImg8bit" if kind == "image" else "gtFine", split)
    city = sorted(os.listdir(folder))[0]
    name = sorted(n for n in os.listdir(os.path.join(folder, city)) if n.endswith(("leftImg8bit.png", "labelIds.png")))[0]
    return os.path.join(folder, city, name)


def _fails_in_process(argv, capfd):
    """main.main() on argv must end with SystemExit(1), one 'main.py: error:' line and no traceback in all that
    this process and its DataLoader workers wrote (capfd: file descriptors 1 and 2); -> that line."""
    run_main(argv, code=1)
    captured = capfd.readouterr()
    output = captured.out + captured.err
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("main.py: error: ") and "Traceback" not in output, output
    return errors[0]


@pytest.mark.parametrize("case", ["missing folder", "no val images", "image without label", "label without image",
                                  "undecodable header", "label size", "more ranks than val images",
                                  "batch larger than a share", "sync-bn on cpu", "fp16 on cpu", "bad crop",
                                  "evaluate without resume", "missing resume"])
def test_bad_input_found_before_training_with_one_clear_line(case, tiny_data, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's rules, also on a GPU machine
    data = _copy_data(tiny_data, tmp_path)
    args = ["--check-only", "2"]
    if case == "missing folder":
        data, expect = str(tmp_path / "nowhere"), "not found"
    elif case == "no val images":
        shutil.rmtree(os.path.join(data, "leftImg8bit", "val"))
        os.makedirs(os.path.join(data, "leftImg8bit", "val", "lindau"))
        expect = "holds no *_leftImg8bit.png"
    elif case == "image without label":
        os.remove(_some(data, "train", "label"))
        expect = "have no label file"
    elif case == "label without image":
        os.remove(_some(data, "val", "image"))
        expect = "have no image"
    elif case == "undecodable header":
        with open(_some(data, "train", "image"), "r+b") as f:
            f.truncate(10)
        expect = "cannot be read as an image"
    elif case == "label size":
        from PIL import Image
        Image.new("L", (10, 10)).save(_some(data, "val", "label"))
        expect = "is 10x10 but its image is 64x32"
    elif case == "more ranks than val images":
        args, expect = ["--check-only", "6"], "6 processes but only 5 val images"
    elif case == "batch larger than a share":
        args, expect = args + ["-b", "8"], "--batch-size 8 x 2 process(es) makes a global batch of 16, more than"
    elif case == "sync-bn on cpu":
        args, expect = args + ["--sync-bn"], "--sync-bn needs CUDA"
    elif case == "fp16 on cpu":
        args, expect = args + ["--amp", "fp16"], "--amp fp16 runs on CUDA only in this program"
    elif case == "bad crop":
        args, expect = args + ["--crop-size", "1", "2", "3"], "--crop-size 1 2 3"
    elif case == "evaluate without resume":
        args, expect = args + ["-e"], "give it --resume PATH"
    else:
        args, expect = args + ["--resume", str(tmp_path / "none.pth")], "none.pth: no such file"
    out = str(tmp_path / "out")
    os.makedirs(out)
    with open(os.path.join(out, "checkpoint.pth"), "wb") as f:
        f.write(b"a good checkpoint")
    line = _fails_in_process(["--data", data, "--output-dir", out, *TRAIN_ARGS, "--overwrite", *args], capfd)
    assert expect in line, line
    with open(os.path.join(out, "checkpoint.pth"), "rb") as f:
        assert f.read() == b"a good checkpoint"  # untouched


@pytest.mark.parametrize("case", ["truncated image",  # in this process; "label values": main.py as a program
                                  pytest.param("label values", marks=pytest.mark.launch)])
def test_bad_file_found_when_read_names_it(case, tiny_data, tmp_path, capfd):
    data = _copy_data(tiny_data, tmp_path)
    if case == "truncated image":
        path = _some(data, "train", "image")
        with open(path, "r+b") as f:  # the header is whole, the pixels are not
            f.truncate(os.path.getsize(path) // 2)
    else:
        from PIL import Image
        path = _some(data, "train", "label")
        Image.new("L", (64, 32), 200).save(path)
    # -j 1: the error comes from a DataLoader worker, which wraps it in a traceback of its own.
    argv = ["--data", data, "--output-dir", str(tmp_path / "out"), "--epochs", "1", *TRAIN_ARGS, "-j", "1"]
    if case == "truncated image":
        line = _fails_in_process(argv, capfd)
    else:  # as a program: it must also exit, its worker still running when the error ends main.py (it ignores
        # SIGTERM, which multiprocessing's exit hook sends daemonic children before waiting for them: harness/recovery.py)
        result = subprocess.run([sys.executable, "main.py", *argv], cwd=ROOT, env=cpu_env(), capture_output=True,
                                text=True, timeout=120)
        output = result.stdout + result.stderr
        lines = [line for line in output.splitlines() if "error:" in line]
        assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in output, output
        line = lines[0]
    assert line.startswith("main.py: error: ") and path in line, line


# --- defects found by reading (each of these failed before harness/recovery.py) ----------------------------------

def _file_read_by_rank(root, rank, world_size=2, seed=0):
    """The training image that `rank` reads first in epoch 0 (main.py's sampler, seed and file order)."""
    from torch.utils.data.distributed import DistributedSampler
    from dataset import Cityscapes
    train_set = Cityscapes(root, "train")
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    return train_set.images[next(iter(sampler))]


@pytest.mark.launch
def test_a_bad_file_on_rank_1_is_named_by_rank_1_once_and_restarts_do_not_repeat_it(data24, tmp_path):
    """A launch: run.sh's torchrun, its report and its restarts are the point."""
    data = _copy_data(data24, tmp_path)
    path = _file_read_by_rank(data, rank=1)
    with open(path, "r+b") as f:  # the header is whole (run.sh's check passes), the pixels are not
        f.truncate(os.path.getsize(path) // 2)
    out = str(tmp_path / "out")
    start = time.time()
    result = subprocess.run(["./run.sh", "--epochs", "1", *TRAIN_ARGS], cwd=ROOT, capture_output=True, text=True,
                            env={**cpu_env(), **_env(data, out, MAX_RESTARTS="1")}, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    errors = [line for line in output.splitlines() if "main.py: error:" in line]
    assert len(errors) == 1, output  # said once: not by rank 0 as a lost peer, not again by each restart
    assert errors[0].startswith("main.py: error: rank 1: ") and path in errors[0], output
    assert output.index(errors[0]) < output.index("ChildFailedError"), output  # the program's line first
    assert output.count("Traceback") == 1 and "torch/distributed/run.py" in output, output  # torchrun's report only
    # No restart waits for the 5-minute --dist-timeout (as a rank waiting for the failed one would): the whole run,
    # restart included, takes about 30 s alone on 2 cores and about 40 s beside another test's processes (pytest -n 2).
    assert time.time() - start < 150, output


@pytest.mark.long
def test_a_resumed_epoch_uses_the_persistent_workers_and_no_others(data24, straight, tmp_path):
    """A run resumed in the middle of an epoch trains with -j workers, not -j more, and evaluation's
    workers do not stay beside the training ones. A process of its own (forked): its children are its DataLoaders'
    workers alone."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    checkpoint = checkpoint_of(straight, "checkpoint.prev.pth")  # epoch 0 done, by 2 processes of 2 images
    checkpoint["step"], checkpoint["world_size"], checkpoint["batch_size"] = 2, 1, 2  # as if one stopped at step 2
    torch.save(checkpoint, os.path.join(out, "checkpoint.pth"))
    process, output = fork_main(["--data", data24, "--output-dir", out, *SLOW_ARGS, "-j", "2", "--epochs", "3",
                                 "--resume", "auto"], str(tmp_path / "said.log"))
    counts, read = {}, 0
    try:
        while process.exitcode is None:  # each line's count of children, taken as soon as the line is seen
            with open(output) as f:
                lines = f.read().split("\n")[:-1]  # whole lines
            try:
                with open(f"/proc/{process.pid}/task/{process.pid}/children") as f:
                    children = len(f.read().split())
            except OSError:  # ended meanwhile
                break
            for line in lines[read:]:
                for epoch in (1, 2):
                    if line.startswith(f"epoch {epoch} step ") and not line.startswith(f"epoch {epoch} step 12/"):
                        counts.setdefault(epoch, []).append(children)
            read = len(lines)
            time.sleep(0.01)
        process.join(timeout=120)
    finally:
        process.kill()
        process.join()
    assert process.exitcode == 0
    assert counts[1][0] == 2 and max(counts[1]) == 2, counts  # the resumed epoch starts at step 3, 2 workers
    assert max(counts[2]) == 2, counts


def test_the_previous_checkpoint_keeps_its_folder_name(tmp_path):
    folder = tmp_path / "runs.pth" / "x"  # a folder whose name ends like a checkpoint's
    folder.mkdir(parents=True)
    path = str(folder / "checkpoint.pth")
    assert checkpoints.previous_path(path) == str(folder / "checkpoint.prev.pth")
    for epoch in (1, 2):
        main.save_checkpoint({"epoch": epoch}, path)
    assert torch.load(str(folder / "checkpoint.prev.pth"), weights_only=True)["epoch"] == 1


def test_only_collective_failures_are_taken_for_a_lost_peer(tmp_path):
    import torch.distributed as dist
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:21908: "
                        "Connection reset by peer")
    assert recovery.is_collective_failure(gloo)
    assert recovery.is_collective_failure(dist.DistBackendError("NCCL error: unhandled system error"))
    assert recovery.is_collective_failure(dist.DistStoreError("Socket Timeout"))
    for other in ("CUDA error: peer access is not supported between these two devices",
                  "DataLoader timed out after 30 seconds", "connection to the metrics server was refused"):
        assert not recovery.is_collective_failure(RuntimeError(other)), other
    # gloo's timeout as DDP's buffer broadcast meets it: no gloo file named, raised by a call from
    # torch.distributed's code into C++ (here torch.empty(-1) stands in for the collective)...
    ddp = tmp_path / "torch" / "nn" / "parallel" / "distributed.py"
    ddp.parent.mkdir(parents=True)
    for source, expect in (("import torch\ntorch.empty(-1)\n", True),
                           # ... but DDP's own errors, raised by its Python, are mistakes, not a lost peer
                           ("raise RuntimeError('Expected to have finished reduction in the prior iteration')\n", False)):
        ddp.write_text(source)
        with pytest.raises(RuntimeError) as raised:
            exec(compile(source, str(ddp), "exec"))
        assert recovery.is_collective_failure(raised.value) == expect, source


@pytest.mark.launch
def test_a_mistake_every_rank_meets_under_torchrun_is_said_once(tiny_data, tmp_path):
    """The general rule, without run.sh's check in front: a flag mistake meets every rank; rank 0 says it, once,
    before torchrun stops the ranks still running. A launch: torchrun's ending of the other ranks is the point.
    (torchrun's restarts do not say a mistake again: the record that ends them is the same one,
    test_a_bad_file_on_rank_1_is_named_by_rank_1_once_and_restarts_do_not_repeat_it.)"""
    result = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "main.py",
                             "--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS,
                             "--amp", "fp16"], cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    errors = [line for line in output.splitlines() if "main.py: error:" in line]
    mistake = "--amp fp16 runs on CUDA only in this program; on the CPU use --amp bf16 or no --amp"
    # Rank 0 says it; rank 1 does, marked, only where rank 0 had not within RANK_0_SAYS_IT_S (a loaded machine).
    assert errors in ([f"main.py: error: {mistake}"], [f"main.py: error: rank 1: {mistake}"]), output


def test_a_rank_waits_for_rank_0_to_say_a_mistake_every_rank_finds_and_says_it_when_rank_0_does_not(tmp_path,
                                                                                                       monkeypatch,
                                                                                                       capsys):
    """Rank 1 of 2 meets a mistake that every rank finds alike (rank 0's to say): it ends only once rank 0 has said
    it (its record), so that torchrun does not stop rank 0 first, before it said it
    (test_a_mistake_every_rank_meets_under_torchrun_is_said_once failed so); with no record, rank 1 says it after
    RANK_0_SAYS_IT_S, and another rank nothing; a stop while it waits ends it quietly. In-process: the waiting is
    the point."""
    monkeypatch.setattr(recovery, "RANK_0_SAYS_IT_S", 1.0)
    monkeypatch.setattr(job.RUN, "env", job.Environment(rank=1, world_size=2, local_rank=1, run_id="test"))
    for rank_0_says_it in (True, False):
        monkeypatch.setattr(job.RUN, "guard", job.Guard(output_dir=str(tmp_path / str(rank_0_says_it))))
        if rank_0_says_it:  # rank 0's record, 0.3 s later, as _say_record_and_exit writes it
            writer = threading.Timer(0.3, _write_stop_record, ("test", time.time() + 0.3, "--lr nan must be above 0"))
            writer.start()
        start = time.monotonic()
        with pytest.raises(SystemExit) as exit_info:
            recovery._say_record_and_exit("--lr nan must be above 0", say_it=False)
        took, said = time.monotonic() - start, capsys.readouterr().err
        assert exit_info.value.code == 1
        if rank_0_says_it:
            writer.join()
            assert 0.3 <= took < 1.0 and said == "", (took, said)  # until rank 0's record, and nothing said
        else:
            assert took >= 1.0 and said == "main.py: error: rank 1: --lr nan must be above 0\n", (took, said)
            assert recovery._stop_records()[0][1]["message"] == \
                "rank 1: --lr nan must be above 0"  # recorded: torchrun's restarts do not say it again
    # Rank 2 of 3, with no record either: rank 1 says it, rank 2 nothing.
    monkeypatch.setattr(job.RUN, "env", job.Environment(rank=2, world_size=3, local_rank=2, run_id="test"))
    monkeypatch.setattr(job.RUN, "guard", job.Guard(output_dir=str(tmp_path / "rank 2")))
    with pytest.raises(SystemExit) as exit_info:
        recovery._say_record_and_exit("--lr nan must be above 0", say_it=False)
    assert exit_info.value.code == 1 and capsys.readouterr().err == ""
    # A stop while it waits (torchrun stops every worker once one has failed): exit 1, nothing said, no traceback.
    def stopped():
        raise stops.Interrupted(signal.SIGTERM)
    monkeypatch.setattr(recovery, "_peer_stopped_on_a_mistake", stopped)
    monkeypatch.setattr(job.RUN, "env", job.Environment(rank=1, world_size=2, local_rank=1, run_id="test"))
    monkeypatch.setattr(job.RUN, "guard", job.Guard(output_dir=str(tmp_path / "stopped")))
    with pytest.raises(SystemExit) as exit_info:
        recovery._say_record_and_exit("--lr nan must be above 0", say_it=False)
    assert exit_info.value.code == 1 and capsys.readouterr().err == ""


def _write_stop_record(run_id, when, message):
    """A record as _say_record_and_exit writes it."""
    path = pathlib.Path(recovery._stop_files()[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run_id": run_id, "time": when, "message": message}))


def test_a_record_is_this_jobs_by_its_run_id_and_time(tmp_path, monkeypatch):
    """A run id can repeat from job to job (run.sh on several nodes passes --rdzv-id deeplab unless RDZV_ID is set),
    so a record is this job's when it has this job's run id and was written after this node's torchrun agent
    started (read from /proc; here pytest's parent, checked against ps). A worker that finds this job's record
    exits at once, in a first attempt too; an earlier job's or another run id's record is left alone. Where the
    start cannot be read, only a restarted worker exits, and rank 0 of a first attempt removes the records."""
    run_id = f"test-{os.getpid()}"
    monkeypatch.setattr(job.RUN, "guard", job.Guard(output_dir=str(tmp_path)))
    monkeypatch.setattr(job.RUN, "env", job.Environment(rank=0, world_size=2, run_id=run_id))
    started = recovery._job_started()  # (pytest's parent's start, standing in for torchrun's)
    age = int(subprocess.run(["ps", "-o", "etimes=", "-p", str(os.getppid())], capture_output=True, text=True,
                             check=True).stdout)
    assert abs(started + 1 - (time.time() - age)) < 3 and started < job.RUN.guard.started - 1
    known = ((0, run_id, started - 60, False, True),  # an earlier job's: not this job's stop
             (0, run_id, job.RUN.guard.started - 1, True, True),  # this job's, written before this worker began
             (0, "another", time.time(), False, True),
             (1, run_id, started - 60, False, True),
             (1, run_id, time.time(), True, True))
    unknown = ((0, run_id, time.time(), False, False), (1, run_id, time.time(), True, True))
    for job_started, rows in ((started, known), (None, unknown)):
        monkeypatch.setattr(recovery, "_job_started", lambda: job_started)
        for restarts, its_run_id, written, ends, kept in rows:
            monkeypatch.setattr(job.RUN, "env", job.Environment(rank=0, world_size=2, run_id=run_id,
                                                                restarts=restarts))
            _write_stop_record(its_run_id, written, "a bad file")
            try:
                recovery._exit_or_clear_stop_record()
                ended = False
            except SystemExit as exit_info:
                ended = exit_info.code == 1
            assert (ended, os.path.exists(recovery._stop_files()[0])) == (ends, kept), (job_started, restarts,
                                                                                         its_run_id, written - started)
    pathlib.Path(recovery._stop_files()[0]).write_text("[]")  # a file of another kind: no record, no traceback
    recovery._exit_or_clear_stop_record()


# The layout main.py wrote before the redesign of 2026-11-30, typed out: a requeued job spans such a change.
LAYOUT_2026_11 = {"model", "optimizer", "scaler", "best_miou", "args", "world_size", "batch_size", "classes", "epoch",
                  "step", "epoch_loss_sum"}
ARGS_2026_11 = {
    "data": "data/cityscapes", "model": "deeplabv3plus_mobilenet_v3_large", "output_stride": 16,
    "pretrained_backbone": "none", "weights": None, "crop_size": [32], "scale_range": [1.0, 1.0], "color_jitter": 0.5,
    "cache_dir": None, "workers": 0, "epochs": 1, "start_epoch": 0, "batch_size": 2, "lr": 0.1, "backbone_lr": 0.1,
    "momentum": 0.9, "weight_decay": 0.0001, "print_freq": 1, "resume": "", "evaluate": False, "seed": 0,
    "output_dir": "output", "overwrite": False, "amp": None, "save_predictions": None, "tensorboard": False,
    "dist_backend": None, "dist_timeout": 5.0, "check_only": None, "sync_bn": None, "channels_last": None,
    "compile": False, "find_unused_parameters": False, "eval_scales": None, "eval_flip": False, "eval_crop": None,
    "eval_stride": None, "local_rank": 0}


def test_a_checkpoint_in_the_earlier_layout_still_resumes_evaluates_and_predicts(trained, tiny_data, tmp_path,
                                                                               capfd):
    state = torch.load(os.path.join(trained, "checkpoint.pth"), weights_only=True)
    # (batch_size now lives in args alone; the model named is the one whose weights these are: the tests' tiny one)
    old = {key: state[key] if key in state else state["args"][key] for key in LAYOUT_2026_11} | {
        "args": ARGS_2026_11 | {"model": state["args"]["model"]}}
    out = str(tmp_path / "out")
    os.makedirs(out)
    torch.save(old, os.path.join(out, "checkpoint.pth"))
    run_main(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2", "--resume", "auto"])
    assert "resuming from" in capfd.readouterr().out and checkpoint_of(out)["epoch"] == 2
    torch.save(old, os.path.join(out, "old.pth"))
    run_main(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "-e", "--resume", os.path.join(out, "old.pth")])
    with open(os.path.join(out, "eval.json")) as f:
        assert json.load(f)["num_images"] == 5
    run_main([os.path.join(tiny_data, "leftImg8bit", "val"), "--resume", os.path.join(out, "old.pth"), "-j", "0",
              "--what", "label", "--output-dir", str(tmp_path / "p")], program="predict")
    assert len(os.listdir(tmp_path / "p" / "trainIds")) == 3  # 5 images in 3 city folders


def test_the_stop_vote_is_read_one_step_late_and_never_lets_a_nan_be_saved():
    cpu, fine, nan = torch.device("cpu"), torch.tensor(0.5), torch.tensor(float("nan"))
    try:
        vote = stops.StopVote(cpu)
        assert [vote.cast(fine), vote.cast(fine)] == [None, None]
        job.RUN.stops.signal = signal.SIGTERM  # arrives during the third step
        assert vote.cast(fine) is None  # the second step's vote: nothing then
        assert vote.cast(fine) == "signal"  # the third's, read at the fourth: every rank stops there, saving it
        vote = stops.StopVote(cpu)
        vote.cast(fine)
        assert vote.cast(nan) == "nonfinite"  # ... but the step the stop is read at is voted on too: a NaN is not saved
        vote = stops.StopVote(cpu)
        vote.cast(fine)
        assert vote.cast(fine) == "signal" and vote.cast(nan) is None  # (the stop was read before this step)
        job.RUN.stops.signal = None
        vote = stops.StopVote(cpu)
        assert vote.cast(fine) is None and vote.cast(nan) is None and vote.result() == "nonfinite"  # the last step
    finally:
        job.RUN.stops.signal = None


def test_a_stop_in_the_middle_of_an_accumulation_finishes_its_step_and_resumes_bitwise(data24, tmp_path,
                                                                                       monkeypatch, capfd):
    """--accum-steps 2 in one process: a signal that comes between the two batches of an optimizer step lets the
    step finish (a stop is read after whole steps), and the resumed run ends bitwise where an uninterrupted one
    does. Resumed with another layout of the same global batch (-b 4, no accumulation), it goes on at the same
    step without a note."""
    import dataset
    common = ["--data", data24, *TRAIN_ARGS, "--accum-steps", "2", "--epochs", "1"]  # 6 steps of 2 batches of 2
    straight, out, other = (str(tmp_path / name) for name in ("straight", "out", "other"))
    run_main(common + ["--output-dir", straight])
    reads, read = [], dataset.SegmentationFiles.__getitem__

    def signal_between_two_batches(self, index):
        if self.crop_size is not None:  # a training read
            reads.append(index)
            if len(reads) == 7:  # the first image of step 1's second batch
                stops._on_signal(signal.SIGTERM, None)
        return read(self, index)
    monkeypatch.setattr(dataset.SegmentationFiles, "__getitem__", signal_between_two_batches)
    run_main(common + ["--output-dir", out])
    monkeypatch.setattr(dataset.SegmentationFiles, "__getitem__", read)
    said = capfd.readouterr().out
    assert "stopped by signal 15 at epoch 0 step 3/6" in said, said  # step 1 finished, step 2 ran, then all stopped
    assert checkpoint_of(out)["step"] == 3 and checkpoint_of(out)["args"]["accum_steps"] == 2
    shutil.copytree(out, other)
    run_main(common + ["--output-dir", out, "--resume", "auto"])
    _assert_same_weights(straight, out)
    run_main(common + ["--output-dir", other, "--resume", "auto", "-b", "4", "--accum-steps", "1"])
    said = capfd.readouterr().out
    assert "at epoch 0 after step 3" in said and "note: the checkpoint was trained" not in said, said
    assert "epoch 0 step 4/6" in said and "epoch 0 step 3/6" not in said, said


def test_the_heartbeat_goes_through_torch_s_public_store_where_the_peers_read_it(monkeypatch):
    """recovery.py names nothing private of torch.distributed: each rank's heartbeat goes into the store the process
    group met at (MASTER_ADDR:MASTER_PORT) through a public TCPStore of its own, where describe_peers reads every
    rank's. One gloo process, in this one, world size 1, whose heartbeat file is hidden: as for a rank of another
    node, the store is all there is to read."""
    from datetime import timedelta
    import torch.distributed as dist
    monkeypatch.setattr(recovery, "_read_beats", lambda group: {})  # no rank of this node's files: the store's alone
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    job.read_environment("main.py")
    recovery.start_heartbeat(0.5)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    try:
        deadline, said = time.time() + 20, ""
        while "every rank alive" not in said and time.time() < deadline:
            said = recovery.describe_peers()
            time.sleep(0.2)
        assert said.startswith("every rank alive and at the same step"), said
    finally:
        recovery.stop_heartbeat()
        dist.destroy_process_group()
        job.RUN.env = job.Environment()  # (the next test's run reads its own)


def test_the_rendezvous_state_run_sh_s_wait_reads_is_still_torch_s():
    """rendezvous.watch_rendezvous (run.sh's wait for the other nodes) unpickles torch's private _RendezvousState from
    the c10d rendezvous's store and reads its complete and participants: a torch that changes them fails here, by
    name, not as a wait that never counts a node."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    state = getattr(dynamic_rendezvous, "_RendezvousState", None)
    assert state is not None, "torch.distributed.elastic.rendezvous.dynamic_rendezvous._RendezvousState is gone"
    fields = set(vars(state()))
    assert {"complete", "participants"} <= fields, f"_RendezvousState has no complete or participants: {fields}"


@pytest.mark.launch
def test_a_program_leaves_its_objects_out_of_the_interpreter_s_last_collection(tiny_data, tmp_path, monkeypatch):
    """A run of main.py registers gc.freeze to run at exit (harness/recovery.py's guard, predict.py's too), so that
    the interpreter's collections at exit skip torch's objects. What that relies on is CPython's: atexit runs before
    those collections, and they leave frozen objects out. Shown in plain interpreters (no torch: milliseconds) by an
    unreachable cycle that says so if it is finalized: with gc.freeze registered it is not."""
    script = ("import atexit, gc, sys\n"
              "class Noisy:\n"
              "    def __del__(self):\n"
              "        sys.stdout.write('finalized')\n"
              "cycle = Noisy()\n"
              "cycle.itself = cycle\n"
              "del cycle\n")
    for frozen, said in ((False, "finalized"), (True, "")):
        # -S: no sitecustomize, not even the one conftest gives the tests' interpreters, which registers gc.freeze
        command = [sys.executable, "-S", "-c", script + ("atexit.register(gc.freeze)\n" if frozen else "")]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout == said, (frozen, result.stdout, result.stderr)
    registered = []  # recovery's own atexit replaced, not the module: whatever else registers meanwhile is not lost
    monkeypatch.setattr(recovery, "atexit", SimpleNamespace(register=registered.append, unregister=lambda f: None))
    run_main(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--check-only", "1"])
    assert registered == [gc.freeze]


@pytest.mark.parametrize("planted", ["another user's folder", "a folder others may write in", "a symbolic link"])
def test_a_distributed_run_keeps_its_records_in_tmpdir_only_in_a_folder_of_this_users_own(planted, tiny_data,
                                                                                         tmp_path, monkeypatch,
                                                                                         capsys):
    """Another user on a shared node can make any name in /tmp first. The folder where the heartbeats and a mistake's
    record are kept is this user's own, mode 700; a name taken by anything else is refused in one line as a
    distributed run starts (before its process group forms), and never written to or read from."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = tmp_path / f"deeplab-{os.getuid()}"
    assert paths.private_folder() == str(path) and stat.S_IMODE(path.stat().st_mode) == 0o700
    path.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "a symbolic link":
        path.symlink_to(elsewhere)
        why = "is a symbolic link"
    else:
        path.mkdir()
        if planted == "a folder others may write in":
            path.chmod(0o777)
            why = "may be written by other users (mode 777)"
        else:
            if os.getuid() != 0:
                pytest.skip("making a folder another user's needs root")
            os.chown(path, 4242, 4242)
            why = "belongs to another user (uid 4242)"
    assert paths.private_folder() is None
    monkeypatch.setattr(job.RUN, "env", job.Environment(rank=0, world_size=2, run_id="planted"))
    monkeypatch.setattr(job.RUN, "guard", job.Guard(output_dir=None))
    assert recovery._stop_files() == [] and recovery._peers_folder() is None
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)  # a launcher's: the run would form a process group
    line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS], capsys)
    own = "mkdir -p ~/tmp && export TMPDIR=~/tmp, then run again"
    advice = {"another user's folder": own, "a folder others may write in": f"chmod 700 {path}, or {own}",
              "a symbolic link": f"remove it (rm {path}), or {own}"}[planted]
    assert line == (f"main.py: error: {path} {why}, where this program keeps this user's records of a run (heartbeats, "
                    f"a mistake for torchrun's restarts): {advice}"), line
    assert os.listdir(elsewhere) == [] and not (tmp_path / "out").exists()


def test_a_process_killed_inside_torch_save_loses_nothing_and_the_same_command_resumes(tiny_data, trained, tmp_path,
                                                                                        monkeypatch):
    """SIGKILL (the OOM killer, a node lost) while torch.save is writing the checkpoint: the one before stays whole,
    and the same command resumes from it, doing the epoch in flight again, with nothing the killed save left behind.
    A forked process: the kill is the point."""
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    before = (out / "checkpoint.pth").read_bytes()
    real_save = torch.save

    class Dying:
        """The checkpoint's file, as torch.save writes it: the process is killed 64 KiB into it."""

        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += self.f.write(data)
            if self.written > 65536:
                self.f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return len(data)

        def flush(self):
            self.f.flush()

    def dying_save(obj, f, *args, **kwargs):
        if "checkpoint.pth." in os.path.basename(getattr(f, "name", "")):  # main.py's save, not best.pth's
            f = Dying(f)
        return real_save(obj, f, *args, **kwargs)
    command = ["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "2", "--resume", "auto"]
    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", dying_save)  # in the forked copy alone: undone here before the resume
        killed = fork_main(command, str(tmp_path / "killed.log"))
        killed.process.join(120)
    assert killed.process.exitcode == -signal.SIGKILL, pathlib.Path(killed.output).read_text()
    assert (out / "checkpoint.pth").read_bytes() == before  # the checkpoint before, whole
    assert [name for name in os.listdir(out) if name.startswith("checkpoint.pth.") and name.endswith(".tmp")]
    run_main(command)  # the same command
    assert checkpoints.read("--resume", str(out / "checkpoint.pth"))["epoch"] == 2
    assert (out / "checkpoint.prev.pth").read_bytes() == before
    assert [r["epoch"] for r in metrics(str(out))] == [0, 1]  # the killed epoch's line once, from the resumed run
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")], os.listdir(out)


def test_a_resume_that_changes_the_learning_rates_base_says_so(tiny_data, tmp_path, capsys):
    """--base-batch scales --lr with the global batch: a run resumed with another global batch (another number of
    GPUs under run.sh) goes on at another base rate, and says both."""
    out = str(tmp_path / "out")
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2", "--base-batch", "4"]
    run_main([*common, "--epochs", "1", "-b", "2"])  # 0.1 x 2/4
    capsys.readouterr()
    run_main([*common, "--resume", "auto", "-b", "4"])  # 0.1 x 4/4
    assert "note: the learning rate's base is 0.1 now, 0.05 before (--lr 0.1 x 4/4)" in capsys.readouterr().out


# --- out of memory: one line, said by the rank that ran out, no restart ----------------------------------------------
def _runs_out_of_memory(monkeypatch, when, cpu=False):
    """DeepLab's forward raises torch.OutOfMemoryError (as CUDA's allocator does; cpu: the RuntimeError the CPU's
    allocator raises) when when(calls, training) says; the device's memory reads 24 GiB, 22.5 at the peak."""
    import models
    from harness import recovery
    forward, calls = models.DeepLab.forward, []

    def forward_or_out_of_memory(self, images):
        calls.append(1)
        if when(len(calls), torch.is_grad_enabled()):
            if cpu:
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                                   "memory: you tried to allocate 2147483648 bytes. Error code 12")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(self, images)
    monkeypatch.setattr(models.DeepLab, "forward", forward_or_out_of_memory)
    monkeypatch.setattr(recovery, "memory_figures", lambda: ("GPU 0", 24.0, 22.5))


@pytest.mark.usefixtures("on_the_cpu")
def test_out_of_memory_in_a_step_or_the_evaluation_ends_in_one_line_that_says_what_to_change(tiny_data, tmp_path,
                                                                                             monkeypatch, capsys):
    common = ["--data", tiny_data, *TRAIN_ARGS, "--epochs", "1"]
    _runs_out_of_memory(monkeypatch, lambda calls, training: calls == 3)  # the third step
    line = main_fails(common + ["--output-dir", str(tmp_path / "a")], capsys)
    assert line == ("main.py: error: out of memory in a training step (-b 2 per process x --accum-steps 1, crop 32x32, "
                    "fp32; GPU 0: 24.0 GiB in all, 22.5 GiB at the peak): try --amp bf16, -b 1 --accum-steps 2 (the "
                    "same global batch), or a smaller --crop-size"), line
    assert not os.path.exists(tmp_path / "a" / "checkpoint.pth")
    _runs_out_of_memory(monkeypatch, lambda calls, training: not training)  # the first val image
    line = main_fails(common + ["--output-dir", str(tmp_path / "b"), "--amp", "bf16"], capsys)
    assert line == ("main.py: error: out of memory in the evaluation (val images whole, at full resolution, one at a "
                    "time, bf16; GPU 0: 24.0 GiB in all, 22.5 GiB at the peak): try a sliding window, --eval-crop 769 "
                    "(mmsegmentation's)"), line
    monkeypatch.setenv("DEEPLAB_RUN_SH", "1")  # the advice as run.sh's user types it; the CPU's allocator this time
    _runs_out_of_memory(monkeypatch, lambda calls, training: training, cpu=True)
    line = main_fails(common + ["--output-dir", str(tmp_path / "c"), "-b", "3", "--accum-steps", "2"], capsys)
    assert line.endswith("try --amp bf16, -b 1 --accum-steps 6 (the same global batch), or a smaller --crop-size "
                         "(after ./run.sh)"), line


@pytest.mark.usefixtures("on_the_cpu")
def test_out_of_memory_in_predict_py_ends_in_one_line(trained, tmp_path, monkeypatch, capsys):
    _runs_out_of_memory(monkeypatch, lambda calls, training: True)
    line = main_fails(["--resume", os.path.join(trained, "best.pth"), os.path.join(trained, "vis"), "-j", "0",
                       "--output-dir", str(tmp_path / "p")], capsys, program="predict")
    assert line == ("predict.py: error: out of memory in a prediction (-b 4 images of one size per forward, whole, at "
                    "full resolution, fp32; GPU 0: 24.0 GiB in all, 22.5 GiB at the peak): try --amp bf16, -b 1, or "
                    "a sliding window, --eval-crop 769 (mmsegmentation's)"), line


@pytest.mark.usefixtures("on_the_cpu")
def test_a_master_port_taken_by_another_program_is_named(tiny_data, tmp_path, monkeypatch, capsys):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": port}.items():
            monkeypatch.setenv(name, value)
        line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS], capsys)
    assert f"MASTER_PORT {port} is taken on this machine by another program (another run?): give another" in line, line


def test_a_bug_while_the_group_forms_keeps_its_traceback(tmp_path):
    """While the ranks meet, torch's failures (RuntimeErrors: gloo's own, DistError) are the "did not all meet"
    line; an error of another kind there is a bug of this program, and keeps its traceback."""
    with pytest.raises(KeyError, match="a bug"):
        with recovery.guard("main.py", main.get_args_parser().parse_args(["--output-dir", str(tmp_path)])):
            job.RUN.guard.waiting_since = time.time()  # (as start_heartbeat sets it)
            raise KeyError("a bug")
