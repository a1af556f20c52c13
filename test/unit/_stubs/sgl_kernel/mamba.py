"""Import-only stand-in for ``sgl_kernel.mamba`` (no CPU build exists on PyPI).

With ``SGLANG_USE_CPU_ENGINE=1`` several SGLang modules do ``from sgl_kernel import X``
at import time. Model construction and ``load_weights`` never call these kernels, so
every name resolves to a function that raises if it is ever called. No
``torch.ops.sgl_kernel`` ops are registered, so SGLang's AMX paths stay off.
"""

__version__ = "0.0.0+stub"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _not_implemented(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available (test stub)")

    _not_implemented.__name__ = name
    return _not_implemented
