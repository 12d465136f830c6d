import sys

from conftest import run


def test_bench_runs_and_prints_each_target_beside_its_measure():
    """bench.py --quick: tiny sizes, so its timings mean nothing; what it must do is run every measure."""
    output = run([sys.executable, "bench.py", "--quick"], timeout=300)
    table = output[output.index("measure "):].splitlines()[1:]
    names = ["DDP scaling efficiency", "main.py's step vs a bare step", "data pipeline vs resize-then-crop",
             "data: ours vs today's", "data: cached (warm) vs today's", "data: sample time / its decode time",
             "data: bytes a sample", "rank 0's peak memory", "evaluation speed-up"]
    assert [any(line.startswith(name) for line in table) for name in names] == [True] * len(names), output
    assert all(line.split()[-1] in ("yes", "NO", "-") for line in table if line.strip())
