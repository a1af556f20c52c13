"""Derived targets once per engine layout: each TP rank derives its own, kept for the engine's life.

Deriving runs SGLang's loaders on meta (seconds per rank for a 671B model); an RL
run updates thousands of times with the same layout. Every TP rank derives only
its own rank, in parallel with the others, then the ranks exchange what they
derived (plain data, through the engine's CPU group): the first update costs one
rank's derivation, not T of them.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from sglang.srt.weight_sync.derive.derived_targets import (
    DerivedTargets,
    RankTargets,
    checkpoint_layout,
    derive_engine_rank,
)
from sglang.srt.weight_sync.phase_timing import collector_paused
from sglang.srt.weight_sync.sglang_compat import original_hf_config, parallel_widths
from sglang.srt.weight_sync.target_layout import EngineParallel

# isort: split
# pr: scale
from sglang.srt.weight_sync.derive.disk_cache import (
    read_record,
    record_path,
    write_record,
)
from sglang.srt.weight_sync.derive.repeated_layers import derive_once_per_layer_kind

# pr: scale end
# pr: fp8
from sglang.srt.weight_sync.fp8_targets import derivation_config

# pr: fp8 end

__all__ = (
    "Exchange",
    "assemble",
    "derive_own_rank",
    "engine_derived_targets",
    "own_rank_record",
)

logger = logging.getLogger(__name__)

# Every TP rank's bytes, in rank order, on every rank: a collective over the engine's TP group.
Exchange = Callable[[bytes], Sequence[bytes]]


def engine_derived_targets(
    model_config,
    rank: int,
    exchange: Exchange,
    memo: Optional[Dict[Tuple, DerivedTargets]] = None,
) -> DerivedTargets:
    """This engine's targets for every TP rank (the published layout), derived at most once
    per ``memo`` (the engine's weight sync keeps one; None: none kept).

    Every TP rank calls it together: on the first call each derives (or reads from disk)
    its own rank and all join ``exchange``, even a rank whose derivation failed (its
    error travels instead, and every rank raises it), so no rank is left waiting.
    """
    memo = {} if memo is None else memo
    tp, attn_tp, ep = parallel_widths()[:3]
    memory_key = (id(model_config), tp, attn_tp, ep)
    cached = memo.get(memory_key)
    if cached is not None:
        return cached
    try:
        own = own_rank_record(model_config, rank)
    except Exception as e:  # noqa: BLE001 - this rank must still join the exchange, carrying its error
        logger.exception(
            "engine rank %d: deriving its weight-sync targets failed", rank
        )
        own = {
            "error": f"engine rank {rank}: deriving its targets failed: {type(e).__name__}: {e}"
        }
    blobs = exchange(json.dumps(own, separators=(",", ":")).encode())
    with collector_paused():
        records = [own if r == rank else json.loads(b) for r, b in enumerate(blobs)]
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        raise ValueError("; ".join(errors))
    targets = assemble(EngineParallel(tp, attn_tp, ep), records)
    memo[memory_key] = targets
    return targets


def own_rank_record(model_config, rank: int) -> dict:
    """This TP rank's derivation as plain data: derived now, or read from disk where an
    engine of the same model and layout derived it before (``derive.disk_cache``)."""
    # pr: scale
    path = record_path(model_config, rank)
    record = read_record(path)
    if record is not None:
        return record
    # pr: scale end
    record = derive_own_rank(model_config, rank)
    # pr: scale
    write_record(path, record)
    # pr: scale end
    return record


def derive_own_rank(model_config, rank: int) -> dict:
    """This TP rank's derivation from SGLang's loaders on meta tensors, as plain data; rank 0's
    carries the checkpoint's names and shapes (every rank gets rank 0's record)."""
    logger.info(
        "weight sync: engine rank %d derives its targets of %s (TP %d, attention TP %d, MoE EP %d) "
        "from SGLang's loaders on meta tensors",
        rank,
        model_config.model_path,
        *parallel_widths()[:3],
    )
    start = time.perf_counter()
    derive = None  # every layer through the loaders
    # pr: scale
    derive = derive_once_per_layer_kind  # each kind of repeated layer once
    # pr: scale end
    # millions of small objects: the collector's full passes would free nothing
    with collector_paused():
        checkpoint = checkpoint_layout(original_hf_config(model_config))
        config = model_config
        # pr: fp8
        config = derivation_config(model_config)  # block-FP8: an unquantized copy
        # pr: fp8 end
        derived = derive_engine_rank(config, checkpoint, rank, derive=derive)
        record = {"rank": rank, "derived": derived.to_builtins()}
        if rank == 0:
            record["checkpoint"] = {
                "shapes": {n: list(s) for n, s in checkpoint.shapes().items()},
                "aliases": dict(checkpoint.aliases),
            }
    logger.info(
        "weight sync: engine rank %d derived %d targets in %.1f s",
        rank,
        len(derived.targets),
        time.perf_counter() - start,
    )
    return record


def assemble(parallel: EngineParallel, records: Sequence[dict]) -> DerivedTargets:
    """Every rank's record (rank order) as the engine's targets; with the collector paused, as
    the many small objects decoded would otherwise set it scanning every record again."""
    for r, record in enumerate(records):
        if record.get("rank") != r:
            raise ValueError(
                f"engine rank {r} sent the targets of rank {record.get('rank')}"
            )
    with collector_paused():
        ranks = [RankTargets.from_builtins(record["derived"]) for record in records]
        checkpoint = records[0]["checkpoint"]
        shapes = {n: tuple(s) for n, s in checkpoint["shapes"].items()}
        return DerivedTargets.of_ranks(parallel, ranks, shapes, checkpoint["aliases"])
