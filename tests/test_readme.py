import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_step_tables_point_at_the_marked_steps():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    with open(os.path.join(ROOT, "main.py")) as f:
        lines = f.read().splitlines()
    rows = [line for line in readme.splitlines() if re.match(r"\| [1-4]\. ", line)]
    assert len(rows) == 8  # the English and the Chinese table
    for row in rows:
        step = row[2]
        for number in re.findall(r"\(main\.py#L(\d+)\)", row):
            assert f"Step {step}" in lines[int(number) - 1], (row, lines[int(number) - 1])


def test_readme_opens_with_the_two_commands_ci_runs():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        head = f.read().split("```")[1]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    test_line = next(line for line in head.splitlines() if "python -m pytest -q tests" in line)
    requirements = re.search(r"pip install -r (\S+)", test_line).group(1)
    assert "./run.sh" in head and requirements == "requirements-test.txt"
    assert f"-r {requirements}" in ci and "OMP_NUM_THREADS=1 python -m pytest -q tests" in ci
    with open(os.path.join(ROOT, requirements)) as f:
        assert f.readline().strip() == "-r requirements.txt"  # the tests' set includes training's
