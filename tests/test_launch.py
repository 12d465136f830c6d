"""main.py under each launcher, and run.sh end to end, as a user runs them (gloo, CPU): subprocesses where the
launcher is the point, ranks forked from this process where main.py's reading of its variables is."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import (ROOT, SLOW_ARGS, TRAIN_ARGS, built_once, checkpoint_of, cpu_env, fingerprint, finish_ranks,
                      fork_main, fork_ranks, free_port, metrics, run, run_main, run_sh_workers_line)
import main
from harness import job

PY = sys.executable


def test_local_rank_from_either_flag_or_environment():
    parse = lambda argv: main.get_args_parser().parse_args(argv).local_rank  # noqa: E731
    assert parse(["--local-rank=1"]) == 1  # torch.distributed.launch since PyTorch 2.0
    assert parse(["--local_rank", "1"]) == 1  # the tutorial, and launch before 2.0
    assert parse([]) is None  # torchrun: the environment only, which main() reads (Step 1, continued)



def _manual_launch(argv, logs):
    """The pre-torchrun way: a process per rank, MASTER_ADDR/PORT, RANK, WORLD_SIZE, and --local_rank; no
    LOCAL_RANK. Each rank is forked from this process: main.py's reading of them is the point. (The launch form
    tests a fresh interpreter's start.) -> what rank 0 said (the others say nothing but their errors)."""
    assert "LOCAL_RANK" not in os.environ  # (the forks inherit this process's variables)
    os.makedirs(logs)
    port = str(free_port())
    ranks = [fork_main([f"--local_rank={rank}", *argv], os.path.join(logs, f"rank_{rank}.log"),
                       {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": "2"})
             for rank in range(2)]
    return finish_ranks(ranks)[0]


def _files(folder):
    """{name: its bytes} of each file in folder."""
    return {name: (pathlib.Path(folder) / name).read_bytes() for name in os.listdir(folder)}


def _one_epoch(data, out, predictions):
    """main.py's arguments in each launch form: an epoch on tiny_data, the val predictions saved (each rank writes
    its own share's)."""
    return ["--data", data, "--output-dir", out, "--epochs", "1", *TRAIN_ARGS, "--save-predictions", predictions]


@pytest.fixture(scope="module")
def two_agreeing_ranks(tiny_data, tmp_path_factory):
    """The two-rank forms' reference, made once for the whole run (conftest.built_once): the same run in two forked
    ranks (a launcher's variables, no launcher), each rank's model kept as it is evaluated, and shown to be the same
    on both. -> its checkpoint's model."""
    def run_and_keep_each_rank_s_model(folder):
        evaluate = main.validate

        def validate(model, *args, **kwargs):
            torch.save(model.state_dict(), os.path.join(folder, f"rank_{torch.distributed.get_rank()}.pth"))
            return evaluate(model, *args, **kwargs)
        with pytest.MonkeyPatch.context() as patch:  # (the forks inherit it)
            patch.setattr(main, "validate", validate)
            finish_ranks(fork_ranks(_one_epoch(tiny_data, os.path.join(folder, "out"),
                                               os.path.join(folder, "predictions")), os.path.join(folder, "logs")))
    folder = built_once(tmp_path_factory, "two_agreeing_ranks", run_and_keep_each_rank_s_model)
    ranks = [torch.load(os.path.join(folder, f"rank_{rank}.pth"), weights_only=True) for rank in range(2)]
    different = [name for name in ranks[0] if not torch.equal(ranks[0][name], ranks[1][name])]
    assert not different, f"the ranks evaluated different models: {len(different)} tensors, e.g. {different[:3]}"
    return checkpoint_of(os.path.join(folder, "out"))["model"]


# torchrun: run.sh's tests and test_lesson.py. The local_rank form forks its ranks; the plain form runs here.
@pytest.mark.parametrize("form", [pytest.param("launch", marks=pytest.mark.launch), "local_rank", "plain"])
def test_each_launch_form_trains_and_evaluates(form, tiny_data, tmp_path, capsys, request):
    """Each way of starting main.py: torch.distributed.launch starts fresh interpreters, the launcher being the
    point; a process per rank by hand, with --local_rank, is forked from this process; the plain form runs main.main
    in this process. Trains: an epoch recorded, and with two ranks, bitwise the model of two forked ranks that
    evaluated the same model (the ranks agree).
    Evaluates: the mIoU printed is the one recorded, and the checkpoint, evaluated again here in one process, gives
    that mIoU and every val image's prediction byte for byte: every rank's share was evaluated and counted."""
    out, predictions = str(tmp_path / "out"), str(tmp_path / "predictions")
    common = ["main.py", *_one_epoch(tiny_data, out, predictions)]
    if form == "launch":  # deprecated, passes --local-rank=N
        log = run([PY, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port()}",
                   *common])
    elif form == "local_rank":
        log = _manual_launch(common[1:], str(tmp_path / "logs"))
    else:  # python main.py: no launcher, no process group (in this process: the same code, no start-up to wait for)
        log = run_main(common[1:], capsys)
    world_size = 1 if form == "plain" else 2
    assert f"{world_size} process(es)" in log
    [record] = metrics(out)
    assert record["world_size"] == world_size and record["epoch"] == 0
    if world_size == 2:
        mine, reference = checkpoint_of(out)["model"], request.getfixturevalue("two_agreeing_ranks")
        different = [name for name in reference if not torch.equal(mine[name], reference[name])]
        assert mine.keys() == reference.keys() and not different, f"{len(different)} tensors differ: {different[:3]}"
    assert re.findall(r"^epoch 0: .* mIoU (\S+) \(best", log, re.MULTILINE) == [f"{record['miou']:.4f}"], log
    assert 0 <= record["miou"] <= 1
    again = str(tmp_path / "again")
    run_main(["--data", tiny_data, "--output-dir", out, *TRAIN_ARGS, "-e", "--resume",
              os.path.join(out, "checkpoint.pth"), "--save-predictions", again])
    with open(os.path.join(out, "eval.json")) as f:
        result = json.load(f)
    assert result["num_images"] == 5 and result["miou"] == record["miou"]
    written = _files(predictions)
    assert len(written) == 5 and written == _files(again)


@pytest.mark.launch
def test_three_processes_on_run_sh_s_line_scale_the_learning_rate_with_the_global_batch(data24, tmp_path):
    """run.sh on a number of processes that cannot make the recipe's global batch of 16: 3 take -b 5 each, a global
    batch of 15, and --lr 0.1 scales linearly to 0.1 x 15/16 (--base-batch 16), said at the start. The line is
    run.sh's own: a stand-in for Python records run.sh's check, whose line is the workers' with --check-only added.
    Three ranks forked on it train the one step of the one epoch (24 images) at that rate, as the poly schedule's
    first step is its base rate. (run.sh's torchrun line for 3 GPUs:
    test_run_sh_keeps_the_recipes_global_batch_on_1_to_8_gpus.)"""
    out, log, fake = str(tmp_path / "out"), tmp_path / "started", tmp_path / "python"
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$FAKE_LOG"\nexit 1\n')  # one argument a line
    fake.chmod(0o755)
    tiny = [arg for arg, after in zip(TRAIN_ARGS, ["", *TRAIN_ARGS]) if "-b" not in (arg, after)]  # run.sh's -b
    env = {"NPROC": "3", "DATA": data24, "OUTPUT_DIR": out, "PYTHON": str(fake), "FAKE_LOG": str(log)}
    result = subprocess.run(["./run.sh", "--epochs", "1", *tiny], cwd=ROOT, env=cpu_env(**env), capture_output=True,
                            text=True, timeout=60)
    line = log.read_text().splitlines() if log.exists() else []
    assert line[:1] == [os.path.join(ROOT, "main.py")] and line[-2:] == ["--check-only", "3"], (line, result.stderr)
    said = finish_ranks(fork_ranks(line[1:-2], str(tmp_path / "logs"), world_size=3))[0]
    assert "global batch 15 (-b 5 x 3 process(es) x --accum-steps 1)" in said, said
    assert "note: global batch 15, not --base-batch 16: the learning rate is scaled with it, --lr 0.1 x 15/16 = " \
        "0.09375" in said, said
    [record] = metrics(out)
    assert record["world_size"] == 3 and record["lr"] == pytest.approx(0.1 * 15 / 16, rel=1e-12), record


@pytest.mark.launch
def test_run_sh_resumes_by_itself_bitwise_where_a_run_left_off_and_evaluates_its_checkpoint(data24, straight,
                                                                                             tmp_path, monkeypatch):
    """run.sh's launch is the point. A job of --epochs 2 that ended after epoch 0 leaves what the straight run
    (conftest) left then: its previous checkpoint and epoch 0's line of metrics. The same ./run.sh line again resumes
    by itself (run.sh passes --resume auto) at the start of epoch 1, on 2 processes, and ends with bitwise the
    straight run's weights and metrics; evaluated (-e) on two ranks, that checkpoint gives the same mIoU. (A first
    run.sh of --epochs 1 could not be compared: its poly schedule spans one epoch, its learning rates are another
    run's. run.sh starting from nothing is the demo's test.)"""
    records = metrics(straight)  # the straight run began from nothing: what such a run writes
    assert [r["epoch"] for r in records] == [0, 1]
    for name in ("checkpoint.pth", "best.pth", "vis/epoch_000.png"):
        assert os.path.isfile(os.path.join(straight, name)), name
    out = str(tmp_path / "out")
    os.makedirs(out)
    shutil.copy(os.path.join(straight, "checkpoint.prev.pth"), os.path.join(out, "checkpoint.pth"))
    with open(os.path.join(straight, "metrics.jsonl")) as f, open(os.path.join(out, "metrics.jsonl"), "w") as g:
        g.write(f.readline())
    assert checkpoint_of(out)["epoch"] == 1 and checkpoint_of(out)["step"] == 0
    env = {"DATA": data24, "OUTPUT_DIR": out, "NPROC": "2", "MASTER_PORT": str(free_port())}
    log = run(["./run.sh", "--epochs", "2", *SLOW_ARGS], env=env)  # no --resume: run.sh resumes by itself
    assert "2 process(es), backend gloo" in log
    assert "resuming from" in log and "at the start of epoch 1" in log
    records = metrics(out)
    assert [r["epoch"] for r in records] == [0, 1]  # continued at epoch 1, did not redo epoch 0
    assert records[1]["lr"] < records[0]["lr"]  # the poly schedule continued too
    for key in ("train_loss", "lr", "miou", "iou", "train_img_per_s", "epoch_time_s"):
        assert key in records[1]
    assert set(records[1]["iou"]) >= {"road", "car", "sky"}
    for name in ("checkpoint.pth", "vis/epoch_001.png"):
        assert os.path.isfile(os.path.join(out, name)), name
    mine, reference = checkpoint_of(out)["model"], checkpoint_of(straight)["model"]
    assert mine.keys() == reference.keys()
    different = [k for k in reference if not torch.equal(mine[k], reference[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
    for record, straight_record in zip(records, metrics(straight), strict=True):
        for key in ("epoch", "train_loss", "lr", "miou", "iou"):
            assert record[key] == straight_record[key], key

    # Evaluated on the line run.sh gives its two workers for -e (its -b and --accum-steps first), in forked ranks,
    # after run.sh's check of that line (--check-only 2, DEEPLAB_RUN_SH set, as run.sh runs it) in this process.
    # `./run.sh -e --resume ...` itself, as the README writes it, is run by the docs walk (tests/tools/walk_docs.py).
    predictions = str(tmp_path / "predictions")
    evaluation = run_sh_workers_line(data24, out, "-e", "--resume", os.path.join(out, "checkpoint.pth"),
                                     "--save-predictions", predictions, *TRAIN_ARGS)
    with monkeypatch.context() as under_run_sh:
        under_run_sh.setenv("DEEPLAB_RUN_SH", "1")
        run_main(evaluation + ["--check-only", "2"])
    job.RUN.env = job.Environment()  # what the check read under run.sh reset, as other tests do
    finish_ranks(fork_ranks(evaluation, str(tmp_path / "logs")))
    with open(os.path.join(out, "eval.json")) as f:
        result = json.load(f)
    assert result["num_images"] == 3 and 0 <= result["miou"] <= 1
    assert result["miou"] == pytest.approx(records[1]["miou"])  # the same model, the same number
    names = sorted(os.listdir(predictions))
    assert len(names) == 3 and all(n.endswith("_pred_labelIds.png") for n in names)


@pytest.mark.launch
def test_run_sh_without_data_writes_synthetic_set_and_trains(tmp_path):
    """A launch, run.sh's demo being the point. Run from a folder with no data/cityscapes and DATA not set: the demo,
    its paths relative to that folder (OUTPUT_DIR set, to keep the test small, is too; not ASCII, under the C
    locale). A DATA named on purpose that holds nothing is no demo (run.sh's choice, read from a stand-in for Python).
    Our arguments, after the demo's, win: the tests' tiny model among them, which has no ImageNet weights, so that
    it trains at all says the demo's --pretrained-backbone none reached main.py, as its --lr did."""
    env = {"OUTPUT_DIR": "ausgabe-über", "NPROC": "2", "MASTER_PORT": str(free_port()), "LANG": "C", "LC_ALL": "C"}
    log = run([os.path.join(ROOT, "run.sh"), "--epochs", "1", "--crop-size", "16", "-b", "16", "-p", "50",
               "--model", "deeplabv3plus_mobilenet_tiny"], env=env, cwd=str(tmp_path))  # 9 steps
    assert "no Cityscapes in data/cityscapes" in log
    assert os.path.isdir(tmp_path / "data" / "cityscapes_synthetic" / "leftImg8bit" / "test")
    assert [r["epoch"] for r in metrics(str(tmp_path / "ausgabe-über"))] == [0]
    args = checkpoint_of(str(tmp_path / "ausgabe-über"))["args"]
    assert (args["model"], args["crop_size"], args["lr"], args["pretrained_backbone"]) == (
        "deeplabv3plus_mobilenet_tiny", [16], 0.05, "none"), args
    # DATA named on purpose, holding nothing: main.py's check on it, not the demo. A stand-in for Python records what
    # run.sh starts and fails as the check does on a missing folder (its line: test_recovery's bad input).
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "$*" >> started\nexit 1\n')
    fake.chmod(0o755)
    result = subprocess.run([os.path.join(ROOT, "run.sh")], cwd=str(tmp_path), capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "DATA": "typo/cityscapes",
                                 "PYTHON": str(fake)}, timeout=60)
    assert result.returncode == 1 and "demo" not in result.stdout + result.stderr, result.stdout + result.stderr
    [check] = (tmp_path / "started").read_text().splitlines()
    assert "main.py --data typo/cityscapes --output-dir output --resume auto -b 8 --accum-steps 1 " in check, check
    assert check.endswith(" --check-only 2"), check


@pytest.mark.launch
def test_two_nodes_train_together_and_match_one_node(data24, straight, tmp_path):
    """run.sh's multi-node form: two launchers on this machine, each a node with one gloo worker, meet at
    the c10d rendezvous and produce bitwise the checkpoint of one node with two processes."""
    out = str(tmp_path / "out")
    port = str(free_port())
    nodes = []
    for node_rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "DATA": data24, "OUTPUT_DIR": out,
               "NPROC": "1", "NNODES": "2", "NODE_RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "RDZV_ID": f"test{port}"}
        nodes.append(subprocess.Popen(["./run.sh", "--epochs", "2", *SLOW_ARGS], cwd=os.path.dirname(main.__file__),
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [node.communicate(timeout=240)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), logs
    assert "2 process(es), backend gloo" in "".join(logs)
    mine = torch.load(os.path.join(out, "checkpoint.pth"), weights_only=True)
    reference = torch.load(os.path.join(straight, "checkpoint.pth"), weights_only=True)
    assert mine["epoch"] == reference["epoch"] == 2
    assert all(torch.equal(mine["model"][k], reference["model"][k]) for k in reference["model"])
    assert [r["miou"] for r in metrics(out)] == [r["miou"] for r in metrics(straight)]


@pytest.mark.launch
def test_run_sh_starts_the_python_PYTHON_names_and_says_in_python_s_words_why_it_cannot(tiny_data, tmp_path):
    """run.sh's own lines are the point: each case is a launch of it. The suite's PATH holds no Python and PYTHON
    names the one running pytest (conftest). Without PYTHON, its default `python` is found nowhere: one line says so,
    before any step. A Python that fails before it imports torch (PYTHONHASHSEED=abc ends it as it starts) is named
    with what Python said, not taken for a missing PyTorch; a Python without torch is told to install it, or to name
    the one that has it. Both advices are then followed in one run, the only one that imports torch (twice: the GPU
    count, main.py's check): it differs from each of the two runs that gave advice in that run's one variable alone,
    so each followed advice is what got past its mistake. run.sh counts the GPUs and runs main.py's check with the
    Python PYTHON names, as its tests train with it. main.py's own line about a flag proves that the check ran and
    had imported torch. That this line is all run.sh printed proves that the check stopped the mistake in front of
    torchrun: no worker started, none restarted."""
    assert shutil.which("python") is None and shutil.which("python3") is None, os.environ["PATH"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DATA": tiny_data, "OUTPUT_DIR": str(tmp_path / "out")}
    env.pop("CUDA_VISIBLE_DEVICES", None)  # not hidden: run.sh counts the GPUs, with Python too

    def run_sh(**variables):
        """run.sh's one line, with these variables set (None: unset)."""
        changed = {**env, **variables}
        result = subprocess.run(["./run.sh", "--epochs", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                                env={name: value for name, value in changed.items() if value is not None})
        lines = (result.stdout + result.stderr).strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, lines
        return lines[0]
    assert run_sh(PYTHON=None) == ("run.sh: error: PYTHON=python: no such program: set PYTHON to the Python that has "
                                   "PyTorch (PYTHON=/path/to/python ./run.sh)")
    line = run_sh(PYTHON=PY, PYTHONHASHSEED="abc")
    assert line.startswith(f'run.sh: error: PYTHON={PY} cannot count the GPUs (python -c "import torch; '
                           'print(torch.cuda.device_count())"): Fatal Python error: '), line
    assert "PYTHONHASHSEED" in line, line
    assert "PyTorch" not in line, line
    bare = tmp_path / "python"  # a Python without site-packages: no torch there
    bare.write_text(f'#!/bin/bash\nexec {PY} -I -S "$@"\n')
    bare.chmod(0o755)
    assert run_sh(PYTHON=str(bare), PYTHONHASHSEED="0") == (
        f"run.sh: error: PYTHON={bare} has no PyTorch (ModuleNotFoundError: No module named 'torch'): pip install -r "
        f"{ROOT}/requirements.txt with it, or set PYTHON to the Python that has it")
    # Both advices followed: PYTHONHASHSEED a number, as Python asked, and PYTHON the Python that has torch.
    assert run_sh(PYTHON=PY, PYTHONHASHSEED="0") == "main.py: error: --epochs: 0 must be at least 1"
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.launch
@pytest.mark.parametrize("gpus, per_gpu, accum_steps", [(1, 8, 2), (2, 8, 1), (3, 5, 1), (4, 4, 1), (5, 3, 1),
                                                        (6, 3, 1), (7, 2, 1), (8, 2, 1)])
def test_run_sh_keeps_the_recipes_global_batch_on_1_to_8_gpus(gpus, per_gpu, accum_steps, tiny_data, tmp_path):
    """run.sh as a machine with that many GPUs runs it, a stand-in for Python recording what run.sh starts: one
    process per GPU, at most the two-GPU layout's 8 images a forward, and the global batch of 16 where the GPUs can
    share it; elsewhere the -b nearest 16 / GPUs, and always --base-batch 16, which scales --lr with the global batch
    (main.py; test_three_processes_on_run_sh_s_line_scale_the_learning_rate_with_the_global_batch)."""
    log, fake = tmp_path / "started", tmp_path / "python"
    fake.write_text('#!/bin/bash\nif [ "$1" = -c ]; then echo "$FAKE_GPUS"; else echo "$*" >> "$FAKE_LOG"; fi\n')
    fake.chmod(0o755)
    env = {"PYTHON": str(fake), "FAKE_GPUS": str(gpus), "FAKE_LOG": str(log), "DATA": tiny_data,
           "OUTPUT_DIR": str(tmp_path / "out"), "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}
    result = subprocess.run(["./run.sh"], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    check, launch = log.read_text().splitlines()
    assert f"--check-only {gpus}" in check and f"--nproc_per_node {gpus} " in launch, (check, launch)
    assert f"-b {per_gpu} --accum-steps {accum_steps} --base-batch 16" in launch, launch


@pytest.mark.launch
def test_run_sh_starts_no_torchrun_on_one_node_when_its_check_finds_nothing_to_train(tiny_data, tmp_path):
    """main.py's check exits 3 when the run it would resume has finished (test_checkpoints): run.sh then ends there,
    exit 0, on one node; on two it starts torchrun, whose workers compare what each node resumes from. A stand-in
    for Python exits as the check would and records what run.sh starts."""
    log, fake = tmp_path / "started", tmp_path / "python"
    fake.write_text('#!/bin/bash\n[ "$1" != -c ] || exit 0\necho "$*" >> "$FAKE_LOG"\n'
                    'case " $* " in *" --check-only "*) exit 3;; esac\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log), "DATA": tiny_data, "CUDA_VISIBLE_DEVICES": "",
           "OUTPUT_DIR": str(tmp_path / "out")}
    for nodes, started in (("1", ["--check-only 2"]), ("2", ["--check-only 4", "torch.distributed.run"])):
        log.unlink(missing_ok=True)
        result = subprocess.run(["./run.sh"], cwd=ROOT, env={**env, "NNODES": nodes}, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        lines = log.read_text().splitlines()
        assert len(lines) == len(started) and all(part in line for part, line in zip(started, lines)), lines


@pytest.mark.launch
def test_run_sh_refuses_a_stop_status_that_is_no_exit_status(tmp_path):
    env = {**os.environ, "STOP_STATUS": "256", "CUDA_VISIBLE_DEVICES": "", "DATA": str(tmp_path / "data"),
           "OUTPUT_DIR": str(tmp_path / "out")}  # (a run.sh that did not check it would stop at the empty DATA)
    result = subprocess.run(["./run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (result.stdout + result.stderr).strip() == "run.sh: error: STOP_STATUS=256: an exit status is at most 255"


@pytest.mark.launch
def test_run_sh_started_from_a_deleted_folder_says_so(tmp_path):
    """torch's import dies in oneMKL's "Cannot load libtorch_cpu.so" in a process whose folder was deleted, before any
    line of main.py runs: run.sh says what happened first. (bash alone: nothing of Python starts.)"""
    gone = tmp_path / "gone"
    gone.mkdir()
    result = subprocess.run(["bash", "-c", f"cd {gone} && rmdir {gone} && bash {ROOT}/run.sh"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        "run.sh: error: the folder you are in was deleted: cd to a folder that exists, then run again"), result


@pytest.mark.launch
@pytest.mark.parametrize("variables, expect", [
    ({"NPROC": "0"}, "NPROC=0: give a whole number of at least 1"),
    ({"NPROC": "two"}, "NPROC=two: give a whole number of at least 1"),
    ({"NNODES": "0"}, "NNODES=0: give a whole number of at least 1"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2: nodes are numbered 0 to NNODES-1 (1)"),
    ({"NODE_RANK": "-1"}, "NODE_RANK=-1: give a whole number of at least 0"),
    ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS=-1: give a whole number of at least 0"),
    ({"MAX_RESTARTS": "99999999999999999999"}, "MAX_RESTARTS=99999999999999999999: give a whole number of at most "
                                               "999999999"),  # past bash's integers, which wrap without a word
    ({"NPROC": "000"}, "NPROC=000: give a whole number of at least 1"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT=http: give a whole number of at least 1"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000: a port is at most 65535"),
])
def test_run_sh_variables_are_checked_before_anything_runs(variables, expect, previous_run):
    before = fingerprint(previous_run)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUTPUT_DIR": previous_run, **variables}
    result = subprocess.run(["./run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and output.strip() == f"run.sh: error: {expect}", output
    assert fingerprint(previous_run) == before


@pytest.mark.launch
def test_run_sh_reads_a_leading_zero_as_decimal(tiny_data, tmp_path):
    """bash's arithmetic would read NPROC=010 as eight processes (and NPROC=08 as an error): ten are counted, and
    eight. A stand-in for Python records what run.sh starts (no torch to import: run.sh's own arithmetic is the
    point)."""
    log, fake = tmp_path / "started", tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "$*" >> "$FAKE_LOG"\n')
    fake.chmod(0o755)
    for given, counted in (("010", 10), ("08", 8)):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DATA": tiny_data, "OUTPUT_DIR": str(tmp_path / "out"),
               "NPROC": given, "PYTHON": str(fake), "FAKE_LOG": str(log)}
        result = subprocess.run(["./run.sh", *TRAIN_ARGS], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        check, launch = log.read_text().splitlines()
        log.unlink()
        assert check.endswith(f" --check-only {counted}"), check  # main.py's check is told the whole world size
        assert f"--nproc_per_node {counted} " in launch, launch
