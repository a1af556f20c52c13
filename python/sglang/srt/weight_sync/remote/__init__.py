"""Weight-sync groups with engines on other GPUs and hosts (docs/remote.md).

The trainer's side is public here: ``RemoteSync`` (join, update, leave, close), what it
reports or raises, and how it reaches an engine (``HttpEndpoint``, ``LocalEndpoint``).
The engine's side is reached only through SGLang's hooks (``remote.requests`` in the
tokenizer manager, ``remote.engine`` in the scheduler).

The names are resolved on first use, so that an engine process importing
``remote.engine`` does not import the trainer's end with this package.
"""

from importlib import import_module

# exported name -> the module of this package that defines it
_EXPORTS = {
    "EngineEndpoint": "endpoints",
    "HttpEndpoint": "endpoints",
    "LocalEndpoint": "endpoints",
    "RemoteSyncError": "endpoints",
    "drive_engine": "endpoints",
    "engine_request": "endpoints",
    "RemoteReport": "trainer",
    "RemoteSync": "trainer",
    "areal_sync": "frameworks",
}

__all__ = tuple(sorted(_EXPORTS))


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
