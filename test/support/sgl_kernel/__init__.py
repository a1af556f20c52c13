"""Pure-torch stand-in for ``sgl_kernel`` (no CPU build of sgl-kernel exists on PyPI).

With ``SGLANG_USE_CPU_ENGINE=1`` many SGLang modules run ``from sgl_kernel import X`` at
import time. On a CPU without AMX, SGLang falls back to native torch for RMSNorm,
SiLU-and-mul, rotary embedding, the KV store, linear/logits and the all-reduce, so
only one kernel really runs in a tiny-model Engine: ``assign_req_to_token_pool_cpu``
(decode-time KV slot bookkeeping), implemented here in plain torch. Every other name
resolves to a function that raises ``NotImplementedError`` when called, so imports
succeed and an unexpected use fails loudly. The same holds for the submodules that SGLang
imports unconditionally (``SUBMODULES``: ``mamba`` on 0.5.23, also ``kvcacheio`` on 0.5.10 and
0.5.12), which a finder at the end of ``sys.meta_path`` creates on import; the others stay
absent, because SGLang catches their ImportError (e.g. ``scalar_type``) and falls back; on
the GPU tier (``SGLANG_TEST_GPU=1``), whose CUDA branches import many more at module level,
every submodule is served.

On a GPU (``test/gpu``, where no sgl-kernel build can be installed) SGLang's CUDA branch calls
the elementwise kernels of a dense model's forward: RMSNorm (plain and Gemma, fused with the
residual add) and the gated activations. They are implemented here in plain torch with the
kernels' semantics (fp32 math, in-place where the kernel is in place), so a tiny model runs with
CUDA graphs; everything else still raises when called.

No ``torch.ops.sgl_kernel`` ops are registered: SGLang's AMX check
(``cpu_has_amx_support``) needs ``torch.ops.sgl_kernel.convert_weight_packed``, so the
AMX paths stay off even on an AMX CPU.

The directory holding this package (``test/support``) must be on the ``PYTHONPATH``
*environment variable*, not only ``sys.path``: the scheduler and detokenizer processes
are spawned and inherit the environment. With a full sglang install (real CUDA
``sglang-kernel``) it must come first, to shadow the real package.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

import torch

__version__ = "0.0.0+torch-stand-in"
SUBMODULES = ("mamba", "kvcacheio")
# On the GPU tier SGLang's CUDA branches import many more submodules at module level
# (``sgl_kernel.quantization``, ``.flash_attn``, ...):
# every one is served there, but those SGLang probes and replaces when absent.
_SERVE_ALL = os.environ.get("SGLANG_TEST_GPU") == "1"
PROBED = ("scalar_type",)
# Submodule functions that answer a question rather than run a kernel.
SUBMODULE_ATTRS = {"utils": {"is_arch_support_pdl": lambda: False}}
# Operators SGLang's CUDA branches register fake (meta) kernels for at import time, so they must
# exist as ``torch.ops.sgl_kernel.*``; defined on the GPU tier only, never called.
FAKED_OPS = ("moe_fused_gate", "fused_linear_sigmoid_mul", "int8_scaled_mm_with_quant")


def assign_req_to_token_pool_cpu(
    req_pool_indices,
    req_to_token,
    start_offset,
    end_offset,
    out_cache_loc,
    max_ctx_len=None,
):
    """``req_to_token[req_pool_indices[k], start_offset[k]:end_offset[k]] = next (end-start) of out_cache_loc``.

    Requests are walked in order with a running offset into ``out_cache_loc`` (what the
    Triton kernel ``assign_req_to_token_pool`` computes as the sum of the previous
    requests' lengths). ``max_ctx_len`` (the row length of ``req_to_token``) is unused.
    """
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    pt = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pt : pt + n].to(req_to_token.dtype)
        pt += n


def _rms(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = weight.float()
    return (xf * (1.0 + w if gemma else w)).to(x.dtype)


def _into(result: torch.Tensor, out):
    if out is None:
        return result
    out.copy_(result)
    return out


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """``sgl_kernel.rmsnorm``: ``out = input / rms(input) * weight``, computed in fp32."""
    return _into(_rms(input, weight, eps, gemma=False), out)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """``sgl_kernel.fused_add_rmsnorm``, in place: ``residual += input``, then
    ``input = rmsnorm(residual)``."""
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps, gemma=False))


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """``sgl_kernel.gemma_rmsnorm``: RMSNorm with ``1 + weight``."""
    return _into(_rms(input, weight, eps, gemma=True), out)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """``sgl_kernel.gemma_fused_add_rmsnorm``, in place, with ``1 + weight``."""
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps, gemma=True))


def _gated(act, input, out):
    d = input.shape[-1] // 2
    result = act(input[..., :d].float()) * input[..., d:].float()
    return _into(result.to(input.dtype), out)


def silu_and_mul(input, out=None, enable_pdl=None):
    """``sgl_kernel.silu_and_mul``: ``silu(x[..., :d]) * x[..., d:]``."""
    return _gated(torch.nn.functional.silu, input, out)


def gelu_and_mul(input, out=None, enable_pdl=None):
    """``sgl_kernel.gelu_and_mul`` (exact GELU)."""
    return _gated(torch.nn.functional.gelu, input, out)


def gelu_tanh_and_mul(input, out=None, enable_pdl=None):
    """``sgl_kernel.gelu_tanh_and_mul`` (tanh-approximated GELU)."""
    return _gated(lambda x: torch.nn.functional.gelu(x, approximate="tanh"), input, out)


def missing(module: str, name: str):
    """What ``from <module> import <name>`` gets for a kernel the stand-in lacks: a callable
    that raises if used (dunders raise AttributeError, as Python's import machinery expects)."""
    if name.startswith("__"):
        raise AttributeError(name)

    def _not_implemented(*args, **kwargs):
        raise NotImplementedError(
            f"{module}.{name} is not available (pure-torch test stand-in)"
        )

    _not_implemented.__name__ = name
    _not_implemented.__qualname__ = name
    return _not_implemented


def __getattr__(name):
    return missing("sgl_kernel", name)


class _StandInSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``sgl_kernel.<one of SUBMODULES>`` as a module whose every attribute is ``missing(...)``."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(f"{__name__}."):
            return None
        name = fullname[len(__name__) + 1 :]
        if (_SERVE_ALL and name not in PROBED) or name in SUBMODULES:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__dict__.update(SUBMODULE_ATTRS.get(spec.name.rpartition(".")[2], {}))
        module.__getattr__ = lambda name: missing(spec.name, name)
        return module

    def exec_module(self, module):
        pass


if _SERVE_ALL and not hasattr(torch.ops.sgl_kernel, FAKED_OPS[0]):
    for _op in FAKED_OPS:
        torch.library.define(f"sgl_kernel::{_op}", "(Tensor input) -> Tensor")

if not any(isinstance(f, _StandInSubmodules) for f in sys.meta_path):
    sys.meta_path.append(_StandInSubmodules())
