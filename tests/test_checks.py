"""harness/checks.py: every number flag's range, checked after parsing and before any work, in one line."""
import os
import sys

import pytest

import main
from conftest import ROOT, main_fails, one_error_line, run_main


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


# Every program with a command line, and its module (its parser's).
PROGRAMS = {"main.py": "main", "predict.py": "predict", "synthetic.py": "synthetic",
            "harness/cache.py": "harness.cache", "bench.py": "bench"}


def _number_flags():
    """(program, flag, type, nargs) of every action of every program's parser whose type is int or float."""
    import importlib
    found = []
    for program, module in PROGRAMS.items():
        for action in importlib.import_module(module).get_args_parser()._actions:
            if action.type in (int, float):
                found.append(pytest.param(program, action.option_strings, action.type, action.nargs,
                                          id=f"{program} {max(action.option_strings, key=len)}"))
    return found


def _given(program, flag, numbers, tmp_path, monkeypatch, capsys):
    """program's command line with flag given numbers, in this process, where nothing else is the matter until it
    starts its work; that work fails at once without a word about the flag: main.py and harness/cache.py on a --data
    that is not there, predict.py on a checkpoint that is not there, synthetic.py on a folder that holds a file,
    bench.py --gpu on no GPU. -> (its exit status, all it printed and its exit message)."""
    import runpy
    import signal
    mine = tmp_path / "mine"
    mine.mkdir(exist_ok=True)
    (mine / "photo.jpg").write_bytes(b"the user's own file")
    nowhere, out = str(tmp_path / "no data"), str(tmp_path / "out")
    argv = {"main.py": ["--data", nowhere, "--output-dir", out],
            "predict.py": [nowhere, "--resume", str(tmp_path / "none.pth"), "--output-dir", out],
            "synthetic.py": [str(mine)], "harness/cache.py": [out, "--data", nowhere],
            "bench.py": ["--gpu"]}[program] + [flag, *numbers]
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        if program in ("main.py", "predict.py"):
            run_main(argv, program=PROGRAMS[program])
        else:  # run as files, as their docs run them: their checks are in their `if __name__ == "__main__"` block
            monkeypatch.setattr(sys, "argv", [program, *argv])
            runpy.run_path(os.path.join(ROOT, program), run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code
    finally:
        for number, handler in handlers.items():  # synthetic.py's own, for a Ctrl-C while it writes
            signal.signal(number, handler)
    said = capsys.readouterr()
    worked = os.path.exists(out) or os.listdir(mine) != ["photo.jpg"]
    return code, said.out + said.err + (code if isinstance(code, str) else ""), worked


@pytest.mark.parametrize("program, flags, kind, nargs", _number_flags())
def test_every_number_flag_of_every_program_refuses_a_number_out_of_its_range_before_any_work(
        program, flags, kind, nargs, tmp_path, monkeypatch, capsys):
    """Each program's parser walked: every flag that takes an int or a float has a range. The program refuses -1 or
    a number past any sane size (whichever its range forbids), and a float flag NaN too, in one line that names the
    flag and the number, before any work. A flag that lets them through has no range: the test names what it let
    through."""
    count = 2 if nargs == 2 else 1  # (--scale-range, --size: two numbers)
    for numbers in [["-1", str(10**12) if kind is int else "1e300"]] + ([["nan"]] if kind is float else []):
        through = {}
        for number in numbers:
            code, output, worked = _given(program, max(flags, key=len), [number] * count, tmp_path, monkeypatch, capsys)
            errors = [line for line in output.splitlines() if "error:" in line]
            if (code not in (0, None) and "Traceback" not in output and len(errors) == 1
                    and any(flag in errors[0] for flag in flags)
                    and (number in errors[0] or f"{float(number):g}" in errors[0])):
                assert not worked, (program, flags, number)  # refused before any work
                break
            through[number] = (output.strip().splitlines() or ["(nothing said)"])[-1]
        else:
            pytest.fail(f"{program} {max(flags, key=len)} refuses none of {', '.join(through)}: it has no range check "
                        f"(what it said instead: {through})")


def test_a_temporary_folder_too_long_for_the_workers_sockets_is_refused_where_workers_start(tmp_path, monkeypatch,
                                                                                           capsys):
    """main.py and predict.py with DataLoader workers (the default, or -j 1) refuse a temporary folder whose path
    leaves their sockets no room (test_torch_claims: 75 characters at most), in one line; with -j 0 they make no
    socket, and its length is no mistake."""
    import tempfile
    long = str(tmp_path / ("t" * max(1, 80 - len(str(tmp_path)))))
    monkeypatch.setattr(tempfile, "tempdir", long)
    said = (f"the temporary folder {long} is {len(long)} characters long, more than the 75 that DataLoader workers' "
            "sockets in it allow: set TMPDIR to a shorter path (/tmp, say)")
    nowhere = str(tmp_path / "nowhere")
    for program, argv in (("main", ["--data", nowhere, "--output-dir", str(tmp_path / "out")]),
                          ("predict", ["--resume", nowhere, nowhere])):
        for workers in ([], ["-j", "1"]):
            assert main_fails(argv + workers, capsys, program=program) == f"{program}.py: error: {said}"
        assert said not in main_fails(argv + ["-j", "0"], capsys, program=program)
