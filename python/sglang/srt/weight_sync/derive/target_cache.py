"""Derived targets once per engine layout: each TP rank derives its own, in memory for the engine's life, on disk across restarts.

Deriving runs SGLang's loaders on meta (seconds per rank for a 671B model); an RL
run updates thousands of times with the same layout. Every TP rank derives only
its own rank, in parallel with the others, then the ranks exchange what they
derived (plain data, through the engine's CPU group): the first update costs one
rank's derivation, not T of them. Each rank's entry on disk is keyed by everything
the derivation depends on, all read from what the engine already holds (nothing is
built to compute it): SGLang's and transformers' versions, the model config as on
disk and as the engine adjusted it, the server args that shape loading, the
parallel layout and the platform, the device (CUDA: its name and compute capability;
the CPU engine: "cpu") and the versions of the kernel packages whose presence and
release change what loaders and post-load processing do (``KERNEL_PACKAGES``: a GPU
engine's loaders take other branches than the meta derivation run elsewhere would
see, and a kernel upgrade can change a shuffle or a w13/w31 order). The checkpoint's names, shapes and dtypes are a
function of the config and transformers' version (``checkpoint_layout``), so they
are keyed through those.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

from sglang.srt.weight_sync.derive.derived_targets import (
    DerivedTargets,
    RankTargets,
    checkpoint_layout,
    derive_engine_rank,
)
from sglang.srt.weight_sync.sglang_compat import (
    original_hf_config,
    parallel_widths,
    server_args_dict,
)
from sglang.srt.weight_sync.target_layout import EngineParallel, paused_gc

# isort: split
# pr: fp8
from sglang.srt.weight_sync.fp8_targets import derivation_config

# pr: fp8 end

__all__ = (
    "CACHE_DIR_ENV",
    "Exchange",
    "FORMAT",
    "KERNEL_PACKAGES",
    "assemble",
    "cache_dir",
    "cache_key",
    "device_facts",
    "engine_derived_targets",
    "kernel_versions",
    "own_rank_record",
)

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "SGLANG_WEIGHT_SYNC_CACHE_DIR"
FORMAT = 2  # the on-disk record's layout: one file per rank
# Server-args fields that say where or how the engine talks, never how it loads weights.
_VOLATILE = (
    "port",
    "host",
    "addr",
    "seed",
    "log",
    "timeout",
    "api_key",
    "url",
    "file_storage",
    "socket",
)

# Packages whose kernels SGLang's loaders and post-load processing branch on (MoE runner
# shuffles, w13/w31 order, deep_gemm layouts), by distribution name.
KERNEL_PACKAGES = ("sgl-kernel", "flashinfer-python", "deep-gemm", "triton")

# Every TP rank's bytes, in rank order, on every rank: a collective over the engine's TP group.
Exchange = Callable[[bytes], Sequence[bytes]]


def cache_dir() -> Path:
    return Path(
        os.environ.get(CACHE_DIR_ENV)
        or Path.home() / ".cache" / "sglang" / "weight_sync"
    )


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
    with paused_gc():
        records = [own if r == rank else json.loads(b) for r, b in enumerate(blobs)]
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        raise ValueError("; ".join(errors))
    targets = assemble(EngineParallel(tp, attn_tp, ep), records)
    memo[memory_key] = targets
    return targets


def own_rank_record(model_config, rank: int) -> dict:
    """This TP rank's derivation as plain data: from the disk cache, or derived now and cached."""
    path = cache_dir() / cache_key(model_config) / f"tp{rank}.json"
    record = _read(path)
    if record is None:
        logger.info(
            "weight sync: engine rank %d derives its targets of %s (TP %d, attention TP %d, MoE EP %d) "
            "from SGLang's loaders on meta tensors; cached as %s",
            rank,
            model_config.model_path,
            *parallel_widths()[:3],
            path,
        )
        start = time.perf_counter()
        with (
            paused_gc()
        ):  # millions of small objects: the collector's full passes would free nothing
            checkpoint = checkpoint_layout(original_hf_config(model_config))
            config = model_config
            # pr: fp8
            config = derivation_config(model_config)  # block-FP8: an unquantized copy
            # pr: fp8 end
            derived = derive_engine_rank(config, checkpoint, rank)
            record = {"format": FORMAT, "rank": rank, "derived": derived.to_builtins()}
            if (
                rank == 0
            ):  # the checkpoint's names and shapes: every rank gets rank 0's record
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
        _write(path, record)
    return record


def assemble(parallel: EngineParallel, records: Sequence[dict]) -> DerivedTargets:
    """Every rank's record (rank order) as the engine's targets; with the collector paused, as
    the many small objects decoded would otherwise set it scanning every record again."""
    for r, record in enumerate(records):
        if record.get("rank") != r:
            raise ValueError(
                f"engine rank {r} sent the targets of rank {record.get('rank')}"
            )
    with paused_gc():
        ranks = [RankTargets.from_builtins(record["derived"]) for record in records]
        checkpoint = records[0]["checkpoint"]
        shapes = {n: tuple(s) for n, s in checkpoint["shapes"].items()}
        return DerivedTargets.of_ranks(parallel, ranks, shapes, checkpoint["aliases"])


@lru_cache(maxsize=None)
def _versions() -> Tuple[str, ...]:
    from importlib.metadata import version

    return version("sglang"), version("transformers"), version("torch")


def kernel_versions() -> Tuple[Tuple[str, str], ...]:
    """(distribution, version, or "absent") of each of ``KERNEL_PACKAGES`` as installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in KERNEL_PACKAGES:
        try:
            out.append((name, version(name)))
        except PackageNotFoundError:
            out.append((name, "absent"))
    return tuple(out)


def device_facts() -> Tuple[str, ...]:
    """The device the engine's loaders run for: ("cpu",) for SGLang's CPU engine; on CUDA
    (or ROCm) the kind, the device's name and its compute capability; else what the server
    args name."""
    import torch

    from sglang.srt.utils import is_cpu

    if is_cpu():
        return ("cpu",)
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        kind = "hip" if getattr(torch.version, "hip", None) else "cuda"
        return (kind, torch.cuda.get_device_name(index), f"{major}.{minor}")
    return (str(server_args_dict().get("device") or "unknown"),)


def cache_key(model_config) -> str:
    """What a derivation depends on, hashed; computed from what the engine holds, in milliseconds."""
    from sglang.srt.utils import is_cpu

    server_args = {
        k: v
        for k, v in server_args_dict().items()
        if not any(word in k for word in _VOLATILE)
    }
    blob = json.dumps(
        [
            FORMAT,
            _versions(),
            original_hf_config(model_config).to_dict(),
            model_config.hf_config.to_dict(),
            str(model_config.dtype),
            server_args,
            list(parallel_widths()),
            bool(is_cpu()),
            device_facts(),
            kernel_versions(),
        ],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _read(path: Path) -> Optional[dict]:
    try:
        with paused_gc():
            record = json.loads(path.read_bytes())
        if record.get("format") != FORMAT or "derived" not in record:
            raise ValueError(
                f"format {record.get('format')!r}, this release reads {FORMAT}"
            )
        return record
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as e:
        logger.warning("weight sync: ignoring unreadable target cache %s: %s", path, e)
        return None


def _write(path: Path, record: dict) -> None:
    """Atomically (a restarted engine may read while another writes)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, suffix=".tmp", delete=False
        ) as f:
            json.dump(record, f, separators=(",", ":"))
        os.replace(f.name, path)
    except OSError as e:
        logger.warning(
            "weight sync: could not cache derived targets at %s: %s", path, e
        )
