"""What each rank does in the weight-sync group tests without an engine (``test_remote_group``).

One gloo world of processes plays a trainer (its first ranks, FSDP-style ``Shard(0)``
shards of fp32 weights) and remote engines (the ranks after them, each engine's TP ranks
with bf16 parameters shaped by the hand rules of a tiny Qwen2, ``benchmark.weight_sync``).
They meet in a ``SyncGroup`` made in a TCP store the trainer's first rank hosts, as in
production; the world's own group is used for nothing else. Every engine rank must end
with SGLang's slicing of the weights bit for bit, having received exactly its
parameters' bytes.
"""

from __future__ import annotations

import os
import time
from typing import List

import torch

GROUP = "test-group"


class Collected:
    """Deferred landings, kept for the test to write (what an engine's staging does)."""

    def __init__(self):
        from sglang.srt.weight_sync.executor import Deferred

        self.landings: List = []
        self.deferred = type(
            "Collect", (Deferred,), {"landed": lambda _, xs: self.landings.extend(xs)}
        )()


def _setup(rank: int, job: dict, store=None, timeout: float = 60):
    import tiny_models

    from benchmark.weight_sync.hand_rules import model_targets_from_config
    from sglang.srt.weight_sync.manifest import EngineManifest
    from sglang.srt.weight_sync.remote.group import SyncGroup
    from sglang.srt.weight_sync.remote.protocol import Membership
    from sglang.srt.weight_sync.remote.rendezvous import open_store
    from sglang.srt.weight_sync.target_layout import EngineParallel

    config = tiny_models.tiny_config("qwen2")
    membership = Membership.of(
        GROUP,
        job.get("epoch", 1),
        "127.0.0.1",
        job["port"],
        "gloo",
        job["trainers"],
        job["engines"],
    )
    if store is None:
        store = open_store("127.0.0.1", job["port"], rank == 0, 60)
    group = SyncGroup(
        GROUP, membership.epoch, membership.world_size, "gloo", rank, store, timeout
    )
    group.hear_membership(membership if rank == 0 else None, 60)
    member = membership.engine_of(rank)
    targets = None
    if member is not None:
        targets = model_targets_from_config(
            config, EngineParallel(member.tp_size), torch.bfloat16
        )
    publish = member is not None and rank == member.offset
    group.exchange_layouts(EngineManifest.of(targets) if publish else None, None, 60)
    return group, member, targets, store


def weights_of(seed: int):
    import tiny_models

    from benchmark.weight_sync.hand_rules import model_targets_from_config
    from sglang.srt.weight_sync.target_layout import EngineParallel

    shapes = model_targets_from_config(
        tiny_models.tiny_config("qwen2"), EngineParallel(1), torch.bfloat16
    ).tensor_shapes()
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in sorted(shapes.items())}


def trainer_part(rank: int, trainers: int, weights, bucket: int, update_id: str):
    from sglang.srt.weight_sync.remote.group import SyncGroup, TrainerPart
    from sglang.srt.weight_sync.remote.protocol import UpdateHeader
    from sglang.srt.weight_sync.source_layout import MeshSpec

    specs = {
        n: MeshSpec.sharded(t.shape, t.dtype, 0, list(range(trainers)))
        for n, t in weights.items()
    }
    local = {}
    for n, spec in specs.items():
        box = spec.describe(n).box_of(rank)
        local[n] = weights[n][box.slices()].contiguous()
    part = TrainerPart(specs, local)
    if rank == 0:
        part.wire, digest = SyncGroup.wire_of(specs)
        part.header = UpdateHeader(
            update_id, digest, len(part.wire), bucket, len(specs)
        )
    return part


def remote_group_job(rank: int, world: int, job: dict, store=None) -> dict:
    """Updates (one per seed) from the trainer ranks to every engine; per rank what it sent
    or received, and on engine ranks whether every parameter is SGLang's slicing."""
    from benchmark.weight_sync.hand_rules import reference_param
    from sglang.srt.weight_sync.executor import write_landings, write_zero_fills

    group, member, targets, _store = _setup(rank, job, store)
    out = {"updates": []}
    for i, seed in enumerate(job["seeds"]):
        weights = weights_of(seed)
        if member is None:
            part = trainer_part(rank, job["trainers"], weights, job["bucket"], f"u{i}")
            if job.get("nan") and rank == 1:
                part.local[sorted(part.local)[0]][0] = float("nan")
            if job.get("wrong_shard") and rank == 1:  # one row short
                name = sorted(part.local)[0]
                part.local = {**part.local, name: part.local[name][:-1]}

            def finite(_header, _specs, local=part.local):
                from sglang.srt.weight_sync.apply import nonfinite_tensors

                return [
                    f"trainer rank {rank}: tensor {n!r} holds NaN"
                    for n in nonfinite_tensors(local)
                ]

            try:
                result = group.run_update(part, 60, finite)
            except Exception as e:  # noqa: BLE001 - the test reads the message
                out["updates"].append({"error": f"{type(e).__name__}: {e}"})
                continue
            out["updates"].append(
                {"sent": result.stats.bytes_sent, "rounds": result.stats.rounds}
            )
            continue
        tp_rank = rank - member.offset
        params = {
            t.name: torch.full(t.shape, 7.0, dtype=t.dtype)
            for t in targets.for_rank(tp_rank)
        }
        peak = None
        if job.get("staging"):  # the engine's own staging, drained as its pause does
            from sglang.srt.weight_sync.remote.engine import (
                Receive,
                Staging,
                write_staged,
            )

            staging = Staging(job["staging"], 60, group.who)
            receiving = Receive(group, staging, None, params, 60)
            write_staged(receiving, params, 60)
            receiving.thread.join()
            result, peak = receiving.result, staging.peak
        else:
            collected = Collected()
            try:
                result = group.run_update(None, 60, None, params, collected.deferred)
            except Exception as e:  # noqa: BLE001 - the test reads the message
                out["updates"].append({"error": f"{type(e).__name__}: {e}"})
                continue
            write_zero_fills(result.plan, rank, params)
            write_landings(params, collected.landings)
        wrong = [
            t.name
            for t in targets.for_rank(tp_rank)
            if not torch.equal(params[t.name], reference_param(t, weights))
        ]
        out["updates"].append(
            {
                "received": result.stats.bytes_received,
                "lower_bound": result.plan.lower_bound_bytes(rank),
                "param_bytes": sum(
                    p.numel() * p.element_size() for p in params.values()
                ),
                "wrong": wrong,
                "rounds": result.stats.rounds,
                "staging_peak": peak,
                "largest_round": result.stats.largest_round_bytes,
            }
        )
    group.close()
    return out


def dying_engine_job(rank: int, world: int, job: dict) -> dict:
    """The last rank (an engine rank) dies in the middle of receiving; every other rank
    must return an error within the bound naming the phase."""
    group, member, targets, _store = _setup(rank, job)
    weights = weights_of(1)
    timeout = job["timeout"]
    started = time.monotonic()
    if member is None:
        part = trainer_part(rank, job["trainers"], weights, job["bucket"], "u-die")
        try:
            group.run_update(part, timeout)
            error = None
        except Exception as e:  # noqa: BLE001 - the test reads the message
            error = f"{type(e).__name__}: {e}"
        return {"error": error, "seconds": time.monotonic() - started}
    tp_rank = rank - member.offset
    params = {
        t.name: torch.zeros(t.shape, dtype=t.dtype) for t in targets.for_rank(tp_rank)
    }

    collected = Collected()
    rounds = []

    def landed(_, xs):
        rounds.append(len(xs))
        if rank == world - 1 and len(rounds) == 2:
            os._exit(0)  # killed mid-update, after two rounds

    collected.deferred.__class__.landed = landed
    try:
        group.run_update(None, timeout, None, params, collected.deferred)
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads the message
        error = f"{type(e).__name__}: {e}"
    return {
        "error": error,
        "seconds": time.monotonic() - started,
        "rounds": len(rounds),
    }


def stalled_join_job(rank: int, world: int, job: dict) -> dict:
    """Epoch 1: the last rank (an engine rank) stops short of the rendezvous (``stall``:
    before meeting the others in the store, or after it, before making the epoch's groups,
    as a rank whose address its peers cannot reach); every other rank must fail its join
    within ``timeout``. Epoch 2, every rank again: an update must land bit for bit."""
    from sglang.srt.weight_sync.remote import group as remote_group
    from sglang.srt.weight_sync.remote.rendezvous import open_store

    store = open_store("127.0.0.1", job["port"], rank == 0, 60)
    timeout, out = job["timeout"], {}
    started = time.monotonic()
    if rank == world - 1:
        if job["stall"] == "groups":  # meets the others, then never makes a group
            remote_group.join_group = lambda *a, **k: time.sleep(timeout + 3) or 1 / 0
        else:
            time.sleep(timeout + 3)
    try:
        _setup(rank, {**job, "epoch": 1}, store, timeout)
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - the test reads the message
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - started
    if rank == world - 1:
        from sglang.srt.weight_sync.control_plane import join_group

        remote_group.join_group = join_group
    time.sleep(max(0.0, timeout + 4 - out["seconds"]))  # the stalled rank is back
    out.update(remote_group_job(rank, world, {**job, "epoch": 2}, store))
    if rank == 0:  # epoch 2 formed: this rank (the store's host) deleted epoch 1's keys
        out["epoch1_keys"] = [k for k in store.list_keys() if "/epoch1/" in k]
    return out


def silent_engines_job(rank: int, world: int, job: dict) -> dict:
    """Trainer ranks whose only engine does not answer its health check (as one busy or
    gone would): the join raises ``RemoteSyncError`` on every trainer rank, naming the
    engine, where it used to form a group of no engine whose updates reported success."""
    from sglang.srt.weight_sync.remote import (
        EngineEndpoint,
        RemoteSync,
        RemoteSyncError,
    )

    asked = []

    class Silent(EngineEndpoint):
        name = "http://silent:1"

        def tp_size(self) -> int:
            return 1

        def alive(self, timeout_s: float) -> bool:
            asked.append(timeout_s)
            return False

    sync = RemoteSync(
        GROUP,
        "127.0.0.1",
        job["port"],
        [Silent()] if rank == 0 else [],
        backend="gloo",
        timeout_s=job["timeout"],
    )
    try:
        sync.join()
        error = None
    except RemoteSyncError as e:
        error = str(e)
    finally:
        sync.close()
    return {"error": error, "asked": asked, "left": sync.left}
