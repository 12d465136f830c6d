#!/usr/bin/env bash
# The checks that need CUDA (the CPU suite cannot make them): run on a machine with 1 or more GPUs.
#   bash tests/gpu_check.sh
# run.sh on every visible GPU (NCCL, SyncBatchNorm, DDP with device_ids, bf16 autocast), resume with
# fp16 and a GradScaler, -e with --save-predictions, then the published recipe's sizes on full-size
# 2048x1024 images (crop 768, batch 8 per GPU, full-resolution evaluation) in bf16 and fp32.
set -euo pipefail
cd "$(dirname "$0")/.."
T=${TMPDIR:-/tmp}/gpu_check
rm -rf "$T"; mkdir -p "$T"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
python dataset.py --synthetic "$T/small" --num-train 32 --num-val 6 --size 512 256 &
python dataset.py --synthetic "$T/full" --num-train 48 --num-val 3 --size 2048 1024 --seed 1 &
wait
R=(--model deeplabv3plus_resnet101 --pretrained-backbone none -j 4 -p 4)
echo "== 1. run.sh: nccl, SyncBN, DDP, bf16 autocast, eval, checkpoint"
DATA=$T/small OUTPUT_DIR=$T/o1 ./run.sh "${R[@]}" --crop-size 256 -b 4 --epochs 2 --amp 2>&1 | grep -v "^  "
echo "== 2. --resume auto with fp16 and a GradScaler"
DATA=$T/small OUTPUT_DIR=$T/o1 ./run.sh "${R[@]}" --crop-size 256 -b 4 --epochs 3 --amp fp16 --resume auto 2>&1 | grep -v "^  "
echo "== 3. -e with --save-predictions"
DATA=$T/small OUTPUT_DIR=$T/o1 ./run.sh "${R[@]}" -e --resume "$T/o1/checkpoint.pth" --save-predictions "$T/preds" 2>&1 | tail -3
ls "$T/preds" | head -3; python -c "import json; print(json.load(open('$T/o1/eval.json'))['num_images'])"
echo "== 4. recipe sizes on 2048x1024 images: bf16, then fp32"
DATA=$T/full OUTPUT_DIR=$T/o2 ./run.sh --pretrained-backbone none --epochs 1 -p 1 -j 6 --amp 2>&1 | grep -v "^  "
DATA=$T/full OUTPUT_DIR=$T/o3 ./run.sh --pretrained-backbone none --epochs 1 -p 1 -j 6 2>&1 | grep -v "^  "
cp "$T"/o2/metrics.jsonl "${OUT:-$T}/metrics_bf16.jsonl" 2>/dev/null || true
cp "$T"/o3/metrics.jsonl "${OUT:-$T}/metrics_fp32.jsonl" 2>/dev/null || true
cp "$T"/o2/vis/epoch_000.png "${OUT:-$T}/vis_full.png" 2>/dev/null || true
echo "gpu_check: all passed"
