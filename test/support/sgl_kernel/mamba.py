"""Stand-in for ``sgl_kernel.mamba``: every name imports, and raises ``NotImplementedError`` if called.

See ``sgl_kernel/__init__.py`` (the package's docstring) for why this exists.
"""


from sgl_kernel import missing


def __getattr__(name):
    return missing("sgl_kernel.mamba", name)
