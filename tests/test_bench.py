import json
import math

import pytest


def _positive(value, most=math.inf):
    return isinstance(value, (int, float)) and 0 < value < most


@pytest.mark.long
def test_bench_quick_measures_every_figure_and_prints_it_beside_its_target(capsys):
    """bench.py --quick: tiny sizes on a shared machine, so its timings say nothing of the targets; what it must do
    is measure every figure (a number in a sane range, not zero, negative, NaN or infinite) and print each in its
    table beside the target. Its command line (bench.cli) runs in this process: a fresh interpreter is not what
    this proves, and this one has imported torch already."""
    import bench
    import torch
    threads = torch.get_num_threads()
    try:
        bench.cli(["--quick"])
    finally:
        torch.set_num_threads(threads)  # bench gives itself one thread; the tests after this one get theirs back
    output = capsys.readouterr().out
    table = output[output.index("measure "):].splitlines()[1:]
    last = next(number for number, line in enumerate(table) if line.startswith("{"))  # the figures' JSON line
    figures = json.loads(table[last])
    rows = {line[:46].strip(): line[46:].split() for line in table[:last]}
    names = ["DDP scaling efficiency, 2 gloo processes vs 1", "main.py's step vs a bare step",
             "data pipeline vs resize-then-crop", "data: ours vs today's (PIL, float in worker)",
             "data: cached (warm) vs today's", "data: sample time / its decode time",
             "data: bytes a sample, today's / ours", "rank 0's peak memory over the others'",
             "evaluation speed-up, 2 processes vs 1"]
    assert list(rows) == names, output
    for name, (measured, *target, met) in rows.items():
        float(measured.rstrip("%x"))  # a number, as its target is written
        assert target and met in ("yes", "NO", "-"), (name, rows[name])

    rates = figures["img_per_s"]
    assert set(rates) == {"1 process", "2 without communication", "2 with DDP"}, rates
    assert all(_positive(rate) for rate in rates.values()), rates
    # Two processes on at least as many cores: neither far past twice one process's rate, nor stopped. Far: 3 times,
    # not 1.5: the suite's other worker (pytest -n 2) may hold a core while one process is timed and not while two are
    # (seen: 1.73).
    assert _positive(figures["ddp_efficiency"], 3), figures
    assert _positive(rates["2 without communication"] / rates["1 process"] / 2, 3), rates
    assert rows[names[0]][0] == f"{figures['ddp_efficiency']:.3f}"
    assert _positive(figures["bare_step_s"], 60), figures
    assert -0.5 < figures["loop_overhead"] < 5, figures  # main.py's loop is the bare step and a little
    assert rows[names[1]][0] == f"{figures['loop_overhead'] * 100:+.2f}%"

    samples = figures["data_samples_per_s"]
    assert set(samples) >= {"today", "ours", "ours, cached", "resize-then-crop", "decode alone"}, samples
    assert all(_positive(rate) for rate in samples.values()), samples
    sizes = figures["data_sample_bytes"]
    assert all(_positive(size) for size in sizes.values()), sizes
    assert sizes["ours"] < sizes["today"], sizes  # uint8 images, not float32
    assert rows[names[6]][0] == f"{sizes['today'] / sizes['ours']:.2f}x"

    memory = figures["peak_memory_gib"]
    assert len(memory) == 2 and all(_positive(gib, 64) for gib in memory), memory  # one figure for each rank
    assert -1 < figures["rank0_memory_excess"] < 1, figures
    eval_s = figures["eval_time_s"]
    assert set(eval_s) == {"1 process(es)", "2 process(es)"} and all(_positive(s, 300) for s in eval_s.values()), eval_s
    assert rows[names[8]][0] == f"{eval_s['1 process(es)'] / eval_s['2 process(es)']:.2f}x"
