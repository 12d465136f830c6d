"""The promise table on the harness's front page (harness/README.md) is true: every owner it names exists, every
test it names exists, and every module of the harness owns a promise."""
import ast
import importlib
import os
import re

import harness
from conftest import ROOT


def _page():
    with open(os.path.join(ROOT, "harness", "README.md")) as f:
        return f.read()


def _table():
    """-> [(promise, owner, [(file, test)])], read from harness/README.md."""
    rows = re.findall(r"^- (.+?)\n  owner: (\S+)\n  tests: ((?:.+\n)(?:         .+\n)*)", _page(), re.M)
    return [(promise, owner, [tuple(line.strip().split("::")) for line in tests.splitlines()])
            for promise, owner, tests in rows]


def test_the_promise_table_names_owners_and_tests_that_exist_and_every_module_owns_a_row():
    table = _table()
    assert len(table) == _page().count("\n  owner: ") > 10  # every row read
    owners = set()
    for promise, owner, tests in table:
        module, _, name = owner.rpartition(".")
        place = importlib.import_module(f"harness.{module}") if module else harness
        assert callable(getattr(place, name, None)), f"{promise}: its owner {owner} is not in the harness"
        owners.add(module)
        for file, test in tests:
            with open(os.path.join(ROOT, "tests", file)) as f:
                defined = {node.name for node in ast.walk(ast.parse(f.read())) if isinstance(node, ast.FunctionDef)}
            assert test in defined, f"{promise}: {file}::{test} is not a test"
    modules = {name[:-3] for name in os.listdir(os.path.join(ROOT, "harness")) if name.endswith(".py")}
    assert modules - {"__init__"} <= owners, f"no promise owned by {sorted(modules - {'__init__'} - owners)}"
