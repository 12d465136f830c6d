"""Your own data: the folder layout (images/, masks/, classes.json) trains, evaluates and predicts with its own
classes; a Cityscapes model fine-tunes on it; its mistakes end in one line; TensorBoard's curves continue
across a resume."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

import dataset
import images
from harness import checkpoints, job, paths
from conftest import ROOT, TRAIN_ARGS, main_fails, no_space, own_data, run_main
from dataset import FolderDataset, default_colors, open_dataset
from models import build_model

# Cityscapes' categories, typed here independently of synthetic.py, with the colour of each one's first class.
CATEGORIES = ["flat", "construction", "object", "nature", "sky", "human", "vehicle"]
CATEGORY_COLORS = [(128, 64, 128), (70, 70, 70), (153, 153, 153), (107, 142, 35), (70, 130, 180), (220, 20, 60),
                   (0, 0, 142)]


pytestmark = pytest.mark.usefixtures("on_the_cpu")


def test_the_synthetic_folder_set_reads_as_its_files_say(folder_data):
    with open(os.path.join(folder_data, "classes.json")) as f:
        assert json.load(f) == {"names": CATEGORIES, "colors": [list(c) for c in CATEGORY_COLORS], "ignore_index": 255}
    val = open_dataset(folder_data, "val")
    assert isinstance(val, FolderDataset) and val.classes["names"] == CATEGORIES and len(val) == 5
    val.check_files(decode_labels=True)
    for index in range(len(val)):
        assert val.images[index].endswith(".jpg")
        with Image.open(val.labels[index]) as mask:
            assert mask.mode == "P"  # a palette PNG: its indices are the classes, not its colours
            indices = torch.from_numpy(np.asarray(mask).copy())
        image, label = val[index]
        assert image.shape == (3, 32, 64) and image.dtype == torch.uint8
        assert torch.equal(label, indices)  # 0-6 and 255 = ignore, as written
        assert set(label.unique().tolist()) <= set(range(7)) | {255}
    present = set().union(*(set(val[i][1].unique().tolist()) for i in range(len(val))))
    assert {0, 1, 4, 6, 255} <= present  # flat, construction, sky, vehicle and the ignored bonnet
    train = open_dataset(folder_data, "train", crop_size=(32, 32))
    image, label = train[0]
    assert image.shape == (3, 32, 32) and label.shape == (32, 32)


def test_a_hand_made_folder_set_with_sub_folders_and_greyscale_masks(tmp_path):
    root = tmp_path / "mine"
    for split, name, values in (("train", "a/x", [0, 1, 100]), ("val", "y", [1, 1, 0])):
        (root / "images" / split / os.path.dirname(name)).mkdir(parents=True, exist_ok=True)
        (root / "masks" / split / os.path.dirname(name)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((4, 6, 3), 128, np.uint8)).save(root / "images" / split / f"{name}.png")
        Image.fromarray(np.array([values] * 4, np.uint8).repeat(2, 1)).save(root / "masks" / split / f"{name}.png")
    (root / "classes.json").write_text(json.dumps({"names": ["background", "cat"], "ignore_index": 100}))
    for sub in ("images", "masks"):  # a linked folder is followed, as in Cityscapes' layout
        shutil.copytree(root / sub / "val", tmp_path / f"elsewhere_{sub}")
        os.symlink(tmp_path / f"elsewhere_{sub}", root / sub / "train" / "linked")
    train = open_dataset(str(root), "train")
    assert [train.image_id(i) for i in range(len(train))] == [os.path.join("a", "x"), os.path.join("linked", "y")]
    assert train.classes["colors"] == default_colors(2)
    assert train[0][1][0].tolist() == [0, 0, 1, 1, 255, 255]  # ignore_index 100 -> 255, the trainer's ignore
    assert default_colors(2) == [[128, 0, 0], [0, 128, 0]]  # PASCAL VOC's palette from its second entry
    os.symlink(root / "images" / "train", root / "images" / "train" / "a" / "loop")
    with pytest.raises(dataset.BadInput, match="leads back to a folder already listed"):
        open_dataset(str(root), "train")


def _break(root, how):
    """Make one mistake a user makes in a folder data set."""
    val_masks, val_images = os.path.join(root, "masks", "val"), os.path.join(root, "images", "val")
    classes = os.path.join(root, "classes.json")
    if how == "image without mask":
        os.remove(os.path.join(val_masks, "street_0002.png"))
    elif how == "mask without image":
        os.remove(os.path.join(val_images, "street_0002.jpg"))
    elif how == "mask of another size":
        Image.new("L", (32, 32), 0).save(os.path.join(val_masks, "street_0002.png"))
    elif how == "class index outside classes.json":
        Image.new("L", (64, 32), 9).save(os.path.join(val_masks, "street_0002.png"))
    elif how == "class index outside classes.json, in a train mask":
        mask = np.zeros((32, 64), np.uint8)
        mask[5, 7] = 40  # one stray value, as a resize with interpolation leaves
        Image.fromarray(mask).save(os.path.join(root, "masks", "train", "street_0005.png"))
    elif how == "a 4-bit greyscale mask":
        Image.new("L", (64, 32), 1).save(os.path.join(val_masks, "street_0002.png"), bits=4)
    elif how == "a train mask holding JPEG bytes":  # exported again as JPEG, its name kept
        path = os.path.join(root, "masks", "train", "street_0005.png")
        with Image.open(path) as mask:
            indices = np.array(mask)
        Image.fromarray(indices).save(path, format="JPEG")
    elif how == "an RGB mask":
        Image.new("RGB", (64, 32), (1, 1, 1)).save(os.path.join(val_masks, "street_0002.png"))
    elif how == "empty split":
        shutil.rmtree(val_images)
        os.makedirs(val_images)
    elif how == "two images, one mask":
        shutil.copy(os.path.join(val_images, "street_0002.jpg"), os.path.join(val_images, "street_0002.png"))
    elif how == "no classes.json":
        os.remove(classes)
    else:  # a classes.json of these contents
        with open(classes, "w") as f:
            f.write(how)


@pytest.mark.parametrize("how, expect", [
    ("image without mask", "1 val image(s) have no mask, e.g. {root}/masks/val/street_0002.png is missing"),
    ("mask without image", "1 val mask(s) have no image, e.g. {root}/masks/val/street_0002.png"),
    ("mask of another size", "{root}/masks/val/street_0002.png is 32x32 but its image is 64x32"),
    ("class index outside classes.json", "{root}/masks/val/street_0002.png holds the class index 9, but "
                                         "{root}/classes.json names 7 classes (0-6)"),
    ("class index outside classes.json, in a train mask", "{root}/masks/train/street_0005.png holds the class "
                                                          "index 40"),
    ("a train mask holding JPEG bytes", "main.py: error: {root}/masks/train/street_0005.png holds JPEG bytes, not a "
                                        "PNG's, whatever its name says: export the label again as a PNG from its "
                                        "source (JPEG's compression changes class indices; converting this file keeps "
                                        "the changed ones)"),
    ("an RGB mask", "{root}/masks/val/street_0002.png is not a mask of class indices"),
    ("a 4-bit greyscale mask", "{root}/masks/val/street_0002.png cannot be decoded (a 4-bit greyscale PNG, whose "
                               "values PIL would scale to 0-255; save it as 8-bit)"),
    ("empty split", "{root}/images/val holds no images"),
    ("two images, one mask", "street_0002.jpg and street_0002.png would share one mask"),
    ("no classes.json", "{root}/classes.json not found"),
    ('{"names": ["a", "b"', "{root}/classes.json cannot be read as JSON"),
    ('{"names": ["road"]}', '"names" must list at least 2 class names'),
    ('{"names": ["a", "b", "a"]}', '"names" lists \'a\' more than once (indices 0, 2): give each class one name'),
    ('{"names": ["a", "b"], "ignore_index": 1}', '"ignore_index" 1 must be a whole number from 2 to 255'),
    ('{"names": ["a", "b"], "ignore_index": 254.5}', '"ignore_index" 254.5 must be a whole number from 2 to 255'),
    ('{"names": ["a", "b"], "colors": [[0, 0, 0], [1, 1, 1]], "names": ["c", "d", "e"]}',
     "{root}/classes.json: 'names' given more than once (Python's json keeps only the last): keep one"),
    ('{"names": ["a", "b"], "colors": [[0, 0, 0]]}', '"colors" must hold one [r, g, b] of 0-255 for each of the 2'),
    ('{"names": ["a", "b"], "colours": []}', "holds ['colours'], not only names, colors and ignore_index"),
])
def test_mistakes_in_your_own_data_end_in_one_line(folder_data, tmp_path, how, expect, capsys):
    root = str(tmp_path / "data")
    shutil.copytree(folder_data, root)
    _break(root, how)
    line = main_fails(["--data", root, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--check-only", "2"],
                       capsys)
    assert expect.format(root=root) in line, line


def test_a_mask_named_png_that_holds_jpeg_bytes_is_refused_at_start_and_wherever_it_is_read(folder_data, tmp_path):
    """Judged by its bytes, not its name, as a mask named .jpg is refused by its name: one line at start
    (check_files), the same where it is decoded (a cached run's first epoch), never class indices JPEG changed."""
    root = str(tmp_path / "data")
    shutil.copytree(folder_data, root)
    _break(root, "a train mask holding JPEG bytes")
    train = open_dataset(root, "train", cache_dir=str(tmp_path / "cache"))
    path = os.path.join(root, "masks", "train", "street_0005.png")
    line = (f"{path} holds JPEG bytes, not a PNG's, whatever its name says: export the label again as a PNG from its "
            "source (JPEG's compression changes class indices; converting this file keeps the changed ones)")
    for read in (train.check_files, lambda: train[train.labels.index(path)]):
        with pytest.raises(dataset.BadInput) as refused:
            read()
        assert str(refused.value) == line


@pytest.mark.parametrize("decoder, suffix", [("torchcodec", "jpg"), ("PIL", "jpg"), ("torchcodec", "png"),
                                             ("PIL", "png")])
def test_a_phone_photo_is_read_turned_as_its_mask_was_drawn(tmp_path, monkeypatch, decoder, suffix):
    """A JPEG stored 40x20 with EXIF orientation 6 is seen 20 wide and 40 high; its mask is drawn on what is seen."""
    if decoder == "PIL":
        monkeypatch.setattr(images, "_torchcodec_decode", None)
    root = tmp_path / "phone"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "masks" / split).mkdir(parents=True)
        stored = np.zeros((20, 40, 3), np.uint8)
        stored[:, :20] = 255  # the stored left half: turned a quarter clockwise, the top half as seen
        exif = Image.Exif()
        exif[0x0112] = 6
        Image.fromarray(stored).save(root / "images" / split / f"phone.{suffix}", exif=exif, quality=95)
        mask = np.zeros((40, 20), np.uint8)
        mask[:20] = 1  # drawn on the picture as seen: the top half is class 1
        Image.fromarray(mask).save(root / "masks" / split / "phone.png")
    (root / "classes.json").write_text(json.dumps({"names": ["dark", "bright"]}))
    val = open_dataset(str(root), "val")
    val.check_files()  # sizes compared as seen: no "is 20x40 but its image is 40x20"
    image, label = val[0]
    assert image.shape == (3, 40, 20)
    bright = image.float().mean(0) > 128
    assert (bright == (label == 1)).float().mean() > 0.95  # JPEG's blur at the edge aside


def test_a_cached_mask_is_checked_again_when_the_classes_change(folder_data, tmp_path):
    root, cache = str(tmp_path / "data"), str(tmp_path / "cache")
    shutil.copytree(folder_data, root)
    val = open_dataset(root, "val", cache_dir=cache)
    assert all(val[i][1].max() <= 6 or val[i][1].max() == 255 for i in range(len(val)))  # cached now
    with open(os.path.join(root, "classes.json"), "w") as f:
        json.dump({"names": CATEGORIES[:4]}, f)  # sky, human and vehicle no longer named
    fewer = open_dataset(root, "val", cache_dir=cache)
    with pytest.raises(dataset.BadInput, match="holds the class index [4-6], but .* names 4 classes"):
        [fewer[i] for i in range(len(fewer))]  # not silently ignored: the cached masks are read again


def test_a_checkpoint_from_before_classes_were_saved_is_cityscapes(trained, tiny_data, folder_data, tmp_path, capsys):
    old = str(tmp_path / "old.pth")
    checkpoint = torch.load(os.path.join(trained, "best.pth"), weights_only=True)
    del checkpoint["classes"]  # as main.py wrote them before it saved the classes
    torch.save(checkpoint, old)
    run_main(["--data", tiny_data, "--output-dir", str(tmp_path / "e"), "-e", "--resume", old, *TRAIN_ARGS])
    assert "  road" in capsys.readouterr().out
    line = main_fails(["--data", folder_data, "--output-dir", str(tmp_path / "e"), "-e", "--resume", old,
                        *TRAIN_ARGS], capsys)
    assert "was trained for 19 classes (road, sidewalk, building, ...)" in line, line


@pytest.mark.launch
def test_run_sh_names_what_a_folder_data_set_lacks(folder_data, tmp_path):
    data = str(tmp_path / "data")
    shutil.copytree(folder_data, data)
    os.remove(os.path.join(data, "classes.json"))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DATA": data, "OUTPUT_DIR": str(tmp_path / "out")}
    result = subprocess.run(["./run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "synthetic" not in output, output  # not quietly the demo instead
    assert output.strip().endswith(f"main.py: error: {data}/classes.json not found: a data set in images/ and "
                                   "masks/ names its classes there, as " + dataset._CLASSES_EXAMPLE), output


def test_weights_start_every_layer_but_a_classifier_for_other_classes(trained, folder_data, capsys):
    """--weights: the backbone and head of a Cityscapes model, and a fresh classifier for 7 classes."""
    from types import SimpleNamespace
    job.read_environment()  # as a run starts (an earlier --check-only test in this process left it quiet)
    saved = torch.load(os.path.join(trained, "best.pth"), weights_only=True)["model"]
    torch.manual_seed(0)
    model = build_model(TRAIN_ARGS[1], 7)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    best = os.path.join(trained, "best.pth")
    args = SimpleNamespace(weights=best, resume="", model=TRAIN_ARGS[1], output_stride=16)
    checkpoints.load_weights(model, args, {"names": CATEGORIES})
    assert "its classifier, trained for 19 classes (road, sidewalk, building, ...), does not fit the 7 classes of " \
           "--data and starts afresh" in capsys.readouterr().out
    for key, value in model.state_dict().items():
        expected = fresh[key] if key.startswith("classifier.") else saved[key]
        assert torch.equal(value, expected), key


def _events(folder):
    # Imported here: the other tests run without TensorBoard (requirements-test.txt installs it, so this runs in CI).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(folder, "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def test_own_data_fine_tuned_evaluated_predicted_and_its_curves_continue(trained, folder_data, tmp_path, capsys):
    out, preds = str(tmp_path / "out"), str(tmp_path / "preds")
    train = ["--data", folder_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "2", "--tensorboard",
             "--weights", os.path.join(trained, "best.pth")]
    run_main(train)
    assert "does not fit the 7 classes of --data and starts afresh" in capsys.readouterr().out
    # What the run wrote is what harness/paths.py's one table of run files names (-e's eval.json, below).
    assert sorted(os.listdir(out)) == sorted(name for name in paths.RUN_FILES if name != "eval.json")
    checkpoint = torch.load(os.path.join(out, "checkpoint.pth"), weights_only=True)
    assert checkpoint["classes"]["names"] == CATEGORIES and checkpoint["model"]["classifier.weight"].shape[0] == 7
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["iteration"] for r in records] == [4, 8] and list(records[0]["iou"]) == CATEGORIES

    # TensorBoard: the step curves and the epochs' points. Then a stop after epoch 2's points were written but
    # before its checkpoint (checkpoint.pth back to the one before), and the resumed run: every point once.
    events = _events(out)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [e.step for e in events.Scalars("val/mIoU")] == [4, 8]
    assert {f"val_IoU/{name}" for name in ("flat", "sky", "vehicle")} <= set(events.Tags()["scalars"])
    assert events.Images("val/image_truth_prediction")[-1].width == 3 * 64
    before = [e.value for e in events.Scalars("val/mIoU")]
    shutil.copy(os.path.join(out, "checkpoint.prev.pth"), os.path.join(out, "checkpoint.pth"))
    run_main([*train, "--resume", "auto"])
    assert f"--weights {os.path.join(trained, 'best.pth')} not read: the run continues from its checkpoint" in \
        capsys.readouterr().out
    events = _events(out)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [e.step for e in events.Scalars("val/mIoU")] == [4, 8]
    assert [e.value for e in events.Scalars("val/mIoU")] == pytest.approx(before)  # resumed bitwise on the CPU

    # -e: the classes' names in the table and eval.json, predictions written as the data set's own masks.
    capsys.readouterr()
    run_main(["--data", folder_data, "--output-dir", out, *TRAIN_ARGS, "-e", "--resume", os.path.join(out, "best.pth"),
              "--save-predictions", preds])
    assert "  vehicle" in capsys.readouterr().out
    with open(os.path.join(out, "eval.json")) as f:
        assert list(json.load(f)["iou"]) == CATEGORIES
    assert sorted(os.listdir(out)) == sorted(paths.RUN_FILES)  # and nothing the table does not name
    assert sorted(os.listdir(preds)) == [f"street_{i:04d}.png" for i in range(5)]
    with Image.open(os.path.join(preds, "street_0000.png")) as mask:
        assert mask.mode == "P" and mask.size == (64, 32) and int(np.asarray(mask).max()) < 7

    # A model of other classes on this data: one line, which says how to fine-tune instead.
    line = main_fails(["--data", folder_data, "--output-dir", out, *TRAIN_ARGS, "-e", "--resume",
                        os.path.join(trained, "best.pth")], capsys)
    assert "was trained for 19 classes" in line and "--data has 7 others" in line and "--weights" in line, line

    # predict.py: the classes' colours come from the checkpoint; labelIds are Cityscapes' alone.
    run_main(["--resume", os.path.join(out, "best.pth"), "-j", "0", os.path.join(folder_data, "images", "val"),
              "--output-dir", str(tmp_path / "p"), "--what", "color", "label"], program="predict")
    assert sorted(os.listdir(tmp_path / "p")) == ["color", "labels"]  # not trainIds/: these are not Cityscapes'
    with Image.open(tmp_path / "p" / "labels" / "street_0000.jpg.png") as indices:
        assert int(np.asarray(indices).max()) < 7
    with Image.open(tmp_path / "p" / "color" / "street_0000.jpg.png") as picture:
        colors = {tuple(c) for c in np.asarray(picture).reshape(-1, 3).tolist()}
    assert colors <= set(CATEGORY_COLORS), colors
    line = main_fails(["--resume", os.path.join(out, "best.pth"), folder_data, "--format", "labelid"], capsys,
                      program="predict")
    assert "this model's classes are not Cityscapes'" in line, line


def test_tensorboard_that_cannot_write_costs_the_curves_not_the_run(tiny_data, tmp_path, monkeypatch, capsys):
    from torch.utils.tensorboard import SummaryWriter
    monkeypatch.setattr(SummaryWriter, "add_scalar", no_space)
    out = str(tmp_path / "out")
    run_main(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "--epochs", "1", "--tensorboard"])
    said = capsys.readouterr()
    assert said.out.count("warning: TensorBoard cannot write ([Errno 28] No space left on device): no curves for "
                          "the rest of this run") == 1 and "Traceback" not in said.err, said
    assert os.path.isfile(os.path.join(out, "checkpoint.pth"))  # the disk that is full (the checkpoint's too) says so


def test_tensorboard_missing_stops_before_any_work(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)  # as if not installed
    line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--tensorboard"],
                       capsys)
    assert line == "main.py: error: --tensorboard needs TensorBoard, which is not installed: pip install tensorboard"
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("extra, expect", [
    (["-e", "--resume", "x.pth", "--weights", "y.pth"], "--weights starts a new training run from a trained model, "
                                                         "but -e evaluates --resume's model: give one of the two"),
    (["--resume", "x.pth", "--weights", "y.pth"], "but --resume continues a run: give one of the two"),
    (["--weights", "nothing.pth"], "--weights nothing.pth: no such file"),
    (["-e", "--resume", "x.pth", "--tensorboard"], "--tensorboard draws training's curves; -e writes eval.json"),
])
def test_weights_and_tensorboard_flags_that_cannot_work(tiny_data, tmp_path, extra, expect, capsys):
    line = main_fails(["--data", tiny_data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, *extra], capsys)
    assert expect in line, line


def test_which_data_set_a_folder_holds_when_it_could_be_both(tiny_data, folder_data, tmp_path):
    """An empty images/ beside Cityscapes' leftImg8bit/ is no folder data set (it has no classes.json); a
    classes.json beside leftImg8bit/ is an error, not a guess; ignore_index 255.0 is the whole number 255."""
    root = tmp_path / "both"
    shutil.copytree(tiny_data, root)
    (root / "images").mkdir()
    assert type(open_dataset(str(root), "val")).__name__ == "Cityscapes"
    shutil.copy(os.path.join(folder_data, "classes.json"), root / "classes.json")
    with pytest.raises(images.BadInput, match="holds both Cityscapes' leftImg8bit/ and a folder data set's"):
        open_dataset(str(root), "val")
    own = tmp_path / "own"
    shutil.copytree(folder_data, own)
    spec = json.loads((own / "classes.json").read_text())
    (own / "classes.json").write_text(json.dumps({**spec, "ignore_index": 255.0}))
    assert open_dataset(str(own), "val").ignore_value == 255


def test_an_image_of_any_size_up_to_the_limit_reads_without_a_warning_and_a_larger_one_in_one_line(tmp_path):
    """PIL warns past 89 million pixels and refuses past twice that; this program reads the user's own files up to
    2**28 pixels (a 14000 x 14000 aerial image) and names a larger one before decoding it. PNG headers alone: the
    size is read from them, no pixel is decoded."""
    import struct
    import warnings
    import zlib

    def header_only_png(path, width, height, colour_type=2):  # 2: RGB; 0: 8-bit grey, a Cityscapes label's kind
        def chunk(kind, data):
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        ihdr = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))
        return str(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's DecompressionBombWarning would fail this
        assert images.seen_size(header_only_png(tmp_path / "aerial.png", 14000, 14000)) == (14000, 14000, False)
        huge = header_only_png(tmp_path / "huge.png", 20000, 20000)
        grey = header_only_png(tmp_path / "huge_grey.png", 20000, 20000, colour_type=0)  # torchcodec's, for labels
        for read, path in [(images.read_image, huge), (images.seen_size, huge), (images.decode_label, huge),
                           (images.decode_label, grey)]:
            with pytest.raises(images.BadInput, match=r".png is 20000 x 20000 pixels, more than the 268,435,456 "
                                                      r"this program reads \(16384 x 16384\): cut it into tiles"):
                read(path)


def test_own_data_mistakes_name_their_real_cause(tmp_path, capsys):
    import numpy as np
    from PIL import Image
    argv = [*TRAIN_ARGS, "--check-only", "1", "--output-dir", str(tmp_path / "o")]
    data = own_data(tmp_path, [[[0, 1] * 3] * 4])
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
