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
absent, because SGLang catches their ImportError (e.g. ``scalar_type``) and falls back.

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
import sys
import types

import torch

__version__ = "0.0.0+torch-stand-in"
SUBMODULES = ("mamba", "kvcacheio")


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
        if fullname in {f"{__name__}.{name}" for name in SUBMODULES}:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = lambda name: missing(spec.name, name)
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _StandInSubmodules) for f in sys.meta_path):
    sys.meta_path.append(_StandInSubmodules())
