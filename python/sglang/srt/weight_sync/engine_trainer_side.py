"""The engine's side of an update its trainer planned (trainer-side resharding,
``trainer_reshard``): the trainer rank beside each engine rank sends that rank's
parameters already in place, so the engine moves nothing between its ranks.

A "describe" payload publishes the engine's manifest into the channel (nothing is
written); a "params" payload is checked against the manifest the trainer planned with
(fingerprint, names, shapes, dtypes, finite values), then copied into the parameters once
every TP rank agreed (``LocalStep.run``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from sglang.srt.weight_sync.apply import (
    check_buffers,
    copy_buffers,
    nonfinite_buffers,
    write_quantized,
)
from sglang.srt.weight_sync.delivery import Payload
from sglang.srt.weight_sync.derive import DerivedTargets
from sglang.srt.weight_sync.fp8_targets import EngineBlockFp8
from sglang.srt.weight_sync.manifest import EngineManifest, write_manifest
from sglang.srt.weight_sync.protocol import PayloadKind, resolve_channel
from sglang.srt.weight_sync.target_layout import restrict

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
    channel: str,
    fp8: Optional[EngineBlockFp8] = None,
    live: Optional[Dict[str, torch.Tensor]] = None,
) -> LocalStep:
    """ "describe": publish the manifest (nothing is written to the model). "params": check
    the buffers the trainer planned against this engine's manifest, then copy them in place;
    a block-FP8 weight's buffer (in its staged dtype: the manifest's) is the staging its
    delivered blocks are quantized from (``fp8``; ``live``: the model's tensors, scales
    included)."""
    if payload.kind == PayloadKind.DESCRIBE:
        path = write_manifest(resolve_channel(channel, rank), rank, manifest)
        logger.info(
            "engine rank %d: published the engine layout %s at %s",
            rank,
            manifest.fingerprint[:12],
            path,
        )
        return LocalStep([], lambda: (0, 0, 0))
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
    wanted = [
        t
        for t in restrict(targets.for_rank(rank), payload.names, targets.aliases)
        if t.name in payload.tensors
    ]
    unknown = sorted(set(payload.tensors) - {t.name for t in wanted})
    problems = (
        [
            f"engine rank {rank}: buffers {unknown[:3]} are not parameters this update fills"
        ]
        if unknown
        else []
    )

    quantized = fp8.own.quantized if fp8 is not None else ()
    names = {q.weight for q in quantized}
    plain = [t for t in wanted if t.name not in names]
    staged = [t for t in wanted if t.name in names]
    fp8_params = {q.weight: params[q.weight] for q in quantized}
    fp8_params.update((q.scale, live[q.scale].data) for q in quantized)

    def copy() -> Tuple[int, int, int]:
        copied = copy_buffers(params, plain, payload.tensors)
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
            for name in nonfinite_buffers(wanted, payload.tensors)
        ]
    return LocalStep(problems, copy)
