"""DDP properties, on real gloo process groups (torch.multiprocessing, one thread per process)."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import main
from conftest import TRAIN_ARGS
from dataset import IGNORE_INDEX, NUM_CLASSES, Cityscapes
from models import build_model


def _spawn(fn, world_size, tmp_path, *args):
    # fork: the children start without importing torch again (seconds each); one thread a process, so no
    # thread pool is copied half-way.
    mp.start_processes(_entry, args=(fn, world_size, str(tmp_path), args), nprocs=world_size, join=True,
                       start_method="fork")


def _entry(rank, fn, world_size, tmp, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store_{world_size}", rank=rank,
                            world_size=world_size)
    try:
        fn(rank, world_size, tmp, *args)
    finally:
        dist.destroy_process_group()


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return build_model(TRAIN_ARGS[1], NUM_CLASSES)  # the tests' tiny DeepLabV3+ (conftest)


# --- after several DDP steps every parameter and buffer is identical on every rank -----------------

def _train_steps(rank, world_size, tmp, data):
    args = main.get_args_parser().parse_args(["-p", "1000", "--epochs", "2", "-b", "2", "--lr", "0.05"])
    model = DDP(_tiny_model(), gradient_as_bucket_view=True)
    train_set = Cityscapes(data, "train", crop_size=(32, 32))
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=2, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for epoch in range(2):  # 2 epochs x 2 steps, each rank on its own images
        sampler.set_epoch(epoch)
        main.train_one_epoch(model, optimizer, scaler, loader, torch.device("cpu"), epoch, 0, len(loader), args)
    torch.save({"params": {k: v.clone() for k, v in model.module.named_parameters()},
                "buffers_before_sync": {k: v.clone() for k, v in model.module.named_buffers()}},
               f"{tmp}/before_{rank}.pt")
    main.sync_buffers(model.module)
    torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, f"{tmp}/state_{rank}.pt")


def test_parameters_and_buffers_identical_on_all_ranks_after_ddp_steps(tmp_path, tiny_data):
    _spawn(_train_steps, 2, tmp_path, tiny_data)
    before = [torch.load(tmp_path / f"before_{r}.pt") for r in range(2)]
    states = [torch.load(tmp_path / f"state_{r}.pt") for r in range(2)]
    for name, value in before[0]["params"].items():
        assert torch.equal(value, before[1]["params"][name]), name  # DDP's averaged gradients
    # BatchNorm statistics: each rank's own last batch until main.sync_buffers makes them rank 0's.
    assert any(not torch.equal(v, before[1]["buffers_before_sync"][k])
               for k, v in before[0]["buffers_before_sync"].items())
    initial = _tiny_model().state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in states[0].items())  # it did train
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name


# --- two ranks' averaged gradient equals one process's gradient on the union of their batches ------

def _gradients(rank, world_size, tmp):
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(4, 3, 32, 32, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (4, 32, 32), generator=generator)  # no ignore: equal weights
    model = _tiny_model().eval()  # eval: no batch statistics, no dropout; gradients still flow
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    share = slice(rank * 2, rank * 2 + 2)
    main.criterion(ddp(images[share]), labels[share]).backward()
    main.criterion(reference(images), labels).backward()
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        worst = max(worst, ((p.grad - q.grad).norm() / q.grad.norm().clamp(min=1e-12)).item())
    torch.save(worst, f"{tmp}/grad_{rank}.pt")


def test_averaged_gradients_equal_single_process_gradient_on_union(tmp_path):
    _spawn(_gradients, 2, tmp_path)
    for rank in range(2):
        assert torch.load(tmp_path / f"grad_{rank}.pt") < 1e-5


# --- train shards are disjoint and cover the set; set_epoch changes the order ----------------------

def test_train_shards_disjoint_cover_and_reshuffle_each_epoch():
    dataset = list(range(20))
    shards = {}
    for epoch in (0, 1):
        for rank in (0, 1):  # configured as main.py configures it
            sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shards[epoch, rank] = list(sampler)
        assert not set(shards[epoch, 0]) & set(shards[epoch, 1])
        assert sorted(shards[epoch, 0] + shards[epoch, 1]) == dataset
    assert shards[0, 0] != shards[1, 0]


def test_eval_shards_count_every_image_exactly_once():
    for size in (1, 5, 7, 500):
        for world_size in range(1, 9):
            if world_size > size:
                continue
            indices = [i for r in range(world_size) for i in main.eval_shard(size, r, world_size)]
            assert sorted(indices) == list(range(size))


# --- evaluation on 1, 2 and 3 ranks gives the identical confusion matrix --------------------------

def _evaluate(rank, world_size, tmp, data):
    val_set = Cityscapes(data, "val")
    loader = DataLoader(Subset(val_set, main.eval_shard(len(val_set), rank, world_size)), batch_size=1)
    args = main.get_args_parser().parse_args([])
    confusion = main.evaluate(_tiny_model(seed=5), loader, torch.device("cpu"), NUM_CLASSES, args)
    if rank == 0:
        torch.save(confusion, f"{tmp}/confusion_{world_size}.pt")


def test_evaluation_identical_on_1_2_3_ranks(tmp_path, tiny_data):
    val_set = Cityscapes(tiny_data, "val")
    assert len(val_set) % 2 and len(val_set) % 3
    labelled = sum(int((val_set[i][1] != IGNORE_INDEX).sum()) for i in range(len(val_set)))
    for world_size in (1, 2, 3):
        _spawn(_evaluate, world_size, tmp_path, tiny_data)
    confusions = [torch.load(tmp_path / f"confusion_{w}.pt") for w in (1, 2, 3)]
    assert int(confusions[0].sum()) == labelled  # every labelled pixel of every image, once
    assert torch.equal(confusions[0], confusions[1]) and torch.equal(confusions[0], confusions[2])


def test_miou_is_mean_over_present_classes():
    confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64)
    confusion[0, 0], confusion[0, 1], confusion[1, 1] = 6, 2, 2  # road: 6/(6+2), sidewalk: 2/(2+2)
    miou, iou = main.iou_from_confusion(confusion)
    assert iou[0].item() == pytest.approx(0.75) and iou[1].item() == pytest.approx(0.5)
    assert torch.isnan(iou[2:]).all()
    assert miou == pytest.approx(0.625)


def test_loss_ignores_255_and_is_finite_on_an_all_ignored_crop():
    logits = torch.randn(1, NUM_CLASSES, 4, 4)
    labels = torch.full((1, 4, 4), IGNORE_INDEX)
    assert main.criterion(logits, labels).item() == 0.0
    labels[0, 0, 0] = 3
    expected = torch.nn.functional.cross_entropy(logits[:, :, 0, 0], labels[:, 0, 0])
    assert main.criterion(logits, labels).item() == pytest.approx(expected.item(), rel=1e-6)


def test_a_failed_checkpoint_write_leaves_the_previous_one_whole(tmp_path):
    path = str(tmp_path / "checkpoint.pth")
    main.save_checkpoint({"model": {"w": torch.ones(3)}, "epoch": 1}, path)
    main.save_checkpoint({"model": {"w": torch.full((3,), 2.0)}, "epoch": 2}, path)
    with pytest.raises(Exception):  # dies half-way through writing: a lambda cannot be saved
        main.save_checkpoint({"model": {"w": torch.zeros(1000)}, "epoch": 3, "bad": lambda: 0}, path)
    assert torch.load(path, weights_only=True)["epoch"] == 2
    assert torch.load(str(tmp_path / "checkpoint.prev.pth"), weights_only=True)["epoch"] == 1


def test_one_image_per_process_trains_with_aspp_pooling_batchnorm():
    model = _tiny_model().train()  # one image: ASPP's pooling branch has one value per channel
    loss = main.criterion(model(torch.randn(1, 3, 64, 64)), torch.randint(0, NUM_CLASSES, (1, 64, 64)))
    loss.backward()
    assert torch.isfinite(loss)
    with pytest.raises(ValueError):  # what plain BatchNorm does there, and what the model avoids
        torch.nn.BatchNorm2d(4).train()(torch.randn(1, 4, 1, 1))


# --- gradient accumulation: N batches on one process make the step one batch on each of N processes makes ---------

def _accumulated_steps(rank, world_size, tmp, accum_steps):
    """Two optimizer steps of main.train_one_epoch through DDP: world size 1 with --accum-steps 2, or world size 2
    with --accum-steps 1. Either way step s sees batches 2s and 2s+1 (2 images each), each a forward of its own."""
    generator = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=generator),
                torch.randint(0, NUM_CLASSES, (2, 32, 32), dtype=torch.uint8, generator=generator)) for _ in range(4)]
    loader = batches if world_size == 1 else batches[rank::2]  # rank r: batches r and 2 + r
    args = main.get_args_parser().parse_args(["-b", "2", "--accum-steps", str(accum_steps), "--lr", "0.05",
                                              "--epochs", "1", "-p", "1000"])
    model = DDP(_tiny_model())
    entered, no_sync = [], model.no_sync  # the batches that skip the all-reduce
    model.no_sync = lambda: entered.append(1) or no_sync()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    main.train_one_epoch(model, optimizer, scaler, loader, torch.device("cpu"), 0, 0, 2, args)
    if rank == 0:
        torch.save({"weights": {k: v.clone() for k, v in model.module.named_parameters()}, "no_sync": len(entered)},
                   f"{tmp}/accumulated_{world_size}.pt")


def test_accumulating_two_batches_on_one_process_gives_the_weights_of_one_batch_on_each_of_two(tmp_path):
    _spawn(_accumulated_steps, 1, tmp_path, 2)
    _spawn(_accumulated_steps, 2, tmp_path, 1)
    one, two = (torch.load(tmp_path / f"accumulated_{w}.pt") for w in (1, 2))
    assert (one.pop("no_sync"), two.pop("no_sync")) == (2, 0)  # the first of each two batches: no all-reduce
    one, two = one["weights"], two["weights"]
    initial = dict(_tiny_model().named_parameters())
    assert any(not torch.equal(initial[k], v) for k, v in one.items())  # it did train
    for name, value in one.items():  # the same update, up to the order of float additions
        assert torch.allclose(value, two[name], rtol=1e-4, atol=1e-6), (name, (value - two[name]).abs().max())
