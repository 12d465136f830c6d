"""tests/tools/gpu_check.sh cannot drift: every command it runs parses with its program's own parser (GPU and dry-run
sizes alike), its first step (the device and the data) runs, and a stop ends every command it started. The rest
runs on a GPU, or with --dry-run."""
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, processes_mentioning

sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))
import gpu_check  # noqa: E402


@pytest.mark.parametrize("mode", ["gpu", "dry"])
def test_every_command_parses_with_its_programs_parser(mode, tmp_path):
    import bench
    import main
    import predict
    import synthetic
    from harness import cache
    parsers = {"main.py": main, "run.sh": main, "predict.py": predict, "synthetic.py": synthetic,
               "harness.cache": cache, "bench.py": bench}
    checked = set()
    for name, command, env in gpu_check.plan(gpu_check.SIZES[mode], str(tmp_path), mode == "dry"):
        program = next(os.path.basename(part) for part in command if os.path.basename(part) in parsers)
        arguments = command[command.index(next(p for p in command if os.path.basename(p) == program)) + 1:]
        if program == "run.sh":  # run.sh gives main.py these, then the check's own
            arguments = ["--data", env["DATA"], "--output-dir", env["OUTPUT_DIR"], "--resume", "auto", *arguments]
        parsers[program].get_args_parser().parse_args(arguments)  # an unknown or bad flag: SystemExit here
        checked.add(program)
    assert checked == set(parsers) - {"main.py"}  # main.py, through run.sh


@pytest.mark.launch
def test_its_first_step_runs(tmp_path):
    out = str(tmp_path / "check")
    result = subprocess.run(["bash", "tests/tools/gpu_check.sh", "--dry-run", "--first-step-only", "--out", out], cwd=ROOT,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(os.path.join(out, "gpu_check.json")) as f:
        results = json.load(f)
    assert results["dry_run"] is True and "data_s" in results, results
    assert os.path.isdir(os.path.join(out, "work", "full", "leftImg8bit", "train"))


def test_a_stop_while_the_check_starts_a_command_stops_that_command_too(tmp_path):
    """A stop signal comes while the main thread is inside start(): after the command began, before it was
    recorded in RUNNING (Python runs the handler there). The check ends, and the command with it (seen: a
    synthetic.py left running when test_stops' check was stopped just after it began). Forked: the check's handler
    ends its process."""
    marker = tmp_path / "a-command"
    marker.touch()
    marker = str(marker)

    def check():
        real = gpu_check.subprocess.Popen

        def popen_then_stop(*args, **options):
            process = real(*args, **options)
            os.kill(os.getpid(), signal.SIGTERM)  # handled before Popen() has returned
            return process

        gpu_check.subprocess.Popen = popen_then_stop
        gpu_check.stop_on_signal()
        gpu_check.start(["tail", "-f", marker])  # runs until stopped
        os._exit(0)  # not reached when the stop ends the check

    process = multiprocessing.get_context("fork").Process(target=check)
    process.start()
    process.join(timeout=30)
    try:
        assert process.exitcode == 128 + signal.SIGTERM
        deadline = time.time() + 5
        while processes_mentioning(marker) and time.time() < deadline:
            time.sleep(0.05)
        assert not processes_mentioning(marker), "the command it was starting runs on"
    finally:
        for pid in processes_mentioning(marker):
            os.kill(pid, signal.SIGKILL)
