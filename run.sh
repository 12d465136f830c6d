#!/usr/bin/env bash
# Launch main.py with torchrun: one process per visible GPU, or NPROC gloo processes on the CPU.
#
#   CUDA_VISIBLE_DEVICES=0,1 ./run.sh                  # 2 GPUs, main.py's recipe on data/cityscapes
#   ./run.sh --epochs 10 --lr 0.02                     # arguments after run.sh go to main.py (and win)
#   NPROC=4 ./run.sh                                   # on a CPU: 4 gloo processes (default 2)
#   DATA=/datasets/cityscapes OUTPUT_DIR=runs/r101 ./run.sh
#   DATA=data/my_data OUTPUT_DIR=runs/mine ./run.sh    # your own data: images/, masks/, classes.json
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 ./run.sh   # on node 0; NODE_RANK=1 on node 1
#   MAX_RESTARTS=3 ./run.sh                            # torchrun restarts failed workers; they resume
#
# With DATA not set and nothing in data/cityscapes, it writes a synthetic set once (data/cityscapes_synthetic)
# and trains a demo sized for a laptop CPU into output/demo: about 3 minutes on 2 cores (BENCHMARKS.md, by
# machine). Paths (DATA, OUTPUT_DIR, the arguments) are relative to where you run it, as for any command.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)  # where main.py and the other programs are

fail() { echo "run.sh: error: $*" >&2; exit 1; }
# Started from a folder that was deleted (removed, or replaced by a checkout), torch's import dies in oneMKL's "Cannot
# load libtorch_cpu.so", before any line of the program runs; and relative paths would lead nowhere.
pwd -P >/dev/null 2>&1 \
  || fail "the folder you are in was deleted: cd to a folder that exists, then run again"
case " $* " in *" -h "* | *" --help "*)  # what run.sh does, then main.py's options
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  echo "Arguments after ./run.sh go to main.py: python $ROOT/main.py --help lists them (run.sh passes -b and"
  echo "--accum-steps, or the demo's settings, first; yours come after and win). Variables: docs/options.md."
  exit 0;;
esac
# main.py's advice then names what the user typed here (OUTPUT_DIR, DATA, ./run.sh again), not the flags made of it.
export DEEPLAB_RUN_SH=1
# A whole number of at least $2 in variable $1, or one line naming it. Made plain decimal in place: bash's
# arithmetic reads a leading 0 as octal (NPROC=08 an error, NPROC=010 eight), and wraps past 2**63 without a word.
need_number() {
  local given=${!1}
  [[ "$given" =~ ^[0-9]+$ ]] || fail "$1=$given: give a whole number of at least $2"
  local digits=${given#"${given%%[!0]*}"}  # without its leading zeros
  [ "${#digits}" -le 9 ] || fail "$1=$given: give a whole number of at most 999999999"
  printf -v "$1" '%d' "$(( 10#$given ))"
  [ "${!1}" -ge "$2" ] || fail "$1=$given: give a whole number of at least $2"
}

DATA_GIVEN=${DATA:-}  # a data set named on purpose: an error if it holds none, never the demo
DATA=${DATA:-data/cityscapes}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
SYNTHETIC=${SYNTHETIC:-data/cityscapes_synthetic}
MAX_RESTARTS=${MAX_RESTARTS:-3}
JOIN_TIMEOUT=${JOIN_TIMEOUT:-600}
STOP_STATUS=${STOP_STATUS:-0}  # the exit status after a stop every worker saved (a scheduler's script may requeue)
for VAR in NNODES MASTER_PORT JOIN_TIMEOUT; do need_number "$VAR" 1; done
for VAR in NODE_RANK MAX_RESTARTS STOP_STATUS; do need_number "$VAR" 0; done
[ "$STOP_STATUS" -le 255 ] || fail "STOP_STATUS=$STOP_STATUS: an exit status is at most 255"
[ "$NODE_RANK" -lt "$NNODES" ] || fail "NODE_RANK=$NODE_RANK: nodes are numbered 0 to NNODES-1 ($(( NNODES - 1 )))"
[ "$MASTER_PORT" -le 65535 ] || fail "MASTER_PORT=$MASTER_PORT: a port is at most 65535"
[ -z "${NPROC:-}" ] || need_number NPROC 1
# Every Python step (the GPU count, the synthetic set, the check, torchrun and so its workers) runs on $PYTHON: one
# that is not there is said here, before a step could read its absence as "no PyTorch".
command -v "$PYTHON" >/dev/null \
  || fail "PYTHON=$PYTHON: no such program: set PYTHON to the Python that has PyTorch (PYTHON=/path/to/python ./run.sh)"

# A stop while run.sh prepares ends in one line: Ctrl-C (SIGINT), SIGTERM, the terminal closing (SIGHUP), or
# SIGUSR1/SIGUSR2 (what a scheduler may be told to send before a job's time is up). (A run.sh started where SIGINT
# is ignored, in the background of a script, keeps ignoring it: bash's `trap -` would turn it back on.)
INT_IGNORED=$(trap -p INT)
on_stop() {  # on_stop COMMAND: run COMMAND on a stop signal; on_stop -: as before
  trap "$1" TERM HUP USR1 USR2
  [ -n "$INT_IGNORED" ] || trap "$1" INT
}
# A line to the terminal, which may have closed (SIGHUP), or to a pipe whose reader has gone (`| tee log`): the
# subshell takes the failed write, or the SIGPIPE, never run.sh.
say() { (echo "$@") 2>/dev/null || true; }
# The Python steps before training (the synthetic set, the check) run in the background, waited for: a Ctrl-C
# then reaches run.sh alone (a background process of a script ignores it), which stops the step and says so in
# one line, instead of Python's traceback from wherever the step was (importing torch, say).
run_step() {  # run_step WHAT COMMAND...: WHAT names the step in the stop line; STOP_WAIT=0: do not wait for it
  local what=$1
  shift
  "$@" &
  STEP=$!
  local ends="kill -TERM $STEP 2>/dev/null; wait $STEP 2>/dev/null || true"  # (a step cleans up what it began)
  [ "${STOP_WAIT:-1}" = 1 ] || ends="kill -KILL $STEP 2>/dev/null"
  on_stop "$ends; say \"run.sh: stopped while $what; nothing was started. Run the same ./run.sh line again to begin\" >&2; exit 130"
  STATUS=0
  wait "$STEP" || STATUS=$?
  on_stop -
  return "$STATUS"
}

CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # (nproc alone counts OMP_NUM_THREADS, not cores)
if [ "${CUDA_VISIBLE_DEVICES-unset}" = "" ]; then
  NGPU=0  # GPUs hidden on purpose: no need to start Python to count them
else
  # In the background, waited for, as every Python step before training: a stop ends it at once, and does not wait
  # for a driver that does not answer (a command substitution would wait for Python before run.sh could act).
  COUNT=$(mktemp -d "${TMPDIR:-/tmp}/deeplab-gpus.XXXXXX") \
    || fail "TMPDIR=${TMPDIR:-/tmp} cannot be written: set TMPDIR to a folder of this machine that can be written"
  trap 'rm -rf "$COUNT"' EXIT
  # A full disk may still take the empty folder, but not Python's lines, which land in it: a test line first.
  WROTE=$( { printf 'a test line\n' > "$COUNT/probe"; } 2>&1 ) \
    || fail "TMPDIR=${TMPDIR:-/tmp} cannot be written (${WROTE##*: }): free space there, or set TMPDIR to another folder"
  STATUS=0
  # What Python says goes to a file (the step's own redirection: run_step's stop line still reaches the terminal).
  STOP_WAIT=0 run_step "counting the GPUs" sh -c 'exec "$0" -c "import torch; print(torch.cuda.device_count())" \
    > "$1/gpus" 2> "$1/said"' "$PYTHON" "$COUNT" || STATUS=$?
  NGPU=$(cat "$COUNT/gpus")
  # The line that names the error: an exception's, or a fatal error's first (Python's state follows it), else the last.
  SAID=$(grep -E '^(Fatal Python error: |[A-Za-z_][A-Za-z0-9_.]*(Error|Exception)(: |$))' "$COUNT/said" \
    | tail -n 1 || true)
  [ -n "$SAID" ] || SAID=$(grep -v '^[[:space:]]*$' "$COUNT/said" | tail -n 1 || true)
  if [ "$STATUS" -eq 0 ]; then
    (cat "$COUNT/said" >&2) 2>/dev/null || true  # a warning of PyTorch's (a driver too old, say) is for the user
  fi
  rm -rf "$COUNT"; trap - EXIT
  if [ "$STATUS" -ne 0 ] || ! [[ "$NGPU" =~ ^[0-9]+$ ]]; then
    # Advice only where the error gives it: PyTorch missing; anything else is said in Python's own words.
    [ "$SAID" != "ModuleNotFoundError: No module named 'torch'" ] || fail "PYTHON=$PYTHON has no PyTorch ($SAID):" \
      "pip install -r $ROOT/requirements.txt with it, or set PYTHON to the Python that has it"
    fail "PYTHON=$PYTHON cannot count the GPUs (python -c \"import torch; print(torch.cuda.device_count())\"):" \
      "${SAID:-it said nothing, exit status $STATUS}"
  fi
  if [ "$NGPU" -eq 0 ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    say "run.sh: note: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES, but PyTorch sees no GPU: running on the CPU"
  fi
fi
if [ "$NGPU" -gt 0 ]; then
  NPROC=${NPROC:-$NGPU}
  [ "$NPROC" -le "$NGPU" ] || fail "NPROC=$NPROC but $NGPU GPU(s) visible: one process per GPU at most"
else
  NPROC=${NPROC:-2}
  # One process per core at most: more threads than cores make every process slower.
  THREADS=$(( CORES / NPROC )); [ "$THREADS" -ge 1 ] || THREADS=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS}
fi
WORLD=$(( NPROC * NNODES ))

# Real data: Cityscapes, or your own (images/, masks/ and classes.json, docs/your-data.md); also a DATA given on
# purpose, or a data/cityscapes with something in it, that holds neither: main.py's check names what is missing.
# The demo only where nothing was named and data/cityscapes is missing or empty.
if compgen -G "$DATA/leftImg8bit/train/*/*_leftImg8bit.png" >/dev/null || [ -f "$DATA/classes.json" ] \
    || [ -d "$DATA/images" ] || [ -n "$DATA_GIVEN" ] || [ -n "$(ls -A "$DATA" 2>/dev/null)" ]; then
  OUTPUT_DIR=${OUTPUT_DIR:-output}
  # main.py's defaults are the recipe (VainF/DeepLabV3Plus-Pytorch's: DeepLabV3+ ResNet-101, output stride 16,
  # crop 768, global batch 16, lr 0.1 with the backbone at 0.01, 30k iterations, ImageNet backbone). run.sh
  # keeps the global batch at 16 with at most the two-GPU layout's 8 images per process and forward (about
  # 9 GiB with --amp, 15 in fp32: docs/memory.md): one process accumulates two batches of 8 (--accum-steps 2:
  # the gradient of 16 images, but BatchNorm's statistics over each forward's 8, where two GPUs' cover 16),
  # two take 8 each, four 4, eight 2. Other counts take the -b nearest 16 / processes (3 GPUs: 5, a global
  # batch of 15; 6: 3, 18; 7: 2, 14), and --base-batch 16 scales --lr with the global batch (main.py says so).
  BATCH=$(( (32 + WORLD) / (2 * WORLD) )); [ "$BATCH" -ge 1 ] || BATCH=1
  [ "$BATCH" -le 8 ] || BATCH=8
  ACCUM=$(( 16 / (BATCH * WORLD) )); [ "$ACCUM" -ge 1 ] || ACCUM=1
  ARGS=(-b "$BATCH" --accum-steps "$ACCUM" --base-batch 16)
else
  # The demo writes into a folder of its own, so that a run on real data later does not meet it in output/.
  OUTPUT_DIR=${OUTPUT_DIR:-output/demo}
  say "run.sh: no Cityscapes in $DATA (docs/cityscapes.md says how to get it): the demo, on a synthetic set, in $OUTPUT_DIR"
  if [ ! -d "$SYNTHETIC" ]; then  # written whole or not at all (synthetic.py: a temporary folder, renamed)
    run_step "writing the synthetic set $SYNTHETIC (it appears whole or not at all)" \
      "$PYTHON" "$ROOT/synthetic.py" "$SYNTHETIC" --num-train 300 --num-val 60 --num-test 20 --size 192 96 -j "$CORES"
  fi
  DATA=$SYNTHETIC
  # Sized to end within 5 minutes on a slow 2-core CPU: 7 epochs of 96x96 crops, from scratch, without
  # the recipe's colour jitter (in so short a run the model learns faster on scenes as val shows them).
  ARGS=(--model deeplabv3plus_mobilenet_v3_large --pretrained-backbone none --crop-size 96 -b 8 --lr 0.05
        --backbone-lr 1 --color-jitter 0 --epochs 7 -j 1 -p 6)
fi

if [ "$NNODES" -gt 1 ]; then
  # torchrun's c10d rendezvous: the node at MASTER_ADDR hosts it at MASTER_PORT; every node runs this same
  # line. OUTPUT_DIR must be on a filesystem all nodes share: rank 0 writes, every rank reads to resume.
  LAUNCH=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-backend c10d
          --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-deeplab}"
          --rdzv-conf "join_timeout=$JOIN_TIMEOUT")
else
  LAUNCH=(--standalone)  # a free port on this machine, no rendezvous server to set up
  # One machine: gloo's connections between the workers on the loopback alone (Linux's lo), not on an address other
  # machines reach, unless GLOO_SOCKET_IFNAME is set. (torch's stores listen on every interface whatever the address
  # they are given: docs/how-it-works.md.)
  if [ -z "${GLOO_SOCKET_IFNAME:-}" ] && [ -e /sys/class/net/lo ]; then export GLOO_SOCKET_IFNAME=lo; fi
fi
# --resume auto: run again, the same line carries on from the run's last checkpoint (an epoch's end, or where a
# stop saved; and says so when it had finished); arguments after ./run.sh come last and win.
MAIN=("$ROOT/main.py" --data "$DATA" --output-dir "$OUTPUT_DIR" --resume auto "${ARGS[@]}" "$@")

# Check the arguments, the data and any --resume in one plain process first: a mistake ends here with one
# line, instead of in every worker, in torchrun's report, and again in each of torchrun's restarts.
# Exit status 3 (harness/errors.py's NOTHING_TO_TRAIN): the run it would resume has finished, and the check said
# so. On one node that is all: no worker would do more than say it again. Several nodes still start torchrun: each
# node's check decides alone, and a node that stopped here would keep the others waiting at the rendezvous for up
# to JOIN_TIMEOUT. The workers then compare what each rank resumes from (a stale copy of the checkpoint on one node
# ends the run with one line, not a hang), and rank 0 says "nothing to train" again.
STATUS=0
run_step "checking the arguments and the data" "$PYTHON" "${MAIN[@]}" --check-only "$WORLD" || STATUS=$?
if [ "$STATUS" -eq 3 ] && [ "$NNODES" -eq 1 ]; then exit 0; fi
[ "$STATUS" -eq 0 ] || [ "$STATUS" -eq 3 ] || exit "$STATUS"

say "run.sh: $NPROC process(es) on this node, $NNODES node(s), data $DATA, output $OUTPUT_DIR"
# torchrun restarts all workers when one fails (MAX_RESTARTS times); main.py then resumes by itself from
# the last checkpoint. It runs in a session of its own so that a Ctrl-C reaches run.sh alone, which
# passes it on to the workers: they finish the step, save, and exit 0, and so does torchrun. A second
# Ctrl-C or SIGTERM stops torchrun and its workers at once.
# Workers get a store of their own for each attempt: when they share torchrun's rendezvous store, a
# restarted worker can read the previous attempt's addresses and fail to connect (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# A signal that comes while a worker is still starting (importing torch, before its handlers) is ignored by it,
# or kills it and torchrun starts it again to train on: the first signal is also written here, where workers look.
STOP_DIR=$(mktemp -d "${TMPDIR:-/tmp}/deeplab-stop.XXXXXX") \
  || fail "TMPDIR=${TMPDIR:-/tmp} cannot be written: set TMPDIR to a folder of this machine that can be written"
export DEEPLAB_STOP_FILE="$STOP_DIR/signal"
WATCHER=
trap 'rm -rf "$STOP_DIR"; [ -z "$WATCHER" ] || kill "$WATCHER" 2>/dev/null || true' EXIT
# SIGUSR1 and SIGUSR2 ignored by torchrun (their default would kill it), and SIGTERM (torchrun's agent would turn it
# into an exception: it stops the workers, kills them 30 s later, and exits 1 with a traceback, saved or not): a
# scheduler that sends one to every process of the job (Slurm's --signal) leaves it to run.sh and the workers,
# which save and exit 0, and torchrun with them. It stops at once on SIGINT (below).
# (The workers inherit SIGTERM ignored: each takes it back as it starts, recovery.py.) torchrun's own handlers are
# those PET_SIGNALS_TO_HANDLE names, the variable of its --signals-to-handle: an older torchrun, which has no such
# option, passes over the variable and keeps its SIGTERM handler (the workers still save; torchrun exits 1).
trap '' USR1 USR2
# torchrun starts the workers with $PYTHON_EXEC where it is set, else with its own interpreter: without it, the
# workers run on the same $PYTHON as the check above, whatever an environment left in PYTHON_EXEC.
unset PYTHON_EXEC
( trap '' TERM
  PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT exec setsid "$PYTHON" -m torch.distributed.run "${LAUNCH[@]}" \
    --nproc_per_node "$NPROC" --max-restarts "$MAX_RESTARTS" "${MAIN[@]}" ) &
LAUNCHER=$!
if [ "$NNODES" -gt 1 ]; then
  # Waiting for the other nodes says so, once after a few seconds and then every minute: how many have joined
  # the rendezvous at MASTER_ADDR:MASTER_PORT, and when torchrun gives up (harness/rendezvous.py).
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c 'import sys, harness.rendezvous; harness.rendezvous.watch_rendezvous(*sys.argv[1:])' \
    "$MASTER_ADDR:$MASTER_PORT" "${RDZV_ID:-deeplab}" "$NNODES" "$JOIN_TIMEOUT" &
  WATCHER=$!
fi
SIGNALS=0
forward() {
  SIGNALS=$(( SIGNALS + 1 ))
  # SIGHUP (the terminal closed) goes on as SIGHUP: the workers then print nowhere, not into the closed terminal.
  # Every other stop goes on as SIGTERM, also a Ctrl-C: a worker still starting (importing torch) has SIGTERM
  # ignored, as torchrun passed it on, and once started finds the stop file and ends with exit 0, where SIGINT would
  # print a KeyboardInterrupt traceback; a restarted one does the same. Once training, the workers take each signal
  # alike: they save, and stop.
  local as=TERM
  [ "$1" != HUP ] || as=HUP
  # The signal is passed on first, then said: saying it may fail (a closed terminal, a pipe whose reader is gone).
  if [ "$SIGNALS" -eq 1 ] && pgrep -P "$LAUNCHER" >/dev/null; then
    { echo "$1" > "$DEEPLAB_STOP_FILE"; } 2>/dev/null || true   # (the workers that run get the signal itself)
    pkill "-$as" -P "$LAUNCHER" || true
    say "run.sh: got SIG$1: the workers save a checkpoint at the end of this step and stop (again to stop at once)"
  else
    # A second signal; or no worker running (torchrun waits for the other nodes, or between restarts). torchrun
    # stops its workers on SIGINT; with none, nothing runs that could save, and SIGKILL ends it at once, without
    # Python's KeyboardInterrupt traceback (and also where SIGINT is ignored: a run.sh started in a script's
    # background).
    { echo "$1" > "$DEEPLAB_STOP_FILE"; } 2>/dev/null || true
    if pgrep -P "$LAUNCHER" >/dev/null; then
      kill -INT "$LAUNCHER" 2>/dev/null || true
    else
      kill -KILL "$LAUNCHER" 2>/dev/null || true
    fi
    [ "$SIGNALS" -gt 1 ] || say "run.sh: got SIG$1 while no worker ran: stopping torchrun; what was saved stays"
  fi
}
for SIG in TERM HUP USR1 USR2; do trap "forward $SIG" "$SIG"; done
[ -n "$INT_IGNORED" ] || trap 'forward INT' INT
while :; do
  STATUS=0; wait "$LAUNCHER" || STATUS=$?   # (not a bare wait: set -e would end run.sh here)
  kill -0 "$LAUNCHER" 2>/dev/null || break   # wait returns early when a signal arrives
done
# torchrun exits 0 when every worker of its last attempt did; after a stop, a worker exits 0 once its part is saved
# (rank 0's checkpoint written) or when it had nothing to save (stopped before it began). STOP_STATUS says so to a
# scheduler's script (docs/cityscapes.md's requeues the job on it). Not told apart: a worker that failed after the
# stop without saving, restarted by torchrun into an attempt that ends at once; the run then goes on from its last
# checkpoint, an epoch's end or an earlier stop's.
[ "$STATUS" -ne 0 ] || [ "$SIGNALS" -eq 0 ] || exit "$STOP_STATUS"
exit "$STATUS"
