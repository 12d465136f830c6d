"""harness/inference.py: multi-scale, flip and sliding window give the plain evaluation back where they should."""
import argparse
import json
import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import TRAIN_ARGS, main_fails, run_main, varied_model
from harness import errors, inference
import main
from dataset import NUM_CLASSES, Cityscapes

PY = sys.executable


def args_of(argv):
    parser = argparse.ArgumentParser()
    inference.add_arguments(parser)
    return parser.parse_args(argv)


def mode_of(argv):
    return inference.read_mode(args_of(argv))


def confusion(model, tiny_data):
    loader = DataLoader(Cityscapes(tiny_data, "val"), batch_size=1)
    return main.evaluate(model, loader, torch.device("cpu"), NUM_CLASSES, main.get_args_parser().parse_args([]))


@pytest.mark.parametrize("argv", [["--eval-scales", "1.0"], ["--eval-crop", "32", "64"], ["--eval-crop", "100"]],
                         ids=["one scale of 1.0", "a window as large as the image", "a window larger than the image"])
def test_one_view_gives_the_plain_evaluations_confusion_matrix(argv, tiny_data):
    model = varied_model()
    plain = confusion(model, tiny_data)
    assert (plain.sum(0) > 0).sum() >= 3  # several classes predicted: the comparison means something
    assert torch.equal(confusion(inference.wrap(model, args_of(argv)), tiny_data), plain)


def test_windows_cover_every_pixel_and_end_at_the_edge():
    assert inference._window_starts(1024, 769, 513) == [0, 255]  # mmsegmentation's slide mode on Cityscapes
    assert inference._window_starts(2048, 769, 513) == [0, 513, 1026, 1279]
    assert inference._window_starts(10, 4, 3) == [0, 3, 6]
    assert inference._window_starts(30, 64, 10) == [0]


def test_views_average_to_probabilities_at_the_inputs_size():
    model, images = varied_model(), torch.randn(2, 3, 37, 53)
    scores = inference.predict(model, images, mode_of(["--eval-scales", "0.5", "1.25", "--eval-flip",
                                                       "--eval-crop", "24", "--eval-stride", "16"]))
    assert scores.shape == (2, 19, 37, 53)
    assert torch.allclose(scores.sum(1), torch.ones(2, 37, 53), atol=1e-5)
    # A flip-symmetric mode on a mirror image predicts the mirror image.
    flipped = inference.predict(model, images.flip(-1), mode_of(["--eval-flip"]))
    assert torch.allclose(flipped.flip(-1), inference.predict(model, images, mode_of(["--eval-flip"])), atol=1e-5)


def test_eval_flags_checked_in_one_line(tiny_data, tmp_path, capsys):
    assert mode_of([]) is None
    assert mode_of(["--eval-crop", "769"]).stride == (513, 513)
    for argv in (["--eval-stride", "8"], ["--eval-crop", "16", "--eval-stride", "17"], ["--eval-crop", "8", "9", "10"]):
        with pytest.raises(errors.UserError):
            mode_of(argv)
    # Training evaluates single-scale after each epoch: main.py says so before any work.
    line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path), *TRAIN_ARGS, "--eval-scales", "1", "2"],
                      capsys)
    assert line.startswith("main.py: error: --eval-scales"), line


def test_main_e_records_the_mode_and_its_speed(tiny_data, tmp_path):
    checkpoint = str(tmp_path / "random.pth")
    torch.save({"model": varied_model().state_dict(), "args": {"model": TRAIN_ARGS[1], "output_stride": 16}},
               checkpoint)
    run_main(["-e", "--resume", checkpoint, "--data", tiny_data, "--output-dir", str(tmp_path), *TRAIN_ARGS,
              "--eval-scales", "0.75", "1.0", "--eval-flip", "--eval-crop", "24", "--eval-stride", "16"])
    with open(tmp_path / "eval.json") as f:
        result = json.load(f)
    assert result["mode"] == "scales 0.75,1 + flip + window 24x24 stride 16x16"
    assert result["images_per_s"] > 0 and result["num_images"] == 5 and 0 <= result["miou"] <= 1


def test_the_picture_shows_what_the_evaluation_predicted_for_the_first_val_image(tiny_data, tmp_path):
    """The evaluation keeps no image: records.picture predicts rank 0's first val image again, with the model
    evaluated (here with -e's flip), and gets what evaluate() wrote for it with --save-predictions."""
    import numpy as np
    from PIL import Image
    from torch.utils.data import Subset
    from dataset import TRAINID_TO_ID
    from harness import records
    val_set = Cityscapes(tiny_data, "val")
    loader = DataLoader(Subset(val_set, main.eval_shard(len(val_set), 0, 2)), batch_size=1)
    model = inference.wrap(varied_model(), args_of(["--eval-flip"]))
    args = main.get_args_parser().parse_args([])
    main.evaluate(model, loader, torch.device("cpu"), NUM_CLASSES, args, save_dir=str(tmp_path))
    image, label, prediction = records.picture(model, loader, torch.device("cpu"), args, main.normalize)
    saved = np.array(Image.open(tmp_path / f"{val_set.image_id(0)}_pred_labelIds.png"))
    assert len(np.unique(saved)) >= 3  # several classes: the comparison means something
    assert (TRAINID_TO_ID[prediction].numpy() == saved).all()
    assert torch.equal(image, val_set[0][0]) and torch.equal(label, val_set[0][1])


@pytest.mark.parametrize("trained_with", [["--amp"], ["--eval-crop", "24"]], ids=["amp", "eval-crop"])
def test_e_evaluates_as_the_run_did_and_reads_the_val_images_alone(trained_with, tiny_data, tmp_path, capsys):
    """-e on best.pth finds the mIoU its epoch logged, for a run that evaluated in bf16 (--amp) and for one that
    evaluated in windows (--eval-crop): it takes those flags from the checkpoint, and says so. It reads the val split
    alone: a folder without train/ is evaluated, and --check-only (run.sh's check of -e) passes on it. A flag given
    wins, and is said."""
    import shutil
    from conftest import metrics
    out, val_only = str(tmp_path / "out"), tmp_path / "val_only"
    run_main(["--data", tiny_data, "--output-dir", out, "--epochs", "1", *TRAIN_ARGS, *trained_with])
    for top in ("leftImg8bit", "gtFine"):
        shutil.copytree(f"{tiny_data}/{top}/val", val_only / top / "val")
    evaluate = ["-e", "--resume", f"{out}/best.pth", "--data", str(val_only), "--output-dir", out, "-j", "0"]
    capsys.readouterr()
    run_main([*evaluate, "--check-only", "2"])  # ends after the checks, with exit status 0
    assert "evaluated" not in capsys.readouterr().out
    run_main(evaluate)
    taken = "--amp bf16" if trained_with == ["--amp"] else "window 24x24 stride 16x16"
    assert f"note: -e evaluates as the run did ({taken}, from {out}/best.pth)" in capsys.readouterr().out
    with open(f"{out}/eval.json") as f:
        assert json.load(f)["miou"] == metrics(out)[0]["miou"]
    same = ["--amp", "bf16"] if trained_with == ["--amp"] else ["--eval-crop", "24", "24"]  # written another way
    run_main([*evaluate, *same])
    assert "note: -e evaluates as the run did" in capsys.readouterr().out
    other = ["--amp", "off"] if trained_with == ["--amp"] else ["--eval-crop", "24", "--eval-stride", "8"]
    run_main([*evaluate, *other])
    differs = "--amp off (the run's: bf16)" if trained_with == ["--amp"] else \
        "window 24x24 stride 8x8 (the run's: window 24x24 stride 16x16)"
    assert f"note: -e evaluates with {differs}: its mIoU may differ" in capsys.readouterr().out
    if trained_with == ["--amp"]:  # a run on GPUs in fp16, evaluated on a CPU: bf16 there, said
        saved = torch.load(f"{out}/best.pth", map_location="cpu", weights_only=True)
        torch.save({**saved, "args": {**saved["args"], "amp": "fp16"}}, tmp_path / "fp16.pth")
        said = run_main([*evaluate[:2], str(tmp_path / "fp16.pth"), *evaluate[3:]], capsys)
        assert "note: -e evaluates with --amp bf16 (the run's: fp16)" in said and "wrote" in said, said


def test_amp_given_alone_picks_what_the_device_runs_natively(monkeypatch):
    """--amp alone: bf16 on the CPU and on a GPU that runs it natively, fp16 on one that only emulates it (V100, T4:
    is_bf16_supported() says True there, is_bf16_supported(including_emulation=False) False); main.py's choice (the
    lesson's) and the harness's (predict.py, the out-of-memory advice) agree. A value given stays."""
    from harness import checks
    assert main.native_bf16(torch.device("cpu")) and checks.native_amp(False) == "bf16"
    for native, expected in ((True, "bf16"), (False, "fp16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True: native or including_emulation)
        assert main.native_bf16(torch.device("cuda", 0)) == native and checks.native_amp(True) == expected
    assert [main.amp_of_the_job(given, torch.device("cpu")) for given in ("fp16", "off", None, "auto")] == \
        ["fp16", "off", None, "bf16"]


def _amp_of_a_rank(rank, port, folder):
    """One rank of two (gloo): its device runs bf16 natively on rank 0 alone; what amp_of_the_job chose, to a file."""
    import torch.distributed as dist
    code = 1
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        main.native_bf16 = lambda device: rank == 0
        with open(f"{folder}/rank_{rank}", "w") as f:
            f.write(main.amp_of_the_job("auto", torch.device("cpu")))
        dist.destroy_process_group()
        code = 0
    finally:
        os._exit(code)


def test_amp_given_alone_is_one_choice_for_the_whole_job(tmp_path):
    """Two ranks whose GPUs differ (one runs bf16 natively, one would emulate it) both take fp16: ranks in two
    precisions would average scaled and unscaled gradients."""
    import multiprocessing
    from conftest import free_port
    port = free_port()
    ranks = [multiprocessing.get_context("fork").Process(target=_amp_of_a_rank, args=(rank, port, str(tmp_path)))
             for rank in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(60)
    assert [rank.exitcode for rank in ranks] == [0, 0]
    assert [(tmp_path / f"rank_{rank}").read_text() for rank in range(2)] == ["fp16", "fp16"]


@pytest.mark.usefixtures("on_the_cpu")
def test_any_size_and_any_scale_the_flags_accept(trained, tiny_data, tmp_path, capsys):
    from PIL import Image
    photos = tmp_path / "tiny"
    photos.mkdir()
    for width, height in ((1, 1), (3, 2), (1, 40)):
        Image.new("RGB", (width, height), (90, 90, 90)).save(photos / f"{width}x{height}.png")
    run_main(["--resume", os.path.join(trained, "best.pth"), str(photos), "--output-dir", str(tmp_path / "p"), "-j",
              "0", "--eval-scales", "0.01", "1", "--eval-flip", "--eval-crop", "8", "--eval-stride",
              "1"], program="predict")
    for name, size in (("1x1", (1, 1)), ("3x2", (3, 2)), ("1x40", (1, 40))):
        with Image.open(tmp_path / "p" / "color" / f"{name}.png.png") as picture:
            assert picture.size == size
    run_main(["--data", tiny_data, "--output-dir", str(tmp_path / "e"), *TRAIN_ARGS, "-e", "--resume",
              os.path.join(trained, "best.pth"), "--eval-scales", "0.01", "--eval-crop", "8"])
    assert "mIoU" in capsys.readouterr().out
