"""This process's place in the job, read once from what started it (torchrun, torch.distributed.launch, run.sh, or
nothing), and who speaks: the harness's one source for both. main.py's lesson reads what it needs itself. And RUN,
the one object that holds a run's state: everything the harness remembers while a program runs.

    job.read_environment("main.py")   # at the start of a run (recovery.guard): every variable checked, once
    job.get_rank(), job.get_world_size(), job.is_main_process()   # the process group's, or before it the launcher's
    job.env().restarts, .run_id, .under_run_sh, .stop_file         # what torchrun and run.sh told this process
    job.log("...")                    # rank 0 alone prints; silent with --check-only (which prints its lines itself)
    job.named("--output-dir")         # a flag as the user typed it: OUTPUT_DIR under run.sh
    job.checkpoint_path()             # OUTPUT_DIR/checkpoint.pth
    job.resume_advice()               # how to carry on a stopped run, in the user's own terms
    job.global_batch(args)            # -b x processes x --accum-steps
    job.RUN.stops.signal              # a run's state, a field per concern (Run, below)
"""
import os
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from .errors import fail


@dataclass(frozen=True)
class Environment:
    """What the launcher and run.sh set, checked. distributed: RANK and WORLD_SIZE are set (a launcher started this
    process: it joins a process group, even as the only one)."""
    program: str = "main.py"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    distributed: bool = False
    master: str = "?:?"                 # MASTER_ADDR:MASTER_PORT
    restarts: int = 0                   # TORCHELASTIC_RESTART_COUNT: torchrun's restarts after a failure
    run_id: str | None = None           # TORCHELASTIC_RUN_ID: --standalone: a new random id per job; else --rdzv-id
                                        # (torchrun's default "none", run.sh's "deeplab"), which later jobs may repeat
    under_run_sh: bool = False          # DEEPLAB_RUN_SH=1: the user typed ./run.sh and its variables
    stop_file: str | None = None        # DEEPLAB_STOP_FILE: where run.sh writes the first stop signal's name


# --- a run's state ----------------------------------------------------------------------------------------------
@dataclass
class Command:
    """What this run's command says that advice must not repeat (a --resume PATH, --overwrite), where it writes, and
    whether it speaks (--check-only says only a mistake, or that there is nothing left to train)."""
    resume: str | None = None           # "--resume PATH", for a PATH (not for auto)
    overwrite: str | None = None        # "--overwrite", when given
    quiet: bool = False
    output_dir: str = "output"


@dataclass
class Guard:
    """What recovery.guard knows of the program it runs: to say how the run ended, and the heartbeat's thread."""
    program: str = "main.py"
    args: object = None                 # the program's flags, for the line about a mistake or running out of memory
    output_dir: str | None = None       # main.py's --output-dir, where a mistake is recorded for the peers (else none)
    started: float = field(default_factory=time.time)
    heartbeat: tuple | None = None      # (thread, the event that stops it, its group): recovery.start_heartbeat
    waiting_since: float | None = None  # when this rank began to wait for the process group to form


@dataclass
class Stops:
    """What stops.py knows of stopping: the signal seen, the ranks' vote, a file rank 0 could not write."""
    signal: int | None = None           # the first stop signal this process received
    signal_time: float = 0.0            # when (a second one, a second or more later, stops at once)
    handlers: dict | None = None        # a training run's: the stop signals' handlers before it, for restore()
    vote: object = None                 # the stops.StopVote of this epoch's steps, made at its first step
    decision: str | None = None         # the epoch's first decision to stop: "signal" or "nonfinite"
    steps: int = 0                      # optimizer steps voted on, for the heartbeat
    phase: str | None = None            # where a training run is: a key of stops.PHASES (stops.enter)
    problem: str | None = None          # the line of a file rank 0 could not write, until the ranks stop on it


@dataclass
class Records:
    """What records.py keeps while a run writes its records."""
    writer: object = None               # TensorBoard's SummaryWriter (rank 0, with --tensorboard)
    estimated: bool = False             # the time left was said, once, after the first epoch that trained a step
    lost_predictions: list | None = None  # [the first OSError, how many predictions were lost]: watch_predictions


@dataclass
class Run:
    """A run's state, all of it: a field per concern, each written by the module named beside it alone, and read as
    job.RUN.<field>. begin_run() sets every field afresh where a run starts (recovery.guard), so that a second run
    in one process (the tests', or a process forked from one that ran) starts clean; `unchecked` alone lasts the
    process. Every other module-level name of the harness is a constant."""
    env: Environment = field(default_factory=Environment)  # job.read_environment (recovery.guard, first thing)
    command: Command = field(default_factory=Command)      # job.remember_command (the preflight)
    guard: Guard = field(default_factory=Guard)            # recovery.py
    stops: Stops = field(default_factory=Stops)            # stops.py (afresh in stops.install)
    start: object = None                                   # preflight.py: checkpoints.Start, where the run starts
    held: list = field(default_factory=list)               # paths.py: [(descriptor, lock file, folders made for it)]
    weights: dict = field(default_factory=dict)            # checkpoints.py: {path: checkpoint}, --weights read once
    unchecked: set = field(default_factory=set)            # checkpoints.py: files without CRC-32s, said once each
    verified: dict = field(default_factory=dict)           # checkpoints.py: {path: what os.stat said as read() began}
    train_list: dict | None = None                         # checkpoints.py: the training list, in every checkpoint
    records: Records = field(default_factory=Records)      # records.py


RUN = Run()  # never replaced itself, only its fields: `from .job import RUN` is this process's run from anywhere


def begin_run():
    """The one reset: every field of RUN as a new process has it, but `unchecked`, which lasts the process. Called
    where a run starts (recovery.guard, before anything else) and by the tests before each test, once what an
    earlier run left holding (signal handlers, the heartbeat, TensorBoard's writer, the output folder) is let go."""
    fresh = Run(unchecked=RUN.unchecked)
    for name in vars(fresh):
        setattr(RUN, name, getattr(fresh, name))


def _whole_number(name, default, low=0, high=None, advice="set it as a launcher does (torchrun sets RANK, "
                  "WORLD_SIZE and LOCAL_RANK itself), or unset it", listed=False):
    """The environment variable name as a whole number in [low, high] (default when it is not set); else one line
    that names it, its value and what to set. listed: the first of a comma-separated list (OMP_NUM_THREADS's
    nested levels)."""
    text = os.environ.get(name)
    if text is None:
        return default
    digits = (text.split(",")[0] if listed else text).strip()
    value = int(digits) if digits.isascii() and digits.isdecimal() else None
    if value is None or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        fail(f"the environment variable {name}={text!r} is not a whole number {bound}: {advice}")
    return value


def read_environment(program="main.py"):
    """Read and check the variables the program uses, once for this run: the launcher's, run.sh's, and
    OMP_NUM_THREADS, which torch reads (TMPDIR: harness.check_temporary_folder, at import). A bad value, or a
    launcher's variables that cannot make a process group (RANK without WORLD_SIZE, RANK past WORLD_SIZE, no
    MASTER_ADDR or MASTER_PORT), ends in one line."""
    RUN.env = Environment(program=program)  # what is known so far, for the line a bad variable ends in
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world_size = _whole_number("RANK", 0), _whole_number("WORLD_SIZE", 1, low=1)
    if ("RANK" in os.environ) != ("WORLD_SIZE" in os.environ):
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in os.environ else ("WORLD_SIZE", "RANK")
        fail(f"{given} is set but {missing} is not: a process group needs both (or neither, for one plain process)")
    if rank >= world_size:
        fail(f"RANK={rank} but WORLD_SIZE={world_size}: ranks are numbered 0 to WORLD_SIZE-1")
    for name in ("MASTER_ADDR", "MASTER_PORT") if distributed else ():
        if not os.environ.get(name):
            fail(f"RANK and WORLD_SIZE are set but {name} is not: set MASTER_ADDR and MASTER_PORT to where rank 0 "
                 "listens (a free port there: 29500, say), or start the program with torchrun, which sets them")
    if distributed:
        _whole_number("MASTER_PORT", None, 1, 65535, "set it to a free port on rank 0's machine (29500, say)")
    # torch's threads: libgomp only warns of a bad value, and takes every core
    _whole_number("OMP_NUM_THREADS", None, 1, advice="set the threads each process may use (the machine's cores "
                  "over the processes), or unset it", listed=True)
    _whole_number("LOCAL_WORLD_SIZE", None, 1)  # (main.default_workers divides the cores by it)
    RUN.env = Environment(
        program=program, rank=rank, world_size=world_size, local_rank=_whole_number("LOCAL_RANK", 0),
        distributed=distributed, master=f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}",
        restarts=_whole_number("TORCHELASTIC_RESTART_COUNT", 0), run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
        under_run_sh=os.environ.get("DEEPLAB_RUN_SH") == "1", stop_file=os.environ.get("DEEPLAB_STOP_FILE") or None)
    return RUN.env


def env():
    return RUN.env


def get_rank():
    """The global rank: the process group's, or before it exists the launcher's RANK (0 without a launcher)."""
    return dist.get_rank() if dist.is_initialized() else RUN.env.rank


def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else RUN.env.world_size


def is_main_process():
    """Global rank 0, not local rank 0: with several nodes that would be one per node."""
    return get_rank() == 0


def log(*message):
    if is_main_process() and not RUN.command.quiet:
        print(*message, flush=True)


def remember_command(args, quiet=False):
    """RUN.command from the flags (Command)."""
    RUN.command = Command(
        resume=f"--resume {args.resume}" if getattr(args, "resume", "") not in ("", "auto") else None,
        overwrite="--overwrite" if getattr(args, "overwrite", False) else None, quiet=quiet,
        output_dir=getattr(args, "output_dir", "output"))


def checkpoint_path(output_dir=None):
    """The run's checkpoint, OUTPUT_DIR/checkpoint.pth: the one place the harness makes its name."""
    return os.path.join(output_dir or RUN.command.output_dir, "checkpoint.pth")


def named(flag):
    """A flag as the user set it, for advice: under run.sh the user typed the variables OUTPUT_DIR and DATA, not the
    flags run.sh made of them."""
    return {"--output-dir": "OUTPUT_DIR", "--data": "DATA"}.get(flag, flag) if RUN.env.under_run_sh else flag


def resume_advice():
    """How to carry on a stopped run, as the user started it: without --overwrite (it would put the run aside)
    and without a --resume PATH (it would start from that file again, not from where the run stopped)."""
    resume, overwrite = RUN.command.resume, RUN.command.overwrite
    if RUN.env.under_run_sh:
        drop = " and ".join(flag for flag in (resume, overwrite) if flag)
        return "run the same ./run.sh line again" + (f" without {drop}" if drop else "")
    return ("run the same command with --resume auto" + (f" in place of {resume}" if resume else "")
            + (" and without --overwrite" if overwrite else ""))


def global_batch(args, world_size=None):
    """Images per optimizer step over every process: -b x processes x --accum-steps."""
    return args.batch_size * (world_size or get_world_size()) * args.accum_steps
