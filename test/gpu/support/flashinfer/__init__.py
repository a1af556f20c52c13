"""Import-only stand-in for ``flashinfer`` on the GPU tier (``scripts/gpu_run.sh``).

SGLang's CUDA branches import some flashinfer names at module level even when no flashinfer
backend is chosen (``layers/sampler.py``: its sampling kernels). The tier runs Triton
attention and the PyTorch sampler, and sets ``SGLANG_IS_FLASHINFER_AVAILABLE=false`` so that
SGLang's availability check does not mistake this package for the real one. Every name and
the submodules in ``SERVED`` resolve (the others stay absent: SGLang probes them and falls
back); calling anything raises ``NotImplementedError``. Kept out of
``test/support`` so the CPU suite never sees a ``flashinfer`` package.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+import-only-stand-in"
SERVED = ("sampling", "gemm", "prefill")


def _missing(module: str, name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _not_implemented(*args, **kwargs):
        raise NotImplementedError(
            f"{module}.{name} is not available (import-only stand-in)"
        )

    _not_implemented.__name__ = _not_implemented.__qualname__ = name
    return _not_implemented


def __getattr__(name):
    return _missing(__name__, name)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``flashinfer.<one of SERVED>`` as a module whose attributes are stubs."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in {f"{__name__}.{name}" for name in SERVED}:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: _missing(spec.name, name)
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Submodules) for f in sys.meta_path):
    sys.meta_path.append(_Submodules())
