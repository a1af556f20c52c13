"""The delta codec (``delta_codec``): any pair of regions of any dtype an engine holds, at any
density, decodes to the new values bit for bit, and no encoding is larger than the region.

Values are drawn as raw bit patterns, so NaNs of every payload, infinities, ``-0.0`` and
subnormals all occur; FP8 e4m3 regions are compared as bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.weight_sync.delta_codec import (
    Kind,
    bits_of,
    choose,
    decode,
    decode_into,
    encode,
    encode_many,
    payload_bytes,
    region_digest,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits_of(a), bits_of(b))


@st.composite
def region_pairs(draw):
    """(old, new): ``new`` is ``old`` with a drawn fraction of elements given random bits."""
    dtype = draw(st.sampled_from(DTYPES))
    numel = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**31 - 1))
    density = draw(st.sampled_from([0.0, 1e-4, 0.003, 0.02, 0.03, 0.04, 0.2, 1.0]))
    g = torch.Generator().manual_seed(seed)
    width = torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * width,), dtype=torch.uint8, generator=g)
    old = raw.view(dtype)
    fresh = torch.randint(0, 256, (numel * width,), dtype=torch.uint8, generator=g)
    pick = torch.rand(numel, generator=g) < density
    new_bits = bits_of(old).clone()
    new_bits[pick] = bits_of(fresh.view(dtype))[pick]
    return old, new_bits.view(dtype)


@settings(max_examples=300, deadline=None)
@given(region_pairs())
def test_roundtrip_is_bit_exact_and_never_larger(pair):
    old, new = pair
    enc = encode(old, new)
    assert _bits_equal(decode(enc, old), new)
    assert enc.nbytes <= enc.full_bytes
    assert enc.nbytes == payload_bytes(enc.kind, enc.numel, enc.changed, enc.itemsize)
    changed = int((bits_of(old) != bits_of(new)).sum())
    assert (enc.kind == Kind.UNCHANGED) == (changed == 0)
    # the chosen kind is the smallest possible
    best = min(
        payload_bytes(k, enc.numel, changed, enc.itemsize)
        for k in (Kind.INDICES, Kind.BITMASK, Kind.FULL)
    )
    assert changed == 0 or enc.nbytes == best


@settings(max_examples=60, deadline=None)
@given(st.lists(region_pairs(), min_size=1, max_size=6))
def test_a_bucket_encodes_like_its_regions_one_by_one(pairs):
    batch = encode_many(pairs)
    for (old, new), enc in zip(pairs, batch):
        single = encode(old, new)
        assert enc.kind == single.kind and torch.equal(enc.payload, single.payload)
        dest = old.clone()
        decode_into(enc, dest)
        assert _bits_equal(dest, new)


def test_signed_zero_and_nan_payloads_count_as_changes():
    old = torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=torch.float32)
    new = old.clone()
    new[0] = -0.0
    bits = bits_of(new)
    bits[1] = bits[1] ^ 1  # another NaN payload
    enc = encode(old, new)
    assert enc.changed == 2 and _bits_equal(decode(enc, old), new)


def test_break_even_between_indices_and_bitmask_is_one_in_32():
    numel = 32 * 1024
    assert choose(numel, numel // 32 - 1, 2) == Kind.INDICES
    assert choose(numel, numel // 32 + 1, 2) == Kind.BITMASK
    assert choose(numel, numel, 2) == Kind.FULL
    assert choose(numel, 0, 2) == Kind.UNCHANGED


def test_malformed_records_are_refused():
    old = torch.zeros(64, dtype=torch.bfloat16)
    new = old.clone()
    new[3] = 1.0
    enc = encode(old, new)
    assert enc.kind == Kind.INDICES
    bad = type(enc)(enc.kind, enc.numel, enc.itemsize, enc.changed, enc.payload[:-1])
    with pytest.raises(ValueError, match="expected"):
        decode(bad, old)
    idx = enc.payload.clone()
    idx[:4] = torch.tensor([100], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        decode(type(enc)(enc.kind, 64, 2, 1, idx), old)
    with pytest.raises(ValueError, match="region of"):
        decode(enc, torch.zeros(65, dtype=torch.bfloat16))


def test_digest_sees_one_changed_element_and_a_swap():
    t = torch.randn(1000).to(torch.bfloat16)
    base = region_digest(t)
    u = t.clone()
    u[500] = -u[500] if u[500] != 0 else 1.0
    assert region_digest(u) != base
    w = t.clone()
    w[[1, 2]] = t[[2, 1]]
    assert t[1] == t[2] or region_digest(w) != base
    assert 0 <= base < 2**62 and region_digest(t.clone()) == base
