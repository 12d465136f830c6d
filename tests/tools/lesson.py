"""main.py's lesson: main.py without its harness, every statement that names the harness package (harness/: a
module main.py imports from it, or a name imported from one) taken out. What remains is the DDP tutorial's
program, finished: Steps 1-4, the training step with gradient accumulation, the exact evaluation, saving a
checkpoint and resuming from one with --resume PATH, on torch, models.py and dataset.py (which reads files through
images.py) alone.

    python tests/tools/lesson.py                 # prints it, with a note of what was taken out (on stderr)
    python tests/tools/lesson.py > my_ddp.py     # to read it beside the tutorial, or to start a project from it
    python tests/tools/lesson.py --write         # docs/lesson.py anew, which the README's step table links to

The rule, in full: the harness is what comes from harness/. A statement is taken out when it names such a module
(as main.py imports it) or name; a compound statement (if, for, with, def) when its header does, else what is
inside it is looked at the same way; a decorator that names one is taken out, the function stays. A name bound
only by a statement taken out is such a name too (then a statement of the lesson that uses it would go as well:
tests/test_lesson.py proves none does). A block left empty gets pass, and a paragraph of main.py's docstring that
speaks of the harness goes too.
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS = "harness"  # the package: whatever comes from it is the harness
PRINTED = os.path.join(ROOT, "docs", "lesson.py")  # the lesson, to read and link to (tests/test_readme.py: current)
PRINTED_NOTE = ("# The lesson: main.py without its harness (`python tests/tools/lesson.py` prints it). Copy it to "
                "start.\n")


def _from_harness(module):
    return module is not None and (module == HARNESS or module.startswith(HARNESS + "."))


def _names(node):
    """The names an expression or simple statement uses (`a.b.c` uses a)."""
    return {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}


def _header(statement):
    """What a compound statement says before its blocks: an if's test, a for's target and iterable, a with's items,
    an except's type. (A def's and a class's decorators are looked at one by one, apart.)"""
    parts = {ast.If: ("test",), ast.While: ("test",), ast.For: ("target", "iter"), ast.With: ("items",),
             ast.ExceptHandler: ("type",)}.get(type(statement), ())
    names = set()
    for field in parts:
        value = getattr(statement, field)
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                names |= _names(item)
    return names


def _imports(statement):
    """The harness's names an import statement brings in (from harness import stops; import harness.job)."""
    if isinstance(statement, ast.Import):
        return {(alias.asname or alias.name).split(".")[0] for alias in statement.names if _from_harness(alias.name)}
    if isinstance(statement, ast.ImportFrom) and _from_harness(statement.module):
        return {alias.asname or alias.name for alias in statement.names}
    return set()


def _blocks(statement):
    return [getattr(statement, field) for field in ("body", "orelse", "finalbody", "handlers")
            if getattr(statement, field, None)]


def _bound(statement):
    """Plain names a simple statement binds (an assignment's targets that are names, not attributes)."""
    targets = getattr(statement, "targets", None) or [getattr(statement, "target", None)]
    return {child.id for target in targets if target is not None for child in ast.walk(target)
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store)}


def harness_statements(source):
    """-> (the harness's statements and decorators as [(first line, last line, indirect)], names taken out).
    indirect: taken out only because it uses a name a harness statement bound, not a module's."""
    tree = ast.parse(source)
    harness = set()
    for node in tree.body:  # the harness's modules as main.py imports them, and the names it imports from them
        harness |= _imports(node)
    direct = set(harness)
    while True:
        taken, kept_bindings = [], set()

        def visit(statements):
            for statement in statements:
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    for decorator in statement.decorator_list:
                        if _names(decorator) & harness:
                            taken.append((decorator.lineno, decorator.end_lineno, not _names(decorator) & direct))
                    visit(statement.body)
                elif _blocks(statement):
                    used = _header(statement)
                    if used & harness:
                        taken.append((statement.lineno, statement.end_lineno, not used & direct))
                        continue
                    for block in _blocks(statement):
                        visit(block)
                else:
                    used = _names(statement) | _imports(statement)
                    if used & harness:
                        taken.append((statement.lineno, statement.end_lineno, not used & direct))
                    else:
                        kept_bindings.update(_bound(statement))
        visit(tree.body)
        bound_by_harness = set()
        for first, last, _ in taken:
            for node in ast.walk(tree):
                if isinstance(node, ast.stmt) and getattr(node, "lineno", 0) == first and not _blocks(node):
                    bound_by_harness |= _bound(node)
        grown = harness | (bound_by_harness - kept_bindings)
        if grown == harness:
            return taken, harness
        harness = grown


def strip(source):
    """main.py's source without its harness, comments and all, each emptied block given a pass. -> (lesson, the
    statements taken out)."""
    taken, _ = harness_statements(source)
    gone = set()
    for first, last, _ in taken:
        gone.update(range(first, last + 1))
    passes = {}  # line -> indent: the first line of a block whose every statement goes
    for node in ast.walk(ast.parse(source)):
        for block in _blocks(node) if isinstance(node, ast.stmt) and node.lineno not in gone else []:
            if all(statement.lineno in gone for statement in block):
                passes[block[0].lineno] = block[0].col_offset
    docstring = ast.parse(source).body[0]  # its paragraphs that speak of the harness go too
    paragraphs = [part for part in docstring.value.value.split("\n\n") if "harness" not in part]
    lines = ['"""' + "\n\n".join(paragraphs).rstrip("\n") + '\n"""\n']
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        if number in passes:
            lines.append(" " * passes[number] + "pass\n")
        if number not in gone and number > docstring.end_lineno:
            lines.append(line)
    return "".join(lines), taken


def main():
    with open(os.path.join(ROOT, "main.py")) as f:
        lesson, taken = strip(f.read())
    if sys.argv[1:] == ["--write"]:
        with open(PRINTED, "w") as f:
            f.write(PRINTED_NOTE + lesson)
    else:
        sys.stdout.write(lesson)
    print(f"# tests/tools/lesson.py: {len(taken)} statements of main.py's harness taken out (lines "
          f"{', '.join(str(first) if first == last else f'{first}-{last}' for first, last, _ in taken)})",
          file=sys.stderr)


if __name__ == "__main__":
    main()
