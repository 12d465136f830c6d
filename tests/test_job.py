"""The run's state (harness/job.py's RUN) has one reset, job.begin_run: the program calls it where a run starts
(recovery.guard), and conftest calls the same before each test, so that the tests exercise the program's own."""
import argparse
import dataclasses

from harness import job, recovery


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
