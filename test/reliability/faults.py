"""Helpers of the reliability tests: an engine, its state, and payloads sent by hand."""

from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Sequence, Tuple

import torch

import tiny_models
from engine import cpu_engine
from update_cases import _checksums

TP = 2


@contextlib.contextmanager
def running_engine(directory):
    model_dir, config = tiny_models.make_tiny_model("qwen2", directory)
    with cpu_engine(model_dir, tp_size=TP) as eng:
        yield eng, model_dir, config


def state(eng) -> Dict[int, Dict[str, str]]:
    """Per-rank parameter checksums (SGLang's weight checker)."""
    return _checksums(eng)


def generate(eng, prompts: Sequence[Sequence[int]], max_new: int = 4) -> List[List[int]]:
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    return [o["output_ids"] for o in eng.generate(input_ids=[list(p) for p in prompts], sampling_params=params)]


def full_shards(weights: Dict[str, torch.Tensor]) -> List[Tuple[str, torch.Tensor, object]]:
    """Every tensor whole, held by both trainer ranks (what each rank sends)."""
    from sglang.srt.weight_sync.source_layout import MeshSpec

    return [(n, t, MeshSpec.full(t.shape, t.dtype, list(range(TP)))) for n, t in sorted(weights.items())]


def send(channel: str, update_id: str, per_rank: Sequence[list]) -> list:
    """Push each engine rank's shards as the trainer rank beside it would; returns the
    senders (keep them until the engine has read the shards, then close them)."""
    from sglang.srt.weight_sync.delivery import ShardSender

    senders = []
    for rank, shards in enumerate(per_rank):
        sender = ShardSender(channel, rank)
        sender.send(update_id, rank, {r: r for r in range(TP)}, shards)
        senders.append(sender)
    return senders


def update(eng, channel: str, update_id: str, per_rank: Sequence[list] = (), **kwargs):
    """Send ``per_rank`` shards (may be empty) and ask the engine to apply ``update_id``;
    returns (success, message, seconds the engine took)."""
    senders = send(channel, update_id, per_rank) if per_rank else []
    eng.begin_weight_update()
    try:
        start = time.monotonic()
        success, message = eng.update_weights_distributed(update_id, channel, **kwargs)
        return success, message, time.monotonic() - start
    finally:
        eng.end_weight_update()
        for s in senders:
            s.close()


def engine_fds() -> int:
    """Open file descriptors of this process's children (the engine's processes)."""
    import psutil

    total = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.num_fds()
    return total
