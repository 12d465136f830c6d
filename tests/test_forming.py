"""The process group while it forms (recovery.start_heartbeat): an interface that is not there, and torchrun's restarts,
whose store outlives an attempt. Each attempt ends or goes on with at most one line, never a traceback, and no rank
waits for an address an earlier attempt left."""
import os
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from harness import errors, job, recovery
from conftest import ROOT, TRAIN_ARGS, cpu_env, free_port

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


@pytest.mark.launch
def test_an_interface_that_is_not_here_is_said_once_before_any_wait_and_not_restarted(tiny_data, tmp_path):
    """GLOO_SOCKET_IFNAME naming no interface of this machine, under torchrun with a restart: one line (the variable,
    its value, the interfaces there are, what to do) by rank 0, not by every rank, not again by the restart, and
    no traceback of gloo's."""
    here = ", ".join(name for _, name in socket.if_nameindex())
    process = _torchrun(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS],
                        {"GLOO_SOCKET_IFNAME": "nosuch0"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = process.communicate(timeout=120)[0]
    assert process.returncode != 0
    errors_said = [line for line in output.splitlines() if "main.py: error:" in line]
    assert errors_said == [f"main.py: error: rank 0: GLOO_SOCKET_IFNAME='nosuch0' names 'nosuch0', no network "
                           f"interface of this machine (it has {here}): set it to the one the ranks reach each other "
                           f"through (a comma-separated list for several), or unset it"], output
    assert "Unable to find address" not in output and "waiting" not in output, output
    _no_traceback_but_torchrun_s(output)
