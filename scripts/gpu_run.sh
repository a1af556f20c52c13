#!/usr/bin/env bash
# Run the GPU tier (test/gpu) on a machine with a CUDA device, torch 2.11 and Python 3.12, and no
# network: installs .gpu/ (made by scripts/gpu_carry.sh) into a target folder, then runs pytest
# with the environment the tier needs (docs/gpu.md). Extra arguments go to pytest.
#   bash scripts/gpu_run.sh                 # the whole tier
#   bash scripts/gpu_run.sh -k ipc -x       # a selection
#   bash scripts/gpu_run.sh test/gpu/test_derived_cuda.py   # one file (only the files named)
#   bash scripts/gpu_run.sh --bench [args]  # benchmark/weight_sync/gpu_update.py instead
#   bash scripts/gpu_run.sh --torchrun N    # test/gpu/test_multi_gpu.py on N GPUs
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${SGLANG_GPU_SITE:-/tmp/sglang-gpu-site}
WHEEL=$(ls .gpu/sglang-0.5.12+dwu1-*.whl)
if [ ! -f "$SITE/.ready" ] || [ "$(cat "$SITE/.ready")" != "$(sha256sum "$WHEEL")" ]; then
  rm -rf "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu/wheels/*.whl
  # Our wheel's Python tag is the build machine's; its only compiled file (SGLang's gRPC
  # extension) is not imported by the engine, so it is unpacked rather than installed.
  python3 -m zipfile -e "$WHEEL" "$SITE"
  sha256sum "$WHEEL" > "$SITE/.ready"
fi
export PYTHONPATH="$SITE:$PWD/test/gpu/support:$PWD/test/support${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_TEST_GPU=1 SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 SGLANG_IS_FLASHINFER_AVAILABLE=false
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
if [ "${1:-}" = "--torchrun" ]; then
  N=$2
  shift 2
  # NCCL's watchdog acts 4 x its dump delay after an error it finds, its heartbeat monitor
  # after its timeout (480 s): shortened, so that test_multi_gpu.py's failure test decides
  # after both have passed (docs/gpu.md, runbook)
  export TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=${TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC:-2000}
  export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-20}
  exec torchrun --nproc-per-node "$N" -m pytest test/gpu/test_multi_gpu.py -p no:cacheprovider \
    --timeout=600 -rs -q "$@"
fi
if [ "${1:-}" = "--bench" ]; then
  shift
  exec python3 -m benchmark.weight_sync.gpu_update "$@"
fi
# The whole tier, unless the arguments name test files or folders themselves.
TARGET=test/gpu
for a in "$@"; do
  case "$a" in test/*) TARGET= ;; esac
done
exec python3 -m pytest $TARGET -p no:cacheprovider --timeout=600 -rs -q --durations=0 "$@"
