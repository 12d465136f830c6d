"""A newcomer's hour, walked: every command of the README and of docs/, in the order a person meets them, run as
written in a fresh copy of the project, each checked to exit as documented and to write what the docs say it
writes. Commands that need what this machine has not (GPUs, several machines, Slurm, the real Cityscapes) are
listed below as skipped, with the reason; a command in the docs that the walk does not know fails it, and so
does a command of the walk that the docs no longer have: the two cannot drift apart.

    python tests/tools/walk_docs.py              # all of it: 3.5 to 6 minutes on 2 cores (.ci/run runs it)
    python tests/tools/walk_docs.py --list       # the commands, in order, and what the walk does with each
    python tests/tools/walk_docs.py --keep DIR   # walk in DIR and leave it there, to look at what was written

Where the docs allow it (arguments after ./run.sh go to main.py), the demo trains 2 epochs instead of 7, the
fine-tuning on your own data 1 instead of 3, and TensorBoard's run 1 epoch of models.py's tiny model (its curves are
the point, not the demo's model again). Two commands run beside the others, sharing the two cores with them: the
Cityscapes scripts' install (it needs nothing the walk makes) from the start, during the demo, and the ONNX export
(it needs only the demo's best.pth, and nothing after it reads model.onnx) from the demo's end. Each is checked, as
every command is, when the walk comes to it (the install at its place in the docs, the export after the last
command), and killed then if it has run past its time. A SIGTERM or SIGHUP to the walk ends it as a Ctrl-C does,
killing what it started.
"""
import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP_REAL = "needs the real Cityscapes in data/cityscapes, which cannot be downloaded here"
SKIP_GPU = "needs CUDA GPUs"


def Run(extra="", env=None, expect=(), files=(), status=0, before=None, timeout=300, early=False, alongside=False):
    """A command the walk runs: `extra` appended to it, `expect` in what it prints, `files` there after it. `early`:
    it starts before its turn, in the background: True, with the walk (it needs nothing an earlier command makes);
    a command, as soon as that command's first run is checked (it needs only what that one makes, and no command
    before its turn changes it; one that runs alongside is checked at the end, so what waits for it starts at its
    own turn). `alongside`: the walk goes on beside it (started at its turn, if not early), no
    later command needing what it makes. Each is checked, as every command, once it has ended (the walk waits for
    it at its turn, or for one alongside at the end)."""
    return SimpleNamespace(skip=None, extra=extra, env=env or {}, expect=expect, files=files, status=status,
                           before=before, timeout=timeout, early=early, alongside=alongside)


def Skip(why):
    return SimpleNamespace(skip=why)


def photos(folder):
    """Your own pictures and video frames, as predict.md's first two commands expect them in photos/ and clips/."""
    from PIL import Image
    import numpy as np
    rng = np.random.default_rng(0)
    for path, size in (("photos/street.jpg", (160, 90)), ("photos/phone/tall.png", (60, 100)),
                       ("clips/day1/frame_0001.jpg", (128, 72)), ("clips/day1/frame_0002.jpg", (128, 72))):
        os.makedirs(os.path.dirname(os.path.join(folder, path)), exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(os.path.join(folder, path))


def where_things_are(folder, output):
    """The README's block under "It ends with where things are" is what the demo printed, line for line."""
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    block = readme.split("It ends with where things are:", 1)[1].split("```")[1].strip("\n").splitlines()
    printed = output.split("Where things are:\n", 1)[1].splitlines()[:len(block)]
    assert printed == block, "the README's list of where things are is not what the demo printed:\n" + \
        "\n".join(printed)


DEMO = "output/demo"
WALK = {
    # README.md
    "pip install -r requirements.txt && ./run.sh": [
        Run(extra=" --epochs 2", expect=["no Cityscapes in data/cityscapes", "done: best mIoU", "Where things are:"],
            files=[f"{DEMO}/{name}" for name in ("checkpoint.pth", "checkpoint.prev.pth", "best.pth", "metrics.jsonl",
                                                  "vis/epoch_001.png")] + ["data/cityscapes_synthetic/leftImg8bit/test"],
            before="walk_readme_block"),
        # again (the Chinese quick start): "Running ./run.sh again carries on ..., or says there is nothing to train"
        Run(extra=" --epochs 2", expect=["nothing to train: output/demo/checkpoint.pth has finished 2 epochs"])],
    "pip install -r requirements-test.txt && OMP_NUM_THREADS=1 python -m pytest -q -n 2 tests": Skip(
        "the suite itself: .ci/run runs it before this walk"),
    "./run.sh -e --resume output/demo/best.pth": Run(expect=["wrote output/demo/eval.json"],
                                                      files=[f"{DEMO}/eval.json", f"{DEMO}/vis/eval.png"]),
    "python predict.py --resume output/demo/best.pth data/cityscapes_synthetic/leftImg8bit/test --output-dir "
    "predictions": Run(expect=["wrote 20 predictions to predictions"],
                       files=["predictions/color", "predictions/overlay", "predictions/trainIds"]),
    "CUDA_VISIBLE_DEVICES=0,1 ./run.sh": Skip(SKIP_GPU),
    "torchrun --standalone --nproc_per_node=2 main.py --data data/cityscapes": Skip(SKIP_REAL),
    "python -m torch.distributed.launch --nproc_per_node=2 main.py --data data/cityscapes": Skip(SKIP_REAL),
    "python main.py --data data/cityscapes": Skip(SKIP_REAL),
    # docs/predict.md
    "python predict.py --resume output/demo/best.pth photos/ --output-dir predictions/": Run(
        before="photos", expect=["wrote 2 predictions to predictions/"],
        files=["predictions/color/street.jpg.png", "predictions/overlay/phone/tall.png.png",
               "predictions/trainIds/street.jpg.png"]),
    "python predict.py --resume output/demo/best.pth 'clips/**/*.jpg' --eval-flip --eval-crop 769 --eval-stride 513":
        Run(expect=["flip + window 769x769 stride 513x513", "wrote 2 predictions to predictions"],
            files=["predictions/color/frame_0001.jpg.png"]),
    "torchrun --standalone --nproc_per_node=2 predict.py --resume output/demo/best.pth "
    "data/cityscapes_synthetic/leftImg8bit/test --format labelid --what label": Run(
        expect=["2 process(es)", "wrote 20 predictions"],
        files=["predictions/labelIds/berlin/berlin_000000_000019_leftImg8bit.png.png"]),
    # The export needs only the demo's best.pth, which no command before its turn changes: started once it is there.
    "python predict.py --resume output/demo/best.pth --export model.onnx": Run(
        expect=["wrote model.onnx"], files=["model.onnx"], early="pip install -r requirements.txt && ./run.sh",
        alongside=True),
    # docs/your-data.md
    "python synthetic.py data/my_streets --layout folder --num-train 300 --num-val 60 --size 192 96": Run(
        files=["data/my_streets/classes.json", "data/my_streets/masks/val"]),
    "DATA=data/my_streets OUTPUT_DIR=output/my_streets ./run.sh --weights output/demo/best.pth --crop-size 96 "
    "--epochs 3 -j 1": Run(extra=" --epochs 1", expect=["its classifier, trained for 19 classes", "done: best mIoU"],
                           files=["output/my_streets/best.pth"]),
    # docs/tensorboard.md
    "pip install tensorboard": Run(),
    "OUTPUT_DIR=output/watched ./run.sh --tensorboard": Run(
        extra=" --epochs 1 --model deeplabv3plus_mobilenet_tiny", files=["output/watched/tensorboard"],
        expect=["done: best mIoU"]),
    "tensorboard --logdir output/watched": Skip("a server, which runs until stopped; the walk checks the event "
                                                "files it shows (output/watched/tensorboard) instead"),
    # docs/memory.md: no command of its own (its settings are run.sh's, tested by the suite)
    # docs/cityscapes.md
    'python -m venv .venv-cityscapes && .venv-cityscapes/bin/pip install cityscapesscripts "numpy<2.4"': Run(
        files=[".venv-cityscapes/bin/csEvalPixelLevelSemanticLabeling"], early=True),
    "torchrun --standalone --nproc_per_node=2 main.py -e --resume output/demo/best.pth --data "
    "data/cityscapes_synthetic --output-dir output/demo --save-predictions preds/": Run(
        expect=["wrote output/demo/eval.json and predictions to preds/", "it replaces the earlier one"],
        files=["preds/frankfurt_000000_000019_pred_labelIds.png"]),
    "CITYSCAPES_DATASET=data/cityscapes_synthetic CITYSCAPES_RESULTS=preds/ CITYSCAPES_EXPORT_DIR=preds/ "
    ".venv-cityscapes/bin/csEvalPixelLevelSemanticLabeling": Run(
        expect=["Score Average"], files=["preds/resultPixelLevelSemanticLabeling.json"], before="same_miou"),
    "NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 ./run.sh": Skip(
        "needs two machines (tests/test_launch.py runs two nodes on one machine)"),
    "NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 ./run.sh": Skip("needs two machines"),
    # docs/troubleshooting.md, docs/options.md, docs/tests.md: no command block
}
SLURM = "the Slurm batch script"


def pages(folder):
    """README.md, then the pages its table "More, one topic a page" names, in that order; a page of docs/ it does not
    name after them."""
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
        table = f.read().split("## More, one topic a page", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"\| \[(docs/[\w-]+\.md)\]", table)
    others = sorted(f"docs/{name}" for name in os.listdir(os.path.join(folder, "docs"))
                    if name.endswith(".md") and f"docs/{name}" not in named)
    return ["README.md", *named, *others]


def _without_comment(line):
    """A shell line without its trailing comment (a # after a blank, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(folder, page):
    """[(command, or the SLURM marker for a Slurm script)] of a page's ```bash blocks, in order: lines joined where
    they end in a backslash, comments and blank lines dropped, blanks squeezed."""
    with open(os.path.join(folder, page), encoding="utf-8") as f:
        text = f.read()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        if block.startswith("#!/bin/bash") and "#SBATCH" in block:
            found.append(SLURM)
            continue
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            command = " ".join(_without_comment(command).split())
            if command:
                found.append(command)
    return found


def walk(folder):
    """Run every command of the docs in folder (a fresh copy of the project), in order. -> [(page, command, how)]."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("DEEPLAB_RUN_SH", None)
    unknown = [(page, command) for page in pages(folder) for command in commands(folder, page)
               if command != SLURM and command not in WALK]
    assert not unknown, "commands in the docs that the walk does not know (add them to tests/tools/walk_docs.py's " \
        "WALK):\n" \
        + "\n".join(f"  {page}: {command}" for page, command in unknown)
    seen = {command for page in pages(folder) for command in commands(folder, page)}
    gone = [command for command in WALK if command not in seen]
    assert not gone, "commands of the walk that the docs no longer have:\n" + "\n".join(gone)
    steps, times = [], {}  # (page, command, its step) in the order a reader meets them
    for page in pages(folder):
        for command in commands(folder, page):
            times[command] = times.get(command, 0) + 1
            steps.append((page, command, Skip("needs a Slurm cluster") if command == SLURM else
                          _step(WALK[command], times[command])))
    started, done, beside = {}, [], []  # started: a step's index -> its command, running or ended (_start)
    try:
        for number, (page, command, step) in enumerate(steps):
            if not step.skip and step.early is True:
                print(f"walk: {page}: started with the walk: {command[:90]}", flush=True)
                started[number] = _start(command + step.extra, folder, {**env, **step.env})
        for number, (page, command, step) in enumerate(steps):
            if step.skip:
                print(f"walk: {page}: skipped: {command[:90]} ({step.skip})", flush=True)
                done.append((page, command, "skipped"))
                continue
            if step.before == "photos":
                photos(folder)
            if number not in started:
                print(f"walk: {page}: running{' beside the next commands' if step.alongside else ''}: "
                      f"{command[:90]}", flush=True)
                started[number] = _start(command + step.extra, folder, {**env, **step.env})
            if step.alongside:
                beside.append((page, command, step, started[number]))
            else:
                done.append(_check(page, command, step, folder, started[number]))
            for later, (its_page, its_command, its_step) in enumerate(steps):  # those waiting for this one's first run
                if later > number and later not in started and not its_step.skip and its_step.early == command \
                        and not step.alongside:  # (one alongside is checked at the end: see Run)
                    print(f"walk: {its_page}: started now that it can be, beside the next commands: "
                          f"{its_command[:90]}", flush=True)
                    started[later] = _start(its_command + its_step.extra, folder, {**env, **its_step.env})
        for page, command, step, running in beside:
            done.append(_check(page, command, step, folder, running))
    finally:  # a command started early or alongside, still running when another failed: ended with the walk
        for running in started.values():
            if running.waiter.is_alive():  # (an ended one's group id may be another's by now)
                with contextlib.suppress(OSError):
                    os.killpg(running.process.pid, signal.SIGKILL)
    return done


def _check(page, command, step, folder, running):
    """Wait for a started command (to its timeout, counted from its start) and check it as its step documents it:
    exit status, what it prints, what it writes. -> (page, command, how long it ran)."""
    returncode, output = _finish(running, folder, step.timeout)
    problems = []
    if returncode != step.status:  # an exit status, or how the walk killed it
        problems.append(f"exit {returncode}, documented {step.status}" if isinstance(returncode, int) else
                        f"{returncode} (documented: exit {step.status})")
    problems += [f"does not print {text!r}" for text in step.expect if text not in output]
    problems += [f"did not write {path}" for path in step.files if not os.path.exists(os.path.join(folder, path))]
    if not problems and step.before == "walk_readme_block":
        where_things_are(folder, output)
    if not problems and step.before == "same_miou":
        problems += same_miou(folder, output)
    assert not problems, f"{page}: {command + step.extra}: " + "; ".join(problems) + f"\n{output[-3000:]}"
    took = f"{running.end - running.start:.0f} s"
    print(f"walk: {page}: ran in {took}: {command[:90]}", flush=True)
    return page, command, took


def _start(command, folder, env):
    """bash -c command in folder, started in a process group of its own; what it prints goes to a file (a pipe that
    nobody reads while the walk runs other commands would fill, and stop it); a thread notes when it ends. -> the
    command's record: process, output, start, end (None while it runs), waiter (the thread)."""
    output = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
    process = subprocess.Popen(["bash", "-c", command], cwd=folder, env=env, stdout=output,
                               stderr=subprocess.STDOUT, start_new_session=True)
    running = SimpleNamespace(process=process, output=output, start=time.monotonic(), end=None, waiter=None)

    def note_the_end():
        process.wait()
        running.end = time.monotonic()
    running.waiter = threading.Thread(target=note_the_end, daemon=True)
    running.waiter.start()
    return running


def _finish(running, folder, timeout):
    """A started command's end -> (exit status, what it printed). One still running timeout seconds after it started
    is killed when the walk comes to it (at its turn, or for one started early or alongside when the walk checks it),
    with its process group and every process working in the folder (run.sh starts torchrun in a session of its own),
    and its status says so ('killed: still running past its N s'): a command that hangs fails the walk, it does not
    hang it."""
    running.waiter.join(max(0.0, running.start + timeout - time.monotonic()))
    if running.waiter.is_alive():
        ran = time.monotonic() - running.start
        with contextlib.suppress(ProcessLookupError):
            os.killpg(running.process.pid, signal.SIGKILL)
        while _kill_working_in(folder):  # again, for any started while the last round looked
            time.sleep(0.5)
        running.waiter.join()
        returncode = f"killed: still running past its {timeout} s (ran {ran:.0f} s)"
    else:
        returncode = running.process.returncode
    with running.output:
        running.output.seek(0)
        return returncode, running.output.read()


def _kill_working_in(folder):
    """SIGKILL every process (but this one) whose working folder is folder or inside it. -> how many."""
    folder, killed = os.path.realpath(folder), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if int(pid) != os.getpid() and (cwd == folder or cwd.startswith(folder + os.sep)):
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return killed


def _step(steps, time):
    """A command's step the time-th time the docs give it: one step for every time, or a list, its last repeated."""
    return steps if not isinstance(steps, list) else steps[min(time, len(steps)) - 1]


def same_miou(folder, output):
    """The official evaluation's "Score Average" IoU is main.py's mIoU of the same predictions (eval.json)."""
    import json
    with open(os.path.join(folder, DEMO, "eval.json")) as f:
        ours = json.load(f)["miou"]
    official = float(re.search(r"Score Average : (\S+)", output)[1])
    return [] if abs(official - ours) < 5e-4 else [f"the official mIoU {official} is not main.py's {ours:.4f}"]


def copy_project(target):
    """The project as a fresh clone has it: the files git knows (tracked, or new and not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.splitlines()
    for name in listed:
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(target, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(target, name))


def main():
    parser = argparse.ArgumentParser(prog="tests/tools/walk_docs.py", description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="the commands in order and what the walk does with each")
    parser.add_argument("--keep", metavar="DIR", help="walk in DIR (new or empty) and leave it there (every process "
                        "working in DIR is killed when a command runs past its time and when the walk ends: keep no "
                        "shell of yours there)")
    args = parser.parse_args()
    if args.list:
        times = {}
        for page in pages(ROOT):
            for command in commands(ROOT, page):
                times[command] = times.get(command, 0) + 1
                step = Skip("needs a Slurm cluster") if command == SLURM else \
                    _step(WALK[command], times[command]) if command in WALK else None
                when = "" if step is None or step.skip else ", started with the walk" if step.early is True else \
                    f", started after the first run of: {step.early}" if step.early else \
                    ", beside the next commands" if step.alongside else ""
                how = "UNKNOWN to the walk" if step is None else f"skipped: {step.skip}" if step.skip else \
                    f"run{' with' + step.extra if step.extra else ''}{when}"
                print(f"{page}: {command}\n    {how}")
        return
    folder = args.keep or tempfile.mkdtemp(prefix="walk_docs-")
    if args.keep:
        os.makedirs(folder, exist_ok=True)
        if os.listdir(folder):
            sys.exit(f"walk_docs.py: error: --keep {folder} is not empty: give a new or empty folder")
    start = time.time()
    for stop in (signal.SIGTERM, signal.SIGHUP):  # as SIGINT: the finally blocks below kill what the walk started
        signal.signal(stop, lambda number, frame: sys.exit(128 + number))
    try:
        copy_project(folder)
        done = walk(folder)
    except AssertionError as error:
        sys.exit(f"walk_docs.py: FAILED: {error}")
    finally:
        while _kill_working_in(folder):  # a command started early or alongside, still running when the walk failed
            time.sleep(0.5)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    ran = sum(1 for _, _, how in done if how != "skipped")
    print(f"walk_docs.py: {ran} commands ran as documented, {len(done) - ran} skipped (reasons above), in "
          f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
