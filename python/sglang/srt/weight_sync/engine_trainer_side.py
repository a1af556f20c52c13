"""The engine's side of an update its trainer planned (trainer-side resharding,
``trainer_reshard``): the trainer rank beside each engine rank sends that rank's
parameters already in place, so the engine moves nothing between its ranks.

A "params" payload is checked against the manifest the trainer planned with
(fingerprint, names, shapes, dtypes, finite values), then copied into the parameters once
every TP rank agreed (``LocalStep.run``). Into a block-FP8 weight, the regions the trainer
quantized (the payload's ``Fp8Region`` entries: whole blocks of e4m3 and float32
scales, ``fp8_sender``) land straight in the e4m3 weight and ``weight_scale_inv``; only
the blocks left (in the weight's staged-dtype buffer) are quantized here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.apply import (
    check_buffers,
    copy_buffers,
    nonfinite_buffers,
    quantize_region,
    write_quantized,
)
from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.delivery import Payload
from sglang.srt.weight_sync.derive import DerivedTargets
from sglang.srt.weight_sync.fp8_sender import land_box, left_to_quantize
from sglang.srt.weight_sync.fp8_targets import EngineBlockFp8, QuantizedParam
from sglang.srt.weight_sync.manifest import EngineManifest
from sglang.srt.weight_sync.protocol import Fp8Region, Fp8RegionKind
from sglang.srt.weight_sync.target_layout import ParamTarget, restrict

__all__ = ("LocalStep", "local_step")

logger = logging.getLogger(__name__)


@dataclass
class LocalStep:
    """A trainer-side update's local work on this rank, run once every rank agreed;
    ``run`` returns this rank's ``FIGURES`` (the engine itself receives nothing)."""

    problems: List[str]
    run: Callable[[], Tuple[int, int, int]]


def local_step(
    payload: Payload,
    targets: DerivedTargets,
    manifest: EngineManifest,
    params,
    rank: int,
    fp8: Optional[EngineBlockFp8] = None,
    live: Optional[Dict[str, torch.Tensor]] = None,
) -> LocalStep:
    """A "params" payload: check the buffers the trainer planned against this engine's
    manifest, then copy them in place; a block-FP8 weight's buffer (in its staged dtype: the
    manifest's) is the staging its delivered blocks are quantized from (``fp8``; ``live``:
    the model's tensors, scales included)."""
    if payload.fingerprint != manifest.fingerprint:
        return LocalStep(
            [
                f"engine rank {rank}: the trainer planned against engine layout {payload.fingerprint[:12]!r}, "
                f"the engine's is now {manifest.fingerprint[:12]!r} (the trainer re-reads it on the next update)"
            ],
            lambda: (0, 0, 0),
        )
    not_copied = sorted(
        n for n in payload.names if targets.aliases.get(n, n) in targets.not_copied
    )
    if not_copied:
        name = not_copied[0]
        return LocalStep(
            [
                f"engine rank {rank}: tensor {name!r} is not a copy in SGLang's loader: "
                f"{targets.not_copied[targets.aliases.get(name, name)]}"
            ],
            lambda: (0, 0, 0),
        )
    quantized = fp8.own.quantized if fp8 is not None else ()
    sent = set(payload.tensors) | {e.param for e in payload.fp8_regions}
    wanted = [
        t
        for t in restrict(targets.for_rank(rank), payload.names, targets.aliases)
        if t.name in sent
    ]
    names = {q.weight for q in quantized}
    plain = [t for t in wanted if t.name not in names]
    regions, problems = _regions(payload, quantized, wanted, rank)
    staged = []  # what is left of a block-FP8 weight: in a parameter-shaped staged buffer
    for t in wanted:
        if t.name in names:
            landed = [(e.index, box) for e, box in regions.get(t.name, ())]
            left = left_to_quantize(t, landed)
            if left:
                staged.append(dataclasses.replace(t, pieces=left))
    buffered = {t.name for t in plain + staged}
    unknown = sorted(
        set(payload.tensors) - buffered - {e.key for e in payload.fp8_regions}
    )
    if unknown:
        problems.append(
            f"engine rank {rank}: buffers {unknown[:3]} are not parameters this update fills "
            "(a block-FP8 weight delivered in regions has no parameter-shaped buffer)"
        )
    fp8_params = {q.weight: params[q.weight] for q in quantized}
    fp8_params.update((q.scale, live[q.scale].data) for q in quantized)
    scales = {q.weight: q.scale for q in quantized}

    def copy() -> Tuple[int, int, int]:
        copied = copy_buffers(params, plain, payload.tensors)
        for weight, landed in regions.items():
            w, s = fp8_params[weight], fp8_params[scales[weight]]
            for e, box in landed:
                buf = payload.tensors[e.key]
                if e.kind == Fp8RegionKind.QUANTIZED:
                    copied += land_box(buf, w, s, e.index, box, e.block)
                else:
                    copied += quantize_region(buf, w, s, e.index, box, e.block)
        copied += write_quantized(quantized, staged, payload.tensors, fp8_params)
        logger.info(
            "engine rank %d: trainer-side update, copied %d bytes locally", rank, copied
        )
        return 0, 0, 0

    as_staged = {  # what check_buffers compares a block-FP8 weight's buffer with
        q.weight: torch.empty(q.shape, dtype=q.staged_dtype, device="meta")
        for q in quantized
    }
    problems += check_buffers(params, plain, payload.tensors, rank)
    problems += check_buffers(as_staged, staged, payload.tensors, rank)
    if not problems:
        problems += [
            f"engine rank {rank}: tensor {name!r}: the buffer from trainer rank {payload.trainer_rank} holds "
            "NaN or inf values (refused: an update never writes non-finite weights)"
            for name in nonfinite_buffers(plain + staged, payload.tensors)
            + _nonfinite_regions(payload)
        ]
    return LocalStep(problems, copy)


def _regions(
    payload: Payload,
    quantized: Sequence[QuantizedParam],
    wanted: Sequence[ParamTarget],
    rank: int,
) -> Tuple[Dict[str, List[Tuple[Fp8Region, Box]]], List[str]]:
    """The payload's block-FP8 regions by weight, checked against this rank's plan by
    name: each of a block-FP8 weight this update fills, of its block, whole blocks inside
    what the update delivers of it, no two overlapping, its tensor of the kind's dtype and
    size. Problems name the region's key, the weight and what was expected."""
    by_weight = {q.weight: q for q in quantized}
    targets = {t.name: t for t in wanted}
    regions: Dict[str, List[Tuple[Fp8Region, Box]]] = {}
    problems: List[str] = []
    for e in payload.fp8_regions:
        q = by_weight.get(e.param)
        box = Box(e.offsets, e.sizes)
        reason = _region_problem(
            e, box, q, targets.get(e.param), payload.tensors.get(e.key)
        )
        if not reason:
            overlap = next(
                (
                    o.key
                    for o, b in regions.get(e.param, ())
                    if o.index == e.index and b.intersect(box) is not None
                ),
                None,
            )
            reason = f"overlaps region {overlap!r}" if overlap else ""
        if reason:
            problems.append(
                f"engine rank {rank}: region {e.key!r} ({e.kind.value}) of {e.param!r} "
                f"from trainer rank {payload.trainer_rank}: {reason}"
            )
        else:
            regions.setdefault(e.param, []).append((e, box))
    return regions, problems


def _region_problem(
    e: Fp8Region,
    box: Box,
    q: Optional[QuantizedParam],
    t: Optional[ParamTarget],
    buf: Optional[torch.Tensor],
) -> str:
    """Why region ``e`` does not fit this rank's plan ("" when it does)."""
    if q is None or t is None:
        return "not a block-FP8 weight this update fills"
    if e.block != q.block:
        return f"blocks {e.block}, the weight's are {q.block}"
    inner = q.shape[len(e.index) :]
    if (
        len(inner) != len(e.sizes)
        or any(i >= n for i, n in zip(e.index, q.shape))
        or not Box.full(inner).contains(box)
    ):
        return f"index {e.index} box {box} is not inside the weight {q.shape}"
    for d, b in zip((-2, -1), q.block):
        end = box.ends[d]
        if box.offsets[d] % b or (end % b and end != inner[d]):
            return f"box {box} is not whole {q.block} blocks"
    left = [box]
    for p in t.pieces:
        if p.perm is None and p.index == e.index:
            left = [r for x in left for r in x.subtract(p.dest_box())]
    if left:
        return f"box {box} is not delivered by this update (e.g. {left[0]})"
    if e.kind == Fp8RegionKind.QUANTIZED:
        dtype, shape = torch.uint8, (e.quantized_bytes,)
    else:
        dtype, shape = q.staged_dtype, e.sizes
    if buf is None or buf.dtype != dtype or tuple(buf.shape) != tuple(shape):
        got = "none" if buf is None else f"{tuple(buf.shape)} {buf.dtype}"
        return f"its tensor is {got}, expected {tuple(shape)} {dtype}"
    return ""


def _nonfinite_regions(payload: Payload) -> List[str]:
    """Weights of regions holding NaN or inf (a quantized one's scales: its sender's
    values were not finite)."""
    bad = []
    for e in payload.fp8_regions:
        buf = payload.tensors[e.key]
        if e.kind == Fp8RegionKind.QUANTIZED:
            buf = buf[math.prod(e.sizes) :].view(torch.float32)
        if not torch.isfinite(buf).all():
            bad.append(e.param)
    return sorted(set(bad))
