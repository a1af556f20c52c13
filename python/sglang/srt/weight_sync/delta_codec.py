"""Delta codec: a region's new engine-dtype values as the few bytes that changed, exactly.

Pure tensor code (no process group): the trainer encodes each region it sends against the
values it last delivered, the engine decodes against the values it holds. Elements are
compared by bit pattern (an integer view of the same width), never by float equality:
``-0.0`` and ``0.0`` differ, a NaN equals only the same NaN bits, and FP8 e4m3 is compared
as bytes. Each region is sent as the smallest of four kinds (``Kind``):

* ``UNCHANGED``: nothing;
* ``INDICES``: the changed elements' int32 positions, then their values;
* ``BITMASK``: one bit per element (little-endian within a byte), then the changed values;
* ``FULL``: the region itself.

Indices beat a bitmask below a density of 1/32 (4 bytes per change against 1/8 byte per
element); both beat the full region while the values plus the positions are fewer bytes.
The choice is by bytes only: ``docs/results.md`` records that encoding and decoding every
kind costs far less per byte than the wire saves. ``encode_many`` compares a bucket's
regions of one dtype in one vectorised pass (one comparison and one cumulative count over
their concatenation); ``decode_into`` writes into the destination in place.

``region_digest`` is a position-weighted 62-bit sum of a region's bit patterns, the same on
every device: what an engine holds is compared with what the trainer last delivered.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = (
    "DIGEST_BITS",
    "Encoded",
    "Kind",
    "NO_DIGEST",
    "bits_of",
    "choose",
    "decode",
    "decode_into",
    "encode",
    "encode_many",
    "payload_bytes",
    "region_digest",
)

DIGEST_BITS = 62
NO_DIGEST = -1  # a record whose base is not checked
INDEX_BYTES = 4  # int32 positions
MAX_INDEXED = (1 << 31) - 1  # more elements than int32 can name: no INDICES kind

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# odd multiplier (the golden ratio's 64-bit constant, as a signed int64) and an offset, so
# that any single changed word, and any two swapped words, change the sum
_GOLDEN = -7046029254386353131
_OFFSET = 0x632BE5AB


class Kind(enum.IntEnum):
    """How one region travels (its code on the wire)."""

    UNCHANGED = 0
    INDICES = 1
    BITMASK = 2
    FULL = 3


@dataclass(frozen=True)
class Encoded:
    """One region's encoding: ``kind``, the region's element count and element size, the
    number of changed elements (``changed``; ``numel`` for FULL), and ``payload`` (1-d
    uint8, on the device the values were on)."""

    kind: Kind
    numel: int
    itemsize: int
    changed: int
    payload: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.payload.numel()

    @property
    def full_bytes(self) -> int:
        return self.numel * self.itemsize


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened as integers of the same width (its bit patterns), without a copy
    when it is contiguous."""
    itemsize = t.element_size()
    if itemsize not in _INT_OF_SIZE:
        raise ValueError(f"dtype {t.dtype}: no integer view of {itemsize} bytes")
    return t.contiguous().reshape(-1).view(_INT_OF_SIZE[itemsize])


def payload_bytes(kind: Kind, numel: int, changed: int, itemsize: int) -> int:
    """The payload size of a region of ``numel`` elements with ``changed`` of them changed,
    sent as ``kind``."""
    if kind == Kind.UNCHANGED:
        return 0
    if kind == Kind.INDICES:
        return changed * (INDEX_BYTES + itemsize)
    if kind == Kind.BITMASK:
        return (numel + 7) // 8 + changed * itemsize
    return numel * itemsize


def choose(numel: int, changed: int, itemsize: int) -> Kind:
    """The smallest kind for ``changed`` of ``numel`` elements (ties: the simpler one, in
    the order FULL, BITMASK, INDICES: fewer operations to decode)."""
    if changed == 0:
        return Kind.UNCHANGED
    kinds = [Kind.FULL, Kind.BITMASK]
    if numel <= MAX_INDEXED:
        kinds.append(Kind.INDICES)
    return min(kinds, key=lambda k: payload_bytes(k, numel, changed, itemsize))


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, bit ``i % 8`` of byte ``i // 8`` for element ``i``."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    weights = torch.tensor(
        [1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device
    )
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n].bool()


def _view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes as ``dtype``; copied first when they do not start aligned for it (a record's
    parts follow one another in a byte buffer)."""
    size = torch.tensor([], dtype=dtype).element_size()
    if raw.storage_offset() % size:
        raw = raw.clone()
    return raw.view(dtype)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _payload(
    kind: Kind, new_bits: torch.Tensor, mask: Optional[torch.Tensor]
) -> torch.Tensor:
    if kind == Kind.UNCHANGED:
        return torch.empty(0, dtype=torch.uint8, device=new_bits.device)
    if kind == Kind.FULL:
        return _as_bytes(new_bits)
    if kind == Kind.INDICES:
        idx = torch.nonzero(mask).reshape(-1)
        return torch.cat([_as_bytes(idx.to(torch.int32)), _as_bytes(new_bits[idx])])
    return torch.cat([_pack_bits(mask), _as_bytes(new_bits[mask])])


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.dtype != new.dtype or old.numel() != new.numel():
        raise ValueError(
            f"delta of a region: old is {old.dtype} x {old.numel()}, new is "
            f"{new.dtype} x {new.numel()} (expected the same dtype and size)"
        )


def encode(old: Optional[torch.Tensor], new: torch.Tensor) -> Encoded:
    """``new`` against ``old`` (same dtype and element count; None: no base, FULL)."""
    if old is None:
        bits = bits_of(new)
        return Encoded(
            Kind.FULL, bits.numel(), new.element_size(), bits.numel(), _as_bytes(bits)
        )
    return encode_many([(old, new)])[0]


def encode_many(
    pairs: Sequence[Tuple[Optional[torch.Tensor], torch.Tensor]],
) -> List[Encoded]:
    """Every ``(old, new)`` region's encoding; regions of one element size are compared in
    one pass over their concatenation (old None: FULL)."""
    out: List[Optional[Encoded]] = [None] * len(pairs)
    by_size: dict = {}
    for i, (old, new) in enumerate(pairs):
        if old is None:
            out[i] = encode(None, new)
            continue
        _check_pair(old, new)
        by_size.setdefault(new.element_size(), []).append(i)
    for itemsize, members in by_size.items():
        olds = [bits_of(pairs[i][0].to(pairs[i][1].device)) for i in members]
        news = [bits_of(pairs[i][1]) for i in members]
        sizes = [n.numel() for n in news]
        if len(members) == 1:
            masks_all = olds[0] != news[0]
        else:
            masks_all = torch.cat(olds) != torch.cat(news)
        counts = _segment_counts(masks_all, sizes)
        offset = 0
        for i, new_bits, numel, changed in zip(members, news, sizes, counts):
            mask = masks_all[offset : offset + numel]
            offset += numel
            kind = choose(numel, changed, itemsize)
            out[i] = Encoded(
                kind,
                numel,
                itemsize,
                numel if kind == Kind.FULL else changed,
                _payload(kind, new_bits, mask),
            )
    return out  # type: ignore[return-value]


def _segment_counts(mask: torch.Tensor, sizes: Sequence[int]) -> List[int]:
    """How many elements are set in each consecutive segment of ``mask`` (one cumulative
    count and one read of the boundaries)."""
    if len(sizes) == 1:
        return [int(mask.sum())]
    ends = torch.tensor(sizes, device=mask.device).cumsum(0)
    cum = torch.cat(
        [
            torch.zeros(1, dtype=torch.int64, device=mask.device),
            mask.to(torch.int64).cumsum(0),
        ]
    )
    at_ends = cum[ends]
    starts = torch.cat([cum[:1], at_ends[:-1]])
    return (at_ends - starts).tolist()


def decode_into(encoded: Encoded, dest: torch.Tensor) -> None:
    """Turn ``dest`` (contiguous, holding the old values) into the new values, in place.
    ``ValueError`` when the payload does not fit the region."""
    if dest.numel() != encoded.numel or dest.element_size() != encoded.itemsize:
        raise ValueError(
            f"a {encoded.kind.name} record of {encoded.numel} elements of {encoded.itemsize} "
            f"bytes for a region of {dest.numel()} elements of {dest.element_size()} bytes"
        )
    expected = payload_bytes(
        encoded.kind, encoded.numel, encoded.changed, encoded.itemsize
    )
    if encoded.nbytes != expected:
        raise ValueError(
            f"a {encoded.kind.name} record of {encoded.nbytes} bytes; expected {expected}"
        )
    if not dest.is_contiguous():
        raise ValueError("decode_into writes a contiguous destination")
    if encoded.kind == Kind.UNCHANGED:
        return
    bits = dest.reshape(-1).view(_INT_OF_SIZE[encoded.itemsize])
    payload = encoded.payload.to(dest.device)
    if encoded.kind == Kind.FULL:
        bits.copy_(_view(payload, bits.dtype))
        return
    n = encoded.changed
    if encoded.kind == Kind.INDICES:
        idx = _view(payload[: n * INDEX_BYTES], torch.int32).to(torch.int64)
        if n and (int(idx.min()) < 0 or int(idx.max()) >= encoded.numel):
            raise ValueError(
                f"an INDICES record names positions outside [0, {encoded.numel})"
            )
        bits[idx] = _view(payload[n * INDEX_BYTES :], bits.dtype)
        return
    mask_bytes = (encoded.numel + 7) // 8
    mask = _unpack_bits(payload[:mask_bytes], encoded.numel)
    if int(mask.sum()) != n:
        raise ValueError(
            f"a BITMASK record says {n} elements changed, its mask sets {int(mask.sum())}"
        )
    bits[mask] = _view(payload[mask_bytes:], bits.dtype)


def decode(encoded: Encoded, old: torch.Tensor) -> torch.Tensor:
    """The new values, as a new tensor shaped like ``old``."""
    out = old.detach().clone(memory_format=torch.contiguous_format)
    decode_into(encoded, out)
    return out


def region_digest(t: torch.Tensor) -> int:
    """A position-weighted 62-bit sum of ``t``'s bit patterns (int64 arithmetic that wraps,
    the same on CPU and GPU): any changed element, and any two swapped, change it."""
    bits = bits_of(t).to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device)
    weights = (weights * _GOLDEN) | 1
    total = int(((bits + _OFFSET) * weights).sum())
    return total & ((1 << DIGEST_BITS) - 1)
