"""Every input is listed by one function, images.input_files (the training data of both layouts, predict.py's
folders), and judged by its type, not its name: a named pipe called like an image is named and skipped (opening one
waits for a writer for ever), macOS's AppleDouble files (._NAME) are no pictures, and a classes.json that cannot be
read, however it fails, ends in one line."""
import json
import os
import shutil
import threading
from contextlib import suppress

import pytest

import images
from conftest import TRAIN_ARGS, main_fails

pytestmark = pytest.mark.usefixtures("on_the_cpu")


def _pipe_that_answers(path):
    """A named pipe at path whose writer gives a reader a few bytes: without the type check, a reader would not
    hang but fail on them, so that the test fails instead of hanging. -> a function that releases the writer where
    nothing read the pipe."""
    os.mkfifo(path)

    def write():
        with suppress(BrokenPipeError), open(path, "wb") as f:  # waits for a reader (released: one that left)
            f.write(b"not a picture")

    threading.Thread(target=write, daemon=True).start()
    return lambda: os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))


def _apple_double(path):
    """macOS's record of path's metadata, as a FAT or network disk holds it beside path: ._NAME."""
    with open(os.path.join(os.path.dirname(path), "._" + os.path.basename(path)), "wb") as f:
        f.write(b"\x00\x05\x16\x07" + bytes(60))  # AppleDouble's magic number, then a header: no picture


def test_the_lister_takes_regular_files_and_names_the_rest(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.png").write_bytes(b"x")
    os.symlink(tmp_path / "a" / "x.png", tmp_path / "linked.png")
    os.symlink(tmp_path / "a", tmp_path / "latest")  # a second way to a folder: its files listed once, no loop
    release = _pipe_that_answers(str(tmp_path / "cam.jpg"))
    _apple_double(str(tmp_path / "a" / "x.png"))
    files, others = images.input_files(str(tmp_path))
    release()
    assert files == [str(tmp_path / "a" / "x.png"), str(tmp_path / "linked.png")]
    assert others == [(str(tmp_path / "cam.jpg"), "a named pipe")]
    assert images.input_files(str(tmp_path), recursive=False)[0] == [str(tmp_path / "linked.png")]
    os.symlink(tmp_path, tmp_path / "a" / "up")  # a link back up: a loop
    with pytest.raises(images.BadInput, match="up leads back to a folder already listed"):
        images.input_files(str(tmp_path))
    os.remove(tmp_path / "a" / "up")
    os.symlink(tmp_path / "gone.png", tmp_path / "a" / "broken.png")
    with pytest.raises(images.BadInput, match="broken.png is a symbolic link that leads nowhere"):
        images.input_files(str(tmp_path))


@pytest.mark.parametrize("layout", ["cityscapes", "folder"])
def test_a_pipe_named_like_an_image_among_the_training_data_is_skipped_and_named(layout, tiny_data, folder_data,
                                                                                 tmp_path, capsys):
    data = str(tmp_path / "data")
    shutil.copytree(tiny_data if layout == "cityscapes" else folder_data, data)
    train = (os.path.join(data, "leftImg8bit", "train", "aachen") if layout == "cityscapes" else
             os.path.join(data, "images", "train"))
    first = sorted(os.listdir(train))[0]
    name = "aachen_000099_000019_leftImg8bit.png" if layout == "cityscapes" else "cam.jpg"
    release = _pipe_that_answers(os.path.join(train, name))
    _apple_double(os.path.join(train, first))
    import main
    main.main(main.get_args_parser().parse_args(["--data", data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS,
                                                 "--epochs", "1"]))  # (--check-only says nothing but mistakes)
    release()
    said = capsys.readouterr()
    assert "error" not in said.err, said.err
    assert f"note: 1 entry of {data} skipped: not files to read (e.g. {os.path.join(train, name)}, a named pipe)" \
        in said.out, said.out
    assert "._" not in said.out + said.err


def test_a_pipe_among_predict_s_inputs_is_skipped_and_named(trained, tmp_path, capsys):
    from PIL import Image
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.new("RGB", (8, 6)).save(photos / "a.png")
    _apple_double(str(photos / "a.png"))
    release = [_pipe_that_answers(str(photos / "cam.jpg")), _pipe_that_answers(str(tmp_path / "door.jpg"))]
    import predict
    for i, inputs in enumerate(([str(photos)], [str(photos / "a.png"), str(tmp_path / "door.jpg")])):
        out = tmp_path / f"out{i}"
        predict.main(predict.get_args_parser().parse_args(["--resume", os.path.join(trained, "best.pth"), *inputs,
                                                           "-j", "0", "--output-dir", str(out)]))
        said = capsys.readouterr().out
        assert "note: 1 input(s) skipped: not files to read" in said and "a named pipe" in said, said
        assert sorted(os.listdir(out / "color")) == ["a.png.png"], said  # the AppleDouble file is no input
    for each in release:
        each()


@pytest.mark.parametrize("content, expect", [
    ("[" * 100_000 + "]" * 100_000, "cannot be read as JSON (maximum recursion depth exceeded"),
    (None, "classes.json is a named pipe, not a file"),
])
def test_a_classes_json_that_cannot_be_read_ends_in_one_line(content, expect, folder_data, tmp_path, capsys):
    data = str(tmp_path / "data")
    shutil.copytree(folder_data, data)
    os.remove(os.path.join(data, "classes.json"))
    if content is None:
        release = _pipe_that_answers(os.path.join(data, "classes.json"))
    else:
        with open(os.path.join(data, "classes.json"), "w") as f:
            f.write(content)
    line = main_fails(["--data", data, "--output-dir", str(tmp_path / "out"), *TRAIN_ARGS, "--check-only", "1"],
                      capsys)
    assert expect in line, line
    if content is None:
        release()
    json.loads("[]")  # (the json module still works after the deep one)
