"""Stand-in for ``sgl_kernel.mamba``: every name imports, and raises ``NotImplementedError`` if called.

See ``sgl_kernel/__init__.py`` (the package's docstring) for why this exists.
"""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _not_implemented(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.mamba.{name} is not available (pure-torch test stand-in)")

    _not_implemented.__name__ = name
    _not_implemented.__qualname__ = name
    return _not_implemented
