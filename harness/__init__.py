"""The harness: what a real run needs beside main.py's lesson, attached through whole statements of main.py (each
marked `harness`) that a learner can delete. main.py imports it in one statement; the lesson's own modules
(models.py, dataset.py, images.py) import nothing from here.

    preflight    everything a user can get wrong, found before any work; the output folder held
    checks       the flags' ranges and what several flags say together, after parsing
    checkpoints  which checkpoint a run starts from; every reader's CRC-32 check; --weights; saving on a stop
    stops        stopping together: signals, the ranks' vote each step, DataLoader workers that leave a stop
                 to their parent
    recovery     how a run ends: one-line errors, out of memory, a lost peer named; waits that say what they wait for
    records      what rank 0 writes beside the checkpoint: metrics, best.pth, pictures, eval.json, TensorBoard
    inference    multi-scale, flip and sliding-window evaluation (main.py -e, predict.py)
    paths        every path a program writes, checked in one place; one run per output folder
    job          this process's place in the job, read once from the launcher's environment
    errors       the error types
    cache        `python -m harness.cache`: fill dataset.py's decode cache before training
"""
