#!/usr/bin/env bash
# The checks that need CUDA, in one call of at most 5 minutes on one GPU (its data made in seconds):
#   bash tests/tools/gpu_check.sh [--out DIR]     # on a GPU machine
#   bash tests/tools/gpu_check.sh --dry-run       # the same steps on the CPU at tiny sizes: prove the script first
#   bash tests/tools/gpu_check.sh --plan          # the commands it runs
# Results go to DIR/gpu_check.json as each step ends (tests/tools/gpu_check.py says what each key means).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python}" tests/tools/gpu_check.py "$@"
