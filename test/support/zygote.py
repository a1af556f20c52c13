"""Test-only: SGLang's schedulers and detokenizers forked from a warm child of the process that
starts them (its zygote), instead of spawned as fresh interpreters.

SGLang starts each scheduler and the detokenizer with multiprocessing's "spawn": a fresh
interpreter that imports torch, transformers and SGLang (about 15 s of one core here) before
it does anything, on the path of every engine start. ``start()``, called where a process has
one thread (the test process from ``test/conftest.py``, every rank from ``ranks._worker``),
forks that process's zygote: it imports the scheduler and the detokenizer (``PRELOAD``; a
rank's fork server imported them already), then serves as a multiprocessing fork server
(the standard library's ``forkserver.main``). ``install()`` (``sitecustomize`` runs it in
every process) sends the processes whose target is ``run_scheduler_process`` or
``run_detokenizer_process`` there. A launcher without a zygote of its own (a test server's
``python -m sglang.launch_server``, the server process that verl's and AReaL's adapters
spawn, ``leak_run.py``) forks one when it first starts them, if it has one thread then:
it imported them itself, so that costs a fork. It releases its OpenMP threads first
(``_openmp_paused``). The started processes keep what a spawned child has:

* the pickled process object and its pipes, ``sys.path``, the working directory (the fork
  server runs ``spawn._main``, as a spawned child does); the launching process's stdout and
  stderr of the moment (passed along), its ``os.environ`` of the moment, and the test hooks
  that environment asks for (``sitecustomize.install()``), in ``_Child``;
* modules imported under the same environment. A variable that a module read while it was
  imported (recorded from this module's import on, ``_record_import_reads``), or that C
  libraries read when loaded (``C_PREFIXES``), and that differs between the zygote and the
  launching process makes the process spawn as before (``TORCHDYNAMO_DISABLE`` of the
  compiled engine, which torch reads when a ``torch.compile`` decorator runs at import);
* its place in the process tree, under the launching process (through the zygote): upstream's
  ``kill_process_tree`` and the tests' lookups find it, and the zygote dies with the launching
  process (``PR_SET_PDEATHSIG``), SGLang's processes with it (their own parent-death signal);
* the SIGQUIT SGLang's processes send their parent on a fatal error: the zygote relays it;
* the process title SGLang gives them (``sglang::scheduler_TP0``).

A process whose zygote is gone (upstream's ``Engine.shutdown`` kills every child) forks a
new one in the same way when it next starts them, or spawns them.
``SGLANG_TEST_FRESH_SPAWN=1`` in a process's environment makes it spawn from the start.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing.context
import os
import signal
import socket
import sys
import threading
from typing import Dict, FrozenSet, List, Optional, Set

__all__ = ["PRELOAD", "install", "start"]

PRELOAD = (
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
)
TARGETS = frozenset(
    {
        ("sglang.srt.managers.scheduler", "run_scheduler_process"),
        ("sglang.srt.managers.detokenizer_manager", "run_detokenizer_process"),
    }
)
# Variables that C libraries read when they are loaded (OpenMP, MKL, the loader, malloc,
# Python itself): a difference in any of them spawns.
C_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "LD_", "MALLOC_", "PYTHON")
# Variables that may differ although read at import: the test hooks' (``sitecustomize``
# reads them to know which hooks to install, which ``_Child`` does again, and the hooks read
# them when called), and one read only by test helpers that decorators call at import
# (transformers' and torch's testing utilities).
CALL_TIME = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "SGLANG_TEST_FAULT_DIR",
        "SGLANG_TEST_FIGURES_LOG",
        "SGLANG_TEST_FORBIDDEN_LOG",
        "SGLANG_TEST_PARAM_PTRS",
    }
)
READY_TIMEOUT_S = 300.0
OMP_PAUSE_HARD = 2  # omp_pause_resource_t

_MACHINERY = ("<frozen _collections_abc>", os.__file__)

_spawn_popen = multiprocessing.context.SpawnProcess._Popen
_import_reads: Set[str] = set()
_lock = threading.Lock()


def _caller(depth: int):
    """The frame that called into ``os.environ`` (past the mapping machinery)."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_code.co_filename in _MACHINERY:
        frame = frame.f_back
    return frame


def _record_import_reads() -> None:
    """Record every ``os.environ`` key read while a module is being imported, in this process
    and the processes it forks (idempotent). A read by code that iterates over the whole
    environment (``dict(os.environ)``, ``.items()``) is not one: fsspec and tqdm do that at
    import to find the variables of their own prefix."""
    cls = type(os.environ)
    if getattr(cls, "_zygote_original", None) is not None:
        return
    getitem, iterate = cls.__getitem__, cls.__iter__
    iterating = [None]  # the frame that last iterated over the environment

    def __iter__(self):
        iterating[0] = _caller(1)
        yield from iterate(self)

    def __getitem__(self, key):
        caller = _caller(1)
        if caller is not iterating[0]:
            frame = caller
            while frame is not None:
                if frame.f_code.co_filename == "<frozen importlib._bootstrap>":
                    _import_reads.add(key)
                    break
                frame = frame.f_back
        return getitem(self, key)

    cls._zygote_original = (getitem, iterate)
    cls.__getitem__, cls.__iter__ = __getitem__, __iter__


def _stop_recording() -> None:
    cls = type(os.environ)
    original = getattr(cls, "_zygote_original", None)
    if original is not None:
        cls.__getitem__, cls.__iter__ = original
        cls._zygote_original = None


_record_import_reads()
# Whether every import of this process was recorded: this module came before torch
# (``sitecustomize`` imports it first; ``test/conftest.py`` before anything else).
_RECORDED_FROM_START = "torch" not in sys.modules


def _threads() -> int:
    """This process's Python threads. (numpy's OpenBLAS keeps a native worker thread from its
    import on, and resets its pool in a forked child itself, as multiprocessing's fork
    server relies on.)"""
    return threading.active_count()


class _Zygote:
    """A started zygote, as its launching process sees it."""

    def __init__(
        self, owner: int, pid: int, address: str, alive_w: int, ready_r: int
    ) -> None:
        self.owner, self.pid, self.address = owner, pid, address
        self.alive_w, self.ready_r = alive_w, ready_r
        self.environ: Optional[Dict[str, str]] = None  # the zygote's, after its imports
        self.import_reads: FrozenSet[str] = frozenset()
        self.broken = False

    def alive(self) -> bool:
        if self.broken:
            return False
        try:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            done = self.pid
        if done:
            self.broken = True
        return not self.broken

    def ready(self) -> bool:
        """Wait until the zygote imported ``PRELOAD``; False if it failed or took too long."""
        if self.environ is None and not self.broken:
            import select

            chunks: List[bytes] = []
            while True:
                readable, _, _ = select.select([self.ready_r], [], [], READY_TIMEOUT_S)
                chunk = os.read(self.ready_r, 1 << 16) if readable else b""
                if not chunk:
                    break
                chunks.append(chunk)
            os.close(self.ready_r)
            try:
                said = json.loads(b"".join(chunks))
                self.environ = said["environ"]
                self.import_reads = frozenset(said["import_reads"])
            except (ValueError, KeyError, TypeError):
                self.broken = True
        return not self.broken and self.alive()

    def differ(self, environ: Dict[str, str]) -> Set[str]:
        """The variables that modules read at import, or C libraries when loaded, and that
        differ between the zygote (after its imports) and ``environ``."""
        zygote = self.environ or {}
        read = self.import_reads | _import_reads
        return {
            k
            for k in set(zygote) | set(environ)
            if zygote.get(k) != environ.get(k)
            and (k in read or k.startswith(C_PREFIXES))
            and k not in CALL_TIME
        }

    def connect(self, fds: List[int]):
        """``ForkServer.connect_to_new_process`` against this zygote: (status_r, data_w)."""
        from multiprocessing import reduction, resource_tracker

        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(self.address)
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            try:
                reduction.sendfds(
                    client,
                    [child_r, child_w, self.alive_w, resource_tracker.getfd(), *fds],
                )
            except BaseException:
                os.close(parent_r)
                os.close(parent_w)
                raise
            finally:
                os.close(child_r)
                os.close(child_w)
        return parent_r, parent_w


_zygote: Optional[_Zygote] = None


def start() -> None:
    """Fork this process's zygote, if it has one thread and none yet."""
    global _zygote
    if (
        os.environ.get("SGLANG_TEST_FRESH_SPAWN")
        or os.environ.get("SGLANG_TEST_GPU") == "1"
        or not _RECORDED_FROM_START
        or _threads() != 1
    ):
        return
    if _zygote is not None and _zygote.owner == os.getpid() and _zygote.alive():
        return
    if not _openmp_paused():
        return
    from multiprocessing import connection

    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    listener.listen()
    alive_r, alive_w = os.pipe()
    ready_r, ready_w = os.pipe()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.close(alive_w)
            os.close(ready_r)
            _serve(parent, listener.fileno(), alive_r, ready_w)
            code = 0
        except SystemExit:  # the fork server's end: its launching process is gone
            code = 0
        except BaseException:  # noqa: BLE001 - the launching process spawns instead
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(alive_r)
    os.close(ready_w)
    listener.close()
    _zygote = _Zygote(parent, child, address, alive_w, ready_r)


def _openmp_paused() -> bool:
    """Release the OpenMP thread pool of this thread, if it has one, before a fork: libgomp's
    pool does not survive one (a forked child's first parallel region waits forever for
    threads it does not have). OpenMP 5.0's ``omp_pause_resource_all`` frees it; the next
    parallel region here starts a new one. False if libgomp is loaded and cannot pause.
    (A process that is itself a fork of one whose pool had threads would wait here for them
    in vain: every launcher here is a fresh interpreter, or a rank forked from a fork server
    that never ran a parallel region.)"""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    for path in paths:
        try:
            if ctypes.CDLL(path).omp_pause_resource_all(OMP_PAUSE_HARD) != 0:
                return False
        except (OSError, AttributeError):
            return False
    return True


def _serve(parent: int, listener_fd: int, alive_r: int, ready_w: int) -> None:
    """The zygote: die with ``parent``, look like a fresh interpreter, import ``PRELOAD``,
    say which variables imports read, then serve as a fork server."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        return
    keep = {0, 1, 2, listener_fd, alive_r, ready_w}
    for fd in [int(f) for f in os.listdir("/proc/self/fd")]:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    for sig in signal.valid_signals():
        try:
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGQUIT, lambda *_: os.kill(parent, signal.SIGQUIT))
    said = b""
    try:
        for name in PRELOAD:
            __import__(name)
        # Forking a process with threads could deadlock its children.
        if _threads() == 1:
            said = json.dumps(
                {"environ": dict(os.environ), "import_reads": sorted(_import_reads)}
            ).encode()
    finally:
        os.write(ready_w, said)
        os.close(ready_w)
    if not said:
        return
    from multiprocessing import forkserver

    forkserver.main(listener_fd, alive_r, [], None, None)


class _Child:
    """A process target that first becomes what a spawned child of the launching process
    would be: its stdout and stderr, its environment, its test hooks, default SIGQUIT."""

    def __init__(self, environ: Dict[str, str], target) -> None:
        self.environ = environ
        self.target = target

    def __call__(self, *args, **kwargs):
        import faulthandler
        import logging
        import tempfile
        from multiprocessing import forkserver

        _stop_recording()
        stdout, stderr = forkserver._forkserver._inherited_fds[:2]
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        faulthandler.disable()  # pytest's, on a descriptor the zygote closed
        for handler in list(logging.root.handlers):
            logging.root.removeHandler(handler)
        logging.root.setLevel(logging.WARNING)
        try:  # setproctitle claims the argv and environ area on first use: before it changes
            import setproctitle

            setproctitle.getproctitle()
        except ImportError:
            pass
        os.environ.clear()
        os.environ.update(self.environ)
        tempfile.tempdir = None
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
        hooks = sys.modules.get("sitecustomize")
        if hooks is None:
            import sitecustomize as hooks  # installs them as it loads
        else:
            hooks.install()
        return self.target(*args, **kwargs)


def _popen(process_obj):
    """``SpawnProcess._Popen``: SGLang's schedulers and detokenizer from the zygote where it
    can, else spawned."""
    target = getattr(process_obj, "_target", None)
    key = (getattr(target, "__module__", None), getattr(target, "__name__", None))
    if key in TARGETS:
        start()  # late, where this process has no live zygote of its own (idempotent)
    zygote = _zygote
    environ = dict(os.environ)
    if (
        key not in TARGETS
        or zygote is None
        or zygote.owner != os.getpid()
        or environ.get("SGLANG_TEST_FRESH_SPAWN")
        or not zygote.ready()
        or zygote.differ(environ)
    ):
        return _spawn_popen(process_obj)
    from multiprocessing import forkserver, popen_forkserver

    class Popen(popen_forkserver.Popen):
        def _launch(self, process_obj):
            # The child's stdout and stderr, as its inherited fds 0 and 1.
            self._fds.extend((1, 2))
            with _lock:
                default = forkserver.connect_to_new_process
                forkserver.connect_to_new_process = zygote.connect
                try:
                    super()._launch(process_obj)
                finally:
                    forkserver.connect_to_new_process = default

    process_obj._target = _Child(environ, target)
    return Popen(process_obj)


def install() -> None:
    """Start SGLang's schedulers and detokenizer from this process's zygote (idempotent)."""
    multiprocessing.context.SpawnProcess._Popen = staticmethod(_popen)
