import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_step_tables_point_at_the_marked_steps_in_main_py_and_the_printed_lesson():
    """Each row of both step tables links to its step's marks in main.py and in docs/lesson.py, which is the lesson
    tests/tools/lesson.py prints now (python tests/tools/lesson.py --write makes it anew)."""
    import lesson
    with open(os.path.join(ROOT, "main.py")) as f:
        source = f.read()
    with open(lesson.PRINTED) as f:
        assert f.read() == lesson.PRINTED_NOTE + lesson.strip(source)[0], "run: python tests/tools/lesson.py --write"
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    rows = [line for line in readme.splitlines() if re.match(r"\| [1-4]\. ", line)]
    assert len(rows) == 8  # the English and the Chinese table
    for path in ("main.py", "docs/lesson.py"):
        with open(os.path.join(ROOT, path)) as f:
            lines = f.read().splitlines()
        for row in rows:
            step = row[2]
            numbers = re.findall(rf"\({re.escape(path)}#L(\d+)\)", row)
            assert numbers, (path, row)
            for number in numbers:
                assert f"Step {step}" in lines[int(number) - 1], (row, lines[int(number) - 1])


def test_readme_opens_with_the_two_commands_ci_runs():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        head = f.read().split("```")[1]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    test_line = next(line for line in head.splitlines() if "python -m pytest" in line)
    requirements = re.search(r"pip install -r (\S+)", test_line).group(1)
    command = re.search(r"&& (OMP_NUM_THREADS=1 python -m pytest .*?tests) ", test_line).group(1)
    assert "./run.sh" in head and requirements == "requirements-test.txt"
    assert f"-r {requirements}" in ci and f"env {command}\n" in ci, command  # the README's, as CI runs it
    with open(os.path.join(ROOT, requirements)) as f:
        assert f.readline().strip() == "-r requirements.txt"  # the tests' set includes training's


def test_every_local_link_leads_to_a_file():
    readme = os.path.join(ROOT, "README.md")
    docs = os.path.join(ROOT, "docs")
    pages = [readme] + [os.path.join(docs, name) for name in sorted(os.listdir(docs)) if name.endswith(".md")]
    assert len(pages) > 1
    broken = []
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):  # [text](target): markdown links
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path))
            if not os.path.isfile(resolved):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such file)")
            elif re.fullmatch(r"L\d+", anchor):
                with open(resolved, encoding="utf-8") as f:
                    count = sum(1 for _ in f)
                if not 1 <= int(anchor[1:]) <= count:
                    broken.append(f"{os.path.relpath(page, ROOT)}: {target} (the file has {count} lines)")
    assert not broken, broken


def _functions(path):
    import ast
    with open(os.path.join(ROOT, path)) as f:
        source = f.read()
    tree = ast.parse(source)
    return source, {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def _depth(node, level=0):
    """The deepest nesting of blocks below node (its own body is level 0; an elif counts as its if)."""
    import ast
    deepest = level
    for field in ("body", "orelse", "finalbody", "handlers"):
        for child in getattr(node, field, []):
            elif_ = field == "orelse" and isinstance(node, ast.If) and isinstance(child, ast.If) and len(node.orelse) == 1
            inner = level if elif_ else level + 1
            if isinstance(child, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.ExceptHandler)):
                deepest = max(deepest, _depth(child, inner))
    return deepest


def _project_imports():
    """{module: the project's modules it imports anywhere in its file}, the harness's as harness.NAME (a relative
    import resolved), the top level's by their names."""
    import ast
    import glob
    files = {os.path.splitext(os.path.relpath(path, ROOT))[0].replace(os.sep, "."): path
             for path in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "harness", "*.py"))}
    files["harness"] = files.pop("harness.__init__")
    imports = {}
    for module, path in files.items():
        package = "harness" if module.startswith("harness") else ""
        with open(path) as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package if node.level else node.module
                base = f"{base}.{node.module}" if node.level and node.module else base
                found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        imports[module] = found & set(files)
    return imports


def test_no_module_of_the_project_imports_another_in_a_circle():
    imports = _project_imports()
    assert {"main", "harness.stops", "harness.cache"} <= set(imports) and "harness.stops" in imports["main"]

    def reaches(start, goal, seen=()):
        return any(other == goal or (other not in seen and reaches(other, goal, (*seen, other)))
                   for other in imports[start])
    assert not [module for module in imports if reaches(module, module)]


def test_the_lesson_s_modules_import_nothing_of_the_harness():
    """main.py imports harness/ in one statement; models.py, dataset.py and images.py never, not even inside a
    function."""
    imports = _project_imports()
    for module in ("models", "dataset", "images"):
        assert not {name for name in imports[module] if name.startswith("harness")}, (module, imports[module])
    import ast
    with open(os.path.join(ROOT, "main.py")) as f:
        tree = ast.parse(f.read())
    statements = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and "harness" in
                  {alias.name.split(".")[0] for alias in node.names} | {(getattr(node, "module", "") or "").split(".")[0]}]
    assert len(statements) == 1, [ast.unparse(node) for node in statements]


def test_the_lesson_keeps_its_shape():
    """main.py reads as the tutorial: Steps 1-4 in order, each marked, DistributedSampler in Step 4, nothing of the
    preflight between the steps, main() shallow. (Sizes are aims for a review, not tests: a cap made fixes pack
    statements into one line.)"""
    source, functions = _functions("main.py")
    lines = source.splitlines()
    main = functions.pop("main")
    assert max(_depth(child, 0) for child in main.body) <= 4
    marks = [(number, line.strip()) for number, line in enumerate(lines, 1) if re.match(r"\s*# Step \d", line)]
    steps = [mark[len("# Step ")] for _, mark in marks]
    assert steps == sorted(steps) and set(steps) == {"1", "2", "3", "4"}, marks  # in order, each marked
    set_device = next(n for n, line in enumerate(lines, 1) if "torch.cuda.set_device(local_rank)" in line)
    loader = next(n for n, line in enumerate(lines, 1) if "train_loader = DataLoader(" in line)
    assert not any("check_only" in line for line in lines[set_device:loader])
    step4 = next(n for n, mark in marks if mark.startswith("# Step 4:"))
    assert step4 < next(n for n, line in enumerate(lines, 1) if "DistributedSampler(" in line) < loader
