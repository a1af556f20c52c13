"""Derived targets on disk across engine restarts: one record per engine layout and TP rank.

An RL run restarts its engines with the same model and layout many times, and deriving a
deep model's targets costs seconds per rank. Each rank's record is keyed by everything the
derivation depends on, all read from what the engine already holds (nothing is built to
compute it): SGLang's and transformers' versions, the model config as on disk and as the
engine adjusted it, the server args that shape loading, the parallel layout and the
platform, the device (CUDA: its name and compute capability; the CPU engine: "cpu") and the
versions of the kernel packages whose presence and release change what loaders and
post-load processing do (``KERNEL_PACKAGES``: a GPU engine's loaders take other branches
than a meta derivation elsewhere would see, and a kernel upgrade can change a shuffle or a
w13/w31 order). The checkpoint's names, shapes and dtypes are a function of the config and
transformers' version (``checkpoint_layout``), so they are keyed through those. A record
that cannot be read is ignored (and derived again); one that cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple

from sglang.srt.weight_sync.phase_timing import collector_paused
from sglang.srt.weight_sync.sglang_compat import (
    original_hf_config,
    parallel_widths,
    server_args_dict,
)

__all__ = (
    "CACHE_DIR_ENV",
    "FORMAT",
    "KERNEL_PACKAGES",
    "cache_dir",
    "cache_key",
    "device_facts",
    "kernel_versions",
    "read_record",
    "record_path",
    "write_record",
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


def cache_dir() -> Path:
    """Where records live: ``$SGLANG_WEIGHT_SYNC_CACHE_DIR``, else under ``~/.cache``."""
    return Path(
        os.environ.get(CACHE_DIR_ENV)
        or Path.home() / ".cache" / "sglang" / "weight_sync"
    )


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


def read_record(path: Path) -> Optional[dict]:
    try:
        with collector_paused():
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


def write_record(path: Path, record: dict) -> None:
    """Atomically (a restarted engine may read while another writes)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, suffix=".tmp", delete=False
        ) as f:
            json.dump({**record, "format": FORMAT}, f, separators=(",", ":"))
        os.replace(f.name, path)
        logger.info("weight sync: derived targets cached as %s", path)
    except OSError as e:
        logger.warning(
            "weight sync: could not cache derived targets at %s: %s", path, e
        )


def record_path(model_config, rank: int) -> Path:
    """The file holding TP ``rank``'s record for this engine's model and layout."""
    return cache_dir() / cache_key(model_config) / f"tp{rank}.json"
