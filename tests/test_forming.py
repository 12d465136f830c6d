"""The process group while it forms (recovery.start_heartbeat): an interface that is not there, torchrun's restarts,
whose store outlives an attempt, and a torchrun gone. Each attempt ends or goes on with at most one line, never a
traceback, and no rank waits for an address an earlier attempt left or a peer that will not come."""
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from harness import errors, job, recovery
from conftest import ROOT, SLOW_ARGS, TRAIN_ARGS, cpu_env, fork_main, free_port, metrics, wait_in_file

PY = sys.executable


def _torchrun(args, env=None, **kwargs):
    """Plain torchrun, not run.sh: two workers of main.py on this machine, one restart allowed."""
    return subprocess.Popen([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "--max-restarts=1", "main.py", *args], cwd=ROOT, env=cpu_env(**(env or {})),
                            text=True, **kwargs)


def _no_traceback_but_torchrun_s(output):
    """No worker's traceback: at most torchrun's own report of a failed job."""
    assert output.count("Traceback") == (1 if "ChildFailedError" in output else 0), output


def test_gloo_socket_ifname_is_read_as_torch_reads_it(monkeypatch):
    """What start_heartbeat refuses is what torch's gloo fails on, and nothing more: a value of one character is
    ignored, the list is split at commas (an empty last piece dropped), and each name must be an interface of this
    machine. Each value tried on a real gloo process group of one process."""
    here = [name for _, name in socket.if_nameindex()]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for value in (here[0], f"{here[0]},", "x", ",", f"{here[0]},nosuch0", "nosuch0", f",{here[0]}", f"{here[0]} "):
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", value)
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        job.read_environment("main.py")
        try:
            recovery.start_heartbeat(0.5)
            refused = None
        except errors.UserError as error:
            refused = str(error)
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=10))
            fails = False
        except RuntimeError:
            fails = True
        finally:
            recovery.stop_heartbeat()
            if dist.is_initialized():
                dist.destroy_process_group()
        assert (refused is not None) == fails, (value, refused)
        if refused:
            assert refused.startswith(f"GLOO_SOCKET_IFNAME={value!r} names '") and ", ".join(here) in refused, refused
    job.RUN.env = job.Environment()  # (the next test's run reads its own)


def test_an_interface_that_is_not_here_is_said_once_before_any_wait(tiny_data, tmp_path):
    """GLOO_SOCKET_IFNAME naming no interface of this machine, on two ranks: one line (the variable, its value, the
    interfaces there are, what to do) by rank 0 alone, at once, and no traceback of gloo's. (torchrun's restarts do
    not repeat a mistake: test_recovery.py's
    test_a_bad_file_on_rank_1_is_named_by_rank_1_once_and_restarts_do_not_repeat_it.)"""
    here = ", ".join(name for _, name in socket.if_nameindex())
    environment = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(free_port()), "GLOO_SOCKET_IFNAME": "nosuch0",
                   "TORCHELASTIC_RUN_ID": f"test-{os.getpid()}"}  # (where rank 1 finds rank 0's record)
    argv = ["--data", tiny_data, "--output-dir", str(tmp_path / "out"), "--dist-timeout", "300", *TRAIN_ARGS]
    ranks = [fork_main(argv, str(tmp_path / f"rank{rank}.log"), {**environment, "RANK": str(rank),
                                                                 "LOCAL_RANK": str(rank)}) for rank in (0, 1)]
    try:
        for forked in ranks:
            forked.process.join(timeout=60)
        said = [open(forked.output).read() for forked in ranks]
        assert [forked.process.exitcode for forked in ranks] == [1, 1], said
    finally:
        for forked in ranks:
            forked.process.kill()
    errors_said = [line for line in (said[0] + said[1]).splitlines() if "error:" in line]
    assert errors_said == [f"main.py: error: rank 0: GLOO_SOCKET_IFNAME='nosuch0' names 'nosuch0', no network "
                           f"interface of this machine (it has {here}): set it to the one the ranks reach each other "
                           f"through (a comma-separated list for several), or unset it"], said
    assert "Traceback" not in said[0] + said[1] and "Unable to find address" not in said[0] + said[1], said


def _serve_a_store(port):
    """A process that serves a store, as torchrun's agent does: killing it is torchrun ending."""
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    time.sleep(600)
    del store


@pytest.mark.long
def test_a_rank_whose_torchrun_has_ended_does_not_wait_for_its_peers(tiny_data, tmp_path):
    """torchrun with restarts ends (killed) while the group forms, and with it the peers it was to start. Rank 0,
    which serves the group's store itself, and rank 1, waiting for rank 0's port in torchrun's store, each end
    within seconds with one line, instead of waiting out --dist-timeout (5 minutes here) for a peer that never
    comes."""
    for rank, said in ((0, "rank 0: torchrun's store at"), (1, "rank 1: the 2 processes did not all meet")):
        port = free_port()
        agent = multiprocessing.get_context("fork").Process(target=_serve_a_store, args=(port,), daemon=True)
        agent.start()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        store.set("deeplab/store", "an earlier attempt's")
        log = str(tmp_path / f"rank{rank}.log")
        forked = fork_main(["--data", tiny_data, "--output-dir", str(tmp_path / f"out{rank}"), "--dist-timeout", "5",
                            *TRAIN_ARGS], log, {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                                                "TORCHELASTIC_MAX_RESTARTS": "1"})
        try:
            deadline = time.time() + 120  # until the rank has reached torchrun's store: rank 0 writes, rank 1 removes
            while store.check(["deeplab/store"]) and store.get("deeplab/store") == b"an earlier attempt's":
                assert time.time() < deadline, open(log).read()
                time.sleep(0.1)
            os.kill(agent.pid, signal.SIGKILL)
            forked.process.join(timeout=30)
            output = open(log).read()
            assert forked.process.exitcode == 1, output
        finally:
            forked.process.kill()
        errors_said = [line for line in output.splitlines() if "error:" in line]
        assert len(errors_said) == 1 and errors_said[0].startswith(f"main.py: error: {said}"), output
        assert "Traceback" not in output, output


def _workers(torchrun):
    """The PIDs of a torchrun's workers, local rank 0 first (started first)."""
    with open(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children") as f:
        return sorted(int(pid) for pid in f.read().split())


@pytest.mark.launch
def test_a_rank_killed_before_the_first_checkpoint_is_restarted_by_plain_torchrun_and_the_run_ends(data24, tmp_path):
    """Plain torchrun with a restart (not run.sh, which gives each attempt a store of its own): rank 1 killed
    (SIGKILL) at the first step. The restarted attempt meets, trains the epoch and ends with exit 0: no gloo
    "Connection refused" traceback, no wait for an earlier attempt's rank, and at most one line, rank 0's naming
    the lost rank."""
    out, log = str(tmp_path / "out"), tmp_path / "torchrun.log"
    with open(log, "w") as f:
        process = _torchrun(["--data", data24, "--output-dir", out, "--epochs", "1", "--dist-timeout", "1",
                             *SLOW_ARGS], stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_in_file(str(log), "epoch 0 step 1/6")
        os.kill(_workers(process)[1], 9)
        process.wait(timeout=240)
    finally:
        process.kill()
    output = log.read_text()
    assert process.returncode == 0, output
    errors_said = [line for line in output.splitlines() if "main.py: error:" in line]
    assert len(errors_said) <= 1 and all("rank 1's process is gone" in line for line in errors_said), output
    assert "Connection refused" not in output and "connectFullMesh" not in output, output
    _no_traceback_but_torchrun_s(output)
    assert [r["epoch"] for r in metrics(out)] == [0]
