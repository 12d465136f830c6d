"""predict.py as a user runs it: any images in, one prediction each at its size; bad input named; torchrun
shares the images out; the ONNX export computes what PyTorch computes."""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import onnxruntime  # not skipped when missing: requirements-test.txt installs it, in CI too
import pytest
import torch
from PIL import Image

from harness import checkpoints
from conftest import (ROOT, TRAIN_ARGS, built_once, fingerprint, finish_ranks, fork_main, fork_ranks, main_fails,
                      no_shared_memory_in_workers, no_space, run, run_main, varied_model)
from dataset import CLASS_COLORS, TRAINID_TO_ID
import predict

PY = sys.executable
# name: (size as seen (width, height), how it is written)
IMAGES = {
    "frame.png": ((40, 30), "RGB"),
    "sub/frame.png": ((40, 30), "RGB"),  # the same name in another folder
    "a.jpg": ((47, 33), "L"),            # a.jpg and a.png in one folder
    "a.png": ((47, 33), "RGBA"),
    "deep/er/p.bmp": ((20, 50), "P"),
    "t.tiff": ((64, 32), "RGB"),
    "w.webp": ((30, 30), "RGB"),
    "phone.jpg": ((24, 48), "EXIF"),    # stored 48x24 with orientation 6: seen turned, 24 wide
}


def write_images(folder, broken=True):
    rng = np.random.default_rng(0)
    for name, ((width, height), kind) in IMAGES.items():
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if kind == "EXIF":
            exif = Image.Exif()
            exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
            Image.fromarray(rng.integers(0, 255, (width, height, 3), dtype=np.uint8)).save(path, exif=exif)
        else:
            pixels = rng.integers(0, 255, (height, width, 4), dtype=np.uint8)
            Image.fromarray(pixels, "RGBA").convert(kind).save(path)
    with open(os.path.join(folder, "notes.txt"), "w") as f:
        f.write("not an image: left alone")
    if broken:
        with open(os.path.join(folder, "broken.png"), "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model") / "best.pth")
    torch.save({"model": varied_model().state_dict(), "args": {"model": TRAIN_ARGS[1], "output_stride": 16}}, path)
    return path


@pytest.mark.launch
def test_any_image_predicted_at_its_size_and_a_broken_one_named(checkpoint, tmp_path):
    inputs = str(tmp_path / "photos")
    write_images(inputs)
    before = fingerprint(inputs)
    out = os.path.join(inputs, "predictions")  # inside the input folder: left out of the search
    command = [PY, "predict.py", "--resume", checkpoint, inputs, "--output-dir", out, "--format", "labelid",
               "-j", "1", "-b", "2"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1, result.stderr
    errors = result.stderr.splitlines()
    assert [line for line in errors if "broken.png" in line] == [
        line for line in errors if line.startswith(f"predict.py: {os.path.join(inputs, 'broken.png')} cannot be read")]
    assert "its label" not in result.stderr  # training's advice has no place here
    assert errors[-1] == ("predict.py: error: 1 of 9 images could not be read (named above); "
                          "the others were written"), result.stderr
    colors = {tuple(c) for c in CLASS_COLORS}
    for name, (size, _) in IMAGES.items():
        label = Image.open(os.path.join(out, "labelIds", name + ".png"))
        assert label.size == size and label.mode == "L", name
        assert set(np.unique(np.asarray(label))) <= set(TRAINID_TO_ID.tolist()), name
        color = np.asarray(Image.open(os.path.join(out, "color", name + ".png")))
        assert color.shape == (size[1], size[0], 3) and {tuple(c) for c in color.reshape(-1, 3)} <= colors
        assert Image.open(os.path.join(out, "overlay", name + ".png")).size == size
    assert sorted(fingerprint(out)) == sorted(f"{kind}/{name}.png" for kind in ("color", "overlay", "labelIds")
                                              for name in IMAGES)  # nothing else, nothing twice
    assert {k: v for k, v in fingerprint(inputs).items() if not k.startswith("predictions/")} == before


def test_two_ranks_write_every_image_once(checkpoint, tmp_path):
    """predict.py on two ranks (forked, with a launcher's variables: its split of the images is the point, not the
    launcher) writes each image once, and rank 0 counts both ranks' predictions."""
    inputs = str(tmp_path / "photos")
    write_images(inputs, broken=False)
    out = os.path.join(inputs, "out")
    os.makedirs(out)
    Image.new("RGB", (16, 16)).save(os.path.join(out, "stale.png"))  # the output folder is never an input
    # A pattern, as the shell would leave it: it matches the folders, the images, notes.txt and out/stale.png.
    log = finish_ranks(fork_ranks(["--resume", checkpoint, os.path.join(inputs, "**", "*"), "--output-dir", out,
                                   "-j", "0", "--what", "label", "--eval-flip"], str(tmp_path / "logs"),
                                  program="predict"))[0]
    assert "predicting 8 images" in log and "2 process(es)" in log and "(flip)" in log, log
    assert "wrote 8 predictions" in log, log  # the sum over both ranks: no image twice
    assert sorted(fingerprint(os.path.join(out, "trainIds"))) == sorted(name + ".png" for name in IMAGES)


def _fails(argv, capsys):
    run_main(argv, code=1, program="predict")
    [line] = capsys.readouterr().err.splitlines()
    return line


def test_mistakes_end_in_one_line(checkpoint, tmp_path, capsys):
    bare, other, text = (str(tmp_path / name) for name in ("bare.pth", "other.pth", "notes.pth"))
    torch.save(varied_model().state_dict(), bare)
    torch.save({"model": {"fc.weight": torch.zeros(2, 2)}, "args": {"model": "resnet50"}}, other)
    with open(text, "w") as f:
        f.write("not a checkpoint")
    folder = str(tmp_path / "empty")
    os.makedirs(folder)
    cases = {
        ("--resume", str(tmp_path / "missing.pth"), folder): "no such file",
        ("--resume", bare, folder): "holds weights without the model's name",
        ("--resume", other, folder): "not of this project's DeepLab",
        ("--resume", text, folder): "cannot be read",
        ("--resume", checkpoint): "no INPUT",
        ("--resume", checkpoint, folder): "no images",
        ("--resume", checkpoint, str(tmp_path / "nothing*.png")): "no such file or folder",
        ("--resume", checkpoint, folder, "--output-dir", folder): "is inside --output-dir",
        ("--resume", checkpoint, folder, "--output-dir", str(tmp_path)): "is inside --output-dir",
        ("--resume", checkpoint, "--export", "m.onnx", folder): "give it no INPUT",
    }
    for argv, words in cases.items():
        line = _fails(list(argv), capsys)
        assert line.startswith("predict.py: error: ") and words in line, (argv, line)


def test_a_full_disk_ends_in_one_line(checkpoint, tmp_path, monkeypatch, capsys):
    inputs = str(tmp_path / "photos")
    write_images(inputs, broken=False)
    monkeypatch.setattr(Image.Image, "save", no_space)
    line = _fails(["--resume", checkpoint, inputs, "--output-dir", str(tmp_path / "out"), "-j", "0"], capsys)
    # (the free space is said as it was when the write failed: its file is written whole or not at all)
    assert re.fullmatch(re.escape(f"predict.py: error: cannot write in --output-dir {tmp_path / 'out'} (no space left "
                                  "on device; ") + r"\d+ MiB free there when it failed\): free space there", line), line


def test_a_checkpoint_whose_weights_or_colours_do_not_fit_ends_in_one_line_before_any_image(checkpoint, tmp_path,
                                                                                          capsys):
    """What predict.py takes from a checkpoint is loaded before any image is read (the weights into the model, the
    colours into the palette): torch's own error, in one line that names the file, and nothing written."""
    inputs, out = str(tmp_path / "photos"), str(tmp_path / "out")
    write_images(inputs, broken=False)
    state = torch.load(checkpoint, weights_only=True)
    for number, classes in enumerate([{"names": ["a", "b", "c"]},  # a classifier of 19
                                      {"names": [str(i) for i in range(19)], "colors": [[300, 0, 0]] * 19}]):
        path = str(tmp_path / f"misfit{number}.pth")
        torch.save({**state, "classes": classes}, path)
        line = _fails(["--resume", path, inputs, "--output-dir", out, "-j", "0"], capsys)
        assert line.startswith(f"predict.py: error: --resume {path} does not fit {TRAIN_ARGS[1]} with its "
                               f"{len(classes['names'])} classes and their colours (RuntimeError: "), line
        assert ("size mismatch for classifier.weight" if number == 0 else "uint8") in line, line
        assert not os.path.exists(out)


@pytest.fixture(scope="module")
def two_process_run(tiny_data, tmp_path_factory):
    """A folder: run/best.pth, as main.py writes it on two processes (one epoch on tiny_data); best.pth, the same with
    varied_model's weights (which predict many classes). Built once for the whole run, by the first worker to ask."""
    def build(folder):
        run_dir = os.path.join(folder, "run")
        finish_ranks(fork_ranks(["--data", tiny_data, "--output-dir", run_dir, "--epochs", "1", *TRAIN_ARGS],
                                os.path.join(folder, "logs")))
        saved = torch.load(os.path.join(run_dir, "best.pth"), map_location="cpu", weights_only=True)
        torch.save({**saved, "model": varied_model().state_dict()}, os.path.join(folder, "best.pth"))
    return built_once(tmp_path_factory, "two_process_run", build)


@pytest.fixture(scope="module")
def exported(two_process_run, tmp_path_factory):
    """A folder: best.pth, two_process_run's; model.onnx, predict.py's export of it. Built once for the whole run, by
    the first worker to ask: torch's exporter takes 20-50 s, so the tests that use it are marked launch, and the
    quick loop (-m "not launch") leaves them out.

    The export runs in a forked copy of this process. Seen with torch 2.14: after torch.export in a process that had
    run no backward yet, its first backward starts autograd's device threads, and each process forked from it
    afterwards fails its first backward ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"). In pytest's own process, that failed every later test that forks ranks."""
    def build(folder):
        best, path = os.path.join(folder, "best.pth"), os.path.join(folder, "model.onnx")
        shutil.copy(os.path.join(two_process_run, "best.pth"), best)
        exporter = fork_main(["--resume", best, "--export", path], f"{path}.log", program="predict")
        assert finish_ranks([exporter])[0].startswith(f"wrote {path}"), exporter
    return built_once(tmp_path_factory, "exported", build)


@pytest.mark.launch  # torch's exporter (the fixture): 20-50 s
def test_onnx_export_computes_what_pytorch_computes(exported):
    session = onnxruntime.InferenceSession(os.path.join(exported, "model.onnx"), providers=["CPUExecutionProvider"])
    model = checkpoints.load_for_inference(os.path.join(exported, "best.pth"))[0]
    for shape in ((1, 3, 64, 128), (3, 3, 75, 101)):  # batch, height and width other than the example's
        images = torch.randn(shape)
        with torch.no_grad():
            expected = model(images).numpy()
        [logits] = session.run(None, {"images": images.numpy()})
        assert logits.shape == (shape[0], 19, *shape[2:]) and logits.dtype == np.float32
        assert np.abs(logits - expected).max() < 1e-3
        assert (logits.argmax(1) == expected.argmax(1)).mean() > 0.999


@pytest.mark.launch
def test_pt2_export_runs_on_torch_alone_outside_the_project(exported, tmp_path):
    """model.pt2, exported here (in a fork: torch.export would break this process's later forks), then in a fresh
    python in a folder outside the project (nothing of it importable), loads with torch.export.load and computes
    the checkpoint's logits at sizes other than the export's example. predict.py knows it again by its bytes, as an
    earlier export it may replace."""
    assert not str(tmp_path).startswith(ROOT)
    pt2 = str(tmp_path / "model.pt2")
    exporter = fork_main(["--resume", os.path.join(exported, "best.pth"), "--export", pt2], f"{pt2}.log",
                         program="predict")
    assert finish_ranks([exporter])[0].startswith(f"wrote {pt2}"), exporter
    images = torch.randn(3, 3, 75, 101)
    torch.save(images, tmp_path / "images.pt")
    (tmp_path / "load.py").write_text(
        "import sys, torch\n"
        "assert all(name not in sys.modules for name in ('models', 'harness'))\n"
        f"model = torch.export.load({pt2!r}).module()\n"
        "with torch.no_grad():\n"
        "    torch.save(model(torch.load('images.pt')), 'logits.pt')\n")
    run([PY, "-c", "import runpy; runpy.run_path('load.py')"], cwd=str(tmp_path), env={"PYTHONPATH": ""})
    model = checkpoints.load_for_inference(os.path.join(exported, "best.pth"))[0]
    with torch.no_grad():
        expected = model(images)
    logits = torch.load(tmp_path / "logits.pt")
    assert logits.shape == (3, 19, 75, 101) and (logits - expected).abs().max() < 1e-4
    assert predict.is_export(pt2) and predict.is_export(
        os.path.join(exported, "model.onnx"))
    import zipfile
    with zipfile.ZipFile(tmp_path / "other.pt2", "w") as other:
        other.writestr("model/notes.txt", "a zip file, not an export")
    assert not predict.is_export(str(tmp_path / "other.pt2"))


def test_an_export_that_fails_leaves_the_earlier_one_as_it_was(trained, tmp_path, monkeypatch, capsys):
    """A full disk while model.pt2 is written again: one line, the earlier export's bytes as they were, and no
    temporary file left. (torch.export itself is stood in for: run in this process it would break later forks.)"""
    earlier = tmp_path / "model.pt2"
    import zipfile
    with zipfile.ZipFile(earlier, "w") as archive:  # what predict.py takes for an earlier export (is_export)
        archive.writestr("model/archive_format", "pt2")
    before = fingerprint(str(tmp_path))

    def save_half(program, f):
        f.write(b"PK\x03\x04 half an archive")
        raise OSError(28, os.strerror(28))
    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: "a program")
    monkeypatch.setattr(torch.export, "save", save_half)
    line = main_fails(["--resume", os.path.join(trained, "best.pth"), "--export", str(earlier)], capsys,
                      program="predict")
    assert "no space left on device" in line, line
    assert fingerprint(str(tmp_path)) == before


def python_lines(heading):
    """The ```python block under the heading `## heading` of docs/predict.md, as a user copies it."""
    with open(os.path.join(ROOT, "docs", "predict.md"), encoding="utf-8") as f:
        section = f.read().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```python\n(.*?)```", section, re.S)
    return block


def test_load_best_pth_in_your_own_code_as_predict_md_says(two_process_run, tmp_path, monkeypatch):
    """predict.md's lines, as written, in a folder laid out as the project's (output/demo/best.pth): on the best.pth of
    a run on two processes (DDP), whose keys have no "module." prefix. They build predict.py's model, in eval mode."""
    trained = os.path.join(two_process_run, "run", "best.pth")
    os.makedirs(tmp_path / "output" / "demo")
    os.symlink(trained, tmp_path / "output" / "demo" / "best.pth")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the lines put "." first on it
    names = {}
    exec(python_lines("Load best.pth in your own code"), names)
    saved = torch.load(trained, map_location="cpu", weights_only=True)
    assert saved["world_size"] == 2 and not any(key.startswith("module.") for key in saved["model"])
    model, reference = names["model"], checkpoints.load_for_inference(trained)[0]
    assert not model.training and type(model) is type(reference)
    images = torch.randn(2, 3, 40, 72)
    with torch.no_grad():
        assert torch.equal(model(images), reference(images))


@pytest.mark.launch
def test_predict_md_s_onnx_lines_run_outside_the_project(exported, tmp_path):
    """predict.md's ONNX lines, each in a fresh python in a folder outside the project. On another machine: model.onnx
    and a phone photo alone, without torch, write predict.py's trainIds prediction of the photo. The check, after
    the lines that load best.pth (the project's folder put in their line 2), finds the export computes PyTorch's
    logits."""
    assert not str(tmp_path).startswith(ROOT)
    os.symlink(os.path.join(exported, "model.onnx"), tmp_path / "model.onnx")
    rng = np.random.default_rng(1)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: seen turned, 60 wide and 100 high
    Image.fromarray(rng.integers(0, 255, (60, 100, 3), dtype=np.uint8)).save(tmp_path / "street.jpg", exif=exif,
                                                                             quality=95)
    other_machine = "import sys\nsys.modules['torch'] = None  # none there: import torch fails\n"
    (tmp_path / "other_machine.py").write_text(other_machine + python_lines("Predict on another machine"))
    run([PY, "other_machine.py"], cwd=str(tmp_path), env={"PYTHONPATH": ""})
    written = np.asarray(Image.open(tmp_path / "street.png"))
    run_main(["--resume", os.path.join(exported, "best.pth"), str(tmp_path / "street.jpg"), "--output-dir",
              str(tmp_path / "out"), "--what", "label", "-j", "0"], program="predict")
    expected = np.asarray(Image.open(tmp_path / "out" / "trainIds" / "street.jpg.png"))
    assert written.shape == expected.shape == (100, 60) and written.dtype == np.uint8
    assert (written == expected).mean() > 0.999 and len(np.unique(expected)) >= 5
    # The check: the loading lines with the project's folder in their line 2, then its own.
    loading = python_lines("Load best.pth in your own code").splitlines(keepends=True)
    assert loading[1].startswith('sys.path.insert(0, ".")'), loading[1]
    loading[1] = f"sys.path.insert(0, {ROOT!r})\n"
    os.makedirs(tmp_path / "output" / "demo")
    os.symlink(os.path.join(exported, "best.pth"), tmp_path / "output" / "demo" / "best.pth")
    (tmp_path / "check.py").write_text("".join(loading) + python_lines("Check your ONNX file against PyTorch"))
    said = run([PY, "check.py"], cwd=str(tmp_path), env={"PYTHONPATH": ""})
    difference = float(re.search(r"^largest difference: (\S+)$", said, re.M).group(1))
    same = float(re.search(r"^same class: (\S+)$", said, re.M).group(1))
    assert difference < 1e-3 and same > 0.999, said


def test_a_gif_in_a_folder_is_skipped_and_said_and_read_when_named_by_itself(tmp_path, capsys):
    """A choice: a folder's GIFs (and other kinds) are not predicted (their first frame alone would be), but said;
    a GIF named by itself is read, its first frame."""
    Image.new("RGB", (8, 4)).save(tmp_path / "street.png")
    Image.new("RGB", (8, 4)).save(tmp_path / "clip.gif")
    found = predict.find_images([str(tmp_path)], str(tmp_path / "out"))
    assert [name for _, name in found] == ["street.png"]
    assert (f"note: 1 picture(s) of a kind predict.py does not take from a folder skipped (e.g. {tmp_path}/clip.gif)"
            in capsys.readouterr().out)
    assert [name for _, name in predict.find_images([str(tmp_path / "clip.gif")], str(tmp_path / "out"))] == \
        ["clip.gif"]


def test_a_batch_a_worker_cannot_hand_over_ends_in_one_line_not_a_hang(checkpoint, tmp_path, monkeypatch, capsys):
    """With /dev/shm full, a worker's batch failed in its queue's feeder thread and was dropped: predict.py waited for
    it forever. Now the worker ends, and the line names shared memory and what to give."""
    inputs = str(tmp_path / "photos")
    write_images(inputs, broken=False)
    no_shared_memory_in_workers(monkeypatch)
    line = _fails(["--resume", checkpoint, inputs, "--output-dir", str(tmp_path / "out"), "-j", "2"], capsys)
    assert re.fullmatch(r"predict\.py: error: a data loading worker could not hand over a batch: shared memory "
                        r"\(/dev/shm, \d+ MiB free\) is most likely too small: give -j 1 or -j 0, or more shared "
                        r"memory \(Docker: --shm-size=8g\)\.", line), line


def test_floating_point_pixels_are_scaled_by_a_rule_that_is_said(checkpoint, tmp_path, capsys):
    """A float TIFF (PIL's mode F) has no standard scale: values in 0-1 were clipped to 0 and 1 of 0-255, and the model
    predicted a black picture without a word. Now 0-1 is scaled to 0-255 (else 0-255, clipped), and predict.py says
    so once, with their count."""
    from images import read_image
    inputs = tmp_path / "floats"
    inputs.mkdir()
    values = np.linspace(0, 1, 64 * 32, dtype=np.float32).reshape(32, 64)
    Image.fromarray(values, mode="F").save(inputs / "unit.tif")
    Image.fromarray(values * 255, mode="F").save(inputs / "bytes.tif")
    expected = np.rint(values.astype(np.float64) * 255).astype(np.uint8)
    for name in ("unit.tif", "bytes.tif"):
        assert np.array_equal(read_image(str(inputs / name))[..., 0], expected), name
    run_main(["--resume", checkpoint, str(inputs), "-j", "0", "--output-dir", str(tmp_path / "out")], program="predict")
    assert (f"note: 2 image(s) hold floating-point pixels (e.g. {inputs / 'bytes.tif'}): values all within 0-1 are "
            "scaled by 255, others clipped to 0-255") in capsys.readouterr().out
