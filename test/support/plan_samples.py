"""Small plans for the data plane's tests: one tensor moved whole between ranks."""

from typing import Collection

import torch


def whole_tensor_plan(
    holder: int, receivers: Collection[int], world: int, shape=(6, 4)
):
    """Tensor ``w`` (``shape``, 2-d, fp32) held whole by ``holder`` only, needed whole (as
    parameter ``p``) by each of ``receivers``, in a world of ``world`` ranks."""
    from sglang.srt.weight_sync.box import Box
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

    src = {"w": MeshSpec.full(tuple(shape), torch.float32, [holder]).describe("w")}
    target = ParamTarget(
        "p",
        tuple(shape),
        torch.float32,
        (Piece("w", Box((0, 0), tuple(shape)), (), (0, 0)),),
    )
    return plan(src, {r: ([target] if r in receivers else []) for r in range(world)})
