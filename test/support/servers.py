"""SGLang HTTP servers on CPU in process trees of their own, as remote engines are.

``http_server(model_dir, tp_size, ...)`` launches ``python -m sglang.launch_server`` in a new
session (its own process group: killing it, ``kill()``, takes the scheduler and detokenizer
processes with it and nothing else), waits until ``/health`` answers, yields a ``Server``
and kills it at the end; ``launch_side_by_side`` starts several before waiting for any. The server gets the CPU engine's environment
(``engine.configure_cpu_env``), ``SGLANG_CPU_OMP_THREADS_BIND`` for its TP ranks, and
``env``. ``Server.checksums()`` reads every TP rank's parameter checksums with SGLang's own
weight checker (``/weights_checker``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from engine import SUPPORT_DIR, _pid_alive, configure_cpu_env, omp_bind
from ports import free_port

ARGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--skip-tokenizer-init",
    "--mem-fraction-static", "0.3",
    "--max-total-tokens", "4096",
    "--disable-cuda-graph",
    "--random-seed", "0",
    "--log-level", "warning",
    "--sleep-on-idle",
)  # fmt: skip


@dataclass
class Server:
    """A running server: its URL, TP size, the launching process (its session leader)."""

    url: str
    tp_size: int
    process: subprocess.Popen
    log: str
    timings: Dict[str, float] = field(default_factory=dict)

    @property
    def server_args(self):  # what update_cases.checksums reads
        return type("Args", (), {"url": lambda _: self.url})()

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """Kill the server's whole process group (launcher, schedulers, detokenizer) and
        wait until none of it runs: /dev/shm hygiene keeps the files of a live creator."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _group_running(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def checksums(self):
        from update_cases import checksums

        return checksums(self)

    def generate(self, prompts, max_new_tokens: int):
        import requests

        body = {
            "input_ids": [list(map(int, p)) for p in prompts],
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        }
        reply = requests.post(f"{self.url}/generate", json=body, timeout=300)
        return reply.status_code, reply.json()


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (``engine._pid_alive``: zombies do not)."""
    import psutil

    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pgid and _pid_alive(pid):
                return True
    return False


class PortTaken(RuntimeError):
    """Another process took the server's port between choosing and binding it."""


def wait_healthy(
    url: str, process: subprocess.Popen, log: str, timeout: float = 900
) -> None:
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {process.returncode}")
        with open(log, errors="replace") as f:
            if "address already in use" in f.read():
                raise PortTaken(f"{url}: the port was taken")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"no SGLang server at {url} after {timeout} s")


def launch(
    model_dir,
    tp_size: int = 1,
    env: Optional[Mapping[str, str]] = None,
    log_dir: Optional[str] = None,
    cores: Optional[str] = None,
) -> Server:
    """Start a server (see the module's text) and wait until it is healthy; a port taken
    meanwhile by another process is replaced by another (three tries)."""
    for attempt in range(3):
        try:
            return _launch(model_dir, tp_size, env, log_dir, cores)
        except PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start(model_dir, tp_size, env, log_dir, cores) -> Server:
    """Popen a server; ``_ready`` waits for it."""
    configure_cpu_env()
    port = free_port()
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(SUPPORT_DIR), full_env.get("PYTHONPATH", "")]
    )
    full_env["SGLANG_CPU_OMP_THREADS_BIND"] = cores or omp_bind(tp_size)
    full_env.update(env or {})
    log = os.path.join(log_dir or "/tmp", f"sglang-server-{port}.log")
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang.launch_server",
                "--model-path",
                str(model_dir),
                "--tp-size",
                str(tp_size),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *ARGS,
            ],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", tp_size, process, log)
    server.timings["started"] = started
    return server


def _ready(server: Server) -> Server:
    """Wait until ``server`` answers ``/health`` (killed if it never does)."""
    try:
        wait_healthy(server.url, server.process, server.log)
    except BaseException:
        server.kill()
        raise
    server.timings["start_s"] = time.monotonic() - server.timings.pop("started")
    return server


def _launch(model_dir, tp_size, env, log_dir, cores) -> Server:
    return _ready(_start(model_dir, tp_size, env, log_dir, cores))


def launch_side_by_side(
    model_dir,
    tp_size: int,
    envs: Sequence[Optional[Mapping[str, str]]],
    log_dir: Optional[str] = None,
) -> List[Server]:
    """One server per entry of ``envs``, all started before any is waited for (their imports
    and loads overlap); one whose port was taken meanwhile is launched again alone."""
    starting = [_start(model_dir, tp_size, env, log_dir, None) for env in envs]
    servers: List[Server] = []
    try:
        for server, env in zip(starting, envs):
            try:
                servers.append(_ready(server))
            except PortTaken:
                servers.append(launch(model_dir, tp_size, env, log_dir))
    except BaseException:
        for server in starting + servers:
            server.kill()
        raise
    return servers


def launch_with_fault_dirs(
    model_dir, tp_size: int, count: int, directory
) -> Tuple[List[Server], List]:
    """``count`` servers side by side, each with a fault directory of its own under
    ``directory`` (``SGLANG_TEST_FAULT_DIR``, see ``sitecustomize``): (servers, directories)."""
    faults = [directory / f"faults{i}" for i in range(count)]
    for fault in faults:
        fault.mkdir()
    servers = launch_side_by_side(
        model_dir,
        tp_size,
        [{"SGLANG_TEST_FAULT_DIR": str(fault)} for fault in faults],
        log_dir=str(directory),
    )
    return servers, faults


@contextlib.contextmanager
def http_server(model_dir, tp_size: int = 1, **kwargs) -> Iterator[Server]:
    server = launch(model_dir, tp_size, **kwargs)
    try:
        yield server
    finally:
        server.kill()
