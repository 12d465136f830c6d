"""Stopping together. A signal or a loss gone NaN or infinite on any rank stops every rank at the same step: a
signal saves where the ranks are first and ends the run with exit status 0; a NaN saves nothing (the last
checkpoint is the last good one) and ends it with 1. A second signal, a second or more after the first, stops at
once. The signals that stop a training run so: SIGTERM (a scheduler's preemption, `timeout`, torchrun or run.sh
passing a stop on), SIGINT (Ctrl-C), SIGHUP (the terminal closed), SIGUSR1 and SIGUSR2 (what a scheduler may be
told to send before a job's time is up, Slurm's --signal=USR1@120). A write to a closed terminal, or a full disk
under the log, costs the line, not the run.

    stops.install()                     # recovery.guard, as main.py starts: a training run's signals (PHASES)
    stops.enter("training")             # after init_process_group (the preflight enters the phases before it)
    stops.shield_workers(loader, ...)   # DataLoader workers leave a stop to the process that reads them
    if stops.ranks_vote_to_stop(loss): break   # a collective each optimizer step: its vote cast, the step before's read
    stops.save_if_stopped(epoch, step, steps_per_epoch, save)   # after an epoch's steps: save there and end
    stops.ranks_vote_after_epoch(last)  # a collective after an epoch's files: a signal during its evaluation

A name that begins with ranks_ is a collective (here and in the whole harness): every rank calls it, at the same
point. This module's state is job.RUN.stops.
"""
import errno
import functools
import multiprocessing.queues
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager, suppress

import torch
import torch.distributed as dist
from torch._utils import ExceptionWrapper  # (what a DataLoader worker sends in a batch's place when it fails)

from . import job, paths
from .errors import Finished, fail
from .job import RUN, log

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class Interrupted(BaseException):
    """A stop that came before training began: nothing to save, so the run ends at once (recovery.guard says so).
    Raised from the signal handler, wherever the run is: a BaseException, as KeyboardInterrupt is, so that no
    `except Exception` on its way (a reader that calls a file it cannot read damaged, a download's error) takes the
    stop for a failure of its own."""


# --- signals ----------------------------------------------------------------------------------------------------
def _on_signal(signum, frame):
    if RUN.stops.signal is None:
        RUN.stops.signal, RUN.stops.signal_time = signum, time.time()
        if RUN.stops.phase == "preflight":
            raise Interrupted(signum)
    elif time.time() - RUN.stops.signal_time > 1.0:  # a second signal (not a copy of the first, which a
        signal.signal(signum, signal.SIG_DFL)     # scheduler and a launcher may both send): stop now
        os.kill(os.getpid(), signum)


# A training run's phases, in order, and the stop signals' handler in each: enter() alone switches them. (In other
# runs, -e, --check-only, predict.py and the tools, a stop ends the program at once: install.)
PHASES = {
    "preflight": _on_signal,  # nothing is trained, nothing waits for this process: the run ends at once (Interrupted)
    "writing": _on_signal,    # writes that must not stop half-way (deferred()): the run ends after them
    # init_process_group: it waits for the ranks inside torch's C++, which retries a call a signal interrupts and so
    # never lets a Python handler run (a stop would wait out --dist-timeout). So each signal does what it did before
    # this run (one ignored stays so, as run.sh has torchrun ignore SIGUSR1), or its default: the process ends at once.
    "meeting": None,
    "training": _on_signal,   # noted, and acted on where every rank stops together (ranks_vote_to_stop, ...)
}


def install(training=True):
    """A run starts with no signal seen. A training run's stop signals (STOP_SIGNALS) take the handler of PHASES'
    first phase, and its sys.stdout and sys.stderr are wrapped (_Terminal). In other runs of one process a stop ends
    the program at once: Ctrl-C or SIGTERM, as a KeyboardInterrupt (_stop_now)."""
    RUN.stops = job.Stops()
    if training:
        RUN.stops.handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}  # (restore's)
        RUN.stops.phase = "preflight"  # (a training run's: enter() switches no other)
        enter("preflight")
        if sys.stdout is not None:  # (None: this process was started with its output closed)
            sys.stdout = _Terminal(sys.stdout)
        if sys.stderr is not None:
            sys.stderr = _Terminal(sys.stderr)
    elif int(os.environ.get("WORLD_SIZE", "1")) == 1:  # -e, --check-only, predict.py, the tools, in one process
        # (Several: torchrun's SIGTERM after another rank failed must end this one at once, in a collective too,
        # where no Python handler runs. Its default does.)
        RUN.stops.handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
        for signum, handler in RUN.stops.handlers.items():
            if handler in (signal.SIG_DFL, signal.default_int_handler):  # (one ignored stays so)
                signal.signal(signum, _stop_now)


def _stop_now(signum, frame):
    """Ctrl-C or SIGTERM where a stop ends the program at once: a KeyboardInterrupt, so that what it was
    writing goes (paths.write_folder, a temporary file) and recovery.guard says so in one line. Once: a second stop
    (a launcher's, a script's) must not break into that cleanup."""
    for stop in RUN.stops.handlers:  # (SIGINT and SIGTERM: install)
        signal.signal(stop, signal.SIG_IGN)
    RUN.stops.signal = signum
    raise KeyboardInterrupt


def enter(phase):
    """The one switch between PHASES, in a training run (in another, nothing). Back in "preflight" from "writing",
    a stop that came meanwhile ends the run."""
    if RUN.stops.phase is None:
        return
    RUN.stops.phase = phase
    for signum, before in RUN.stops.handlers.items():
        signal.signal(signum, PHASES[phase] or (signal.SIG_IGN if before == signal.SIG_IGN else signal.SIG_DFL))
    if phase == "preflight" and RUN.stops.signal is not None:
        raise Interrupted(RUN.stops.signal)


@contextmanager
def deferred():
    """Around writes that must not stop half-way (the preflight moving an old run aside): PHASES' "writing"."""
    enter("writing")
    try:
        yield
    except BaseException:
        with suppress(Interrupted):  # the block's own error is the one to say, not a stop that came
            enter("preflight")
        raise
    enter("preflight")


def restore():
    """The signals back to what they did before this run (a second run in one process: the tests')."""
    for signum, handler in (RUN.stops.handlers or {}).items():
        signal.signal(signum, handler)
    RUN.stops.handlers = None
    for name in ("stdout", "stderr"):
        if isinstance(getattr(sys, name), _Terminal):
            setattr(sys, name, getattr(sys, name).stream)


class _Terminal:
    """sys.stdout or sys.stderr while a training run prints. A write that a closed terminal refuses (EIO; a closed
    pipe: EPIPE) sends what it prints nowhere from then on; one a full disk refuses (a log file) loses that line.
    Either would otherwise raise mid-step and end the run unsaved: after the terminal closes (SIGHUP), a line may
    be printed before the stop is read, and torchrun would then restart the workers into the closed terminal."""

    def __init__(self, stream):
        self.stream = stream

    def _guarded(self, method, *args):
        try:
            return method(*args)
        except OSError as error:
            if error.errno in (errno.EIO, errno.EPIPE):  # from now on, nowhere
                nowhere = os.open(os.devnull, os.O_WRONLY)
                os.dup2(nowhere, self.stream.fileno())
                os.close(nowhere)
            elif error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise

    def write(self, text):
        self._guarded(self.stream.write, text)
        return len(text)

    def flush(self):
        self._guarded(self.stream.flush)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def stop_signal():
    """The signal that asked this process to stop, or None. run.sh also writes the first signal's name into the
    file DEEPLAB_STOP_FILE names: a worker that was still starting then (the signal killed it before it had
    handlers, and torchrun started it again) or not yet started learns it there."""
    stop_file = job.env().stop_file
    if RUN.stops.signal is None and stop_file and os.path.exists(stop_file):
        try:
            with open(stop_file) as f:
                name = f.read().strip()
        except OSError:
            name = "TERM"  # gone again (run.sh ended) or unreadable: it was there, a stop was asked for
        RUN.stops.signal = int(getattr(signal, f"SIG{name}", signal.SIGTERM))
        RUN.stops.signal_time = time.time()
    return RUN.stops.signal


def quiet_pool_worker():
    """A multiprocessing.Pool's worker (synthetic.py's, cache.py's) leaves a stop to its parent: in a process group of
    its own, a Ctrl-C or a stop to the program's group does not reach it. (A worker killed while it waits for a task
    or hands a result over holds one of the pool's queue locks for good, and the parent's Pool.terminate then waits
    forever.) It ends at once on the
    SIGTERM with which its parent ends the pool (not stops.install's KeyboardInterrupt, a forked copy of its
    parent's)."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# --- DataLoader workers -------------------------------------------------------------------------------------------
def shield_workers(*loaders):
    """A stop sent to every process of the job (Ctrl-C at a terminal, `timeout`, `kill -- -PGID`, Slurm's --signal,
    which signals every process of a job step) reaches the DataLoader's workers too, any of STOP_SIGNALS (SIGUSR1's
    default would kill a worker outright). torch's own handler ends a
    worker on SIGTERM from anyone but its parent by the signal's default, and the training process then raises
    "DataLoader worker ... exited unexpectedly" (or "... is killed by signal") mid-step instead of saving. So each
    worker leaves such a stop to the process that reads it; its parent's SIGTERM still ends it, as in torch (the
    DataLoader's shutdown, Python's exit)."""
    for loader in filter(None, loaders):  # (-e has no training loader)
        loader.worker_init_fn = functools.partial(_worker_init, os.getpid())


def _worker_init(parent, worker_id):
    paths.forget_hold()  # a forked worker's copy of --output-dir's lock would hold it after its parent was killed
    multiprocessing.queues.Queue._on_queue_feeder_error = _batch_not_handed_over  # (a method: its queue comes first)
    # Blocked in this thread before the next starts: every thread of the worker then blocks them, and the signals
    # wait for sigwaitinfo, which tells who sent each.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    threading.Thread(target=_end_on_parents_sigterm, args=(parent,), daemon=True, name="stops").start()


def _batch_not_handed_over(queue, error, batch):
    """multiprocessing's hook, in a DataLoader worker, for a batch its queue's feeder thread could not send. A batch
    not yet in shared memory (predict.py's: batch_size=None, no collate) has its tensors moved there by that thread,
    and with /dev/shm full that raises there (torch's "unable to allocate shared memory"); multiprocessing's own hook
    prints a traceback and drops the batch, and the parent waited for it forever (seen: predict.py with a 1 MB
    /dev/shm). The error goes in the batch's place instead, as torch sends an error of the worker's own thread, and
    the parent raises it (as a RuntimeError, whatever its type) for recovery.data_worker_lost to name."""
    failed = ExceptionWrapper((RuntimeError, error, error.__traceback__),
                              where=f"in DataLoader worker (pid {os.getpid()}), handing over a batch")
    with suppress(ValueError):  # (the queue closed: the worker is ending, and no one waits for the batch)
        queue.put((batch[0], failed))


def _end_on_parents_sigterm(parent):
    """The only stop a worker acts on: its parent's SIGTERM. The others wait here, blocked, for nothing."""
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)  # as torch's handler does for its parent's SIGTERM: exit 0, which the parent expects


# --- agreeing to stop -----------------------------------------------------------------------------------------------
class StopVote:
    """Whether every rank should stop training, agreed after each step without stalling the GPU's queue.

    Each step casts a vote (a signal reached this rank; its loss is NaN or infinite) in a small all_reduce (MAX)
    queued behind the step, and reads the vote of the step before, which is long done by then. Reading a vote
    at once would make the CPU wait for its whole step to finish before queueing the next: the GPU would idle
    while the next batch is copied and its kernels launched. So every rank stops at the same step, one step
    after the cause: a signal stops them within two steps, with a checkpoint (the step the stop is read at is
    voted on as well, once, so that a NaN there is not saved either); a NaN step is never saved. On
    the CPU (gloo) the all_reduce is done when it returns, and the delay changes nothing."""

    def __init__(self, device):
        self.device, self.pending = device, None

    def cast(self, loss):
        """This step's vote. -> the previous step's decision: None, "signal" or "nonfinite"."""
        votes = torch.stack([(~torch.isfinite(loss.detach())).float(),
                             torch.full((), float(stop_signal() is not None), device=self.device)])
        if dist.is_initialized():
            dist.all_reduce(votes, op=dist.ReduceOp.MAX)  # NCCL: queued on its stream, the CPU goes on
        votes = votes.to("cpu", non_blocking=True)  # from the GPU: into pinned memory, when the step is done
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        decision, self.pending = self.result(), (votes, done)  # the step before's, then this one's pending
        if decision == "signal" and self.result() == "nonfinite":  # this step's too: its weights are not saved
            decision = "nonfinite"
        return decision

    def result(self):
        """The last step's decision (cast's too), once the epoch's steps are queued."""
        if self.pending is None:
            return None
        (votes, done), self.pending = self.pending, None
        if done is not None:
            done.synchronize()  # the step before this one: done, or nearly
        nonfinite, signal_seen = votes.tolist()
        return "nonfinite" if nonfinite else "signal" if signal_seen else None


def ranks_vote_to_stop(loss):
    """A collective, each optimizer step, on every rank: this step's vote cast (an all_reduce), the one before read.
    -> whether every rank stops now (they all read the same decision)."""
    if RUN.stops.vote is None:
        RUN.stops.vote = StopVote(loss.device)
    RUN.stops.steps += 1
    decision = RUN.stops.vote.cast(loss)
    RUN.stops.decision = RUN.stops.decision or decision
    return decision is not None


def pending_write_failure():
    """The line of a file rank 0 could not write, while the ranks have not yet stopped on it; or None."""
    return RUN.stops.problem


def write_failed(message):
    """Rank 0 could not write a file of the run (a full disk): said when every rank stops together (the first such
    line), at the next vote (save_if_stopped, ranks_vote_after_epoch), not by rank 0 alone while the others wait for
    it."""
    RUN.stops.problem = RUN.stops.problem or message


def save_if_stopped(epoch, step, steps_per_epoch, save):
    """After an epoch's steps, every rank at the same step (the next to run: step). A NaN or infinite loss, here or
    in the last steps' votes: nothing saved, exit 1 (a restart would meet it again). A signal part-way through
    the epoch: rank 0 calls save(step), every rank ends the run (exit 0). A signal at the epoch's last step: the
    epoch is evaluated and saved first (ranks_vote_after_epoch)."""
    vote, decision = RUN.stops.vote, RUN.stops.decision
    RUN.stops.vote = RUN.stops.decision = None
    decision = decision or (vote and vote.result())  # else the last step's vote
    if decision == "nonfinite":
        checkpoint = job.checkpoint_path()
        fail(f"the loss became NaN or infinite in epoch {epoch}: stopped without saving; "
             f"{checkpoint if os.path.isfile(checkpoint) else 'no checkpoint'} is the last good one. "
             "Try a lower --lr, or --amp bf16 instead of fp16")
    if decision == "signal" and step < steps_per_epoch:
        if job.is_main_process():
            save(step)
            if RUN.stops.problem:  # no collective follows: rank 0 says it and ends; the others end as stopped
                fail(RUN.stops.problem, this_rank=True)
        _stopped(f"{stop_signal() or 'on another rank'} at epoch {epoch} step {step}/{steps_per_epoch}")


def ranks_vote_after_epoch(last=False):
    """A collective after an epoch's files, on every rank: each learns whether rank 0 could not write them (a full
    disk: all stop with its line, exit 1) and whether a signal reached any rank during the evaluation (or at the
    epoch's last step: all end the run, exit 0, the epoch saved). last: the epoch was the last one, so there is
    nothing left to stop."""
    flags = torch.tensor([float(stop_signal() is not None), float(RUN.stops.problem is not None)])
    if dist.is_initialized():
        if dist.get_backend() == "nccl":  # NCCL reduces GPU tensors only
            flags = flags.cuda()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    signal_seen, write_failed_somewhere = flags.tolist()
    if write_failed_somewhere:
        fail(RUN.stops.problem or "rank 0 could not write this epoch's files")  # rank 0 has the line and says it
    if signal_seen and last:
        log("a stop was asked for at the end of the last epoch: training had finished, nothing is left to stop")
    elif signal_seen:
        _stopped("after an epoch")


def _stopped(where):
    """Every rank ends the run, its checkpoint saved: exit 0."""
    log(f"stopped by signal {where}; saved {job.checkpoint_path()}. To resume, {job.resume_advice()}")
    raise Finished
