"""harness/paths.py: every path a program writes, checked in one place: nothing the user made is written over,
nothing lands in the data set, a failed write says why from its errno, and one output folder holds one run."""
import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import main
from harness import checkpoints, errors, paths, stops
from conftest import ROOT, TRAIN_ARGS, fingerprint, fingerprints, main_fails, run_main


pytestmark = pytest.mark.usefixtures("on_the_cpu")


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
    said = run_main(common + ["--overwrite"], capsys)  # as ./run.sh --overwrite runs it
    [moved] = [os.path.join(previous_run, name) for name in os.listdir(previous_run) if name.startswith("replaced-")]
    assert "resuming" not in said and f"is now in {moved}" in said, said
    assert fingerprint(moved) == before  # nothing deleted: the old run whole, pictures included, beside the new one
    with open(os.path.join(previous_run, "metrics.jsonl")) as f:
        assert [line.startswith('{"epoch": 0') for line in f] == [True]  # the new run's lines only
    assert os.listdir(os.path.join(previous_run, "vis")) == ["epoch_000.png"]
    assert checkpoints.read("--resume", os.path.join(previous_run, "best.pth"))["epoch"] == 1


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


def test_the_data_set_is_never_where_the_run_writes(tiny_data, previous_run, capsys):
    data = os.path.join(previous_run, "vis", "data")  # a place the run writes into, and --overwrite moves aside
    shutil.copytree(tiny_data, data)
    before = fingerprint(previous_run)
    for extra in ([], ["--overwrite"], ["--check-only", "1"]):
        line = main_fails(["--data", data, "--output-dir", previous_run, *TRAIN_ARGS, *extra], capsys)
        assert f"--data {data} is inside {os.path.join(previous_run, 'vis')}, where the run writes" in line, line
        assert fingerprint(previous_run) == before


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


def test_missing_folders_are_made_and_a_place_that_cannot_be_is_named(tiny_data, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    line = main_fails(["--data", tiny_data, "--output-dir", str(blocker / "runs" / "x"), *TRAIN_ARGS], capsys)
    assert f"cannot be written ({blocker} is a file)" in line, line
    out = tmp_path / "runs" / "deep" / "x"
    run_main(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--check-only", "1"])
    assert not out.exists()  # the preflight writes nothing
    run_main(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "1", "--save-predictions",
              str(tmp_path / "p" / "q")])
    assert (out / "best.pth").is_file() and len(os.listdir(tmp_path / "p" / "q")) == 5


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
    before = fingerprints(trained, str(photos), str(tmp_path))
    for argv, expect in [
        (["--resume", checkpoint, str(photos), "--output-dir", checkpoint], "is a file, not a folder"),
        (["--resume", checkpoint, "--export", checkpoint], f"--export {checkpoint} would write over --resume"),
        (["--resume", checkpoint, "--export", str(photos)], f"--export {photos} is a folder: give a file name"),
        (["--resume", checkpoint, "--export", str(notes)], "exists and is not an earlier output of --export"),
        (["--resume", checkpoint, "--export", str(other)], "exists and is not an earlier output of --export"),
        (["--resume", str(tmp_path / "gone.pth"), str(photos), "--output-dir", str(tmp_path / "p")], "no such file"),
        (["--resume", checkpoint, str(tmp_path / "gone"), "--output-dir", str(tmp_path / "p")], "no such file"),
    ]:
        line = main_fails(argv, capsys, program="predict")
        assert expect in line, (argv, line)
        assert fingerprints(trained, str(photos), str(tmp_path)) == before  # nothing made, nothing written
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
        line = main_fails(["--resume", os.path.join(out, "best.pth"), os.path.join(out, "vis"), "--output-dir",
                           predictions, "-j", "0"], capsys, program="predict")
        assert (f"--output-dir {predictions} is inside {out}, which is in use by another run (host "
                f"{socket.gethostname()}, process {holder.pid}): give another --output-dir") in line, line
        assert fingerprint(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)  # a holder that dies without letting go
        holder.communicate()
    said = run_main(common + ["--epochs", "2", "--resume", "auto"], capsys)
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
    run_main(common + ["--check-only", "1"])
    assert not os.path.exists(tmp_path / "new")  # the preflight only looks
    run_main(common)
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
    ("checkpoint.prev.pth", lambda path: _chattr("+i", path), "is marked immutable (lsattr): clear it with chattr -i "),
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
    run_main(common)
    assert "done: best mIoU" in capsys.readouterr().out


def test_no_write_follows_a_link_left_where_the_run_writes(tiny_data, trained, tmp_path, monkeypatch, capsys):
    """A shared run folder, or a restored backup, may hold symbolic links at the names a run writes. The lock record,
    which the run writes into, is named before any step; the files it replaces (an epoch's picture, metrics.jsonl,
    the checkpoint's temporary file) are made anew or refused, never written through. The file the links lead to
    stays as it was."""
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's own notes")
    common = ["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "2", "--resume", "auto"]
    link = out / ".held"
    os.symlink(notes, link)
    assert main_fails(common, capsys) == (f"main.py: error: {link} is a symbolic link (to {notes}), where this program "
                                          "keeps its lock file (one folder, one run): remove it, then run again")
    os.remove(link)
    os.symlink(notes, out / "vis" / "epoch_001.png")
    os.replace(out / "metrics.jsonl", tmp_path / "metrics.jsonl")  # the run's lines, kept elsewhere and linked to
    lines = (tmp_path / "metrics.jsonl").read_bytes()
    os.symlink(tmp_path / "metrics.jsonl", out / "metrics.jsonl")
    run_main(common)
    assert "done: best mIoU" in capsys.readouterr().out
    assert notes.read_text() == "a user's own notes" and (tmp_path / "metrics.jsonl").read_bytes() == lines
    assert not os.path.islink(out / "metrics.jsonl") and (out / "metrics.jsonl").read_bytes().startswith(lines)
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
        run_main(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "3", "--resume", "auto"])
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
    assert line == (f"main.py: error: cannot write --output-dir {named} (Invalid argument): its filesystem refuses "
                    "the name run:1: choose another name, or choose another folder"), line
    # A ':' in a folder this user may not write, on a filesystem that takes it: a permission, as it is.
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)  # (root may write anywhere: this user may not)
    advice = paths.what_to_do(OSError(errno.EACCES, "Permission denied", str(named)), str(named))
    assert advice == f"give this user write permission to {tmp_path} and the files in it (ls -l {tmp_path})", advice


def test_predict_s_output_dir_and_save_predictions_are_held_while_written(tiny_data, trained, tmp_path, monkeypatch,
                                                                          capsys):
    """One folder, one run, for every writer: predict.py holds its --output-dir, and a run its --save-predictions,
    while it writes there, so that a second run into either is refused (the refusal's line: the test above)."""
    from harness import records
    seen = []
    real_write = paths.write_atomically

    def noting(path, *args, **kwargs):
        seen.append(paths._held(os.path.dirname(os.path.dirname(path))))  # predictions/color/NAME.png
        return real_write(path, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(paths, "write_atomically", noting)
        run_main(["--resume", os.path.join(trained, "best.pth"), os.path.join(trained, "vis"), "-j", "0",
                  "--output-dir", str(tmp_path / "p")], program="predict")
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
    run_main(["--data", tiny_data, "--output-dir", str(tmp_path / "e"), *TRAIN_ARGS, "-e", "--resume",
              os.path.join(trained, "best.pth"), "--save-predictions", predictions])
    assert seen and all(seen) and not paths._held(predictions) and os.listdir(predictions), seen


def test_a_lock_record_copied_with_its_folder_is_not_taken_for_a_killed_run(tiny_data, trained, tmp_path, capsys):
    """A backup (cp -a) of a folder a run holds copies its .held, whose record names a live process of this host.
    The copy's next run takes it over without calling that process killed: the record names another file (its
    inode); a record written into this very file is a killed run's, and said so, though its process id now names
    a live process (a process id used again)."""
    import socket
    for said in (False, True):
        out = tmp_path / f"copy-{said}"
        shutil.copytree(trained, out)
        (out / paths.HOLD).touch()
        inode = (out / paths.HOLD).stat().st_ino + (0 if said else 1)
        (out / paths.HOLD).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                  "since": "2026-12-01 10:00:00", "file": inode}))
        output = run_main([*TRAIN_ARGS, "--data", tiny_data, "--output-dir", str(out), "-e", "--resume",
                           str(out / "best.pth")], capsys)  # (-e holds it too)
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
    said = run_main(command, capsys)
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
