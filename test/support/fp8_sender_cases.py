"""Block-FP8 blocks quantized at the sender: one process runs a whole plan (``test_fp8_update``).

``Shard(0)`` chunks of the BF16 weights on ``trainers`` ranks (at 3 ranks a 512-row tensor
is cut at rows 171 and 342: its first and last 128-blocks lie whole on one rank, the
middle ones meet only on the engine), engine TP ranks after them holding the parameters of
SGLang's FP8 model classes (names, shapes, dtypes from ``fp8_cases.sglang_fp8_load``,
garbage values). The plan (``planner.plan``) is cut by ``fp8_sender.sender_quantized``; its
moves run here in one process, reading only each trainer rank's own chunk: the staged
dtype's regions land in the engine rank's staging, the quantized blocks are quantized by
their sender (``quantize_for_wire``) and written by the receiver (``land_quantized``); then
each engine rank quantizes what is left (``apply.write_quantized`` on
``SenderFp8Plan.engine_targets``). The lower bound of the quantized layout is counted block
by block, independently of the cut.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Tuple

import torch

__all__ = (
    "RANK_FIGURES",
    "quantized_lower_bound",
    "sender_side_update",
    "trainer_side_rank",
)

# the byte and staging figures every update rank of ``test_fp8_update`` returns
RANK_FIGURES = ("received", "lower_bound", "planned", "peak", "bf16_lower_bound")


def _blocks(box, block=(128, 128)):
    """The blocks of ``box`` (whole blocks of its tensor, last two dims), one box each."""
    from sglang.srt.weight_sync.box import Box

    lead = tuple(box.offsets[:-2]), tuple(box.sizes[:-2])
    (r0, c0), (r1, c1) = box.offsets[-2:], box.ends[-2:]
    for r in range(r0, r1, block[0]):
        for c in range(c0, c1, block[1]):
            yield Box(
                lead[0] + (r, c),
                lead[1] + (min(block[0], r1 - r), min(block[1], c1 - c)),
            )


def quantized_lower_bound(sources, targets, quantized, element_bytes, rank=None) -> int:
    """The least bytes an engine rank must receive when every block lying whole on one
    trainer rank travels quantized (one byte per element, a float32 scale per block) and
    every other element in its target's dtype. ``rank``: the trainer rank beside it
    (engine-side resharding), whose own elements it copies instead; None: it holds none."""
    names = {q.weight for q in quantized}

    def held(box, holders) -> int:
        own = (h.box.intersect(box) for h in holders if h.rank == rank)
        return sum(b.numel for b in own if b is not None)

    total = 0
    for t in targets:
        for p in t.pieces:
            holders = sources[p.tensor].holders
            if t.name not in names:
                total += (p.box.numel - held(p.box, holders)) * element_bytes[t.name]
                continue
            for b in _blocks(p.box):
                whole = [h for h in holders if h.box.contains(b)]
                if whole:
                    total += 0 if whole[0].rank == rank else b.numel + 4
                else:
                    total += (b.numel - held(b, holders)) * element_bytes[t.name]
    return total


def _run_moves(plan, sender, shards, staged, fp8_params) -> None:
    """Every move of ``sender`` (an ``fp8_sender.SenderFp8Plan``) as its two ends would."""
    from sglang.srt.weight_sync.fp8_sender import land_quantized, quantize_for_wire

    def read(m):
        return shards[m.src][m.holder.buffer][m.src_box().slices()]

    moves = list(sender.plan.local) + [m for rnd in sender.plan.rounds for m in rnd]
    for m in moves:
        data = read(m).to(m.dtype)
        for d in m.dests:
            staged[d.rank][d.param][d.index][d.box(m.region).slices()].copy_(data)
    quantized = list(sender.local) + [q for rnd in sender.quantized for q in rnd]
    for q in quantized:
        buf = quantize_for_wire(read(q.move), q.block)
        assert buf.numel() == q.nbytes, (q, buf.numel())
        for rank in {d.rank for d in q.move.dests}:
            land_quantized(q, buf, rank, fp8_params[rank])


def sender_side_update(
    bf16: str, loads: dict, trainers: int, tp: int, bucket: int
) -> Dict[int, dict]:
    """Per engine rank: parameters differing from SGLang's load, bytes received against
    the quantized lower bound and the plan's own, and blocks quantized at the sender."""
    import tiny_models
    from fp8_cases import checksum

    from sglang.srt.weight_sync.apply import write_quantized
    from sglang.srt.weight_sync.fp8_sender import sender_quantized
    from sglang.srt.weight_sync.fp8_targets import (
        block_fp8_targets,
        block_sites,
        staging_buffers,
    )
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.source_layout import MeshSpec

    full = tiny_models.load_checkpoint(bf16)
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    ranks = list(range(trainers))
    specs = {n: MeshSpec.sharded(t.shape, t.dtype, 0, ranks) for n, t in full.items()}
    sources = {n: spec.describe(n) for n, spec in specs.items()}
    shards = {
        r: {n: full[n][sources[n].box_of(r).slices()].clone() for n in full}
        for r in ranks
    }
    del full
    engines: Dict[int, Tuple] = {}
    for k in range(tp):
        load = loads[(tp, k)]
        transformed = block_fp8_targets(load["derived"].targets, load["live"], shapes)
        assert not transformed.problems, [str(p) for p in transformed.problems]
        garbage = torch.Generator().manual_seed(k)
        params = {
            n: torch.randn(s, generator=garbage).to(d)
            for n, (s, d) in sorted(load["live"].items())
        }
        engines[trainers + k] = (load, transformed, params)
    wanted = {r: e[1].targets for r, e in engines.items()}
    cut = sender_quantized(
        plan(sources, wanted, bucket_bytes=bucket),
        {r: e[1].quantized for r, e in engines.items()},
        shapes,
    )
    staged, fp8_params = {}, {}
    for r, (_, transformed, params) in engines.items():
        staged[r] = {
            **params,
            **staging_buffers(transformed.quantized, torch.device("cpu")),
        }
        fp8_params[r] = {q.weight: params[q.weight] for q in transformed.quantized}
        fp8_params[r].update((q.scale, params[q.scale]) for q in transformed.quantized)
        for q in transformed.quantized:
            staged[r][q.weight].fill_(
                float("nan")
            )  # a block read from staging twice shows
    _run_moves(cut.plan, cut, shards, staged, fp8_params)
    out = {}
    for r, (load, transformed, params) in engines.items():
        left = cut.engine_targets(transformed.targets, r)
        write_quantized(transformed.quantized, left, staged[r], fp8_params[r])
        written = {t.name for t in transformed.targets} | {
            q.scale for q in transformed.quantized
        }
        element_bytes: Mapping[str, int] = {
            t.name: t.dtype.itemsize for t in transformed.targets
        }
        at_sender = [
            q
            for rnd in cut.quantized
            for q in rnd
            if r in {d.rank for d in q.move.dests}
        ]
        out[r] = {
            "differ": sorted(
                n for n in written if checksum(params[n]) != load["checksums"][n]
            ),
            "received": cut.received_bytes(r),
            "lower_bound": quantized_lower_bound(
                sources, transformed.targets, transformed.quantized, element_bytes
            ),
            "unquantized_received": sum(
                m.nbytes
                for rnd in cut.plan.rounds
                for m in rnd
                for d in m.dests
                if d.rank == r
            ),
            "blocks_at_sender": sum(q.blocks for q in at_sender),
            "sites": block_sites(sources, transformed, transformed.targets, r),
            "staged_bound": sum(
                p.box.numel * element_bytes[t.name]
                for t in transformed.targets
                for p in t.pieces
            ),
        }
    out["sent"] = sum(cut.sent_bytes(r) for r in ranks)
    return out


def trainer_side_rank(
    rank: int,
    world: int,
    tp: int,
    bf16: str,
    loads: dict,
    bucket: int,
    batches: int,
    megatron_pp: int = 0,
    delta: bool = False,
) -> dict:
    """Rank ``rank`` of ``world`` FSDP2 trainer ranks (with ``megatron_pp``: Megatron-core
    ranks at TP ``world / megatron_pp`` x PP ``megatron_pp``, ``fp8_cases.megatron_shards``)
    on the trainer-side one-hop path, as the runtime runs it: ``TrainerPlans.reshard_to_engines`` against the block-FP8 engines'
    manifest (engine TP ``tp``, one engine per ``tp`` trainer ranks: rank k beside engine
    rank k % ``tp``), the payload's header through the protocol's encoding and checked
    decoding, then the engine rank's own step (``engine_trainer_side.local_step``) into
    garbage parameters. Returns ``fp8_cases.update_rank``'s figures, and the bytes handed
    to the engine rank against the quantized lower bound of its layout (``handed_bound``:
    counted block by block from the trainer's shards, each unquantized parameter's
    buffer whole; ``handed_bf16``: every parameter's buffer whole in its staged dtype, as
    before sender quantization). With ``delta`` (one batch): three updates through the
    trainer's agreement with a ``ReshardDelta`` (``reshard_delta``), the engine rank's
    parameters garbage before each: the weights (full), the weights with a few values
    changed on every rank (a delta), the weights again (a delta back, checked against
    SGLang's load); ``deltas``: each update's summary."""
    import dataclasses

    import tiny_models
    import torch.distributed as dist
    from fp8_cases import (
        checksum,
        fsdp_shards,
        megatron_shards,
    )

    from sglang.srt.weight_sync.derive.derived_targets import DerivedTargets
    from sglang.srt.weight_sync.fp8_targets import engine_block_fp8
    from sglang.srt.weight_sync.manifest import EngineManifest
    from sglang.srt.weight_sync.target_layout import EngineParallel
    from sglang.srt.weight_sync.trainer_reshard import TrainerPlans

    full = tiny_models.load_checkpoint(bf16)
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    if megatron_pp:  # Megatron-core TP world / PP x PP (a real GPTModel's parameters)
        layout, local = megatron_shards(bf16, full, world // megatron_pp, megatron_pp)
    else:
        layout, local = fsdp_shards(full, world)
    del full  # the reference lives in ``loads``: no rank keeps a full tensor past here
    derived = DerivedTargets.of_ranks(  # the widths the engine publishes (EP, say)
        EngineParallel(*loads[(tp, 0)]["parallel"]),
        [loads[(tp, r)]["derived"] for r in range(tp)],
        shapes,
        {},
    )
    mine = rank % tp
    live = loads[(tp, mine)]["live"]
    meta = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in live.items()}
    fp8 = engine_block_fp8(derived, meta, mine)
    assert fp8 is not None and not fp8.own.problems
    dtype_of = {n: d for n, (_, d) in live.items()}
    dtype_of.update((q.weight, q.staged_dtype) for q in fp8.own.quantized)
    targets = dataclasses.replace(fp8.targets, dtype_of=dtype_of)
    blocks = {q.weight: q.block for q in fp8.own.quantized}
    manifest = EngineManifest.of(targets, blocks)
    groups = [list(range(j * tp, (j + 1) * tp)) for j in range(world // tp)]
    written = {t.name for t in targets.for_rank(mine)} | {
        q.scale for q in fp8.own.quantized
    }
    garbage = torch.Generator().manual_seed(rank)
    params = {
        n: torch.randn(live[n][0], generator=garbage).to(live[n][1])
        for n in sorted(written)
    }
    plans = TrainerPlans()
    sync = None
    if delta:
        from sglang.srt.weight_sync.reshard_delta import ReshardDelta
        from sglang.srt.weight_sync.trainer_flow import TrainerSync

        sync = TrainerSync()
        sync.delta, plans = ReshardDelta(digest=True), sync.plans
    figures = dict.fromkeys(
        RANK_FIGURES
        + (
            "handed",
            "handed_bound",
            "handed_bf16",
            "quantized_regions",
            "staged_regions",
            "fp8_buffers",
        ),
        0,
    )
    updates = [local]
    if delta:
        changed = {k: t.clone() for k, t in local.items()}
        for t in changed.values():
            # a few values 2 bf16 ulps up: rarely a block's largest, so scales rarely move
            t.view(-1)[rank::4099] *= 1 + 2**-6
        updates = [local, changed, local]
    deltas = []
    for number, weights in enumerate(updates):
        if number:  # the engine rank's parameters garbage again
            for t in params.values():
                t.copy_(torch.randn(t.shape, generator=garbage).to(t.dtype))
            figures = dict.fromkeys(figures, 0)
        _one_update(
            sync,
            plans,
            layout,
            weights,
            manifest,
            groups,
            rank,
            bucket,
            batches,
            (targets, mine, fp8, params, blocks),
            figures,
            deltas,
        )
    dist.barrier()
    expected = loads[(tp, mine)]["checksums"]
    return {
        "differ": sorted(n for n, t in params.items() if checksum(t) != expected[n]),
        "compared": len(params),
        "not_written": sorted(set(live) - written),
        "quantized": len(fp8.own.quantized),
        "fp8_live": sum(1 for _, d in live.values() if d == torch.float8_e4m3fn),
        # the per-rank planner's bound (``rank_plan``): half the cap plus a row, received
        # and sent per round
        "staging_bound": bucket
        + 2 * max(t.element_size() * math.prod(t.shape[1:]) for t in local.values()),
        "deltas": deltas,
        **figures,
    }


def _one_update(
    sync,
    plans,
    layout,
    local,
    manifest,
    groups,
    rank,
    bucket,
    batches,
    engine,
    figures,
    deltas,
) -> None:
    """One update of ``trainer_side_rank`` (through the trainer's agreement and its delta
    when ``sync`` is given), each chunk handed to the engine rank's own step."""
    import json

    from fp8_cases import batches_of, local_of

    from sglang.srt.weight_sync.delivery import Payload
    from sglang.srt.weight_sync.engine_trainer_side import local_step
    from sglang.srt.weight_sync.phase_timing import PhaseClock
    from sglang.srt.weight_sync.protocol import (
        Fp8RegionKind,
        PayloadKind,
        decode_header,
        header_fields,
    )
    from sglang.srt.weight_sync.target_layout import restrict
    from sglang.srt.weight_sync.trainer_flow import agree_on_inputs
    from sglang.srt.weight_sync.trainer_reshard import chunks

    targets, mine, fp8, params, blocks = engine
    for names in batches_of(layout, batches):
        sources = {n: layout[n] for n in names}
        mine_local = local_of(layout, local, names, rank)
        delta = data = None
        if sync is not None:
            delta = sync.delta
            agree_on_inputs(
                sync,
                sources,
                mine_local,
                manifest,
                groups,
                bucket,
                30,
                PhaseClock(),
                delta,
            )
            data = sync.data
        for part in chunks(manifest, names, 1 << 40):
            result = plans.reshard_to_engines(
                sources,
                mine_local,
                manifest,
                groups,
                rank,
                bucket,
                part,
                30,
                data,
                checked=sync is not None,
                delta=delta,
            )
            regions = result.fp8_regions
            tensors = [(n, t) for n, t in result.buffers.items()]
            tensors += [(e.key, buf) for e, buf in regions]
            wire = header_fields(
                "u",
                rank,
                {rank: mine},
                [(n, None) for n, _ in tensors],
                [],
                PayloadKind.PARAMS,
                sorted(sources),
                manifest.fingerprint,
                None,
                fp8_regions=[e for e, _ in regions],
            )
            header = decode_header([json.dumps(wire).encode(), b""])
            payload = Payload(
                "u",
                rank,
                {rank: mine},
                dict(tensors),
                {},
                PayloadKind.PARAMS,
                tuple(header["names"]),
                header["fingerprint"],
                fp8_regions=header["fp8_regions"],
            )
            step = local_step(payload, targets, manifest, params, mine, fp8, params)
            assert not step.problems, step.problems
            step.run()
            own = [
                t for t in restrict(targets.for_rank(mine), names, {}) if t.name in part
            ]
            element_bytes = {t.name: t.dtype.itemsize for t in own}
            sender = result.sender
            figures["received"] += result.stats.bytes_received
            figures["lower_bound"] += result.lower_bound_bytes(rank)
            figures["planned"] += sender.received_bytes(rank)
            figures["peak"] = max(figures["peak"], result.stats.peak_staging_bytes)
            figures["bf16_lower_bound"] += result.plan.lower_bound_bytes(rank)
            figures["handed"] += result.handed_bytes()
            # the unquantized parameters go as parameter-shaped buffers, as before
            plain = sum(
                math.prod(t.shape) * element_bytes[t.name]
                for t in own
                if t.name not in blocks
            )
            fp8_own = [t for t in own if t.name in blocks]
            figures["handed_bound"] += plain + quantized_lower_bound(
                sources, fp8_own, fp8.own.quantized, element_bytes
            )
            figures["handed_bf16"] += sum(
                math.prod(t.shape) * element_bytes[t.name] for t in own
            )
            kinds = [e.kind for e, _ in regions]
            figures["quantized_regions"] += kinds.count(Fp8RegionKind.QUANTIZED)
            figures["staged_regions"] += kinds.count(Fp8RegionKind.STAGED)
            figures["fp8_buffers"] += sum(1 for n in result.buffers if n in blocks)
        if delta is not None:
            deltas.append(delta.summary())
            delta.commit()
