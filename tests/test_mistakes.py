"""A user's mistakes end in one line that names them, before any work, and leave a previous run's files as
they were. Flags and paths are checked in-process (no process started); run.sh's variables by run.sh."""
import argparse
import errno
import glob
import hashlib
import re
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import main
from harness import checkpoints, errors, job, paths, stops
from conftest import ROOT, TRAIN_ARGS, fingerprint, main_fails, no_space, one_error_line


@pytest.fixture
def previous_run(tmp_path):
    """An output folder holding a finished run's files (small stand-ins)."""
    out = tmp_path / "out"
    (out / "vis").mkdir(parents=True)
    for name in ("checkpoint.pth", "best.pth", "metrics.jsonl", "vis/epoch_000.png"):
        (out / name).write_bytes(f"the previous run's {name}".encode())
    return str(out)


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


def test_choices_that_cannot_work_here(tiny_data, tmp_path, previous_run, capsys):
    before = fingerprint(previous_run)
    common = ["--data", tiny_data, "--output-dir", previous_run, *TRAIN_ARGS, "--check-only", "2", "--resume", "auto"]
    os.symlink(tmp_path / "nowhere", tmp_path / "gone")  # output folders that are links to nothing, or to themselves
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    empty, listing = tmp_path / "empty.pth", tmp_path / "list.pth"
    empty.write_bytes(b"")
    torch.save([1, 2, 3], listing)
    for extra, expect in [
        (["--dist-backend", "nccl"], "--dist-backend nccl needs CUDA"),
        (["--crop-size", "16", "-b", "1"], "too little for BatchNorm"),
        (["--scale-range", "2", "0.5"], "the first is the smallest scale"),
        # A fresh start's backbone (a run that resumes never reads it): into a new folder.
        (["--pretrained-backbone", str(empty), "--output-dir", str(tmp_path / "new")], "empty.pth cannot be read"),
        (["--pretrained-backbone", str(listing), "--output-dir", str(tmp_path / "new")], "list.pth holds no state dict"),
        (["--output-dir", os.path.join(previous_run, "metrics.jsonl")], "is a file, not a folder"),
        (["--save-predictions", os.path.join(previous_run, "best.pth")], "is a file, not a folder"),
        (["--output-dir", os.path.join(previous_run, "best.pth", "sub")], "cannot be written"),
        (["--output-dir", str(tmp_path / "gone")], "gone is a symbolic link that leads nowhere or loops back to itself"),
        (["--output-dir", str(tmp_path / "loop" / "sub")], f"({tmp_path / 'loop'}, on its way) is a symbolic link"),
    ]:
        line = main_fails(common + extra, capsys)
        assert expect in line, (extra, line)
    assert fingerprint(previous_run) == before


def test_a_previous_run_is_never_replaced_without_a_word(tiny_data, previous_run, capsys):
    before = fingerprint(previous_run)
    line = main_fails(["--data", tiny_data, "--output-dir", previous_run, *TRAIN_ARGS, "--epochs", "1"], capsys)
    assert "holds another run" in line and "--resume auto" in line and "--overwrite" in line, line
    assert fingerprint(previous_run) == before
    line = main_fails(["--data", tiny_data, "--output-dir", previous_run, *TRAIN_ARGS, "--resume", "auto"], capsys)
    assert "cannot be read" in line and "these files are kept" in line, line  # damaged, no fallback: stop
    assert fingerprint(previous_run) == before


def test_overwrite_moves_a_previous_run_aside_and_resume_auto_does_not_replace_it(tiny_data, previous_run, capsys):
    os.remove(os.path.join(previous_run, "checkpoint.pth"))  # best.pth and metrics.jsonl stay: a run all the same
    before = fingerprint(previous_run)
    common = ["--data", tiny_data, "--output-dir", previous_run, *TRAIN_ARGS, "--epochs", "1", "--resume", "auto"]
    line = main_fails(common, capsys)
    assert "holds another run" in line and "no checkpoint to continue from" in line, line
    assert fingerprint(previous_run) == before
    main.main(main.get_args_parser().parse_args(common + ["--overwrite"]))  # as ./run.sh --overwrite runs it
    said = capsys.readouterr().out
    [moved] = [os.path.join(previous_run, name) for name in os.listdir(previous_run) if name.startswith("replaced-")]
    assert "resuming" not in said and f"is now in {moved}" in said, said
    assert fingerprint(moved) == before  # nothing deleted: the old run whole, pictures included, beside the new one
    with open(os.path.join(previous_run, "metrics.jsonl")) as f:
        assert [line.startswith('{"epoch": 0') for line in f] == [True]  # the new run's lines only
    assert os.listdir(os.path.join(previous_run, "vis")) == ["epoch_000.png"]
    assert checkpoints.read("--resume", os.path.join(previous_run, "best.pth"))["epoch"] == 1


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path):
    from types import SimpleNamespace
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:
        f.write('{"epoch": 0, "miou": 0.5}\n{"epoch": 1, "miou": 0.6}\n{"epoch": 2, "mi')  # killed mid-line
    checkpoints.rewrite_run_files_at(SimpleNamespace(output_dir=str(tmp_path)), checkpoints.Start(), 2, 0)
    with open(path) as f:
        assert f.read() == '{"epoch": 0, "miou": 0.5}\n{"epoch": 1, "miou": 0.6}\n'  # the next line starts whole


def test_checkpoints_that_cannot_resume_training(tiny_data, trained, tmp_path, capsys):
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    before = fingerprint(out)
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS]
    # A requeued job that had already finished: nothing to do, and it says so (exit 0). run.sh's check (--check-only)
    # says it in the same words and exits 3, so that run.sh starts no worker to say it again (test_launch).
    main.main(main.get_args_parser().parse_args(common + ["--epochs", "1", "--resume", "auto"]))
    said = capsys.readouterr().out
    assert "nothing to train" in said and "done" not in said, said
    with pytest.raises(SystemExit) as exit_info:
        main.main(main.get_args_parser().parse_args(common + ["--epochs", "1", "--resume", "auto",
                                                               "--check-only", "2"]))
    assert exit_info.value.code == errors.NOTHING_TO_TRAIN == 3  # run.sh reads 3
    assert capsys.readouterr().out == said.splitlines(keepends=True)[-1]  # the line main.py's train() says
    assert fingerprint(out) == before
    line = main_fails(common + ["--epochs", "3", "--resume", os.path.join(out, "checkpoint.pth"), "--start-epoch",
                                 "1"], capsys)
    assert "--start-epoch 1 with --resume" in line, line
    weights = str(tmp_path / "weights.pth")  # weights only, as torch.save(model.state_dict()) writes them
    torch.save(torch.load(os.path.join(out, "checkpoint.pth"), weights_only=True)["model"], weights)
    line = main_fails(common + ["--epochs", "3", "--resume", weights], capsys)
    assert "weights only" in line and "-e" in line, line
    assert fingerprint(out) == before  # neither mistake touched the run
    main.main(main.get_args_parser().parse_args(common + ["-e", "--resume", weights]))  # enough for -e
    assert "mIoU" in capsys.readouterr().out
    empty = str(tmp_path / "empty")
    line = main_fails(["--data", tiny_data, "--output-dir", empty, *TRAIN_ARGS, "-e", "--resume", "auto"], capsys)
    assert "no checkpoint" in line, line  # not an evaluation of random weights


def test_an_empty_checkpoint_falls_back_to_the_one_before(trained, tmp_path, capsys):
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    shutil.copy(os.path.join(out, "checkpoint.pth"), os.path.join(out, "checkpoint.prev.pth"))
    open(os.path.join(out, "checkpoint.pth"), "wb").close()  # 0 bytes
    path, checkpoint = checkpoints._find_in_run(out, evaluate=False)
    assert path.endswith("checkpoint.prev.pth") and checkpoint["epoch"] == 1


def test_a_full_disk_keeps_the_previous_checkpoint_and_no_half_file(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "checkpoint.pth")
    main.save_checkpoint({"epoch": 1}, path)
    main.save_checkpoint({"epoch": 2}, path)
    before = fingerprint(str(tmp_path))

    for error in (OSError(28, "No space left on device"),  # torch.save's zip writer says it in its own words:
                  RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")):
        def full_disk(state, f):
            f.write(b"x" * 4096)
            raise error
        monkeypatch.setattr(torch, "save", full_disk)
        monkeypatch.setattr(paths, "free_mib", lambda folder: 0.2)  # when it failed
        stops.install(training=False)  # a run's start: nothing failed yet
        main.save_checkpoint({"epoch": 3}, path)  # rank 0's failure waits for the ranks' vote, which every rank joins
        with pytest.raises(errors.UserError) as raised:
            stops.ranks_vote_after_epoch()
        assert "(no space left on device; 0 MiB free there when it failed)" in str(raised.value), raised.value
        assert "checkpoint.pth is the last one written" in str(raised.value)
        assert fingerprint(str(tmp_path)) == before  # no .tmp left, checkpoint.pth and .prev.pth as they were


def test_a_save_that_fails_says_why_from_its_errno_and_what_it_says_to_do_works(trained, tmp_path):
    """After the preflight, a save can still fail: the line's reason and advice come from the error's errno (here a
    file-size limit, and a folder put where checkpoint.prev.pth goes), never 'free space' for all; followed, the
    next save works."""
    import resource
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    path, previous = str(out / "checkpoint.pth"), out / "checkpoint.prev.pth"
    state = torch.load(path, weights_only=True)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    stops.install(training=False)  # a run's start: nothing failed yet
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, limits[1]))  # 1 MiB, less than a checkpoint (ulimit -f 1024)
    try:
        main.save_checkpoint(state, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)  # as the line says: ulimit -f unlimited
    with pytest.raises(errors.UserError) as raised:
        stops.ranks_vote_after_epoch()
    assert str(raised.value).startswith(f"cannot write {path} (File too large): {path} is the last one written. This "
                                        "process may write files of at most 1.0 MiB (the shell's file-size limit, "
                                        "ulimit -f): raise it, ulimit -f unlimited,"), raised.value
    assert sorted(os.listdir(out)) == sorted(os.listdir(trained))  # no temporary file left
    previous.mkdir()  # after the preflight's check: the rename onto it fails
    stops.install(training=False)
    main.save_checkpoint({**state, "epoch": 2}, path)
    with pytest.raises(errors.UserError) as raised:
        stops.ranks_vote_after_epoch()
    assert str(raised.value).startswith(f"cannot write {previous} (Is a directory): {path} is the last one written. "
                                        f"{previous} is a folder, in the way of the run's own: move it away;"), raised.value
    previous.rmdir()  # as the line says
    stops.install(training=False)
    main.save_checkpoint({**state, "epoch": 3}, path)
    assert stops.pending_write_failure() is None
    assert torch.load(previous, weights_only=True)["epoch"] == 2 and torch.load(path, weights_only=True)["epoch"] == 3


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
    before = fingerprint(previous_run)
    common = ["--data", data, "--output-dir", previous_run, *TRAIN_ARGS, "--check-only", "2", "--overwrite"]
    main.main(main.get_args_parser().parse_args(common))  # stray files are ignored
    assert "error" not in capsys.readouterr().err

    loop = os.path.join(data, "leftImg8bit", "train", "loop")
    os.symlink(loop, loop)
    line = main_fails(common, capsys)
    assert loop in line and "loops back" in line, line
    os.remove(loop)

    from PIL import Image
    val = os.path.join(data, "gtFine", "val")
    label_dir = [os.path.join(val, c) for c in sorted(os.listdir(val)) if os.path.isdir(os.path.join(val, c))][0]
    label = os.path.join(label_dir, sorted(n for n in os.listdir(label_dir) if n.endswith("labelIds.png"))[0])
    Image.new("L", (64, 32), 200).save(label)  # a val label with values no labelIds image has
    line = main_fails(common, capsys)
    assert label in line and "not a Cityscapes labelIds image" in line, line  # before training, not after epoch 1
    assert fingerprint(previous_run) == before


@pytest.mark.launch
@pytest.mark.parametrize("variables, expect", [
    ({"NPROC": "0"}, "NPROC=0: give a whole number of at least 1"),
    ({"NPROC": "two"}, "NPROC=two: give a whole number of at least 1"),
    ({"NNODES": "0"}, "NNODES=0: give a whole number of at least 1"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2: nodes are numbered 0 to NNODES-1 (1)"),
    ({"NODE_RANK": "-1"}, "NODE_RANK=-1: give a whole number of at least 0"),
    ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS=-1: give a whole number of at least 0"),
    ({"MAX_RESTARTS": "99999999999999999999"}, "MAX_RESTARTS=99999999999999999999: give a whole number of at most "
                                               "999999999"),  # past bash's integers, which wrap without a word
    ({"NPROC": "000"}, "NPROC=000: give a whole number of at least 1"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT=http: give a whole number of at least 1"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000: a port is at most 65535"),
])
def test_run_sh_variables_are_checked_before_anything_runs(variables, expect, previous_run):
    before = fingerprint(previous_run)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUTPUT_DIR": previous_run, **variables}
    result = subprocess.run(["./run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and output.strip() == f"run.sh: error: {expect}", output
    assert fingerprint(previous_run) == before


@pytest.mark.launch
def test_run_sh_reads_a_leading_zero_as_decimal(tiny_data, tmp_path):
    """bash's arithmetic would read NPROC=010 as eight processes (and NPROC=08 as an error): ten are counted, and
    eight. A stand-in for Python records what run.sh starts (no torch to import: run.sh's own arithmetic is the
    point)."""
    log, fake = tmp_path / "started", tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "$*" >> "$FAKE_LOG"\n')
    fake.chmod(0o755)
    for given, counted in (("010", 10), ("08", 8)):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DATA": tiny_data, "OUTPUT_DIR": str(tmp_path / "out"),
               "NPROC": given, "PYTHON": str(fake), "FAKE_LOG": str(log)}
        result = subprocess.run(["./run.sh", *TRAIN_ARGS], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        check, launch = log.read_text().splitlines()
        log.unlink()
        assert check.endswith(f" --check-only {counted}"), check  # main.py's check is told the whole world size
        assert f"--nproc_per_node {counted} " in launch, launch


def test_under_run_sh_too_many_processes_name_its_variables(tiny_data, tmp_path, monkeypatch, capsys):
    """main.py's check as run.sh runs it (DEEPLAB_RUN_SH=1, the world size run.sh counted): the advice names what the
    user sets there, NPROC and NNODES, not a flag. In-process: the line is main.py's."""
    monkeypatch.setenv("DEEPLAB_RUN_SH", "1")
    line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--check-only", "10"],
                       capsys)
    assert line == "main.py: error: 10 processes but only 5 val images: use at most 5 processes in all (NPROC x NNODES)"


# --- nothing the user made is written over: what a command reads, and where it writes -------------------------
def _fingerprint(*folders):
    return {folder: fingerprint(folder) for folder in folders}


def test_the_advice_for_a_model_of_other_classes_leads_to_a_command_that_works(trained, folder_data, tmp_path,
                                                                                capsys):
    out, new = str(tmp_path / "run"), str(tmp_path / "fine_tuned")
    shutil.copytree(trained, out)  # a Cityscapes run (19 classes), to continue on a data set of 7 classes
    before = _fingerprint(out, folder_data)
    common = ["--data", folder_data, *TRAIN_ARGS, "--epochs", "1"]
    line = main_fails(common + ["--output-dir", out, "--resume", "auto"], capsys)
    weights = os.path.join(out, "checkpoint.pth")
    assert f"fine-tune it on this data into a new output folder: --weights {weights} --output-dir NEW" in line, line
    line = main_fails(common + ["--output-dir", out, "--weights", weights], capsys)
    assert "holds another run" in line, line  # the same folder: refused, as another run is
    line = main_fails(common + ["--output-dir", out, "--weights", weights, "--overwrite"], capsys)
    assert "belongs to the run that --overwrite moves aside" in line and "another --output-dir" in line, line
    assert _fingerprint(out, folder_data) == before  # none of the three touched a file
    main.main(main.get_args_parser().parse_args(common + ["--output-dir", new, "--weights", weights]))  # the advice
    assert "starts afresh" in capsys.readouterr().out
    assert _fingerprint(out, folder_data) == before and os.path.isfile(os.path.join(new, "best.pth"))


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


def test_the_data_set_is_never_where_the_run_writes(tiny_data, previous_run, capsys):
    data = os.path.join(previous_run, "vis", "data")  # a place the run writes into, and --overwrite moves aside
    shutil.copytree(tiny_data, data)
    before = fingerprint(previous_run)
    for extra in ([], ["--overwrite"], ["--check-only", "1"]):
        line = main_fails(["--data", data, "--output-dir", previous_run, *TRAIN_ARGS, *extra], capsys)
        assert f"--data {data} is inside {os.path.join(previous_run, 'vis')}, where the run writes" in line, line
        assert fingerprint(previous_run) == before


def test_the_advice_after_a_stop_continues_the_run_instead_of_starting_over(tiny_data, trained, tmp_path,
                                                                              monkeypatch, capsys):
    import dataset
    import signal
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    read = dataset.SegmentationFiles.__getitem__

    def signal_at_the_first_read(self, index):  # SIGTERM during the first step: the ranks stop one step later
        if self.crop_size is not None and job.RUN.stops.signal is None:
            stops._on_signal(signal.SIGTERM, None)
        return read(self, index)
    monkeypatch.setattr(dataset.SegmentationFiles, "__getitem__", signal_at_the_first_read)
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2"]
    best = os.path.join(out, "best.pth")
    main.main(main.get_args_parser().parse_args(common + ["--resume", best]))
    said = capsys.readouterr().out
    assert "stopped by signal 15 at epoch 1 step 2/4" in said, said
    assert f"run the same command with --resume auto in place of --resume {best}" in said, said
    monkeypatch.setattr(dataset.SegmentationFiles, "__getitem__", read)
    stop = tmp_path / "stop"
    stop.write_text("TERM")  # run.sh writes the first signal here: a worker started (again) after it ends at once
    monkeypatch.setenv("DEEPLAB_STOP_FILE", str(stop))
    before = fingerprint(out)
    with pytest.raises(SystemExit) as exit_info:
        main.main(main.get_args_parser().parse_args(common + ["--resume", "auto"]))
    said = capsys.readouterr().out
    assert exit_info.value.code == 0 and "stopped before it began its work" in said and fingerprint(out) == before, said
    monkeypatch.delenv("DEEPLAB_STOP_FILE")
    main.main(main.get_args_parser().parse_args(common + ["--resume", "auto"]))  # the advice, followed
    said = capsys.readouterr().out
    assert f"resuming from {os.path.join(out, 'checkpoint.pth')} at epoch 1 after step 2" in said, said


@pytest.mark.parametrize("where, flag", [("data", "--output-dir"), ("data/leftImg8bit", "--output-dir"),
                                         ("data/gtFine/val", "--save-predictions"), ("data", "--cache-dir")])
def test_no_output_lands_in_the_data_set(tiny_data, tmp_path, where, flag, capsys):
    data = str(tmp_path / "data")
    shutil.copytree(tiny_data, data)
    before = fingerprint(data)
    target = str(tmp_path / where)
    argv = ["--data", data, *TRAIN_ARGS, "--epochs", "1", flag, target]
    if flag != "--output-dir":
        argv += ["--output-dir", str(tmp_path / "out")]
    line = main_fails(argv, capsys)
    assert f"{flag} {target} is" in line and f"--data {data}, which this command reads" in line, line
    assert fingerprint(data) == before and not os.path.exists(tmp_path / "out")


def test_reads_are_checked_before_anything_is_moved_or_written(tiny_data, trained, tmp_path, previous_run, capsys):
    before = fingerprint(previous_run)
    for extra, expect in [(["--weights", str(tmp_path / "gone.pth")], "gone.pth: no such file"),
                          (["--weights", trained], f"--weights {trained} is a folder, not a checkpoint: give a "
                                                   f"checkpoint file, such as {os.path.join(trained, 'best.pth')}"),
                          (["--data", str(tmp_path / "nowhere")], "not found")]:
        argv = ["--data", tiny_data, "--output-dir", previous_run, *TRAIN_ARGS, "--overwrite", *extra]
        line = main_fails(argv, capsys)
        assert expect in line, (extra, line)
        assert fingerprint(previous_run) == before  # --overwrite moved nothing: a read failed first
    assert not [name for name in os.listdir(previous_run) if name.startswith("replaced-")]


def test_missing_folders_are_made_and_a_place_that_cannot_be_is_named(tiny_data, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    line = main_fails(["--data", tiny_data, "--output-dir", str(blocker / "runs" / "x"), *TRAIN_ARGS], capsys)
    assert f"cannot be written ({blocker} is a file)" in line, line
    out = tmp_path / "runs" / "deep" / "x"
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS,
                                                 "--check-only", "1"]))
    assert not out.exists()  # the preflight writes nothing
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS,
                                                 "--epochs", "1", "--save-predictions", str(tmp_path / "p" / "q")]))
    assert (out / "best.pth").is_file() and len(os.listdir(tmp_path / "p" / "q")) == 5


def test_a_rewind_keeps_what_it_drops_and_says_so(tiny_data, tmp_path, capsys):
    out = str(tmp_path / "out")
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2"]
    main.main(main.get_args_parser().parse_args(common))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = f.readlines()
    newer = fingerprint(out)
    capsys.readouterr()
    main.main(main.get_args_parser().parse_args(common + ["--resume", os.path.join(out, "checkpoint.prev.pth")]))
    said = capsys.readouterr().out
    assert "rewinds this run; what came after it is kept" in said and "1 later epoch(s)" in said, said
    names = os.listdir(out)
    [checkpoint] = [n for n in names if n.startswith("checkpoint.rewound-")]
    [metrics] = [n for n in names if n.startswith("metrics.rewound-")]
    with open(os.path.join(out, checkpoint), "rb") as f:  # the later checkpoint, byte for byte
        assert hashlib.sha1(f.read()).hexdigest() == newer["checkpoint.pth"]
    with open(os.path.join(out, metrics)) as f:
        assert f.readlines() == lines[1:]  # the dropped line, as it was
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["epoch"] for line in f] == [0, 1]  # epoch 1 done again, once


def test_a_folder_or_a_ddp_state_dict_or_backbone_weights_given_as_a_checkpoint(tiny_data, trained, tmp_path,
                                                                                 capsys):
    common = ["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS]
    line = main_fails(common + ["-e", "--resume", trained], capsys)
    assert f"--resume {trained} is a folder, not a checkpoint" in line, line
    weights = torch.load(os.path.join(trained, "best.pth"), weights_only=True)["model"]
    wrapped = str(tmp_path / "ddp.pth")  # torch.save(ddp_model.state_dict()): every key "module.…"
    torch.save({f"module.{key}": value for key, value in weights.items()}, wrapped)
    main.main(main.get_args_parser().parse_args(common + ["-e", "--resume", wrapped]))
    assert "mIoU" in capsys.readouterr().out
    backbone = str(tmp_path / "mobilenet_v3_large.pth")  # a classification network's weights, as torchvision's
    torch.save({"features.0.0.weight": torch.zeros(16, 3, 3, 3), "classifier.0.weight": torch.zeros(1280, 960)},
               backbone)
    line = main_fails(common[:3] + [str(tmp_path / "new")] + common[4:] + ["--weights", backbone], capsys)
    assert "holds the weights of a classification network" in line and f"--pretrained-backbone {backbone}" in line
    best = os.path.join(trained, "best.pth")
    for given, expect in [(best, ["holds a whole DeepLab model", f"fine-tune from it with --weights {best}"]),
                          (wrapped, ["holds a segmentation model's weights", "of this program goes to --weights"])]:
        line = main_fails(common[:3] + [str(tmp_path / "new")] + common[4:] + ["--pretrained-backbone", given], capsys)
        assert all(part in line for part in expect), line  # where a backbone's weights are meant
    vision = str(tmp_path / "torchvision.pth")  # torchvision's own DeepLab, its head named otherwise
    torch.save({"backbone.0.0.weight": torch.zeros(16, 3, 3, 3), "classifier.0.convs.0.0.weight": torch.zeros(4)},
               vision)
    line = main_fails(common + ["-e", "--resume", vision], capsys)
    assert "holds torchvision's own DeepLab (torchvision.models.segmentation" in line, line
    odd = str(tmp_path / "odd.pth")  # weights alone, of no model of this project: -e and --weights would fail too
    torch.save({**weights, "classifier.weight": torch.zeros(19, 3, 1, 1)}, odd)
    line = main_fails(common + ["--resume", odd], capsys)
    assert "its weights fit no model of this project" in line and "-e" not in line, line


def test_torch_s_own_error_text_is_whole(tiny_data, tmp_path, capsys):
    broken = tmp_path / "broken.pth"
    broken.write_bytes(b"PK\x03\x04 not really a zip archive")
    with pytest.raises(Exception) as raised:
        torch.load(broken, weights_only=True)
    line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "-e", "--resume",
                        str(broken)], capsys)
    assert str(raised.value).strip().splitlines()[0] in line, line


def test_pretrained_weights_are_fetched_only_for_a_fresh_start(tiny_data, trained, tmp_path, monkeypatch, capsys):
    from torchvision.models import MobileNet_V3_Large_Weights
    fetched = []

    def offline(self, *args, **kwargs):  # a compute node without internet
        fetched.append(self)
        raise OSError("no network")
    monkeypatch.setattr(type(MobileNet_V3_Large_Weights.IMAGENET1K_V1), "get_state_dict", offline)
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    imagenet = ["--data", tiny_data, "--output-dir", out,
                *[a if a != "none" else "imagenet" for a in TRAIN_ARGS]]  # --pretrained-backbone imagenet
    main.main(main.get_args_parser().parse_args(imagenet + ["-e", "--resume", os.path.join(out, "best.pth")]))
    main.main(main.get_args_parser().parse_args(imagenet + ["--resume", "auto", "--epochs", "2", "--check-only",
                                                            "2"]))  # a resumed run's preflight
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a torchrun restart: continues from its checkpoint
    main.main(main.get_args_parser().parse_args(imagenet + ["--epochs", "1"]))
    # (With the tests' tiny model a fetch would not reach get_state_dict: models.py refuses imagenet for it first, and
    # main.main above would have ended in that error instead: each of the three runs finishing is the proof.)
    assert fetched == []
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    fresh = imagenet[:3] + [str(tmp_path / "fresh")] + imagenet[4:] + ["--check-only", "2"]
    line = main_fails(fresh, capsys)  # the tests' tiny model has no ImageNet weights to fetch: said, not tried
    assert "mobilenet_tiny (MobileNetV3-Small at half width) has no ImageNet weights" in line and fetched == [], line
    line = main_fails(fresh + ["--model", "deeplabv3plus_mobilenet_v3_large"], capsys)
    assert "could not download the ImageNet weights" in line and len(fetched) == 1, line  # a fresh start fetches


def _predict_fails(argv, capsys):
    import predict
    with pytest.raises(SystemExit) as exit_info:
        predict.main(predict.get_args_parser().parse_args(argv))
    assert exit_info.value.code == 1
    return one_error_line(capsys, "predict.py: error: ")


def test_predict_and_export_never_write_over_what_they_read(trained, tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper
    checkpoint = os.path.join(trained, "best.pth")
    photos = tmp_path / "photos"
    photos.mkdir()
    from PIL import Image
    Image.new("RGB", (8, 6)).save(photos / "a.png")
    notes = tmp_path / "notes.onnx"
    notes.write_text("my notes, not a model")
    other = tmp_path / "other.onnx"  # an ONNX model, but not one --export wrote
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), other)
    before = _fingerprint(trained, str(photos), str(tmp_path))
    for argv, expect in [
        (["--resume", checkpoint, str(photos), "--output-dir", checkpoint], "is a file, not a folder"),
        (["--resume", checkpoint, "--export", checkpoint], f"--export {checkpoint} would write over --resume"),
        (["--resume", checkpoint, "--export", str(photos)], f"--export {photos} is a folder: give a file name"),
        (["--resume", checkpoint, "--export", str(notes)], "exists and is not an earlier output of --export"),
        (["--resume", checkpoint, "--export", str(other)], "exists and is not an earlier output of --export"),
        (["--resume", str(tmp_path / "gone.pth"), str(photos), "--output-dir", str(tmp_path / "p")], "no such file"),
        (["--resume", checkpoint, str(tmp_path / "gone"), "--output-dir", str(tmp_path / "p")], "no such file"),
    ]:
        line = _predict_fails(argv, capsys)
        assert expect in line, (argv, line)
        assert _fingerprint(trained, str(photos), str(tmp_path)) == before  # nothing made, nothing written
    import predict
    assert not predict.is_export(str(other)) and not predict.is_export(str(notes))


def test_a_generated_data_set_never_lands_on_files(tmp_path):
    from synthetic import write_synthetic
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "photo.jpg").write_bytes(b"the user's own file")
    with pytest.raises(errors.UserError, match="is not empty: give a new or empty folder"):
        write_synthetic(str(mine), 2, 1, (32, 16))
    assert os.listdir(mine) == ["photo.jpg"]

    import synthetic
    original = synthetic._write_scene

    def interrupted(job):
        if job[3] == 1:  # the second scene
            raise KeyboardInterrupt
        original(job)
    synthetic._write_scene = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            write_synthetic(str(tmp_path / "new"), 3, 1, (32, 16))
    finally:
        synthetic._write_scene = original
    assert sorted(os.listdir(tmp_path)) == ["mine"]  # no half-written set, no temporary folder left
    write_synthetic(str(tmp_path / "new"), 3, 1, (32, 16), workers=2, unique=2)
    assert len(os.listdir(tmp_path / "new" / "leftImg8bit" / "train" / "aachen")) == 1


def test_the_decode_cache_stays_out_of_the_data_set_and_minus_j_0_means_this_process(tiny_data, tmp_path):
    from harness.cache import prepare_cache
    data = str(tmp_path / "data")
    shutil.copytree(tiny_data, data)
    before = fingerprint(data)
    with pytest.raises(errors.UserError, match="CACHE_DIR .* is inside --data"):
        prepare_cache(data, os.path.join(data, "cache"), ["val"], workers=0)
    assert fingerprint(data) == before
    prepare_cache(data, str(tmp_path / "cache"), ["val"], workers=0)  # no pool: in this process
    assert len(os.listdir(tmp_path / "cache")) == 2 * 5


def _own_data(tmp_path, masks, names=("background", "cat"), ignore=255, image_size=(6, 4), suffix=".png"):
    """A folder data set: for each split, images of image_size and these masks (lists of rows)."""
    import numpy as np
    from PIL import Image
    root = tmp_path / "own"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "masks" / split).mkdir(parents=True)
        for i, mask in enumerate(masks):
            Image.new("RGB", image_size, (100, 120, 140)).save(root / "images" / split / f"x{i}{suffix}")
            Image.fromarray(np.array(mask, np.uint8)).save(root / "masks" / split / f"x{i}.png")
    (root / "classes.json").write_text(json.dumps({"names": list(names), "ignore_index": ignore}))
    return str(root)


def test_labels_that_cannot_teach_are_said(tmp_path, capsys):
    out = str(tmp_path / "o")
    binary = [[0, 255, 255, 255, 255, 255]] * 4  # a cat mask saved as 0/255: 255 is ignore
    data = _own_data(tmp_path, [binary, binary], names=("background", "cat", "dog"))
    main.main(main.get_args_parser().parse_args(["--data", data, *TRAIN_ARGS, "--epochs", "1", "--output-dir", out]))
    said = capsys.readouterr().out
    warnings = [line for line in said.splitlines() if line.startswith("warning:") and "--crop-size" not in line
                and "also training images" not in line]  # (these splits hold the same images, said too)
    assert len(warnings) == 2, said  # before training, and training goes on (the crop's warning aside: 6x4 images)
    assert "has a pixel of 'cat', 'dog': the model cannot learn it" in warnings[0]
    assert "2 of 2 training masks are more than half ignore_index 255" in warnings[1]
    assert "save them with its class index instead" in warnings[1]
    assert said.index("warning:") < said.index("training deeplabv3plus")
    shutil.rmtree(tmp_path / "own")
    unlabelled = [[255] * 6] * 4
    data = _own_data(tmp_path, [unlabelled, [[0] * 6] * 4])
    for mask in os.listdir(os.path.join(data, "masks", "val")):  # val: nothing labelled at all
        from PIL import Image
        Image.new("L", (6, 4), 255).save(os.path.join(data, "masks", "val", mask))
    line = main_fails(["--data", data, *TRAIN_ARGS, "--check-only", "1", "--output-dir", out + "2"], capsys)
    assert "val labels of --data" in line and "hold no pixel of any class" in line, line


def test_own_data_mistakes_name_their_real_cause(tmp_path, capsys):
    import numpy as np
    from PIL import Image
    argv = [*TRAIN_ARGS, "--check-only", "1", "--output-dir", str(tmp_path / "o")]
    data = _own_data(tmp_path, [[[0, 1] * 3] * 4])
    many = {"names": [f"c{i}" for i in range(256)]}
    with open(os.path.join(data, "classes.json"), "w") as f:
        json.dump(many, f)
    line = main_fails(["--data", data, *argv], capsys)
    assert "names 256 classes, but a mask of 8 bits a pixel holds at most 255 classes beside its ignore_index" in line
    with open(os.path.join(data, "classes.json"), "w") as f:
        json.dump({"names": ["a", "b"]}, f)
    Image.new("RGB", (6, 4)).save(os.path.join(data, "images", "val", "y.webp"))
    line = main_fails(["--data", data, *argv], capsys)
    assert "y.webp: images are .jpg, .jpeg, .png files, and this format is not read" in line, line
    os.remove(os.path.join(data, "images", "val", "y.webp"))
    Image.new("L", (6, 4)).save(os.path.join(data, "masks", "val", "x0.jpg"))
    line = main_fails(["--data", data, *argv], capsys)
    assert "x0.jpg: masks are PNGs: JPEG's compression changes class indices" in line, line
    os.remove(os.path.join(data, "masks", "val", "x0.jpg"))
    exif = Image.Exif()
    exif[0x0112] = 6  # a phone photo stored 6x4, seen 4x6; its mask drawn on the stored picture
    Image.fromarray(np.zeros((4, 6, 3), np.uint8)).save(os.path.join(data, "images", "val", "x0.jpg"), exif=exif)
    os.remove(os.path.join(data, "images", "val", "x0.png"))
    line = main_fails(["--data", data, *argv], capsys)
    assert "is 6x4 but its image is 4x6 as its EXIF orientation turns it (stored 6x4)" in line, line


def test_any_size_and_any_scale_the_flags_accept(trained, tiny_data, tmp_path, capsys):
    import predict
    from PIL import Image
    photos = tmp_path / "tiny"
    photos.mkdir()
    for width, height in ((1, 1), (3, 2), (1, 40)):
        Image.new("RGB", (width, height), (90, 90, 90)).save(photos / f"{width}x{height}.png")
    predict.main(predict.get_args_parser().parse_args([
        "--resume", os.path.join(trained, "best.pth"), str(photos), "--output-dir", str(tmp_path / "p"), "-j", "0",
        "--eval-scales", "0.01", "1", "--eval-flip", "--eval-crop", "8", "--eval-stride", "1"]))
    for name, size in (("1x1", (1, 1)), ("3x2", (3, 2)), ("1x40", (1, 40))):
        with Image.open(tmp_path / "p" / "color" / f"{name}.png.png") as picture:
            assert picture.size == size
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", str(tmp_path / "e"), *TRAIN_ARGS,
                                                 "-e", "--resume", os.path.join(trained, "best.pth"),
                                                 "--eval-scales", "0.01", "--eval-crop", "8"]))
    assert "mIoU" in capsys.readouterr().out


def test_a_rewind_s_start_becomes_the_run_s_checkpoint_so_a_restart_continues_it(tmp_path):
    from types import SimpleNamespace
    out = tmp_path / "out"
    out.mkdir()
    for name, text in (("checkpoint.pth", "epoch 6"), ("checkpoint.prev.pth", "epoch 5"), ("best.pth", "epoch 3")):
        (out / name).write_text(text)
    (out / "metrics.jsonl").write_text("".join(f'{{"epoch": {e}}}\n' for e in range(6)))
    start = checkpoints.Start(str(out / "best.pth"))
    checkpoints.rewrite_run_files_at(SimpleNamespace(output_dir=str(out)), start, 3, 0)
    assert (out / "checkpoint.pth").read_text() == "epoch 3" and not (out / "checkpoint.prev.pth").exists()
    kept = {path.name.split(".rewound-")[0]: path.read_text() for path in out.iterdir() if ".rewound-" in path.name}
    assert kept == {"checkpoint": "epoch 6", "checkpoint.prev": "epoch 5", "metrics": '{"epoch": 3}\n{"epoch": 4}\n'
                    '{"epoch": 5}\n'}  # best.pth is the start: nothing to keep
    assert (out / "metrics.jsonl").read_text() == '{"epoch": 0}\n{"epoch": 1}\n{"epoch": 2}\n'


def test_a_run_rewound_to_checkpoint_prev_saves_every_epoch_after(tiny_data, trained, tmp_path, capsys):
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    # checkpoint.pth lost (the end of epoch 1, say): the run goes on from the one before it, a rewind.
    os.rename(os.path.join(out, "checkpoint.pth"), os.path.join(out, "checkpoint.prev.pth"))
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--resume",
                                                 "auto", "--epochs", "3"]))  # epochs 1 and 2, each saved
    said = capsys.readouterr().out
    assert "rewinds this run" in said and "done: best mIoU" in said and "cannot write" not in said, said
    checkpoint, previous = os.path.join(out, "checkpoint.pth"), os.path.join(out, "checkpoint.prev.pth")
    assert checkpoints.read("--resume", checkpoint)["epoch"] == 3
    assert checkpoints.read("--resume", previous)["epoch"] == 2
    assert os.stat(checkpoint).st_ino != os.stat(previous).st_ino
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")], os.listdir(out)


def test_nothing_a_killed_save_or_a_rewind_leaves_stops_a_later_save(tiny_data, trained, tmp_path, monkeypatch,
                                                                       capsys):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    path = str(out / "checkpoint.pth")
    monkeypatch.setattr(os, "getpid", lambda: 1)  # in a container every run is process 1
    # What saves killed half-way left (the second name of the checkpoint they replaced, their half-written files),
    # and a checkpoint.prev.pth that is a second name of checkpoint.pth, as a rewind to it leaves it.
    leftovers = ["checkpoint.prev.pth.1.tmp", "checkpoint.pth.tmp", "best.pth.1.tmp", "metrics.jsonl.1-0a1b2c3d.tmp"]
    for name in leftovers:
        (out / name).write_bytes(b"half")
    os.link(path, out / "checkpoint.prev.pth")
    state = torch.load(path, weights_only=True)
    stops.install(training=False)  # a run's start: nothing failed yet
    for epoch in (2, 3):
        main.save_checkpoint({**state, "epoch": epoch}, path)
        assert stops.pending_write_failure() is None
    assert torch.load(out / "checkpoint.prev.pth", weights_only=True)["epoch"] == 2
    assert "checkpoint.prev.pth.1.tmp" in os.listdir(out)  # a name no save uses again
    # The next run holds the folder: no live run writes there, and what killed saves left goes.
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS,
                                                 "--epochs", "3", "--resume", "auto"]))
    assert "nothing to train" in capsys.readouterr().out
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")], os.listdir(out)


def test_a_torchrun_restart_keeps_what_the_first_attempt_started_from(tiny_data, trained, tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    best, common = os.path.join(trained, "best.pth"), ["--data", tiny_data, *TRAIN_ARGS]
    main.main(main.get_args_parser().parse_args(common + ["--output-dir", str(tmp_path / "e"), "-e", "--resume",
                                                          best]))
    with open(tmp_path / "e" / "eval.json") as f:
        assert json.load(f)["checkpoint"] == best  # -e evaluates what it was given, restarted or not
    out = str(tmp_path / "new")  # the first attempt died before its first checkpoint
    main.main(main.get_args_parser().parse_args(common + ["--output-dir", out, "--resume", best, "--epochs", "2"]))
    said = capsys.readouterr().out
    assert f"resuming from {best} at the start of epoch 1" in said and "starting afresh" not in said, said


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


def test_out_of_memory_in_predict_py_ends_in_one_line(trained, tmp_path, monkeypatch, capsys):
    _runs_out_of_memory(monkeypatch, lambda calls, training: True)
    line = _predict_fails(["--resume", os.path.join(trained, "best.pth"), os.path.join(trained, "vis"), "-j", "0",
                           "--output-dir", str(tmp_path / "p")], capsys)
    assert line == ("predict.py: error: out of memory in a prediction (-b 4 images of one size per forward, whole, at "
                    "full resolution, fp32; GPU 0: 24.0 GiB in all, 22.5 GiB at the peak): try --amp bf16, -b 1, or "
                    "a sliding window, --eval-crop 769 (mmsegmentation's)"), line


# --- one folder, one run ------------------------------------------------------------------------------------------
HOLDER = """import sys, time, types
from harness import paths
paths.hold_output(types.SimpleNamespace(output_dir=sys.argv[1], check_only=None, evaluate=False))
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.launch
def test_a_folder_in_use_is_refused_to_another_run_and_taken_over_from_a_dead_one(tiny_data, trained, tmp_path,
                                                                                  capsys):
    import signal
    import socket
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, out], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"  # a run (a process that holds the folder as main.py does)
    before = fingerprint(out)
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS]
    try:
        for extra in (["--epochs", "2", "--resume", "auto"], ["--resume", "auto", "--check-only", "2"],
                      ["-e", "--resume", os.path.join(out, "best.pth")], ["--epochs", "1", "--overwrite"]):
            line = main_fails(common + extra, capsys)
            assert (f"--output-dir {out} is in use by another run (host {socket.gethostname()}, process "
                    f"{holder.pid}, since ") in line and "wait for it to end, or give another --output-dir" in line, line
            assert fingerprint(out) == before  # nothing of the refused run there, not even its stop record
        predictions = os.path.join(out, "predictions")  # predict.py's pictures among the files of a run that writes
        line = _predict_fails(["--resume", os.path.join(out, "best.pth"), os.path.join(out, "vis"), "--output-dir",
                               predictions, "-j", "0"], capsys)
        assert (f"--output-dir {predictions} is inside {out}, which is in use by another run (host "
                f"{socket.gethostname()}, process {holder.pid}): give another --output-dir") in line, line
        assert fingerprint(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)  # a holder that dies without letting go
        holder.communicate()
    main.main(main.get_args_parser().parse_args(common + ["--epochs", "2", "--resume", "auto"]))
    said = capsys.readouterr().out
    assert f"was held by host {socket.gethostname()}, process {holder.pid}" in said and "taken over" in said, said
    assert not os.path.exists(os.path.join(out, paths.HOLD))  # let go at the end


def test_a_new_output_folder_is_held_before_anything_in_it_is_decided(tiny_data, tmp_path, monkeypatch, capsys):
    """A run that starts slowly into a folder that does not exist yet holds it (made for it) before it decides how
    to start there: another run that would begin there meanwhile is refused, instead of finishing there unseen
    and having its best.pth and metrics replaced by this one's fresh start."""
    out = str(tmp_path / "new" / "out")
    held_while_deciding, decide = [], checkpoints.decide_start

    def deciding(args):
        held_while_deciding.append(paths._held(out))  # what another run's paths.hold_output would meet now
        return decide(args)
    monkeypatch.setattr(checkpoints, "decide_start", deciding)
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "1", "--resume", "auto"]
    line = main_fails(common + ["-b", "9"], capsys)  # a mistake found after the hold
    assert "makes a global batch of 9" in line and held_while_deciding == [True], (line, held_while_deciding)
    assert not os.path.exists(tmp_path / "new")  # the folders made for the hold, left empty, go with it
    main.main(main.get_args_parser().parse_args(common + ["--check-only", "1"]))
    assert not os.path.exists(tmp_path / "new")  # the preflight only looks
    main.main(main.get_args_parser().parse_args(common))
    assert held_while_deciding == [True, False, True] and os.path.isfile(os.path.join(out, "best.pth"))


def _chattr(flag, path):
    result = subprocess.run(["chattr", flag, str(path)], capture_output=True)
    if result.returncode:
        pytest.skip(f"chattr {flag} is not allowed here: {result.stderr.decode().strip()}")


@pytest.mark.parametrize("name, make, expect", [
    ("best.pth", os.mkdir, "is a folder, where the run writes a file of its own: move it away"),
    ("metrics.jsonl", os.mkdir, "is a folder, where the run writes a file of its own: move it away"),
    ("vis", lambda path: open(path, "w").close(), "is a file, where the run writes a folder of its own: move it away"),
    ("checkpoint.pth", os.mkdir, "is a folder, where the run writes a file of its own: move it away"),
    ("checkpoint.pth", os.mkfifo, "is a named pipe (FIFO), where the run writes a file of its own: move it away"),
    ("checkpoint.prev.pth", lambda path: _chattr("+i", path), "is marked immutable (lsattr), and the run replaces it: "
                                                            "clear the mark, chattr -i "),
    (".held", os.mkdir, "is a folder, where this program keeps its lock file (one folder, one run): remove it, then "
                        "run again"),
])
def test_what_stands_where_the_run_writes_is_named_before_any_step(name, make, expect, tiny_data, trained, tmp_path,
                                                                   capsys):
    """Found by the preflight (run.sh's --check-only too), not after an epoch of training as a failed write
    that says 'free space'; the advice followed, the run goes on."""
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    path = out / name
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists() and name != "checkpoint.prev.pth":
        path.unlink()
    if name == "checkpoint.prev.pth":
        shutil.copy(out / "checkpoint.pth", path)
    make(path)
    common = ["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "2", "--resume", "auto"]
    try:
        for extra in (["--check-only", "1"], []):
            line = main_fails(common + extra, capsys)
            assert line == f"main.py: error: {path} {expect}" + (str(path) + ", or move it away" if "chattr" in expect
                                                                  else ""), line
    finally:
        if name == "checkpoint.prev.pth":
            _chattr("-i", path)  # as the line says
    if name == ".held":
        os.rmdir(path)
    elif name != "checkpoint.prev.pth":
        os.rename(path, tmp_path / "moved away")
    if name == "checkpoint.pth":
        shutil.copy(out / "best.pth", out / "checkpoint.pth")  # (the run's checkpoint back, to go on from)
    main.main(main.get_args_parser().parse_args(common))
    assert "done: best mIoU" in capsys.readouterr().out


def test_a_checkpoint_this_user_may_not_read_or_that_is_no_file_is_named_as_such(tiny_data, trained, tmp_path,
                                                                                  monkeypatch, capsys):
    """Permission denied is said as such, not as a truncated file, and --resume auto does not rewind past it; a
    named pipe is not 'no such file'; a checkpoint.pth that links to a file kept elsewhere is the run's own."""
    import builtins
    import errno
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    checkpoint = str(out / "checkpoint.pth")
    shutil.copy(checkpoint, out / "checkpoint.prev.pth")
    before = fingerprint(out)
    common = ["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "2"]
    real_open = builtins.open

    def denied(file, *args, **kwargs):  # as a file of mode 600 owned by another user opens (this test runs as root)
        if str(file) == checkpoint:
            raise PermissionError(errno.EACCES, "Permission denied", file)
        return real_open(file, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", denied)
        line = main_fails(common + ["--resume", "auto"], capsys)
    assert line == (f"main.py: error: --resume auto: {checkpoint} cannot be read (Permission denied): give this user "
                    f"read permission (ls -l {checkpoint}; chmod u+r {checkpoint} as its owner), or copy it somewhere "
                    "this user may read it"), line
    assert fingerprint(out) == before  # not rewound to checkpoint.prev.pth
    pipe = str(tmp_path / "pipe.pth")
    os.mkfifo(pipe)
    for flag in ("--resume", "--weights"):
        line = main_fails(common + [flag, pipe, "--output-dir", str(tmp_path / "new")], capsys)
        assert line == f"main.py: error: {flag} {pipe} is a named pipe (FIFO), not a checkpoint: give a checkpoint file"
    elsewhere = str(tmp_path / "kept" / "checkpoint.pth")  # the run's checkpoint kept on another disk, say
    os.makedirs(os.path.dirname(elsewhere))
    os.replace(checkpoint, elsewhere)
    os.symlink(elsewhere, checkpoint)
    kept = fingerprint(os.path.dirname(elsewhere))
    main.main(main.get_args_parser().parse_args(common + ["--resume", "auto"]))
    said = capsys.readouterr().out
    assert f"note: {checkpoint} is a symbolic link to {elsewhere}: the run reads it" in said, said
    assert f"resuming from {checkpoint} at the start of epoch 1" in said and "done: best mIoU" in said, said
    assert not os.path.islink(checkpoint) and checkpoints.read("--resume", checkpoint)["epoch"] == 2
    assert fingerprint(os.path.dirname(elsewhere)) == kept


@pytest.mark.parametrize("moment, target", [
    ("taking the output folder", (paths, "_open_and_lock")),
    ("checking a checkpoint's CRC-32s", (__import__("zipfile").ZipFile, "testzip")),
    ("reading a checkpoint", (torch, "load")),
    ("checking the data", (__import__("dataset"), "seen_size")),
    ("building the model", (main, "build_model")),
])
def test_a_stop_at_any_moment_before_training_ends_the_run_and_changes_nothing(moment, target, tiny_data, trained,
                                                                                tmp_path, monkeypatch, capsys):
    """The stop signal, sent to this process at that moment, ends the run there: never taken for a damaged file
    by code that catches errors (the checkpoint rewound to the one before it, a good image called unreadable)."""
    import signal
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    shutil.copy(os.path.join(out, "checkpoint.pth"), os.path.join(out, "checkpoint.prev.pth"))
    before = fingerprint(out)
    owner, name = target
    real, sent = getattr(owner, name), []

    def stopped_there(*args, **kwargs):
        if not sent:
            sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode: in here
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, stopped_there)
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs",
                                                 "2", "--resume", "auto"]))
    said = capsys.readouterr()
    assert sent and "Traceback" not in said.err, said
    assert f"stopped by signal {int(signal.SIGTERM)} before training began: nothing was trained" in said.out, said
    assert not any(word in said.out + said.err for word in ("warning", "damaged", "cannot", "error")), said
    assert fingerprint(out) == before  # no rewind, nothing set aside, the folder let go


# --- a checkpoint is verified before it is trusted --------------------------------------------------------------------
def _damage(path, at=0.5):
    """4 KiB changed inside the file, as a bad copy might: torch.load still reads it."""
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * at))
        f.write(bytes(4096))


def test_a_damaged_checkpoint_is_refused_by_every_reader_and_resume_auto_falls_back(tiny_data, trained, tmp_path,
                                                                                   capsys):
    import predict
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    best = os.path.join(out, "best.pth")
    shutil.copy(os.path.join(out, "checkpoint.pth"), os.path.join(out, "checkpoint.prev.pth"))
    _damage(best)
    torch.load(best, weights_only=True)  # torch itself does not notice
    common = ["--data", tiny_data, *TRAIN_ARGS]
    damaged = f"--resume {best} is damaged: its record"
    line = main_fails(common + ["--output-dir", str(tmp_path / "e"), "-e", "--resume", best], capsys)
    assert damaged in line and "differs from the CRC-32 torch.save wrote for it" in line, line
    line = main_fails(common + ["--output-dir", str(tmp_path / "w"), "--weights", best, "--epochs", "1"], capsys)
    assert f"--weights {best} is damaged" in line, line
    for argv in ([str(tmp_path), "--output-dir", str(tmp_path / "p")], ["--export", str(tmp_path / "m.onnx")]):
        with pytest.raises(SystemExit):
            predict.main(predict.get_args_parser().parse_args(["--resume", best, *argv]))
        assert damaged in one_error_line(capsys, "predict.py: error: ")
    _damage(os.path.join(out, "checkpoint.pth"), at=0.3)
    main.main(main.get_args_parser().parse_args(common + ["--output-dir", out, "--epochs", "2", "--resume", "auto"]))
    said = capsys.readouterr().out
    assert "checkpoint.pth is damaged" in said and "using the one before it" in said, said
    assert "at the start of epoch 1" in said and "done:" in said, said


def test_a_byte_changed_anywhere_in_a_checkpoint_is_refused_or_changes_nothing(tmp_path):
    """The CRC-32s torch.save writes cover what a checkpoint holds: a byte changed anywhere (each of the first and
    last 600 bytes, where the zip's headers and directory are, and 400 places between) is refused, or leaves what
    torch.load reads exactly as it was (a byte of the records' padding, or of a header field nothing reads)."""
    path = str(tmp_path / "c.pth")
    state = {"model": {"w": torch.randn(64, 32), "b": torch.arange(7.0)}, "epoch": 3, "args": {"model": "x"}}
    torch.save(state, path)
    good = open(path, "rb").read()
    size = len(good)
    places = sorted(set(range(600)) | set(range(size - 600, size)) | {600 + i * (size - 1200) // 400 for i in range(400)})
    refused = same = 0
    for at in places:
        with open(path, "wb") as f:
            f.write(good[:at] + bytes([good[at] ^ 0x5A]) + good[at + 1:])
        try:
            checkpoints.verify("--resume", path)
            loaded = torch.load(path, weights_only=True)
        except (errors.UserError, Exception):
            refused += 1
            continue
        assert loaded.keys() == state.keys() and loaded["epoch"] == 3 and loaded["args"] == state["args"], at
        assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items()), at
        same += 1
    assert refused > len(places) // 2 and refused + same == len(places), (refused, same)
    with open(path, "wb") as f:
        f.write(good[: size // 2])  # cut short, as a copy that stopped
    with pytest.raises(errors.UserError, match="cannot be read .*: it is truncated"):
        checkpoints.read("--resume", path)


def test_a_checkpoint_without_crcs_is_read_and_said_once(trained, tmp_path, capsys):
    old = str(tmp_path / "old.pth")
    state = torch.load(os.path.join(trained, "best.pth"), weights_only=True)
    torch.serialization.set_crc32_options(False)  # as some writers save
    try:
        torch.save(state, old)
    finally:
        torch.serialization.set_crc32_options(True)
    assert checkpoints.read("--resume", old)["epoch"] == 1 and checkpoints.read("--weights", old)
    said = capsys.readouterr().out
    assert said.count(f"note: {old} carries no CRC-32s") == 1, said


# --- an earlier result is replaced only with a word; a full disk anywhere ends in one line ----------------------
def test_earlier_results_are_replaced_with_a_word_and_a_full_disk_writing_eval_json_ends_in_one_line(
        tiny_data, trained, tmp_path, monkeypatch, capsys):
    import predict
    best = os.path.join(trained, "best.pth")
    evaluate = ["--data", tiny_data, "--output-dir", str(tmp_path / "e"), *TRAIN_ARGS, "-e", "--resume", best]
    main.main(main.get_args_parser().parse_args(evaluate))
    assert "replaces" not in capsys.readouterr().out
    main.main(main.get_args_parser().parse_args(evaluate))
    assert "it replaces the earlier one (mIoU" in capsys.readouterr().out
    images = os.path.join(trained, "vis")
    for _ in range(2):
        predict.main(predict.get_args_parser().parse_args(["--resume", best, images, "-j", "0", "--output-dir",
                                                           str(tmp_path / "p")]))
    assert "holds an earlier prediction: 3 of its files are replaced" in capsys.readouterr().out

    from harness import records

    def full_disk(*args, **options):
        raise OSError(28, "No space left on device")
    for module, name in ((paths, "write_atomically"), (records, "save_picture")):  # eval.json's write, the picture's
        with monkeypatch.context() as patch:
            patch.setattr(module, name, full_disk)
            before = fingerprint(str(tmp_path / "e"))
            line = main_fails(evaluate, capsys)
        assert line == (f"main.py: error: cannot write in {tmp_path / 'e'} (no space left on device): eval.json is as "
                        "it was; free space there, or give -e another --output-dir"), line
        assert fingerprint(str(tmp_path / "e"))["eval.json"] == before["eval.json"]  # not replaced before the stop


# --- advice that works: each piece of advice a mistake's line gives, followed as it is written ------------------------
def _replace(argv, old, new):
    """argv with the flag old (the last time it is given: the one that counts) and its value, when it takes one,
    replaced by the words new."""
    at = len(argv) - 1 - argv[::-1].index(old)
    takes_value = at + 1 < len(argv) and not argv[at + 1].startswith("-")
    return argv[:at] + new + argv[at + (2 if takes_value else 1):]


def _number_in_range(line):
    """A value the line's range allows: '-b/--batch-size: 0 must be at least 1' -> ('--batch-size', '1')."""
    flag, bounds = re.search(r"(\S+): \S+ must be (.*)$", line).groups()
    low = re.search(r"(?:at least|above) ([-\d.e+]+)", bounds)
    high = re.search(r"(?:at most|below) ([-\d.e+]+)", bounds)
    value = (float(low.group(1)) + float(high.group(1))) / 2 if low and high else float(low.group(1)) + (
        "above" in bounds)
    return flag.split("/")[-1], f"{value:g}"


ADVICE = [  # (the mistake: argv after the common flags, its line's words, how its advice makes the next argv)
    pytest.param(["--amp", "fp16"], "--amp fp16 runs on CUDA only in this program",
                 lambda argv, line: _replace(argv, "--amp", re.search(r"use (--amp \w+)", line).group(1).split()),
                 id="amp-fp16-on-cpu"),
    pytest.param(["--sync-bn"], "--sync-bn needs CUDA",
                 lambda argv, line: "drop the flag" in line and _replace(argv, "--sync-bn", []), id="sync-bn-on-cpu"),
    pytest.param(["--dist-backend", "nccl"], "needs CUDA GPUs",
                 lambda argv, line: _replace(argv, "--dist-backend",
                                             re.search(r"use (--dist-backend \w+)", line).group(1).split()),
                 id="nccl-on-cpu"),
    pytest.param(["-e"], "evaluates a trained model",
                 lambda argv, line: argv + re.search(r"give it (--resume) PATH", line).group(1).split() + ["{best}"],
                 id="evaluate-without-resume"),
    pytest.param(["-e", "--resume", "{best}", "--overwrite"], "-e trains nothing",
                 lambda argv, line: _replace(argv, re.search(r"drop (--\w+)", line).group(1), []),
                 id="evaluate-with-overwrite"),
    pytest.param(["-e", "--resume", "{best}", "--tensorboard"], "-e writes eval.json",
                 lambda argv, line: _replace(argv, re.search(r"drop (--\w+)", line).group(1), []),
                 id="evaluate-with-tensorboard"),
    pytest.param(["--resume", "{best}", "--weights", "{best}"], "give one of the two",
                 lambda argv, line: _replace(argv, "--weights", []), id="resume-and-weights"),
    pytest.param(["--crop-size", "16", "-b", "1"], "too little for BatchNorm",
                 lambda argv, line: _replace(argv, "-b", re.search(r" or (-b \d+)", line).group(1).split()),
                 id="too-little-for-batchnorm"),
    pytest.param(["-b", "9"], "makes a global batch of 9",
                 lambda argv, line: _replace(argv, "-b", ["-b", re.search(r"--batch-size (\d+) or less", line)
                                                          .group(1)]),
                 id="batch-above-training-images"),
    pytest.param(["-b", "1", "--accum-steps", "9"], "makes a global batch of 9",
                 lambda argv, line: _replace(argv, "--accum-steps", re.search(r"-b 1 (--accum-steps \d+) or less",
                                                                              line).group(1).split()),
                 id="accum-steps-above-training-images"),
    pytest.param(["--check-only", "6"], "only 5 val images",
                 lambda argv, line: _replace(argv, "--check-only",
                                             ["--check-only", re.search(r"at most (\d+)", line).group(1)]),
                 id="processes-above-val-images"),
    pytest.param(["--seed", str(2**64)], "would pass 2**64 - 1",
                 lambda argv, line: _replace(argv, "--seed",
                                             ["--seed", re.search(r"--seed of at most (\d+)", line).group(1)]),
                 id="seed-past-generators"),
    pytest.param(["-b", "0"], "must be at least 1",
                 lambda argv, line: _replace(argv, "-b", ["-b", _number_in_range(line)[1]]), id="batch-size-0"),
    pytest.param(["--lr", "-1"], "must be above 0",
                 lambda argv, line: _replace(argv, "--lr", list(_number_in_range(line))), id="lr-negative"),
    pytest.param(["--momentum", "2"], "below 1",
                 lambda argv, line: _replace(argv, "--momentum", list(_number_in_range(line))), id="momentum-2"),
    pytest.param(["-e", "--resume", "{best}", "--model", "deeplabv3_mobilenet_v3_large"],
                 "holds a deeplabv3plus_mobilenet",
                 lambda argv, line: _replace(argv, "--model", re.search(r"pass (--model \S+)", line).group(1).split()),
                 id="model-not-the-checkpoint-s"),
    pytest.param(["-e", "--resume", "{bare}", "--model", "deeplabv3_mobilenet_v3_large"], "does not fit",
                 lambda argv, line: _replace(argv, "--model", re.search(r"give (--model \S+)", line).group(1).split()),
                 id="weights-only-not-of-model"),
    pytest.param(["--resume", "{bare}"], "it has weights only",
                 lambda argv, line: argv + re.search(r"evaluate it with (-e)", line).group(1).split(),
                 id="resume-weights-only-evaluate-them"),
    # No --model given: the advice names the model the weights fit, which the default does not.
    pytest.param(["--resume", "{bare}", "{no --model}"], "it has weights only",
                 lambda argv, line: argv + re.search(r"evaluate it with (-e --model \S+)", line).group(1).split(),
                 id="resume-weights-only-no-model-evaluate-them"),
    # Start afresh, from an ImageNet backbone.
    pytest.param(["-e", "--resume", "{vision}"], "holds torchvision's own DeepLab",
                 lambda argv, line: "(--pretrained-backbone) instead" in line and _replace(
                     _replace(argv, "--resume", []), "-e", []),
                 id="torchvision-deeplab-start-afresh"),
    pytest.param(["--resume", "{bare}"], "it has weights only",
                 lambda argv, line: _replace(argv, "--resume", re.search(r"fine-tune from it with (--weights \S+)",
                                                                         line).group(1).split()),
                 id="resume-weights-only-fine-tune-them"),
    pytest.param(["-e", "--resume", "auto"], "no checkpoint in",
                 lambda argv, line: _replace(argv, "--resume", re.search(r"give -e (--resume) PATH", line).group(1)
                                             .split() + ["{best}"]),
                 id="evaluate-auto-without-checkpoint"),
    pytest.param(["--pretrained-backbone", "{best}"], "holds a whole DeepLab model",
                 lambda argv, line: _replace(argv, "--pretrained-backbone", re.search(r"with (--weights \S+)", line)
                                             .group(1).split()),
                 id="whole-model-as-backbone"),
    pytest.param(["--output-dir", "{data}/out"], "which this command reads",
                 lambda argv, line: "choose a folder outside it" in line and _replace(argv, "--output-dir",
                                                                                       ["--output-dir", "{fresh}/out"]),
                 id="output-inside-data"),
]


@pytest.mark.parametrize("variables, expect", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "the environment variable RANK='x' is not a whole number of at least 0"),
    ({"LOCAL_RANK": ""}, "LOCAL_RANK='' is not a whole number of at least 0: set it as a launcher does"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK and WORLD_SIZE are set but MASTER_ADDR is not: set MASTER_ADDR and"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"},
     "MASTER_PORT='http' is not a whole number from 1 to 65535: set it to a free port"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"OMP_NUM_THREADS": "all"}, "OMP_NUM_THREADS='all' is not a whole number of at least 1: set the threads"),
    ({"TMPDIR": "/nowhere"}, "TMPDIR='/nowhere' is not a folder this process can write to"),
])
def test_the_launchers_environment_is_checked_in_one_line(variables, expect, tiny_data, tmp_path, monkeypatch,
                                                        capsys):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS], capsys)
    assert expect in line and not os.path.exists(tmp_path / "out"), line


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


@pytest.fixture(scope="module")
def advice_files(trained, tmp_path_factory):
    """The files the advice cases name (a trained run's best.pth, its weights alone, torchvision's DeepLab), written
    once for all of them: no case writes to them."""
    folder = tmp_path_factory.mktemp("advice")
    bare = str(folder / "bare.pth")  # a DeepLab's weights alone, as torch.save(model.state_dict()) writes them
    torch.save(torch.load(os.path.join(trained, "best.pth"), weights_only=True)["model"], bare)
    vision = str(folder / "torchvision.pth")
    torch.save({"backbone.0.0.weight": torch.zeros(1), "classifier.0.convs.0.0.weight": torch.zeros(1)}, vision)
    return {"best": os.path.join(trained, "best.pth"), "bare": bare, "vision": vision}


@pytest.mark.parametrize("extra, words, follow", ADVICE)
def test_each_piece_of_advice_followed_as_written_ends_that_mistake(extra, words, follow, tiny_data, advice_files,
                                                                    tmp_path, capsys):
    """Each mistake's line gives advice; the command it advises (made from the line's own words) gets past it: the
    preflight (--check-only, which writes nothing) then passes, or meets another mistake, never the same one."""
    names = {**advice_files, "data": tiny_data, "fresh": str(tmp_path)}
    common = ["--data", tiny_data, "--output-dir", str(tmp_path / "run"), *TRAIN_ARGS, "--epochs", "1"]
    argv = [word.format(**names) for word in common + (["--check-only", "1"] if "--check-only" not in extra else [])
            + extra if word != "{no --model}"]
    if "{no --model}" in extra:
        argv = _replace(argv, "--model", [])
    line = main_fails(argv, capsys)
    assert words in line, (extra, line)
    advised = follow(argv, line)
    assert advised, (extra, line)
    try:
        main.main(main.get_args_parser().parse_args([word.format(**names) for word in advised]))
        assert "error" not in capsys.readouterr().err, (extra, line, advised)
    except SystemExit as stop:
        if stop.code == errors.NOTHING_TO_TRAIN:  # past the mistake: the checks passed, and the run had finished
            assert "nothing to train" in capsys.readouterr().out, (extra, line, advised)
        else:
            assert words not in one_error_line(capsys), (extra, line, advised)


# --- a checkpoint of another version: checked whole, before any of it is used ---------------------------------------
def _another_version(trained, path, change):
    """trained's checkpoint.pth as another version of main.py (or a hand) might have left it: changed by change(its
    dict), saved at path without this version's format number, as the versions before it wrote none."""
    state = torch.load(os.path.join(trained, "checkpoint.pth"), weights_only=True)
    assert state.pop("format") == checkpoints.FORMAT  # every checkpoint this version writes says its format
    change(state)
    torch.save(state, path)
    return path


def _adam(state):
    """An optimizer of another kind, in the two groups main.py makes: Adam's state after one step, for the model the
    checkpoint holds (its one misfit is then the optimizer's kind)."""
    model = main.build_model(TRAIN_ARGS[1], 19, 16, "none")
    optimizer = torch.optim.Adam(main.make_optimizer(model, main.get_args_parser().parse_args([])).param_groups)
    main.criterion(model(torch.randn(2, 3, 32, 32)), torch.zeros(2, 32, 32, dtype=torch.long)).backward()
    optimizer.step()
    state["optimizer"] = optimizer.state_dict()


def _momentum_of_another_shape(state):
    first = min(state["optimizer"]["state"])
    state["optimizer"]["state"][first]["momentum_buffer"] = torch.zeros(3)


@pytest.mark.parametrize("change, expect", [
    (lambda s: s.update(step=2, epoch=0) or s.pop("epoch_loss_sum"), "it holds no epoch_loss_sum"),
    (lambda s: s["optimizer"]["param_groups"].append(dict(s["optimizer"]["param_groups"][1], params=[])),
     "its optimizer has 3 parameter group(s), not 2"),
    (_adam, "its optimizer is not SGD's (it holds exp_avg, exp_avg_sq, step)"),
    (_momentum_of_another_shape, "1 of its optimizer's momentum buffers fit no parameter of"),
    (lambda s: s.update(epoch="1"), "its epoch is '1', not a whole number of at least 0"),
    (lambda s: s.update(epoch=-1), "its epoch is -1, not a whole number"),
    (lambda s: s.update(best_miou=None), "its best_miou is None, neither an mIoU from 0 to 1 nor -inf"),
    (lambda s: s.update(scaler={"scale": "big"}), "its scaler is not a GradScaler's state"),
    (lambda s: s["args"].update(batch_size=0), "its args' batch_size is 0, not a whole number of at least 1"),
])
def test_a_checkpoint_of_another_version_is_refused_in_one_line_before_training(change, expect, tiny_data, trained,
                                                                               tmp_path, capsys):
    """What main.py's train() reads of a checkpoint, checked before any of it is used: one line that names what does
    not fit and which version wrote it, and whose advice (-e, or fine-tuning into a new folder) works as written."""
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    path = _another_version(trained, os.path.join(out, "checkpoint.pth"), change)
    before = fingerprint(out)
    common = ["--data", tiny_data, *TRAIN_ARGS, "--epochs", "2"]
    line = main_fails(common + ["--output-dir", out, "--resume", "auto"], capsys)
    assert f"--resume {path} cannot resume training in this version of main.py: {expect}" in line, line
    assert "(it carries no format number: an earlier version of main.py wrote it, or another program)" in line, line
    assert fingerprint(out) == before  # nothing trained, nothing written
    if expect.startswith("its optimizer is not SGD's"):  # the advice, the same in every case, followed once
        advised = re.search(r"fine-tuning into a new run: (--weights \S+) --output-dir NEW$", line).group(1).split()
        main.main(main.get_args_parser().parse_args(common[:-1] + ["1", "--output-dir", str(tmp_path / "new"),
                                                                   *advised]))
        assert os.path.isfile(tmp_path / "new" / "checkpoint.pth")
        main.main(main.get_args_parser().parse_args(common + ["--output-dir", out, "-e", "--resume", path]))
        assert "mIoU" in capsys.readouterr().out


def test_an_older_checkpoint_that_is_whole_still_resumes_and_a_new_one_says_its_format(tiny_data, trained, tmp_path,
                                                                                      capsys):
    """A checkpoint without the format number (every version before it) resumes when what it holds fits: without
    epoch_loss_sum at an epoch's start (it is 0 there), its classes without colours (predict.py draws them in
    Cityscapes' own). What the run writes next says this version's format."""
    import predict
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    _another_version(trained, os.path.join(out, "checkpoint.pth"),
                     lambda s: s.pop("epoch_loss_sum") and s["classes"].pop("colors"))
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs",
                                                 "2", "--resume", "auto"]))
    assert "resuming from" in capsys.readouterr().out
    for name in ("checkpoint.pth", "best.pth"):
        assert checkpoints.read("--resume", os.path.join(out, name))["format"] == checkpoints.FORMAT
    colourless = _another_version(trained, str(tmp_path / "colourless.pth"), lambda s: s["classes"].pop("colors"))
    predict.main(predict.get_args_parser().parse_args([os.path.join(tiny_data, "leftImg8bit", "val"), "--resume",
                                                       colourless, "-j", "0", "--output-dir", str(tmp_path / "p")]))
    assert len(os.listdir(tmp_path / "p" / "color")) == 3  # 5 images in 3 city folders


def test_a_step_past_the_end_of_its_epoch_finishes_that_epoch(tiny_data, trained, tmp_path, capsys):
    """A position past the steps an epoch has now (fewer training images than when it was saved, or a larger global
    batch): that epoch's training is done; it is evaluated and saved, and said, not trained past its end."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    _another_version(trained, os.path.join(out, "checkpoint.pth"), lambda s: s.update(epoch=0, step=100))
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs",
                                                 "1", "--resume", "auto"]))
    said = capsys.readouterr().out
    assert ("is at step 100 of epoch 0, and an epoch has 4 steps now (8 training images, a global batch of 2): epoch "
            "0's training is done; it is evaluated and saved") in said, said
    assert "epoch 0 step" not in said  # no step trained
    saved = checkpoints.read("--resume", os.path.join(out, "checkpoint.pth"))
    assert (saved["epoch"], saved["step"]) == (1, 0)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["epoch"] for line in f] == [0]


@pytest.mark.parametrize("reader", ["--resume", "-e", "--weights", "predict.py"])
def test_a_newer_version_s_checkpoint_is_named_as_such_by_every_reader(reader, tiny_data, trained, tmp_path, capsys):
    """A checkpoint of a newer version (a model this one does not build, a higher format number) is said to be one,
    not sent to a --model this version refuses, nor called another network."""
    import predict
    for number, change in enumerate([lambda s: s.update(format=checkpoints.FORMAT + 1),
                                     lambda s: s["args"].update(model="deeplabv3plus_resnet152")]):
        path = _another_version(trained, str(tmp_path / f"newer{number}.pth"), change)
        argv = {"--resume": ["--resume", path, "--epochs", "2"], "-e": ["-e", "--resume", path],
                "--weights": ["--weights", path]}.get(reader)
        if argv is None:
            with pytest.raises(SystemExit):
                predict.main(predict.get_args_parser().parse_args([tiny_data, "--resume", path]))
            line = one_error_line(capsys, "predict.py: error: ")
        else:
            line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, *argv], capsys)
        flag = "--weights" if reader == "--weights" else "--resume"
        assert (f"{flag} {path} was written by a newer version of this program (checkpoint format "
                f"{checkpoints.FORMAT + 1}; this one reads up to {checkpoints.FORMAT}): use that version" in line
                if number == 0 else
                f"{flag} {path} is not a checkpoint this version of main.py reads: its model is "
                "'deeplabv3plus_resnet152', which this version does not build" in line), line
        assert not any(words in line for words in ("pass --model", "give --model", "--model deeplabv3plus_resnet101"))


def test_a_line_names_where_the_model_it_builds_came_from(tiny_data, trained, tmp_path, capsys):
    """No '--model NAME was given' when none was typed: the default, or the checkpoint's own, is said as such; and the
    advice (give --model) works."""
    path = _another_version(trained, str(tmp_path / "no_args.pth"), lambda s: s.pop("args"))
    common = ["--data", tiny_data, "--output-dir", str(tmp_path / "e"), *TRAIN_ARGS, "-e", "--resume", path]
    typed = common.index("--model")
    line = main_fails(common[:typed] + common[typed + 2:], capsys)
    assert (f"--resume {path} does not fit deeplabv3plus_resnet101, the default model (no --model given, and it names "
            "none)") in line, line
    advised = re.search(r"give (--model \S+)$", line).group(1).split()
    main.main(main.get_args_parser().parse_args(common[:typed] + common[typed + 2:] + advised))
    assert "mIoU" in capsys.readouterr().out
    line = main_fails(common[:typed] + ["--model", "deeplabv3_resnet50"] + common[typed + 2:] + ["--resume",
                       os.path.join(trained, "best.pth")], capsys)
    assert "holds a deeplabv3plus_mobilenet_tiny model, but --model deeplabv3_resnet50 was given" in line, line


# --- what rank 0 writes beside the checkpoint: nothing of the user's, nor the trained epoch, lost -------------------
def test_lines_a_user_added_to_metrics_jsonl_are_kept_on_resume(tiny_data, trained, tmp_path, capsys):
    """metrics.jsonl's lines that are no record of this program (a note a user added, even one without its newline)
    stay where they were when a run resumes; the records of the epochs it does again go, and the next record starts
    on a line of its own."""
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('# lr lowered by hand from here\n{"note": "a JSON note of mine"}\n{"epoch": 1, "iteration": 8, '
                '"miou": 0.5}\nlast note, no newline')
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs",
                                                 "2", "--resume", "auto"]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = f.read().splitlines()
    assert [line[:11] for line in lines] == ['{"epoch": 0', "# lr lowere", '{"note": "a', "last note, ",
                                             '{"epoch": 1'], lines  # the stale record of epoch 1 gone, redone


def test_save_predictions_never_replaces_a_data_set_s_files(tiny_data, folder_data, trained, tmp_path, capsys):
    """--save-predictions inside any data set (not only --data: another one's masks are its ground truth), or in a
    folder holding files the predictions would replace that no --save-predictions wrote, is refused before any
    work; predictions written there before (each PNG says what wrote it) are written again."""
    other, copy = str(tmp_path / "other"), str(tmp_path / "copy")
    shutil.copytree(folder_data, other)
    shutil.copytree(os.path.join(folder_data, "masks", "val"), copy)  # masks, in a folder of no data set
    before = fingerprint(other), fingerprint(copy)
    common = ["--data", folder_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--epochs", "1"]
    line = main_fails(common + ["--save-predictions", os.path.join(other, "masks", "val")], capsys)
    assert (f"--save-predictions {os.path.join(other, 'masks', 'val')} is inside the data set {other} (it holds "
            "classes.json): predictions would land among its files") in line, line
    line = main_fails(common + ["--save-predictions", copy], capsys)
    assert (f"--save-predictions {copy} holds 5 file(s) that the predictions would replace (e.g. {copy}/") in line
    assert "which no --save-predictions wrote: give a new or empty folder" in line, line
    assert (fingerprint(other), fingerprint(copy)) == before and not os.path.exists(tmp_path / "out")
    evaluate = ["--data", tiny_data, "--output-dir", str(tmp_path / "e"), *TRAIN_ARGS, "-e", "--resume",
                os.path.join(trained, "best.pth"), "--save-predictions", str(tmp_path / "new")]
    city = str(tmp_path / "city")  # another Cityscapes: its gtFine/val/ is its ground truth
    shutil.copytree(tiny_data, city)
    line = main_fails(evaluate[:-1] + [os.path.join(city, "gtFine", "val")], capsys)
    assert f"is inside the data set {city} (it holds leftImg8bit)" in line, line
    for _ in range(2):  # the advice followed, twice: the second replaces what the first wrote
        main.main(main.get_args_parser().parse_args(evaluate))
        assert len(glob.glob(str(tmp_path / "new" / "*_pred_labelIds.png"))) == 5




def test_a_full_disk_under_save_predictions_or_tensorboard_keeps_the_trained_epoch(tiny_data, trained, tmp_path,
                                                                                  monkeypatch, capsys):
    """Predictions or TensorBoard's curves that cannot be written (a full disk there) cost those, not the epoch: its
    checkpoint is saved; the predictions end the run in one line whose advice writes them."""
    from torch.utils.tensorboard import SummaryWriter
    import dataset
    out, predictions = str(tmp_path / "out"), str(tmp_path / "predictions")
    common = ["--data", tiny_data, *TRAIN_ARGS, "--epochs", "1"]
    with monkeypatch.context() as patch:
        patch.setattr(dataset.Cityscapes, "save_prediction", no_space)
        patch.setattr(SummaryWriter, "add_image", no_space)
        line = main_fails(common + ["--output-dir", out, "--save-predictions", predictions, "--tensorboard"], capsys)
    checkpoint, free = os.path.join(out, "checkpoint.pth"), re.search(r"; (\d+) MiB free", line).group(1)
    assert line == (f"main.py: error: cannot write 5 prediction(s) in {predictions} (no space left on device; "
                    f"{free} MiB free there when it failed): the last epoch's "
                    f"checkpoint, {checkpoint}, is kept; free space there, then write them from it: -e --resume {checkpoint} "
                    f"--data {tiny_data} --output-dir {out} --save-predictions {predictions}"), line
    assert checkpoints.read("--resume", checkpoint)["epoch"] == 1 and os.listdir(predictions) == []
    advised = line.split("write them from it: ")[1].split()
    main.main(main.get_args_parser().parse_args(TRAIN_ARGS + advised))
    assert len(os.listdir(predictions)) == 5
    monkeypatch.setattr(dataset.Cityscapes, "save_prediction", no_space)  # -e: eval.json is written, then the line
    line = main_fails(["--data", tiny_data, *TRAIN_ARGS, "-e", "--resume", checkpoint, "--output-dir",
                        str(tmp_path / "e"), "--save-predictions", predictions], capsys)
    assert "the evaluation is in eval.json; free space there, then run the same command again" in line, line
    assert os.path.isfile(tmp_path / "e" / "eval.json")


def test_a_full_disk_before_the_first_checkpoint_gives_advice_that_works(tiny_data, tmp_path, monkeypatch, capsys):
    """The epoch's picture cannot be written and no checkpoint was kept yet: the advice is to start again with
    --overwrite (resuming would find no checkpoint and refuse the files the epoch wrote), and it works."""
    from harness import records
    argv = ["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--epochs", "1"]
    with monkeypatch.context() as patch:
        patch.setattr(records, "save_picture", no_space)
        line = main_fails(argv, capsys)
    assert ("(no space left on device; " in line and line.endswith(
        "no checkpoint was kept. Free space there, then start again: the same command with --overwrite (what this "
        "epoch wrote is put aside)")), line
    main.main(main.get_args_parser().parse_args(argv + ["--overwrite"]))
    assert os.path.isfile(tmp_path / "out" / "checkpoint.pth")


@pytest.mark.parametrize("layout, folder", [("cityscapes", ("leftImg8bit", "val")), ("cityscapes", ("gtFine", "val")),
                                            ("folder", ("masks", "train"))])
def test_a_data_folder_that_cannot_be_listed_is_named_in_one_line(layout, folder, tiny_data, folder_data, tmp_path,
                                                                  monkeypatch, capsys):
    """A folder of the data set this user may not read (permission denied) is named, with errno's advice, instead of
    a traceback (os.listdir) or images left out without a word (os.walk, glob); given the permission, the run goes
    on. As root, who may read anything, the refusal is made by os.listdir and os.scandir themselves."""
    data = str(tmp_path / "data")
    shutil.copytree(tiny_data if layout == "cityscapes" else folder_data, data)
    top = os.path.join(data, *folder)
    unreadable = os.path.join(top, sorted(os.listdir(top))[0]) if layout == "cityscapes" else top  # a city, or masks
    argv = ["--data", data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--check-only", "1"]
    with monkeypatch.context() as patch:
        if os.geteuid() != 0:
            os.chmod(unreadable, 0)
        for name in ("listdir", "scandir") if os.geteuid() == 0 else ():
            def refuse(path=".", real=getattr(os, name)):
                if os.path.abspath(path) == unreadable:
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
                return real(path)
            patch.setattr(os, name, refuse)
        line = main_fails(argv, capsys)
    assert line == (f"main.py: error: {unreadable} cannot be listed (Permission denied): give the user that runs "
                    f"training permission to read it and the folders in it (ls -ld {unreadable}: its owner and mode)")
    os.chmod(unreadable, 0o755)  # the advice followed (as root: the refusal taken away with the patch)
    main.main(main.get_args_parser().parse_args(argv))  # --check-only: every check passes
    assert "error" not in capsys.readouterr().err


def test_val_images_that_are_also_training_images_are_said_before_training(tiny_data, tmp_path, capsys):
    """Val images with the bytes of a training image (copied under another name) make the val mIoU a measure of
    memory: a warning before training says how many, with an example pair. A set without any says nothing."""
    from dataset import open_dataset
    from harness import preflight
    assert preflight._val_images_in_train(open_dataset(tiny_data, "train"), open_dataset(tiny_data, "val")) == []
    data = str(tmp_path / "data")
    shutil.copytree(tiny_data, data)
    trains = sorted(glob.glob(os.path.join(data, "leftImg8bit", "train", "*", "*_leftImg8bit.png")))[:2]
    for number, image in enumerate(trains):  # into a val city of their own, under new names
        for sub, suffix in (("leftImg8bit", "leftImg8bit"), ("gtFine", "gtFine_labelIds")):
            source = image.replace("leftImg8bit", sub, 1).replace("leftImg8bit.png", f"{suffix}.png")
            os.makedirs(os.path.join(data, sub, "val", "copied"), exist_ok=True)
            shutil.copy(source, os.path.join(data, sub, "val", "copied", f"copied_000000_00000{number}_{suffix}.png"))
    main.main(main.get_args_parser().parse_args(["--data", data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS,
                                                 "--epochs", "1"]))
    said = capsys.readouterr().out
    assert (f"warning: 2 of the 7 val images of --data {data} are also training images, byte for byte (e.g. "
            f"{data}/leftImg8bit/val/copied/copied_000000_000000_leftImg8bit.png and {trains[0]})") in said, said
    assert said.index("are also training images") < said.index("training deeplabv3plus")  # before any step


def test_a_save_over_a_checkpoint_pth_that_links_to_checkpoint_prev_keeps_the_file_it_led_to(tmp_path):
    """checkpoint.pth a symbolic link to checkpoint.prev.pth: the save keeps the file itself as the previous one
    (a second name of the link would have replaced it with a link to itself, and the old checkpoint was gone)."""
    def save(state, path):  # main.py's way: a temporary file renamed over the checkpoint
        with open(path + ".tmp", "wb") as f:
            torch.save(state, f)
        os.replace(path + ".tmp", path)
    path, prev = str(tmp_path / "checkpoint.pth"), str(tmp_path / "checkpoint.prev.pth")
    torch.save({"epoch": 1}, prev)
    os.symlink("checkpoint.prev.pth", path)
    checkpoints.keeping_previous(save)({"epoch": 2}, path)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.prev.pth", "checkpoint.pth"]
    assert not os.path.islink(path) and not os.path.islink(prev)
    assert torch.load(prev)["epoch"] == 1 and torch.load(path)["epoch"] == 2


class _Calls:
    """An object whose unpickling would call os.mkdir: what a checkpoint carrying code does."""

    def __init__(self, folder):
        self.folder = folder

    def __reduce__(self):
        return os.mkdir, (self.folder,)


@pytest.mark.parametrize("carried, saved", [("call", "zip"), ("object", "zip"), ("object", "zip without CRC-32s"),
                                            ("object", "legacy")])
def test_a_checkpoint_carrying_code_or_objects_is_named_so_not_called_truncated(trained, tmp_path, carried, saved):
    """torch.load(weights_only=True) refuses both; the line says what the file holds, judged by its pickle (whole),
    not by the words of torch's message: a call to a function torch blocks (os.mkdir) was called truncated. A zip
    file saved without CRC-32s, and torch's legacy format, are named so too. Nothing in it ran."""
    ran = str(tmp_path / "ran")
    state = torch.load(os.path.join(trained, "best.pth"), weights_only=True)
    state["extra"] = _Calls(ran) if carried == "call" else argparse.Namespace(lr=0.1)
    path = str(tmp_path / "carrying.pth")
    torch.serialization.set_crc32_options(saved != "zip without CRC-32s")
    try:
        torch.save(state, path, _use_new_zipfile_serialization=saved != "legacy")
    finally:
        torch.serialization.set_crc32_options(True)
    with pytest.raises(errors.UserError, match="holds Python objects beyond plain data, which torch.load"
                                               r"\(weights_only=True\) refuses: not loaded"):
        checkpoints.read("--resume", path)
    assert not os.path.exists(ran)


def test_no_write_follows_a_link_left_where_the_run_writes(tiny_data, trained, tmp_path, monkeypatch, capsys):
    """A shared run folder, or a restored backup, may hold symbolic links at the names a run writes. The lock record
    and metrics.jsonl, which the run writes into, are named before any step; the files it replaces (an epoch's picture,
    the checkpoint's temporary file) are made anew or refused, never written through. The file the links lead to stays
    as it was."""
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's own notes")
    common = ["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "2", "--resume", "auto"]
    for name, then in ((".held", "where this program keeps its lock file (one folder, one run): remove the link, "
                                 "then run again"),
                       ("metrics.jsonl", "and the run appends to it: move it away, or replace it with a copy of the "
                                         "file it leads to")):
        link = out / name
        if link.exists():
            os.rename(link, tmp_path / "kept")
        os.symlink(notes, link)
        assert main_fails(common, capsys) == f"main.py: error: {link} is a symbolic link (to {notes}), {then}"
        os.remove(link)
        if (tmp_path / "kept").exists():
            os.rename(tmp_path / "kept", link)
    os.symlink(notes, out / "vis" / "epoch_001.png")
    main.main(main.get_args_parser().parse_args(common))
    assert "done: best mIoU" in capsys.readouterr().out
    assert notes.read_text() == "a user's own notes"
    from PIL import Image
    picture = out / "vis" / "epoch_001.png"
    assert not os.path.islink(picture) and Image.open(picture).format == "PNG"
    assert checkpoints.read("--resume", str(out / "checkpoint.pth"))["epoch"] == 2
    # main.py's own save, at the temporary name it will use (its clock held still): refused, not written through.
    path = str(out / "checkpoint.pth")
    monkeypatch.setattr(main.time, "time_ns", lambda: 42)
    os.symlink(notes, f"{path}.{os.getpid()}-42.tmp")
    with pytest.raises(FileExistsError):
        main.save_checkpoint.__wrapped__({"epoch": 3}, path)  # (the lesson's function, without the harness's wrapper)
    assert notes.read_text() == "a user's own notes"
    assert checkpoints.read("--resume", path)["epoch"] == 2


def test_saves_work_where_the_filesystem_makes_no_hard_links_and_a_name_it_refuses_is_named(tiny_data, trained,
                                                                                             tmp_path, monkeypatch,
                                                                                             capsys):
    """FAT, exFAT, SMB and many FUSE mounts: link(2) says EPERM, and the calls that copy permissions and times fail
    too. Every save keeps the checkpoint before it (a copy of its bytes), a rewind keeps what it drops, and nothing is
    called a permission problem; a name such a filesystem refuses (vfat: EINVAL for a ':') is named as such."""
    def refused(*args, **kwargs):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    with monkeypatch.context() as fat:
        for name in ("link", "chmod", "utime"):
            fat.setattr(os, name, refused)
        main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS,
                                                     "--epochs", "3", "--resume", "auto"]))
        assert "cannot write" not in capsys.readouterr().out
        assert checkpoints.read("--resume", str(out / "checkpoint.pth"))["epoch"] == 3
        assert checkpoints.read("--resume", str(out / "checkpoint.prev.pth"))["epoch"] == 2
        # A rewind to the checkpoint before: what it drops is kept under names that say so.
        from types import SimpleNamespace
        checkpoints.rewrite_run_files_at(SimpleNamespace(output_dir=str(out)),
                                         checkpoints.Start(str(out / "checkpoint.prev.pth")), 2, 0)
        kept = [name for name in os.listdir(out) if ".rewound-" in name]
        assert sorted(name.split(".rewound-")[0] for name in kept) == ["best", "checkpoint", "metrics"], kept

    real_mkdir = os.mkdir

    def vfat_mkdir(path, *args, **kwargs):
        if ":" in os.path.basename(path):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", vfat_mkdir)
    named = tmp_path / "run:1"
    line = main_fails(["--data", tiny_data, "--output-dir", str(named), *TRAIN_ARGS], capsys)
    assert line == (f"main.py: error: --output-dir {named} cannot be made (Invalid argument): its filesystem refuses "
                    "the name run:1 (FAT, exFAT and SMB allow none of \\ : * ? \" < > | in a name): choose another "
                    "name, or choose another folder"), line
    # A ':' in a folder this user may not write, on a filesystem that takes it: a permission, as it is.
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)  # (root may write anywhere: this user may not)
    advice = paths.what_to_do(OSError(errno.EACCES, "Permission denied", str(named)), str(named))
    assert advice == f"give this user write permission to {tmp_path} and the files in it (ls -l {tmp_path})", advice


def test_a_checkpoint_changed_between_its_check_and_main_py_s_read_of_it_is_refused(tiny_data, trained, tmp_path,
                                                                                      monkeypatch, capsys):
    """The preflight verifies --resume (CRC-32s, contents), then main.py's lesson loads it again: a file replaced
    in between (another job's save, a copy landing) would be trained from unchecked. It is refused in one line."""
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    real_load = torch.load

    def replaced_first(path, *args, **kwargs):
        if "mmap" not in kwargs:  # main.py's own torch.load (the preflight's read() maps the file)
            shutil.copy(out / "best.pth", str(path) + ".new")
            os.replace(str(path) + ".new", path)
        return real_load(path, *args, **kwargs)
    monkeypatch.setattr(torch, "load", replaced_first)
    checkpoint = out / "checkpoint.pth"
    line = main_fails(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "2", "--resume",
                       str(checkpoint)], capsys)
    assert line == (f"main.py: error: --resume {checkpoint} changed after this run checked it (replaced, or written "
                    "to, as the run started): run again once nothing writes it"), line


def test_predict_s_output_dir_and_save_predictions_are_held_while_written(tiny_data, trained, tmp_path, monkeypatch,
                                                                          capsys):
    """One folder, one run, for every writer: predict.py holds its --output-dir, and a run its --save-predictions,
    while it writes there, so that a second run into either is refused (the refusal's line: the test above)."""
    import predict
    from harness import records
    seen = []
    real_write = paths.write_atomically

    def noting(path, *args, **kwargs):
        seen.append(paths._held(os.path.dirname(os.path.dirname(path))))  # predictions/color/NAME.png
        return real_write(path, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(paths, "write_atomically", noting)
        predict.main(predict.get_args_parser().parse_args(["--resume", os.path.join(trained, "best.pth"),
                                                           os.path.join(trained, "vis"), "-j", "0", "--output-dir",
                                                           str(tmp_path / "p")]))
    assert seen and all(seen) and not paths._held(str(tmp_path / "p")), seen  # held while written, let go after
    predictions = str(tmp_path / "predictions")
    watch = records.watch_predictions

    def noting_predictions(val_set):
        save = val_set.save_prediction

        def save_noting(index, prediction, folder):
            seen.append(paths._held(folder))
            save(index, prediction, folder)
        val_set.save_prediction = save_noting
        watch(val_set)
    seen.clear()
    monkeypatch.setattr(records, "watch_predictions", noting_predictions)
    main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", str(tmp_path / "e"),
                                                 *TRAIN_ARGS, "-e", "--resume", os.path.join(trained, "best.pth"),
                                                 "--save-predictions", predictions]))
    assert seen and all(seen) and not paths._held(predictions) and os.listdir(predictions), seen


def test_a_lock_record_copied_with_its_folder_is_not_taken_for_a_killed_run(tiny_data, trained, tmp_path, capsys):
    """A backup (cp -a) of a folder a run holds copies its .held, whose record names a live process of this host.
    The copy's next run takes it over without calling that process killed; a record whose process id now belongs to
    a process started later (a process id used again) is a killed run's, and said so."""
    import socket
    for started, said in ((paths._started(os.getpid()), False), (1, True)):
        out = tmp_path / f"copy-{said}"
        shutil.copytree(trained, out)
        (out / paths.HOLD).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                  "started": started, "since": "2026-12-01 10:00:00"}))
        main.main(main.get_args_parser().parse_args([*TRAIN_ARGS, "--data", tiny_data, "--output-dir", str(out), "-e",
                                                     "--resume", str(out / "best.pth")]))  # (-e holds it too)
        output = capsys.readouterr().out
        assert ("which ended without letting go" in output) == said and "mIoU" in output, output


def test_a_folder_whose_first_save_was_killed_is_started_again_by_the_same_command(tiny_data, trained, tmp_path,
                                                                                   capsys):
    """Killed during the first epoch's checkpoint: best.pth and metrics.jsonl were written, no checkpoint. The same
    command (run.sh, a requeued Slurm job: --resume auto) starts the run again, saying so, with those files moved
    aside; a folder that holds more than that is still refused."""
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    (out / "checkpoint.pth").unlink()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 0, "itera')  # (a second write of epoch 0's line, cut short by the kill)
    command = ["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "1", "--resume", "auto"]
    main.main(main.get_args_parser().parse_args(command))
    said = capsys.readouterr().out
    assert (f"note: {out} held only what a first epoch stopped before its checkpoint wrote: the run starts again from "
            f"the beginning, and those files are now in {out}/replaced-") in said and "done: best mIoU" in said, said
    assert checkpoints.read("--resume", str(out / "checkpoint.pth"))["epoch"] == 1
    moved = [name for name in os.listdir(out) if name.startswith("replaced-")]
    assert sorted(os.listdir(out / moved[0])) == ["best.pth", "metrics.jsonl", "vis"]
    # Two epochs' lines: not a first epoch's alone, refused as before.
    (out / "checkpoint.pth").unlink()
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"epoch": 1}) + "\n")
    assert "holds another run (best.pth, metrics.jsonl), no checkpoint to continue from" in main_fails(command, capsys)


def test_a_mid_epoch_resume_on_another_training_list_ends_that_epoch_and_says_so(tiny_data, trained, tmp_path,
                                                                                  capsys):
    """A checkpoint keeps its training list's count and fingerprint. Images added (or swapped) between a stop
    part-way through an epoch and its resume would have the rest of that epoch's shuffle show some images twice and
    others never: the epoch's training ends where it stopped, said, and the next draws from the new list."""
    from dataset import open_dataset
    assert torch.load(os.path.join(trained, "checkpoint.pth"), weights_only=True)["train_list"] == {
        "images": 8, "fingerprint": checkpoints.training_list(open_dataset(tiny_data, "train"), tiny_data)["fingerprint"]}
    # (On the same list a resume goes on at its step: the bitwise mid-epoch resumes of test_recovery.py show it.)
    for other in ({"images": 12, "fingerprint": "0123456789abcdef"}, {"images": 8, "fingerprint": "0123456789abcdef"}):
        out = tmp_path / f"out-{len(os.listdir(tmp_path))}"
        shutil.copytree(trained, out)
        checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
        checkpoint["step"] = 1  # stopped after step 1 of epoch 1's 4
        checkpoint["train_list"] = other
        torch.save(checkpoint, out / "checkpoint.pth")
        main.main(main.get_args_parser().parse_args(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS,
                                                     "--epochs", "2", "--resume", "auto"]))
        output = capsys.readouterr().out
        note = (f"note: {out / 'checkpoint.pth'} was saved part-way through epoch 1 on another training list ("
                + ("12 images then, 8 now" if other["images"] == 12 else "8 images then and now, not the same ones")
                + "): epoch 1's training ends at its step 1 (the rest of its shuffle is of the old list); it is "
                  "evaluated and saved, and epoch 2 draws from this list")
        assert note in output and "done: best mIoU" in output, output
        assert f"resuming from {out / 'checkpoint.pth'} at epoch 1 after step 4 " in output, output
