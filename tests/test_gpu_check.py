"""tests/gpu_check.sh cannot drift: every command it runs parses with its program's own parser (GPU and dry-run
sizes alike), and its first step (the device and the data) runs. The rest runs on a GPU, or with --dry-run."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests"))
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


def test_its_first_step_runs(tmp_path):
    out = str(tmp_path / "check")
    result = subprocess.run(["bash", "tests/gpu_check.sh", "--dry-run", "--first-step-only", "--out", out], cwd=ROOT,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(os.path.join(out, "gpu_check.json")) as f:
        results = json.load(f)
    assert results["dry_run"] is True and "data_s" in results, results
    assert os.path.isdir(os.path.join(out, "work", "full", "leftImg8bit", "train"))
