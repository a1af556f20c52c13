"""A real ``sglang.Engine`` on this CPU-only machine, and HF greedy decoding to compare it with.

Environment:

* ``SGLANG_USE_CPU_ENGINE=1`` must be in the environment of the engine's spawned
  processes, and should be in ``os.environ`` before the test process first imports the
  ``sglang.srt`` modules that read it at import time (``_is_cpu = is_cpu()``).
  ``test/e2e/conftest.py`` calls ``configure_cpu_env()`` at import time; ``cpu_engine``
  calls it again and warns if SGLang was imported too early (measured harmless: the
  launching process does not take CPU-specific branches on the paths used here).
* The pure-torch ``sgl_kernel`` stand-in (``test/support/sgl_kernel``) must be importable
  in every process: its directory goes on ``sys.path`` *and* into ``PYTHONPATH``, since
  the scheduler and detokenizer processes are spawned and inherit the environment.
* TP > 1 on a 1-NUMA machine needs ``SGLANG_CPU_OMP_THREADS_BIND`` (one core list per
  rank, "0|1" for TP 2); ``cpu_engine`` sets it while it launches the engine.

``DEFAULT_ENGINE_ARGS`` are the engine arguments that work on CPU (``device="cpu"``,
``attention_backend="torch_native"``, ``skip_tokenizer_init``, a bounded
``max_total_tokens``); ``cleanup_shm`` removes the ``/dev/shm`` files engines left behind;
``hf_greedy`` and ``stable_prompts`` give what an engine's greedy generation is compared
with. The engine's tokenizer manager handles SIGTERM on its event loop by killing every
child of the process that started the engine and exiting it (upstream
``sigterm_watchdog``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

# isort: split
# pr: safety
import signal
import time

# pr: safety end

SUPPORT_DIR = Path(__file__).resolve().parent
SHM_DIR = Path("/dev/shm")
# Files SGLang (and multiprocessing under it) leaves in /dev/shm when an engine goes down.
# "psm_": Python's own SharedMemory names, which 0.5.12's and 0.5.10.post1's broadcast queues
# take (0.5.23 names them "sgl_shm_mq_<pid>_..."); 24 MiB each.
SHM_PREFIXES = (
    "sgl_shm",
    "sglang_loads_",
    "sem.mp-",
    "multi_tokenizer_args_",
    "psm_",
)

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]
Prompts = Sequence[Sequence[int]]


# pr: safety
class EngineDied(RuntimeError):
    """A scheduler/detokenizer process of the engine died while the engine was in use."""


# pr: safety end
# ----------------------------------------------------------------------------------------------
# Environment


def _prepend_path_var(name: str, entry: str) -> None:
    parts = [p for p in os.environ.get(name, "").split(os.pathsep) if p]
    if entry not in parts:
        os.environ[name] = os.pathsep.join([entry] + parts)


def configure_cpu_env() -> None:
    """Make this process (and the processes it spawns) able to run SGLang's CPU engine.

    Idempotent. Sets ``SGLANG_USE_CPU_ENGINE=1``, puts ``test/support`` (the ``sgl_kernel``
    stand-in) first on ``sys.path`` and ``PYTHONPATH``, and keeps HF logging quiet. Call it
    before anything imports ``sglang.srt`` modules beyond the light ones (see
    ``check_cpu_env``).
    """
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    _prepend_path_var("PYTHONPATH", str(SUPPORT_DIR))
    if str(SUPPORT_DIR) not in sys.path:
        sys.path.insert(0, str(SUPPORT_DIR))
    if torch.version.cuda is not None:
        # A CUDA torch build on a machine without GPU (the pinned torch of SGLang 0.5.10/0.5.12):
        # NCCL loads from the nvidia wheels, and SGLang's TP groups would then build a pynccl
        # communicator for a CPU device and fail; a library name that cannot load disables it.
        os.environ.setdefault("SGLANG_NCCL_SO_PATH", "libnccl-disabled-on-cpu.so")
    # SGLang torch.compiles a few small helpers on CPU (the vocab-parallel embedding's input
    # mask, the seeded sampler); the first generation of every engine process then spends
    # most of its time in dynamo and inductor. They are pure index arithmetic with eager
    # equivalents, so the tests run them eagerly; test_engine_smoke.py keeps them compiled
    # (``COMPILED``) and checks that engine against HF too.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# pr: safety
# Modules that cache ``is_cpu()`` at import (``_is_cpu = is_cpu()``) and that the launching
# process imports with ``sglang.Engine``.
_CPU_FLAG_MODULES = (
    "sglang.srt.mem_cache.allocation",
    "sglang.srt.mem_cache.memory_pool",
)


def check_cpu_env() -> None:
    """Raise if the environment is not set for the CPU engine; warn if SGLang was imported too early.

    Only the spawned engine processes need ``SGLANG_USE_CPU_ENGINE=1`` at their import
    time: an Engine whose launching process imported ``sglang.srt.entrypoints.engine``
    before the variable was set was measured to work (TP 1 and 2, generate and
    ``update_weights_from_tensor``, identical outputs). That is not a guarantee for every
    code path, hence the warning.
    """
    import warnings

    problems = []
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        problems.append("SGLANG_USE_CPU_ENGINE is not '1'")
    if str(SUPPORT_DIR) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        problems.append(f"{SUPPORT_DIR} (the sgl_kernel stand-in) is not on PYTHONPATH")
    if problems:
        raise RuntimeError(
            "the CPU engine environment is not configured: "
            + "; ".join(problems)
            + ". Call test/support/engine.py:configure_cpu_env() first."
        )
    early = [
        name
        for name in _CPU_FLAG_MODULES
        if getattr(sys.modules.get(name), "_is_cpu", None) is False
    ]
    if early:
        warnings.warn(
            f"{early} were imported before SGLANG_USE_CPU_ENGINE=1 was set, so this process "
            "runs their non-CPU branches (the engine's own processes are unaffected). Call "
            "configure_cpu_env() before importing sglang (test/e2e/conftest.py does).",
            stacklevel=3,
        )


# pr: safety end
@contextlib.contextmanager
def _env(values: Mapping[str, Optional[str]]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def omp_bind(tp_size: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` giving each TP rank its own core(s), e.g. "0|1" for TP 2.

    With fewer cores than ranks (TP 4 on 2 cores) ranks share cores round-robin.
    """
    cores = sorted(os.sched_getaffinity(0))
    if tp_size <= len(cores):
        per = len(cores) // tp_size
        groups = [cores[i * per : (i + 1) * per] for i in range(tp_size)]
    else:
        groups = [[cores[i % len(cores)]] for i in range(tp_size)]
    return "|".join(",".join(map(str, g)) for g in groups)


# ----------------------------------------------------------------------------------------------
# /dev/shm hygiene


def _shm_entries() -> Dict[str, float]:
    out = {}
    try:
        for entry in SHM_DIR.iterdir():
            if entry.name.startswith(SHM_PREFIXES):
                try:
                    out[entry.name] = entry.stat().st_mtime
                except FileNotFoundError:
                    pass
    except OSError:
        pass
    return out


def _shm_in_use(exclude_pids=()) -> set:
    """Inodes of the /dev/shm files some live process (other than ``exclude_pids``) has open
    or mapped. Inodes, not names: a named semaphore is mapped under the temporary name glibc
    created it with before linking it to its own."""
    used = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in exclude_pids:
            continue
        try:
            for fd in (proc / "fd").iterdir():
                try:
                    if os.readlink(fd).startswith("/dev/shm/"):
                        used.add(os.stat(fd).st_ino)
                except OSError:
                    continue
            with open(proc / "maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        used.add(int(fields[4]))
        except (OSError, PermissionError):
            continue
    return used


def _pid_in_name(name: str) -> Optional[int]:
    # sgl_shm_<kind>_<pid>_<rand> (see sglang/srt/utils/stale_shm_cleanup.py)
    if name.startswith("sgl_shm_"):
        parts = name.split("_")
        if len(parts) >= 4 and parts[-2].isdigit():
            return int(parts[-2])
    return None


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie does not: killed, not yet reaped by the parent it was
    handed to, it has let go of its files and mappings (a killed server's schedulers are
    zombies for a while after the server's own process is gone)."""
    import psutil

    try:
        return psutil.Process(pid).status() not in (
            psutil.STATUS_ZOMBIE,
            psutil.STATUS_DEAD,
        )
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process: it may well run
        return True


def cleanup_shm(
    before: Mapping[str, float],
    started_at: float,
    engine_pids: Sequence[int] = (),
    mine_in_use: bool = False,
) -> List[str]:
    """Remove /dev/shm files that appeared after ``before`` was taken and that nobody uses.

    A file is removed only if it was not in ``before``, is not older than ``started_at``,
    is not open or mapped by a live process other than this one (the shut-down engine's
    tokenizer manager in this process may still map some; with ``mine_in_use``, by this one
    either: its own multiprocessing queues' semaphores, which it removes at exit), and, when
    its name carries a creator pid, that pid is this process, an engine process or dead. So a
    concurrently running engine of another test session keeps its files. Returns the removed
    names.
    """
    removed = []
    candidates = {
        n: m
        for n, m in _shm_entries().items()
        if n not in before and m >= started_at - 1
    }
    if not candidates:
        return removed
    in_use = _shm_in_use(exclude_pids=set() if mine_in_use else {os.getpid()})
    for name in sorted(candidates):
        try:
            if (SHM_DIR / name).stat().st_ino in in_use:
                continue
        except FileNotFoundError:
            continue
        pid = _pid_in_name(name)
        if (
            pid is not None
            and pid != os.getpid()
            and pid not in engine_pids
            and _pid_alive(pid)
        ):
            continue
        try:
            (SHM_DIR / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as e:  # pragma: no cover - best effort
            logger.warning("could not remove /dev/shm/%s: %s", name, e)
    return removed


# ----------------------------------------------------------------------------------------------
# Process safety: a dying engine process must not take the test process with it.


# pr: safety
# ``cpu_engine(model_dir, tp_size, **kwargs)`` starts the engine in this process with
# ``DEFAULT_ENGINE_ARGS``, yields it, shuts it down and removes the ``/dev/shm`` files the
# engine left behind. Two things a test author must know:
#
# * Upstream ``Engine.shutdown()`` kills **every** child process of the calling process
#   (``kill_process_tree(os.getpid(), include_parent=False)``), not only the engine's: a
#   second engine, trainer processes, a forkserver. ``cpu_engine`` narrows that call, while
#   it shuts down, to the processes that appeared while its engine started (minus
#   multiprocessing's shared resource tracker). Calling ``engine.shutdown()`` yourself
#   bypasses this.
# * A scheduler that dies makes the engine send SIGQUIT to the test process, whose upstream
#   handlers SIGKILL the whole process tree, pytest included. ``cpu_engine`` replaces them
#   and watches the engine's processes itself (``_EngineMonitor``): the running or next
#   ``engine.*`` call raises ``EngineDied`` and only the engine's processes are killed
#   (a failed start raises upstream's ``RuntimeError``).
def _children() -> List[int]:
    import psutil

    with contextlib.suppress(psutil.Error):
        return [c.pid for c in psutil.Process().children(recursive=True)]
    return []


def _resource_tracker_pid() -> Optional[int]:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def _with_descendants(pids: Sequence[int]) -> List[int]:
    import psutil

    out = set(pids)
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    return sorted(out)


def _kill(pids: Sequence[int]) -> None:
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
    psutil.wait_procs(procs, timeout=30)


@contextlib.contextmanager
def _kill_only(pids: Sequence[int]) -> Iterator[None]:
    """While active, SGLang's ``kill_process_tree(<this process>)`` kills only ``pids`` (and their
    descendants) instead of every child of this process; other calls are unchanged."""
    import sglang.srt.entrypoints.engine as engine_module

    original = engine_module.kill_process_tree

    def scoped(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        if parent_pid is None or parent_pid == os.getpid():
            _kill([p for p in _with_descendants(pids) if p != skip_pid])
            return None
        return original(
            parent_pid,
            include_parent=include_parent,
            skip_pid=skip_pid,
            wait_timeout=wait_timeout,
        )

    engine_module.kill_process_tree = scoped
    try:
        yield
    finally:
        engine_module.kill_process_tree = original


# pr: safety end
def _launch_sigquit_handler(
    signum, frame
):  # passed as Engine(custom_sigquit_handler=...)
    # Upstream's default kills the whole process tree (pytest included). During startup the
    # engine itself notices the dead scheduler and raises RuntimeError; nothing to do here.
    logger.error("SIGQUIT from an engine process during startup (a scheduler failed)")


# pr: safety
def _dead(pids: Sequence[int]) -> List[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            out.append(pid)
    return out


class _EngineMonitor:
    """Notices a dead engine process without relying on signals.

    Upstream's subprocess watchdog reports a dead scheduler/detokenizer with SIGQUIT, which
    the tokenizer manager handles on its (uv)loop; a SIGQUIT that arrives while the loop is
    idle (between engine calls) was observed to be handled only minutes later, leaving the
    next call hanging. This thread polls the engine's processes; on a death it kills the
    rest, marks the engine dead and stops the loop if a call is running, which makes that
    call raise ``EngineDied`` (``_guard``); later calls raise at once.
    """

    def __init__(self, engine, pids: Sequence[int], interval: float = 0.5):
        import threading

        self.engine, self.pids, self.interval = engine, list(pids), interval
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="cpu-engine-monitor", daemon=True
        )
        self._thread.start()

    def check(self) -> bool:
        """True if the engine is (now known to be) dead."""
        if getattr(self.engine, "_test_engine_died", False):
            return True
        dead = _dead(self.pids)
        if not dead:
            return False
        self.engine._test_engine_died = dead
        logger.error(
            "engine process(es) %s died; killing the engine's other processes", dead
        )
        with contextlib.suppress(Exception):
            watchdog = self.engine.tokenizer_manager._subprocess_watchdog
            if watchdog is not None:
                watchdog._stop_event.set()  # no join: this may run on its own thread
        _kill(_with_descendants(self.pids))
        loop = self.engine.loop
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self.check():
                    return
            except Exception:  # noqa: BLE001 - never let the monitor die silently
                logger.exception("cpu-engine monitor failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _install_running_sigquit_handler(engine, monitor: _EngineMonitor) -> None:
    """Replace the tokenizer manager's running-phase SIGQUIT handler (it SIGKILLs the whole
    process tree, pytest included) with one that only runs the monitor's check."""
    tm = engine.tokenizer_manager
    base = tm.signal_handler_class

    class _TestSignalHandler(base):
        def running_phase_sigquit_handler(self, signum=None, frame=None):
            logger.error(
                "SIGQUIT from an engine process: a scheduler or the detokenizer died"
            )
            if (
                not monitor.check()
            ):  # a SIGQUIT without a dead process: treat the engine as dead
                engine._test_engine_died = True
                _kill(_with_descendants(monitor.pids))
                with contextlib.suppress(Exception):
                    engine.loop.stop()

    tm.signal_handler_class = _TestSignalHandler
    if (
        tm.event_loop is not None
    ):  # handle loop already created: swap the installed handler now
        handler = _TestSignalHandler(tm)
        with contextlib.suppress(Exception):
            tm.event_loop.add_signal_handler(
                signal.SIGQUIT, handler.running_phase_sigquit_handler
            )


def _guard(engine, monitor: _EngineMonitor, method):
    def call(*args, **kwargs):
        if monitor.check():
            raise EngineDied(
                f"the engine is dead (process(es) {engine._test_engine_died} died earlier); "
                "see the log above"
            )
        try:
            return method(*args, **kwargs)
        except RuntimeError as e:
            if monitor.check():
                raise EngineDied(
                    f"an engine process died during {method.__name__}: {e}"
                ) from e
            raise

    call.__name__ = method.__name__
    call.__doc__ = method.__doc__
    return call


# pr: safety end
# ----------------------------------------------------------------------------------------------
# The engine


DEFAULT_ENGINE_ARGS = dict(
    device="cpu",
    attention_backend="torch_native",
    skip_tokenizer_init=True,
    # On CPU the engine refuses to start if free system memory fell by more than this fraction
    # while it loaded its weights: engines started side by side (several per test) need room.
    # The KV cache stays bounded by max_total_tokens, whatever the fraction.
    mem_fraction_static=0.3,
    max_total_tokens=4096,  # without it the CPU platform sizes the KV cache from system RAM (~1 GB)
    disable_cuda_graph=True,
    random_seed=0,
    log_level="warning",
    # An idle scheduler polls its sockets instead of spinning: on a machine with few cores an
    # idle engine would otherwise take a core from the test and trainer processes beside it.
    sleep_on_idle=True,
)

# pr: here
# ``cpu_engine(..., env=COMPILED)``: the engine's processes run SGLang's torch.compile'd helpers
# compiled, as a user's engine does (``configure_cpu_env`` disables dynamo for the others).
# Inductor compiles in the scheduler itself: its pool of compile workers (one fresh interpreter
# each, about twenty for a TP-2 engine here) would cost more than the few kernels they compile.
COMPILED: Mapping[str, Optional[str]] = {
    "TORCHDYNAMO_DISABLE": None,
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}
# pr: here end

# The same, for engines that tests start in worker processes, whose warnings would only add noise.
WORKER_ENGINE_ARGS = {**DEFAULT_ENGINE_ARGS, "log_level": "error"}

# pr: safety
_GUARDED = (
    "generate",
    "begin_weight_update",
    "end_weight_update",
    "update_weights_from_tensor",
    "update_weights_from_distributed",
    "update_weights_from_disk",
    "flush_cache",
)


@contextlib.contextmanager
def cpu_engine(
    model_dir: PathLike,
    tp_size: int = 1,
    env: Optional[Mapping[str, str]] = None,
    **kwargs,
):
    """Start ``sglang.Engine`` on CPU for ``model_dir`` at ``tp_size``, yield it, shut it down.

    ``kwargs`` override ``DEFAULT_ENGINE_ARGS`` (any ``ServerArgs`` field). The engine's
    scheduler processes get ``SGLANG_CPU_OMP_THREADS_BIND`` from ``omp_bind(tp_size)``
    unless it is already set, and ``env`` (this process's environment is left as it was).
    Timings land in ``engine.test_timings`` (``start_s``).
    """
    configure_cpu_env()
    check_cpu_env()
    import atexit

    import sglang

    before = _shm_entries()
    started_at = time.time()
    own_children = set(_children())
    args = {
        **DEFAULT_ENGINE_ARGS,
        "model_path": str(model_dir),
        "tp_size": tp_size,
        "custom_sigquit_handler": _launch_sigquit_handler,
        **kwargs,
    }
    env = dict(env or {})
    if tp_size > 1 and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        env["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(tp_size)

    def new_children() -> List[int]:
        # Children that appeared while the engine started are the engine's (schedulers,
        # detokenizer), except multiprocessing's resource tracker, which is shared.
        return [
            p
            for p in _children()
            if p not in own_children and p != _resource_tracker_pid()
        ]

    engine = monitor = None
    pids: List[int] = []
    try:
        t0 = time.perf_counter()
        try:
            with _env(env):  # read by the spawned schedulers at startup
                engine = sglang.Engine(**args)
        except BaseException:
            _kill(
                new_children()
            )  # a failed start may leave some ranks or the detokenizer running
            raise
        engine.test_timings = {"start_s": time.perf_counter() - t0}
        engine._test_engine_died = False
        pids = new_children()
        engine.test_pids = pids
        monitor = _EngineMonitor(engine, pids)
        _install_running_sigquit_handler(engine, monitor)
        for name in _GUARDED:
            if hasattr(engine, name):
                setattr(engine, name, _guard(engine, monitor, getattr(engine, name)))
        yield engine
    finally:
        if monitor is not None:
            monitor.stop()
        if engine is not None:
            try:
                with _kill_only(
                    pids
                ):  # upstream would kill every child of this process
                    engine.shutdown()
            except Exception:  # noqa: BLE001 - a dead engine may fail to shut down cleanly
                logger.exception("engine.shutdown() failed; killing its processes")
                _kill(_with_descendants(pids))
            # shutdown() registered itself with atexit; it is done, and running it again at
            # interpreter exit would kill whatever children this process has then.
            atexit.unregister(engine.shutdown)
        removed = cleanup_shm(before, started_at, pids)
        if removed:
            logger.info("removed from /dev/shm: %s", removed)


# pr: safety end
# ----------------------------------------------------------------------------------------------
# Greedy decoding: SGLang and HF


def engine_greedy(engine, prompts: Prompts, max_new_tokens: int) -> List[List[int]]:
    """Greedy (temperature 0) continuation of each prompt (token ids), ignoring EOS."""
    out = engine.generate(
        input_ids=[list(map(int, p)) for p in prompts],
        sampling_params={
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    return [list(map(int, o["output_ids"])) for o in out]


def load_hf_model(
    model_dir: PathLike, weights: Optional[Mapping[str, torch.Tensor]] = None
):
    """HF ``AutoModelForCausalLM`` of ``model_dir`` (bf16, eval), with ``weights`` (HF checkpoint
    names, e.g. ``{"lm_head.weight": t}``) replacing checkpoint tensors first.

    Replacement goes through a modified copy of the checkpoint, so HF's own loading
    conversions apply (e.g. per-expert MoE tensors fused into ``experts.gate_up_proj``).
    """
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if not weights:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.bfloat16
        ).eval()
    from tiny_models import write_modified_checkpoint

    with tempfile.TemporaryDirectory(prefix="hf_modified_") as tmp:
        write_modified_checkpoint(model_dir, tmp, weights)
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.bfloat16
        ).eval()


def _as_hf_model(model, weights):
    if isinstance(model, (str, Path)):
        return load_hf_model(model, weights)
    if weights:
        raise ValueError("weights= only applies when model is a checkpoint directory")
    return model


def _routers(model) -> List[Tuple[torch.nn.Module, int]]:
    """MoE router modules (``mlp.gate`` returning ``(router_logits, ...)``) and their top-k."""
    top_k = getattr(model.config, "num_experts_per_tok", None)
    return [
        (m, getattr(m, "top_k", top_k))
        for name, m in model.named_modules()
        if name.endswith("mlp.gate")
        and top_k
        and hasattr(m, "weight")
        and m.weight.dim() == 2
        and m.weight.shape[0] == getattr(model.config, "num_experts", -1)
    ]


@torch.no_grad()
def _greedy(model, prompts: Prompts, max_new_tokens: int):
    """Greedy tokens, top-1/top-2 logit margins (fp32) per step, and per prompt the smallest
    router margin (k-th minus (k+1)-th router logit over all tokens and MoE layers; inf for
    dense models). Equal-length prompts are decoded as one batch."""
    tokens: List[List[int]] = [[] for _ in prompts]
    margins: List[List[float]] = [[] for _ in prompts]
    router_margin: List[float] = [float("inf")] * len(prompts)
    by_len: Dict[int, List[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    current: List[int] = []

    def hook(module, inputs, output, k):
        logits = (output[0] if isinstance(output, tuple) else output).float()
        logits = logits.reshape(len(current), -1, logits.shape[-1])
        top = logits.topk(k + 1, dim=-1).values
        gap = (top[..., k - 1] - top[..., k]).amin(dim=-1)
        for row, i in enumerate(current):
            router_margin[i] = min(router_margin[i], float(gap[row]))

    handles = [
        m.register_forward_hook(lambda mod, a, o, k=k: hook(mod, a, o, k))
        for m, k in _routers(model)
    ]
    try:
        for idx in by_len.values():
            current[:] = idx
            ids = torch.tensor(
                [list(map(int, prompts[i])) for i in idx], dtype=torch.long
            )
            out = model(input_ids=ids, use_cache=True)
            for step in range(max_new_tokens):
                logits = out.logits[:, -1].float()
                top = logits.topk(2, dim=-1)
                nxt = top.indices[:, 0]
                for row, i in enumerate(idx):
                    tokens[i].append(int(nxt[row]))
                    margins[i].append(float(top.values[row, 0] - top.values[row, 1]))
                if step + 1 < max_new_tokens:
                    out = model(
                        input_ids=nxt[:, None],
                        past_key_values=out.past_key_values,
                        use_cache=True,
                    )
    finally:
        for h in handles:
            h.remove()
    return tokens, margins, router_margin


def hf_greedy(
    model,
    prompts: Prompts,
    max_new_tokens: int,
    weights: Optional[Mapping[str, torch.Tensor]] = None,
) -> List[List[int]]:
    """HF greedy continuation (token ids) of each prompt, with a KV cache, EOS ignored.

    ``model`` is a checkpoint directory (optionally with ``weights`` replacing some of its
    tensors, by HF checkpoint name; see ``load_hf_model``) or an already loaded HF model.
    Prompts of equal length are decoded as one batch.
    """
    return _greedy(_as_hf_model(model, weights), prompts, max_new_tokens)[0]


# pr: here
def hf_greedy_margins(
    model,
    prompts: Prompts,
    max_new_tokens: int,
    weights: Optional[Mapping[str, torch.Tensor]] = None,
) -> List[List[float]]:
    """Top-1 minus top-2 logit (fp32) at each HF greedy step: how close each step is to a tie.

    Useful to tell a real mismatch from a bf16 near-tie when engine and HF disagree.
    """
    return _greedy(_as_hf_model(model, weights), prompts, max_new_tokens)[1]


def greedy_mismatches(
    model,
    prompts: Prompts,
    outputs: Sequence[Sequence[int]],
    tol: float = 0.25,
    weights: Optional[Mapping[str, torch.Tensor]] = None,
) -> List[str]:
    """Teacher-forced check of greedy ``outputs`` (e.g. the engine's) against HF, tolerant to bf16 ties.

    Feeds HF each prompt followed by its output and requires, at every step, that the
    output token's HF logit is within ``tol`` of the best HF logit there. Unlike exact
    comparison with ``hf_greedy`` this does not stop at the first near-tie flip, and a
    wrong weight still fails (its tokens score far below HF's best). Returns one line per
    bad step; empty means the outputs are greedy for the HF model up to ``tol``.
    """
    model = _as_hf_model(model, weights)
    problems = []
    with torch.no_grad():
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            out = list(map(int, out))
            if not out:
                continue
            ids = torch.tensor([list(map(int, prompt)) + out[:-1]], dtype=torch.long)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
            for step, token in enumerate(out):
                best = int(logits[step].argmax())
                gap = float(logits[step, best] - logits[step, token])
                if gap > tol:
                    problems.append(
                        f"prompt {i} step {step}: token {token} is {gap:.3f} below HF's best "
                        f"{best} (logit {float(logits[step, best]):.3f})"
                    )
    return problems


# pr: here end
def stable_prompts(
    models: Sequence,
    count: int,
    max_new_tokens: int,
    min_margin: float = 0.25,
    prompt_len: int = 6,
    vocab_size: int = 512,
    seed: int = 0,
    max_tries: int = 8192,
    min_router_margin: float = 0.05,
) -> List[List[int]]:
    """``count`` seeded random prompts on which exact greedy comparison with HF is robust.

    A prompt qualifies if, for every model in ``models``, HF's greedy continuation has a
    top-1/top-2 logit gap of at least ``min_margin`` at every step and, for MoE models,
    every token's k-th and (k+1)-th router logits (every MoE layer) differ by at least
    ``min_router_margin``. SGLang and HF round differently in bf16, so a near-tie in the
    output logits, or in expert routing (seen with the tiny Qwen3-MoE: different tokens
    at TP 1 with output gaps of 0.4-2), can flip. 0.25 is about 4 bf16 ulps at the tiny
    models' logit scale (~8-10); router logits are ~2, where 0.05 is ~3 ulps.

    Acceptance falls fast with stricter margins, longer prompts and more steps: for the
    tiny Qwen3-MoE and 8 steps, 5% of random prompts pass at (0.25, 0.05) with
    ``prompt_len=4`` and 1.6% at length 6, but under 0.4% at ``min_margin=0.5``.

    Each entry of ``models`` is a checkpoint directory, a ``(directory, weights)`` pair or a
    loaded HF model.
    """
    loaded = [
        load_hf_model(*m) if isinstance(m, tuple) else _as_hf_model(m, None)
        for m in models
    ]
    g = torch.Generator().manual_seed(seed)
    chosen: List[List[int]] = []
    tried = 0
    while tried < max_tries:
        batch = torch.randint(0, vocab_size, (256, prompt_len), generator=g).tolist()
        tried += len(batch)
        ok = [True] * len(batch)
        for m in loaded:
            _, margins, router = _greedy(m, batch, max_new_tokens)
            for j in range(len(batch)):
                ok[j] = (
                    ok[j]
                    and min(margins[j]) >= min_margin
                    and router[j] >= min_router_margin
                )
        chosen += [p for p, good in zip(batch, ok) if good]
        if len(chosen) >= count:
            return chosen[:count]
    raise RuntimeError(
        f"only {len(chosen)} of {count} prompts with margins >= {min_margin} (router "
        f"{min_router_margin}) in {tried} tries; try a shorter prompt_len or max_new_tokens"
    )


@contextlib.contextmanager
def weight_update_session(engine) -> Iterator[None]:
    """0.5.23 accepts weight updates only between ``begin_weight_update()`` and
    ``end_weight_update()``; older releases have no session and take them at any time."""
    if not hasattr(engine, "begin_weight_update"):
        yield
        return
    engine.begin_weight_update()
    try:
        yield
    finally:
        engine.end_weight_update()
