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

from typing import Dict, Mapping, Tuple

import torch

__all__ = ("quantized_lower_bound", "sender_side_update")


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


def quantized_lower_bound(sources, targets, quantized, element_bytes) -> int:
    """The least bytes an engine rank that holds nothing of the trainer's must receive when
    every block lying whole on one trainer rank travels quantized (one byte per element, a
    float32 scale per block) and every other element in its target's dtype."""
    names = {q.weight for q in quantized}
    total = 0
    for t in targets:
        for p in t.pieces:
            if t.name not in names:
                total += p.box.numel * element_bytes[t.name]
                continue
            holders = [h.box for h in sources[p.tensor].holders]
            for b in _blocks(p.box):
                whole = any(h.contains(b) for h in holders)
                total += b.numel + 4 if whole else b.numel * element_bytes[t.name]
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
