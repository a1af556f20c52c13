"""Helpers of the reliability tests: an engine, its state, and payloads sent by hand."""

from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Sequence, Tuple

import tiny_models
import torch
from engine import cpu_engine
from update_cases import checksums

TP = 2


@contextlib.contextmanager
def running_engine(directory, fault_dir=None):
    """A TP-2 tiny-Qwen2 engine; with ``fault_dir``, its ranks fail after their writes on
    demand (``test/support/sitecustomize.py``, ``SGLANG_TEST_FAULT_DIR``)."""
    model_dir, config = tiny_models.make_tiny_model("qwen2", directory)
    env = {"SGLANG_TEST_FAULT_DIR": str(fault_dir)} if fault_dir is not None else None
    with cpu_engine(model_dir, tp_size=TP, env=env) as eng:
        yield eng, model_dir, config


def state(eng) -> Dict[int, Dict[str, str]]:
    """Per-rank parameter checksums (SGLang's weight checker)."""
    return checksums(eng)


def generate(
    eng, prompts: Sequence[Sequence[int]], max_new: int = 4
) -> List[List[int]]:
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    return [
        o["output_ids"]
        for o in eng.generate(
            input_ids=[list(p) for p in prompts], sampling_params=params
        )
    ]


def full_shards(
    weights: Dict[str, torch.Tensor],
) -> List[Tuple[str, torch.Tensor, object]]:
    """Every tensor whole, held by both trainer ranks (what each rank sends)."""
    from sglang.srt.weight_sync.source_layout import MeshSpec

    return [
        (n, t, MeshSpec.full(t.shape, t.dtype, list(range(TP))))
        for n, t in sorted(weights.items())
    ]


def send(channel: str, update_id: str, per_rank: Sequence[list]) -> list:
    """Push each engine rank's shards as the trainer rank beside it would; returns the
    senders (keep them until the engine has read the shards, then close them)."""
    from sglang.srt.weight_sync.delivery import ShardSender

    senders = []
    for rank, shards in enumerate(per_rank):
        sender = ShardSender(channel, rank)
        sender.send(update_id, rank, {r: r for r in range(TP)}, shards)
        senders.append(sender)
    return senders


def update(eng, channel: str, update_id: str, per_rank: Sequence[list] = (), **kwargs):
    """Send ``per_rank`` shards (may be empty) and ask the engine to apply ``update_id``;
    returns (success, message, seconds the engine took)."""
    senders = send(channel, update_id, per_rank) if per_rank else []
    eng.begin_weight_update()
    try:
        start = time.monotonic()
        reply = eng.update_weights_distributed(update_id, channel, **kwargs)
        return reply["success"], reply["message"], time.monotonic() - start
    finally:
        eng.end_weight_update()
        for s in senders:
            s.close()


def engine_fds() -> int:
    """Open file descriptors of this process's children (the engine's processes)."""
    import psutil

    total = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.num_fds()
    return total


# ----------------------------------------------------------------------------------------------
# Trainer ranks that die: a gloo world of trainer processes whose first rank relays its
# control request to the engine in the test process.


class RelayClient:
    """What rank 0 hands ``update_weights_distributed`` as ``engine``: the request goes to the
    test process, which owns the engine, and the answer comes back."""

    def __init__(self, requests, answers):
        self.requests, self.answers = requests, answers

    async def update_weights_from_tensor(self, req):
        self.requests.put(req)
        return self.answers.get(timeout=600)


def _arrange_death(when: str) -> None:
    """Make this trainer rank exit (as a SIGKILL would: no cleanup) at ``when``."""
    import os

    from sglang.srt.weight_sync.control_plane import ControlGroup

    if when == "before_delivery":
        os._exit(1)
    if (
        when == "after_delivery"
    ):  # past the barrier that says every payload is on its way
        real = ControlGroup.barrier

        def barrier_then_die(self, *args, **kwargs):
            real(self, *args, **kwargs)
            os._exit(1)

        ControlGroup.barrier = barrier_then_die
    # pr: scale
    if (
        when == "mid_update"
    ):  # entering trainer-side resharding: its peers wait for this rank's rows
        from sglang.srt.weight_sync import trainer_reshard

        def execute_then_die(*args, **kwargs):
            os._exit(1)

        trainer_reshard.execute = execute_then_die
    # pr: scale end


def trainer_job(rank: int, world: int, job: dict) -> dict:
    """A good update (seed 1), then the fault: ``job["die_rank"]`` dies at ``job["when"]``;
    the survivors report how long they took to fail and why."""
    import asyncio
    import functools
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from update_cases import as_layout, new_weights

    from sglang.srt.weight_sync import trainer_flow

    os.environ["TMPDIR"] = job[
        "tmp"
    ]  # the channel directories go there (forked ranks share the server's env)
    tempfile.tempdir = None
    mesh = init_device_mesh(
        "cpu", (1, world, 1), mesh_dim_names=("dp", "infer_tp", "infer_pp")
    )
    layout = "fsdp"
    # pr: scale
    if (
        job["when"] == "mid_update"
    ):  # FSDP shards resharded on the trainer side: rank 0 needs rows of rank 1
        trainer_flow.update_flow = functools.partial(
            trainer_flow.update_flow, mode="trainer"
        )
    # pr: scale end
    client = RelayClient(job["requests"], job["answers"]) if rank == 0 else None

    def update(seed):
        weights = as_layout(
            new_weights(job["model_dir"], seed), layout, mesh["infer_tp"]
        )
        return asyncio.run(
            trainer_flow.update_weights_distributed(
                client,
                weights,
                "infer_tp",
                mesh,
                fallback=None,
                timeout_s=job["timeout_s"],
            )
        )

    first = update(1)
    dist.barrier()
    if rank == job["die_rank"]:
        _arrange_death(job["when"])
    start = time.monotonic()
    # what the survivor's error says of the engine's answer (PeerLost.outcome)
    known = None
    try:
        update(2)
        outcome = "returned"
    except Exception as e:  # noqa: BLE001 - the survivor's error is what the test checks
        outcome = f"{type(e).__name__}: {e}"
        if getattr(e, "outcome", None) is not None:
            known = dict(
                update_id=e.outcome.update_id,
                applied=e.outcome.applied,
                answer=e.outcome.answer,
            )
    elapsed = time.monotonic() - start
    trainer_flow.TrainerSync.of(mesh).close()  # what VerlEngine.shutdown() does
    return dict(first=first, elapsed=elapsed, outcome=outcome, known=known)


def run_trainers(
    eng, world: int, job: dict, deadline_s: float = 300
) -> Tuple[Dict[int, dict], List[str]]:
    """Run ``trainer_job`` on ``world`` gloo ranks (forked from the preloaded fork server: no
    engine starts in them) while this process serves rank 0's engine requests; returns the
    results of the ranks that lived (dead ranks give none) and the channel directories left
    behind (the ranks make them in a private ``TMPDIR``)."""
    import os
    import queue
    import tempfile

    from ranks import _context, _worker

    ctx = _context("forkserver")
    results, requests, answers = ctx.Queue(), ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(job, requests=requests, answers=answers, tmp=tmp)
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker, args=(r, world, store, trainer_job, (job,), results)
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out, end = {}, time.monotonic() + deadline_s
        try:
            while time.monotonic() < end and (
                any(p.is_alive() for p in procs) or not results.empty()
            ):
                try:
                    req = requests.get(timeout=0.2)
                except queue.Empty:
                    pass
                else:
                    eng.begin_weight_update()
                    try:
                        answers.put(
                            eng.loop.run_until_complete(
                                eng.tokenizer_manager.update_weights_from_tensor(
                                    req, None
                                )
                            )
                        )
                    finally:
                        eng.end_weight_update()
                with contextlib.suppress(queue.Empty):
                    rank, ok, value = results.get_nowait()
                    assert ok, f"trainer rank {rank} failed:\n{value}"
                    out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        left = sorted(d for d in os.listdir(tmp) if d.startswith("sglang-weights-"))
    return out, left


# ----------------------------------------------------------------------------------------------
# Updates while generation is in flight: everything on the engine's own event loop.


async def generate_async(tm, prompt: Sequence[int], max_new: int) -> dict:
    """One greedy generation through the tokenizer manager; its last output."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(
        input_ids=list(prompt),
        sampling_params={
            "max_new_tokens": max_new,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    out = None
    async for out in tm.generate_request(obj, None):
        pass
    return out


async def update_async(
    eng, channel: str, update_id: str, per_rank: Sequence[list], **kwargs
) -> Tuple[bool, str]:
    """``update`` from within the engine's loop (so generation can run beside it)."""
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsDistributedReqInput,
    )

    tm = eng.tokenizer_manager
    senders = send(channel, update_id, per_rank)
    try:
        await tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
        try:
            reply = await tm.update_weights_distributed(
                UpdateWeightsDistributedReqInput(
                    update_id=update_id, channel=channel, **kwargs
                ),
                None,
            )
            return reply["success"], reply["message"]
        finally:
            await tm.end_weight_update(EndWeightUpdateReqInput(), None)
    finally:
        for s in senders:
            s.close()
