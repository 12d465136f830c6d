"""main.py's lesson lifts whole: with its harness taken out (tests/tools/lesson.py), it runs on torch, models.py and
dataset.py alone, in a folder that holds nothing else of the project; and on a data set and a model written from
its docstring's contract alone, it trains, evaluates each val image once, saves and resumes bitwise."""
import ast
import builtins
import importlib.util
import os
import re
import shutil
import subprocess
import symtable
import sys

import pytest
import torch

import lesson
import main
from conftest import ROOT, TRAIN_ARGS, finish_ranks, fork_ranks
from harness import preflight

CONTRACT = os.path.join(ROOT, "tests", "contract")  # dataset.py and models.py written from main.py's docstring alone


def test_without_its_harness_main_py_trains_evaluates_saves_and_resumes(tiny_data, tmp_path, monkeypatch, capsys):
    """The lesson lifted into a folder of its own beside copies of models.py, dataset.py and images.py: it imports
    nothing else of the project, and with the project's own data set and model it trains, evaluates, saves, and
    resumes at the next epoch from its checkpoint. In this process, imported from that folder with the copies (the
    static check of its imports, first in this test, covers main and harness, which this process has loaded). The
    launch the tutorial teaches, torchrun on two processes, is the contract test's (below), with -e as one plain
    python main.py."""
    with open(os.path.join(ROOT, "main.py")) as f:
        stripped, taken = lesson.strip(f.read())
    # Taking the harness out took no statement of the lesson with it (no lesson line needs a value of the harness).
    assert taken and not [(first, last) for first, last, indirect in taken if indirect], taken
    imported = {node.module if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.parse(stripped).body if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}
    project = {os.path.splitext(name)[0] for name in os.listdir(ROOT) if name.endswith(".py")} | {"harness"}
    assert {name.split(".")[0] for name in imported} & project == {"models", "dataset"}, imported
    assert "harness" not in stripped.lower()  # no word of it left: every comment is about what remains
    folder = _lesson_in(tmp_path / "lesson", *(os.path.join(ROOT, name) for name in ("models.py", "dataset.py",
                                                                                     "images.py")))
    # Its imports found in its folder alone: nothing of the project's folder loaded meanwhile.
    lifted, loaded = _import_lifted(folder, monkeypatch)
    assert {name for name, path in loaded.items() if path.startswith(ROOT + os.sep)} == set(), loaded
    assert loaded["dataset"].startswith(str(folder)) and loaded["models"].startswith(str(folder)), loaded
    out = str(tmp_path / "out")
    lesson_args = ["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS]
    lifted.main(lifted.get_args_parser().parse_args([*lesson_args, "--epochs", "1"]))
    said = capsys.readouterr().out
    assert "1 process(es), backend none" in said and "epoch 0: train loss" in said and "mIoU" in said, said
    assert torch.load(os.path.join(out, "checkpoint.pth"), weights_only=True)["epoch"] == 1
    lifted.main(lifted.get_args_parser().parse_args([*lesson_args, "--epochs", "2", "--resume",
                                                     os.path.join(out, "checkpoint.pth")]))
    said = capsys.readouterr().out
    assert "epochs 1..1" in said and "epoch 1: train loss" in said and "epoch 0 step" not in said, said
    assert torch.load(os.path.join(out, "checkpoint.pth"), weights_only=True)["epoch"] == 2


def leftovers(source):
    """What pyflakes would say of a program's names, read from Python's own symbol tables: an import never used, a
    local variable assigned and never read, a name used and defined nowhere. -> the problems, one line each."""
    top = symtable.symtable(source, "lesson", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    used, problems = set(), []

    def visit(table):
        function = table.get_type() == "function"
        for symbol in table.get_symbols():
            name = symbol.get_name()
            if symbol.is_referenced() and (not function or symbol.is_global() or symbol.is_free()):
                used.add(name)
            if function and symbol.is_local() and symbol.is_assigned() and not symbol.is_referenced() \
                    and not symbol.is_parameter():
                problems.append(f"{name} is assigned in {table.get_name()}() and never read")
            if symbol.is_referenced() and (symbol.is_global() or not function) and name not in defined \
                    and not hasattr(builtins, name) and name != "__file__":  # (what every module is given)
                problems.append(f"{name} is used in {table.get_name()} and defined nowhere")
        for child in table.get_children():
            visit(child)
    visit(top)
    return problems + [f"{s.get_name()} is imported and never used" for s in top.get_symbols()
                       if s.is_imported() and s.get_name() not in used]


def test_the_printed_lesson_has_no_leftovers():
    """No import, variable or value left behind by the harness's removal (the check finds each kind: first shown)."""
    found = leftovers("import os\nimport time\ndef f():\n    kept = os.getpid()\n    return missing\n")
    assert sorted(found) == ["kept is assigned in f() and never read", "missing is used in f and defined nowhere",
                             "time is imported and never used"], found
    with open(os.path.join(ROOT, "main.py")) as f:
        stripped, _ = lesson.strip(f.read())
    assert leftovers(stripped) == []


def _lesson_in(folder, *modules):
    """The printed lesson as main.py in folder, beside copies of modules (paths). -> folder."""
    with open(os.path.join(ROOT, "main.py")) as f:
        stripped, _ = lesson.strip(f.read())
    folder.mkdir()
    (folder / "main.py").write_text(stripped)
    for path in modules:
        shutil.copy(path, folder / os.path.basename(path))
    return folder


def _import_lifted(folder, monkeypatch):
    """The lesson in folder (_lesson_in) imported in this process as the module lifted_lesson, its imports found in
    its folder first: the project's own modules of the names the folder holds out of sys.modules, and the lesson in,
    as lifted_lesson (a rank forked from here imports it by that name); both as before after the test.
    -> (the module, {name: file} of every module its import loaded)."""
    for name in ("models", "dataset", "images"):
        if (folder / f"{name}.py").exists():
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(folder))
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location("lifted_lesson", folder / "main.py")
    lifted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lifted)
    loaded = {name: getattr(sys.modules[name], "__file__", None) or "" for name in set(sys.modules) - before}
    monkeypatch.setitem(sys.modules, "lifted_lesson", lifted)
    return lifted, loaded


def _contract_module(name):
    """tests/contract's dataset.py or models.py, imported under a name of its own (the project's own are loaded)."""
    spec = importlib.util.spec_from_file_location(f"contract_{name}", os.path.join(CONTRACT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _miou(model, val_set, num_classes, counted):
    """The mIoU over the val images counted (indices, repeats allowed), worked out here: TP / (TP + FP + FN) for each
    class that occurs, label 255 left out."""
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    model.eval()
    with torch.no_grad():
        for index in counted:
            image, label = val_set[index]
            prediction = model(main.normalize(image[None]))[0].argmax(0)
            known = label != 255
            confusion += torch.bincount(label[known].long() * num_classes + prediction[known],
                                        minlength=num_classes ** 2).view(num_classes, num_classes)
    hits = confusion.diag().double()
    union = confusion.sum(0) + confusion.sum(1) - hits
    return (hits[union > 0] / union[union > 0]).mean().item()


@pytest.mark.launch
def test_the_lesson_on_a_data_set_and_a_model_written_from_its_contract_alone(tmp_path, monkeypatch, capsys):
    """The printed lesson beside tests/contract's dataset.py and models.py, written from main.py's docstring and
    importing nothing of the project, on two gloo processes with a persistent worker each (-j 1). It trains 2 epochs
    straight, in two ranks forked from this process (which imports the lesson first). It trains 2 epochs again under
    torchrun, crashed in the second (the data set fails there). Two forked ranks resume it from the checkpoint of its
    first epoch. (tests/contract's classes have nothing public beyond the contract.) The weights and the optimizer
    equal bit for bit. That needs what the contract says of the augmentation's draw, and of .epoch: with a plain
    attribute, the persistent workers never see epoch 1 (the crash does not come, checked first, and their draw
    stays at epoch 0's).
    The mIoU printed is the one worked out here over each val image once (5 images on 2 ranks: counting one twice,
    as a padded sampler would, differs), and the one -e prints in one plain process (this one), without the optional
    save_prediction. The model's name is not given: MODEL_NAMES' first is the default."""
    folder = _lesson_in(tmp_path / "lesson", os.path.join(CONTRACT, "dataset.py"), os.path.join(CONTRACT, "models.py"))
    lifted, loaded = _import_lifted(folder, monkeypatch)
    assert {name for name, path in loaded.items() if path.startswith(ROOT + os.sep)} == set(), loaded
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "main.py"]
    common = ["--data", "unused", "--pretrained-backbone", "none", "--crop-size", "32", "-b", "2", "-j", "1",
              "--lr", "0.05", "--seed", "3"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    said = finish_ranks(fork_ranks([*common, "--epochs", "2", "--output-dir", straight], str(tmp_path / "logs"),
                                   program="lifted_lesson"))[0]
    # The crash after epoch 1's first batch (-b 2): its step's all-reduce waits for rank 0, which saved epoch 0 first.
    crashed = subprocess.run([*torchrun, *common, "--epochs", "2", "--output-dir", resumed], cwd=str(folder),
                             env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                                  "CONTRACT_CRASH": "1 2"}, capture_output=True, text=True, timeout=240)
    assert crashed.returncode != 0 and "the test's crash in epoch 1" in crashed.stdout + crashed.stderr, crashed
    for output in (said, crashed.stdout):
        assert "2 process(es), backend gloo" in output, output
        assert "training tiny_shapes on 24 images (6 steps/epoch)" in output, output
    said_again = finish_ranks(fork_ranks([*common, "--epochs", "2", "--output-dir", resumed, "--resume",
                                          os.path.join(resumed, "checkpoint.pth")], str(tmp_path / "logs_resumed"),
                                         program="lifted_lesson"))[0]
    assert "epochs 1..1" in said_again and "epoch 0 step" not in said_again, said_again
    one, other = (torch.load(os.path.join(out, "checkpoint.pth"), weights_only=True) for out in (straight, resumed))
    assert one["epoch"] == other["epoch"] == 2
    for part in ("model", "optimizer"):
        flat_one, flat_other = (torch.nn.utils.parameters_to_vector([t.float() for t in _tensors(c[part])])
                                for c in (one, other))
        assert torch.equal(flat_one, flat_other), part
    dataset, models = _contract_module("dataset"), _contract_module("models")
    model = models.build_model("tiny_shapes", 3, 16, "none")
    model.load_state_dict(one["model"])
    val_set = dataset.open_dataset("unused", "val")
    printed = float(re.findall(r"epoch 1: train loss .*mIoU (\S+) ", said)[0])
    exact = _miou(model, val_set, 3, range(5))
    assert abs(printed - exact) < 1e-4, (printed, exact)
    assert abs(_miou(model, val_set, 3, [0, 1, 2, 3, 4, 0]) - exact) > 3e-4  # the check tells a repeat apart
    # -e in one plain process, on a data set without the optional save_prediction: the same mIoU.
    capsys.readouterr()
    lifted.main(lifted.get_args_parser().parse_args([*common, "-e", "--resume", os.path.join(straight,
                                                                                        "checkpoint.pth")]))
    said = capsys.readouterr().out
    assert "1 process(es)" in said and float(re.findall(r"mIoU (\S+)", said)[-1]) == printed, said


def _tensors(state):
    """Every tensor of a state dict, nested ones too, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _tensors(item)]
    return []


def test_check_only_tells_how_to_train_longer_as_the_lesson_does():
    """run.sh's check (--check-only) says a finished run's line for the lesson, which imports nothing of it."""
    assert preflight.TRAIN_LONGER == main.TRAIN_LONGER


def test_peak_memory_on_a_cpu_whose_os_does_not_tell_it_is_nan(monkeypatch):
    """Windows has no resource module: without it (main.resource is None then), the CPU's peak memory is NaN."""
    assert main.peak_memory_gib(torch.device("cpu")) > 0
    monkeypatch.setattr(main, "resource", None)
    assert main.peak_memory_gib(torch.device("cpu")) != main.peak_memory_gib(torch.device("cpu"))  # NaN
