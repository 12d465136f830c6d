#!/usr/bin/env bash
# The checks that need CUDA (the CPU suite cannot make them): run on a machine with 1 or more GPUs.
#   bash tests/gpu_check.sh
# run.sh on every visible GPU (NCCL, SyncBatchNorm, DDP with device_ids, bf16 autocast), resume with
# fp16 and a GradScaler, -e with --save-predictions, the recipe's sizes on photo-like 2048x1024 PNGs
# (as slow to decode as Cityscapes'; crop 768, global batch 16, full-resolution evaluation) in bf16 with
# -j 4, from the PNGs and from --cache-dir (compare with bench.py --gpu's model-only rate), one image per GPU,
# and preemption (SIGTERM to run.sh: the step finishes, a checkpoint is saved, exit 0, resume).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${TMPDIR:-/tmp}/gpu_check
rm -rf "$T"; mkdir -p "$T"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
python dataset.py --synthetic "$T/small" --num-train 32 --num-val 6 --size 512 256 &
python dataset.py --synthetic "$T/full" --num-train 64 --num-val 3 --size 2048 1024 --seed 1 --photo &
wait
R=(--model deeplabv3plus_resnet101 --pretrained-backbone none -j 4 -p 4)
echo "== 1. run.sh: nccl, SyncBN, DDP, bf16 autocast, eval, checkpoint"
DATA=$T/small OUTPUT_DIR=$T/o1 ./run.sh "${R[@]}" --crop-size 256 -b 4 --epochs 2 --amp 2>&1 | grep -v "^  "
echo "== 2. --resume auto with fp16 and a GradScaler"
DATA=$T/small OUTPUT_DIR=$T/o1 ./run.sh "${R[@]}" --crop-size 256 -b 4 --epochs 3 --amp fp16 --resume auto 2>&1 | grep -v "^  "
echo "== 3. -e with --save-predictions"
DATA=$T/small OUTPUT_DIR=$T/o1 ./run.sh "${R[@]}" -e --resume "$T/o1/checkpoint.pth" --save-predictions "$T/preds" 2>&1 | tail -3
ls "$T/preds" | head -3; python -c "import json; print(json.load(open('$T/o1/eval.json'))['num_images'])"
echo "== 4. the recipe's sizes on photo-like 2048x1024 PNGs, bf16, -j 4: from the PNGs, then decoded once (--cache-dir)"
DATA=$T/full OUTPUT_DIR=$T/o2 ./run.sh --pretrained-backbone none --epochs 1 -p 1 -j 4 --amp 2>&1 | grep -v "^  "
python dataset.py --prepare-cache "$T/cache" --data "$T/full" --split train val
DATA=$T/full OUTPUT_DIR=$T/o3 ./run.sh --pretrained-backbone none --epochs 1 -p 1 -j 4 --amp --cache-dir "$T/cache" 2>&1 | grep -v "^  "
echo "== 5. one image per GPU (ASPP's pooling BatchNorm on a 1x1 map)"
DATA=$T/small OUTPUT_DIR=$T/o4 ./run.sh "${R[@]}" --crop-size 256 -b 1 --epochs 1 -p 16 --amp 2>&1 | grep -E "^epoch 0:|error"
echo "== 6. preemption on the GPU: SIGTERM to run.sh mid-epoch, exit 0, then resume to the end"
DATA=$T/small OUTPUT_DIR=$T/o5 ./run.sh "${R[@]}" --crop-size 256 -b 2 --epochs 2 -p 1 > "$T/o5.log" 2>&1 &
RUN=$!
for _ in $(seq 600); do grep -q "epoch 0 step 3/" "$T/o5.log" 2>/dev/null && break; sleep 0.2; done
kill -TERM $RUN; STATUS=0; wait $RUN || STATUS=$?
grep -E "stopped by signal|error" "$T/o5.log"; echo "run.sh exit status after SIGTERM: $STATUS"; [ "$STATUS" -eq 0 ]
DATA=$T/small OUTPUT_DIR=$T/o5 ./run.sh "${R[@]}" --crop-size 256 -b 2 --epochs 2 -p 100 --resume auto 2>&1 | grep -E "resuming|^epoch [0-9]:|done|error"
cp "$T"/o2/metrics.jsonl "${OUT:-$T}/metrics_bf16.jsonl" 2>/dev/null || true
echo "gpu_check: all passed"
