"""Imported first by every Python the tests start (conftest puts this folder on PYTHONPATH): at exit, the
interpreter's last garbage collections leave out what exists then (gc.freeze), as main.py and predict.py do for
themselves (harness/recovery.py). Without this file, the others the tests start would pay them: torchrun's agents,
run.sh's GPU count and rendezvous watcher, harness/cache.py, tests/tools/gpu_check.py (about 0.3 s of CPU an agent:
BENCHMARKS.md). A sitecustomize this
one hides (a Linux distribution's) runs after it."""
import atexit
import gc
import importlib.util
import os
import sys

atexit.register(gc.freeze)

_here = os.path.dirname(os.path.abspath(__file__))
for _folder in sys.path:
    _hidden = os.path.join(_folder or os.curdir, "sitecustomize.py")
    if os.path.abspath(_folder or os.curdir) != _here and os.path.isfile(_hidden):
        _spec = importlib.util.spec_from_file_location("_hidden_sitecustomize", _hidden)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
