"""Measure, side by side in one run, and print ratios against their targets.

    python bench.py              # the CPU: DDP scaling, loop overhead, data pipeline, memory, evaluation
    python bench.py --gpu        # one GPU: DeepLabV3+ ResNet-101, crop 768, batch 8, per precision/layout

Each configuration runs the same model, batch and step (forward, cross-entropy, backward, SGD) on
random images; the first steps (and torch.compile's compilation) are left out of the timing.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2

import dataset

import main
from dataset import NUM_CLASSES
from models import build_model


def _rate(fn, seconds):
    """Calls per second of fn, run for about `seconds` after one warm-up call."""
    fn()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        count += 1
    return count / (time.perf_counter() - start)


def bench_data(root, seconds):
    """Images per second per worker: our training transform against resize-the-whole-image-then-crop
    (torchvision's segmentation reference), both from the PNG files to normalised tensors, crop 768."""
    ours = dataset.Cityscapes(root, "train", crop_size=(768, 768))
    reference_transform = v2.Compose([
        v2.RandomResize(512, 2048),  # the shorter side 1024 times 0.5-2.0, the whole image
        v2.RandomCrop(768, pad_if_needed=True, fill={tv_tensors.Image: 0, tv_tensors.Mask: 255}),
        v2.RandomHorizontalFlip(), v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
        v2.Normalize(dataset.MEAN, dataset.STD)])
    counter = {"i": 0}

    def reference():
        i = counter["i"] = (counter["i"] + 1) % len(ours)
        with Image.open(ours.images[i]) as f:
            image = tv_tensors.Image(torch.from_numpy(np.array(f.convert("RGB"))).permute(2, 0, 1))
        with Image.open(ours.targets[i][0]) as f:
            label = tv_tensors.Mask(dataset.ID_TO_TRAINID[torch.from_numpy(np.array(f)).long()][None])
        reference_transform(image, label)

    def mine():
        counter["i"] = (counter["i"] + 1) % len(ours)
        ours[counter["i"]]

    theirs, ours_rate = _rate(reference, seconds), _rate(mine, seconds)
    return ours_rate, theirs


def gpu_step_rate(dtype, channels_last, compile_model, batch, crop, steps, warmup):
    torch.manual_seed(0)
    model = build_model("deeplabv3plus_resnet101", NUM_CLASSES).cuda().train()
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    forward = torch.compile(model) if compile_model else model
    images = torch.randn(batch, 3, crop, crop, device="cuda").contiguous(memory_format=memory_format)
    labels = torch.randint(0, NUM_CLASSES, (batch, crop, crop), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = main.criterion(forward(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    start = time.time()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warmup_s = time.time() - start
    torch.cuda.reset_peak_memory_stats()
    start = time.time()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.time() - start
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, optimizer, forward
    torch.cuda.empty_cache()
    return batch * steps / elapsed, peak, warmup_s


def bench_gpu(batch, crop, steps, warmup):
    torch.backends.cudnn.benchmark = True  # fixed sizes: let cuDNN pick the fastest kernels once
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: DeepLabV3+ ResNet-101, "
          f"crop {crop}, batch {batch}, {steps} timed steps after {warmup}")
    configs = [("fp32", None, False, False), ("bf16 autocast", torch.bfloat16, False, False),
               ("bf16 + channels_last", torch.bfloat16, True, False),
               ("bf16 + channels_last + compile", torch.bfloat16, True, True)]
    base = None
    print(f"{'configuration':<32} {'img/s':>8} {'x fp32':>7} {'peak GiB':>9} {'warm-up s':>10}")
    for name, dtype, channels_last, compile_model in configs:
        rate, peak, warmup_s = gpu_step_rate(dtype, channels_last, compile_model, batch, crop, steps, warmup)
        base = base or rate
        print(f"{name:<32} {rate:8.1f} {rate / base:7.2f} {peak:9.2f} {warmup_s:10.1f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the single-GPU precision/layout table")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--crop", type=int, default=768)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("bench.py --gpu: no CUDA device visible")
        bench_gpu(args.batch, args.crop, args.steps, args.warmup)
