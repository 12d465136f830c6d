"""Surviving faults, out of main.py's way: who speaks, one-line errors, signals, a lost peer, checkpoints.

main.py calls it in a few places:

    @recovery.guarded                            # main(args) inside guard(): a mistake -> one line, a lost
    def main(args): ...                          # peer -> which rank, exit 1
        recovery.fail("...")                     # a mistake every rank finds the same way: rank 0 says it
        recovery.install_signal_handlers()       # SIGTERM / Ctrl-C: finish the step, save, exit 0
        recovery.start_heartbeat()               # lets a rank name the peer it lost
        position, path = recovery.resume(...)    # --resume PATH|auto
        recovery.save_checkpoint(state, path, keep_previous=True)

A mistake the user can fix ends with `main.py: error: ...` on one line, said by the rank that met it, once:
under torchrun a restarted worker does not repeat it (a restart is for a lost process or peer, not for a
bad file). Only global rank 0 logs progress and writes files.
"""
import functools
import json
import os
import shutil
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
from torch.utils.data.distributed import DistributedSampler

from dataset import BadInput, Cityscapes

# This module's state, in one place: set by main.py and the signal handler, read by the heartbeat.
_state = SimpleNamespace(quiet=False, signal=None, signal_time=0.0, step=0, output_dir=None,
                         started=time.time(), heartbeat=None)


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


class UserError(Exception):
    """A mistake the user can fix. this_rank=False: every rank finds it the same way (a flag, the data folder,
    a checkpoint), and rank 0 says it; True: only this rank meets it (its GPU), and this rank says it."""

    def __init__(self, message, this_rank=False):
        super().__init__(message)
        self.this_rank = this_rank


def fail(message, this_rank=False):
    raise UserError(str(message), this_rank)


def _one_line(error):
    """The message of a BadInput, also when a DataLoader worker raised it (then it is wrapped in the
    worker's traceback, and the message is its last line)."""
    lines = str(error).rstrip().splitlines() or [type(error).__name__]
    return lines[-1].split("BadInput: ", 1)[-1]


# --- the run, and how it ends ---------------------------------------------------------------------------
@contextmanager
def guard(output_dir):
    """Around main.py's run: every way it can end becomes exit 0, or one line and exit 1.

    - UserError (fail()): rank 0 prints it; every rank found it.
    - BadInput raised while training (a damaged file whose header was fine): the rank that read it prints
      it, whichever that is, and records it so that the peers waiting for this rank stay quiet and a
      torchrun restart does not repeat it.
    - A failed or timed-out collective: each waiting rank names the rank at fault from the heartbeats.
    Anything else is a bug, not a mistake: its traceback is kept.
    """
    _state.output_dir = output_dir
    _exit_if_stopped_before()
    try:
        yield
    except UserError as error:
        if error.this_rank and get_world_size() > 1:
            _stop(f"rank {get_rank()}: {error}", say_it=True)
        _stop(str(error), say_it=is_main_process())
    except BadInput as error:
        prefix = f"rank {get_rank()}: " if get_world_size() > 1 else ""
        _stop(prefix + _one_line(error), say_it=True)
    except Exception as error:
        if not (dist.is_initialized() and is_collective_failure(error)):
            raise
        if _peer_stopped_on_a_mistake():
            os._exit(1)  # the rank that met it said why; not sys.exit: a broken process group can hang
        print(f"main.py: error: rank {get_rank()}: a collective failed or waited more than --dist-timeout "
              f"({_one_line(error)[:160]}). {describe_peers()}. The last checkpoint: "
              f"{os.path.join(output_dir, 'checkpoint.pth')}; restart with --resume auto", file=sys.stderr, flush=True)
        os._exit(1)


def guarded(main):
    """main(args), run inside guard(args.output_dir)."""
    @functools.wraps(main)
    def run(args):
        with guard(args.output_dir):
            return main(args)
    return run


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
    return [os.path.join(_state.output_dir, ".stopped.json"),
            os.path.join(tempfile.gettempdir(), f"deeplab-stopped-{run_id}.json")]


def _stop(message, say_it):
    """Say the one line, record it for the peers and for torchrun's restarts, exit 1."""
    if say_it:
        print(f"main.py: error: {message}", file=sys.stderr, flush=True)
        if get_world_size() > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
            record = {"run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""), "time": time.time(), "message": message}
            for path in _stop_files():
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    _write_atomically(path, json.dumps(record).encode())
                    break
                except OSError:
                    pass  # nowhere to write: restarts may repeat the line, nothing worse
    if dist.is_initialized() and get_world_size() > 1:
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
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


def _on_signal(signum, frame):
    if _state.signal is None:
        _state.signal, _state.signal_time = signum, time.time()
    elif time.time() - _state.signal_time > 1.0:  # a second signal (not a copy of the first, which a
        signal.signal(signum, signal.SIG_DFL)     # scheduler and a launcher may both send): stop now
        os.kill(os.getpid(), signum)


def stop_signal():
    """The signal that asked this process to stop, or None."""
    return _state.signal


def ignore_sigint(worker_id):
    """DataLoader workers' init: a Ctrl-C in a terminal reaches every process of the group, the workers too;
    they leave it to the training process, which must still read the batch in flight. (SIGTERM stays fatal
    for them: multiprocessing uses it to end them when the training process exits.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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


# --- checkpoints ------------------------------------------------------------------------------------------
def previous_path(path):
    """checkpoint.pth -> checkpoint.prev.pth, in the same folder (the folder's own name is left alone)."""
    stem, extension = os.path.splitext(path)
    return stem + ".prev" + extension


def _write_atomically(path, data, before_rename=None):
    """Write a temporary file, fsync, rename over path: a crash mid-write leaves the old file whole, and a
    failed write (a full disk) leaves no half file behind. data: bytes, or a function that writes to a file."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            data(f) if callable(data) else f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(directory)  # the rename itself survives a power cut
    os.close(directory)


def save_checkpoint(state, path, keep_previous=False):
    """Written atomically. keep_previous: the checkpoint it replaces stays as *.prev.pth, a fallback. A write
    that fails (a full disk) leaves the previous checkpoint as it was and ends the run in one line."""
    def keep_previous_one():
        if os.path.isfile(path):
            previous = previous_path(path)
            if os.path.exists(previous):
                os.remove(previous)
            os.link(path, previous)  # a second name for the old file: path exists throughout

    try:
        _write_atomically(path, lambda f: torch.save(state, f), keep_previous_one if keep_previous else None)
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
        folder = os.path.dirname(os.path.abspath(path))
        kept = f"{path} is the last one written" if os.path.isfile(path) else "no checkpoint was kept"
        fail(f"cannot write {path} ({getattr(error, 'strerror', None) or _one_line(error)[:100]}; "
             f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB free there): {kept}. Free space, then resume "
             "with --resume auto")


TRAINING_STATE = ("optimizer", "scaler", "epoch", "world_size", "batch_size")  # what resuming training needs


def read_checkpoint(path):
    """-> (checkpoint dict with at least "model", None) or (None, why it cannot be used). A bare state dict
    (weights only, as torch.save(model.state_dict()) writes) is taken as {"model": it}."""
    try:
        # map_location="cpu": otherwise every rank loads onto the GPU the checkpoint was saved from
        # (rank 0's), and that GPU holds a copy per rank. weights_only=True: a checkpoint is data, not code.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        return None, f"cannot be read ({_one_line(error)[:150]}): truncated or not a checkpoint"
    if isinstance(checkpoint, dict) and checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        checkpoint = {"model": checkpoint}
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict):
        return None, "holds no model weights (no 'model' state dict): it is not a checkpoint of main.py"
    return checkpoint, None


def find_checkpoint(resume, output_dir, evaluate=False):
    """--resume PATH: that file, or a clear error. --resume auto: output_dir/checkpoint.pth, else the one
    before it; with neither there, a fresh start (but -e has nothing to evaluate). A file there that cannot
    be read, with no usable one before it, stops the run: those files are evidence, not to be replaced.
    -> (checkpoint, path) or (None, "")."""
    if resume != "auto":
        if not os.path.isfile(resume):
            fail(f"--resume {resume}: no such file")
        checkpoint, problem = read_checkpoint(resume)
        if problem:
            fail(f"--resume {resume} {problem}")
        return checkpoint, resume
    problems = []
    for name in ("checkpoint.pth", "checkpoint.prev.pth"):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            checkpoint, problem = read_checkpoint(path)
            if checkpoint is not None:
                if problems:
                    log(f"warning: {problems[0]}; using the one before it, {path}")
                return checkpoint, path
            problems.append(f"{path} {problem}")
    if problems:
        fail(f"--resume auto: {'; '.join(problems)}. Nothing usable to resume from, and these files are kept: "
             "move them aside to start afresh, or give --resume a good checkpoint")
    if evaluate:
        fail(f"-e --resume auto: no checkpoint in {output_dir} to evaluate; give --resume PATH")
    log(f"no checkpoint in {output_dir}: starting afresh")
    return None, ""


def classes_of(checkpoint):
    """The class names a checkpoint was trained for: main.py saves them; one saved before it did was trained
    on Cityscapes; weights alone (a bare state dict) do not say (None)."""
    if "classes" in checkpoint:
        return list(checkpoint["classes"]["names"])
    return list(Cityscapes.classes["names"]) if "args" in checkpoint else None


def _check_model_name(checkpoint, flag, path, model_name):
    saved = checkpoint.get("args", {}).get("model")
    if saved and saved != model_name:
        fail(f"{flag} {path} holds a {saved} model, but this run builds {model_name}: pass --model {saved}")


def _load_fitting(model, weights, flag, path, model_name):
    """Load weights that must fit the model exactly; else one line that says how they differ."""
    own = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in weights.items()
             if k in own and v.shape != own[k].shape]
    missing, unexpected = own.keys() - weights.keys(), weights.keys() - own.keys()
    if wrong or missing or unexpected:
        fail(f"{flag} {path} does not fit {model_name}: {len(wrong)} tensors of another shape (e.g. {wrong[:1]}), "
             f"{len(missing)} missing, {len(unexpected)} unexpected")
    model.load_state_dict(weights)


def load_model_state(model, checkpoint, path, model_name, classes):
    """--resume: the model of the run to continue or evaluate, trained for the classes of --data."""
    _check_model_name(checkpoint, "--resume", path, model_name)
    theirs = classes_of(checkpoint)
    if theirs is not None and theirs != list(classes["names"]):
        fail(f"--resume {path} was trained for {len(theirs)} classes ({', '.join(theirs[:3])}, ...), but --data has "
             f"{len(classes['names'])} others ({', '.join(classes['names'][:3])}, ...): use the model on its own "
             f"data, or fine-tune it on this data with --weights {path}")
    _load_fitting(model, checkpoint["model"], "--resume", path, model_name)


def load_weights(model, path, model_name, classes):
    """--weights: start from a trained model (fine-tuning). A classifier trained for other classes (another
    number, or other names) is left as built, freshly initialised, and a line says so; the rest must fit."""
    if not os.path.isfile(path):
        fail(f"--weights {path}: no such file")
    checkpoint, problem = read_checkpoint(path)
    if problem:
        fail(f"--weights {path} {problem}")
    _check_model_name(checkpoint, "--weights", path, model_name)
    weights, own = dict(checkpoint["model"]), model.state_dict()
    theirs = classes_of(checkpoint)
    head = [key for key in ("classifier.weight", "classifier.bias") if key in weights and key in own]
    if any(weights[key].shape != own[key].shape for key in head) or theirs not in (None, list(classes["names"])):
        before = f"{len(theirs)} classes ({', '.join(theirs[:3])}, ...)" if theirs else "other classes"
        for key in head:
            weights[key] = own[key]
        log(f"--weights {path}: its classifier, trained for {before}, does not fit the {len(classes['names'])} "
            f"classes of --data and starts afresh; every other layer starts from {path}")
    else:
        log(f"--weights {path}: every layer starts from it")
    _load_fitting(model, weights, "--weights", path, model_name)


def resume(args, model, optimizer, scaler, world_size, classes):
    """--resume PATH|auto (or none): load the model and, when training, the optimizer, GradScaler and position.
    -> ({"epoch", "step", "best_miou", "epoch_loss_sum"}, the checkpoint's path or "")."""
    position = {"epoch": args.start_epoch, "step": 0, "best_miou": float("-inf"), "epoch_loss_sum": 0.0}
    checkpoint, path = find_checkpoint(args.resume, args.output_dir, args.evaluate) if args.resume else (None, "")
    if checkpoint is None:
        return position, ""
    load_model_state(model, checkpoint, path, args.model, classes)
    if args.evaluate:  # the weights are all -e needs
        return position, path
    if args.start_epoch and args.resume != "auto":
        fail(f"--start-epoch {args.start_epoch} with --resume: {path} says where to start (epoch "
             f"{checkpoint.get('epoch', '?')}); drop --start-epoch")
    if args.start_epoch:  # --resume auto (run.sh, a restart): the checkpoint wins, and that is said
        log(f"note: --start-epoch {args.start_epoch} is ignored: {path} says where to continue")
    missing = [key for key in TRAINING_STATE if key not in checkpoint]
    if missing:
        fail(f"--resume {path} holds no {', '.join(missing)}: it has weights only (evaluate it with -e); to "
             "continue training, resume a checkpoint.pth that main.py wrote")
    where = f"epoch {checkpoint['epoch']}" + (f" step {checkpoint['step']}" if checkpoint.get("step") else "")
    log(f"resuming from {path} at {where}, best mIoU {checkpoint.get('best_miou', float('nan')):.4f}")
    optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint["scaler"] and scaler.is_enabled():  # empty when saved without --amp fp16
        scaler.load_state_dict(checkpoint["scaler"])
    position = {key: checkpoint.get(key, default) for key, default in position.items()}
    position["epoch"] = checkpoint["epoch"]
    before = (checkpoint["world_size"], checkpoint["batch_size"])
    if before != (world_size, args.batch_size):
        # Another order of images: finish the epoch from the same number of images seen.
        position["step"] = position["step"] * before[0] * before[1] // (world_size * args.batch_size)
        log(f"note: the checkpoint was trained with {before[0]} process(es) x {before[1]} images; this run has "
            f"{world_size} x {args.batch_size}. It continues at the same epoch and learning-rate position, but "
            "not bitwise as an uninterrupted run would")
    return position, path


class ResumableSampler(DistributedSampler):
    """PyTorch's DistributedSampler, able to begin an epoch part-way: a run resumed in the middle of an epoch
    skips the batches it has seen (set `skip` to their number of samples), through the same DataLoader and
    its persistent workers. The order is DistributedSampler's own, so the rest is what the stopped run
    would have seen."""
    skip = 0

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.skip:])

    def __len__(self):
        return super().__len__() - self.skip


def trim_metrics(path, epoch):
    """Cut metrics.jsonl back to the epochs before `epoch`: a resumed run writes the later ones again."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["epoch"] < epoch:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                pass  # a line cut short by a crash: it belonged to the epoch being redone
    _write_atomically(path, "".join(kept).encode())
