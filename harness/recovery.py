"""What ends a run, out of main.py's way: every way it can end becomes exit 0, or one line and exit 1; a lost peer
is named; a wait says what it waits for.

    @recovery.guarded("main.py")             # around main(args): mistakes, out of memory, a lost peer -> one line
    def main(args): ...
    recovery.start_heartbeat(minutes)         # before init_process_group: says what it waits for; then a thread
                                              # writes this rank's heartbeat into the process group's store
    recovery.stop_heartbeat()                 # before destroy_process_group

A mistake the user can fix (errors.UserError, images.BadInput, models.WeightsError) ends with `main.py: error: ...`
(or `predict.py: error: ...`) on one line, said by the rank that met it, once: under torchrun a restarted worker
does not repeat it (a restart is for a lost process or peer, not for a bad file). Only global rank 0 logs
progress and writes files. This module's state is job.RUN.guard.
"""
import atexit
import functools
import gc
import json
import os
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager, suppress
from datetime import timedelta

import torch
import torch.distributed as dist

from . import checks, job, paths, records, stops
from .errors import BadInput, Finished, UserError, first_line
from .job import RUN, get_rank, get_world_size, is_main_process, log
from models import WeightsError


def _one_line(error):
    """The message of a BadInput, also when a DataLoader worker raised it (then it is wrapped in the
    worker's traceback, and the message is its last line)."""
    lines = str(error).rstrip().splitlines() or [type(error).__name__]
    return lines[-1].split("BadInput: ", 1)[-1]


# --- the run, and how it ends ---------------------------------------------------------------------------
@contextmanager
def guard(program, args=None):
    """Around a program's run: every way it can end becomes exit 0, or one line and exit 1.

    - UserError (errors.fail), and a WeightsError (a backbone file): rank 0 prints it when every rank found it; the
      rank that met it when only it did.
    - BadInput (a file of the data set that cannot be used): before the process group exists every rank reads the
      same files, and rank 0 says it; after, the rank that read it says it, whichever that is, and records it so
      that the peers waiting for this rank stay quiet and a torchrun restart does not repeat it.
    - Out of memory (torch.OutOfMemoryError on a GPU, the CPU allocator's RuntimeError): the rank that ran out says
      where (a training step, the evaluation, a prediction), with what (the batch, the crop, the precision), the
      device's memory, and what to change. It is not retried: the same step would run out again.
    - A failed or timed-out collective: each waiting rank names the rank at fault from the heartbeats.
    - errors.Finished (--check-only done, a stop saved): exit 0; a check of a run that has finished: exit
      errors.NOTHING_TO_TRAIN.
    Anything else is a bug, not a mistake: its traceback is kept. main.py's signals are stops.py's while it runs.
    args: the program's flags (where a mistake is recorded for the peers and restarts, the out-of-memory line)."""
    try:
        _begin(program, args)
        yield
    except Finished as done:
        stop_heartbeat()
        if dist.is_initialized():
            dist.destroy_process_group()  # every rank stopped at the same point: none waits in a collective
        if done.status:
            sys.exit(done.status)
    except stops.Interrupted as stop:
        log(f"{program}: stopped by signal {stop.args[0]} before training began: nothing was trained. To go on, "
            f"{job.resume_advice()}")
    except KeyboardInterrupt:  # a stop where it ends at once (-e, predict.py, the tools; stops.install): one line
        if is_main_process():
            signum = RUN.stops.signal or signal.SIGINT
            _say(f"{program}: stopped ({'Ctrl-C' if signum == signal.SIGINT else signal.Signals(signum).name})")
        sys.exit(130)
    except (UserError, WeightsError) as error:
        if isinstance(error, paths.Held):  # another run's folder: nothing of this run is written there
            RUN.guard.output_dir = None
        if getattr(error, "this_rank", False):
            _said_by_this_rank(str(error))
        _say_record_and_exit(str(error), say_it=is_main_process())
    except BadInput as error:
        if not dist.is_initialized():
            _say_record_and_exit(_one_line(error), say_it=is_main_process())
        _said_by_this_rank(_one_line(error))
    except Exception as error:
        if said := out_of_memory(error) or data_worker_lost(error):
            _said_by_this_rank(said)
        if isinstance(error, RuntimeError) and not dist.is_initialized() and RUN.guard.waiting_since is not None:
            _say_record_and_exit(f"rank {get_rank()}: " + _did_not_meet(error), say_it=True)
        if not (dist.is_initialized() and is_collective_failure(error)):
            raise
        _lost_peer(error)
    finally:
        stops.restore()
        stop_heartbeat()
        records.close_tensorboard()
        paths.release_output()  # --output-dir free for the next run (paths.hold_output)


def _say(line):
    """A line on stderr, at once."""
    print(line, file=sys.stderr, flush=True)


def _said_by_this_rank(message):
    """A line only this rank met: said by it, with its number where the job has several ranks; recorded; exit 1."""
    _say_record_and_exit((f"rank {get_rank()}: " if get_world_size() > 1 else "") + message, say_it=True)


def _begin(program, args):
    """A run starts with nothing said and no signal seen (a second run in one process too: the tests'): the
    launcher's variables read, a torchrun restart of a job stopped on a mistake ended at once, the stop signals
    installed."""
    job.begin_run()  # every field of job.RUN afresh, for a second run in one process too (the tests')
    # A stream that cannot encode a character (PYTHONIOENCODING=ascii, an old cluster's profile) would raise
    # UnicodeEncodeError from a print of a path or a class name, mid-run: such a character is written as its escape
    # (\xe9, \u0434) instead.
    for stream in (sys.stdout, sys.stderr):
        # (AttributeError: not a TextIOWrapper, a stream replaced by one of another kind; ValueError: closed;
        # OSError: a broken pipe; TypeError: a reconfigure without errors=)
        with suppress(AttributeError, ValueError, OSError, TypeError):
            stream.reconfigure(errors="backslashreplace")
    RUN.guard = job.Guard(program=program, args=args,
                          output_dir=getattr(args, "output_dir", None) if program == "main.py" else None)
    # At exit the interpreter's garbage collections walk every object torch and torchvision made. It costs about 2 s
    # (of a 9 s check-only run on a 2-core EPYC, docs/tests.md) in each worker, in run.sh's check and in predict.py.
    # gc.freeze() at exit leaves those objects out (atexit runs before those collections; CPython's order, which a
    # test checks). Nothing here relies on the cyclic garbage being finalized at exit: files are closed by `with`,
    # TensorBoard's writer by guard, DataLoader workers by multiprocessing's own exit handler (and Python does not
    # promise to finalize what is alive at exit). Unregistered first: a process that runs main() more than once, as
    # the tests do, keeps one.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    job.read_environment(program)
    if job.env().under_run_sh and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        # run.sh starts torchrun with SIGTERM ignored, and its workers inherit that: from here it is theirs again.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if job.env().distributed:
        paths.check_private_folder()  # where the records below are kept: this user's own
    _exit_or_clear_stop_record()
    # A training run's signals finish the step and save; -e's, the preflight's and predict.py's end it at once.
    stops.install(training=program == "main.py" and not (args.evaluate or args.check_only))
    if stops.stop_signal() is not None:  # run.sh passed a stop on while this worker started (torchrun restarted it)
        log(f"{program}: stopped before it began its work (a stop was asked for while it started): nothing "
            f"changed. To go on, {job.resume_advice()}")
        sys.exit(0)


def guarded(program):
    """A decorator: main(args) run inside guard(program, args)."""
    def decorate(main):
        @functools.wraps(main)
        def run(args):
            with guard(program, args):
                return main(args)
        return run
    return decorate


def _lost_peer(error):
    """A collective failed or timed out: this rank says which rank it lost (from the heartbeats), and what to do."""
    paths.release_output()
    if _peer_stopped_on_a_mistake():
        os._exit(1)  # the rank that met it said why; not sys.exit: a broken process group can hang
    checkpoint = job.checkpoint_path(RUN.guard.output_dir) if RUN.guard.output_dir else None
    last = ""
    if getattr(RUN.guard.args, "evaluate", False):
        last = " Run the same command again to evaluate"
    elif checkpoint and os.path.isfile(checkpoint):
        last = f" The last checkpoint: {checkpoint}; {job.resume_advice()}"
    elif checkpoint:
        last = " No checkpoint was written yet: run the same command again to start over"
    _say(f"{RUN.guard.program}: error: rank {get_rank()}: a collective failed or waited more than --dist-timeout "
         f"({_one_line(error)}). {describe_peers()}.{last}")
    os._exit(1)


# --- out of memory -----------------------------------------------------------------------------------------
_RAN_OUT_IN = {"train_one_epoch": "a training step", "evaluate": "the evaluation", "run_batch": "a prediction"}


def is_cpu_out_of_memory(error):
    """The CPU's allocator says it in a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory"); CUDA's
    raises torch.OutOfMemoryError."""
    return isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error)


def data_worker_lost(error):
    """The one line for a DataLoader worker that died or could not hand over a batch, or None for another error.
    torch says it in a plain RuntimeError naming a DataLoader worker (torch 2.14's words, in libtorch_python and
    torch/utils/data), and the advice follows its cause: shared memory that could not be allocated (or a bus error:
    most likely a full /dev/shm); too many open files (the descriptors workers hand tensors over through); another
    error handing a batch over (stops._batch_not_handed_over); a worker killed (Killed, or gone before torch saw
    why: most likely the out-of-memory killer); one that died otherwise. With -j 0 there is no worker: None."""
    text, workers = str(error), getattr(RUN.guard.args, "workers", None)
    if not isinstance(error, RuntimeError) or "DataLoader worker" not in text or workers == 0:
        return None
    if workers is None:
        fewer = "a smaller -j (its default: each process's share of the cores, less one), or -j 0"
    else:
        fewer = "-j 0 (loading in this process)" if workers == 1 else f"-j {workers // 2} or -j 0"
    cause = text.rstrip().splitlines()[-1].split(": ", 1)[-1]  # the worker's own error: its traceback's last line
    said = first_line(error).rstrip(".")
    if any(words in text for words in ("unable to allocate shared memory", "No space left", "Bus error")):
        free = ""
        with suppress(OSError):  # (no /dev/shm: macOS)
            shm = os.statvfs("/dev/shm")
            free = f", {shm.f_bavail * shm.f_frsize / 2**20:.0f} MiB free"
        lost = f"could not hand over a batch: shared memory (/dev/shm{free}) is most likely too small"
        advice = f"give {fewer}, or more shared memory (Docker: --shm-size=8g)"
    elif "Too many open files" in text or "handing over a batch" in text:
        lost, advice = f"could not hand over a batch ({cause})", "give -j 0 (no hand-over)"
        if "Too many open files" in text:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            most = "unlimited" if hard == resource.RLIM_INFINITY else hard
            advice = (f"this shell's open-files limit is at its most ({most}): ask for a higher one" if soft == hard
                      else f"raise this shell's open-files limit to its most (now {soft}): ulimit -Sn {most}") + \
                f", or {advice}"
    elif "is killed by signal: Killed" in text or ("exited unexpectedly" in text and "exit code" not in text):
        lost = f"was killed or ended unexpectedly ({said}), most likely by the out-of-memory killer (dmesg says)"
        advice = f"give {fewer}, or more memory"
    elif "is killed by signal" in text or "exited unexpectedly" in text:  # another signal; an exit code of its own
        lost, advice = f"died ({said})", "give -j 0 to see why"
    else:
        return None
    training = RUN.guard.program == "main.py" and not getattr(RUN.guard.args, "evaluate", False)
    last = f" The last checkpoint is kept: then {job.resume_advice()}." if training else ""
    return f"a data loading worker {lost}: {advice}.{last}"


def memory_figures():
    """(this process's device, its memory in GiB, the peak this process reached in GiB, as the log shows it: a
    GPU's peak allocated, or the CPU's peak resident set)."""
    if torch.cuda.is_available():
        gpu = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(gpu).total_memory
        return f"GPU {gpu}", total / 2**30, torch.cuda.max_memory_allocated(gpu) / 2**30
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "the CPU", total / 2**30, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _smaller_batch(batch, accum_steps):
    """-b and --accum-steps with about half the images per forward and the same global batch; None at -b 1."""
    smaller = max((d for d in range(1, batch // 2 + 1) if batch % d == 0), default=None)
    return smaller and f"-b {smaller} --accum-steps {accum_steps * batch // smaller} (the same global batch)"


def out_of_memory(error):
    """The one line for torch.OutOfMemoryError (or the CPU's): what ran out (told by the function it was raised in),
    with which settings, the device's memory, and what to change, in the flags of the program that ran out; None for
    another error."""
    if not (isinstance(error, torch.OutOfMemoryError) or is_cpu_out_of_memory(error)):
        return None
    phase = next((_RAN_OUT_IN[frame.name] for frame in reversed(traceback.extract_tb(error.__traceback__))
                  if frame.name in _RAN_OUT_IN and os.path.basename(frame.filename) in ("main.py", "predict.py")),
                 "setting up")
    args, (device, total, peak) = RUN.guard.args, memory_figures()
    native, amp = checks.native_amp(torch.cuda.is_available()), getattr(args, "amp", None)
    precision = native if amp == "auto" else amp if amp != "off" else None
    tries = [] if precision else [f"--amp {native}"]
    crop = getattr(args, "eval_crop", None)
    window = f"in windows of {crop[0]}x{crop[-1]} (--eval-crop)" if crop else "whole, at full resolution"
    windows = "a smaller --eval-crop" if crop else "a sliding window, --eval-crop 769 (mmsegmentation's)"
    if phase == "a training step":
        height, width = checks.crop(args)
        settings = f"-b {args.batch_size} per process x --accum-steps {args.accum_steps}, crop {height}x{width}"
        tries += [_smaller_batch(args.batch_size, args.accum_steps), "a smaller --crop-size"]
    elif phase == "the evaluation":
        settings, tries = f"val images {window}, one at a time", tries + [windows]
    elif phase == "a prediction":
        settings = f"-b {args.batch_size} images of one size per forward, {window}"
        tries += ["-b 1" if args.batch_size > 1 else None, windows]
    else:
        settings, tries = "before the first step", tries + ["a smaller model (--model)"]
    *most, last = filter(None, tries)
    under_run_sh = job.env().under_run_sh and RUN.guard.program == "main.py"
    advice = (", ".join(most) + ", or " if most else "") + last
    return (f"out of memory in {phase} ({settings}, {precision or 'fp32'}; {device}: {total:.1f} GiB in all, "
            f"{peak:.1f} GiB at the peak): try {advice}" + (" (after ./run.sh)" if under_run_sh else ""))


def is_collective_failure(error):
    """Whether a collective or the rendezvous store failed, by where the error comes from, not by words in it:
    torch.distributed's own error types (NCCL and the store raise DistError and its subclasses), or a
    RuntimeError raised inside torch.distributed's code (where gloo's errors surface: DDP's buffer broadcast,
    an all_reduce) or naming a gloo source file (gloo's errors in DDP's gradient all-reduce surface in
    backward()). Other RuntimeErrors (a CUDA error in the model, a DataLoader timeout) keep their traceback.
    What it cannot tell apart: a dead peer, a hung one and a broken network (the heartbeats do), and a
    collective that failed for a reason of its own (a CUDA error inside NCCL) from a lost peer. With NCCL,
    its watchdog usually ends the process at the timeout before the error reaches Python at all."""
    if not isinstance(error, RuntimeError):
        return False
    if isinstance(error, dist.DistError) or "/gloo/" in str(error):  # (a DistError is a RuntimeError)
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
    private = paths.private_folder()
    mine = [os.path.join(private, f"stopped-{job.env().run_id or 'none'}.json")] if private else []
    return [os.path.join(RUN.guard.output_dir, ".stopped.json"), *mine] if RUN.guard.output_dir else mine


# How long a rank waits for rank 0 to say a mistake that every rank finds alike (_say_record_and_exit).
RANK_0_SAYS_IT_S = 10.0


def _say_record_and_exit(message, say_it):
    """Say the one line, record it for the peers and for torchrun's restarts (a file: _stop_files), exit 1.
    say_it=False (a mistake every rank finds alike, rank 0's to say): this rank first waits for rank 0's record.
    Ending first, it would have torchrun stop rank 0, perhaps before rank 0 said it (seen with torchrun started
    directly, not by run.sh: torchrun's SIGTERM killed rank 0 while it was still importing torch, and nothing was
    said, nor by the restarts). With no record after RANK_0_SAYS_IT_S, rank 1 says it, marked "rank 1:"; the line
    then comes twice where rank 0 said it but rank 1 could not read its record (another node, and no output folder
    they share). A stop while waiting (torchrun stops every worker once one has failed) ends this rank without a
    word: rank 0's to say."""
    if not say_it and get_world_size() > 1:
        deadline = time.monotonic() + RANK_0_SAYS_IT_S
        # (A stop raised here, inside guard's except clause, would escape guard with a traceback.)
        with suppress(stops.Interrupted, KeyboardInterrupt):
            while not _peer_stopped_on_a_mistake() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not _peer_stopped_on_a_mistake() and get_rank() == 1:
                message, say_it = f"rank 1: {message}", True
    if say_it:
        _say(f"{RUN.guard.program}: error: {message}")
        if get_world_size() > 1 or job.env().run_id is not None:
            record = {"run_id": job.env().run_id or "", "time": time.time(), "message": message}
            for path in _stop_files():  # the first that takes it; none: restarts may repeat the line, nothing worse
                with suppress(OSError):  # (ranks that fail together each write a temporary file of their own)
                    paths.write_atomically(path, json.dumps(record).encode(), durable=False)
                    break
    if dist.is_initialized() and get_world_size() > 1:
        paths.release_output()
        os._exit(1)  # peers may be inside a collective with us: tearing the process group down can hang
    # The failed run's frames are cleared now. The error's traceback keeps them, and they hold the model and the
    # DataLoader's workers. A process that goes on keeps the error (a notebook; a second main() in one process).
    # A garbage collection would free them later, and wait 5 s for each persistent worker (test_torch_claims).
    # No traceback of this error is shown: its one line is all.
    traceback.clear_frames(sys.exc_info()[2])
    sys.exit(1)


def _stop_records():
    """[(path, record)] of the records that can be read, in _stop_files' order (a file of another kind is none)."""
    records = []
    for path in _stop_files():
        with suppress(OSError, ValueError, TypeError, KeyError):  # (unreadable, or no record: JSON of another kind)
            with open(path) as f:
                record = json.load(f)
            records.append((path, {**record, "time": float(record["time"])}))
    return records


def _peer_stopped_on_a_mistake():
    """A mistake was said and recorded since this job (else this run) began."""
    started = _job_started() or RUN.guard.started
    return any(record["time"] >= started for _, record in _stop_records())


def _job_started():
    """When this job's torchrun agent on this node started; None outside torchrun or where Linux's /proc cannot
    be read. The agent is this process's parent. Every worker of every attempt on every node starts after the
    rendezvous, so after every agent of a fixed --nnodes started: a record older than that is an earlier job's,
    also where jobs share a run id (run.sh's --rdzv-id on several nodes). A program that forks between torchrun and
    Python (`--no-python` with a script that does not `exec`, a profiler) is taken for the agent: then a restart
    may say a mistake again."""
    if job.env().run_id is None:
        return None
    with suppress(OSError, ValueError, IndexError, TypeError, StopIteration):  # (TypeError: no /proc/PPID/stat)
        ticks = int(paths.process_stat(os.getppid())[19])  # field 22: its start, in ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        # 1 s earlier, so that a record stamped by a node whose clock runs behind still counts (the worker's seconds
        # of importing torch add to that; rounding btime and the ticks down only moves it earlier too). Capped at
        # this process's own start, in case /proc's figures are not of one boot.
        return min(boot + ticks / os.sysconf("SC_CLK_TCK") - 1.0, RUN.guard.started)
    return None


def _exit_or_clear_stop_record():
    """torchrun restarts every worker when one exits non-zero, whatever the reason. A worker that stopped on a
    mistake (or ran out of memory, or did not meet its peers) recorded it. A worker that finds a record of this job
    (its run id, written since this node's agent started) exits 1 at once without a word: a restart, a worker whose
    agent restarted it without counting a restart (another node's failure: its TORCHELASTIC_RESTART_COUNT stays 0),
    or a rank 0 still starting when a peer failed. The job then ends within seconds, once torchrun's restarts run
    out, instead of meeting the same bad file again. With /proc nothing is removed: the time tells an earlier job's
    record apart. Where /proc cannot tell when the agent started, only a worker with a restart count above 0
    exits, and rank 0 with a count of 0 removes the records it reads (an earlier job's; rarely, one that a peer of
    this attempt has just written)."""
    run_id = job.env().run_id
    if run_id is None:
        return
    started = _job_started()
    for path, record in _stop_records():
        if started is None and not job.env().restarts:
            if is_main_process():
                with suppress(OSError):
                    os.remove(path)
        elif record.get("run_id") == run_id and record["time"] >= (started or 0):  # (no start known: any time)
            sys.exit(1)


# --- a lost peer, and the wait for the peers ------------------------------------------------------------------
HEARTBEAT_S = 2.0


def start_heartbeat(minutes, after_s=5.0, every_s=60.0):
    """Before init_process_group, on every rank:
    - GLOO_SOCKET_IFNAME checked (_check_gloo_interfaces).
    - Under torchrun with restarts, a store of this attempt's own to meet at (_meet_at_a_store_of_this_attempt).
    - A thread. While the process group forms, it says after after_s seconds, then every every_s, what this process
      waits for, where, and when it gives up (rank 0 and each node's first process). Once the group exists, it
      writes every HEARTBEAT_S (its process, the time, steps done) into a file of its own (_peers_folder), which
      every rank of this node reads. While some rank has no file here (another node), it writes into the group's
      store too.

    The peers of a rank's node see its process dead or stopped, whatever became of the store (rank 0's process
    serves it). From another node, a rank stopped, killed or cut off falls silent; one stuck in its own work falls
    behind. When a collective fails, describe_peers() reads these to name the rank. stop_heartbeat() ends it."""
    env, stopping, since = job.env(), threading.Event(), time.time()
    gives_up = time.strftime("%H:%M:%S", time.localtime(since + minutes * 60))
    RUN.guard.waiting_since = since
    _check_gloo_interfaces()
    beat = {"group": None}  # this process group's name in the files' names, which the ranks agree on in its store
    agent, own = _meet_at_a_store_of_this_attempt()

    def run():
        say_at = since + after_s
        while not dist.is_initialized():
            if own is not None:  # rank 0: where its store listens, again and again (_port_of_this_attempt)
                try:
                    agent.set("deeplab/store", str(own.port))
                except Exception as error:  # torchrun has ended: no peer it started comes, none it did not will
                    _say(f"{env.program}: error: rank 0: torchrun's store at {env.master} stopped answering while "
                         f"the process group formed ({first_line(error)}): torchrun has ended; start the job again")
                    os._exit(1)  # (init_process_group waits in torch's C++: this thread ends the process)
            if stopping.wait(0.2):
                return
            if time.time() >= say_at and (env.rank == 0 or env.local_rank == 0):
                _say(f"{env.program}: rank {env.rank}: waiting {time.time() - since:.0f} s for the "
                     f"{env.world_size} processes to meet at {env.master} (the process group); it gives up at "
                     f"{gives_up} (--dist-timeout {minutes:g} min)")
                say_at += every_s
        rank, world_size = get_rank(), get_world_size()
        try:
            store = _group_store()
            beat["group"] = _agree_on_a_name(store)
        except Exception:  # the store is gone already: the job is ending
            return
        while not stopping.is_set() and dist.is_initialized():
            _write_beat(beat["group"], rank)
            if store is not None and len(_read_beats(beat["group"])) < world_size:  # for a rank of another node
                try:
                    store.set(f"deeplab/heartbeat/{rank}", f"{time.time()} {RUN.stops.steps}")
                except Exception:  # the store is gone (rank 0 with it?): the files go on
                    store = None
            stopping.wait(HEARTBEAT_S)
        if stopping.is_set():  # a run that ends as it should takes its file away (a killed one's: _agree_on_a_name)
            with suppress(OSError, TypeError):  # (TypeError: no folder)
                os.remove(os.path.join(_peers_folder(), f"{beat['group']}.{rank}"))

    thread = threading.Thread(target=run, daemon=True, name="peers")
    thread.start()
    RUN.guard.heartbeat = (thread, stopping, beat)
    if agent is not None and own is None:
        os.environ["MASTER_PORT"] = str(_port_of_this_attempt(agent, since + minutes * 60))


def _check_gloo_interfaces():
    """GLOO_SOCKET_IFNAME as torch 2.14 reads it for a gloo group (test_forming tries each case on torch): a value of
    two characters or more, split at commas (an empty last piece left out), each piece an interface of this machine;
    else init_process_group ends in gloo's traceback on every rank. Said by each node's first rank, before any wait;
    torchrun's restarts end quietly on its record (_exit_or_clear_stop_record)."""
    value, here = os.environ.get("GLOO_SOCKET_IFNAME", ""), [name for _, name in socket.if_nameindex()]
    wrong = [name for name in value.removesuffix(",").split(",") if name not in here]
    backend = getattr(RUN.guard.args, "dist_backend", None) or ("nccl" if torch.cuda.is_available() else "gloo")
    if len(value) > 1 and wrong and (RUN.guard.program != "main.py" or backend == "gloo"):  # (predict.py: gloo)
        raise UserError(f"GLOO_SOCKET_IFNAME={value!r} names {wrong[0]!r}, no network interface of this machine (it "
                        f"has {', '.join(here)}): set it to the one the ranks reach each other through (a "
                        "comma-separated list for several), or unset it", this_rank=job.env().local_rank == 0)


def _meet_at_a_store_of_this_attempt():
    """torchrun's agent serves the store init_process_group meets at (TORCHELASTIC_USE_AGENT_STORE=True). In torch
    2.14 it is one server for all the job's attempts (DynamicRendezvousHandler.next_rendezvous), and the ranks' keys
    keep their names. So a restarted rank can read an address of the attempt before: its connect is refused, or it
    waits for a rank that is gone (pytorch/pytorch#135712). Instead rank 0 serves a store of this attempt's own, as
    under run.sh (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). It writes its port into the agent's store while the group
    forms (start_heartbeat), and the others read it there (_port_of_this_attempt). -> (the agent's store, rank 0's
    own store), or (None, None) where the agent serves none, or where torchrun restarts nothing (--max-restarts 0,
    its default): then no earlier attempt left an address, and the group meets at MASTER_PORT as torchrun says."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or \
            os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return None, None
    agent, own = _group_store(), None
    if get_rank() == 0:
        own = dist.TCPStore(os.environ["MASTER_ADDR"], 0, is_master=True, wait_for_workers=False, multi_tenant=True)
        os.environ["MASTER_PORT"] = str(own.port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # init_process_group: rank 0 serves, the others connect
    return agent, own


def _port_of_this_attempt(agent, deadline):
    """The port of rank 0's store, from the agent's: the value an earlier attempt's rank 0 left is removed first,
    and this attempt's writes it again every 0.2 s until the group has formed. The agent's store gone (its torchrun
    has ended), or no port by the deadline: a DistError, said as ranks that did not meet (_did_not_meet)."""
    agent.delete_key("deeplab/store")
    while not agent.check(["deeplab/store"]):
        if time.time() > deadline:
            raise dist.DistError("no word from rank 0 of this attempt in torchrun's store")
        time.sleep(0.1)
    return int(agent.get("deeplab/store").split()[0])


def stop_heartbeat():
    RUN.guard.waiting_since = None  # (the group formed long ago, or never will: guard's "did not meet" no longer)
    if RUN.guard.heartbeat is not None:
        thread, stopping, _ = RUN.guard.heartbeat
        stopping.set()
        thread.join(timeout=10)
        RUN.guard.heartbeat = None


def _peers_folder():
    """Where the ranks of this node write their heartbeats: run.sh's own folder for this run (it removes it when it
    ends), else this user's own in the machine's temporary folder (paths.private_folder); None where there is none."""
    if job.env().stop_file:
        return os.path.dirname(job.env().stop_file)
    return paths.private_folder()


def _agree_on_a_name(store):
    """A name for this process group's heartbeat files, new for each group, which every rank reads from its store:
    files an earlier run left in the folder (a rank killed there) are never taken for this one's. Those whose
    process is gone are removed."""
    key = "deeplab/heartbeat/name"
    if get_rank() == 0:
        store.set(key, f"{os.getpid()}-{time.time_ns()}")
        _remove_files_of_the_gone()
    store.wait([key], timedelta(seconds=60))
    return store.get(key).decode()


def _write_beat(group, rank):
    """This rank's heartbeat file, written whole (replaced): its process, host, the time, steps done."""
    beat = f"{os.getpid()} {socket.gethostname()} {time.time()} {RUN.stops.steps}"
    with suppress(OSError, TypeError):  # (TypeError: no folder to write it in; the store alone tells of this rank)
        paths.write_atomically(os.path.join(_peers_folder(), f"{group}.{rank}"), beat.encode(), durable=False)


def _read_beats(group):
    """{rank: (process id, seconds since its last beat, steps done)} of the ranks of this group on this node."""
    return {int(name.split(".")[1]): beat for name, beat in _beat_files() if name.split(".")[:-1] == [group]}


def _beat_files():
    """[(file name, (process id, seconds since its last beat, steps done))] of the heartbeat files of this machine in
    _peers_folder (and of their writes' temporary files; not run.sh's stop file, which holds no beat)."""
    beats, here, now, folder = [], socket.gethostname(), time.time(), _peers_folder()
    try:
        names = os.listdir(folder) if folder else []
    except OSError:
        names = []
    for name in names:
        with suppress(OSError, ValueError):  # replaced or removed meanwhile; not a heartbeat file
            with open(os.path.join(folder, name)) as f:
                pid, host, stamp, steps = f.read().split()
            if host == here:
                beats.append((name, (int(pid), now - float(stamp), int(steps))))
    return beats


def _process_state(pid):
    """What a peer's process is: "gone" (no such process, or one that has ended and waits for its parent to reap
    it), "stopped" (SIGSTOP, a debugger), or "running"."""
    fields = paths.process_stat(pid)
    if not fields:
        try:
            os.kill(pid, 0)  # (no /proc: a process that is there answers)
        except ProcessLookupError:
            return "gone"
        except OSError:
            pass
        return "running"
    state = fields[0]
    return "gone" if state in ("Z", "X") else "stopped" if state in ("T", "t") else "running"


def _remove_files_of_the_gone():
    """Heartbeat files of this machine whose process is gone: what killed ranks of earlier runs left."""
    for name, (pid, _, _) in _beat_files():
        if _process_state(pid) == "gone":
            with suppress(OSError):  # gone already
                os.remove(os.path.join(_peers_folder(), name))


def _group_store():
    """A connection of this process's own to the store at MASTER_ADDR:MASTER_PORT, where init_process_group's env://
    rendezvous meets (rank 0 serves it) or, before that, torchrun's agent serves its own. Through torch's public
    TCPStore, not the group's own connection, which torch keeps private. Its 5 s timeout holds for each call too (the
    launcher may be tearing the store down: do not wait on it)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=5), wait_for_workers=False)


def _did_not_meet(error):
    """init_process_group gave up (the store says how many came), the address is not there, or rank 0 could not
    listen at MASTER_PORT (another program, or another run, holds it)."""
    env = job.env()
    waited = time.time() - (RUN.guard.waiting_since or time.time())
    if "EADDRINUSE" in str(error):
        return (f"MASTER_PORT {env.master.rsplit(':', 1)[-1]} is taken on this machine by another program (another "
                "run?): give another MASTER_PORT, or end the other; torchrun --standalone finds a free port itself")
    return (f"the {env.world_size} processes did not all meet at {env.master} within {waited:.0f} s "
            f"({first_line(error)}): start every rank, 0 to WORLD_SIZE-1, with the same MASTER_ADDR and MASTER_PORT, "
            "reachable from each (a firewall, another network interface?)")


def describe_peers():
    """Which rank a failed collective lost: one line. The ranks of this node from their files, as their processes
    are (gone, stopped, running); the others from their beats in the group's store, as far as it answers."""
    now = time.time()
    here = _read_beats(RUN.guard.heartbeat[2]["group"]) if RUN.guard.heartbeat else {}  # (no group yet: none)
    for _ in range(10):  # a killed peer's sockets close before its process has ended: give that a second
        states = {rank: "running" if rank == get_rank() else _process_state(beat[0]) for rank, beat in here.items()}
        if set(states.values()) != {"running"}:
            break
        time.sleep(0.1)
    steps, said = {rank: step for rank, (_, _, step) in here.items()}, []  # said: (its kind's place, rank, words)
    for rank, (_, age, _) in here.items():
        if states[rank] == "gone":
            said.append((0, rank, f"rank {rank}'s process is gone (killed, or it failed: its own lines say which)"))
        elif states[rank] == "stopped":
            said.append((1, rank, f"rank {rank} silent for {age:.0f} s (its process is stopped: SIGSTOP, or a "
                                  "debugger)"))
        elif age > 3 * HEARTBEAT_S:
            said.append((2, rank, f"rank {rank} silent for {age:.0f} s (alive, but hung)"))
    others, store = [r for r in range(get_world_size()) if r not in here], None
    with suppress(Exception):  # no answer: said below
        store = _group_store() if others else None
    for rank in others if store is not None else []:
        with suppress(Exception):
            if store.check([f"deeplab/heartbeat/{rank}"]):
                stamp, step = store.get(f"deeplab/heartbeat/{rank}").decode().split()
                steps[rank], age = int(step), now - float(stamp)
                if age > 3 * HEARTBEAT_S:
                    said.append((2, rank, f"rank {rank} silent for {age:.0f} s (stopped, killed, or cut off)"))
    parts = [words for _, _, words in sorted(said)]
    if others and store is None:  # rank 0's process serves the store: gone, unless it is seen here
        blame = "" if 0 in here else ": rank 0 is gone, or its node cut off"
        parts.append(f"rank(s) {others} not heard from (the process group's store, which rank 0's process serves, "
                     f"does not answer{blame})")
    else:
        parts += [f"rank {r} never reported" for r in others if r not in steps]
    if parts:
        return ", ".join(parts)
    if len(set(steps.values())) > 1:
        low = min(steps.values())
        behind = [r for r, step in steps.items() if step == low]
        return f"rank(s) {behind} behind at step {low}, others at {max(steps.values())} (stuck in their own work)"
    return "every rank alive and at the same step: a rank is stuck inside a collective, or the network failed"
