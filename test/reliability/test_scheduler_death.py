"""An engine scheduler dies or hangs during a distributed update its trainer ranks drive.

Two trainer ranks (gloo) drive a TP-2 CPU engine that rank 0 hosts
(``hosted_engine.HostedEngine``: ``trainer_flow``'s update served by
``Engine.update_weights_distributed``, as ``VerlEngine`` drives it), with SGLang's own
signal handlers (as in a real job; not the test fixture's). After a good update the
test SIGKILLs (``died``) or SIGSTOPs (``hung``) the TP-rank-1 scheduler, then both ranks
start the next update. Measured before this suite: the host rank hung for over 10
minutes.

* ``hung``: SGLang sees nothing wrong (the process is alive). The engine answers within
  ``answer_bound_s(timeout_s)`` with ``success=False`` saying that an engine rank did not
  answer, so every trainer rank raises with that message; generation is then refused at
  once (the weights are unknown) instead of hanging on the stopped rank; the engine can
  then be shut down and leaves no process behind.
* ``died``: SGLang's subprocess watchdog sends SIGQUIT to the host, whose upstream
  handler SIGKILLs the host and the engine's processes. The surviving trainer rank
  raises ``PeerLost`` naming the phase and the missing rank within its bound.
"""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest
from faults import TP

TIMEOUT_S = 5.0  # also the margin by which the host's answer beats its peers' own bound (2 * timeout + grace)
PHASES = (
    "before the engine reads the payloads",
    "while the engine applies the update",
    "hearing the engine's answer",
)
# process start/exit and the 1 s watchdog poll, on a loaded 2-core machine
SLACK_S = 10.0


def host_job(rank: int, world: int, job: dict) -> dict:
    """A good update, then (once the test has injured the engine) the next one; how it ended."""
    from engine import DEFAULT_ENGINE_ARGS, omp_bind
    from hosted_engine import HostedEngine
    from torch.distributed.device_mesh import init_device_mesh
    from update_cases import as_layout, new_weights

    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(TP)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    host = HostedEngine(
        mesh["tp"],
        weight_sync_timeout_s=TIMEOUT_S,
        session=False,  # the scheduler's one-shot session, as VerlEngine's updates
        model_path=job["model_dir"],
        **DEFAULT_ENGINE_ARGS,
    )
    first = host.update(
        as_layout(new_weights(job["model_dir"], 1), "fsdp", mesh)
    ).success
    if rank == 0:
        job["ready"].put(os.getpid())
    job["go"].get(timeout=300)
    start = time.monotonic()
    try:
        host.update(as_layout(new_weights(job["model_dir"], 2), "fsdp", mesh))
        outcome = "returned"
    except Exception as e:  # noqa: BLE001 - how it failed is what the test checks
        outcome = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    generation = None
    if (
        rank == 0 and job["fault"] == "hung"
    ):  # on the host only: HostedEngine.generate would broadcast the error
        start = time.monotonic()
        try:
            host.engine.generate(
                input_ids=[[5, 17, 42, 7]], sampling_params={"max_new_tokens": 2}
            )
            generation = ("served", time.monotonic() - start)
        except ValueError as e:
            generation = (f"ValueError: {e}", time.monotonic() - start)
    start = time.monotonic()
    if rank == 0:
        host.shutdown()  # the engine's processes, the stopped scheduler included
    return dict(
        first=first,
        elapsed=elapsed,
        outcome=outcome,
        generation=generation,
        shutdown_s=time.monotonic() - start,
    )


def _schedulers(host_pid: int) -> dict:
    """The engine's processes under the host, by the names SGLang gives them."""
    procs = {}
    for child in psutil.Process(host_pid).children(recursive=True):
        m = re.search(
            r"sglang::(scheduler_TP\d|detokenizer)", " ".join(child.cmdline())
        )
        if m:
            procs[m.group(1)] = child
    return procs


def run(model_dir, fault: str):
    """Start the ranks, injure TP rank 1's scheduler after the first update, let both ranks
    update again; returns (results of the ranks that lived, exit codes, engine processes)."""
    import multiprocessing as mp
    import queue
    import tempfile

    from ranks import _worker

    ctx = mp.get_context("spawn")
    results, ready, go = ctx.Queue(), ctx.Queue(), ctx.Queue()
    job = dict(model_dir=str(model_dir), ready=ready, go=go, fault=fault)
    out, engine = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, TP, os.path.join(tmp, "store"), host_job, (job,), results),
            )
            for r in range(TP)
        ]
        for p in procs:
            p.start()
        try:
            host = ready.get(timeout=300)
            engine = _schedulers(host)
            assert set(engine) == {"scheduler_TP0", "scheduler_TP1", "detokenizer"}, (
                engine
            )
            victim = engine["scheduler_TP1"]
            victim.send_signal(signal.SIGKILL if fault == "died" else signal.SIGSTOP)
            for _ in procs:
                go.put(True)
            end = time.monotonic() + 2 * TIMEOUT_S + 30 + 60
            while (
                len(out) < TP
                and time.monotonic() < end
                and any(p.is_alive() for p in procs)
            ):
                try:
                    rank, ok, value = results.get(timeout=1)
                except queue.Empty:
                    continue
                assert ok, f"trainer rank {rank} failed:\n{value}"
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=30)
            hung = [p.pid for p in procs if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
            _, alive = psutil.wait_procs(list(engine.values()), timeout=30)
            for p in alive:
                p.kill()
        assert not hung, f"trainer processes {hung} still running"
        assert not alive, f"engine processes left behind: {alive}"
        return out, [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import tiny_models

    return tiny_models.make_tiny_model("qwen2", tmp_path_factory.mktemp("model"))[0]


def test_hung_scheduler_gets_an_answer_within_the_bound(model_dir):
    from sglang.srt.weight_sync.control_plane import answer_bound_s

    bound = answer_bound_s(TIMEOUT_S)
    out, exitcodes = run(model_dir, "hung")
    assert sorted(out) == [0, 1] and exitcodes == [0, 0], (sorted(out), exitcodes)
    for rank, result in out.items():
        assert result["first"] is True
        outcome = result["outcome"]
        assert result["elapsed"] < bound + SLACK_S, (
            f"rank {rank} took {result['elapsed']:.1f}s (bound {bound}s)"
        )
        assert outcome.startswith("RuntimeError: weight update"), outcome
        assert (
            f"no answer from the engine within {bound:g}s to distributed weight update"
            in outcome
        ), outcome
        assert "waiting for its schedulers to receive and apply it" in outcome, outcome
        assert "an engine rank did not answer" in outcome, outcome
    refusal, seconds = out[0]["generation"]
    assert refusal.startswith(
        "ValueError: generation refused: the engine has not answered distributed weight "
        "update"
    ), refusal
    assert "restart the engine" in refusal and seconds < 5, (refusal, seconds)


def test_dead_scheduler_takes_the_engine_down_and_the_survivor_is_told(model_dir):
    from sglang.srt.weight_sync.control_plane import GRACE_S

    out, exitcodes = run(model_dir, "died")
    # upstream's subprocess watchdog SIGQUITs the host, whose handler SIGKILLs it and the engine
    assert exitcodes[0] == -signal.SIGKILL, exitcodes
    assert sorted(out) == [1], sorted(out)
    survivor = out[1]
    assert survivor["first"] is True
    assert survivor["elapsed"] < 2 * TIMEOUT_S + GRACE_S + SLACK_S, survivor
    outcome = survivor["outcome"]
    assert outcome.startswith("PeerLost: trainer rank 1: ") and any(
        p in outcome for p in PHASES
    ), outcome
    assert re.search(r"\b[Rr]anks? \[?0\b", outcome), (
        f"the missing rank is not named: {outcome}"
    )
