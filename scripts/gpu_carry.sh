#!/usr/bin/env bash
# Prepare .gpu/, the folder that takes the GPU suite to a GPU machine without network access
# (docs/gpu.md): our SGLang 0.5.12 wheel (0.5.12 pins torch 2.11, the torch such machines
# ship with) and, as CPython 3.12 x86-64 wheels, the pure-Python and small compiled runtime
# dependencies of SGLang that a plain torch + transformers + triton image lacks, pinned to the
# versions the CPU suite runs with (scripts/requirements-cpu-0.5.12.txt); xgrammar (43 MiB) is left
# out, SGLang imports it only for grammar backends (the GPU tests run with none). CUDA-only packages
# (sglang-kernel, flashinfer) are not carried: test/support/sgl_kernel, a pure-torch stand-in,
# replaces sglang-kernel and the engine runs Triton attention.
#   bash scripts/gpu_carry.sh          # here, with network: writes .gpu/ (about 50 MiB)
#   bash scripts/gpu_run.sh [pytest args]   # there, from the repo root with .gpu/ beside it
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu
PY=${PY:-python3}
mkdir -p "$OUT/wheels"
rm -f "$OUT"/wheels/*.whl "$OUT"/sglang-*.whl

# The image's own packages are used where they are there (torch, triton, numpy, aiohttp, httpx,
# huggingface-hub, safetensors, tiktoken, sentencepiece, jinja2, ...); these are missing from it or
# pinned differently by SGLang 0.5.12 (transformers 5.6.0 and the tokenizers it accepts).
PINS=(
  annotated-types==0.8.0 apache-tvm-ffi==0.1.9 asttokens==3.0.2 cffi==2.1.1
  compressed-tensors==0.20.0 dill==0.4.1 distro==1.9.0 executing==2.3.0 fastapi==0.165.0
  gguf==0.19.0 ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 jiter==0.19.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3 matplotlib-inline==0.2.2
  mistral_common==1.13.1 msgspec==0.22.0 openai==2.6.1 opentelemetry-api==1.45.2 orjson==3.13.0
  parso==0.8.7 partial-json-parser==0.2.1.1.post7 pexpect==4.9.0 prompt_toolkit==3.0.53
  ptyprocess==0.7.0 pure_eval==0.2.4 pybase64==1.5.1 pycountry==26.2.16 pycparser==3.12
  pydantic==2.14.4 pydantic-extra-types==2.11.1 pydantic_core==2.50.5 python-multipart==0.0.34
  pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1
  soundfile==0.13.1 stack-data==0.6.3 starlette==1.10.0 tokenizers==0.22.2 traitlets==5.16.1
  transformers==5.6.0 typing-inspection==0.4.5 uvicorn==0.54.0 watchfiles==1.3.0 wcwidth==0.9.4
  zstandard==0.25.0 torch_memory_saver==0.0.10
)
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$OUT/wheels" "${PINS[@]}"

# Our wheel for the 0.5.12 base, built for this interpreter (its only compiled file, SGLang's gRPC
# extension, is not imported by the engine); gpu_run.sh unpacks it, whatever its Python tag.
make -s wheel >/dev/null
cp dist/sglang-0.5.12+dwu1-*.whl "$OUT/"
du -sh "$OUT"
