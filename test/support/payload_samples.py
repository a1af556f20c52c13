"""CPU tensors of every kind a payload carries: dtypes, a scalar, an empty and a strided one."""

from typing import List, Tuple

import torch


def every_dtype_and_shape() -> List[Tuple[str, torch.Tensor]]:
    return [
        ("bf16", torch.randn(3, 5).to(torch.bfloat16)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.empty(0, 4)),
        ("ints", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
        ("strided", torch.arange(12.0).reshape(3, 4).t()),
        ("f16", torch.randn(7).half()),
    ]
