"""main.py's lesson lifts whole: with its harness taken out (tests/lesson.py), it runs on torch, models.py and
dataset.py alone, in a folder that holds nothing else of the project."""
import ast
import builtins
import os
import shutil
import symtable
import sys

import torch

import lesson
from conftest import ROOT, TRAIN_ARGS, run


def test_without_its_harness_main_py_trains_evaluates_and_saves_on_two_processes_and_resumes(tiny_data, tmp_path):
    """The lesson lifted into a folder of its own and run there by fresh interpreters, which find nothing else of the
    project. Its training runs under torchrun on two processes, the launch the tutorial teaches being the point; the
    resume runs as one plain process (python main.py: one interpreter to start, not torchrun's and two workers'),
    which the lesson allows too: it proves the lesson reads its checkpoint and goes on at the next epoch."""
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
    folder = tmp_path / "lesson"
    folder.mkdir()
    (folder / "main.py").write_text(stripped)
    for name in ("models.py", "dataset.py", "images.py"):  # the tutorial's two imports, and dataset's own reader
        shutil.copy(os.path.join(ROOT, name), folder / name)
    out = str(tmp_path / "out")
    lesson_args = ["main.py", "--data", tiny_data, "--output-dir", out, *TRAIN_ARGS]
    said = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *lesson_args,
                "--epochs", "1"], cwd=str(folder))
    assert "2 process(es), backend gloo" in said and "epoch 0: train loss" in said and "mIoU" in said, said
    assert torch.load(os.path.join(out, "checkpoint.pth"), weights_only=True)["epoch"] == 1
    said = run([sys.executable, *lesson_args, "--epochs", "2", "--resume", os.path.join(out, "checkpoint.pth")],
               cwd=str(folder))
    assert "1 process(es), backend none" in said, said
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
                    and not hasattr(builtins, name):
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
