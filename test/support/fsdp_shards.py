"""FSDP2 shards of full tensors, as a trainer rank holds them: one helper for every test that
shards with ``fully_shard`` (the resharding scenarios, the block-FP8 update)."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

__all__ = ["fully_sharded"]


def fully_sharded(full: Dict[str, torch.Tensor], mesh) -> Tuple[dict, dict]:
    """``fully_shard`` a module holding a copy of every tensor of ``full`` over ``mesh`` (1-d:
    FSDP; 2-d: HSDP); this rank's ``(layout, local)``: each tensor's ``SourceLayout`` entry
    (``MeshSpec.of_dtensor``) and its local shard."""
    from torch.distributed.fsdp import fully_shard

    from sglang.srt.weight_sync.source_layout import MeshSpec

    names = sorted(full)
    module = torch.nn.Module()
    for i, name in enumerate(names):
        module.register_parameter(f"p{i}", torch.nn.Parameter(full[name].clone()))
    fully_shard(module, mesh=mesh)
    layout, local = {}, {}
    for i, name in enumerate(names):
        dt = getattr(module, f"p{i}")
        layout[name], local[name] = (
            MeshSpec.of_dtensor(dt).describe(name),
            dt.to_local(),
        )
    return layout, local
