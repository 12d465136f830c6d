"""Surviving faults, out of main.py's way: who speaks, the one-line error channel, signals, a lost peer, and the
ranks' agreement to stop.

    @recovery.guarded("main.py", folder="output_dir")   # a mistake, or out of memory -> one line; a lost peer ->
    def main(args): ...                                  # which rank; exit 1
    recovery.install_signal_handlers()        # SIGTERM / Ctrl-C: finish the step, save, exit 0
    with recovery.waiting_for_peers(minutes):    # init_process_group: says what it waits for, if it waits
    recovery.start_heartbeat()                # lets a rank name the peer it lost
    vote = recovery.StopVote(device)          # each step: a signal or a NaN on any rank stops all, together
    recovery.stop_in_epoch(...), recovery.stop_after_epoch(...)   # save and stop, or fail, every rank alike

A mistake the user can fix (paths.UserError, paths.BadInput) ends with `main.py: error: ...` (or
`predict.py: error: ...`) on one line, said by the rank that met it, once: under torchrun a restarted worker
does not repeat it (a restart is for a lost process or peer, not for a bad file). Only global rank 0 logs
progress and writes files.
"""
import atexit
import functools
import json
import multiprocessing.util  # before atexit.register below: see _end_workers_at_exit
import os
import signal
import sys
import threading
import tempfile
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

import paths
from paths import BadInput, UserError, fail

# This module's state, in one place: set by main.py and the signal handler, read by the heartbeat.
_state = SimpleNamespace(quiet=False, signal=None, signal_time=0.0, step=0, output_dir=None, args=None,
                         started=time.time(), heartbeat=None, program="main.py", handlers=None)


# --- who speaks -------------------------------------------------------------------------------------------
def get_rank():
    """The global rank; before the process group exists, the launcher's RANK (0 without a launcher)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size():
    """The number of processes; before the process group exists, the launcher's WORLD_SIZE (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def is_main_process():
    """Global rank 0, not local rank 0: with several nodes that would be one per node."""
    return get_rank() == 0


def set_quiet(quiet):
    """--check-only reports mistakes only."""
    _state.quiet = quiet


def log(*message):
    if is_main_process() and not _state.quiet:
        print(*message, flush=True)


def _one_line(error):
    """The message of a BadInput, also when a DataLoader worker raised it (then it is wrapped in the
    worker's traceback, and the message is its last line)."""
    lines = str(error).rstrip().splitlines() or [type(error).__name__]
    return lines[-1].split("BadInput: ", 1)[-1]


# --- the run, and how it ends ---------------------------------------------------------------------------
@contextmanager
def guard(program, output_dir=None, args=None):
    """Around a program's run: every way it can end becomes exit 0, or one line and exit 1.

    - UserError (fail()): rank 0 prints it when every rank found it; the rank that met it when only it did.
    - BadInput raised while training (a damaged file whose header was fine): the rank that read it prints
      it, whichever that is, and records it so that the peers waiting for this rank stay quiet and a
      torchrun restart does not repeat it.
    - torch.OutOfMemoryError: the rank that ran out says where (a training step, the evaluation, a prediction),
      with what (the batch, the crop, the precision), the device's memory, and what to change. It is not
      retried: the same step would run out again.
    - A failed or timed-out collective: each waiting rank names the rank at fault from the heartbeats.
    Anything else is a bug, not a mistake: its traceback is kept. output_dir: where a mistake is recorded for
    the peers and restarts, and where the last checkpoint is (main.py's), or None (predict.py). args: the
    program's flags, for the out-of-memory line.
    """
    # A run starts with nothing said and no signal seen (a second run in one process too: the tests').
    _state.program, _state.output_dir, _state.quiet, _state.signal = program, output_dir, False, None
    _state.args = args
    _state.started = time.time()
    _exit_if_stopped_before()
    if stop_signal() is not None:  # run.sh passed a stop on while this worker started (and torchrun started it again)
        log(f"{program}: stopped before it began its work (a stop was asked for while it started): nothing changed. "
            f"To go on, {paths.resume_advice()}")
        sys.exit(0)
    try:
        yield
    except UserError as error:
        if isinstance(error, paths.Held):  # another run's folder: nothing of this run is written there
            _state.output_dir = None
        if error.this_rank and get_world_size() > 1:
            _stop(f"rank {get_rank()}: {error}", say_it=True)
        _stop(str(error), say_it=is_main_process())
    except BadInput as error:
        prefix = f"rank {get_rank()}: " if get_world_size() > 1 else ""
        _stop(prefix + _one_line(error), say_it=True)
    except torch.OutOfMemoryError as error:
        prefix = f"rank {get_rank()}: " if get_world_size() > 1 else ""
        _stop(prefix + out_of_memory(error), say_it=True)
    except Exception as error:
        if not (dist.is_initialized() and is_collective_failure(error)):
            raise
        paths.release_output()
        if _peer_stopped_on_a_mistake():
            os._exit(1)  # the rank that met it said why; not sys.exit: a broken process group can hang
        checkpoint = os.path.join(output_dir, "checkpoint.pth") if output_dir else None
        last = ""
        if getattr(args, "evaluate", False):
            last = " Run the same command again to evaluate"
        elif checkpoint and os.path.isfile(checkpoint):
            last = f" The last checkpoint: {checkpoint}; {paths.resume_advice()}"
        elif checkpoint:
            last = " No checkpoint was written yet: run the same command again to start over"
        print(f"{program}: error: rank {get_rank()}: a collective failed or waited more than --dist-timeout "
              f"({_one_line(error)}). {describe_peers()}.{last}", file=sys.stderr, flush=True)
        os._exit(1)
    finally:
        paths.release_output()  # --output-dir free for the next run (paths.hold_output)
        if _state.handlers is not None:  # the signals go back to what they did before this run
            for signum, handler in _state.handlers.items():
                signal.signal(signum, handler)
            _state.handlers = None


def guarded(program, folder=None):
    """A decorator: main(args) run inside guard(program, args.<folder>, args)."""
    def decorate(main):
        @functools.wraps(main)
        def run(args):
            with guard(program, getattr(args, folder) if folder else None, args):
                return main(args)
        return run
    return decorate


# --- out of memory -----------------------------------------------------------------------------------------
_PHASES = {"train_one_epoch": "a training step", "evaluate": "the evaluation", "run_batch": "a prediction"}


def memory_figures():
    """(this process's device, its memory in GiB, the peak this process reached in GiB, as the log shows it: a
    GPU's peak allocated, or the CPU's peak resident set)."""
    import records  # (records imports this module)
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        return f"GPU {device.index}", total / 2**30, records.peak_memory_gib(device)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "the CPU", total / 2**30, records.peak_memory_gib(torch.device("cpu"))


def _less_precise():
    """The --amp to try: bf16, or fp16 on a GPU without bf16 of its own (T4, V100, RTX 20xx emulate it, slowly)."""
    native_bf16 = not torch.cuda.is_available() or torch.cuda.is_bf16_supported(including_emulation=False)
    return "--amp bf16" if native_bf16 else "--amp fp16"


def _smaller_batch(batch, accum_steps):
    """-> (-b, --accum-steps) with about half the images per forward and the same global batch, or None at -b 1."""
    smaller = max((d for d in range(1, batch // 2 + 1) if batch % d == 0), default=None)
    return None if smaller is None else (smaller, accum_steps * batch // smaller)


def out_of_memory(error):
    """The one line for torch.OutOfMemoryError: what ran out (told by the function it was raised in), with which
    settings, the device's memory, and what to change, in the flags of the program that ran out."""
    phase = "setting up"
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.name in _PHASES and os.path.basename(frame.filename) in ("main.py", "predict.py"):
            phase = _PHASES[frame.name]
            break
    args = _state.args
    device, total, peak = memory_figures()
    precision = getattr(args, "amp", None) or "fp32"
    crop = getattr(args, "eval_crop", None)
    window = f"in windows of {crop[0]}x{crop[-1]} (--eval-crop)" if crop else "whole, at full resolution"
    tries = [] if getattr(args, "amp", None) else [_less_precise()]
    if phase == "a training step":
        height, width = (args.crop_size * 2)[:2]
        settings = f"-b {args.batch_size} per process x --accum-steps {args.accum_steps}, crop {height}x{width}"
        smaller = _smaller_batch(args.batch_size, args.accum_steps)
        if smaller:
            tries.append(f"-b {smaller[0]} --accum-steps {smaller[1]} (the same global batch)")
        tries.append("a smaller --crop-size")
    elif phase == "the evaluation":
        settings = f"val images {window}, one at a time"
        tries.append("a smaller --eval-crop" if crop else "a sliding window, --eval-crop 769 (mmsegmentation's)")
    elif phase == "a prediction":
        settings = f"-b {args.batch_size} images of one size per forward, {window}"
        if args.batch_size > 1:
            tries.append("-b 1")
        tries.append("a smaller --eval-crop" if crop else "a sliding window, --eval-crop 769")
    else:
        settings = "before the first step"
        tries.append("a smaller model (--model)")
    under_run_sh = os.environ.get("DEEPLAB_RUN_SH") == "1" and _state.program == "main.py"
    advice = ", ".join(tries[:-1]) + (", or " if len(tries) > 1 else "") + tries[-1]
    return (f"out of memory in {phase} ({settings}, {precision}; {device}: {total:.1f} GiB in all, {peak:.1f} GiB at "
            f"the peak): try {advice}" + (" (after ./run.sh)" if under_run_sh else ""))


def is_collective_failure(error):
    """Whether a collective or the rendezvous store failed, by where the error comes from, not by words in it:
    torch.distributed's own error types (NCCL and the store raise DistError and its subclasses), or a
    RuntimeError raised inside torch.distributed's code (where gloo's errors surface: DDP's buffer broadcast,
    an all_reduce) or naming a gloo source file (gloo's errors in DDP's gradient all-reduce surface in
    backward()). Other RuntimeErrors (a CUDA error in the model, a DataLoader timeout) keep their traceback.
    What it cannot tell apart: a dead peer, a hung one and a broken network (the heartbeats do), and a
    collective that failed for a reason of its own (a CUDA error inside NCCL) from a lost peer. With NCCL,
    its watchdog usually ends the process at the timeout before the error reaches Python at all."""
    if isinstance(error, dist.DistError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    if "/gloo/" in str(error):
        return True
    # Raised by a call from torch.distributed's Python into its C++ (a collective), not by one of its own
    # `raise` statements (DDP's own errors, such as parameters that got no gradient, are mistakes, not peers).
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or (frames[-1].line or "").lstrip().startswith("raise"):
        return False
    where = frames[-1].filename.replace(os.sep, "/")
    return "/torch/distributed/" in where or where.endswith("/torch/nn/parallel/distributed.py")


def _stop_files():
    """Where a mistake is recorded: the output folder (shared by every node), and this machine's temporary
    folder for when the output folder cannot be written (a full disk)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    mine = os.path.join(tempfile.gettempdir(), f"deeplab-stopped-{run_id}.json")
    return [os.path.join(_state.output_dir, ".stopped.json"), mine] if _state.output_dir else [mine]


def _stop(message, say_it):
    """Say the one line, record it for the peers and for torchrun's restarts, exit 1."""
    if say_it:
        print(f"{_state.program}: error: {message}", file=sys.stderr, flush=True)
        if get_world_size() > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
            record = {"run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""), "time": time.time(), "message": message}
            for path in _stop_files():
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    temporary = f"{path}.{os.getpid()}.tmp"  # ranks that fail together each write their own
                    with open(temporary, "w") as f:
                        json.dump(record, f)
                    os.replace(temporary, path)
                    break
                except OSError:
                    pass  # nowhere to write: restarts may repeat the line, nothing worse
    if dist.is_initialized() and get_world_size() > 1:
        paths.release_output()
        os._exit(1)  # peers may be inside a collective with us: tearing the process group down can hang
    sys.exit(1)


def _read_stop_file():
    for path in _stop_files():
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
    return None


def _peer_stopped_on_a_mistake():
    record = _read_stop_file()
    return record is not None and record.get("time", 0) >= _state.started


def _exit_if_stopped_before():
    """torchrun restarts every worker when one exits non-zero, whatever the reason. A worker that stopped
    on a mistake recorded it: a restarted worker of the same torchrun job exits at once, without a word
    (the line was said), so the job ends after torchrun's restarts run out, seconds later, instead of
    meeting the same bad file again. In the first attempt, rank 0 clears a record of an earlier job."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return
    record = _read_stop_file()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
        if record is not None and is_main_process():
            for path in _stop_files():
                if os.path.exists(path):
                    os.remove(path)
    elif record is not None and record.get("run_id") == run_id:
        sys.exit(1)


# --- signals: stop at the end of the step ---------------------------------------------------------------
def install_signal_handlers():
    """SIGTERM (a scheduler's preemption, torchrun passing one on) or SIGINT (Ctrl-C): main.py finishes the
    step, the ranks agree, rank 0 saves where they are, all exit 0. A second signal exits at once."""
    _state.handlers = {signum: signal.signal(signum, _on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}


def _on_signal(signum, frame):
    if _state.signal is None:
        _state.signal, _state.signal_time = signum, time.time()
    elif time.time() - _state.signal_time > 1.0:  # a second signal (not a copy of the first, which a
        signal.signal(signum, signal.SIG_DFL)     # scheduler and a launcher may both send): stop now
        os.kill(os.getpid(), signum)


def stop_signal():
    """The signal that asked this process to stop, or None. run.sh also writes the first signal's name into the
    file DEEPLAB_STOP_FILE names: a worker that was still starting then (the signal killed it before it had
    handlers, and torchrun started it again) or not yet started learns it there."""
    stop_file = os.environ.get("DEEPLAB_STOP_FILE")
    if _state.signal is None and stop_file and os.path.exists(stop_file):
        try:
            with open(stop_file) as f:
                name = f.read().strip()
        except OSError:
            name = "TERM"  # gone again (run.sh ended) or unreadable: it was there, a stop was asked for
        _state.signal = int(getattr(signal, f"SIG{name}", signal.SIGTERM))
        _state.signal_time = time.time()
    return _state.signal


def worker_init(worker_id):
    """DataLoader workers' init. A stop sent to the whole process group (Ctrl-C in a terminal; SIGTERM from
    `timeout`, `kill -- -PGID`, a scheduler that signals every process of a job) reaches the workers too: they
    leave it to the training process, which must still read the batch in flight, finish its step and save. (The
    DataLoader ends its workers through a queue and an event; a worker whose parent died ends by itself within
    seconds.) And a forked worker lets go of its copy of the --output-dir lock, which would otherwise hold the
    folder after its parent was killed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    paths.forget_hold()


def _end_workers_at_exit():
    """The other side of worker_init. At the exit of the process that started them, multiprocessing's exit hook
    (multiprocessing.util._exit_function) sends SIGTERM to the daemonic children still running (DataLoader workers
    are daemonic) and then waits for them. Workers that ignore SIGTERM would make that wait last for ever: after
    an error raised inside `for ... in loader`, the loader's iterator can still be alive at exit (the error's
    traceback holds it), its workers never told to stop, and main.py would print its one line and then hang. So
    every daemonic child still running at exit (a DataLoader's worker, or a Pool's left open) gets SIGKILL, which
    cannot be ignored, first. atexit runs its functions last registered first, and this one is registered after
    multiprocessing.util's (imported above); it runs in the process whose script ends (a multiprocessing child
    runs the exit hook itself and never reaches atexit)."""
    # The DataLoader's SIGCHLD handler raises "DataLoader worker ... is killed by signal" for a worker of a live
    # iterator that died: here that death is ours, and the default (ignore SIGCHLD) lets the loop reach every child.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=10)  # a process in uninterruptible I/O (a hung network mount) dies when it returns


atexit.register(_end_workers_at_exit)


# --- a lost peer ------------------------------------------------------------------------------------------
HEARTBEAT_S = 2.0


def note_step(step):
    """The training step this rank is at, for its heartbeat."""
    _state.step = step


def start_heartbeat():
    """Every HEARTBEAT_S, write (time, training step) of this rank into the store the process group
    rendezvoused with, from a thread: a rank that is stopped, killed or cut off falls silent, one stuck in
    its own work falls behind. When a collective fails, describe_peers() reads this to name the rank.
    stop_heartbeat() ends the thread: before the process group goes, or the thread may use a store that is
    being torn down."""
    store, key, stopping = dist.distributed_c10d._get_default_store(), f"heartbeat/{get_rank()}", threading.Event()

    def beat():
        while not stopping.is_set():
            try:
                store.set(key, f"{time.time()} {_state.step}")
            except Exception:  # the store is gone: the job is ending
                return
            stopping.wait(HEARTBEAT_S)

    thread = threading.Thread(target=beat, daemon=True, name="heartbeat")
    thread.start()
    _state.heartbeat = (thread, stopping)


def stop_heartbeat():
    if _state.heartbeat is not None:
        thread, stopping = _state.heartbeat
        stopping.set()
        thread.join(timeout=10)
        _state.heartbeat = None


def describe_peers():
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))  # the launcher may be tearing it down: do not wait on it
    except Exception:
        return "no heartbeat to tell which rank"
    now, beats, world_size = time.time(), {}, get_world_size()
    for rank in range(world_size):
        try:
            if store.check([f"heartbeat/{rank}"]):
                stamp, step = store.get(f"heartbeat/{rank}").decode().split()
                beats[rank] = (now - float(stamp), int(step))
        except Exception:
            pass
    silent = {r: age for r, (age, _) in beats.items() if age > 3 * HEARTBEAT_S}
    missing = [r for r in range(world_size) if r not in beats]
    if silent or missing:
        parts = [f"rank {r} silent for {age:.0f} s" for r, age in sorted(silent.items())]
        parts += [f"rank {r} never reported" for r in missing]
        return ", ".join(parts) + " (stopped, killed, or cut off)"
    steps = {r: step for r, (_, step) in beats.items()}
    if len(set(steps.values())) > 1:
        low = min(steps.values())
        behind = [r for r, step in steps.items() if step == low]
        return f"rank(s) {behind} behind at step {low}, others at {max(steps.values())} (stuck in their own work)"
    return "every rank alive and at the same step: a rank is stuck inside a collective, or the network failed"


# --- stopping together ---------------------------------------------------------------------------------------
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


def stop_in_epoch(why, epoch, step, steps_per_epoch, checkpoint_path, save):
    """Training stopped part-way through an epoch, every rank at the same step. "nonfinite": nothing is saved
    (the last checkpoint is the last good one; a restart would meet the NaN again: exit 1). "signal": rank 0
    saves the position (save(), called on rank 0 alone), every rank exits 0."""
    if why == "nonfinite":
        fail(f"the loss became NaN or infinite in epoch {epoch}: stopped without saving; "
             f"{checkpoint_path if os.path.isfile(checkpoint_path) else 'no checkpoint'} is the last good one. "
             "Try a lower --lr, or --amp bf16 instead of fp16")
    if is_main_process():
        save()
    log(f"stopped by signal {stop_signal() or 'on another rank'} at epoch {epoch} step {step}/{steps_per_epoch}; "
        f"saved {checkpoint_path}. To resume, {paths.resume_advice()}")


def stop_after_epoch(problem, device, checkpoint_path, last=False):
    """After an epoch's files (rank 0 wrote them; problem: why it could not, or None), every rank learns whether
    rank 0 failed to write (all stop with its line, exit 1) and whether a signal came during the evaluation
    (all stop, exit 0). last: the epoch was the last one, so there is nothing left to stop. -> whether to stop."""
    flags = torch.tensor([stop_signal() is not None, problem is not None], dtype=torch.float32, device=device)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    signal_seen, write_failed = flags.tolist()
    if write_failed:
        fail(problem or "rank 0 could not write this epoch's files")
    if signal_seen and last:
        log("a stop was asked for at the end of the last epoch: training had finished, nothing is left to stop")
        return False
    if signal_seen:
        log(f"stopped by signal after an epoch; saved {checkpoint_path}. To resume, {paths.resume_advice()}")
    return bool(signal_seen)


# --- waits that say what they wait for ----------------------------------------------------------------------------
@contextmanager
def waiting_for_peers(minutes, after_s=5.0, every_s=60.0):
    """Around init_process_group: when it takes more than after_s seconds (a process that has not started yet, or
    cannot reach MASTER_ADDR), rank 0 and each node's first process say what they wait for, where, and when it
    gives up; again every every_s seconds."""
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    done = threading.Event()
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    gives_up = time.strftime("%H:%M:%S", time.localtime(time.time() + minutes * 60))

    def say():
        waited = 0.0
        while not done.wait(after_s if waited == 0 else every_s):
            waited = time.time() - started
            print(f"{_state.program}: rank {rank}: waiting {waited:.0f} s for the {os.environ.get('WORLD_SIZE', '?')} "
                  f"processes to meet at {where} (the process group); it gives up at {gives_up} (--dist-timeout "
                  f"{minutes:g} min)", file=sys.stderr, flush=True)

    started = time.time()
    thread = threading.Thread(target=say, daemon=True, name="waiting")
    if rank == 0 or local_rank == 0:
        thread.start()
    try:
        yield
    except dist.DistError as error:  # the wait ran out (the store says how many came), or the address is not there
        fail(f"the {os.environ.get('WORLD_SIZE', '?')} processes did not all meet at {where} within "
             f"{time.time() - started:.0f} s ({paths.first_line(error)}): start every rank, 0 to WORLD_SIZE-1, with "
             "the same MASTER_ADDR and MASTER_PORT, reachable from each (a firewall, another network interface?)",
             this_rank=True)
    finally:
        done.set()


def watch_rendezvous(endpoint, run_id, nodes, timeout_s, first_s=5.0, every_s=60.0):
    """run.sh, beside torchrun on each node of several: until the nodes have met at torchrun's c10d rendezvous,
    say after first_s seconds and then every every_s how many have joined, where, and when torchrun gives up
    (--rdzv-conf join_timeout). Reads the rendezvous state from its store with torchrun's own backend class."""
    import pickle
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    host, port = endpoint.rsplit(":", 1)
    started = time.time()
    gives_up = time.strftime("%H:%M:%S", time.localtime(started + float(timeout_s)))
    say_at, store = started + first_s, None
    while time.time() < started + float(timeout_s) + 60:
        joined = None
        try:
            if store is None:
                store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5),
                                 wait_for_workers=False)
            found = C10dRendezvousBackend(store, run_id).get_state()
            if found is not None:
                state = pickle.loads(found[0])
                if state.complete:
                    return  # the nodes have met: torchrun starts the workers
                joined = len(state.participants)
        except Exception:  # the host node's torchrun is not there yet (or has gone): try again
            store = None
        if time.time() >= say_at:
            count = (f"{joined} of {nodes} node(s) have joined" if joined is not None else
                     f"no answer from {endpoint} yet (the node with NODE_RANK=0 hosts it)")
            print(f"run.sh: waiting {time.time() - started:.0f} s for {nodes} nodes to meet at {endpoint} "
                  f"(rendezvous {run_id}): {count}; torchrun gives up at {gives_up} (JOIN_TIMEOUT={timeout_s} s)",
                  flush=True)
            say_at += every_s
        time.sleep(1.0)
