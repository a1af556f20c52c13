#!/usr/bin/env bash
# Creates a venv for one SGLang base release with a torch that runs on CPU and the release's runtime deps
# (no CUDA-only packages).
#   BASE=0.5.23       (default) .venv:              torch 2.13.0+cpu, scripts/requirements-cpu.txt
#   BASE=0.5.15.post1 .venv-0.5.15.post1:           torch 2.11.0 (sglang's pin), scripts/requirements-cpu-0.5.15.post1.txt
#   BASE=0.5.12       .venv-0.5.12:                 torch 2.11.0 (sglang's pin), scripts/requirements-cpu-0.5.12.txt
#   BASE=0.5.10.post1 .venv-0.5.10.post1:           torch 2.9.1 (sglang's pin), scripts/requirements-cpu-0.5.10.post1.txt
# The older releases pin torch builds that exist on PyPI only with CUDA; they import and run on CPU.
# Idempotent: a finished venv is marked by $VENV/.ready.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-0.5.23}
case "$BASE" in
  0.5.23)       TORCH=2.13.0; VISION=0.28.0; REQS=scripts/requirements-cpu.txt; DEFAULT_VENV=.venv ;;
  0.5.15.post1) TORCH=2.11.0; VISION=0.26.0; REQS=scripts/requirements-cpu-0.5.15.post1.txt; DEFAULT_VENV=.venv-0.5.15.post1 ;;
  0.5.12)       TORCH=2.11.0; VISION=0.26.0; REQS=scripts/requirements-cpu-0.5.12.txt; DEFAULT_VENV=.venv-0.5.12 ;;
  0.5.10.post1) TORCH=2.9.1;  VISION=0.24.1; REQS=scripts/requirements-cpu-0.5.10.post1.txt; DEFAULT_VENV=.venv-0.5.10.post1 ;;
  *) echo "setup_env: unknown BASE=$BASE (0.5.23, 0.5.15.post1, 0.5.12, 0.5.10.post1)" >&2; exit 2 ;;
esac
VENV=${VENV:-$DEFAULT_VENV}
# The frameworks' releases for test/e2e/test_{verl,areal}_release.py (--no-deps, see each requirements
# file); added to existing venvs too.
framework_deps() {
  local fw
  for fw in verl areal; do
    cmp -s "scripts/requirements-$fw.txt" "$VENV/.$fw-ready" && continue
    "$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" --no-deps -r "scripts/requirements-$fw.txt"
    cp "scripts/requirements-$fw.txt" "$VENV/.$fw-ready"
  done
}
# Test runners (scripts/requirements-test.txt), added to existing venvs too.
test_deps() {
  cmp -s scripts/requirements-test.txt "$VENV/.test-ready" && return 0
  "$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" -r scripts/requirements-test.txt
  cp scripts/requirements-test.txt "$VENV/.test-ready"
}
[ -f "$VENV/.ready" ] && { framework_deps; test_deps; exit 0; }
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==$TORCH"
printf 'torch==%s\ntorchvision==%s\n' "$TORCH" "$VISION" > "$VENV/constraints.txt"
PIP="$PY -m pip install -q -c $VENV/constraints.txt"
$PIP --no-deps "sglang==$BASE"
$PIP -r "$REQS"
# torchvision on PyPI is a CUDA build; guard its two fake-op registrations so it imports with CPU torch
# (a no-op where its ops load, as with the CUDA torch builds of the older bases).
TV=$("$PY" -c 'import importlib.util,os;print(os.path.dirname(importlib.util.find_spec("torchvision").origin))')
sed -i 's/^@torch.library.register_fake("torchvision::\(q\?nms\)")/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$TV/_meta_registrations.py"
"$PY" -c "import torchvision.transforms, sglang.srt.layers.linear" >/dev/null
touch "$VENV/.ready"
framework_deps
test_deps
