"""What main.py's comments, its modules' and the README's say PyTorch does, checked against the installed torch: one
test per claim, named after it. A newer torch that changes one of these fails here instead of misleading a learner
who copies the comment. Nothing here runs on a GPU; what only a GPU shows is listed in docs/tests.md."""
import contextlib
import json
import os
import pathlib
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from conftest import ROOT, TRAIN_ARGS, built_once

# --- the launchers: what a process is given -----------------------------------------------------------------------
RECORDER = """import json, os, signal, sys, time
count, local_rank = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("LOCAL_RANK")
record_to = os.environ["RECORD_TO"]
if count == "0" and local_rank == "0":  # the first attempt's healthy rank: says so if the launcher stops it
    def stopped(number, frame):
        open(os.path.join(record_to, "stopped0-rank0"), "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stopped)
with open(os.path.join(record_to, f".rank{local_rank}"), "w") as f:
    json.dump({"argv": sys.argv[1:], "LOCAL_RANK": local_rank, "restarts": count, "RANK": os.environ.get("RANK"),
               "WORLD_SIZE": os.environ.get("WORLD_SIZE"),
               "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE")}, f)
os.replace(f.name, os.path.join(record_to, f"attempt{count}-rank{local_rank}.json"))  # whole or absent
# Both ranks record before either ends: the launcher stops the other rank as soon as one fails.
for _ in range(600):
    if len([name for name in os.listdir(record_to) if name.startswith(f"attempt{count}-")]) == 2:
        break
    time.sleep(0.05)
if count == "0" and local_rank == "1":
    sys.exit(1)  # the first attempt's rank 1 fails: does the launcher start both ranks again?
if count == "0":
    time.sleep(60)  # rank 0 still at work, healthy, when rank 1 fails
"""


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One torchrun (a restart allowed) and one torch.distributed.launch, side by side, each starting two processes
    of a script that records its arguments and environment (two, so that a rank's own values differ from the
    other's). Made once for the whole run (conftest.built_once): its tests run on both workers. -> {launcher: [what
    each attempt's rank 0 and rank 1 recorded, in that order]}, with "said" (each launcher's output) and "stopped"
    (for each, the first attempt's healthy ranks that it stopped)."""
    launchers = {"torchrun": "torch.distributed.run", "launch": "torch.distributed.launch"}

    def launch_both(folder):
        script = os.path.join(folder, "record.py")
        with open(script, "w") as f:
            f.write(RECORDER)
        runs = {}
        for name, module in launchers.items():
            out = os.path.join(folder, name)
            os.mkdir(out)
            runs[name] = subprocess.Popen([sys.executable, "-m", module, "--standalone", "--nproc_per_node=2",
                                           "--max-restarts=1", script, "--mine"], cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1", "RECORD_TO": out})
        for name, process in runs.items():
            with open(os.path.join(folder, f"{name}.said"), "w") as f:
                f.write(process.communicate(timeout=120)[0])
    folder = pathlib.Path(built_once(tmp_path_factory, "launched", launch_both))
    return {name: [json.loads(path.read_text()) for path in sorted((folder / name).glob("attempt*.json"))]
            for name in launchers} | {
        "said": {name: (folder / f"{name}.said").read_text() for name in launchers},
        "stopped": {name: sorted(path.name for path in (folder / name).glob("stopped*")) for name in launchers}}


@pytest.mark.launch
def test_torchrun_sets_local_rank_in_the_environment_and_passes_no_argument(launched):
    ranks = launched["torchrun"][:2]
    assert [rank["LOCAL_RANK"] for rank in ranks] == ["0", "1"]
    assert all(rank["argv"] == ["--mine"] for rank in ranks)  # the script's own arguments, no more


@pytest.mark.launch
def test_the_launchers_set_rank_and_world_size(launched):
    assert all([(rank["RANK"], rank["WORLD_SIZE"]) for rank in records[:2]] == [("0", "2"), ("1", "2")]
               for records in (launched["torchrun"], launched["launch"]))


@pytest.mark.launch
def test_the_launchers_set_local_world_size_to_the_processes_they_start_on_their_machine(launched, monkeypatch):
    """main.default_workers divides the cores by it. On one machine the launches give 2, as WORLD_SIZE; torchrun's
    agent (torch.distributed.launch runs the same one) on two machines of 2 and 1 processes tells the two apart:
    two agents in threads, each its own --node-rank of torchrun's static rendezvous, which finds a shared store in
    place of the TCPStore it would open, and the processes they would start recorded instead of started."""
    assert all(rank["LOCAL_WORLD_SIZE"] == "2" for records in (launched["torchrun"], launched["launch"])
               for rank in records)
    import threading
    from torch.distributed.elastic.agent.server import WorkerSpec, local_elastic_agent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    given = {}

    def record(name, entrypoint, args, envs, **more):
        given.update({env["RANK"]: (env["LOCAL_WORLD_SIZE"], env["WORLD_SIZE"]) for env in envs.values()})
        return type("Started", (), {"pids": lambda self: {}})()  # all the agent asks here of what it started
    monkeypatch.setattr(local_elastic_agent, "start_processes", record)
    store, failed = dist.HashStore(), []

    def agent(node, processes):
        try:
            rendezvous = StaticTCPRendezvous("127.0.0.1", 29500, node, 2, "two-machines", timeout=60)
            rendezvous._store = store
            spec = WorkerSpec(role="trainer", local_world_size=processes, rdzv_handler=rendezvous,
                              entrypoint="train.py", max_restarts=0)
            launcher = local_elastic_agent.LocalElasticAgent(spec, DefaultLogsSpecs())
            launcher._initialize_workers(launcher._worker_group)  # the rendezvous, the ranks, the environments
        except BaseException as error:
            failed.append(error)
    threads = [threading.Thread(target=agent, args=machine, daemon=True) for machine in ((0, 2), (1, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failed and given == {"0": ("2", "3"), "1": ("2", "3"), "2": ("1", "3")}


@pytest.mark.launch
def test_torchrun_restarts_every_worker_after_a_failure_and_counts_the_restarts(launched):
    # Rank 1 fails in the first attempt (any exit status but 0) while rank 0 is at work: torchrun stops the healthy
    # rank 0 (SIGTERM) and starts both again, TORCHELASTIC_RESTART_COUNT 1.
    assert [(rank["restarts"], rank["LOCAL_RANK"]) for rank in launched["torchrun"]] == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert launched["stopped"]["torchrun"] == ["stopped0-rank0"]


@pytest.mark.launch
def test_torch_distributed_launch_passes_local_rank_with_a_dash(launched):
    ranks = launched["launch"][:2]
    assert [rank["argv"] for rank in ranks] == [["--local-rank=0", "--mine"], ["--local-rank=1", "--mine"]]
    assert [rank["LOCAL_RANK"] for rank in ranks] == ["0", "1"]
    assert "FutureWarning" in launched["said"]["launch"] and "deprecated" in launched["said"]["launch"]


# --- process groups, samplers, loaders ----------------------------------------------------------------------------
def test_a_gloo_process_group_times_out_after_30_minutes_by_default(ddp_seen):
    """The timeout the forked ranks' gloo group holds, made without one; torch's constant for every backend but
    NCCL says the same. On every build of torch, the CPU's too."""
    from torch.distributed import constants
    assert ddp_seen["gloo_group_timeout_s"] == 30 * 60
    assert constants.default_pg_timeout == timedelta(minutes=30)


def test_a_nccl_group_times_out_after_10_minutes_where_torch_has_nccl_and_after_30_with_a_warning_where_not(
        monkeypatch):
    """The timeout init_process_group chooses for a NCCL group made without one, stopped just after the choice (a
    NCCL group needs a GPU: it would be refused here). A torch built with NCCL has the constant
    default_pg_nccl_timeout, 10 minutes, and chooses it; the CPU build has none, and chooses the others' 30 minutes,
    with a warning. Each build proves its own half."""
    import warnings
    from torch.distributed import constants, distributed_c10d
    chooser, chosen = distributed_c10d._get_default_timeout, []

    class Chosen(Exception):
        pass

    def choosing(backend):
        chosen.append((str(backend), chooser(backend)))
        raise Chosen
    monkeypatch.setattr(distributed_c10d, "_get_default_timeout", choosing)
    with warnings.catch_warnings(record=True) as warned, pytest.raises(Chosen):
        warnings.simplefilter("always")
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()
    said = [str(warning.message) for warning in warned]
    if constants.default_pg_nccl_timeout is not None:  # built with NCCL
        assert constants.default_pg_nccl_timeout == timedelta(minutes=10) and dist.is_nccl_available()
        assert chosen == [("nccl", timedelta(minutes=10))] and not any("NCCL" in words for words in said), said
    else:
        assert chosen == [("nccl", timedelta(minutes=30))] and not dist.is_nccl_available()
        assert any("NCCL support is not compiled" in words for words in said), said


def test_distributed_sampler_pads_every_share_to_one_length_by_repeating_indices():
    shares = [list(DistributedSampler(range(5), num_replicas=2, rank=rank, shuffle=False)) for rank in (0, 1)]
    assert shares == [[0, 2, 4], [1, 3, 0]]  # 5 images, 2 ranks: index 0 twice, every rank 3 steps of 1


def test_a_dataloader_takes_a_sampler_or_shuffle_not_both():
    with pytest.raises(ValueError, match="mutually exclusive"):
        DataLoader(range(3), shuffle=True, sampler=[0, 1, 2])


def test_distributed_sampler_seeds_its_shuffle_with_seed_plus_epoch():
    sampler = DistributedSampler(range(20), num_replicas=2, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(1)
    assert list(sampler) == list(DistributedSampler(range(20), num_replicas=2, rank=0, shuffle=True, seed=4))


def test_without_set_epoch_every_epoch_has_the_same_order():
    sampler = DistributedSampler(range(20), num_replicas=2, rank=0, shuffle=True, seed=0)
    first, second = list(sampler), list(sampler)
    sampler.set_epoch(1)
    assert first == second and list(sampler) != first


def test_drop_last_drops_only_a_last_partial_batch():
    assert [len(batch) for batch in DataLoader(range(7), batch_size=3, drop_last=True)] == [3, 3]
    assert [len(batch) for batch in DataLoader(range(6), batch_size=3, drop_last=True)] == [3, 3]


# --- DDP, on two forked gloo processes ----------------------------------------------------------------------------
class _TwoBatchNorms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(2, 4, 1), torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).mean((2, 3)))


class _FourLayers(torch.nn.Module):
    """Four layers of 1 MiB of weights: with 1 MiB buckets DDP gives each layer a bucket of its own. Written here,
    not as a torch.nn.Sequential: under DDP, torch.nn's own containers gave TorchDynamo no frame to compile."""
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return x


def _ddp_claims(rank, world_size, tmp):
    """Each claim's observation on this rank, recorded for rank 0's file."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size)  # no timeout
    seen = {"gloo_group_timeout_s": dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()}
    torch.manual_seed(rank)  # different weights on each rank before DDP
    model = _TwoBatchNorms()
    ddp = DDP(model)
    weights = [p.detach().clone() for p in model.parameters()]
    gathered = [[torch.zeros_like(w) for w in weights] for _ in range(world_size)]
    for w, outs in zip(weights, zip(*gathered)):
        dist.all_gather(list(outs), w)
    seen["weights_equal_after_wrap"] = all(torch.equal(a, b) for a, b in zip(gathered[0], gathered[1]))

    model.norm.momentum = 0.0  # a forward in training leaves the running statistics as they are

    def broadcasts(forward):
        """Whether a forward broadcast rank 0's buffers: each rank's running mean set to its rank first."""
        model.norm.running_mean.fill_(float(rank))
        forward()
        return bool((model.norm.running_mean == 0).all()) if rank == 1 else None

    x = torch.randn(4, 2, 3, 3)
    model.train()
    # The first forward after wrapping broadcasts whatever came before it; the ones after it show the rule.
    seen["first_forward_after_wrapping_broadcasts"] = broadcasts(lambda: ddp(x).sum().backward())
    seen["later_training_forwards_broadcast"] = [broadcasts(lambda: ddp(x).sum().backward()) for _ in range(2)]
    with torch.no_grad():
        seen["first_no_grad_forward_broadcasts"] = broadcasts(lambda: ddp(x))
        seen["second_no_grad_forward_broadcasts"] = broadcasts(lambda: ddp(x))
    seen["training_forward_after_a_no_grad_one_broadcasts"] = broadcasts(lambda: ddp(x).sum().backward())
    ddp(x).sum().backward()  # a training forward again; then one in eval mode, gradients enabled
    model.eval()
    seen["eval_forward_after_training_broadcasts"] = broadcasts(lambda: ddp(x))
    model.train()

    # SyncBatchNorm under DDP, no_sync or not: DDP (made with a BatchNorm: it refuses SyncBatchNorm on the CPU) given a
    # SyncBatchNorm afterwards. On the CPU its forward decides to gather the batch statistics over the group, then
    # refuses the CPU tensor. Let through (its device check, which also takes the PrivateUse1 device, told that
    # device's name is "cpu"; the GPU-only kernel batch_norm_stats done here in Python), torch's own autograd function
    # gathers them with the group's real all_gather, counted, then stops at the next GPU-only kernel.
    holder = DDP(torch.nn.Sequential(torch.nn.BatchNorm2d(2)))
    holder.module[0] = torch.nn.SyncBatchNorm(2)
    images = torch.randn(2 + rank, 2, 3, 3)  # each rank its own count of values per channel: 18 and 27
    with holder.no_sync():
        try:
            holder(images)
            seen["sync_batchnorm_refuses_the_cpu_under_no_sync"] = "did not refuse"
        except ValueError as error:
            seen["sync_batchnorm_refuses_the_cpu_under_no_sync"] = str(error)
    device_name, batch_norm_stats, all_gather = (
        torch._C._get_privateuse1_backend_name, torch.batch_norm_stats, dist.all_gather)
    gathered = []

    def counting_all_gather(outputs, tensor, *args, **kwargs):
        done = all_gather(outputs, tensor, *args, **kwargs)
        gathered.append([output[-1].item() for output in outputs])  # each rank's count, the last of 2C + 1
        return done
    torch._C._get_privateuse1_backend_name = lambda: "cpu"
    torch.batch_norm_stats = lambda x, eps: (x.mean((0, 2, 3)), (x.var((0, 2, 3), unbiased=False) + eps).rsqrt())
    dist.all_gather = counting_all_gather
    try:
        for case in ("no_sync", "training", "eval"):
            gathered.clear()
            holder.train(case != "eval")
            with holder.no_sync() if case == "no_sync" else contextlib.nullcontext():
                try:
                    holder(images)
                except NotImplementedError:  # after the gather: batch_norm_gather_stats_with_counts is GPU-only
                    pass
            seen[f"sync_batchnorm_gathers_{case}"] = list(gathered)
    finally:
        torch._C._get_privateuse1_backend_name, torch.batch_norm_stats, dist.all_gather = (
            device_name, batch_norm_stats, all_gather)

    # no_sync: the gradient stays this rank's own until a backward outside it all-reduces the sum.
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1, bias=False)
    ddp_net = DDP(net)
    inputs = torch.full((1, 3), float(rank + 1))
    with ddp_net.no_sync():
        ddp_net(inputs).sum().backward()
    seen["grad_inside_no_sync"] = net.weight.grad.clone().tolist()
    ddp_net(inputs).sum().backward()
    seen["grad_after_sync"] = net.weight.grad.clone().tolist()

    # With accumulation: a forward under no_sync leaves the next one without the broadcast.
    ddp(x).sum().backward()
    with ddp.no_sync():
        seen["broadcast_in_no_sync_after_a_synced_step"] = broadcasts(lambda: ddp(x).sum().backward())
    seen["broadcast_after_a_no_sync_forward"] = broadcasts(lambda: ddp(x).sum().backward())
    seen["state_dict_keys_of_the_wrapper"] = sorted({key.split(".")[0] for key in ddp.state_dict()})

    # find_unused_parameters: without it, a parameter that gets no gradient stops the next step.
    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.used(x)
    for find in (False, True):
        torch.manual_seed(0)
        unused = DDP(Unused(), find_unused_parameters=find)
        try:
            for _ in range(2):
                unused(torch.ones(1, 2)).sum().backward()
            seen[f"unused_parameters_train_{find}"] = True
        except RuntimeError:
            seen[f"unused_parameters_train_{find}"] = False

    # find_unused_parameters' graph walk: DDP hands the forward's outputs to its reducer's search for unused
    # parameters (through _find_tensors) after each forward with gradients, outside no_sync, and never without it.
    import torch.nn.parallel.distributed as ddp_module
    handed = []
    find_tensors = ddp_module._find_tensors
    ddp_module._find_tensors = lambda output: handed.append(1) or find_tensors(output)
    walks = {}
    for find in (True, False):
        torch.manual_seed(0)
        searched = DDP(torch.nn.Linear(2, 1), find_unused_parameters=find)
        for case in ("training", "no_sync", "no_grad"):
            handed.clear()
            with searched.no_sync() if case == "no_sync" else contextlib.nullcontext():
                with torch.no_grad() if case == "no_grad" else contextlib.nullcontext():
                    output = searched(torch.ones(1, 2)).sum()
            if case != "no_grad":
                output.backward()
            walks[f"{case}_{find}"] = len(handed)
    ddp_module._find_tensors = find_tensors
    seen["graph_walks"] = walks

    # SyncBatchNorm in a group of one process, on the CPU: refused (its device check comes first).
    groups = [dist.new_group([r]) for r in range(world_size)]  # (every rank makes every group)
    try:
        torch.nn.SyncBatchNorm(2, process_group=groups[rank]).train()(torch.randn(2, 2, 3, 3))
        seen["sync_batchnorm_group_of_one_on_cpu"] = "ran"
    except ValueError as error:
        seen["sync_batchnorm_group_of_one_on_cpu"] = str(error)

    # DDP on a CPU module: device_ids must be None, and SyncBatchNorm is refused.
    try:
        DDP(torch.nn.Linear(2, 2), device_ids=[0])
        seen["cpu_device_ids_refused"] = False
    except (ValueError, AssertionError, RuntimeError):
        seen["cpu_device_ids_refused"] = True
    try:
        DDP(torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(2))))
        seen["cpu_sync_batchnorm_refused"] = None
    except ValueError as error:
        seen["cpu_sync_batchnorm_refused"] = str(error)

    # gradient_as_bucket_view: the reducer's copies into the buckets, counted by the profiler, one way and the other.
    for set_to_none in (True, False):
        torch.manual_seed(0)
        bucketed = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)), gradient_as_bucket_view=True)
        optimizer = torch.optim.SGD(bucketed.parameters(), lr=0.1)

        def step():
            optimizer.zero_grad(set_to_none=set_to_none)
            bucketed(torch.randn(2, 8)).sum().backward()
            optimizer.step()
        step()  # the first: every gradient is new, and copied
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            step()
            step()
        copies = sum(event.count for event in profiler.key_averages() if "reducer::mul_out" in event.key)
        storages = {p.grad.untyped_storage().data_ptr() for p in bucketed.parameters()}
        seen[f"copies_set_to_none_{set_to_none}"] = copies
        seen[f"gradients_share_one_bucket_{set_to_none}"] = len(storages) == 1

    # torch.compile of a DDP model: how many graphs the backend is given, by default (TorchDynamo's DDPOptimizer on)
    # and with the DDPOptimizer off; and the compiled model's gradients against the eager one's. The backend counts
    # the graphs and runs each as it is: no code is generated, so this costs seconds, not the half minute of a
    # first Inductor compile, and the graphs it is given are the ones Inductor would be given.
    from torch import _dynamo as dynamo
    inputs = torch.randn(2, 512) + rank  # each rank its own: the eager DDP's gradient is their average
    gradients = {}
    # "default": the config as torch ships it (optimize_ddp = True in torch/_dynamo/config.py); the others forced.
    forced = {"default": {}, "with_ddp_optimizer": {"optimize_ddp": True},
              "without_ddp_optimizer": {"optimize_ddp": False}, "eager": {}}
    for name, config in forced.items():
        dynamo.reset()
        torch.manual_seed(0)
        layered = DDP(_FourLayers(), bucket_cap_mb=1)
        graphs = []

        def counting(graph, example_inputs):
            graphs.append(graph)
            return graph.forward
        with dynamo.config.patch(**config):
            (layered if name == "eager" else torch.compile(layered, backend=counting))(inputs).sum().backward()
        seen[f"compiled_graphs_{name}"] = len(graphs)
        gradients[name] = [p.grad.clone() for p in layered.parameters()]
    seen["compiled_gradients_equal_eager"] = all(
        torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(gradients["default"], gradients["eager"]))
    if rank == 1:
        with open(f"{tmp}/claims.json", "w") as f:
            json.dump(seen, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_seen(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_claims")
    mp.start_processes(_ddp_claims, args=(2, str(tmp)), nprocs=2, join=True, start_method="fork")
    with open(tmp / "claims.json") as f:
        return json.load(f)


def test_ddp_broadcasts_rank_0s_weights_when_it_wraps_a_model(ddp_seen):
    assert ddp_seen["weights_equal_after_wrap"]


def test_ddp_broadcasts_rank_0s_buffers_at_every_forward_that_follows_a_gradient_enabled_one(ddp_seen):
    # Rank 1's running mean set to 1 and rank 0's to 0 before each forward: rank 0's is on rank 1 after it.
    assert ddp_seen["first_forward_after_wrapping_broadcasts"]
    assert ddp_seen["later_training_forwards_broadcast"] == [True, True]  # the second and third training steps


def test_without_gradients_ddp_broadcasts_buffers_at_the_first_forward_only(ddp_seen):
    assert ddp_seen["first_no_grad_forward_broadcasts"] and not ddp_seen["second_no_grad_forward_broadcasts"]
    # The rule is the forward before: a training forward that follows a no_grad one does not broadcast either.
    assert not ddp_seen["training_forward_after_a_no_grad_one_broadcasts"]


def test_ddp_broadcasts_buffers_at_any_forward_after_a_training_one_in_eval_mode_too(ddp_seen):
    assert ddp_seen["eval_forward_after_training_broadcasts"]  # so evaluate() takes the unwrapped model


def test_sync_batchnorm_gathers_its_statistics_in_every_training_forward_no_sync_or_not(ddp_seen):
    """With --accum-steps N, each micro-batch's forward communicates, and normalises over -b x processes images. On
    the CPU SyncBatchNorm refuses its input once it has decided to gather (under no_sync too); let through (_ddp_claims
    says how), one all_gather in each training forward brings each rank's count of values per channel, 18 and 27,
    under no_sync as outside it, and none in eval mode. The gathered statistics' use needs a GPU."""
    refusal = ddp_seen["sync_batchnorm_refuses_the_cpu_under_no_sync"]
    assert refusal.startswith("SyncBatchNorm expected input tensor to be on GPU")
    assert ddp_seen["sync_batchnorm_gathers_no_sync"] == [[18.0, 27.0]]
    assert ddp_seen["sync_batchnorm_gathers_training"] == [[18.0, 27.0]]
    assert ddp_seen["sync_batchnorm_gathers_eval"] == []


def test_accumulation_gives_the_whole_batchs_gradient_except_through_batchnorm():
    """Two batches of 2 accumulated (each loss halved) against one batch of 4, the model in training mode with its
    Dropout off (p=0: ASPP's Dropout(0.5) alone draws other masks for 4 images than for 2 and 2, and makes the
    gradients differ by about 0.01 in the tests' tiny model, 0.09 in MobileNetV3-Large's): the same gradient with
    every BatchNorm on its running statistics (eval), another with every BatchNorm in training, normalising each
    forward over its own images. Only BatchNorm's mode differs."""
    from models import build_model
    torch.manual_seed(0)
    model = build_model(TRAIN_ARGS[1], 5).train()  # the tests' tiny DeepLabV3+ (conftest)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert dropouts and norms
    for dropout in dropouts:
        dropout.p = 0.0
    images, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4, 32, 32))

    def gradient(accumulate):
        model.zero_grad()
        for part in ((slice(0, 2), slice(2, 4)) if accumulate else (slice(0, 4),)):
            (F.cross_entropy(model(images[part]), labels[part]) / (2 if accumulate else 1)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def difference(batchnorm_training):
        for norm in norms:
            norm.train(batchnorm_training)
        state = {k: v.clone() for k, v in model.state_dict().items()}  # training mode moves the running statistics
        whole = gradient(accumulate=False)
        model.load_state_dict(state)
        parts = gradient(accumulate=True)
        model.load_state_dict(state)
        return ((whole - parts).norm() / whole.norm()).item()
    assert difference(batchnorm_training=False) < 1e-5 and difference(batchnorm_training=True) > 1e-2


def test_after_a_forward_under_no_sync_the_next_forward_broadcasts_no_buffers(ddp_seen):
    # so with --accum-steps N the buffers are broadcast once a step, at its first batch
    assert ddp_seen["broadcast_in_no_sync_after_a_synced_step"]
    assert not ddp_seen["broadcast_after_a_no_sync_forward"]


def test_a_ddp_models_state_dict_keys_start_with_module(ddp_seen):
    assert ddp_seen["state_dict_keys_of_the_wrapper"] == ["module"]


def test_without_find_unused_parameters_a_parameter_without_gradient_stops_training(ddp_seen):
    assert not ddp_seen["unused_parameters_train_False"] and ddp_seen["unused_parameters_train_True"]
    import inspect
    assert inspect.signature(DDP).parameters["find_unused_parameters"].default is False


def test_find_unused_parameters_walks_the_graph_after_each_forward_with_gradients_outside_no_sync(ddp_seen):
    # main.py's comment at DDP(..., find_unused_parameters=...): the search is handed each training forward's output,
    # none under no_sync or no_grad, and none at all with the flag off (its default).
    assert ddp_seen["graph_walks"] == {"training_True": 1, "no_sync_True": 0, "no_grad_True": 0,
                                       "training_False": 0, "no_sync_False": 0, "no_grad_False": 0}


def test_sync_batchnorm_in_a_group_of_one_on_the_cpu_is_refused(ddp_seen):
    assert "expected input tensor to be on GPU" in ddp_seen["sync_batchnorm_group_of_one_on_cpu"]


def test_no_sync_keeps_each_ranks_gradient_and_the_next_backward_averages_the_sums(ddp_seen):
    # Rank r's input is r + 1: rank 1's own gradient (2s) inside no_sync; after the next backward, outside it,
    # the average of each rank's sum: ((1 + 1) + (2 + 2)) / 2 = 3.
    assert ddp_seen["grad_inside_no_sync"] == [[2.0, 2.0, 2.0]]
    assert ddp_seen["grad_after_sync"] == [[3.0, 3.0, 3.0]]


def test_ddp_on_a_cpu_module_refuses_device_ids(ddp_seen):
    assert ddp_seen["cpu_device_ids_refused"]


def test_ddp_refuses_syncbatchnorm_on_the_cpu(ddp_seen):
    assert ddp_seen["cpu_sync_batchnorm_refused"] == "SyncBatchNorm layers only work with GPU modules"


def test_gradients_set_to_none_are_copied_into_ddps_buckets_every_step_zeroed_in_place_they_are_not(ddp_seen):
    assert ddp_seen["copies_set_to_none_True"] == 2 * 4  # 4 parameters, 2 steps after the first
    assert ddp_seen["copies_set_to_none_False"] == 0
    assert ddp_seen["gradients_share_one_bucket_False"]  # views of one bucket


# --- SyncBatchNorm ------------------------------------------------------------------------------------------------
def test_convert_sync_batchnorm_replaces_a_batchnorm_subclass_with_a_plain_syncbatchnorm():
    from models import _PoolingBatchNorm
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(_PoolingBatchNorm(4)))
    assert type(converted[0]) is torch.nn.SyncBatchNorm  # the subclass's own forward is gone


def test_sync_batchnorm_without_a_process_group_is_plain_batchnorm():
    one = torch.randn(1, 4, 1, 1)  # so it fails as BatchNorm does on one value per channel
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        torch.nn.SyncBatchNorm(4).train()(one)


def test_sync_batchnorm_takes_one_value_per_channel_on_each_of_two_processes():
    from torch.nn.modules._functions import SyncBatchNorm as sync_batch_norm
    one = torch.randn(1, 4, 1, 1)  # ASPP's pooling branch with one image per GPU
    arguments = (torch.ones(4), torch.zeros(4), torch.zeros(4), torch.ones(4), 1e-5, 0.1, None)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        sync_batch_norm.apply(one, *arguments, 1)
    # Two processes: the count check passes, and the statistics are computed (on a GPU: the CPU has no kernel)
    with pytest.raises(NotImplementedError):
        sync_batch_norm.apply(one, *arguments, 2)


def test_batchnorm_in_training_refuses_one_value_per_channel():
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        torch.nn.BatchNorm2d(4).train()(torch.randn(1, 4, 1, 1))


# --- numbers --------------------------------------------------------------------------------------------------
def test_bfloat16_has_float32s_range_and_float16_does_not():
    assert torch.finfo(torch.bfloat16).max > 3e38 and torch.finfo(torch.float32).max > 3e38
    assert torch.finfo(torch.float16).max == 65504 and torch.finfo(torch.float16).tiny > 6e-5


def test_cross_entropy_means_over_the_labelled_pixels():
    logits, labels = torch.randn(1, 3, 4, 4), torch.randint(0, 3, (1, 4, 4))
    labels[0, :2] = 255
    summed = F.cross_entropy(logits, labels, ignore_index=255, reduction="sum")
    assert torch.allclose(F.cross_entropy(logits, labels, ignore_index=255), summed / 8)


def test_cross_entropy_mean_over_no_labelled_pixel_is_nan():
    labels = torch.full((1, 2, 2), 255)
    assert torch.isnan(F.cross_entropy(torch.randn(1, 3, 2, 2), labels, ignore_index=255))


def test_softmax_rounding_can_make_two_different_logits_equal_probabilities():
    logits = torch.tensor([0.0, 1e-8])
    assert logits.argmax() == 1 and logits.softmax(0)[0] == logits.softmax(0)[1] and logits.softmax(0).argmax() == 0


def test_float16_autocast_and_a_grad_scaler_work_on_the_cpu_where_bfloat16_is_autocasts_default():
    """--amp fp16 only with CUDA is main.py's choice, not torch's limit: the CPU's autocast computes in float16 when
    asked, and a GradScaler for the CPU does its work (its first scale, 65536, overflows float16: that step is
    skipped and the scale halved; the next one is taken). Without a dtype the CPU's autocast takes bfloat16."""
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.get_autocast_dtype("cuda") == torch.float16
    weight = torch.ones(2, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for expected in ([1.0, 1.0], [0.9, 0.9]):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            output = F.linear(torch.ones(1, 2), weight[None])
        assert output.dtype == torch.float16
        scaler.scale(output.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        assert torch.allclose(weight.detach(), torch.tensor(expected))
    assert scaler.get_scale() == 32768.0


def test_a_disabled_grad_scaler_saves_an_empty_state_which_an_enabled_one_refuses():
    # main.py saves scaler.state_dict() in every checkpoint and loads it only when it is not empty.
    assert torch.amp.GradScaler("cpu", enabled=False).state_dict() == {}
    enabled = torch.amp.GradScaler("cpu")
    assert {"scale", "_growth_tracker"} <= set(enabled.state_dict())
    with pytest.raises(RuntimeError, match="empty"):
        enabled.load_state_dict({})


def test_out_of_memory_is_a_runtime_error_of_its_own_type():
    assert issubclass(torch.OutOfMemoryError, RuntimeError) and torch.OutOfMemoryError is torch.cuda.OutOfMemoryError


def test_the_cpus_allocator_says_out_of_memory_in_a_plain_runtime_error():
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator: can't allocate memory") as raised:
        torch.empty(2**62, dtype=torch.uint8)
    assert not isinstance(raised.value, torch.OutOfMemoryError)  # recovery.is_cpu_out_of_memory looks for its words


def test_manual_seed_takes_up_to_2_64_minus_1_and_the_sampler_adds_the_epoch():
    torch.manual_seed(2**64 - 1)
    with pytest.raises(ValueError, match="Overflow"):
        torch.manual_seed(2**64)
    sampler = DistributedSampler(range(4), num_replicas=1, rank=0, shuffle=True, seed=2**64 - 1)
    list(sampler)
    sampler.set_epoch(1)  # seed + epoch = 2**64: --seed is capped at 2**64 - --epochs
    with pytest.raises(ValueError, match="Overflow"):
        list(sampler)


# --- torch.load, torch.compile ------------------------------------------------------------------------------------
def test_torch_load_weights_only_reads_plain_data_and_refuses_objects(tmp_path):
    import argparse
    torch.save({"args": {"lr": 0.1}, "model": {"w": torch.ones(2)}}, tmp_path / "plain.pth")
    assert torch.load(tmp_path / "plain.pth", weights_only=True)["args"] == {"lr": 0.1}
    torch.save({"args": argparse.Namespace(lr=0.1)}, tmp_path / "namespace.pth")
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(tmp_path / "namespace.pth", weights_only=True)


def test_torch_load_puts_each_tensor_back_on_the_device_it_was_saved_from_unless_given_map_location(
        tmp_path, monkeypatch):
    """A checkpoint records each tensor's device as torch.save found it: here "cuda:0", rank 0's GPU (torch.save told
    so for a CPU tensor). torch.load without map_location restores it there (without CUDA it fails and says so);
    with map_location="cpu", as main.py loads, on the CPU."""
    path = tmp_path / "c.pth"
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    torch.save({"w": torch.arange(3.0)}, path)
    monkeypatch.undo()
    recorded = []
    torch.load(path, weights_only=True, map_location=lambda storage, location: recorded.append(location) or storage)
    assert recorded == ["cuda:0"]
    assert torch.load(path, map_location="cpu", weights_only=True)["w"].device == torch.device("cpu")
    if torch.cuda.is_available():
        assert torch.load(path, weights_only=True)["w"].device == torch.device("cuda", 0)
    else:
        with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
            torch.load(path, weights_only=True)


def test_torch_load_does_not_notice_bytes_changed_in_the_pickle_or_inside_a_tensor(tmp_path):
    """Each changed record fails its CRC-32 (zipfile's testzip names it: what checkpoints.verify checks), and torch.load
    reads it without an error: the pickle's key renamed, the tensor's zeros become ones."""
    import struct
    import zipfile
    path = tmp_path / "c.pth"
    torch.save({"w": torch.zeros(100_000)}, path)
    saved = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        records = {info.filename.split("/", 1)[1]: info for info in archive.infolist()}
    changes = {"data.pkl": (b"X\x01\x00\x00\x00w", b"X\x01\x00\x00\x00v"),  # the key "w", pickled, becomes "v"
               "data/0": (b"\x00" * 4096, b"\x01" * 4096)}  # 4 KiB inside the tensor's zeros
    loaded = {}
    for record, (old, new) in changes.items():
        info = records[record]  # its bytes follow its local header: 30 bytes, then its name and its extra field
        name_length, extra_length = struct.unpack_from("<HH", saved, info.header_offset + 26)
        start = info.header_offset + 30 + name_length + extra_length
        at = saved.index(old, start, start + info.compress_size)
        path.write_bytes(saved[:at] + new + saved[at + len(old):])
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() == info.filename
        loaded[record] = torch.load(path, weights_only=True)
    assert list(loaded["data.pkl"]) == ["v"] and not loaded["data.pkl"]["v"].any()
    assert list(loaded["data/0"]) == ["w"] and loaded["data/0"]["w"].abs().sum() > 0


def test_torch_save_writes_a_crc_32_for_each_record_and_one_attribute_bit_escapes_it(tmp_path):
    """The record's "folder" bit (external attributes, in the central directory): no CRC-32 covers it, zipfile's
    testzip passes, and torch's reader reads none of the record's bytes, without an error: the tensor holds what its
    new memory held. 40 MB, above the 32 MiB up to which glibc's malloc may hand back freed memory (which can hold
    these very values: with a 4 kB tensor this test failed now and then), so that its memory comes zeroed from the
    system and every element reads 0, where each of the record's is at least 1."""
    import zipfile
    path = tmp_path / "c.pth"
    torch.save({"w": torch.arange(1.0, 10_000_001.0)}, path)
    with zipfile.ZipFile(path) as archive:
        assert all(info.CRC for info in archive.infolist()) and archive.testzip() is None
        name = next(info for info in archive.infolist() if info.filename.endswith("data/0")).filename.encode()
    data = bytearray(path.read_bytes())
    entry = data.find(b"PK\x01\x02")
    while data[entry + 46:entry + 46 + len(name)] != name:
        entry = data.find(b"PK\x01\x02", entry + 4)
    data[entry + 38] |= 0x10
    path.write_bytes(bytes(data))
    del data
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    assert not torch.load(path, weights_only=True)["w"].any()


def test_a_dataloader_worker_ends_quietly_on_its_parents_sigterm_and_dies_of_anyone_elses(monkeypatch):
    """torch's own handler in each worker: SIGTERM from the parent -> exit 0; from another process (a scheduler
    signalling the whole job) -> killed by the signal, which the parent then raises mid-iteration (harness/stops.py).
    The parent's SIGCHLD handler raises it. Where that handler ran before the worker had died, the parent's next wait
    for a batch does, after MP_STATUS_CHECK_INTERVAL (5 s, bound as a default argument: half a second here)."""
    import signal
    import time
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    monkeypatch.setattr(_MultiProcessingDataLoaderIter._try_get_data, "__defaults__", (0.5,))

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 100

        def __getitem__(self, index):
            time.sleep(0.05)
            return index
    for sender in ("parent", "another process"):
        batches = iter(DataLoader(Slow(), num_workers=1, multiprocessing_context="fork"))
        next(batches)
        worker = batches._workers[0]
        if sender == "parent":
            os.kill(worker.pid, signal.SIGTERM)
            worker.join(timeout=10)
            assert worker.exitcode == 0
        else:  # the parent's SIGCHLD handler (or its next fetch) raises, wherever the parent is
            with pytest.raises(RuntimeError, match="DataLoader worker .* (killed by signal|exited unexpectedly)"):
                subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)
                worker.join(timeout=10)
                for _ in range(20):
                    next(batches)
            assert worker.exitcode == -signal.SIGTERM
        del batches


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's socket path length")
def test_a_dataloader_worker_hands_its_batch_over_through_a_socket_in_the_temporary_folder_75_characters_at_most(
        monkeypatch):
    """torch's file_descriptor sharing: a worker hands a batch's shared memory to its parent through multiprocessing's
    resource sharer, an AF_UNIX socket in the temporary folder (pymp-XXXXXXXX/listener-XXXXXXXX). A Linux socket's
    path holds 107 characters: a temporary folder of 75 works; with one of 76 the worker's feeder thread fails and
    the parent waits for a batch that never comes (DataLoader's timeout here, 3 s). checks.check_worker_sockets."""
    import multiprocessing
    import tempfile
    from harness import checks
    assert checks._SOCKET_PATH_MAX - checks._SOCKET_SUFFIX == 75
    base = tempfile.mkdtemp()
    for length, works in ((75, True), (76, False)):
        folder = os.path.join(base, "t" * (length - len(base) - 1))
        os.mkdir(folder)
        monkeypatch.setattr(tempfile, "tempdir", folder)
        monkeypatch.delitem(multiprocessing.current_process()._config, "tempdir", raising=False)  # (its own, once made)
        loader = DataLoader(torch.zeros(2, 3), num_workers=1, timeout=3, multiprocessing_context="fork")
        with contextlib.nullcontext() if works else pytest.raises(RuntimeError, match="timed out"):
            next(iter(loader))


def test_a_dataloader_freed_by_a_garbage_collection_waits_for_each_worker_and_by_its_last_reference_does_not(
        monkeypatch):
    """A DataLoader with persistent workers, freed by its last reference: its workers end at once. Freed by a
    garbage collection (in a reference cycle, as an error, its traceback and a frame holding the error make one):
    each worker is waited for MP_STATUS_CHECK_INTERVAL (5 s), then terminated. The collection runs the weakref
    callbacks of multiprocessing's queues before the iterator's __del__. So the feeder threads that would carry each
    worker its last message are closed first. (harness/recovery.py clears a failed run's frames.) Half a second here
    instead of 5."""
    import gc
    import time
    from torch.utils.data import _utils
    assert _utils.MP_STATUS_CHECK_INTERVAL == 5.0
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.5)

    def freed(in_a_cycle):
        """-> whether the worker was still alive once the last name of its DataLoader was gone, and the seconds a
        garbage collection then took."""
        loader = DataLoader(range(4), num_workers=1, persistent_workers=True, multiprocessing_context="fork")
        next(iter(loader))
        worker = loader._iterator._workers[0]
        holder = {"loader": loader}
        if in_a_cycle:
            holder["itself"] = holder
        del loader, holder
        alive = worker.is_alive()
        start = time.monotonic()
        gc.collect()
        return alive, time.monotonic() - start
    assert freed(in_a_cycle=False)[0] is False  # ended as its last reference went
    alive, seconds = freed(in_a_cycle=True)
    assert alive and seconds >= 0.5  # alive until the collection, which waited for it


def test_torch_compile_splits_a_ddp_models_graph_at_its_buckets_by_default(ddp_seen):
    """Four layers in four DDP buckets make four graphs by default (torch's config as it ships, not patched), as with
    the DDPOptimizer forced on, and one with it forced off: the split is the DDPOptimizer's, at the buckets, not a
    graph break. Each graph is then a backward of its own, and a bucket's all-reduce starts when its graph's backward
    ends, before the graphs earlier in the model have run theirs; in one graph every gradient would be ready only at
    its end (the DDPOptimizer's note in torch/_dynamo/backends/distributed.py; seen with the aot_eager backend, whose
    imports cost seconds more than this test). And the compiled DDP model's gradients are the eager DDP's, averaged
    over the ranks."""
    assert ddp_seen["compiled_graphs_default"] == ddp_seen["compiled_graphs_with_ddp_optimizer"] == 4
    assert ddp_seen["compiled_graphs_without_ddp_optimizer"] == 1
    assert ddp_seen["compiled_graphs_eager"] == 0 and ddp_seen["compiled_gradients_equal_eager"]


def test_a_torch_built_with_cuda_carries_nccls_warning_for_a_missing_destroy_process_group():
    """NCCL needs GPUs, so its warning at exit cannot be seen here: this reads it from torch's CUDA library, where
    ProcessGroupNCCL prints it when a process ends without destroy_process_group(). A torch built without CUDA (the
    CPU build) has no NCCL, so neither the warning nor the library: there the test is skipped, saying so."""
    import mmap
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
    if not os.path.exists(library):
        pytest.skip("a torch built without CUDA (the CPU build) has no NCCL, whose warning this reads")
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        assert data.find(b"destroy_process_group() was not called before program exit, which can leak resources") >= 0


# --- torchvision ------------------------------------------------------------------------------------------------
def test_asppool_normalises_one_value_per_channel_per_image():
    from torchvision.models.segmentation.deeplabv3 import ASPPPooling
    pooling = ASPPPooling(8, 4)
    assert pooling[0].output_size == 1 and isinstance(pooling[2], torch.nn.BatchNorm2d)


def test_torchvisions_imagenet_resnet101_is_the_file_the_docs_name():
    from torchvision.models import ResNet101_Weights
    assert ResNet101_Weights.IMAGENET1K_V1.url.endswith("/resnet101-63fe2227.pth")
