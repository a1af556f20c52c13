#!/usr/bin/env bash
# One command for a GPU machine lent for a few minutes (docs/gpu.md): the GPU tier's steps in
# order of what they settle, each given what is left of one deadline, every step's whole output
# kept in OUT_DIR (a step stopped at the deadline still leaves its log). Needs .gpu/ from
# `make gpu-carry`, like scripts/gpu_run.sh, which runs each step.
#   bash scripts/gpu_lease.sh OUT_DIR [SECONDS]   # SECONDS: the deadline, default 560
# Steps: the whole tier in one pytest process (the derived targets under the CUDA branch, then
# the engine tests: the CUDA IPC update after the engine-start test), the CUDA IPC update test
# once more on its own, the one-GPU proof that a data-plane wait running out on NCCL leaves
# the process alive (test/gpu/test_nccl_timeout.py, about a minute: kept out of the tier's
# step so that its own log says how it went), the 8B-shaped benchmark with the engine's phase
# lines.
# OUT_DIR/steps.txt says how each ended.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_lease.sh OUT_DIR [SECONDS]}
LIMIT=${2:-560}
mkdir -p "$OUT"
T0=$SECONDS

step() {
  local name=$1 left=$((LIMIT - (SECONDS - T0))) t1=$SECONDS rc=0
  shift
  if [ "$left" -lt 30 ]; then
    echo "$name: not run, ${left} s left" | tee -a "$OUT/steps.txt"
    return
  fi
  timeout -k 5 "$left" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  echo "$name: rc=$rc in $((SECONDS - t1)) s$([ $rc = 124 ] && echo ', stopped at the deadline')" \
    | tee -a "$OUT/steps.txt"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__)'
} > "$OUT/steps.txt" 2>&1
step tier bash scripts/gpu_run.sh --ignore=test/gpu/test_nccl_timeout.py
step ipc_again bash scripts/gpu_run.sh test/gpu/test_engine_gpu.py -k ipc
step nccl_timeout bash scripts/gpu_run.sh test/gpu/test_nccl_timeout.py -rA
step bench bash scripts/gpu_run.sh --bench --json "$OUT/bench.json" --log-level info
cat "$OUT/steps.txt"
