"""harness/job.py: the launcher's environment, checked in one line; run.sh's variables named in its advice; and the
run's state (job.RUN), whose one reset, job.begin_run, the program calls where a run starts (recovery.guard) and
conftest before each test, so that the tests exercise the program's own."""
import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile

import pytest

from harness import job, paths, recovery
from conftest import SESSION_TMP, TRAIN_ARGS, cpu_env, main_fails


def test_begin_run_makes_every_field_as_a_new_process_has_it_but_what_lasts_the_process():
    fresh = job.Run()
    for name, value in vars(job.RUN).items():  # every field changed, a dataclass's fields too
        if dataclasses.is_dataclass(value):
            setattr(job.RUN, name, dataclasses.replace(value, **{f.name: "left" for f in dataclasses.fields(value)
                                                                  if f.name != "started"}))
        else:
            setattr(job.RUN, name, "left")
    job.RUN.unchecked = {"a-file.pth"}
    job.begin_run()
    for name in vars(fresh):
        if name == "unchecked":
            assert job.RUN.unchecked == {"a-file.pth"}  # said once a process, not once a run
        elif name == "guard":
            assert dataclasses.replace(job.RUN.guard, started=0) == dataclasses.replace(fresh.guard, started=0)
        else:
            assert getattr(job.RUN, name) == getattr(fresh, name), name


def test_a_run_starts_with_what_an_earlier_run_in_the_process_left_undone():
    """A second run in one process (the tests run main() many times) finds no state of the first: guard resets."""
    job.RUN.command = job.Command(quiet=True, resume="--resume old.pth")  # as a --check-only run leaves it
    job.RUN.records.lost_predictions = [OSError("full"), 3]
    with recovery.guard("predict.py", argparse.Namespace(evaluate=True, check_only=0)):
        assert job.RUN.command == job.Command() and job.RUN.records == job.Records()


def test_a_line_with_a_character_the_stream_cannot_encode_is_said_not_raised(monkeypatch):
    """PYTHONIOENCODING=ascii makes stdout strict (Python's stderr escapes by default): a line of the run naming a
    path in another alphabet raised UnicodeEncodeError there, mid-run. Under guard it comes, the letters escaped."""
    import io
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii", write_through=True)
    monkeypatch.setattr("sys.stdout", stdout)
    with recovery.guard("predict.py", argparse.Namespace(evaluate=True, check_only=0)):
        job.log("wrote 2 predictions to дані")
    assert stdout.buffer.getvalue().decode("ascii") == "wrote 2 predictions to \\u0434\\u0430\\u043d\\u0456\n"



@pytest.mark.launch
def test_each_test_keeps_its_records_in_a_temporary_folder_of_its_own_that_its_programs_inherit():
    """conftest.a_temporary_folder_of_its_own: a new, empty, short TMPDIR, the one this process's tempfile, a Python
    the test starts (with cpu_env, as run() does) and a forked copy of this process use; paths.private_folder's
    records are kept there, not in the machine's TMPDIR/deeplab-UID, which a suite running beside this one shares."""
    folder = os.environ["TMPDIR"]
    assert os.path.dirname(folder) == SESSION_TMP and len(folder) <= len(SESSION_TMP) + 10, folder
    assert tempfile.gettempdir() == folder and os.listdir(folder) == []
    started = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"], env=cpu_env(),
                             capture_output=True, text=True, check=True)
    assert started.stdout == f"{folder}\n", started
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a copy of pytest, none of whose exit code may run here
        os.write(write, tempfile.gettempdir().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as forked:
        assert forked.read() == folder
    assert paths.private_folder() == os.path.join(folder, f"deeplab-{os.getuid()}")

@pytest.mark.usefixtures("on_the_cpu")
def test_under_run_sh_the_advice_names_its_variables(tiny_data, previous_run, monkeypatch, capsys):
    monkeypatch.setenv("DEEPLAB_RUN_SH", "1")  # as run.sh sets it
    os.remove(os.path.join(previous_run, "checkpoint.pth"))
    line = main_fails(["--data", tiny_data, "--output-dir", previous_run, *TRAIN_ARGS, "--resume", "auto"], capsys)
    assert f"OUTPUT_DIR {previous_run} holds another run" in line and "choose another OUTPUT_DIR" in line, line
    assert "./run.sh --overwrite" in line and "--output-dir" not in line and "--resume auto" not in line, line
    empty = os.path.join(previous_run, "empty")
    line = main_fails(["--data", tiny_data, "--output-dir", empty, *TRAIN_ARGS, "-b", "9"], capsys)
    assert "give ./run.sh -b 8 or less" in line, line  # run.sh chose -b itself: the user gives it after ./run.sh
    line = main_fails(["--data", tiny_data, "--output-dir", empty, *TRAIN_ARGS, "-e", "--resume", "auto"], capsys)
    assert f"OUTPUT_DIR {empty} to evaluate: train there first, or give ./run.sh -e --resume PATH" in line, line


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("variables, expect", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "the environment variable RANK='x' is not a whole number of at least 0"),
    ({"LOCAL_RANK": ""}, "LOCAL_RANK='' is not a whole number of at least 0: set it as a launcher does"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK and WORLD_SIZE are set but MASTER_ADDR is not: set MASTER_ADDR and"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"},
     "MASTER_PORT='http' is not a whole number from 1 to 65535: set it to a free port"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"OMP_NUM_THREADS": "all"}, "OMP_NUM_THREADS='all' is not a whole number of at least 1: set the threads"),
])
def test_the_launchers_environment_is_checked_in_one_line(variables, expect, tiny_data, tmp_path, monkeypatch,
                                                        capsys):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS], capsys)
    assert expect in line and not os.path.exists(tmp_path / "out"), line
