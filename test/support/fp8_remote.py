"""Block-FP8 remote engines in a weight-sync group: what each rank does (``test_fp8_update``).

One gloo world plays a trainer (its first ranks: ``Shard(0)`` chunks of the BF16 weights,
cutting 128-blocks at 3 ranks) and remote engines (the ranks after them). Each engine rank
holds the parameters of SGLang's FP8 model classes as that TP rank (names, shapes, dtypes
from ``fp8_cases.sglang_fp8_load``, garbage values) in a module, and runs the engine end's
own steps on it: ``EngineLayout.live`` (the block-FP8 transform, the manifest it publishes
through the group), ``Fp8Staging`` (the staged weights, its refusals in the update's
check), ``remote.engine.Receive`` into its ``Staging`` and ``write_staged`` (the pause's
writes, then the quantization). Afterwards every parameter must have the checksum of
SGLang's own load of the reference-quantized checkpoint. ``job["amx"]`` marks a layer as
SGLang's CPU AMX post-load step leaves it: refused before a byte moves. ``job["updates"]``
runs several updates, full or delta, each after the trainer changed a share of its weights
(``_step_weights``): the trainer ranks keep a ``delta_rounds.Snapshot``, and every engine
rank records its parameters' checksums and bytes after each, keeping the bf16 staging of
the pieces it quantizes itself between them (``delta_rounds.KeptStaging``, as the engine
does per membership); ("corrupt", density) is a delta update after each engine rank changed
one e4m3 byte of a weight behind the trainer's back, ("corrupt-kept", density) one after
each engine rank that keeps staging changed one bf16 element of it. An update an engine
rank refuses is a step with its ``error`` (and whether its parameters stayed
``unchanged``); the next steps go on.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

__all__ = ("module_of", "remote_fp8_job")

GROUP = "fp8-group"


def module_of(tensors: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are ``tensors`` by their dotted names (sharing storage)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def _step_weights(weights, step: int, density: float):
    """The trainer's weights for update ``step``: ``density`` of each tensor's elements
    scaled by a random factor near 1 (the same on every rank; 0: unchanged)."""
    if not density:
        return weights
    g = torch.Generator().manual_seed(100 + step)
    out = {}
    for n, t in sorted(weights.items()):
        mask = torch.rand(t.shape, generator=g) < density
        noise = 1 + 0.1 * torch.randn(t.shape, generator=g)
        out[n] = torch.where(mask, t.float() * noise, t.float()).to(t.dtype)
    return out


def _trainer(rank: int, job: dict, group, weights) -> dict:
    """Every update of ``job["updates"]`` ((kind, density) each; one full update when
    absent) from this trainer rank, keeping a ``delta_rounds.Snapshot`` committed after
    each success: what it sent, and each update's delta figures."""
    from sglang.srt.weight_sync.delta_rounds import Snapshot
    from sglang.srt.weight_sync.remote.group import SyncGroup, TrainerPart
    from sglang.srt.weight_sync.remote.protocol import UpdateHeader
    from sglang.srt.weight_sync.source_layout import MeshSpec

    ranks = list(range(job["trainers"]))
    heard = dict(group.block_fp8)  # each engine's block-FP8 weights, as heard at join
    snapshot = Snapshot() if "updates" in job else None
    steps = []
    for i, (kind, density) in enumerate(job.get("updates", [("full", 0.0)])):
        weights = _step_weights(weights, i, density)
        specs = {
            n: MeshSpec.sharded(t.shape, t.dtype, 0, ranks) for n, t in weights.items()
        }
        local = {
            n: weights[n][spec.describe(n).box_of(rank).slices()].clone()
            for n, spec in specs.items()
        }
        part = TrainerPart(specs, local)
        if rank == 0:
            part.wire, digest = SyncGroup.wire_of(specs)
            delta = kind in ("delta", "corrupt", "corrupt-kept")
            part.header = UpdateHeader(
                f"fp8-u{i + 1}",
                digest,
                len(part.wire),
                job["bucket"],
                len(specs),
                delta=delta,
                digest=delta,
                keep_base=snapshot is not None,
            )
        try:
            result = group.run_update(part, 60, snapshot=snapshot)
        except Exception as e:  # noqa: BLE001 - the test reads the message
            return {"error": f"{type(e).__name__}: {e}", "block_fp8": heard}
        if snapshot is not None:
            snapshot.commit(group.membership.epoch, result.plan.fingerprint)
        steps.append(
            {
                "sent": result.stats.bytes_sent,
                "why_full": result.why_full,
                "figures": result.delta.__dict__ if result.delta else {},
            }
        )
    return {"sent": steps[0]["sent"], "block_fp8": heard, "steps": steps}


def _engine_rank(tp: int, tp_rank: int, loads: dict, shapes) -> Tuple:
    """SGLang's FP8 model as TP rank ``tp_rank`` of ``tp`` (garbage values), its layout."""
    from sglang.srt.weight_sync.derive.derived_targets import DerivedTargets
    from sglang.srt.weight_sync.engine_layout import EngineLayout
    from sglang.srt.weight_sync.target_layout import EngineParallel

    live = loads[(tp, tp_rank)]["live"]
    garbage = torch.Generator().manual_seed(tp_rank)
    tensors = {
        n: torch.randn(s, generator=garbage).to(d) for n, (s, d) in sorted(live.items())
    }
    model = module_of(tensors)
    derived = DerivedTargets.of_ranks(  # the widths the engine publishes (EP, say)
        EngineParallel(*loads[(tp, 0)]["parallel"]),
        [loads[(tp, r)]["derived"] for r in range(tp)],
        shapes,
        {},
    )
    layout = EngineLayout(tp_rank)
    return model, layout, layout.live(model, derived, block_fp8=True)


def _differ(step: dict, live, fp8, load: dict) -> list:
    """The parameters an update wrote (``step``'s checksums) unlike SGLang's ``load``."""
    written = set(live.params) | {q.scale for q in fp8.quantized}
    return sorted(n for n in written if step["checksums"][n] != load["checksums"][n])


def remote_fp8_job(rank: int, world: int, job: dict, bf16: str, loads: dict) -> dict:
    """One update from ``job["trainers"]`` BF16 trainer ranks to block-FP8 engines
    ``job["engines"]`` ((name, TP) each); per rank what it sent, or received and whether
    every parameter equals SGLang's load (``loads[(TP, rank)]["checksums"]``)."""
    import tiny_models
    from fp8_cases import checksum
    from fp8_sender_cases import quantized_lower_bound

    from sglang.srt.weight_sync.delta_rounds import KeptStaging
    from sglang.srt.weight_sync.remote.engine import Receive, Staging, write_staged
    from sglang.srt.weight_sync.remote.group import SyncGroup
    from sglang.srt.weight_sync.remote.protocol import Membership
    from sglang.srt.weight_sync.remote.rendezvous import open_store
    from sglang.srt.weight_sync.source_layout import MeshSpec

    membership = Membership.of(
        GROUP, 1, "127.0.0.1", job["port"], "gloo", job["trainers"], job["engines"]
    )
    store = open_store("127.0.0.1", job["port"], rank == 0, 60)
    group = SyncGroup(GROUP, 1, membership.world_size, "gloo", rank, store, 60)
    group.hear_membership(membership if rank == 0 else None, 60)
    member = membership.engine_of(rank)
    weights = tiny_models.load_checkpoint(bf16)
    shapes = {n: tuple(t.shape) for n, t in weights.items()}
    if member is None:
        group.exchange_layouts(None, None, 60)
        out = _trainer(rank, job, group, weights)
        group.close()
        return out
    del weights  # an engine rank holds nothing of the trainer's
    from sglang.srt.weight_sync.fp8_staging import Fp8Staging

    tp_rank = rank - member.offset
    model, layout, live = _engine_rank(member.tp_size, tp_rank, loads, shapes)
    if job.get("amx"):  # as SGLang's CPU AMX post-load step leaves a layer: packed
        layer = model.get_submodule("model.layers.0.self_attn.qkv_proj")
        layer.quant_method = type("Fp8LinearMethod", (), {})()
        layer.use_intel_amx_backend = True
    first = tp_rank == 0
    group.exchange_layouts(
        live.manifest if first else None, None, 60, live.block_fp8_weights
    )
    steps = []
    kept = KeptStaging()  # the engine keeps one per membership
    updates = job.get("updates", [("full", 0.0)])
    for kind, _ in updates:
        if kind == "corrupt":  # one e4m3 byte changed behind the trainer's back
            weight = live.params[min(q.weight for q in live.fp8.own.quantized)]
            weight.view(torch.uint8).view(-1)[0] ^= 1
        corrupted = kind == "corrupt-kept" and bool(kept.regions)
        if corrupted:  # one bf16 element of the kept staging, behind its back
            region = kept.regions[min(kept.regions, key=repr)]
            region.view(torch.int16).view(-1)[0] ^= 1
        before = {n: checksum(p) for n, p in model.named_parameters()}
        # each update as the engine takes it: a staging of its own, received while
        # serving, written in the pause
        fp8 = Fp8Staging.of(live, tp_rank, torch.device("cpu"), group.who)
        staging = Staging(job["staging"], 60, group.who)
        receiving = Receive(
            group,
            staging,
            lambda header, specs, fp8=fp8: layout.refusals(model) + fp8.check(specs),
            live.params,  # checked against the plan only, as the engine does
            60,
            fp8,
            kept,
        )
        try:
            with (
                torch.no_grad()
            ):  # the pause: drains the staging while receiving goes on
                params = fp8.params(live.params)
                staged = sum(t.numel() * t.element_size() for t in fp8.staged.values())
                write_staged(receiving, params, 60)
        except RuntimeError:
            receiving.thread.join(60)
            now = {n: checksum(p) for n, p in model.named_parameters()}
            steps.append(
                {
                    "error": receiving.error,
                    "unchanged": now == before,
                    "corrupted": corrupted,
                    "kept_bytes": kept.nbytes,
                }
            )
            if len(steps) < len(updates):  # the group goes on: every round was run
                continue
            group.close()
            out = {"error": receiving.error, "unchanged": now == before, "steps": steps}
            if (
                len(steps) > 1
            ):  # the updates before this one: the first against SGLang's load
                load = loads[(member.tp_size, tp_rank)]
                out["differ"] = _differ(steps[0], live, fp8, load)
            return out
        receiving.thread.join(60)
        delta = receiving.result.delta
        steps.append(
            {
                "checksums": {n: checksum(p) for n, p in model.named_parameters()},
                "received": receiving.result.stats.bytes_received,
                "wire_bytes": delta.wire_bytes if delta else 0,
                "full_bytes": delta.full_bytes if delta else 0,
                "regions_unchanged": delta.regions_unchanged if delta else 0,
                "corrupted": corrupted,
                "kept_bytes": kept.nbytes,
            }
        )
        if len(steps) == 1:
            result, first_staging, first_fp8 = receiving.result, staging, fp8

    at_sender = [
        q
        for rnd in (result.fp8.quantized if result.fp8 is not None else ())
        for q in rnd
        if rank in {d.rank for d in q.move.dests}
    ]
    targets = live.targets.for_rank(tp_rank)
    sources = {
        n: MeshSpec.sharded(
            s, torch.bfloat16, 0, list(range(job["trainers"]))
        ).describe(n)
        for n, s in shapes.items()
    }
    now = dict(model.named_parameters())
    written = set(live.params) | {q.scale for q in fp8.quantized}
    group.close()
    staging, fp8 = first_staging, first_fp8
    return {
        "steps": steps,
        "differ": _differ(steps[0], live, fp8, loads[(member.tp_size, tp_rank)]),
        "not_written": sorted(set(now) - written),
        "unchanged": sorted(n for n in written if checksum(now[n]) == before[n]),
        "quantized": len(fp8.quantized),
        "received": result.stats.bytes_received,
        "lower_bound": result.lower_bound_bytes(rank),
        # counted block by block from the trainer's shards, independently of the plan
        "quantized_bound": quantized_lower_bound(
            sources, targets, fp8.quantized, {t.name: t.dtype.itemsize for t in targets}
        ),
        "blocks_at_sender": sum(q.blocks for q in at_sender),
        "quantized_received": sum(q.nbytes for q in at_sender),
        "staged_bytes": staged,
        "released": not fp8.staged,
        "unquantized_bytes": sum(
            t.numel() * t.element_size()
            for n, t in live.params.items()
            if n not in {q.weight for q in fp8.quantized}
        ),
        "staging_peak": staging.peak,
    }
