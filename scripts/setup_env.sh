#!/usr/bin/env bash
# Creates .venv with CPU torch 2.13.0 and SGLang 0.5.23 (no CUDA stack), as described in
# shared/research/sglang-0.5.23-on-cpu.md. Idempotent: a finished venv is marked by .venv/.ready.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# verl's release for test/e2e/test_verl_release.py (--no-deps, see the file); added to existing venvs too.
verl_deps() {
  cmp -s scripts/requirements-verl.txt "$VENV/.verl-ready" && return
  "$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" --no-deps -r scripts/requirements-verl.txt
  cp scripts/requirements-verl.txt "$VENV/.verl-ready"
}
[ -f "$VENV/.ready" ] && { verl_deps; exit 0; }
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
echo "torch==2.13.0" > "$VENV/constraints.txt"
PIP="$PY -m pip install -q -c $VENV/constraints.txt"
$PIP --no-deps sglang==0.5.23
$PIP -r scripts/requirements-cpu.txt
# torchvision on PyPI is a CUDA build; guard its two fake-op registrations so it imports with CPU torch.
TV=$("$PY" -c 'import importlib.util,os;print(os.path.dirname(importlib.util.find_spec("torchvision").origin))')
sed -i 's/^@torch.library.register_fake("torchvision::\(q\?nms\)")/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$TV/_meta_registrations.py"
"$PY" -c "import torchvision.transforms, sglang.srt.layers.linear" >/dev/null
touch "$VENV/.ready"
verl_deps
