"""The reference block-FP8 quantizer (``weight_sync.fp8_quant``) against verl 0.9.1's.

verl 0.9.1 (``verl/utils/kernel/fp8_kernel.py``) has two implementations behind
``scaled_fp8_blockwise``, which its ``SGLangFP8QuantizerHelper`` calls: a Triton kernel, used
wherever Triton is installed (every GPU install), and a PyTorch fallback. Ours is the Triton
kernel's arithmetic, bit for bit: the kernel itself runs here in Triton's interpreter, on
the CPU, writing its float32 values before the e4m3 cast (the interpreter's own cast to
e4m3 mis-rounds values that carry into the next binade, e.g. 31.78 -> 16 instead of 32: not
what the GPU's round-to-nearest-even ``cvt`` does, so torch's RTNE cast is applied to both).
The PyTorch fallback differs where the test says, and docs/usage.md (FP8) says why.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sglang.srt.weight_sync.fp8_quant import (
    EPS,
    FP8_MAX,
    block_grid,
    quantize_block_fp8,
)

pytest.importorskip("verl")

SHAPES = ((256, 384), (200, 300), (128, 128))


def _inputs():
    """Random blocks with the hard cases: zero blocks, denormal blocks, tiny blocks under
    verl's 1e-10 floor, huge values and fp32 denormals inside normal blocks; bf16 and fp32."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for shape in SHAPES:
        x = torch.randn(shape, generator=g) * 0.02
        out[f"randn{shape}"] = x
    x = torch.randn(256, 256, generator=g)
    x[:128, :128] = 0
    x[128:, :128] *= 1e-39  # fp32 denormals (bf16 keeps them)
    x[:128, 128:] *= 1e-12  # normal, under the 1e-10 floor
    x[130, 200] = 3e38
    x[200, 201] = -1e30
    x[140, 140] = 1e-40
    out["edges"] = x
    return {
        f"{k}-{str(d)[6:]}": v.to(d)
        for k, v in out.items()
        for d in (torch.bfloat16, torch.float32)
    }


_TRITON_RUN = r"""
import sys, torch
from verl.utils.kernel import fp8_kernel as fk
inputs = torch.load(sys.argv[1])
out = {}
for name, x in inputs.items():
    bm = bn = 128
    n, k = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, (-k) % bn, 0, (-n) % bm))
    y = torch.empty(xp.shape, dtype=torch.float32)
    s = torch.empty(-(-n // bm), -(-k // bn), dtype=torch.float32)
    fk._blockwise_cast_to_fp8_kernel[(s.shape[0], s.shape[1])](
        xp, y, s, *xp.stride(), *y.stride(), *s.stride(), xp.shape[0], xp.shape[1],
        1e-10, fk.FP8_MIN, fk.FP8_MAX, BLOCK_M=bm, BLOCK_N=bn)
    out[name] = (y[:n, :k].contiguous(), s)
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def verl_triton(tmp_path_factory):
    """verl's Triton kernel on every input, in Triton's CPU interpreter (a subprocess:
    the interpreter is chosen when the kernel is decorated): (float32 values, scales)."""
    pytest.importorskip("triton")
    d = tmp_path_factory.mktemp("verl_triton")
    torch.save(_inputs(), d / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_RUN, str(d / "in.pt"), str(d / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(d / "out.pt")


def _largest(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)
    )


@pytest.mark.parametrize("name", sorted(_inputs()))
def test_equals_verl_triton_kernel_bit_for_bit(verl_triton, name):
    x = _inputs()[name]
    q, scale = quantize_block_fp8(x)
    values, verl_scale = verl_triton[name]
    verl_q = values.to(
        torch.float8_e4m3fn
    )  # the GPU's cvt.rn.satfinite after verl's clamp
    assert q.shape == x.shape and scale.shape == block_grid(tuple(x.shape))
    assert torch.equal(_bits(scale), _bits(verl_scale)), name
    assert torch.equal(_bits(q), _bits(verl_q)), (
        f"{name}: {(_bits(q) != _bits(verl_q)).sum()} elements differ"
    )


@pytest.mark.parametrize("name", sorted(_inputs()))
def test_differs_from_verl_pytorch_fallback_only_where_documented(name):
    """verl's fallback divides the other way (``multiplier = 448 / amax``,
    ``scale = 1 / multiplier``) and has no 1e-10 floor: zero blocks get scale 1 (ours
    1e-10 / 448, both dequantize to 0); blocks whose amax is under the floor or whose
    ``448 / amax`` overflows saturate to +-448 with scale 0 (ours: 0); elsewhere a scale
    may differ by one float32 ulp and a value by one e4m3 step where the two multipliers
    differ."""
    from verl.utils.kernel.fp8_kernel import _scaled_fp8_blockwise_pytorch

    x = _inputs()[name]
    q, scale = quantize_block_fp8(x)
    vq, vscale = _scaled_fp8_blockwise_pytorch(x.clone(), [128, 128])
    vscale = vscale.squeeze(-1)
    amax = (
        torch.nn.functional.pad(
            x.float().abs(), (0, (-x.shape[1]) % 128, 0, (-x.shape[0]) % 128)
        )
        .reshape(scale.shape[0], 128, scale.shape[1], 128)
        .amax(dim=(1, 3))
    )
    floor = amax < EPS
    normal = ~floor & torch.isfinite(FP8_MAX / amax)
    # below the floor: ours quantizes to zero with scale 1e-10 / 448
    assert torch.equal(scale[floor], torch.full_like(scale[floor], EPS / FP8_MAX))
    ulps = (_bits(scale) - _bits(vscale)).abs()
    assert _largest(ulps[normal]) <= 1, name
    ours_mult = torch.reciprocal(amax / FP8_MAX)
    verl_mult = FP8_MAX / amax
    same_mult = (_bits(ours_mult) == _bits(verl_mult)) & normal
    expand = same_mult.repeat_interleave(128, 0).repeat_interleave(128, 1)
    expand = expand[: x.shape[0], : x.shape[1]]
    assert torch.equal(_bits(q)[expand], _bits(vq)[expand]), name
    # the dequantized weights agree within one e4m3 step everywhere the blocks are normal
    deq = (
        q.float()
        * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[
            : x.shape[0], : x.shape[1]
        ]
    )
    vdeq = (
        vq.float()
        * vscale.repeat_interleave(128, 0).repeat_interleave(128, 1)[
            : x.shape[0], : x.shape[1]
        ]
    )
    block_of = normal.repeat_interleave(128, 0).repeat_interleave(128, 1)[
        : x.shape[0], : x.shape[1]
    ]
    rel = (deq - vdeq).abs()[block_of] / x.float().abs().clamp_min(1e-30)[block_of]
    assert _largest(rel) <= 0.125 + 1e-6, name


def test_a_block_alone_quantizes_as_in_the_whole_tensor():
    """Each block depends on its own elements only: what lets a block be quantized wherever
    all its elements meet, on any rank, with the bits of quantizing the whole tensor."""
    x = _inputs()["edges-bfloat16"]
    q, scale = quantize_block_fp8(x)
    for i in range(2):
        for j in range(2):
            bq, bs = quantize_block_fp8(
                x[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            )
            assert torch.equal(
                _bits(bq), _bits(q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128])
            )
            assert torch.equal(_bits(bs), _bits(scale[i : i + 1, j : j + 1]))
