"""The harness: what a real run needs beside main.py's lesson, attached through whole statements of main.py (each
marked `harness`) that a learner can delete. main.py imports it in one statement; the lesson's own modules
(models.py, dataset.py, images.py) import nothing from here.

    preflight    everything a user can get wrong, found before any work; the output folder held
    checks       the flags' ranges and what several flags say together, after parsing
    checkpoints  which checkpoint a run starts from; every reader's CRC-32 check; --weights; saving on a stop
    stops        stopping together: signals, the ranks' vote each step, DataLoader workers that leave a stop
                 to their parent
    recovery     how a run ends: one-line errors, out of memory, a lost peer named; waits that say what they wait for
    rendezvous   run.sh's wait for the other nodes, in a process of its own (torch.distributed alone)
    records      what rank 0 writes beside the checkpoint: metrics, best.pth, pictures, eval.json, TensorBoard
    inference    multi-scale, flip and sliding-window evaluation (main.py -e, predict.py)
    paths        every path a program writes, checked in one place; one run per output folder
    job          this process's place in the job, read once from the launcher's environment; and RUN, a run's state
    errors       the error types
    cache        `python harness/cache.py`: fill dataset.py's decode cache before training

A run's state lives in one object, job.RUN (harness/job.py): a field per concern (the environment, the command, the
stop signals and the ranks' vote, the held --output-dir, the checkpoint the run starts from, TensorBoard's writer,
...), each written by one module alone. Every other module-level name is a constant, but cache.py's _preparing:
the data set being cached, set in the parent once per split and in each Pool worker as it starts.

Names say when a function writes or waits for the other ranks: one whose name begins with ranks_ is a collective
(every rank calls it, at the same point); write, make, move, hold, rewrite or save in a name: it writes files; a
name that says check and nothing more only reads.
"""
