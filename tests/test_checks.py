"""harness/checks.py: every number flag's range, checked after parsing and before any work, in one line."""
import os

import pytest

import main
from conftest import main_fails, one_error_line


pytestmark = pytest.mark.usefixtures("on_the_cpu")


@pytest.mark.parametrize("argv, expect", [
    (["-b", "0"], "-b/--batch-size: 0 must be at least 1"),
    (["-b", "two"], "argument -b/--batch-size: invalid int value: 'two'"),
    (["-j", "-1"], "-j/--workers: -1 must be at least 0"),
    (["--lr", "-1"], "--lr: -1 must be above 0"),
    (["--lr", "nan"], "--lr: nan must be above 0"),
    (["--momentum", "-1"], "--momentum: -1 must be at least 0 and below 1"),
    (["--momentum", "2"], "--momentum: 2 must be at least 0 and below 1"),
    (["--wd", "-1"], "--wd/--weight-decay: -1 must be at least 0"),
    (["-p", "0"], "-p/--print-freq: 0 must be at least 1"),
    (["-p", "-1"], "-p/--print-freq: -1 must be at least 1"),
    (["--seed", "-1"], "--seed: -1 must be at least 0"),
    (["--start-epoch", "-1"], "--start-epoch: -1 must be at least 0"),
    (["--epochs", "0"], "--epochs: 0 must be at least 1"),
    (["--dist-timeout", "0"], "--dist-timeout: 0 must be at least 0.1 and at most 10080"),
    (["--dist-timeout", "1e-9"], "--dist-timeout: 1e-09 must be at least 0.1 and at most 10080"),
    (["--dist-timeout", "nan"], "--dist-timeout: nan must be at least 0.1 and at most 10080"),
    (["--dist-timeout", "-5"], "--dist-timeout: -5 must be at least 0.1 and at most 10080"),
    (["--dist-timeout", "1e300"], "--dist-timeout: 1e+300 must be at least 0.1 and at most 10080"),
    (["--seed", str(2**64)], f"--seed {2**64} with --epochs 162: the sampler's seed of the last epoch (--seed + epoch) "
                             "would pass 2**64 - 1, the most torch's generators take; give a --seed of at most "
                             f"{2**64 - 162}"),
    (["--check-only", "0"], "--check-only: 0 must be at least 1"),
    (["--color-jitter", "1.5"], "--color-jitter: 1.5 must be at least 0 and at most 1"),
    (["--scale-range", "0", "2"], "--scale-range: 0 must be above 0"),
    (["--crop-size", "-8"], "--crop-size: -8 must be at least 1"),
])
def test_numbers_out_of_range_are_refused_before_any_work(argv, expect, tmp_path, capsys):
    if "two" in argv:  # not a number at all: argparse's int refuses it, with its usage line
        with pytest.raises(SystemExit) as exit_info:
            main.get_args_parser().parse_args(argv)
        assert exit_info.value.code == 2
        line = one_error_line(capsys)
    else:  # parsed with plain types; checked first thing, in one line (harness/checks.py)
        line = main_fails(["--data", str(tmp_path / "data"), "--output-dir", str(tmp_path / "out"), *argv], capsys)
        assert not os.path.exists(tmp_path / "out")
    assert expect in line, line
