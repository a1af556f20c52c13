"""Test-only: SGLang's engine processes start from a preloaded fork server, not fresh interpreters.

SGLang starts its scheduler and detokenizer processes with multiprocessing's "spawn": each is
a fresh interpreter that imports torch, transformers and SGLang before it does anything, and
the suite starts one or more for almost every engine. ``install()`` (the test process, from
``test/conftest.py``; every process with ``test/support`` on PYTHONPATH, from
``sitecustomize``) starts the processes whose target is one of SGLang's functions from this
process's multiprocessing fork server instead: the standard library's "forkserver" start
method (Linux's default from Python 3.14), whose server imported those modules once
(``PRELOAD``). It keeps what a spawned interpreter would see:

* the pickled process object, its pipes, ``sys.path``, the working directory and the main
  module travel as with "spawn" (the fork server runs the same ``spawn._main``);
* the environment: the process runs with the launching process's ``os.environ`` of the
  moment it starts, not the fork server's (``_InEnv``), and ``sitecustomize`` installs the
  test hooks that environment asks for. Modules read some variables when imported (torch
  decides at import whether a ``torch.compile`` decorator compiles, from
  ``TORCHDYNAMO_DISABLE``), and the server imported them with its own environment: where
  the launching environment differs from the server's in any variable but those read when
  used (``CALL_TIME``), the process is spawned as before;
* the parent's signal: SGLang's processes report a fatal error by sending SIGQUIT to their
  parent (``psutil.Process().parent()``), here the fork server, which passes it on to the
  process that started it (``forkserver_relay``);
* the process title SGLang gives them (``sglang::scheduler_TP0``), which tests look for.

A process starts its server (one of its own, not multiprocessing's, from which ``ranks``
forks gloo ranks) when it first starts an SGLang process: SGLang's launcher has then set
the environment its processes get, and the server imports with it. The server exits when
the process that started it does, and the processes it started with it (SGLang's
parent-death signal), as spawned ones would.

``SGLANG_TEST_FRESH_SPAWN=1`` in a process's environment leaves its SGLang processes to
"spawn" (the leak test runs an engine's life exactly as users do).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import signal
import sys
import tempfile
from typing import Any, Callable, Dict, Optional

__all__ = ["PRELOAD", "install", "server_pid"]

# What the fork server imports once: SGLang's scheduler and detokenizer, and
# ``forkserver_relay`` (the SIGQUIT relay).
PRELOAD = [
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "forkserver_relay",
]

# Variables that may differ between the fork server's environment and a process started
# from it. Read when used: SGLang's CPU thread binding and run id, the test hooks of
# sitecustomize; read by nobody but pytest; and those SGLang's launcher sets just before it
# starts its processes (``_set_envs_and_config`` of 0.5.10.post1 to 0.5.23) for CUDA, NCCL
# and GPU kernel libraries, none of which a CPU engine loads.
CALL_TIME = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "SGLANG_CPU_OMP_THREADS_BIND",
        "SGLANG_RUN_ID",
        "SGLANG_TEST_FAULT_DIR",
        "SGLANG_TEST_FIGURES_LOG",
        "SGLANG_TEST_FORBIDDEN_LOG",
        "SGLANG_TEST_PARAM_PTRS",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "CUDA_MODULE_LOADING",
        "CUTE_DSL_LOG_LEVEL",
        "CUTE_DSL_LOG_TO_CONSOLE",
        "NCCL_CUMEM_ENABLE",
        "NCCL_GRAPH_MIXING_SUPPORT",
        "NCCL_MNNVL_ENABLE",
        "NCCL_NVLS_ENABLE",
        "TRTLLM_ENABLE_PDL",
    }
)

_spawn_popen = multiprocessing.context.SpawnProcess._Popen


class _Server:
    """This process's fork server for SGLang's processes, with the environment it started
    with. Separate from multiprocessing's own (``ranks`` starts gloo ranks from that one)."""

    def __init__(self, environ: Dict[str, str]):
        from multiprocessing import forkserver

        self.owner = os.getpid()
        self.environ = environ
        self.server = forkserver.ForkServer()
        self.server.set_forkserver_preload(PRELOAD)
        self.server.ensure_running()

    def takes(self, environ: Dict[str, str]) -> bool:
        differ = {
            k
            for k in set(self.environ) | set(environ)
            if self.environ.get(k) != environ.get(k)
        }
        return differ <= CALL_TIME

    def popen(self, process_obj):
        """``popen_forkserver.Popen`` through this server instead of multiprocessing's."""
        from multiprocessing import forkserver, popen_forkserver

        self.server.ensure_running()
        default = forkserver.connect_to_new_process
        forkserver.connect_to_new_process = self.server.connect_to_new_process
        try:
            return popen_forkserver.Popen(process_obj)
        finally:
            forkserver.connect_to_new_process = default


_server: Optional[_Server] = None


class _InEnv:
    """A process target that first takes the launching process's environment, and lets its
    fork server go when the process that started it is gone."""

    def __init__(self, environ: Dict[str, str], target: Callable[..., Any]):
        self.environ = environ
        self.target = target

    def __call__(self, *args, **kwargs):
        from multiprocessing import forkserver

        # The server exits when its "alive" pipe has no writer left; a child keeps none, so
        # the server, and with it (SGLang's parent-death signal) this process, go when the
        # process that started them does, as a spawned child of that process would.
        alive = forkserver._forkserver._forkserver_alive_fd
        if alive is not None:
            os.close(alive)
            forkserver._forkserver._forkserver_alive_fd = None
        try:  # setproctitle claims the argv and environ area on first use: before it changes
            import setproctitle

            setproctitle.getproctitle()
        except ImportError:
            pass
        os.environ.clear()
        os.environ.update(self.environ)
        tempfile.tempdir = None
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
        if "sitecustomize" in sys.modules:
            sys.modules["sitecustomize"].install()
        return self.target(*args, **kwargs)


def _popen(process_obj):
    """``SpawnProcess._Popen``: SGLang's processes from the fork server where it can."""
    global _server
    target = getattr(process_obj, "_target", None)
    module = getattr(target, "__module__", None) or ""
    if not module.startswith("sglang.") or os.environ.get("SGLANG_TEST_FRESH_SPAWN"):
        return _spawn_popen(process_obj)
    environ = dict(os.environ)
    if _server is None or _server.owner != os.getpid():
        # Started now, after SGLang's launcher set the environment its processes get.
        _server = _Server(environ)
    elif not _server.takes(environ):
        return _spawn_popen(process_obj)
    process_obj._target = _InEnv(environ, target)
    return _server.popen(process_obj)


def server_pid() -> Optional[int]:
    """The pid of this process's fork server for SGLang's processes, or None."""
    if _server is None or _server.owner != os.getpid():
        return None
    return _server.server._forkserver_pid


def install() -> None:
    """Start SGLang's processes of this process from its fork server (idempotent)."""
    multiprocessing.context.SpawnProcess._Popen = staticmethod(_popen)
