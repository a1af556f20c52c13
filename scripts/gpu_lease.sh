#!/usr/bin/env bash
# One command for a GPU machine lent for a few minutes (docs/gpu.md): the GPU tier's steps in
# order of what they settle, each given what is left of one deadline, every step's whole output
# kept in OUT_DIR (a step stopped at the deadline still leaves its log). Needs .gpu/ from
# `make gpu-carry`, like scripts/gpu_run.sh, which runs each step.
#   bash scripts/gpu_lease.sh OUT_DIR [SECONDS]   # SECONDS: the deadline, default 560
# Steps: the engine tests (the CUDA IPC update after the engine-start test, as in the whole
# tier), the 8B-shaped benchmark with the engine's phase lines, the derived targets under the
# CUDA branch, the CUDA IPC update test once more. OUT_DIR/steps.txt says how each ended.
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
step engine bash scripts/gpu_run.sh test/gpu/test_engine_gpu.py
step bench bash scripts/gpu_run.sh --bench --json "$OUT/bench.json" --log-level info
step derived bash scripts/gpu_run.sh test/gpu/test_derived_cuda.py
step ipc_again bash scripts/gpu_run.sh test/gpu/test_engine_gpu.py -k ipc
cat "$OUT/steps.txt"
