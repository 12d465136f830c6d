"""harness/records.py: what rank 0 writes beside the checkpoint (eval.json, predictions, pictures, TensorBoard)
replaces an earlier result only with a word, and a full disk there costs those files, not the trained epoch."""
import glob
import os
import re
import shutil

import pytest

from harness import checkpoints, paths
from conftest import TRAIN_ARGS, fingerprint, main_fails, no_space, run_main


pytestmark = pytest.mark.usefixtures("on_the_cpu")


# --- an earlier result is replaced only with a word; a full disk anywhere ends in one line ----------------------
def test_earlier_results_are_replaced_with_a_word_and_a_full_disk_writing_eval_json_ends_in_one_line(
        tiny_data, trained, tmp_path, monkeypatch, capsys):
    best = os.path.join(trained, "best.pth")
    evaluate = ["--data", tiny_data, "--output-dir", str(tmp_path / "e"), *TRAIN_ARGS, "-e", "--resume", best]
    run_main(evaluate)
    assert "replaces" not in capsys.readouterr().out
    run_main(evaluate)
    assert "it replaces the earlier one (mIoU" in capsys.readouterr().out
    images = os.path.join(trained, "vis")
    for _ in range(2):
        run_main(["--resume", best, images, "-j", "0", "--output-dir", str(tmp_path / "p")], program="predict")
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
        run_main(evaluate)
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
    run_main(TRAIN_ARGS + advised)
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
    run_main(argv + ["--overwrite"])
    assert os.path.isfile(tmp_path / "out" / "checkpoint.pth")
