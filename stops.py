"""Stopping together. A signal (a scheduler's preemption, Ctrl-C, torchrun or run.sh passing one on) or a loss gone
NaN or infinite on any rank stops every rank at the same step: a signal saves where the ranks are first and ends
the run with exit status 0; a NaN saves nothing (the last checkpoint is the last good one) and ends it with 1. A
second signal, a second or more after the first, stops at once.

    stops.install()                     # recovery.guard, as main.py starts: SIGTERM and SIGINT finish the step
    stops.shield_workers(loader, ...)   # DataLoader workers leave a stop to the process that reads them
    if stops.requested(loss): break     # each optimizer step votes, and reads the vote of the step before
    stops.save_if_stopped(epoch, step, steps_per_epoch, save)   # after an epoch's steps: save there and end
    stops.stop_after_epoch(last)                    # after an epoch's files: a signal during its evaluation
"""
import functools
import os
import signal
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist

import job
import paths
from errors import Finished, fail
from job import log

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_state = SimpleNamespace(signal=None, signal_time=0.0, handlers=None, vote=None, decision=None, steps=0,
                         deferring=False, begun=False)


class Interrupted(Exception):
    """A stop that came before training began: nothing to save, so the run ends at once (recovery.guard says so)."""


# --- signals ----------------------------------------------------------------------------------------------------
def install(training=True):
    """A run starts with no signal seen. A training run's SIGTERM (a scheduler's preemption, torchrun passing one on)
    and SIGINT (Ctrl-C): before the preflight has ended (begin()) and, with a process group, before the ranks have
    met, nothing is trained and nothing waits for this process, and the run ends at once (Interrupted); after, the
    signal is noted and acted on where every rank can stop together (requested, stop_after_epoch), instead of
    killing the process mid-step. Other runs (-e, the preflight) keep Python's own handlers: a stop ends them."""
    _state.signal, _state.vote, _state.decision, _state.steps = None, None, None, 0
    _state.deferring = _state.begun = False
    if training:
        _state.handlers = {signum: signal.signal(signum, _on_signal) for signum in STOP_SIGNALS}


@contextmanager
def deferred():
    """Around writes that must not stop half-way (the preflight moving an old run aside): a signal that comes
    meanwhile ends the run after them."""
    _state.deferring = True
    try:
        yield
    finally:
        _state.deferring = False
    if _state.handlers is not None and _state.signal is not None and _before_training():
        raise Interrupted(_state.signal)


def begin():
    """The preflight has ended: from the process group on (or now, in one plain process) a stop saves first."""
    _state.begun = True


def _before_training():
    return not _state.begun or (job.env().distributed and not dist.is_initialized())


def restore():
    """The signals back to what they did before this run (a second run in one process: the tests')."""
    if _state.handlers is not None:
        for signum, handler in _state.handlers.items():
            signal.signal(signum, handler)
        _state.handlers = None


def _on_signal(signum, frame):
    if _state.signal is None:
        _state.signal, _state.signal_time = signum, time.time()
        if _before_training() and not _state.deferring:
            raise Interrupted(signum)
    elif time.time() - _state.signal_time > 1.0:  # a second signal (not a copy of the first, which a
        signal.signal(signum, signal.SIG_DFL)     # scheduler and a launcher may both send): stop now
        os.kill(os.getpid(), signum)


def stop_signal():
    """The signal that asked this process to stop, or None. run.sh also writes the first signal's name into the
    file DEEPLAB_STOP_FILE names: a worker that was still starting then (the signal killed it before it had
    handlers, and torchrun started it again) or not yet started learns it there."""
    stop_file = job.env().stop_file
    if _state.signal is None and stop_file and os.path.exists(stop_file):
        try:
            with open(stop_file) as f:
                name = f.read().strip()
        except OSError:
            name = "TERM"  # gone again (run.sh ended) or unreadable: it was there, a stop was asked for
        _state.signal = int(getattr(signal, f"SIG{name}", signal.SIGTERM))
        _state.signal_time = time.time()
    return _state.signal


def steps_done():
    """Optimizer steps this process has voted on: how far it got, for its heartbeat (recovery.py)."""
    return _state.steps


# --- DataLoader workers -------------------------------------------------------------------------------------------
def shield_workers(*loaders):
    """A stop sent to every process of the job (Ctrl-C at a terminal, `timeout`, `kill -- -PGID`, Slurm's --signal,
    which signals every process of a job step) reaches the DataLoader's workers too. torch's own handler ends a
    worker on SIGTERM from anyone but its parent by the signal's default, and the training process then raises
    "DataLoader worker ... exited unexpectedly" (or "... is killed by signal") mid-step instead of saving. So each
    worker leaves such a stop to the process that reads it; its parent's SIGTERM still ends it, as in torch (the
    DataLoader's shutdown, Python's exit)."""
    for loader in loaders:
        loader.worker_init_fn = functools.partial(_worker_init, os.getpid())


def _worker_init(parent, worker_id):
    paths.forget_hold()  # a forked worker's copy of --output-dir's lock would hold it after its parent was killed
    # Blocked in this thread before the next starts: every thread of the worker then blocks them, and the signals
    # wait for sigwaitinfo, which tells who sent each.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    threading.Thread(target=_end_on_parents_sigterm, args=(parent,), daemon=True, name="stops").start()


def _end_on_parents_sigterm(parent):
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
        previous, self.pending = self.pending, (votes, done)
        decision = self._decision(previous)
        if decision == "signal" and self.result() == "nonfinite":  # this step's too: its weights are not saved
            decision = "nonfinite"
        return decision

    def result(self):
        """The last step's decision, once the epoch's steps are queued."""
        previous, self.pending = self.pending, None
        return self._decision(previous)

    @staticmethod
    def _decision(vote):
        if vote is None:
            return None
        votes, done = vote
        if done is not None:
            done.synchronize()  # the step before this one: done, or nearly
        nonfinite, signal_seen = votes.tolist()
        return "nonfinite" if nonfinite else "signal" if signal_seen else None


def requested(loss):
    """Each optimizer step, on every rank: this step's vote cast, the one before read. -> whether every rank stops
    now (they all read the same decision)."""
    if _state.vote is None:
        _state.vote = StopVote(loss.device)
    _state.steps += 1
    decision = _state.vote.cast(loss)
    _state.decision = _state.decision or decision
    return decision is not None


def save_if_stopped(epoch, step, steps_per_epoch, save):
    """After an epoch's steps, every rank at the same step (the next to run: step). A NaN or infinite loss, here or
    in the last steps' votes: nothing saved, exit 1 (a restart would meet it again). A signal part-way through
    the epoch: rank 0 calls save(step), every rank ends the run (exit 0). A signal at the epoch's last step: the
    epoch is evaluated and saved first (stop_after_epoch)."""
    vote, decision = _state.vote, _state.decision
    _state.vote = _state.decision = None
    if vote is not None and decision is None:
        decision = vote.result()  # the last step's vote
    if decision == "nonfinite":
        checkpoint = job.checkpoint_path()
        fail(f"the loss became NaN or infinite in epoch {epoch}: stopped without saving; "
             f"{checkpoint if os.path.isfile(checkpoint) else 'no checkpoint'} is the last good one. "
             "Try a lower --lr, or --amp bf16 instead of fp16")
    if decision == "signal" and step < steps_per_epoch:
        if job.is_main_process():
            save(step)
        log(f"stopped by signal {stop_signal() or 'on another rank'} at epoch {epoch} step {step}/{steps_per_epoch}; "
            f"saved {job.checkpoint_path()}. To resume, {job.resume_advice()}")
        raise Finished


def stop_after_epoch(last=False):
    """After an epoch's files, every rank: whether a signal reached any rank during the evaluation (or at the
    epoch's last step). Then every rank ends the run (exit 0) with the epoch saved. last: the epoch was the last
    one, so there is nothing left to stop."""
    flag = torch.tensor([float(stop_signal() is not None)])
    if dist.is_initialized():
        if dist.get_backend() == "nccl":  # NCCL reduces GPU tensors only
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    if last:
        log("a stop was asked for at the end of the last epoch: training had finished, nothing is left to stop")
        return
    log(f"stopped by signal after an epoch; saved {job.checkpoint_path()}. To resume, {job.resume_advice()}")
    raise Finished
