"""harness/preflight.py: everything a user can get wrong is found before any work, reads before anything is moved,
and the advice of each mistake's line, followed as written, gets past it."""
import glob
import os
import re
import shutil

import pytest
import torch

from harness import errors
from conftest import TRAIN_ARGS, fingerprint, main_fails, one_error_line, own_data, run_main


pytestmark = pytest.mark.usefixtures("on_the_cpu")


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
    run_main(common)  # stray files are ignored
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


def test_under_run_sh_too_many_processes_name_its_variables(tiny_data, tmp_path, monkeypatch, capsys):
    """main.py's check as run.sh runs it (DEEPLAB_RUN_SH=1, the world size run.sh counted): the advice names what the
    user sets there, NPROC and NNODES, not a flag. In-process: the line is main.py's."""
    monkeypatch.setenv("DEEPLAB_RUN_SH", "1")
    line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--check-only", "10"],
                       capsys)
    assert line == "main.py: error: 10 processes but only 5 val images: use at most 5 processes in all (NPROC x NNODES)"


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
    run_main(imagenet + ["-e", "--resume", os.path.join(out, "best.pth")])
    run_main(imagenet + ["--resume", "auto", "--epochs", "2", "--check-only", "2"])  # a resumed run's preflight
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a torchrun restart: continues from its checkpoint
    run_main(imagenet + ["--epochs", "1"])
    # (With the tests' tiny model a fetch would not reach get_state_dict: models.py refuses imagenet for it first, and
    # main.main above would have ended in that error instead: each of the three runs finishing is the proof.)
    assert fetched == []
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    fresh = imagenet[:3] + [str(tmp_path / "fresh")] + imagenet[4:] + ["--check-only", "2"]
    line = main_fails(fresh, capsys)  # the tests' tiny model has no ImageNet weights to fetch: said, not tried
    assert "mobilenet_tiny (MobileNetV3-Small at half width) has no ImageNet weights" in line and fetched == [], line
    line = main_fails(fresh + ["--model", "deeplabv3plus_mobilenet_v3_large"], capsys)
    assert "could not download the ImageNet weights" in line and len(fetched) == 1, line  # a fresh start fetches


def test_labels_that_cannot_teach_are_said(tmp_path, capsys):
    out = str(tmp_path / "o")
    binary = [[0, 255, 255, 255, 255, 255]] * 4  # a cat mask saved as 0/255: 255 is ignore
    data = own_data(tmp_path, [binary, binary], names=("background", "cat", "dog"))
    said = run_main(["--data", data, *TRAIN_ARGS, "--epochs", "1", "--output-dir", out], capsys)
    warnings = [line for line in said.splitlines() if line.startswith("warning:") and "--crop-size" not in line
                and "also training images" not in line]  # (these splits hold the same images, said too)
    assert len(warnings) == 2, said  # before training, and training goes on (the crop's warning aside: 6x4 images)
    assert "has a pixel of 'cat', 'dog': the model cannot learn it" in warnings[0]
    assert "2 of 2 training masks are more than half ignore_index 255" in warnings[1]
    assert "save them with its class index instead" in warnings[1]
    assert said.index("warning:") < said.index("training deeplabv3plus")
    shutil.rmtree(tmp_path / "own")
    unlabelled = [[255] * 6] * 4
    data = own_data(tmp_path, [unlabelled, [[0] * 6] * 4])
    for mask in os.listdir(os.path.join(data, "masks", "val")):  # val: nothing labelled at all
        from PIL import Image
        Image.new("L", (6, 4), 255).save(os.path.join(data, "masks", "val", mask))
    line = main_fails(["--data", data, *TRAIN_ARGS, "--check-only", "1", "--output-dir", out + "2"], capsys)
    assert "val labels of --data" in line and "hold no pixel of any class" in line, line


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
        run_main([word.format(**names) for word in advised])
        assert "error" not in capsys.readouterr().err, (extra, line, advised)
    except SystemExit as stop:
        if stop.code == errors.NOTHING_TO_TRAIN:  # past the mistake: the checks passed, and the run had finished
            assert "nothing to train" in capsys.readouterr().out, (extra, line, advised)
        else:
            assert words not in one_error_line(capsys), (extra, line, advised)


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
    said = run_main(["--data", data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--epochs", "1"], capsys)
    assert (f"warning: 2 of the 7 val images of --data {data} are also training images, byte for byte (e.g. "
            f"{data}/leftImg8bit/val/copied/copied_000000_000000_leftImg8bit.png and {trains[0]})") in said, said
    assert said.index("are also training images") < said.index("training deeplabv3plus")  # before any step
