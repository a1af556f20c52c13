"""Upstream SGLang 0.5.23's gathered update path, as the benchmarks run it beside ours.

What ``weight_sync.utils.update_weights`` (and 0.4.7's ``VerlEngine``) do: ``full_tensor()``
of every DTensor on every trainer rank, ``gather_object`` of the tensors' handles to rank 0,
then ``Engine.update_weights_from_tensor`` inside a weight-update session, where SGLang's
own loader narrows each full tensor to its TP rank's part. More tensors than half the
process's file descriptors (a MoE model on CPU) are shared by file name, not descriptor.
"""

from __future__ import annotations

import resource
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ("upstream_update",)


def upstream_update(
    engine, dtensors: Sequence[Tuple[str, torch.Tensor]], rank: int, world: int
) -> Tuple[int, int]:
    """One update through upstream's path; ``engine`` is the ``sglang.Engine`` (rank 0's)
    or None. Returns (bytes this rank received in the all-gathers, bytes of full tensors it
    held at once)."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        LocalSerializedTensor,
    )
    from sglang.srt.utils import MultiprocessingSerializer

    soft_fds, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if len(dtensors) > soft_fds // 2:
        # on CPU each shared tensor holds a file descriptor until the engine has read it: a
        # MoE model's tens of thousands of tensors exceed the process's limit (upstream's
        # GPU path shares CUDA IPC handles instead), so they are shared by file name here
        torch.multiprocessing.set_sharing_strategy("file_system")
    received = peak = 0
    handles: List[Tuple[str, bytes]] = []
    fulls = []  # upstream keeps each full tensor alive until the engine has loaded it
    for name, d in dtensors:
        full = d.full_tensor()
        received += (full.numel() - d.to_local().numel()) * full.element_size()
        fulls.append(full)
        peak += full.numel() * full.element_size()
        handles.append((name, MultiprocessingSerializer.serialize(full)))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(handles, gathered, dst=0)
    if rank == 0:
        named = [
            (group[0][0], LocalSerializedTensor(values=[h for _, h in group]))
            for group in zip(*gathered)
        ]
        engine.begin_weight_update()
        ok, message = engine.update_weights_from_tensor(named, flush_cache=True)
        engine.end_weight_update()
        assert ok, message
    dist.barrier()
    return received, peak
