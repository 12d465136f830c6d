import errno
import glob
import multiprocessing
import os
import shutil
import threading

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torchvision.transforms.v2 import functional as F

import images
from conftest import ROOT, TRAIN_ARGS, fingerprint, main_fails, run_main
import main
from dataset import (ID_TO_TRAINID, IGNORE_INDEX, TRAINID_TO_ID, BadInput, Cityscapes, open_dataset, read_image,
                     read_label, sample_generator, train_transform)
from harness import errors
from synthetic import draw_street, write_synthetic

# The official table (cityscapesScripts labels.py), typed here independently of the code.
OFFICIAL_TRAIN_IDS = {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11, 25: 12,
                      26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}


def test_id_to_trainid_equals_official_table():
    assert ID_TO_TRAINID.shape == (256,)
    expected = [OFFICIAL_TRAIN_IDS.get(label_id, 255) for label_id in range(256)]
    assert ID_TO_TRAINID.tolist() == expected
    assert TRAINID_TO_ID.tolist() == sorted(OFFICIAL_TRAIN_IDS)


def test_synthetic_set_has_official_layout_and_loads_through_torchvision(tiny_data):
    for split, count in (("train", 8), ("val", 5)):
        reference = torchvision.datasets.Cityscapes(tiny_data, split=split, mode="fine", target_type="semantic")
        ours = Cityscapes(tiny_data, split)
        assert len(reference) == len(ours) == count
        assert len({os.path.basename(os.path.dirname(p)) for p in ours.images}) >= 2  # several cities
        assert ours.images == sorted(reference.images)  # same files, in a defined order
        for index, path in enumerate(reference.images):
            name = os.path.basename(path)
            city, seq, frame, suffix = name.split("_")
            assert (len(seq), len(frame), suffix) == (6, 6, "leftImg8bit.png")
            _, target = reference[index]
            label_ids = torch.from_numpy(np.array(target))
            _, label = ours[ours.images.index(path)]
            assert torch.equal(label, ID_TO_TRAINID[label_ids.long()])  # labelIds -> trainIds


def test_synthetic_scenes_are_deterministic_varied_and_labelled(tmp_path):
    write_synthetic(str(tmp_path / "a"), 6, 2, (128, 64), seed=1)
    write_synthetic(str(tmp_path / "b"), 6, 2, (128, 64), seed=1)
    write_synthetic(str(tmp_path / "c"), 6, 2, (128, 64), seed=2)
    files = sorted(os.path.relpath(os.path.join(d, f), tmp_path / "a")
                   for d, _, fs in os.walk(tmp_path / "a") for f in fs)
    read = lambda root, f: np.array(Image.open(os.path.join(root, f)))  # noqa: E731
    assert all(np.array_equal(read(tmp_path / "a", f), read(tmp_path / "b", f)) for f in files)
    assert not all(np.array_equal(read(tmp_path / "a", f), read(tmp_path / "c", f)) for f in files)
    present = set()
    for f in files:
        if f.endswith("labelIds.png"):
            present |= set(np.unique(ID_TO_TRAINID[torch.from_numpy(read(tmp_path / "a", f)).long()]).tolist())
    # road, sidewalk, building, vegetation, sky, car at least, and ignored pixels (the ego vehicle)
    assert {0, 1, 2, 8, 10, 13, IGNORE_INDEX} <= present


def test_train_transform_pads_label_with_ignore_and_keeps_pairs_aligned():
    height, width = 40, 60
    # Vertical stripes 10 pixels wide: label k, image value 30 * k. A crop, resize or flip applied to one
    # and not the other shows up as disagreement.
    stripe = (torch.arange(width) // 10).expand(height, width)
    image = torchvision.tv_tensors.Image((stripe * 30).to(torch.uint8).expand(3, height, width).clone())
    label = torchvision.tv_tensors.Mask(stripe.to(torch.uint8)[None].clone())
    padded = 0
    for seed in range(40):
        out_image, out_label = train_transform(image, label, (64, 64), torch.Generator().manual_seed(seed))
        assert out_image.shape == (3, 64, 64) and out_label.shape == (1, 64, 64)
        pad = (out_label == IGNORE_INDEX)[0]
        padded += int(pad.any())
        assert torch.all(out_image[:, pad] == 0)  # image padded with 0, label with 255 (not 0 = road)
        agree = (out_image[0][~pad].float() / 30).round() == out_label[0][~pad].float()
        assert agree.float().mean() > 0.8  # only the blurred stripe edges may differ
    assert padded > 0  # a scale below 1 happened and was padded


def test_persistent_workers_see_the_epoch_and_augmentation_depends_only_on_it(tiny_data):
    train_set = Cityscapes(tiny_data, "train", crop_size=(32, 32), seed=7)
    loader = torch.utils.data.DataLoader(train_set, batch_size=4, num_workers=2, persistent_workers=True)
    batches = {}
    for epoch in (0, 1, 0):
        train_set.epoch = epoch
        batches.setdefault(epoch, []).append(torch.cat([images for images, _ in loader]))
    assert torch.equal(batches[0][0], batches[0][1])  # the same epoch draws the same crops, any worker
    assert not torch.equal(batches[0][0], batches[1][0])  # the workers saw the new epoch
    train_set.epoch = 0  # and what the workers drew is what this process draws for epoch 0
    assert torch.equal(torch.stack([train_set[i][0] for i in range(len(train_set))]), batches[0][0])


def test_samples_are_uint8_and_the_crop_read_first_is_train_transform_of_the_whole_frame(tiny_data):
    train_set = Cityscapes(tiny_data, "train", crop_size=(48, 48), seed=5)
    for epoch in (0, 1):
        train_set.epoch = epoch
        for index in range(len(train_set)):
            image, label = train_set[index]
            assert image.dtype == label.dtype == torch.uint8
            assert image.shape == (3, 48, 48) and label.shape == (48, 48)
            # The same draw applied to the whole decoded frame, as train_transform does it.
            with Image.open(train_set.images[index]) as f:
                whole = torchvision.tv_tensors.Image(torch.from_numpy(np.array(f.convert("RGB"))).permute(2, 0, 1))
            with Image.open(train_set.labels[index]) as f:
                whole_label = torchvision.tv_tensors.Mask(torch.from_numpy(np.array(f))[None])
            expected_image, expected_label = train_transform(whole, whole_label, (48, 48),
                                                             sample_generator(5, epoch, index))
            assert torch.equal(image, expected_image)
            assert torch.equal(label, ID_TO_TRAINID[expected_label[0].long()])


def test_main_py_s_normalize_equals_torchvision_float_conversion_on_every_device():
    """main.py's own normalize (the lesson asks the data set for uint8 alone) gives torchvision.transforms.v2's floats
    (to_dtype with scale, then normalize), bit for bit: checkpoints trained with them predict the same."""
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (2, 3, 8, 16), dtype=torch.uint8, generator=generator)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for pixels in (batch.to(device), batch[0].to(device)):
            out = main.normalize(pixels)
            assert out.dtype == torch.float32 and out.device == pixels.device
            assert torch.equal(out, F.normalize(F.to_dtype(pixels, torch.float32, scale=True), main.MEAN, main.STD))


def test_the_data_sets_ignore_label_is_the_lesson_s():
    """dataset.py pads and maps to 255 where main.py's loss and mIoU ignore a pixel: the contract's one value."""
    assert IGNORE_INDEX == main.IGNORE_INDEX == 255


def test_photo_frames_are_photo_sized_with_the_scene_labels(tmp_path):
    plain, photo = draw_street(np.random.default_rng(1), 512, 256), draw_street(np.random.default_rng(1), 512, 256, True)
    assert np.array_equal(plain[1], photo[1])  # the same scene: labels untouched
    texture = photo[0].astype(np.float32) - plain[0].astype(np.float32)
    assert 3 < texture.std() < 40  # visible texture, not a new picture
    write_synthetic(str(tmp_path), 1, 1, (512, 256), seed=1, photo=True)
    (path,) = glob.glob(str(tmp_path / "leftImg8bit" / "train" / "*" / "*.png"))
    # A real 2048x1024 frame: about 2.2 MB, 1.05 bytes a pixel; a plain synthetic one (noise sigma 8) about 2.2.
    assert 0.9 < os.path.getsize(path) / (512 * 256) < 1.3


@pytest.mark.parametrize("decoder", ["torchcodec", "PIL"])
def test_decoded_pixels_and_label_indices_are_bitwise_pil_s(tmp_path, monkeypatch, decoder):
    if decoder == "PIL":  # what decodes where torchcodec is not installed
        monkeypatch.setattr(images, "_torchcodec_decode", None)
    else:
        pytest.importorskip("torchcodec")
    image, label_ids, _ = draw_street(np.random.default_rng(2), 128, 64, photo=True)
    Image.fromarray(image).save(tmp_path / "rgb.png")
    Image.fromarray(image).convert("RGBA").save(tmp_path / "rgba.png")
    Image.fromarray(label_ids).save(tmp_path / "grey.png")
    palette = Image.fromarray(label_ids).convert("P")  # indices, with colours unlike them
    palette.putpalette([(i * 37) % 256 for i in range(768)])
    palette.save(tmp_path / "palette.png")
    for name in ("rgb", "rgba"):
        with Image.open(tmp_path / f"{name}.png") as f:
            assert np.array_equal(read_image(str(tmp_path / f"{name}.png")), np.array(f.convert("RGB")))
    assert np.array_equal(read_image(str(tmp_path / "rgb.png")), image)
    for name in ("grey", "palette"):
        assert np.array_equal(read_label(str(tmp_path / f"{name}.png")), label_ids), name
    Image.fromarray(label_ids.astype(np.uint16) * 1000).save(tmp_path / "sixteen.png")
    with pytest.raises(BadInput, match="sixteen.png is not a Cityscapes labelIds image"):
        read_label(str(tmp_path / "sixteen.png"))


def copy_of(tiny_data, tmp_path):
    root = str(tmp_path / "data")
    shutil.copytree(tiny_data, root)
    return root


@pytest.mark.parametrize("cached", [False, True])
def test_a_truncated_image_or_label_is_a_bad_input_naming_the_file(tiny_data, tmp_path, cached):
    root = copy_of(tiny_data, tmp_path)
    cache_dir = str(tmp_path / "cache") if cached else None
    for which in ("images", "labels"):
        data = Cityscapes(root, "val", crop_size=(16, 16), cache_dir=cache_dir)
        index = 1 if which == "images" else 2
        path = data.images[index] if which == "images" else data.labels[index]
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        with pytest.raises(BadInput, match=f"{path} cannot be decoded .*; replace it, or remove the image and its label"):
            data[index]


@pytest.mark.parametrize("decoder", ["torchcodec", "PIL"])
def test_an_image_is_read_as_its_bytes_say_whatever_its_name(tmp_path, monkeypatch, decoder):
    """A .png that holds JPEG bytes and a .jpg that holds PNG bytes: each read as what its bytes are, the same pixels
    as the rightly named file's (images are judged by content; only labels must be PNGs)."""
    if decoder == "PIL":
        monkeypatch.setattr(images, "_torchcodec_decode", None)
    else:
        pytest.importorskip("torchcodec")
    image = draw_street(np.random.default_rng(4), 64, 32, photo=True)[0]
    Image.fromarray(image).save(tmp_path / "real.png")
    Image.fromarray(image).save(tmp_path / "real.jpg", quality=80)
    shutil.copy(tmp_path / "real.jpg", tmp_path / "jpeg_bytes.png")
    shutil.copy(tmp_path / "real.png", tmp_path / "png_bytes.jpg")
    with Image.open(tmp_path / "real.jpg") as f:
        jpeg_pixels = np.array(f.convert("RGB"))
    assert not np.array_equal(jpeg_pixels, image)  # JPEG's compression shows: the two readings differ
    for misnamed, rightly_named, expected in (("jpeg_bytes.png", "real.jpg", jpeg_pixels),
                                              ("png_bytes.jpg", "real.png", image)):
        pixels = read_image(str(tmp_path / misnamed))
        assert np.array_equal(pixels, read_image(str(tmp_path / rightly_named))), misnamed
        assert np.array_equal(pixels, expected), misnamed
        assert images.seen_size(str(tmp_path / misnamed)) == (64, 32, False)


NOT_PNG = "holds {held}, not a PNG's, whatever its name says: export the label again as a PNG from its source ({why})"
JPEG_WHY = "JPEG's compression changes class indices; converting this file keeps the changed ones"


def write_over(path, how):
    """A label file's bytes replaced, its name kept: its values saved as JPEG (a careless re-export) or WebP, or an
    HTML page (a download that failed)."""
    with Image.open(path) as f:
        values = np.array(f)
    if how == "html":
        with open(path, "w") as f:
            f.write("<html><body>Please log in</body></html>")
    else:
        Image.fromarray(values).save(path, format=how, **({"lossless": True} if how == "WEBP" else {}))
    return values


@pytest.mark.parametrize("how, held, why", [
    ("JPEG", "JPEG bytes", JPEG_WHY),
    ("WEBP", "WEBP bytes", "labels are read as PNGs"),
    ("html", None, None),
])
def test_a_labelids_png_that_holds_other_bytes_is_refused_at_start_in_one_line(tiny_data, tmp_path, how, held, why):
    """Judged by its bytes, not its name: a train label (opened at start, not decoded) and a val label (decoded at
    start), each refused by check_files with one line naming the file; and wherever it is decoded."""
    root = copy_of(tiny_data, tmp_path)
    for split, decode_labels, index in (("train", False, 3), ("val", True, 1)):
        data = open_dataset(root, split)
        path = data.labels[index]
        label_ids = write_over(path, how)
        if how == "JPEG":  # what the check prevents: PIL opens it by its content, with class indices changed
            with Image.open(path) as f:
                assert f.format == "JPEG" and not np.array_equal(np.array(f), label_ids)
        line = f"{path} " + (NOT_PNG.format(held=held, why=why) if held else "is no image PIL reads (it begins "
                             "b'<html><b'): export the label again as a PNG, or copy or download it again")
        with pytest.raises(BadInput) as refused:
            data.check_files(decode_labels=decode_labels)
        assert str(refused.value) == line
        for read in (lambda: read_label(path), lambda: data[index]):
            with pytest.raises(BadInput) as refused:
                read()
            assert str(refused.value) == line
        shutil.copy(os.path.join(tiny_data, os.path.relpath(path, root)), path)  # whole again, for the next split


def outputs(data, epochs=(0, 1)):
    result = []
    for epoch in epochs:
        data.epoch = epoch
        result += [data[i] for i in range(len(data))]
    return result


def assert_same(a, b):
    assert len(a) == len(b)
    for (image_a, label_a), (image_b, label_b) in zip(a, b):
        assert torch.equal(image_a, image_b) and torch.equal(label_a, label_b)


def test_a_cached_run_is_bitwise_the_uncached_run(tiny_data, tmp_path):
    cache_dir = str(tmp_path / "cache")
    for split, crop in (("train", (40, 40)), ("val", None)):
        reference = outputs(Cityscapes(tiny_data, split, crop_size=crop, seed=3))
        filling = outputs(Cityscapes(tiny_data, split, crop_size=crop, seed=3, cache_dir=cache_dir))  # decodes, writes
        from_cache = Cityscapes(tiny_data, split, crop_size=crop, seed=3, cache_dir=cache_dir)
        assert isinstance(from_cache.frame(0)[0], np.memmap)  # read from the cache, not decoded
        assert_same(reference, filling)
        assert_same(reference, outputs(from_cache))
    assert len(glob.glob(os.path.join(cache_dir, "*.npy"))) == 2 * (8 + 5)


def _read_all(root, cache_dir, queue):
    queue.put([(image.sum().item(), label.sum().item()) for image, label in outputs(
        Cityscapes(root, "train", crop_size=(24, 24), cache_dir=cache_dir), epochs=(0,))])


def test_many_processes_and_threads_filling_one_empty_cache_agree(tiny_data, tmp_path):
    cache_dir = str(tmp_path / "cache")
    expected = [(image.sum().item(), label.sum().item()) for image, label in outputs(
        Cityscapes(tiny_data, "train", crop_size=(24, 24)), epochs=(0,))]
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=_read_all, args=(tiny_data, cache_dir, queue)) for _ in range(4)]
    threads = [threading.Thread(target=_read_all, args=(tiny_data, cache_dir, queue)) for _ in range(3)]
    for worker in processes + threads:
        worker.start()
    results = [queue.get(timeout=120) for _ in processes + threads]
    for worker in processes + threads:
        worker.join()
    assert results == [expected] * 7
    assert sorted(os.listdir(cache_dir)) == sorted(f for f in os.listdir(cache_dir) if f.endswith(".npy"))  # no temp
    assert len(os.listdir(cache_dir)) == 2 * 8


def test_an_interrupted_cache_write_leaves_no_cache_file(tiny_data, tmp_path, monkeypatch):
    cache_dir = str(tmp_path / "cache")
    data = Cityscapes(tiny_data, "val", cache_dir=cache_dir)

    def save_half_then_die(f, array):
        f.write(b"\x93NUMPY")
        raise KeyboardInterrupt  # as a Ctrl-C in the middle of writing

    monkeypatch.setattr(np, "save", save_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        data[0]
    assert os.listdir(cache_dir) == []  # neither a half file under the final name nor a temporary
    monkeypatch.undo()
    assert_same([data[0]], [Cityscapes(tiny_data, "val")[0]])


def test_a_changed_source_is_decoded_again_not_served_stale(tiny_data, tmp_path):
    root, cache_dir = copy_of(tiny_data, tmp_path), str(tmp_path / "cache")
    data = Cityscapes(root, "val", cache_dir=cache_dir)
    before = data[2]
    image = np.array(Image.open(data.images[2]))
    Image.fromarray(255 - image).save(data.images[2])  # a new version of the frame
    after = data[2]
    assert torch.equal(after[0], 255 - before[0])
    assert_same([after], [Cityscapes(root, "val")[2]])
    assert len(glob.glob(os.path.join(cache_dir, "*.npy"))) == 2  # the old version's file is gone


@pytest.mark.parametrize("damage", ["truncated", "header overwritten"])
def test_a_damaged_cache_file_is_rebuilt_not_trusted(tiny_data, tmp_path, damage):
    cache_dir = str(tmp_path / "cache")
    reference = outputs(Cityscapes(tiny_data, "val", crop_size=(16, 16)))
    outputs(Cityscapes(tiny_data, "val", crop_size=(16, 16), cache_dir=cache_dir))
    for path in glob.glob(os.path.join(cache_dir, "*.npy")):
        with open(path, "r+b") as f:
            if damage == "truncated":
                f.truncate(os.path.getsize(path) - 7)
            else:
                f.write(b"garbage")
    assert_same(reference, outputs(Cityscapes(tiny_data, "val", crop_size=(16, 16), cache_dir=cache_dir)))
    data = Cityscapes(tiny_data, "val", cache_dir=cache_dir)
    assert all(isinstance(array, np.memmap) for array in data.frame(0))  # whole again


@pytest.mark.launch
def test_prepare_cache_fills_the_cache_that_training_reads(tiny_data, tmp_path):
    """python path/to/harness/cache.py, run as a file from another folder (a program's launch is the point here),
    with two worker processes."""
    import subprocess
    import sys
    cache_dir = str(tmp_path / "cache")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "harness", "cache.py"), cache_dir, "--data", tiny_data,
                             "-j", "2"], cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(glob.glob(os.path.join(cache_dir, "*.npy"))) == 2 * (8 + 5)
    data = Cityscapes(tiny_data, "train", crop_size=(24, 24), cache_dir=cache_dir)
    assert all(isinstance(array, np.memmap) for index in range(len(data)) for array in data.frame(index))


def _png16(path, values, colour_type):
    """A 16-bit PNG written by hand (PIL writes 16-bit greyscale only): colour type 0 grey, 2 RGB, 4 grey+alpha,
    6 RGBA; values (H, W, channels) uint16."""
    import struct
    import zlib
    height, width = values.shape[:2]
    rows = b"".join(b"\x00" + values[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def test_every_mode_and_bit_depth_decodes_to_the_same_pixels_in_training_and_in_predict_py(tmp_path, monkeypatch):
    import predict
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8))
    for mode in ("RGB", "RGBA", "L", "LA", "P", "1"):
        rgb.convert(mode).save(tmp_path / f"{mode}.png")
    rgb.convert("P").save(tmp_path / "P-transparent.png", transparency=3)
    for mode in ("RGB", "L", "CMYK"):
        rgb.convert(mode).save(tmp_path / f"{mode}.jpg")
    for name in ("x.webp", "x.bmp", "x.tiff"):
        rgb.save(tmp_path / name)
    grey16 = np.array([[0, 1000, 32896, 65535]], np.uint16)
    Image.fromarray(grey16).save(tmp_path / "I16.png")
    for colour_type, channels in ((2, 3), (4, 2), (6, 4)):
        _png16(tmp_path / f"16bit-{colour_type}.png", rng.integers(0, 65536, (5, 7, channels)).astype(np.uint16),
               colour_type)
    paths = sorted(str(p) for p in tmp_path.iterdir())
    with_torchcodec = [images.read_image(p) for p in paths]
    monkeypatch.setattr(images, "_torchcodec_decode", None)  # where torchcodec is not installed
    for path, expected in zip(paths, with_torchcodec):
        assert np.array_equal(images.read_image(path), expected), path
    predicted = predict.ImageFiles(paths)  # what predict.py decodes, in its workers
    for index, (path, expected) in enumerate(zip(paths, with_torchcodec)):
        assert torch.equal(predicted[index][1], torch.from_numpy(np.array(expected)).permute(2, 0, 1)), path
    # 16 bits scaled to 8, not clipped: 1000 / 257 is 3.9
    assert images.read_image(str(tmp_path / "I16.png"))[0, :, 0].tolist() == [0, 4, 128, 255]


@pytest.mark.usefixtures("on_the_cpu")
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


@pytest.mark.usefixtures("on_the_cpu")
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
                    f"the program permission to read it and the folders in it (ls -ld {unreadable}: its owner and mode)")
    os.chmod(unreadable, 0o755)  # the advice followed (as root: the refusal taken away with the patch)
    run_main(argv)  # --check-only: every check passes
    assert "error" not in capsys.readouterr().err
