"""Measure, side by side in one run, and print ratios against their targets.

    python bench.py              # the CPU: DDP scaling, loop overhead, data pipeline, memory, evaluation
    python bench.py --data       # the data pipeline alone: decoders, the decode cache, prefetch_factor
    python bench.py --gpu        # one GPU: DeepLabV3+ ResNet-101, crop 768, batch 8, per precision/layout;
                                 # with 2 or more GPUs also DataParallel against DDP, throughput and memory

Each configuration runs the same model, batch and step (forward, cross-entropy, backward, SGD) on
random images; the first steps (and torch.compile's compilation) are left out of the timing.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))  # this folder's modules under python -I too
from harness import recovery  # (before torchvision: it checks the temporary folder torchvision's import needs)
from harness.checks import check_numbers
import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2

import dataset
import images

import main
from dataset import NUM_CLASSES
from synthetic import write_synthetic
from models import build_model

HERE = os.path.dirname(os.path.abspath(__file__))


def today_getitem(data, index):
    """Cityscapes.__getitem__ as it was before the uint8 pipeline, kept as the baseline: PIL decodes and
    converts, the whole frame is a tensor before the crop, the worker normalises to float32."""
    image_path, label_path = data.images[index], data.labels[index]
    with Image.open(image_path) as f:
        image = tv_tensors.Image(torch.from_numpy(np.array(f.convert("RGB"))).permute(2, 0, 1))
    with Image.open(label_path) as f:
        label_ids = np.array(f)
    if label_ids.ndim != 2 or label_ids.dtype != np.uint8 or int(label_ids.max()) > dataset.MAX_LABEL_ID:
        raise dataset.BadInput(f"{label_path} is not a Cityscapes labelIds image")
    generator = dataset.sample_generator(data.seed, data.epoch, index)
    image, label = dataset.train_transform(image, tv_tensors.Mask(torch.from_numpy(label_ids)[None]),
                                           data.crop_size, generator)
    label = torch.from_numpy(dataset.ID_TO_TRAINID.numpy()[label[0].numpy()])
    image = v2.functional.normalize(v2.functional.to_dtype(image, torch.float32, scale=True), main.MEAN, main.STD)
    return image.as_subclass(torch.Tensor), label


def bench_data(root, cache_dir, crop, seconds):
    """Seconds per sample in one worker (one thread) for each way of making a training sample from the
    PNG files, measured in turns (one sample of each, in a rotating order, again and again) so that other
    load on the machine slows all of them alike; medians. Returns ({name: seconds}, {name: bytes a sample})."""
    ours = dataset.Cityscapes(root, "train", crop_size=(crop, crop))
    cached = dataset.Cityscapes(root, "train", crop_size=(crop, crop), cache_dir=cache_dir)
    for index in range(len(cached)):
        cached.frame(index)  # fill the cache: "warm" is a cache already written, in the page cache
    reference_transform = v2.Compose([
        v2.RandomResize(crop * 2 // 3, crop * 8 // 3),  # torchvision's reference: scale the whole image
        v2.RandomCrop(crop, pad_if_needed=True, fill={tv_tensors.Image: 0, tv_tensors.Mask: 255}),
        v2.RandomHorizontalFlip()])

    def resize_then_crop(index):  # the same decoding and output as ours, the whole frame resized
        image = tv_tensors.Image(torch.from_numpy(np.array(dataset.read_image(ours.images[index]))).permute(2, 0, 1))
        label_ids = dataset.read_label(ours.labels[index])
        _, label = reference_transform(image, tv_tensors.Mask(torch.from_numpy(label_ids)[None]))
        return _, torch.from_numpy(dataset.ID_TO_TRAINID.numpy()[label[0].numpy()])

    def ours_with_pil(index):  # ours, with PIL as the decoder instead of torchcodec
        decoder, images._torchcodec_decode = images._torchcodec_decode, None
        try:
            return ours[index]
        finally:
            images._torchcodec_decode = decoder

    ways = {"today": lambda i: today_getitem(ours, i), "ours": ours.__getitem__, "ours, PIL decoding": ours_with_pil,
            "ours, cached": cached.__getitem__, "resize-then-crop": resize_then_crop,
            "decode alone": lambda i: (dataset.read_image(ours.images[i]), dataset.read_label(ours.labels[i]))}
    times = {name: [] for name in ways}
    sizes = {name: sum(t.numel() * t.element_size() for t in way(0)) for name, way in ways.items() if name != "decode alone"}
    names, turn, start = list(ways), 0, time.perf_counter()
    while turn < 3 or time.perf_counter() - start < seconds * len(ways):
        index = turn % len(ours)
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            began = time.perf_counter()
            ways[name](index)
            times[name].append(time.perf_counter() - began)
        turn += 1
    return {name: float(np.median(t)) for name, t in times.items()}, sizes


def _sleepy_consumer(root, cache_dir, crop, batch, prefetch_factor, step_s, steps):
    """Seconds the training loop waited for data over `steps` steps, each `step_s` of (sleeping) compute."""
    data = dataset.Cityscapes(root, "train", crop_size=(crop, crop), cache_dir=cache_dir)
    sampler = torch.utils.data.RandomSampler(data, replacement=True, num_samples=batch * (steps + 4),
                                             generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler, num_workers=2,
                                         prefetch_factor=prefetch_factor)
    waited, batches = 0.0, iter(loader)
    for step in range(steps + 4):
        began = time.perf_counter()
        next(batches)
        if step >= 4:  # the first batches wait for the workers to start
            waited += time.perf_counter() - began
        time.sleep(step_s)
    return waited


def bench_prefetch(root, crop, batch, steps):
    """Data wait per step with 2 workers, prefetch_factor 2 against 4. The workers' own time a batch is
    measured first (a consumer that takes no time), under whatever else loads the machine; then consumers
    that take 1.2x and 0.8x that per step, the two factors alternated, medians of 3."""
    batch_s = _sleepy_consumer(root, None, crop, batch, 2, 0.0, steps) / steps
    results = {}
    for speed in (1.2, 0.8):
        waits = {2: [], 4: []}
        for _ in range(3):
            for factor in waits:
                waits[factor].append(_sleepy_consumer(root, None, crop, batch, factor, speed * batch_s, steps) / steps)
        results[speed] = (speed * batch_s, {factor: float(np.median(w)) for factor, w in waits.items()})
    return batch_s, results


# --- the CPU: DDP scaling and loop overhead ----------------------------------------------------------------
MODEL = "deeplabv3plus_mobilenet_v3_large"
# --quick checks that every figure is measured, not the figures: models.py's tiny DeepLabV3+ (0.56 M parameters)
# takes a fraction of the big one's time a step.
QUICK_MODEL = "deeplabv3plus_mobilenet_tiny"


def _batch(batch, size):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(batch, 3, *size, generator=generator),
            torch.randint(0, dataset.NUM_CLASSES, (batch, *size), generator=generator))


def _scaling_worker(rank, world_size, mode, batch, size, steps, warmup, port, result_file, model_name):
    """One process of a scaling run: mode "ddp" (DDP as main.py wraps it) or "alone" (no communication)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(model_name, dataset.NUM_CLASSES).train()
    if mode == "ddp":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        model = DDP(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    images, labels = _batch(batch, size)
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        loss = main.criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    elapsed = time.perf_counter() - start
    if mode == "ddp":
        dist.destroy_process_group()
    with open(f"{result_file}.{rank}", "w") as f:
        f.write(str(elapsed))


def scaling_rate(world_size, mode, batch, size, steps, warmup, start_method="spawn", model_name=MODEL):
    """Global training images per second of world_size processes, one thread each. start_method "fork" (--quick)
    skips each process's import of torch; "spawn" starts them clean, as torchrun does."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "elapsed")
        mp.start_processes(_scaling_worker, args=(world_size, mode, batch, size, steps, warmup, _free_port(), result,
                                                  model_name), nprocs=world_size, join=True, start_method=start_method)
        slowest = max(float(open(f"{result}.{r}").read()) for r in range(world_size))
    return world_size * batch * steps / slowest


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loop_overhead(batch, size, steps, rounds=2, model_name=MODEL):
    """main.train_one_epoch's step against a bare forward, backward and SGD step: same model, batch and
    thread, in one process; alternated, the fastest round of each kept."""
    torch.set_num_threads(1)
    images, labels = _batch(batch, size)
    pixels = torch.randint(0, 256, images.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    loader = [(pixels, labels)] * steps  # uint8, as the data set gives it: both sides normalise
    # main.py's own flags, as its parser gives them: a flag the loop reads cannot be missing here.
    args = main.get_args_parser().parse_args(["-b", str(batch), "--lr", "0.01", "--epochs", "1", "-p", "10"])
    bare, ours = [], []
    for _ in range(rounds):
        for kind in ("bare", "main"):
            torch.manual_seed(0)
            model = build_model(model_name, dataset.NUM_CLASSES).train()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
            scaler = torch.amp.GradScaler("cpu", enabled=False)
            for _ in range(2):  # warm-up
                main.criterion(model(images), labels).backward()
            start = time.perf_counter()
            if kind == "bare":
                for images_, labels_ in loader:
                    loss = main.criterion(model(main.normalize(images_)), labels_.long())
                    optimizer.zero_grad(set_to_none=False)  # as main.py zeroes them (bucket views: --bucket-views)
                    loss.backward()
                    optimizer.step()
                bare.append(time.perf_counter() - start)
            else:
                main.train_one_epoch(model, optimizer, scaler, loader, torch.device("cpu"), 0, 0, steps, args)
                ours.append(time.perf_counter() - start)
    return min(ours) / min(bare) - 1, min(bare) / steps


# --- DDP's gradients in its buckets: zeroed in place or set to None ---------------------------------------------
def _timed(step, steps, cuda):
    """-> (seconds that `steps` calls of step() took, peak memory in GiB: the GPU's over these steps; on the CPU
    the process's peak resident set so far, which cannot be reset)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return elapsed, torch.cuda.max_memory_allocated() / 2**30 if cuda else main.peak_memory_gib(torch.device("cpu"))


def _bucket_worker(rank, world_size, set_to_none, device, model_name, batch, size, steps, warmup, port, result_file):
    """One process of a bucket-view run: DDP with gradient_as_bucket_view=True, the gradients zeroed in place or set
    to None before each step; -> (seconds for `steps` steps, peak memory GiB, reducer copies in one profiled step)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        torch.backends.cudnn.benchmark = True
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    torch.manual_seed(0)
    memory_format = torch.channels_last if cuda else torch.contiguous_format
    model = build_model(model_name, dataset.NUM_CLASSES).to(device, memory_format=memory_format).train()
    model = DDP(model, device_ids=[rank] if cuda else None, gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    images, labels = (t.to(device) for t in _batch(batch, size))
    images = images.contiguous(memory_format=memory_format)

    def step():
        optimizer.zero_grad(set_to_none=set_to_none)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = main.criterion(model(images), labels)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        step()
    copies = sum(event.count for event in profiler.key_averages() if "reducer::mul_out" in event.key)
    elapsed, peak = _timed(step, steps, cuda)
    dist.destroy_process_group()
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump([elapsed, peak, copies], f)


def bucket_views(device="cpu", rounds=2, quick=False):
    """main.py zeroes DDP's gradients in place; PyTorch's default, set_to_none, makes DDP's reducer copy each
    gradient into its bucket every step. Both ways side by side, alternated, fresh processes each run (2 gloo
    processes on the CPU, MobileNetV3 at 128x256, batch 4; one GPU: ResNet-101 at 768, batch 8, bf16,
    channels_last). -> {way: (seconds a step, the fastest run; peak GiB, the largest rank; copies a step)}."""
    import torch.multiprocessing as mp
    cuda = device == "cuda"
    world_size = 1 if cuda else 2
    model_name, batch, size = (("deeplabv3plus_resnet101", 8, (768, 768)) if cuda else
                               (MODEL, 2, (64, 64)) if quick else (MODEL, 4, (128, 256)))
    steps, warmup = (2, 1) if quick else (10, 3)
    found = {"set_to_none": [], "in place": []}
    for _ in range(rounds):
        for way in found:
            with tempfile.TemporaryDirectory() as tmp:
                result = os.path.join(tmp, "bucket")
                mp.start_processes(_bucket_worker, args=(world_size, way == "set_to_none", device, model_name, batch,
                                                         size, steps, warmup, _free_port(), result),
                                   nprocs=world_size, join=True, start_method="fork" if quick else "spawn")
                runs = [json.load(open(f"{result}.{rank}")) for rank in range(world_size)]
            found[way].append((max(r[0] for r in runs) / steps, max(r[1] for r in runs), runs[0][2]))
    return {way: (min(r[0] for r in runs), max(r[1] for r in runs), runs[0][2]) for way, runs in found.items()}


def print_bucket_views(results):
    (none_s, none_gib, none_copies), (place_s, place_gib, place_copies) = results["set_to_none"], results["in place"]
    print(f"gradients zeroed with set_to_none: {none_s * 1000:.1f} ms a step, peak {none_gib:.3f} GiB, {none_copies} "
          f"reducer copies a step; in place: {place_s * 1000:.1f} ms, peak {place_gib:.3f} GiB, {place_copies} copies; "
          f"in place / set_to_none: time {place_s / none_s:.3f}, memory {place_gib / none_gib:.3f}")
    return [("step time, gradients zeroed in place / set_to_none", f"{place_s / none_s:.3f}", "(reported)", None),
            ("peak memory, in place / set_to_none", f"{place_gib / none_gib:.3f}", "(reported)", None)]


# --- a checkpoint verified: what its CRC-32 check costs ------------------------------------------------------------
def checkpoint_check(rounds=5, model_name="deeplabv3plus_resnet101"):
    """The recipe's checkpoint (DeepLabV3+ ResNet-101 with SGD's momentum: what main.py saves after an epoch), in
    turns, the fastest round of each: main.py's save; torch.load alone; checkpoints.read (every record's CRC-32
    checked against the one torch.save wrote, then torch.load); the CRC-32 check alone; and a SHA-256 of the same
    bytes, what the digest checkpoints carried before cost (it hashed every tensor). -> ({way: seconds}, bytes)."""
    import hashlib
    from harness import checkpoints
    torch.set_num_threads(1)
    model = build_model(model_name, dataset.NUM_CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the momentum buffers exist, as after a step
    args = main.get_args_parser().parse_args(["--model", model_name])
    state = main.checkpoint_state(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), args,
                                  {"names": dataset.CLASS_NAMES, "colors": dataset.CLASS_COLORS}, 1, 0, 0.5, 0.0)

    def sha256(path):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        return digest.hexdigest()

    times = {"save (main.save_checkpoint: torch.save, fsync, rename)": [], "torch.load alone": [],
             "read (checkpoints.read: the CRC-32s checked, then torch.load)": [], "the CRC-32 check alone": [],
             "a SHA-256 of the same bytes (the digest's work)": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pth")
        for _ in range(rounds):
            for name, run in zip(times, (
                    lambda: main.save_checkpoint(state, path),
                    lambda: torch.load(path, map_location="cpu", weights_only=True),
                    lambda: checkpoints.read("--resume", path),
                    lambda: checkpoints.verify("--resume", path),
                    lambda: sha256(path))):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        size = os.path.getsize(path)
    return {name: min(values) for name, values in times.items()}, size


# --- the CPU: memory of each rank, evaluation time -----------------------------------------------------------
def _forked_main(rank, nproc, argv, env, port, log):
    """--quick: one process of main.py, forked from this one: main.main(argv) in env, with the variables torchrun
    gives its workers when nproc > 1 (none for one, as `python main.py`); what it prints goes to log.<rank>."""
    os.environ.update(env)
    if nproc > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # this process imported torch before env's OMP_NUM_THREADS was set here
    # Both the descriptors and Python's streams: a caller that captures sys.stdout (pytest) replaced the streams.
    sys.stdout = sys.stderr = open(f"{log}.{rank}", "w", buffering=1)
    os.dup2(sys.stdout.fileno(), 1)
    os.dup2(sys.stdout.fileno(), 2)
    main.main(main.get_args_parser().parse_args(argv))


def run_main(nproc, argv, env, quick=False):
    """main.py with argv in env, on nproc processes: launched as a user launches it (torchrun, or `python main.py`
    for one); with quick, forked from this process instead, which has imported torch already (seconds a process)."""
    if quick:
        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory() as tmp:
            log = os.path.join(tmp, "rank")
            try:
                ranks = mp.start_processes(_forked_main, args=(nproc, argv, env, _free_port(), log), nprocs=nproc,
                                           join=False, start_method="fork")
                deadline = time.time() + 600  # a rank that hangs ends the run in minutes: the suite runs this
                while not ranks.join(timeout=5):
                    if time.time() > deadline:
                        for process in ranks.processes:
                            process.kill()
                        raise SystemExit(f"bench.py: main.py's forked ranks did not end within 600 s: {argv}")
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
                said = "".join(open(f"{log}.{rank}").read()[-2000:] for rank in range(nproc)
                               if os.path.exists(f"{log}.{rank}"))
                raise SystemExit(f"bench.py: main.py failed ({error}):\n{said}") from None
        return
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command = (launcher if nproc > 1 else [sys.executable]) + [os.path.join(HERE, "main.py"), *argv]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"bench.py: main.py failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


def bench_cpu(quick):
    model_name = QUICK_MODEL if quick else MODEL
    print(f"CPU: {os.cpu_count()} cores, torch {torch.__version__}, model {model_name}, one thread per process")
    rows = []  # (what, measured, target, met)
    batch, size = (2, (64, 64)) if quick else (4, (128, 256))
    # --quick: the tiny model's steps are short; 4 timed keep a moment's load on a shared machine from swinging the
    # ratios far (tests/test_bench.py bounds them).
    steps, warmup = (4, 1) if quick else (10, 3)

    start_method = "fork" if quick else "spawn"
    one = scaling_rate(1, "alone", batch, size, steps, warmup, start_method, model_name)
    alone = scaling_rate(2, "alone", batch, size, steps, warmup, start_method, model_name)
    ddp = scaling_rate(2, "ddp", batch, size, steps, warmup, start_method, model_name)
    print(f"1. DDP scaling, batch {batch} per process at {size[0]}x{size[1]}: 1 process {one:.2f} img/s; "
          f"2 without communication {alone:.2f} ({alone / one / 2:.3f}); 2 with DDP {ddp:.2f}")
    rows.append(("DDP scaling efficiency, 2 gloo processes vs 1", f"{ddp / one / 2:.3f}", ">= 0.95", ddp / one / 2 >= 0.95))
    # Every figure as a number, printed last in one JSON line, for a program to read (tests/test_bench.py).
    figures = {"img_per_s": {"1 process": one, "2 without communication": alone, "2 with DDP": ddp},
               "ddp_efficiency": ddp / one / 2}

    overhead, step_s = loop_overhead(batch, size, steps, model_name=model_name)
    print(f"2. loop overhead: bare step {step_s * 1000:.0f} ms; main.py's train_one_epoch {overhead * 100:+.2f}%")
    rows.append(("main.py's step vs a bare step", f"{overhead * 100:+.2f}%", "<= 2%", overhead <= 0.02))
    figures.update(bare_step_s=step_s, loop_overhead=overhead)

    with tempfile.TemporaryDirectory() as tmp:
        rows += data_section(tmp, quick, figures)

        data = os.path.join(tmp, "data")
        size_wh = (256, 128) if quick else (1024, 512)
        write_synthetic(data, num_train=16 if quick else 48, num_val=6 if quick else 24, size=size_wh, seed=2)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        out = os.path.join(tmp, "out")
        common = ["--data", data, "--model", model_name, "--crop-size", "64" if quick else "256", "-b",
                  "2" if quick else "4", "-j", "0", "-p", "100", "--pretrained-backbone", "none", "--output-dir", out]
        run_main(2, common + ["--epochs", "1" if quick else "2"], env, quick)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            memory = json.loads(f.readlines()[-1])["peak_memory_gib"]
        excess = memory[0] / max(memory[1:]) - 1
        # With --quick the ranks are forked from this process, and a forked process's peak resident set starts at
        # its parent's resident size at the fork: each figure is this process's size (torch, sections 1-3) and what
        # the rank added; the ranks were forked alike, so rank 0's excess over the others still compares them.
        forked = " (forked: from this process's size at the fork)" if quick else ""
        print(f"4. peak resident memory per rank over {1 if quick else 2} epoch(s) of training, evaluation and "
              f"rank 0's checkpoints{forked}: " + ", ".join(f"rank {r} {m:.3f} GiB" for r, m in enumerate(memory)))
        rows.append(("rank 0's peak memory over the others'", f"{excess * 100:+.1f}%", "<= 5%", excess <= 0.05))
        figures.update(peak_memory_gib=memory, rank0_memory_excess=excess)

        times = {}
        for nproc in (1, 2):
            run_main(nproc, common + ["-e", "--resume", os.path.join(out, "checkpoint.pth")], env, quick)
            with open(os.path.join(out, "eval.json")) as f:
                times[nproc] = json.load(f)["eval_time_s"]
        print(f"5. evaluation of {6 if quick else 24} val images at {size_wh[0]}x{size_wh[1]}: 1 process "
              f"{times[1]:.2f} s, 2 processes {times[2]:.2f} s (speed-up {times[1] / times[2]:.2f}x)")
        rows.append(("evaluation speed-up, 2 processes vs 1", f"{times[1] / times[2]:.2f}x", "(reported)", None))
        figures["eval_time_s"] = {f"{nproc} process(es)": seconds for nproc, seconds in times.items()}

    print_table(rows)
    print(json.dumps(figures))


def print_table(rows):
    print(f"\n{'measure':<46} {'measured':>9} {'target':>9}  met")
    for what, measured, target, met in rows:
        print(f"{what:<46} {measured:>9} {target:>9}  {'-' if met is None else 'yes' if met else 'NO'}")


def data_section(tmp, quick, figures=None):
    """3. The data pipeline on photo-like frames (as large and as slow to decode as real ones). Its figures go into
    figures, where given."""
    torch.set_num_threads(1)  # a DataLoader worker's share
    root, cache_dir = os.path.join(tmp, "photo"), os.path.join(tmp, "cache")
    # --quick: a quarter of the pixels, the crop in the same proportion; the 3 turns of each way bench_data always
    # takes. Still photo-like PNGs through every way, so every figure is measured.
    size, crop = ((512, 256), 192) if quick else ((2048, 1024), 768)
    write_synthetic(root, num_train=2 if quick else 6, num_val=1, size=size, seed=1, photo=True)
    times, sizes = bench_data(root, cache_dir, crop, 0 if quick else 6)
    decoder = "torchcodec" if images._torchcodec_decode is not None else "PIL (torchcodec not installed)"
    print(f"3. data, photo-like {size[0]}x{size[1]} PNGs ({os.path.getsize(glob.glob(os.path.join(root, 'leftImg8bit', 'train', '*', '*'))[0]) / 1e6:.1f} MB) "
          f"to a {crop} crop, one worker, one thread, decoder {decoder}; samples/s:")
    print("   " + ", ".join(f"{name} {1 / t:.1f}" for name, t in times.items()))
    today, ours, cached = times["today"], times["ours"], times["ours, cached"]
    overhead = ours / times["decode alone"]
    print(f"   bytes a sample leaves a worker with: ours {sizes['ours']:,} (uint8), today {sizes['today']:,} "
          f"(float32 image)")
    if figures is not None:
        figures.update(data_samples_per_s={name: 1 / t for name, t in times.items()}, data_sample_bytes=sizes)
    rows = [("data pipeline vs resize-then-crop", f"{times['resize-then-crop'] / ours:.2f}x", ">= 1.7x",
             times["resize-then-crop"] / ours >= 1.7),
            ("data: ours vs today's (PIL, float in worker)", f"{today / ours:.2f}x", ">= 1.5x", today / ours >= 1.5),
            ("data: cached (warm) vs today's", f"{today / cached:.2f}x", ">= 6x", today / cached >= 6),
            ("data: sample time / its decode time", f"{overhead:.2f}x", "< 1.35x", overhead < 1.35),
            ("data: bytes a sample, today's / ours", f"{sizes['today'] / sizes['ours']:.2f}x", "(reported)", None)]
    if not quick:
        batch = 4
        batch_s, results = bench_prefetch(root, crop, batch, 20)
        print(f"   DataLoader, 2 workers, batch {batch}, uncached: a batch every {batch_s * 1000:.0f} ms")
        for speed, (step_s, waits) in results.items():
            print(f"   a step of {step_s * 1000:.0f} ms ({speed}x that): data wait a step, prefetch_factor 2: "
                  f"{waits[2] * 1000:.1f} ms, 4: {waits[4] * 1000:.1f} ms")
    return rows


# --- one GPU ----------------------------------------------------------------------------------------------------
def gpu_step_rate(dtype, channels_last, compile_model, batch, crop, steps, warmup, device="cuda",
                  model_name="deeplabv3plus_resnet101"):
    """images/s, peak GiB and warm-up seconds of the bare training step (the model alone: random images already
    on the device). device "cpu": the same measure on the CPU (tests/tools/gpu_check.sh --dry-run)."""
    torch.manual_seed(0)
    model = build_model(model_name, NUM_CLASSES).to(device).train()
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    forward = torch.compile(model) if compile_model else model
    images = torch.randn(batch, 3, crop, crop, device=device).contiguous(memory_format=memory_format)
    labels = torch.randint(0, NUM_CLASSES, (batch, crop, crop), device=device)
    cuda = device == "cuda"

    def step():
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = main.criterion(forward(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    start = time.perf_counter()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()  # the warm-up's queued work counts as warm-up
    warmup_s = time.perf_counter() - start
    elapsed, peak = _timed(step, steps, cuda)
    return batch * steps / elapsed, peak, warmup_s


def bench_gpu(batch, crop, steps, warmup):
    torch.backends.cudnn.benchmark = True  # fixed sizes: let cuDNN pick the fastest kernels once
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: DeepLabV3+ ResNet-101, "
          f"crop {crop}, batch {batch}, {steps} timed steps after {warmup}")
    configs = [("fp32", None, False, False), ("fp32 + channels_last", None, True, False),
               ("bf16 autocast", torch.bfloat16, False, False),
               ("bf16 + channels_last", torch.bfloat16, True, False),
               ("bf16 + channels_last + compile", torch.bfloat16, True, True)]
    base = None
    print(f"{'configuration':<32} {'img/s':>8} {'x fp32':>7} {'peak GiB':>9} {'warm-up s':>10}")
    for name, dtype, channels_last, compile_model in configs:
        rate, peak, warmup_s = gpu_step_rate(dtype, channels_last, compile_model, batch, crop, steps, warmup)
        torch.cuda.empty_cache()  # the last configuration's model is gone with its function's frame
        base = base or rate
        print(f"{name:<32} {rate:8.1f} {rate / base:7.2f} {peak:9.2f} {warmup_s:10.1f}", flush=True)


def _timed_bf16_steps(model, batch, crop, steps, warmup, gpus):
    """Seconds for `steps` SGD steps of model on random bf16 channels_last batches after `warmup` steps;
    the peak memory of each GPU numbered in `gpus` counts from the first timed step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    images = torch.randn(batch, 3, crop, crop, device="cuda").contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, dataset.NUM_CLASSES, (batch, crop, crop), device="cuda")
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            for gpu in gpus:
                torch.cuda.reset_peak_memory_stats(gpu)
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = main.criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _ddp_gpu_worker(rank, world_size, batch, crop, steps, warmup, port, result_file):
    """One process per GPU, as main.py runs: NCCL, SyncBatchNorm, DDP, bf16 autocast, channels_last."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(build_model("deeplabv3plus_resnet101", dataset.NUM_CLASSES))
    model = DDP(model.cuda().to(memory_format=torch.channels_last), device_ids=[rank], gradient_as_bucket_view=True)
    elapsed = _timed_bf16_steps(model, batch, crop, steps, warmup, [rank])
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump([elapsed, torch.cuda.max_memory_allocated() / 2**30], f)
    dist.destroy_process_group()


def bench_dp_vs_ddp(batch, crop, steps, warmup):
    """The tutorial's claim, measured: DataParallel (one process, the batch scattered over the GPUs, the
    outputs gathered and the loss computed on GPU 0) against DDP (a process per GPU), batch per GPU equal."""
    import torch.multiprocessing as mp
    gpus = torch.cuda.device_count()
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torch.nn.DataParallel(build_model("deeplabv3plus_resnet101", dataset.NUM_CLASSES).cuda()
                                  .to(memory_format=torch.channels_last))
    dp_rate = batch * gpus * steps / _timed_bf16_steps(model, batch * gpus, crop, steps, warmup, range(gpus))
    dp_memory = [torch.cuda.max_memory_allocated(gpu) / 2**30 for gpu in range(gpus)]
    del model
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "ddp")
        mp.spawn(_ddp_gpu_worker, args=(gpus, batch, crop, steps, warmup, _free_port(), result), nprocs=gpus)
        runs = [json.load(open(f"{result}.{rank}")) for rank in range(gpus)]
    ddp_rate = batch * gpus * steps / max(elapsed for elapsed, _ in runs)
    print(f"\nDataParallel against DDP on {gpus} GPUs, batch {batch} per GPU, crop {crop}, bf16 + channels_last:")
    print(f"{'':<14} {'img/s':>8} {'x DP':>6}  peak GiB per GPU")
    for name, rate, memory in (("DataParallel", dp_rate, dp_memory), ("DDP", ddp_rate, [m for _, m in runs])):
        print(f"{name:<14} {rate:8.1f} {rate / dp_rate:6.2f}  " + " ".join(f"{m:.2f}" for m in memory))


RANGES = {"batch": ("--batch", ("at least", 1)), "crop": ("--crop", ("at least", 16)),
          "steps": ("--steps", ("at least", 1)), "warmup": ("--warmup", ("at least", 0))}


def get_args_parser():
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the single-GPU precision/layout table")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU run: the tiny model, main.py "
                        "forked from this process, not launched): checks that it runs, not timings")
    parser.add_argument("--data", action="store_true", help="the data pipeline's measures alone (section 3)")
    parser.add_argument("--bucket-views", action="store_true", help="DDP's gradients zeroed in place against "
                        "set_to_none, side by side (with --gpu: on one GPU)")
    parser.add_argument("--checkpoint", action="store_true", help="what verifying a checkpoint (its CRC-32s) costs "
                        "on the recipe's checkpoint (ResNet-101)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--crop", type=int, default=768)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    return parser


def cli(argv=None):
    """bench.py's command line: argv (without it, sys.argv's) picks the measures. tests/test_bench.py calls it
    in its own process, which has imported torch already."""
    args = get_args_parser().parse_args(argv)
    check_numbers(args, RANGES)
    if args.checkpoint:
        times, size = checkpoint_check(rounds=1 if args.quick else 5)
        print(f"CPU: {os.cpu_count()} cores, torch {torch.__version__}: the recipe's checkpoint, {size / 1e6:.0f} MB "
              f"(DeepLabV3+ ResNet-101 with SGD's momentum), on {tempfile.gettempdir()}; the fastest of the rounds:")
        for name, seconds in times.items():
            print(f"  {name:<62} {seconds:6.2f} s")
        _, load, read, crc, sha = times.values()
        print(f"  a verified read / torch.load alone: {read / load:.2f}x; the CRC-32 check / a SHA-256: {crc / sha:.2f}x")
    elif args.bucket_views:
        print(f"{torch.cuda.get_device_name() if args.gpu else f'CPU: {os.cpu_count()} cores'}, torch "
              f"{torch.__version__}: DDP, gradient_as_bucket_view=True")
        results = bucket_views("cuda" if args.gpu else "cpu", rounds=1 if args.gpu else 3, quick=args.quick)
        print_table(print_bucket_views(results))
        print(json.dumps({way: list(values) for way, values in results.items()}))
    elif args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("bench.py --gpu: no CUDA device visible")
        bench_gpu(args.batch, args.crop, args.steps, args.warmup)
        if torch.cuda.device_count() >= 2:
            bench_dp_vs_ddp(args.batch, args.crop, args.steps, args.warmup)
    elif args.data:
        print(f"CPU: {os.cpu_count()} cores, torch {torch.__version__}")
        with tempfile.TemporaryDirectory() as tmp:
            print_table(data_section(tmp, args.quick))
    else:
        bench_cpu(args.quick)


if __name__ == "__main__":
    with recovery.guard("bench.py"):  # a stop or Ctrl-C, a mistake: one line
        cli()
