"""A user's mistakes end in one line that names them, before any work, and leave a previous run's files as
they were. Flags and paths are checked in-process (no process started); run.sh's variables by run.sh."""
import hashlib
import os
import shutil
import subprocess

import pytest
import torch

import main
import recovery
from conftest import ROOT, TRAIN_ARGS


def _snapshot(folder):
    """{relative path: sha1} of every file under folder."""
    files = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = hashlib.sha1(f.read()).hexdigest()
    return files


@pytest.fixture
def previous_run(tmp_path):
    """An output folder holding a finished run's files (small stand-ins)."""
    out = tmp_path / "out"
    (out / "vis").mkdir(parents=True)
    for name in ("checkpoint.pth", "best.pth", "metrics.jsonl", "vis/epoch_000.png"):
        (out / name).write_bytes(f"the previous run's {name}".encode())
    return str(out)


def _one_error_line(capsys, prefix="main.py: error: "):
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(prefix), output
    return errors[0]


def _main_fails(argv, capsys, code=1):
    """main.main() on argv ends with exit code `code` and one error line; -> that line."""
    with pytest.raises(SystemExit) as exit_info:
        main.main(main.get_args_parser().parse_args(argv))
    assert exit_info.value.code == code
    return _one_error_line(capsys)


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's rules, also on a GPU machine


@pytest.mark.parametrize("argv, expect", [
    (["-b", "0"], "-b/--batch-size: 0 must be at least 1"),
    (["-b", "two"], "'two' is not an integer"),
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
    (["--dist-timeout", "0"], "--dist-timeout: 0 must be above 0"),
    (["--dist-timeout", "nan"], "--dist-timeout: nan must be above 0"),
    (["--dist-timeout", "-5"], "--dist-timeout: -5 must be above 0"),
    (["--dist-timeout", "1e300"], "--dist-timeout: 1e300 must be above 0 and at most 10080"),
    (["--seed", "100000000000000000000000"], "--seed: 100000000000000000000000 must be at least 0 and at most"),
    (["--check-only", "0"], "--check-only: 0 must be at least 1"),
    (["--color-jitter", "1.5"], "--color-jitter: 1.5 must be at least 0 and at most 1"),
    (["--scale-range", "0", "2"], "--scale-range: 0 must be above 0"),
    (["--crop-size", "-8"], "--crop-size: -8 must be at least 1"),
])
def test_numbers_out_of_range_are_refused_where_they_are_parsed(argv, expect, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main.get_args_parser().parse_args(argv)
    assert exit_info.value.code == 2
    line = _one_error_line(capsys)
    assert expect in line, line


def test_choices_that_cannot_work_here(tiny_data, tmp_path, previous_run, capsys):
    before = _snapshot(previous_run)
    common = ["--data", tiny_data, "--output-dir", previous_run, *TRAIN_ARGS, "--check-only", "2", "--resume", "auto"]
    empty, listing = tmp_path / "empty.pth", tmp_path / "list.pth"
    empty.write_bytes(b"")
    torch.save([1, 2, 3], listing)
    for extra, expect in [
        (["--dist-backend", "nccl"], "--dist-backend nccl needs CUDA"),
        (["--crop-size", "16", "-b", "1"], "too little for BatchNorm"),
        (["--scale-range", "2", "0.5"], "the first is the smallest scale"),
        (["--pretrained-backbone", str(empty)], "empty.pth cannot be read"),
        (["--pretrained-backbone", str(listing)], "list.pth holds no state dict"),
        (["--output-dir", os.path.join(previous_run, "metrics.jsonl")], "is a file, not a folder"),
        (["--save-predictions", os.path.join(previous_run, "best.pth")], "is a file, not a folder"),
        (["--output-dir", os.path.join(previous_run, "best.pth", "sub")], "cannot be written"),
    ]:
        line = _main_fails(common + extra, capsys)
        assert expect in line, (extra, line)
    assert _snapshot(previous_run) == before


def test_a_previous_run_is_never_replaced_without_a_word(tiny_data, previous_run, capsys):
    before = _snapshot(previous_run)
    line = _main_fails(["--data", tiny_data, "--output-dir", previous_run, *TRAIN_ARGS, "--epochs", "1"], capsys)
    assert "holds another run" in line and "--resume auto" in line and "--overwrite" in line, line
    assert _snapshot(previous_run) == before
    line = _main_fails(["--data", tiny_data, "--output-dir", previous_run, *TRAIN_ARGS, "--resume", "auto"], capsys)
    assert "cannot be read" in line and "these files are kept" in line, line  # damaged, no fallback: stop
    assert _snapshot(previous_run) == before


def test_overwrite_replaces_a_previous_run_and_resume_auto_does_not_without_a_checkpoint(tiny_data, previous_run,
                                                                                        capsys):
    os.remove(os.path.join(previous_run, "checkpoint.pth"))  # best.pth and metrics.jsonl stay: a run all the same
    before = _snapshot(previous_run)
    common = ["--data", tiny_data, "--output-dir", previous_run, *TRAIN_ARGS, "--epochs", "1", "--resume", "auto"]
    line = _main_fails(common, capsys)
    assert "holds another run" in line and "no checkpoint to continue from" in line, line
    assert _snapshot(previous_run) == before
    main.main(main.get_args_parser().parse_args(common + ["--overwrite"]))  # as ./run.sh --overwrite runs it
    assert "resuming" not in capsys.readouterr().out
    with open(os.path.join(previous_run, "metrics.jsonl")) as f:
        assert [line.startswith('{"epoch": 0') for line in f] == [True]  # the old run's lines are gone
    assert recovery.read_checkpoint(os.path.join(previous_run, "best.pth"))[0]["epoch"] == 1


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:
        f.write('{"epoch": 0, "miou": 0.5}\n{"epoch": 1, "miou": 0.6}\n{"epoch": 2, "mi')  # killed mid-line
    recovery.trim_metrics(path, 2)
    with open(path) as f:
        assert f.read() == '{"epoch": 0, "miou": 0.5}\n{"epoch": 1, "miou": 0.6}\n'


def test_checkpoints_that_cannot_resume_training(tiny_data, trained, tmp_path, capsys):
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    before = _snapshot(out)
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS]
    # A requeued job that had already finished: nothing to do, and it says so (exit 0).
    main.main(main.get_args_parser().parse_args(common + ["--epochs", "1", "--resume", "auto"]))
    said = capsys.readouterr().out
    assert "nothing to train" in said and "done" not in said, said
    assert _snapshot(out) == before
    line = _main_fails(common + ["--epochs", "3", "--resume", os.path.join(out, "checkpoint.pth"), "--start-epoch",
                                 "1"], capsys)
    assert "--start-epoch 1 with --resume" in line, line
    weights = str(tmp_path / "weights.pth")  # weights only, as torch.save(model.state_dict()) writes them
    torch.save(torch.load(os.path.join(out, "checkpoint.pth"), weights_only=True)["model"], weights)
    line = _main_fails(common + ["--epochs", "3", "--resume", weights], capsys)
    assert "weights only" in line and "-e" in line, line
    assert _snapshot(out) == before  # neither mistake touched the run
    main.main(main.get_args_parser().parse_args(common + ["-e", "--resume", weights]))  # enough for -e
    assert "mIoU" in capsys.readouterr().out
    empty = str(tmp_path / "empty")
    line = _main_fails(["--data", tiny_data, "--output-dir", empty, *TRAIN_ARGS, "-e", "--resume", "auto"], capsys)
    assert "no checkpoint" in line, line  # not an evaluation of random weights


def test_an_empty_checkpoint_falls_back_to_the_one_before(trained, tmp_path, capsys):
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    shutil.copy(os.path.join(out, "checkpoint.pth"), os.path.join(out, "checkpoint.prev.pth"))
    open(os.path.join(out, "checkpoint.pth"), "wb").close()  # 0 bytes
    checkpoint, path = recovery.find_checkpoint("auto", out)
    assert path.endswith("checkpoint.prev.pth") and checkpoint["epoch"] == 1


def test_a_full_disk_keeps_the_previous_checkpoint_and_no_half_file(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "checkpoint.pth")
    recovery.save_checkpoint({"epoch": 1}, path, keep_previous=True)
    recovery.save_checkpoint({"epoch": 2}, path, keep_previous=True)
    before = _snapshot(str(tmp_path))

    def full_disk(state, f):
        f.write(b"x" * 4096)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(recovery.UserError) as error:
        recovery.save_checkpoint({"epoch": 3}, path, keep_previous=True)
    assert "No space left on device" in str(error.value) and "checkpoint.pth is the last one written" in str(error.value)
    assert _snapshot(str(tmp_path)) == before  # no .tmp left, checkpoint.pth and .prev.pth as they were


def test_the_data_folder_as_people_have_it(tiny_data, tmp_path, previous_run, capsys):
    data = str(tmp_path / "data")
    shutil.copytree(tiny_data, data)
    for split in ("train", "val"):  # a copy that went through a Mac, and a note beside the cities
        for kind in ("leftImg8bit", "gtFine"):
            open(os.path.join(data, kind, split, ".DS_Store"), "wb").close()
            open(os.path.join(data, kind, split, "README.txt"), "w").close()
    train = os.path.join(data, "leftImg8bit", "train")
    city = [os.path.join(train, c) for c in sorted(os.listdir(train)) if os.path.isdir(os.path.join(train, c))][0]
    open(os.path.join(city, ".DS_Store"), "wb").close()
    before = _snapshot(previous_run)
    common = ["--data", data, "--output-dir", previous_run, *TRAIN_ARGS, "--check-only", "2", "--overwrite"]
    main.main(main.get_args_parser().parse_args(common))  # stray files are ignored
    assert "error" not in capsys.readouterr().err

    loop = os.path.join(data, "leftImg8bit", "train", "loop")
    os.symlink(loop, loop)
    line = _main_fails(common, capsys)
    assert loop in line and "loops back" in line, line
    os.remove(loop)

    from PIL import Image
    val = os.path.join(data, "gtFine", "val")
    label_dir = [os.path.join(val, c) for c in sorted(os.listdir(val)) if os.path.isdir(os.path.join(val, c))][0]
    label = os.path.join(label_dir, sorted(n for n in os.listdir(label_dir) if n.endswith("labelIds.png"))[0])
    Image.new("L", (64, 32), 200).save(label)  # a val label with values no labelIds image has
    line = _main_fails(common, capsys)
    assert label in line and "not a Cityscapes labelIds image" in line, line  # before training, not after epoch 1
    assert _snapshot(previous_run) == before


@pytest.mark.parametrize("variables, expect", [
    ({"NPROC": "0"}, "NPROC=0: give a whole number of at least 1"),
    ({"NPROC": "two"}, "NPROC=two: give a whole number of at least 1"),
    ({"NNODES": "0"}, "NNODES=0: give a whole number of at least 1"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2: nodes are numbered 0 to NNODES-1 (1)"),
    ({"NODE_RANK": "-1"}, "NODE_RANK=-1: give a whole number of at least 0"),
    ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS=-1: give a whole number of at least 0"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT=http: give a whole number of at least 1"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000: a port is at most 65535"),
])
def test_run_sh_variables_are_checked_before_anything_runs(variables, expect, previous_run):
    before = _snapshot(previous_run)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUTPUT_DIR": previous_run, **variables}
    result = subprocess.run(["./run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and output.strip() == f"run.sh: error: {expect}", output
    assert _snapshot(previous_run) == before
