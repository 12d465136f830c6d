"""The GPU path in one short call (tests/tools/gpu_check.sh runs this): what the CPU suite cannot show, on one GPU.

    bash tests/tools/gpu_check.sh [--out DIR]       # on a GPU machine: within 5 minutes, data included
    bash tests/tools/gpu_check.sh --dry-run         # every step on the CPU at tiny sizes, to prove the script first
    bash tests/tools/gpu_check.sh --plan            # the commands it would run, without running them

Each step writes its result into DIR/gpu_check.json as it ends (a step that fails records false and why, and
the next one runs), and says it in one line. The rates run one at a time, alone; the checks after them time
nothing and run as two chains side by side (fp16 resume, then its ONNX export; preemption, then NaN, then predict):

    device            the GPU, torch, CUDA
    model_only_img_s  bench.py's bare training step at the recipe's sizes (ResNet-101 DeepLabV3+, crop 768,
                      batch 8 a forward as run.sh gives one GPU (-b 8 --accum-steps 2), bf16, channels_last)
    peak_gib_*        the same step's peak memory at other batches and precisions (bf16 -b 4 and 16, fp32 -b 8):
                      the points docs/memory.md estimates
    fp32_img_s, fp32_channels_last_img_s   the bare step in fp32 without and with channels_last (-b 8)
    bucket_*          DDP (one process) with its gradients zeroed in place against set_to_none: step time, peak
    program_img_s, program_data_wait    run.sh's steady steps (after 10 warm-up steps, -p 10) at the same sizes on
                      photo-like 2048x1024 PNGs, default -j; program_vs_model_only: their ratio
    cached_img_s, cached_data_wait      the same from --cache-dir with -j 4
    peak_memory_gib   each rank's, from metrics.jsonl
    resume_ok         --amp fp16 with a GradScaler, resumed (--dry-run: bf16, which the CPU has)
    preempt_ok        SIGTERM to run.sh mid-epoch: exit 0 with a checkpoint, then resumed to the end
    nan_ok            a loss that turns NaN (--lr 1e38, the vote read one step late): exit 1, checkpoint unchanged
    predict_ok        predict.py on the GPU with --amp
    onnx_ok           predict.py --export, run by onnxruntime: PyTorch's logits
"""
import argparse
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
SMALL_MODEL = "deeplabv3plus_mobilenet_v3_large"

# The sizes of each mode. GPU: the recipe for the rates; the small checks on MobileNet, fast but not too fast to
# signal mid-epoch. Dry run: everything tiny, on the CPU.
SIZES = {
    "gpu": dict(frame=(2048, 1024), train=480, val=3, unique=8, recipe=["--amp"], amp="fp16", small=(512, 256),
                small_train=400, small_val=6, small_args=["--crop-size", "256", "-b", "2", "--accum-steps", "1"]),
    # The CPU has bf16, but without native support it is many times slower than float32: the rates run in
    # float32 there, and bf16 stands in for fp16 only in the resume check.
    "dry": dict(frame=(128, 64), train=40, val=2, unique=4, amp="bf16", small=(64, 32), small_train=16, small_val=2,
                recipe=["--model", SMALL_MODEL, "--crop-size", "32", "-b", "2", "--accum-steps", "1"],
                small_args=["--crop-size", "32", "-b", "2", "--accum-steps", "1"]),
}


class Check:
    """The results, written to DIR/gpu_check.json after every step."""

    def __init__(self, out):
        self.out, self.path, self.results, self.failed = out, os.path.join(out, "gpu_check.json"), {}, []
        self.lock = threading.Lock()  # two chains of steps record side by side

    def record(self, **results):
        with self.lock:
            self.results.update(results)
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.results, f, indent=1)
            os.replace(self.path + ".tmp", self.path)

    def step(self, name, function):
        """Run one step; its line on screen; on failure record name: false and why, and go on."""
        start = time.time()
        try:
            said = function()
            self.record(**{f"{name}_s": round(time.time() - start, 1)})
            print(f"gpu_check: {name}: {said} ({time.time() - start:.0f} s)", flush=True)
        except (Exception, SystemExit) as error:  # a failed step is a finding: record it, run the others
            # (SystemExit too: in a chain's thread it would end the chain unseen, and the check would pass)
            with self.lock:
                self.failed.append(name)
            why = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            self.record(**{f"{name}_ok": False, f"{name}_error": str(error)[-2000:]})
            print(f"gpu_check: {name}: FAILED ({why[:300]})", flush=True)

    def side_by_side(self, *chains):
        """Run chains of steps at once, each chain's steps in order: [(name, function)] each."""
        def run_chain(chain):
            for name, function in chain:
                self.step(name, function)

        threads = [threading.Thread(target=run_chain, args=(chain,)) for chain in chains]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


LOG_LOCK = threading.Lock()


def write_log(log, text):
    """Append one command's output to the log whole (two chains write it)."""
    with LOG_LOCK, open(log, "a") as f:
        f.write(text)


def stop(process):
    """A command past its time, or the check itself stopped: SIGTERM twice (run.sh's second one stops torchrun and
    its workers at once; killing run.sh alone would leave them training in a folder a later step uses), then
    whatever is left killed."""
    for wait in (2, 60):
        process.send_signal(signal.SIGTERM)  # (nothing, once it has ended)
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass
    process.kill()


RUNNING = set()  # the commands running now, in both chains: stopped with the check
RUNNING_LOCK = threading.RLock()  # (reentrant: a stop may come while the main thread holds it)
STOPPING = threading.Event()  # set once: no command starts after it
MAIN_STARTING = False  # the main thread is inside start(), holding RUNNING_LOCK
DEFERRED = []  # a stop signal that came meanwhile


def start(command, env=None, **options):
    """A command started in the repository root, and known to _stop_all. A stop while the main thread starts one
    (Python runs signal handlers there, between two steps of Popen too) is acted on once the command is in RUNNING:
    else it would be left running (seen: a synthetic.py). Once the check is stopping, none starts: a chain whose
    step the stop ended would go on to its next step; that chain waits here until the check exits."""
    global MAIN_STARTING
    main = threading.current_thread() is threading.main_thread()
    try:
        with RUNNING_LOCK:
            if main:
                MAIN_STARTING = True
            if not STOPPING.is_set():
                # PYTHON: run.sh's steps, torchrun and its workers run on this check's Python, not on `python` from
                # PATH.
                process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHON": PY, **(env or {})},
                                           **options)
                RUNNING.add(process)
                return process
    finally:
        if main:
            MAIN_STARTING = False
            if DEFERRED:
                _stop_all(DEFERRED[0], None)
    threading.Event().wait()  # never set: os._exit in _stop_all ends this thread with the check


def _stop_all(signum, frame):
    """SIGTERM or Ctrl-C: every command running stopped at once (stop), then the check ends in one line."""
    if MAIN_STARTING:  # in the main thread, interrupting start(): start() calls this again once its command is known
        DEFERRED.append(signum)
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with RUNNING_LOCK:
        STOPPING.set()
        running = [process for process in RUNNING if process.poll() is None]
    threads = [threading.Thread(target=stop, args=(process,)) for process in running]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"gpu_check: stopped by signal {signum}; {len(running)} running command(s) stopped. The results so far "
          "are in gpu_check.json", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def stop_on_signal():
    """SIGTERM or Ctrl-C to the check stops every command it runs (run.sh starts torchrun in a session of its own,
    so a Ctrl-C in the terminal would not reach its workers) and ends it in one line."""
    signal.signal(signal.SIGTERM, _stop_all)
    signal.signal(signal.SIGINT, _stop_all)


def execute(command, env=None, timeout=600):
    """Run a command in the repository root, stopped whole after timeout seconds. -> its CompletedProcess."""
    process = start(command, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process)
        raise
    finally:
        RUNNING.discard(process)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run(command, env=None, log=None, timeout=600):
    """Run a command (execute); its output into the log file; -> its output. Fails on exit != 0."""
    result = execute(command, env, timeout)
    output = result.stdout + result.stderr
    if log:
        write_log(log, f"$ {shlex.join(command)}\n{output}\n")
    if result.returncode:
        raise RuntimeError(f"{shlex.join(command)} exited {result.returncode}: {output[-1500:]}")
    return output


def steady(log_text, warmup_steps=10):
    """(images/s, data wait fraction) over the step lines after the first warmup_steps (windows of -p steps)."""
    windows = [(int(m[1]), float(m[2]), float(m[3]), float(m[4])) for m in re.finditer(
        r"step (\d+)/\d+ loss \S+ lr \S+ ([\d.]+) img/s time ([\d.]+) s \(data ([\d.]+) s\)", log_text)]
    late = [w for w in windows if w[0] > warmup_steps]
    if not late:
        raise RuntimeError(f"no step lines after step {warmup_steps} in the log")
    rate = sum(w[1] for w in late) / len(late)
    return round(rate, 2), round(sum(w[3] for w in late) / sum(w[2] for w in late), 4)


def plan(sizes, tmp, dry):
    """The commands, in order: [(name, command, environment)]. main.py's and predict.py's arguments among them
    are what tests/test_gpu_check.py parses with the programs' own parsers, so that they cannot drift."""
    small, full, cache = (os.path.join(tmp, name) for name in ("small", "full", "cache"))
    cpu = {"CUDA_VISIBLE_DEVICES": "", "NPROC": "1"} if dry else {}
    # The checks run as two chains at once: on the CPU one thread each, or OpenMP's threads spin against each
    # other (the dry run's bf16 resume took 223 s beside the other chain with two threads each, 72-76 s with one).
    checks = {**cpu, "OMP_NUM_THREADS": "1"} if dry else {}
    rate = ["--pretrained-backbone", "none", "--epochs", "1", "-p", "10", *sizes["recipe"]]
    small_run = ["--model", SMALL_MODEL, "--pretrained-backbone", "none", *sizes["small_args"]]
    return [
        ("data small", [PY, "synthetic.py", small, "--num-train", str(sizes["small_train"]), "--num-val",
                        str(sizes["small_val"]), "--size", *map(str, sizes["small"]), "--unique", "8", "-j", "0"], {}),
        ("data full", [PY, "synthetic.py", full, "--num-train", str(sizes["train"]), "--num-val", str(sizes["val"]),
                       "--size", *map(str, sizes["frame"]), "--photo", "--unique", str(sizes["unique"]), "--seed", "1",
                       "-j", str(os.cpu_count())], {}),
        ("buckets", [PY, "bench.py", "--bucket-views", *(["--quick"] if dry else ["--gpu"])],
         {"CUDA_VISIBLE_DEVICES": ""} if dry else {}),
        ("program", ["./run.sh", *rate], {**cpu, "DATA": full, "OUTPUT_DIR": os.path.join(tmp, "o_png")}),
        ("fill cache", [PY, "-m", "harness.cache", cache, "--data", full, "-j", str(os.cpu_count())], {}),
        ("cached", ["./run.sh", *rate, "-j", "4", "--cache-dir", cache],
         {**cpu, "DATA": full, "OUTPUT_DIR": os.path.join(tmp, "o_cache")}),
        ("resume 1", ["./run.sh", *small_run, "-b", "8", "--epochs", "1", "--amp", sizes["amp"], "-p", "50"],
         {**checks, "DATA": small, "OUTPUT_DIR": os.path.join(tmp, "o_resume")}),
        ("resume 2", ["./run.sh", *small_run, "-b", "8", "--epochs", "2", "--amp", sizes["amp"], "-p", "50"],
         {**checks, "DATA": small, "OUTPUT_DIR": os.path.join(tmp, "o_resume")}),
        ("preempt", ["./run.sh", *small_run, "--epochs", "1", "-p", "1"],
         {**checks, "DATA": small, "OUTPUT_DIR": os.path.join(tmp, "o_preempt")}),
        ("preempt resume", ["./run.sh", *small_run, "--epochs", "1", "-p", "50"],
         {**checks, "DATA": small, "OUTPUT_DIR": os.path.join(tmp, "o_preempt")}),
        # The preempted run's checkpoint (its one epoch done) trained on with a loss that turns NaN. MAX_RESTARTS=0:
        # torchrun's restarts after the NaN (which exit at once, silent) cost 8 s each here and prove nothing
        # this check needs; tests/test_recovery.py proves they do not repeat the line.
        ("nan", ["./run.sh", *small_run, "--epochs", "2", "--lr", "1e38", "-p", "50"],
         {**checks, "DATA": small, "OUTPUT_DIR": os.path.join(tmp, "o_preempt"), "MAX_RESTARTS": "0"}),
        ("predict", [PY, "predict.py", "--resume", os.path.join(tmp, "o_preempt", "checkpoint.pth"),
                     os.path.join(small, "leftImg8bit", "val"), "--output-dir", os.path.join(tmp, "predictions"),
                     "--amp", "-j", "2"], {**checks}),
        ("export", [PY, "predict.py", "--resume", os.path.join(tmp, "o_resume", "checkpoint.pth"), "--export",
                    os.path.join(tmp, "model.onnx")], {**checks}),
    ]


def main():
    parser = argparse.ArgumentParser(prog="tests/tools/gpu_check.sh", description="the GPU checks, in one short call")
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU at tiny sizes")
    parser.add_argument("--out", default=None, help="where gpu_check.json and the logs go (default: a new folder)")
    parser.add_argument("--plan", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--first-step-only", action="store_true", help="the device and the data, then stop")
    args = parser.parse_args()
    # (--plan makes no folder: it names the default one DIR)
    out = args.out or ("DIR" if args.plan else tempfile.mkdtemp(prefix="gpu_check-"))
    tmp = os.path.join(out, "work")
    sizes = SIZES["dry" if args.dry_run else "gpu"]
    commands = {name: (command, env) for name, command, env in plan(sizes, tmp, args.dry_run)}
    if args.plan:
        for name, (command, env) in commands.items():
            print(f"{name}: {' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(command)}")
        return
    if os.path.exists(os.path.join(out, "gpu_check.json")):  # an earlier check's figures are not replaced silently
        with open(os.path.join(out, "gpu_check.json")) as f:
            earlier = f.read(2000)
        date = re.search(r'"date": "([^"]+)"', earlier)
        sys.exit(f"gpu_check: error: {out} holds an earlier check's results (gpu_check.json"
                 f"{', ' + date[1] if date else ''}): give another --out, or move it away")
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:  # found now, not after the minutes of the rates
        sys.exit(f"gpu_check: error: the export check needs {', '.join(missing)}: pip install -r requirements-test.txt")
    stop_on_signal()
    os.makedirs(tmp, exist_ok=True)
    check, log = Check(out), os.path.join(out, "gpu_check.log")
    print(f"gpu_check: writing {check.path} and {log}", flush=True)

    def go(name):
        command, env = commands[name]
        return run(command, env, log)

    def device():
        import torch
        if not args.dry_run and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: run with --dry-run on the CPU")
        name = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry_run else "CPU (dry run)"
        check.record(device=name, torch=torch.__version__, cuda=torch.version.cuda, dry_run=args.dry_run,
                     date=time.strftime("%Y-%m-%d"), cpu_count=os.cpu_count())
        return f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, {os.cpu_count()} cores"

    def data():
        small = start(commands["data small"][0], stdout=subprocess.DEVNULL)
        go("data full")
        if small.wait():
            raise RuntimeError("synthetic.py (the small set) failed")
        return f"{sizes['train']} photo-like {sizes['frame'][0]}x{sizes['frame'][1]} frames ({sizes['unique']} drawn)"

    check.step("device", device)
    check.step("data", data)
    if args.first_step_only:
        return

    def model_only():
        import torch
        sys.path.insert(0, ROOT)
        import bench
        if args.dry_run:
            rate, peak, _ = bench.gpu_step_rate(None, False, False, 2, 32, 10, 5, "cpu", SMALL_MODEL)
        else:
            torch.backends.cudnn.benchmark = True  # as main.py has it
            rate, peak, _ = bench.gpu_step_rate(torch.bfloat16, True, False, 8, 768, 20, 10)
            torch.cuda.empty_cache()
        check.record(model_only_img_s=round(rate, 2), model_only_peak_gib=round(peak, 2))
        return f"{rate:.1f} images/s, {peak:.1f} GiB"

    def memory():
        """Peak memory at the batches and precisions docs/memory.md estimates, and fp32's rate with and without
        channels_last (measured only with bf16 before)."""
        import torch
        sys.path.insert(0, ROOT)
        import bench
        found = {}
        points = [("bf16", torch.bfloat16, 4), ("bf16", torch.bfloat16, 16), ("fp32", None, 8)]
        for precision, dtype, batch in points[:1] if args.dry_run else points:
            if args.dry_run:
                _, peak, _ = bench.gpu_step_rate(None, False, False, 2, 32, 2, 1, "cpu", SMALL_MODEL)
            else:
                _, peak, _ = bench.gpu_step_rate(dtype, True, False, batch, 768, 3, 2)
                torch.cuda.empty_cache()
            found[f"peak_gib_{precision}_b{batch}"] = round(peak, 2)
        for layout, channels_last in (("fp32", False), ("fp32_channels_last", True)):
            if args.dry_run:
                rate, _, _ = bench.gpu_step_rate(None, channels_last, False, 2, 32, 2, 1, "cpu", SMALL_MODEL)
            else:
                rate, _, _ = bench.gpu_step_rate(None, channels_last, False, 8, 768, 10, 4)
                torch.cuda.empty_cache()
            found[f"{layout}_img_s"] = round(rate, 2)
        check.record(**found)
        return ", ".join(f"{k} {v}" for k, v in found.items())

    def buckets():
        """DDP's gradients zeroed in place (main.py) against set_to_none: one process, on this GPU."""
        output = go("buckets")
        results = json.loads(next(line for line in output.splitlines() if line.startswith('{"set_to_none"')))
        (none_s, none_gib, _), (place_s, place_gib, copies) = results["set_to_none"], results["in place"]
        found = {"bucket_set_to_none_ms": round(none_s * 1000, 1), "bucket_in_place_ms": round(place_s * 1000, 1),
                 "bucket_set_to_none_gib": round(none_gib, 3), "bucket_in_place_gib": round(place_gib, 3),
                 "bucket_in_place_copies": copies}
        check.record(**found)
        return ", ".join(f"{k} {v}" for k, v in found.items())

    def program(name, key):
        output = go(name)
        rate, wait = steady(output)
        with open(os.path.join(commands[name][1]["OUTPUT_DIR"], "metrics.jsonl")) as f:
            memory = json.loads(f.readline())["peak_memory_gib"]
        results = {f"{key}_img_s": rate, f"{key}_data_wait": wait, f"{key}_peak_memory_gib": memory}
        if "model_only_img_s" in check.results:
            results[f"{key}_vs_model_only"] = round(rate / check.results["model_only_img_s"], 3)
        check.record(**results, **({"peak_memory_gib": memory} if key == "program" else {}))
        return ", ".join(f"{k} {v}" for k, v in results.items())

    def cached():
        go("fill cache")
        return program("cached", "cached")

    def resume():
        go("resume 1")
        second = go("resume 2")
        import torch
        checkpoint = torch.load(os.path.join(commands["resume 2"][1]["OUTPUT_DIR"], "checkpoint.pth"),
                                map_location="cpu", weights_only=True)
        scaler_saved = bool(checkpoint["scaler"]) or args.dry_run  # bf16 (dry run) has no GradScaler
        ok = "resuming from" in second and checkpoint["epoch"] == 2 and scaler_saved
        check.record(resume_ok=ok)
        return f"resumed at epoch 1, finished epoch 2, GradScaler state {'saved' if checkpoint['scaler'] else 'none'}"

    def preempt():
        command, env = commands["preempt"]
        process = start(command, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        for line in process.stdout:
            seen.append(line)
            if re.search(r"epoch 0 step 3/", line):
                process.send_signal(signal.SIGTERM)  # as a scheduler would, to run.sh
                break
        seen += process.stdout.readlines()
        try:
            status = process.wait(timeout=300)
        except subprocess.TimeoutExpired:
            stop(process)
            raise
        write_log(log, f"$ {shlex.join(command)}\n{''.join(seen)}\n")
        stopped = "stopped by signal" in "".join(seen) and status == 0
        finished = "done:" in go("preempt resume")
        check.record(preempt_ok=stopped and finished)
        return f"SIGTERM: exit {status}, {'saved' if stopped else 'NOT saved'}; resumed to the end: {finished}"

    def nan():
        import hashlib
        command, env = commands["nan"]
        checkpoint = os.path.join(env["OUTPUT_DIR"], "checkpoint.pth")
        with open(checkpoint, "rb") as f:
            before = hashlib.sha1(f.read()).hexdigest()
        result = execute(command, env, timeout=300)
        write_log(log, f"$ {shlex.join(command)}\n{result.stdout}{result.stderr}\n")
        with open(checkpoint, "rb") as f:
            kept = hashlib.sha1(f.read()).hexdigest() == before
        said = result.stderr.count("NaN or infinite") == 1  # one line: torchrun's restarts (none here) repeat none
        check.record(nan_ok=result.returncode == 1 and said and kept)
        return f"exit {result.returncode}, {'said' if said else 'NOT said'}, checkpoint {'kept' if kept else 'CHANGED'}"

    def predict():
        go("predict")
        written = sum(len(files) for _, _, files in os.walk(os.path.join(tmp, "predictions")))
        check.record(predict_ok=written == 3 * sizes["small_val"])
        return f"{written} files for {sizes['small_val']} images"

    def onnx():
        go("export")
        import numpy as np
        import onnxruntime
        import torch
        sys.path.insert(0, ROOT)
        from harness import checkpoints
        model, _ = checkpoints.load_for_inference(os.path.join(tmp, "o_resume", "checkpoint.pth"))
        images = torch.randn(1, 3, 64, 128)
        with torch.no_grad():
            expected = model(images).numpy()
        session = onnxruntime.InferenceSession(os.path.join(tmp, "model.onnx"), providers=["CPUExecutionProvider"])
        difference = float(np.abs(session.run(None, {"images": images.numpy()})[0] - expected).max())
        check.record(onnx_ok=difference < 1e-3, onnx_max_difference=difference)
        return f"largest difference from PyTorch's logits {difference:.2e}"

    check.step("model_only", model_only)
    check.step("memory", memory)
    check.step("buckets", buckets)
    check.step("program", lambda: program("program", "program"))
    check.step("cached", cached)
    # Each chain uses its own run's checkpoint, so neither waits for the other.
    check.side_by_side([("resume", resume), ("onnx", onnx)], [("preempt", preempt), ("nan", nan), ("predict", predict)])
    failed = check.failed + [k for k, v in check.results.items() if k.endswith("_ok") and v is False]
    print(f"gpu_check: {'all passed' if not failed else 'FAILED: ' + ', '.join(sorted(set(failed)))}; results in "
          f"{check.path}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
