"""Delta codec: a region's new engine-dtype values as the few bytes that changed, exactly.

Pure tensor code (no process group): the trainer encodes each region it sends against the
values it last delivered, the engine decodes against the values it holds. Elements are
compared by bit pattern (an integer view of the same width), never by float equality:
``-0.0`` and ``0.0`` differ, a NaN equals only the same NaN bits, and FP8 e4m3 is compared
as bytes. Each region is sent as the smallest of four kinds (``Kind``):

* ``UNCHANGED``: nothing;
* ``INDICES``: the changed elements' int32 positions, then their values;
* ``BITMASK``: one bit per element (little-endian within a byte), then the changed values;
* ``FULL``: the region itself;
* ``GAPS``: the changed values, then the gaps between the changed positions as LEB128
  varints (one byte for a gap below 128: at a density of 3%, about one byte per change
  where ``INDICES`` spends four). Its size depends on where the changes are, so a record
  carries it (``payload_bytes`` is None for it).

Indices beat a bitmask below a density of 1/32 (4 bytes per change against 1/8 byte per
element); both beat the full region while the values plus the positions are fewer bytes.
The choice is by bytes only: ``docs/results.md`` records that encoding and decoding every
kind costs far less per byte than the wire saves. ``encode_many`` compares a bucket's
regions of one dtype in one vectorised pass (one comparison and one cumulative count over
their concatenation, a large region alone); ``decode_into`` writes into the destination
in place.

``region_digest`` is a position-weighted 62-bit sum of a region's bit patterns, the same on
every device: what an engine holds is compared with what the trainer last delivered.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.weight_sync.protocol import DeliveryError

__all__ = (
    "CLASSES",
    "DIGEST_BITS",
    "DIGEST_BYTES",
    "Encoded",
    "Kind",
    "NO_DIGEST",
    "RECORD_BYTES",
    "SIZE_BYTES",
    "base_digests",
    "bits_of",
    "choose",
    "decode",
    "decode_into",
    "decode_many",
    "delta_records",
    "encode",
    "encode_many",
    "gaps_bytes_bounds",
    "payload_bytes",
    "read_base_digests",
    "read_delta_records",
    "region_digest",
)

DIGEST_BITS = 62
NO_DIGEST = -1  # a record whose base is not checked
INDEX_BYTES = 4  # int32 positions
MAX_INDEXED = (1 << 31) - 1  # more elements than int32 can name: no INDICES kind
SMALL_REGION = 1 << 16  # regions below this many elements are compared together
MAX_VARINT_BYTES = 9  # a LEB128 varint of a non-negative int64 (63 bits)

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
    GAPS = 4


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


def payload_bytes(kind: Kind, numel: int, changed: int, itemsize: int) -> Optional[int]:
    """The payload size of a region of ``numel`` elements with ``changed`` of them changed,
    sent as ``kind`` (None for ``GAPS``, whose size depends on the positions)."""
    if kind == Kind.GAPS:
        return None
    if kind == Kind.UNCHANGED:
        return 0
    if kind == Kind.INDICES:
        return changed * (INDEX_BYTES + itemsize)
    if kind == Kind.BITMASK:
        return (numel + 7) // 8 + changed * itemsize
    return numel * itemsize


def gaps_bytes_bounds(changed: int, itemsize: int) -> Tuple[int, int]:
    """The least and most bytes a ``GAPS`` payload of ``changed`` elements can have."""
    return changed * (itemsize + 1), changed * (itemsize + MAX_VARINT_BYTES)


def choose(numel: int, changed: int, itemsize: int) -> Kind:
    """The smallest kind of a known size for ``changed`` of ``numel`` elements (ties: the
    simpler one, in the order FULL, BITMASK, INDICES: fewer operations to decode);
    ``encode`` then takes ``GAPS`` instead when it is smaller still."""
    if changed == 0:
        return Kind.UNCHANGED
    kinds = [Kind.FULL, Kind.BITMASK]
    if numel <= MAX_INDEXED:
        kinds.append(Kind.INDICES)
    return min(kinds, key=lambda k: payload_bytes(k, numel, changed, itemsize))


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, bit ``i % 8`` of byte ``i // 8`` for element ``i`` (numpy's
    ``packbits`` on the CPU: some 50 times faster than the tensor ops)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    weights = torch.tensor(
        [1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device
    )
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    if packed.device.type == "cpu":
        flags = np.unpackbits(packed.contiguous().numpy(), count=n, bitorder="little")
        return torch.from_numpy(flags).bool()
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n].bool()


def _varint_lengths(values: torch.Tensor) -> torch.Tensor:
    """How many LEB128 bytes each non-negative int64 of ``values`` takes."""
    bounds = torch.tensor(
        [1 << (7 * k) for k in range(1, MAX_VARINT_BYTES)],
        dtype=torch.int64,
        device=values.device,
    )
    return torch.bucketize(values, bounds, right=True) + 1


def _varints(
    values: torch.Tensor, lengths: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Non-negative int64 ``values`` as LEB128 varints, one after another (vectorised: the
    first byte of every value in one pass, then only the values that need more);
    ``lengths``: ``_varint_lengths(values)``, when known."""
    if values.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    if lengths is None:
        lengths = _varint_lengths(values)
    ends = lengths.cumsum(0)
    starts = ends - lengths
    out = torch.empty(int(ends[-1]), dtype=torch.uint8, device=values.device)
    out[starts] = ((values & 0x7F) | ((lengths > 1).to(torch.int64) << 7)).to(
        torch.uint8
    )
    rest, k = torch.nonzero(lengths > 1).reshape(-1), 1
    while rest.numel():
        more = lengths[rest] > k + 1
        byte = (values[rest] >> (7 * k)) & 0x7F
        out[starts[rest] + k] = (byte | (more.to(torch.int64) << 7)).to(torch.uint8)
        rest, k = rest[more], k + 1
    return out


def _read_varints(raw: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` LEB128 varints that fill ``raw`` exactly; ``ValueError`` otherwise."""
    last = (raw & 0x80) == 0
    if int(torch.count_nonzero(last)) != count or (raw.numel() and not bool(last[-1])):
        raise ValueError(f"a GAPS record's positions are not {count} whole varints")
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=raw.device)
    if count == raw.numel():  # every value in one byte
        return raw.to(torch.int64)
    ends = torch.nonzero(last).reshape(-1)
    starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
    if int((ends - starts).max()) >= MAX_VARINT_BYTES:
        raise ValueError(
            f"a GAPS record holds a varint longer than {MAX_VARINT_BYTES} bytes"
        )
    group = torch.cumsum(last.to(torch.int64), 0) - last.to(torch.int64)
    shift = torch.arange(raw.numel(), device=raw.device) - starts[group]
    parts = (raw & 0x7F).to(torch.int64) << (7 * shift)
    return torch.zeros(count, dtype=torch.int64, device=raw.device).scatter_add_(
        0, group, parts
    )


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
    if kind in (Kind.INDICES, Kind.GAPS):
        idx = torch.nonzero(mask).reshape(-1)
        if kind == Kind.GAPS:
            return _gaps_payload(new_bits, idx)
        return torch.cat([_as_bytes(idx.to(torch.int32)), _as_bytes(new_bits[idx])])
    return torch.cat([_pack_bits(mask), _as_bytes(new_bits[mask])])


def _gaps_payload(new_bits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The changed values, then each position's distance past the previous one, less one."""
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1
    return torch.cat([_as_bytes(new_bits[idx]), _varints(gaps)])


def _smallest(new_bits, mask, numel: int, changed: int, itemsize: int):
    """The smallest kind and its payload: ``choose``'s, or ``GAPS`` when smaller."""
    kind = choose(numel, changed, itemsize)
    if kind == Kind.UNCHANGED or gaps_bytes_bounds(changed, itemsize)[0] >= (
        payload_bytes(kind, numel, changed, itemsize)
    ):
        return kind, _payload(kind, new_bits, mask)
    gaps = _gaps_payload(new_bits, torch.nonzero(mask).reshape(-1))
    if gaps.numel() < payload_bytes(kind, numel, changed, itemsize):
        return Kind.GAPS, gaps
    return kind, _payload(kind, new_bits, mask)


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.dtype != new.dtype or old.numel() != new.numel():
        raise ValueError(
            f"delta of a region: old is {old.dtype} x {old.numel()}, new is "
            f"{new.dtype} x {new.numel()} (expected the same dtype and size)"
        )


def encode(
    old: Optional[torch.Tensor], new: torch.Tensor, kind: Optional[Kind] = None
) -> Encoded:
    """``new`` against ``old`` (same dtype and element count; None: no base, FULL);
    ``kind`` forces one (measurements), else the smallest."""
    if old is None:
        bits = bits_of(new)
        return Encoded(
            Kind.FULL, bits.numel(), new.element_size(), bits.numel(), _as_bytes(bits)
        )
    if kind is None:
        return encode_many([(old, new)])[0]
    _check_pair(old, new)
    new_bits = bits_of(new)
    mask = bits_of(old.to(new.device)) != new_bits
    changed = int(torch.count_nonzero(mask))
    if kind == Kind.UNCHANGED and changed:
        raise ValueError(f"UNCHANGED for a region with {changed} changed elements")
    return Encoded(
        kind,
        new_bits.numel(),
        new.element_size(),
        new_bits.numel() if kind == Kind.FULL else changed,
        _payload(kind, new_bits, mask),
    )


def encode_many(
    pairs: Sequence[Tuple[Optional[torch.Tensor], torch.Tensor]],
) -> List[Encoded]:
    """Every ``(old, new)`` region's encoding (old None: FULL): a region of at least
    ``SMALL_REGION`` elements in one pass of its own, the smaller ones of one element size
    in one pass over their concatenation (thousands of MoE experts' regions)."""
    out: List[Optional[Encoded]] = [None] * len(pairs)
    by_size: dict = {}
    for i, (old, new) in enumerate(pairs):
        if old is None:
            out[i] = encode(None, new)
            continue
        _check_pair(old, new)
        by_size.setdefault(new.element_size(), []).append(i)
    for itemsize, members in by_size.items():
        # a large region is compared on its own; small ones together, in one pass
        large = [i for i in members if pairs[i][1].numel() >= SMALL_REGION]
        small = [i for i in members if pairs[i][1].numel() < SMALL_REGION]
        for group in [[i] for i in large] + ([small] if small else []):
            _encode_group(pairs, group, itemsize, out)
    return out  # type: ignore[return-value]


def _encode_group(pairs, members: List[int], itemsize: int, out: list) -> None:
    """The encodings of ``pairs[i]`` for ``i`` in ``members`` (one element size), from one
    comparison over their concatenation, into ``out``; the group's changed positions and
    ``GAPS`` payloads found in one pass too (``_GroupGaps``), so that thousands of small
    regions cost a few tensor operations, not a few per region."""
    olds, news = [], []
    for i in members:
        old, new = pairs[i]
        olds.append(bits_of(old if old.device == new.device else old.to(new.device)))
        news.append(bits_of(new))
    sizes = [n.numel() for n in news]
    if len(members) == 1:
        mask = olds[0] != news[0]
        changed = int(torch.count_nonzero(mask))
        kind, payload = _smallest(news[0], mask, sizes[0], changed, itemsize)
        out[members[0]] = Encoded(
            kind,
            sizes[0],
            itemsize,
            sizes[0] if kind == Kind.FULL else changed,
            payload,
        )
        return
    new_all = torch.cat(news)
    masks_all = torch.cat(olds) != new_all
    gaps = _GroupGaps(masks_all, new_all, sizes)
    offset = 0
    for r, (i, new_bits, numel) in enumerate(zip(members, news, sizes)):
        changed = gaps.counts[r]
        kind = choose(numel, changed, itemsize)
        if kind != Kind.UNCHANGED and gaps.nbytes(r) < payload_bytes(
            kind, numel, changed, itemsize
        ):
            kind, payload = Kind.GAPS, gaps.payload(r)
        else:
            payload = _payload(kind, new_bits, masks_all[offset : offset + numel])
        offset += numel
        out[i] = Encoded(
            kind, numel, itemsize, numel if kind == Kind.FULL else changed, payload
        )


class _GroupGaps:
    """The changed elements of consecutive regions (``sizes`` elements each) of ``mask``
    over ``new_all``, found in one pass: how many each region has (``counts``) and every
    region's ``GAPS`` payload, as ``_gaps_payload`` makes one (its changed values, then
    each position's gap to the previous one of the region as varints), laid out region
    after region in one buffer."""

    def __init__(
        self, mask: torch.Tensor, new_all: torch.Tensor, sizes: List[int]
    ) -> None:
        device, itemsize = mask.device, new_all.element_size()
        idx = torch.nonzero(mask).reshape(-1)
        bounds = torch.tensor([0] + sizes, device=device).cumsum(0)
        at = torch.searchsorted(idx, bounds)  # each region's first changed element
        self.counts: List[int] = (at[1:] - at[:-1]).tolist()
        region = torch.searchsorted(bounds[1:], idx, right=True)
        local = idx - bounds[region]
        first = torch.ones_like(idx, dtype=torch.bool)
        first[1:] = region[1:] != region[:-1]
        prev = torch.cat([local.new_zeros(1), local[:-1]])
        gaps = torch.where(first, local, local - prev - 1)
        lengths = _varint_lengths(gaps)
        varint_bytes = torch.zeros(len(sizes), dtype=torch.int64, device=device)
        varint_bytes.scatter_add_(0, region, lengths)
        value_bytes = (at[1:] - at[:-1]) * itemsize
        total = value_bytes + varint_bytes
        self.at: List[int] = [0] + total.cumsum(0).tolist()
        starts = total.cumsum(0) - total
        buf = torch.empty(self.at[-1], dtype=torch.uint8, device=device)
        if idx.numel():
            values = _as_bytes(new_all[idx])
            varints = _varints(gaps, lengths)
            # each region's values at its start, its varints after them
            shift = starts - (at[:-1] * itemsize)
            buf[
                torch.arange(values.numel(), device=device)
                + torch.repeat_interleave(shift, value_bytes)
            ] = values
            varint_at = varint_bytes.cumsum(0) - varint_bytes
            shift = starts + value_bytes - varint_at
            buf[
                torch.arange(varints.numel(), device=device)
                + torch.repeat_interleave(shift, varint_bytes)
            ] = varints
        self.buf = buf

    def nbytes(self, r: int) -> int:
        """Region ``r``'s ``GAPS`` payload size."""
        return self.at[r + 1] - self.at[r]

    def payload(self, r: int) -> torch.Tensor:
        """Region ``r``'s ``GAPS`` payload (a view of the group's buffer)."""
        return self.buf[self.at[r] : self.at[r + 1]]


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
    if expected is None:
        low, high = gaps_bytes_bounds(encoded.changed, encoded.itemsize)
        expected = encoded.nbytes if low <= encoded.nbytes <= high else f"{low}-{high}"
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
    if encoded.kind == Kind.GAPS:
        values = payload[: n * encoded.itemsize]
        gaps = _read_varints(payload[n * encoded.itemsize :], n)
        idx = torch.cumsum(gaps + 1, 0) - 1
        if n and (
            int(gaps.min()) < 0
            or int(gaps.max()) >= encoded.numel
            or int(idx[-1]) >= encoded.numel
        ):
            raise ValueError(
                f"a GAPS record names positions outside [0, {encoded.numel})"
            )
        bits[idx] = _view(values, bits.dtype)
        return
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
    if int(torch.count_nonzero(mask)) != n:
        raise ValueError(
            f"a BITMASK record says {n} elements changed, its mask sets "
            f"{int(torch.count_nonzero(mask))}"
        )
    bits[mask] = _view(payload[mask_bytes:], bits.dtype)


def decode_many(
    records: Sequence[Encoded],
    bases: Sequence[torch.Tensor],
    devices: Optional[Sequence[torch.device]] = None,
) -> Tuple[List[Optional[torch.Tensor]], List[str]]:
    """Each record decoded onto a copy of its base (on its device of ``devices``, the
    base's when None):
    the new values, and per record why it does not fit ("" when it does; its value is then
    None), as ``decode_into`` says it. The small ``GAPS`` records of one element size are
    decoded in one pass (thousands of MoE experts' regions: a few tensor operations, not a
    few per region), their values views of one buffer."""
    out: List[Optional[torch.Tensor]] = [None] * len(records)
    errors = [""] * len(records)
    groups: dict = {}
    for i, (enc, base) in enumerate(zip(records, bases)):
        where = base.device if devices is None else devices[i]
        if enc.kind == Kind.GAPS and enc.numel < SMALL_REGION:
            groups.setdefault((enc.itemsize, where), []).append(i)
        else:
            _decode_one(enc, base, where, i, out, errors)
    for (itemsize, where), members in groups.items():
        encs = [records[i] for i in members]
        olds = [bases[i] for i in members]
        news = (
            _decode_gaps_group(encs, olds, itemsize, where)
            if len(members) > 1
            else None
        )
        if news is None:  # one record, or one that does not fit: each alone, named
            for i in members:
                _decode_one(records[i], bases[i], where, i, out, errors)
            continue
        for i, new in zip(members, news):
            out[i] = new
    return out, errors


def _decode_one(enc, base, device, i: int, out: list, errors: list) -> None:
    old = torch.empty(base.shape, dtype=base.dtype, device=device).copy_(base)
    try:
        decode_into(enc, old)
        out[i] = old
    except ValueError as e:
        errors[i] = str(e)


def _decode_gaps_group(
    records: List[Encoded],
    bases: List[torch.Tensor],
    itemsize: int,
    device: torch.device,
) -> Optional[List[torch.Tensor]]:
    """``GAPS`` records onto copies of their bases in one buffer, in one pass: every
    record's varints read together, each position offset by its record's start. None when
    any record does not fit exactly as ``decode_into`` requires (the caller then decodes
    each alone, so that the one that does not fit is named)."""
    counts = [enc.changed for enc in records]
    sizes = [enc.numel for enc in records]
    for enc, base in zip(records, bases):
        low, high = gaps_bytes_bounds(enc.changed, enc.itemsize)
        if (
            base.numel() != enc.numel
            or base.element_size() != itemsize
            or not low <= enc.nbytes <= high
        ):
            return None
    buf = torch.cat([b.to(device).reshape(-1) for b in bases])
    bits = buf.view(_INT_OF_SIZE[itemsize])
    value_parts, varint_parts = [], []
    for enc in records:
        payload = enc.payload.to(device)
        value_parts.append(payload[: enc.changed * itemsize])
        varint_parts.append(payload[enc.changed * itemsize :])
    varints = torch.cat(varint_parts)
    lengths = torch.tensor([v.numel() for v in varint_parts], device=device)
    last = (varints & 0x80) == 0
    ends = lengths.cumsum(0)
    per_record = torch.zeros(len(records), dtype=torch.int64, device=device)
    record_of_byte = torch.repeat_interleave(
        torch.arange(len(records), device=device), lengths
    )
    per_record.scatter_add_(0, record_of_byte, last.to(torch.int64))
    if per_record.tolist() != counts or not bool(last[ends - 1].all()):
        return None
    try:
        gaps = _read_varints(varints, sum(counts))
    except ValueError:
        return None
    n = torch.tensor(counts, device=device)
    record = torch.repeat_interleave(torch.arange(len(records), device=device), n)
    steps = (gaps + 1).cumsum(0)
    first = n.cumsum(0) - n  # each record's first position in ``gaps``
    before = steps[first] - (gaps[first] + 1)  # the steps of the records before it
    local = steps - 1 - before[record]
    if bool((local >= torch.tensor(sizes, device=device)[record]).any()) or bool(
        (local < 0).any() | (gaps >= max(sizes)).any()
    ):
        return None
    starts = torch.tensor([0] + sizes[:-1], device=device).cumsum(0)
    bits[local + starts[record]] = _view(torch.cat(value_parts), bits.dtype)
    out, at = [], 0
    for base, numel in zip(bases, sizes):
        out.append(buf[at : at + numel].view(base.shape))
        at += numel
    return out


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


# the tensor classes whose density a delta update's report and reply give
CLASSES = ("embedding", "attention", "mlp", "norm", "other")


# ---------------------------------------------------------------------------- delta records

# A record's header: one int64, kind | changed << 3 (the payload's size follows from them and
# the region's), then, for a GAPS payload (whose size depends on the positions), its size.
KIND_BITS = 3
RECORD_BYTES = 8
DIGEST_BYTES = 8
SIZE_BYTES = 8


def delta_records(records: List[Encoded]) -> torch.Tensor:
    """One sender's records for one receiver in one round, in the plan's order of their
    moves: each its header, then its payload."""
    parts = []
    for enc in records:
        words = [int(enc.kind) | (enc.changed << KIND_BITS)]
        if payload_bytes(enc.kind, enc.numel, enc.changed, enc.itemsize) is None:
            words.append(enc.nbytes)
        device = enc.payload.device
        parts += [
            torch.tensor(words, dtype=torch.int64, device=device).view(torch.uint8),
            enc.payload.reshape(-1),
        ]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def read_delta_records(
    raw: torch.Tensor, regions: List[Tuple[int, int]], who: str
) -> List[Encoded]:
    """The records of ``raw`` for ``regions`` (each ``(numel, itemsize)``, in the plan's
    order): every header checked against its region (a known kind, at most ``numel``
    changed, ``FULL`` with all) and the buffer read exactly to its end; ``DeliveryError``
    names the record."""
    raw = raw.reshape(-1)
    host = raw.cpu()  # the headers are read here; payloads stay where they landed
    out, offset = [], 0
    for i, (numel, itemsize) in enumerate(regions):
        where = (
            f"{who}: delta record {i} of {len(regions)} (a region of {numel} elements)"
        )
        if offset + RECORD_BYTES > raw.numel():
            raise DeliveryError(f"{where}: the payload ends before its header")
        word = int(host[offset : offset + RECORD_BYTES].clone().view(torch.int64))
        offset += RECORD_BYTES
        code, changed = word & ((1 << KIND_BITS) - 1), word >> KIND_BITS
        if code not in [k.value for k in Kind]:
            raise DeliveryError(f"{where}: unknown kind {code}")
        kind = Kind(code)
        ok_changed = (
            changed == numel
            if kind == Kind.FULL
            else (changed == 0 if kind == Kind.UNCHANGED else 0 < changed <= numel)
        )
        if not ok_changed:
            raise DeliveryError(f"{where}: {kind.name} with {changed} changed")
        size = payload_bytes(kind, numel, changed, itemsize)
        if size is None:  # a GAPS payload: its size follows the header
            if offset + SIZE_BYTES > raw.numel():
                raise DeliveryError(f"{where}: the payload ends before its size")
            size = int(host[offset : offset + SIZE_BYTES].clone().view(torch.int64))
            offset += SIZE_BYTES
            low, high = gaps_bytes_bounds(changed, itemsize)
            if not low <= size <= high:
                raise DeliveryError(
                    f"{where}: a GAPS payload of {size} bytes; expected {low}-{high}"
                )
        if offset + size > raw.numel():
            raise DeliveryError(f"{where}: the payload ends inside it")
        payload = raw[offset : offset + size]
        offset += size
        out.append(Encoded(kind, numel, itemsize, changed, payload))
    if offset != raw.numel():
        raise DeliveryError(
            f"{who}: {raw.numel() - offset} bytes after the last of {len(regions)} records"
        )
    return out


def base_digests(checks: List[int], device=None) -> torch.Tensor:
    """The digests of the bases one sender's regions for one receiver apply to, in the
    plan's order (``NO_DIGEST``: sent whole, no base), one int64 each, sent before the
    update's first round so that the receiver checks every base before anything lands."""
    return torch.tensor(checks, dtype=torch.int64, device=device).view(torch.uint8)


def read_base_digests(raw: torch.Tensor, count: int, who: str) -> List[int]:
    """The ``count`` digests of ``raw`` (``base_digests``); ``DeliveryError`` for a buffer
    of another size or a digest out of range."""
    raw = raw.reshape(-1).cpu()
    if raw.numel() != count * DIGEST_BYTES:
        raise DeliveryError(
            f"{who}: {raw.numel()} bytes of base digests; expected {count * DIGEST_BYTES} "
            f"({count} regions)"
        )
    checks = raw.clone().view(torch.int64).tolist() if count else []
    for i, check in enumerate(checks):
        if check != NO_DIGEST and not 0 <= check < (1 << DIGEST_BITS):
            raise DeliveryError(
                f"{who}: base digest {i} of {count}: {check} is out of range"
            )
    return checks
