"""Derived targets once per engine layout: in memory for the engine's life, on disk across restarts.

Deriving runs SGLang's loaders on meta for every TP rank (seconds for a 671B model);
an RL run updates thousands of times with the same layout. The disk entry is keyed
by everything the derivation depends on: SGLang's version, the model config as the
engine adjusted it, the server args that shape loading, the parallel layout, the
platform and the checkpoint's names, shapes and dtypes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Dict, Tuple

from sglang.srt.weight_sync.derived_targets import CheckpointLayout, DerivedTargets, checkpoint_layout, derive_targets

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "SGLANG_WEIGHT_SYNC_CACHE_DIR"
# Server-args fields that say where or how the engine talks, never how it loads weights.
_VOLATILE = ("port", "host", "addr", "seed", "log", "timeout", "api_key", "url", "file_storage", "socket")

_memory: Dict[Tuple, DerivedTargets] = {}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "sglang" / "weight_sync")


def engine_derived_targets(model_config) -> DerivedTargets:
    """This engine's targets for every TP rank (the published layout), derived at most once."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    memory_key = (id(model_config), par.tp_size, par.attn_tp_size, par.moe_ep_size)
    cached = _memory.get(memory_key)
    if cached is not None:
        return cached
    checkpoint = checkpoint_layout(_original_hf_config(model_config))
    key = cache_key(model_config, checkpoint)
    path = cache_dir() / f"{key}.json"
    targets = _read(path)
    if targets is None:
        logger.info("weight sync: deriving the targets of %s for TP %d (attention TP %d, MoE EP %d) from SGLang's "
                    "loaders on meta tensors; cached as %s", model_config.model_path, par.tp_size,
                    par.attn_tp_size, par.moe_ep_size, path)
        start = time.perf_counter()
        targets = derive_targets(model_config, checkpoint)
        logger.info("weight sync: derived %d targets over %d ranks in %.1f s", sum(map(len, targets.per_rank)),
                    par.tp_size, time.perf_counter() - start)
        _write(path, targets)
    _memory[memory_key] = targets
    return targets


def _original_hf_config(model_config):
    """The config as on disk: the CPU engine pads heads in ``model_config.hf_config``, but the
    checkpoint a trainer sends has the original shapes. SGLang's own (cached) ``get_config``."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.utils.hf_transformers.config import get_config

    return get_config(model_config.model_path, trust_remote_code=get_context().server_args.trust_remote_code,
                      revision=model_config.revision, model_override_args=model_config.model_override_args,
                      model_config_parser=model_config.model_config_parser)


def cache_key(model_config, checkpoint: CheckpointLayout) -> str:
    """What a derivation depends on, hashed."""
    from importlib.metadata import version

    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.utils import is_cpu

    par = get_parallel()
    server_args = {k: v for k, v in get_context().resolved_server_args_dict().items()
                   if not any(word in k for word in _VOLATILE)}
    blob = json.dumps([
        version("sglang"), model_config.hf_config.to_dict(), str(model_config.dtype), server_args,
        [par.tp_size, par.attn_tp_size, par.moe_ep_size], bool(is_cpu()),
        [[n, list(s), str(d)] for n, s, d in checkpoint.tensors], dict(checkpoint.aliases),
    ], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _read(path: Path):
    try:
        return DerivedTargets.from_builtins(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        if path.exists():
            logger.warning("weight sync: ignoring unreadable target cache %s: %s", path, e)
        return None


def _write(path: Path, targets: DerivedTargets) -> None:
    """Atomically (every TP rank of an engine may write the same entry)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(targets.to_builtins(), f)
        os.replace(f.name, path)
    except OSError as e:
        logger.warning("weight sync: could not cache derived targets at %s: %s", path, e)
