"""harness/checkpoints.py: which checkpoint a run starts from; every reader's check (CRC-32s, what it holds,
another version's format), each in one line; a save that keeps the one before; a rewind that keeps what it drops."""
import argparse
import hashlib
import json
import os
import re
import shutil

import pytest
import torch

import main
from harness import checkpoints, errors, paths, stops
from conftest import TRAIN_ARGS, fingerprint, fingerprints, main_fails, run_main


pytestmark = pytest.mark.usefixtures("on_the_cpu")


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
    said = run_main(common + ["--epochs", "1", "--resume", "auto"], capsys)
    assert "nothing to train" in said and "done" not in said, said
    assert errors.NOTHING_TO_TRAIN == 3  # run.sh reads 3
    checked = run_main(common + ["--epochs", "1", "--resume", "auto", "--check-only", "2"], capsys, code=3)
    assert checked == said.splitlines(keepends=True)[-1]  # the line main.py's train() says
    assert fingerprint(out) == before
    line = main_fails(common + ["--epochs", "3", "--resume", os.path.join(out, "checkpoint.pth"), "--start-epoch",
                                 "1"], capsys)
    assert "--start-epoch 1 with --resume" in line, line
    weights = str(tmp_path / "weights.pth")  # weights only, as torch.save(model.state_dict()) writes them
    torch.save(torch.load(os.path.join(out, "checkpoint.pth"), weights_only=True)["model"], weights)
    line = main_fails(common + ["--epochs", "3", "--resume", weights], capsys)
    assert "weights only" in line and "-e" in line, line
    assert fingerprint(out) == before  # neither mistake touched the run
    run_main(common + ["-e", "--resume", weights])  # enough for -e
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


def test_the_advice_for_a_model_of_other_classes_leads_to_a_command_that_works(trained, folder_data, tmp_path,
                                                                                capsys):
    out, new = str(tmp_path / "run"), str(tmp_path / "fine_tuned")
    shutil.copytree(trained, out)  # a Cityscapes run (19 classes), to continue on a data set of 7 classes
    before = fingerprints(out, folder_data)
    common = ["--data", folder_data, *TRAIN_ARGS, "--epochs", "1"]
    line = main_fails(common + ["--output-dir", out, "--resume", "auto"], capsys)
    weights = os.path.join(out, "checkpoint.pth")
    assert f"fine-tune it on this data into a new output folder: --weights {weights} --output-dir NEW" in line, line
    line = main_fails(common + ["--output-dir", out, "--weights", weights], capsys)
    assert "holds another run" in line, line  # the same folder: refused, as another run is
    line = main_fails(common + ["--output-dir", out, "--weights", weights, "--overwrite"], capsys)
    assert "belongs to the run that --overwrite moves aside" in line and "another --output-dir" in line, line
    assert fingerprints(out, folder_data) == before  # none of the three touched a file
    run_main(common + ["--output-dir", new, "--weights", weights])  # the advice
    assert "starts afresh" in capsys.readouterr().out
    assert fingerprints(out, folder_data) == before and os.path.isfile(os.path.join(new, "best.pth"))


def test_a_rewind_keeps_what_it_drops_and_says_so(tiny_data, tmp_path, capsys):
    out = str(tmp_path / "out")
    common = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2"]
    run_main(common)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = f.readlines()
    newer = fingerprint(out)
    capsys.readouterr()
    said = run_main(common + ["--resume", os.path.join(out, "checkpoint.prev.pth")], capsys)
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
    run_main(common + ["-e", "--resume", wrapped])
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
    said = run_main(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--resume", "auto", "--epochs", "3"],
                     capsys)  # epochs 1 and 2, each saved
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
    run_main(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "3", "--resume", "auto"])
    assert "nothing to train" in capsys.readouterr().out
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")], os.listdir(out)


def test_a_torchrun_restart_keeps_what_the_first_attempt_started_from(tiny_data, trained, tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    best, common = os.path.join(trained, "best.pth"), ["--data", tiny_data, *TRAIN_ARGS]
    run_main(common + ["--output-dir", str(tmp_path / "e"), "-e", "--resume", best])
    with open(tmp_path / "e" / "eval.json") as f:
        assert json.load(f)["checkpoint"] == best  # -e evaluates what it was given, restarted or not
    out = str(tmp_path / "new")  # the first attempt died before its first checkpoint
    said = run_main(common + ["--output-dir", out, "--resume", best, "--epochs", "2"], capsys)
    assert f"resuming from {best} at the start of epoch 1" in said and "starting afresh" not in said, said


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
    said = run_main(common + ["--resume", "auto"], capsys)
    assert f"note: {checkpoint} is a symbolic link to {elsewhere}: the run reads it" in said, said
    assert f"resuming from {checkpoint} at the start of epoch 1" in said and "done: best mIoU" in said, said
    assert not os.path.islink(checkpoint) and checkpoints.read("--resume", checkpoint)["epoch"] == 2
    assert fingerprint(os.path.dirname(elsewhere)) == kept


# --- a checkpoint is verified before it is trusted --------------------------------------------------------------------
def _damage(path, at=0.5):
    """4 KiB changed inside the file, as a bad copy might: torch.load still reads it."""
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * at))
        f.write(bytes(4096))


def test_a_damaged_checkpoint_is_refused_by_every_reader_and_resume_auto_falls_back(tiny_data, trained, tmp_path,
                                                                                   capsys):
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
        assert damaged in main_fails(["--resume", best, *argv], capsys, program="predict")
    _damage(os.path.join(out, "checkpoint.pth"), at=0.3)
    said = run_main(common + ["--output-dir", out, "--epochs", "2", "--resume", "auto"], capsys)
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


_NO_LOAD = "its optimizer or scaler does not load into main.py's SGD and GradScaler"  # torch's own error follows


@pytest.mark.parametrize("change, expect", [
    (lambda s: s.update(step=2, epoch=0) or s.pop("epoch_loss_sum"), "it holds no epoch_loss_sum"),
    (lambda s: s["optimizer"]["param_groups"].append(dict(s["optimizer"]["param_groups"][1], params=[])),
     f"{_NO_LOAD} (ValueError: loaded state dict has a different number of parameter groups)"),
    (_adam, f"{_NO_LOAD} (ValueError: another optimizer's state: it holds exp_avg, exp_avg_sq, step)"),
    (_momentum_of_another_shape, f"{_NO_LOAD} (RuntimeError: output with shape torch.Size([3])"),
    (lambda s: s.update(epoch="1"), "its epoch is '1', not a whole number of at least 0"),
    (lambda s: s.update(epoch=-1), "its epoch is -1, not a whole number"),
    (lambda s: s.update(best_miou=None), "its best_miou is None, neither an mIoU from 0 to 1 nor -inf"),
    (lambda s: s.update(scaler={"scale": "big"}), f"{_NO_LOAD} (KeyError: 'growth_factor')"),
    (lambda s: s["args"].update(batch_size=0), "its batch_size is 0, not a whole number of at least 1"),
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
    if "another optimizer's state" in expect:  # the advice, the same in every case, followed once
        advised = re.search(r"fine-tuning into a new run: (--weights \S+) --output-dir NEW$", line).group(1).split()
        run_main(common[:-1] + ["1", "--output-dir", str(tmp_path / "new"), *advised])
        assert os.path.isfile(tmp_path / "new" / "checkpoint.pth")
        run_main(common + ["--output-dir", out, "-e", "--resume", path])
        assert "mIoU" in capsys.readouterr().out


def test_an_older_checkpoint_that_is_whole_still_resumes_and_a_new_one_says_its_format(tiny_data, trained, tmp_path,
                                                                                      capsys):
    """A checkpoint without the format number (every version before it) resumes when what it holds fits: without
    epoch_loss_sum at an epoch's start (it is 0 there), its classes without colours (predict.py draws them in
    Cityscapes' own). What the run writes next says this version's format."""
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    _another_version(trained, os.path.join(out, "checkpoint.pth"),
                     lambda s: s.pop("epoch_loss_sum") and s["classes"].pop("colors"))
    run_main(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2", "--resume", "auto"])
    assert "resuming from" in capsys.readouterr().out
    for name in ("checkpoint.pth", "best.pth"):
        assert checkpoints.read("--resume", os.path.join(out, name))["format"] == checkpoints.FORMAT
    colourless = _another_version(trained, str(tmp_path / "colourless.pth"), lambda s: s["classes"].pop("colors"))
    run_main([os.path.join(tiny_data, "leftImg8bit", "val"), "--resume", colourless, "-j", "0", "--output-dir",
              str(tmp_path / "p")], program="predict")
    assert len(os.listdir(tmp_path / "p" / "color")) == 3  # 5 images in 3 city folders


def test_a_step_past_the_end_of_its_epoch_finishes_that_epoch(tiny_data, trained, tmp_path, capsys):
    """A position past the steps an epoch has now (fewer training images than when it was saved, or a larger global
    batch): that epoch's training is done; it is evaluated and saved, and said, not trained past its end."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    _another_version(trained, os.path.join(out, "checkpoint.pth"), lambda s: s.update(epoch=0, step=100))
    said = run_main(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "1", "--resume",
                     "auto"], capsys)
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
    for number, change in enumerate([lambda s: s.update(format=checkpoints.FORMAT + 1),
                                     lambda s: s["args"].update(model="deeplabv3plus_resnet152")]):
        path = _another_version(trained, str(tmp_path / f"newer{number}.pth"), change)
        argv = {"--resume": ["--resume", path, "--epochs", "2"], "-e": ["-e", "--resume", path],
                "--weights": ["--weights", path]}.get(reader)
        if argv is None:
            line = main_fails([tiny_data, "--resume", path], capsys, program="predict")
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
    run_main(common[:typed] + common[typed + 2:] + advised)
    assert "mIoU" in capsys.readouterr().out
    line = main_fails(common[:typed] + ["--model", "deeplabv3_resnet50"] + common[typed + 2:] + ["--resume",
                       os.path.join(trained, "best.pth")], capsys)
    assert "holds a deeplabv3plus_mobilenet_tiny model, but --model deeplabv3_resnet50 was given" in line, line


def test_lines_a_user_added_to_metrics_jsonl_are_kept_on_resume(tiny_data, trained, tmp_path, capsys):
    """metrics.jsonl's lines that are no record of this program (a note a user added, even one without its newline)
    stay where they were when a run resumes; the records of the epochs it does again go, and the next record starts
    on a line of its own."""
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('# lr lowered by hand from here\n{"note": "a JSON note of mine"}\n{"epoch": 1, "iteration": 8, '
                '"miou": 0.5}\nlast note, no newline')
    run_main(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2", "--resume", "auto"])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = f.read().splitlines()
    assert [line[:11] for line in lines] == ['{"epoch": 0', "# lr lowere", '{"note": "a', "last note, ",
                                             '{"epoch": 1'], lines  # the stale record of epoch 1 gone, redone


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
        output = run_main(["--data", tiny_data, "--output-dir", str(out), *TRAIN_ARGS, "--epochs", "2", "--resume",
                           "auto"], capsys)
        note = (f"note: {out / 'checkpoint.pth'} was saved part-way through epoch 1 on another training list ("
                + ("12 images then, 8 now" if other["images"] == 12 else "8 images then and now, not the same ones")
                + "): epoch 1's training ends at its step 1 (the rest of its shuffle is of the old list); it is "
                  "evaluated and saved, and epoch 2 draws from this list")
        assert note in output and "done: best mIoU" in output, output
        assert f"resuming from {out / 'checkpoint.pth'} at epoch 1 after step 4 " in output, output
