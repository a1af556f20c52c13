"""The reference block-FP8 quantizer: a BF16/FP32 ``[N, K]`` weight to e4m3 and float32
``weight_scale_inv``, one scale per ``128 x 128`` block.

The recipe is verl 0.9.1's Triton kernel (``verl/utils/kernel/fp8_kernel.py``,
``_blockwise_cast_to_fp8_kernel``, what ``SGLangFP8QuantizerHelper`` runs wherever Triton is
installed), after slime's: per block, in float32,
``amax = max(max|x|, 1e-10)``, ``scale = amax / 448``, ``q = clamp(x * (1 / scale), -448, 448)``
rounded to nearest even into ``float8_e4m3fn``; the stored ``weight_scale_inv`` is ``scale``
(SGLang multiplies by it to dequantize). A ragged edge block is quantized as if padded with
zeros, as verl pads. Each block depends only on its own elements, so quantizing a block alone
gives the bits quantizing the whole tensor gives: that is what lets a block be quantized
wherever its elements meet. Where verl's PyTorch fallback differs, and why, is in
docs/usage.md (FP8).
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = (
    "BLOCK",
    "EPS",
    "FP8_DTYPE",
    "FP8_MAX",
    "block_grid",
    "quantize_block_fp8",
    "quantize_blocks_into",
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
EPS = 1e-10  # verl's (and slime's) floor on a block's amax: an all-zero block gets scale 1e-10 / 448
BLOCK = (128, 128)


def block_grid(
    shape: Tuple[int, int], block: Tuple[int, int] = BLOCK
) -> Tuple[int, int]:
    """The scale tensor's shape for a weight of ``shape``: ``ceil(N / bn), ceil(K / bk)``."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def quantize_block_fp8(
    weight: torch.Tensor, block: Tuple[int, int] = BLOCK
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)``: ``weight`` ``[N, K]`` quantized per ``block`` (see the module doc).

    ``q`` is ``float8_e4m3fn`` ``[N, K]``; ``scale_inv`` float32 ``block_grid(shape)``; both on
    ``weight``'s device. The input is read once in float32 and not modified.
    """
    if weight.dim() != 2:
        raise ValueError(
            f"block-FP8 quantization takes a 2-D weight, got shape {tuple(weight.shape)}"
        )
    n, k = weight.shape
    bn, bk = block
    gn, gk = block_grid((n, k), block)
    x = weight.to(torch.float32)
    pad_n, pad_k = gn * bn - n, gk * bk - k
    if pad_n or pad_k:
        x = torch.nn.functional.pad(x, (0, pad_k, 0, pad_n))
    blocks = x.reshape(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(EPS)
    scale = amax / FP8_MAX
    multiplier = torch.reciprocal(scale)
    q = (blocks * multiplier[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(gn * bn, gk * bk)
    if pad_n or pad_k:
        q = q[:n, :k].contiguous()
    return q, scale


def quantize_blocks_into(
    source: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: Tuple[int, int] = BLOCK,
) -> None:
    """Quantize ``source`` (a region of whole blocks, ``[n, k]``) into ``weight`` (e4m3, the
    same shape) and ``scale_inv`` (its block grid), in place (``copy_``: never a rebind)."""
    q, scale = quantize_block_fp8(source, block)
    weight.copy_(q)
    scale_inv.copy_(scale)
