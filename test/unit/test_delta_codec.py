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
    Encoded,
    Kind,
    bits_of,
    choose,
    decode,
    decode_into,
    decode_many,
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
    size = payload_bytes(enc.kind, enc.numel, enc.changed, enc.itemsize)
    assert enc.nbytes == (size if enc.kind != Kind.GAPS else enc.nbytes)
    changed = int((bits_of(old) != bits_of(new)).sum())
    assert (enc.kind == Kind.UNCHANGED) == (changed == 0)
    if changed == 0:
        return
    # the chosen kind is the smallest possible, every kind decodes exactly
    sizes = {}
    for kind in (Kind.INDICES, Kind.BITMASK, Kind.FULL, Kind.GAPS):
        forced = encode(old, new, kind)
        assert _bits_equal(decode(forced, old), new), kind
        sizes[kind] = forced.nbytes
    assert enc.nbytes == min(sizes.values()), (enc.kind, sizes)


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
    enc = encode(old, new, Kind.INDICES)
    bad = type(enc)(enc.kind, enc.numel, enc.itemsize, enc.changed, enc.payload[:-1])
    with pytest.raises(ValueError, match="expected"):
        decode(bad, old)
    idx = enc.payload.clone()
    idx[:4] = torch.tensor([100], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        decode(type(enc)(enc.kind, 64, 2, 1, idx), old)
    with pytest.raises(ValueError, match="region of"):
        decode(enc, torch.zeros(65, dtype=torch.bfloat16))
    gaps = encode(old, new)
    assert gaps.kind == Kind.GAPS and gaps.nbytes == 3  # the value, one varint
    with pytest.raises(ValueError, match="expected"):
        decode(type(gaps)(Kind.GAPS, 64, 2, 1, gaps.payload[:2]), old)
    far = gaps.payload.clone()
    far[2] = 100  # a gap past the region
    with pytest.raises(ValueError, match="outside"):
        decode(type(gaps)(Kind.GAPS, 64, 2, 1, far), old)
    unended = torch.cat([gaps.payload[:2], torch.tensor([0x81], dtype=torch.uint8)])
    with pytest.raises(ValueError, match="whole varints"):
        decode(type(gaps)(Kind.GAPS, 64, 2, 1, unended), old)


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


def test_records_read_back_and_malformed_ones_are_refused():
    """The wire form of a round's records (``remote.protocol``): read back exactly; a wrong
    kind code, count, size or trailing byte is refused naming the record."""
    from sglang.srt.weight_sync.delta_codec import delta_records, read_delta_records
    from sglang.srt.weight_sync.protocol import DeliveryError

    old = torch.zeros(100, dtype=torch.bfloat16)
    new = old.clone()
    new[7] = 2.0
    encs = [encode(old, new), encode(old, old), encode(None, new)]
    encs.append(encode(old, new, Kind.INDICES))
    assert encs[0].kind == Kind.GAPS
    raw = delta_records(encs)
    regions = [(100, 2)] * 4
    back = read_delta_records(raw, regions, "test")
    for enc, want in zip(back, encs):
        assert enc.kind == want.kind and torch.equal(enc.payload, want.payload)
    with pytest.raises(DeliveryError, match="after the last"):
        read_delta_records(torch.cat([raw, raw[:1]]), regions, "test")
    with pytest.raises(DeliveryError, match="ends"):
        read_delta_records(raw[:-1], regions, "test")
    bad = raw.clone()
    bad[:8] = torch.tensor([int(Kind.FULL) | (3 << 3)]).view(torch.uint8)
    with pytest.raises(DeliveryError, match="FULL with 3 changed"):
        read_delta_records(bad, regions, "test")
    bad = raw.clone()
    bad[:8] = torch.tensor([7 | (1 << 3)]).view(torch.uint8)
    with pytest.raises(DeliveryError, match="unknown kind 7"):
        read_delta_records(bad, regions, "test")
    bad = raw.clone()
    bad[8:16] = torch.tensor([1000]).view(torch.uint8)  # the GAPS record's size word
    with pytest.raises(DeliveryError, match="GAPS payload of 1000"):
        read_delta_records(bad, regions, "test")


def test_base_digests_read_back_and_malformed_ones_are_refused():
    """The digests a sender sends before a delta update's first round (``base_digests``):
    read back exactly, ``NO_DIGEST`` included; a buffer of another size or a digest out
    of range is refused."""
    from sglang.srt.weight_sync.delta_codec import (
        DIGEST_BITS,
        NO_DIGEST,
        base_digests,
        read_base_digests,
        region_digest,
    )
    from sglang.srt.weight_sync.protocol import DeliveryError

    checks = [region_digest(torch.arange(6.0)), NO_DIGEST, 0, (1 << DIGEST_BITS) - 1]
    raw = base_digests(checks)
    assert raw.dtype == torch.uint8 and raw.numel() == 8 * len(checks)
    assert read_base_digests(raw, len(checks), "test") == checks
    assert read_base_digests(base_digests([]), 0, "test") == []
    with pytest.raises(DeliveryError, match="expected 24"):
        read_base_digests(raw, 3, "test")
    with pytest.raises(DeliveryError, match="out of range"):
        read_base_digests(base_digests([1 << DIGEST_BITS]), 1, "test")
    with pytest.raises(DeliveryError, match="out of range"):
        read_base_digests(base_digests([-2]), 1, "test")


def test_the_snapshot_advances_only_on_commit():
    """A trainer rank's delivered values (``delta_rounds.Snapshot``): no base before a commit,
    in another epoch or under another plan; a drop makes the next update full and says why."""
    from sglang.srt.weight_sync.delta_rounds import Snapshot

    snap = Snapshot()
    assert snap.bases(1, "plan")[0] is None
    snap.pending[("t",)] = torch.ones(2)
    snap.commit(1, "plan")
    bases, why = snap.bases(1, "plan")
    assert why == "" and torch.equal(bases[("t",)], torch.ones(2))
    assert "epoch" in snap.bases(2, "plan")[1]
    assert "plan changed" in snap.bases(1, "other")[1]
    snap.drop("update u3 failed: engine refused")
    bases, why = snap.bases(1, "plan")
    assert bases is None and why == "update u3 failed: engine refused"


def test_figures_per_engine_and_by_what_the_records_carry():
    """A sender's figures per receiving rank, summed per engine (its group ranks), and the
    summary's densities per class for each engine."""
    from sglang.srt.weight_sync.delta_rounds import (
        RECEIVER_FIGURES,
        DeltaFigures,
        delta_summary,
    )

    a, b = DeltaFigures(sent_delta=30, sent_full=200), DeltaFigures(sent_unchanged=8)
    a.received(2, "model.layers.0.mlp.up_proj.weight", 30, 400, 5, 200)
    a.received(3, "model.layers.0.mlp.up_proj.weight", 200, 200, 100, 100)
    b.received(2, "model.norm.weight", 8, 64, 0, 32)
    engines = [range(2, 4), range(4, 5)]
    rows = [f.engine_rows(engines) for f in (a, b)]
    assert all(len(r) == 2 * len(RECEIVER_FIGURES) for r in rows)
    width = len(RECEIVER_FIGURES)
    first = [x + y for x, y in zip(rows[0][:width], rows[1][:width])]
    assert first[:4] == [238, 664, 105, 332]
    assert rows[0][width:] == [0] * width
    back = DeltaFigures.from_ints(a.ints())
    assert (back.sent_delta, back.sent_full, back.sent_unchanged) == (30, 200, 0)
    summary = delta_summary([a, b], "", False, {"e0": first, "e1": rows[0][width:]})
    assert summary["sent_as"] == {
        "delta": [30, 0],
        "full": [200, 0],
        "unchanged": [0, 8],
    }
    e0 = summary["engines"]["e0"]
    assert (e0["wire_bytes"], e0["full_bytes"]) == (238, 664)
    assert e0["density_by_class"] == {"mlp": 105 / 300, "norm": 0.0}
    assert summary["engines"]["e1"]["density_by_class"] == {}


def test_the_report_says_what_comes_next():
    """After each update the report says whether the next one may be a delta: after a
    commit it may (in the same epoch), after a drop it is full and says why."""
    from sglang.srt.weight_sync.delta_rounds import Snapshot

    snap = Snapshot()
    assert snap.next_update(1) == {
        "next": "full",
        "next_why_full": "no update delivered yet",
    }
    snap.commit(1, "plan")
    assert snap.next_update(1) == {"next": "delta", "next_why_full": ""}
    assert "a new membership epoch (2" in snap.next_update(2)["next_why_full"]
    snap.drop("update u2 was refused: engine 'a': digest mismatch")
    assert snap.next_update(1) == {
        "next": "full",
        "next_why_full": "update u2 was refused: engine 'a': digest mismatch",
    }


def test_figures_carry_what_block_fp8_staging_received():
    """The pieces a block-FP8 engine quantizes from its staging (``engine_quantized``) are
    counted apart per class (all their bytes, those sent whole, a full update's), shared
    among the trainer ranks as integers and read back; a delta's report says none went
    whole for want of a base, a full one why; a report without any says nothing."""
    from sglang.srt.weight_sync.delta_rounds import DeltaFigures, delta_summary

    figures = DeltaFigures(wire_bytes=10)
    figures.staged("model.layers.0.mlp.down_proj.weight", 300, 300, True)
    figures.staged("model.layers.0.self_attn.o_proj.weight", 40, 4000, False)
    figures.staged("model.layers.1.mlp.up_proj.weight", 5, 500, False)
    back = DeltaFigures.from_ints(figures.ints())
    assert back.sent_staged == 345 and back.regions_staged == 3
    assert back.staged_whole == 300 and back.staged_full_bytes == 4800
    assert (
        back.staged_by_class["mlp"] == 305 and back.staged_by_class["attention"] == 40
    )
    assert back.wire_bytes == 10
    summary = delta_summary([back, DeltaFigures()], "", True)["engine_quantized"]
    assert summary["bytes"] == [345, 0] and summary["regions"] == 3
    assert summary["bytes_whole"] == [300, 0] and summary["full_bytes"] == [4800, 0]
    assert summary["bytes_by_class"] == {"attention": 40, "mlp": 305}
    assert summary["why"] == ""
    full = delta_summary([back], "no update delivered yet", False)["engine_quantized"]
    assert "no update delivered yet" in full["why"] and "staging" in full["why"]
    assert delta_summary([DeltaFigures()], "", True)["engine_quantized"] == {}


def test_a_delta_header_asks_the_engines_to_keep_their_bases():
    """A delta update's header says the group keeps bases (``keep_base``: a block-FP8
    engine keeps the bf16 staging of the pieces it quantizes); one that does not, or a
    field that is not a bool, is refused by name."""
    import pytest

    from sglang.srt.weight_sync.protocol import DeliveryError
    from sglang.srt.weight_sync.remote.protocol import UpdateHeader

    head = ("u1", "d" * 64, 10, 64 << 20, 3)
    for header in (
        UpdateHeader(*head),
        UpdateHeader(*head, keep_base=True),
        UpdateHeader(*head, delta=True, digest=True, keep_base=True),
    ):
        assert UpdateHeader.decode(header.encode()) == header
    with pytest.raises(DeliveryError, match="delta=true without keep_base=true"):
        UpdateHeader.decode(UpdateHeader(*head, delta=True).encode())
    bad = UpdateHeader(*head, keep_base=1).encode()  # type: ignore[arg-type]
    with pytest.raises(DeliveryError, match="keep_base=1: must be true or false"):
        UpdateHeader.decode(bad)


def test_kept_staging_is_what_the_pause_wrote_of_the_staged_pieces():
    """``KeptStaging.keep`` copies out of the pause's staging the regions of the moves into
    this rank's block-FP8 staging only (by the trainer's snapshot key, in host memory),
    replacing what it kept; ``clear`` lets it go."""
    from sglang.srt.weight_sync.delta_rounds import KeptStaging, _key

    plan, rank, staged, params = _staged_plan()
    kept = KeptStaging()
    kept.keep(plan, rank, params, staged)
    moves = [
        m for rnd in plan.rounds for m in rnd if any(d.rank == rank for d in m.dests)
    ]
    into = [m for m in moves if any((d.rank, d.param) in staged for d in m.dests)]
    assert into and len(into) < len(moves)
    assert set(kept.regions) == {_key(m) for m in into}
    for m in into:
        base = kept.base(m)
        assert base.device.type == "cpu" and base.is_contiguous()
        assert torch.equal(base, params[m.dests[0].param][m.region.slices()])
    assert kept.nbytes == sum(m.nbytes for m in into)
    params["w"].add_(1)  # what it kept is a copy
    assert not torch.equal(kept.base(into[0]), params["w"][into[0].region.slices()])
    kept.clear()
    assert kept.nbytes == 0 and kept.base(into[0]) is None


def _staged_plan():
    """A receiving rank's plan (rank 1): pieces of weight ``w`` (block FP8, quantized from
    staging on ranks 1 and 2) and a whole ``b`` (not), with the pause's buffers."""
    from sglang.srt.weight_sync.box import Box
    from sglang.srt.weight_sync.planner import Dest, Move, Plan
    from sglang.srt.weight_sync.source_layout import MeshSpec

    def move(name, shape, region, rank):
        holder = MeshSpec.full(shape, torch.bfloat16, [0]).describe(name).holders[0]
        dest = Dest(rank, name, (), (0,) * len(shape), shape)
        return Move(name, region, holder, torch.bfloat16, torch.bfloat16, (dest,))

    w, b = (384, 256), (256,)
    moves = (
        move("w", w, Box((0, 0), (100, 256)), 1),
        move("w", w, Box((100, 0), (100, 256)), 1),
        move("w", w, Box((200, 0), (100, 256)), 2),
        move("b", b, Box((0,), (256,)), 1),
    )
    plan = Plan((), (moves,), (), (), {}, {}, 1 << 20, "p")
    g = torch.Generator().manual_seed(0)
    params = {
        n: torch.randn(s, generator=g).bfloat16() for n, s in (("w", w), ("b", b))
    }
    return plan, 1, frozenset({(1, "w"), (2, "w")}), params


def _membership(trainers: int, engines):
    from sglang.srt.weight_sync.remote.protocol import Membership

    return Membership.of("g", 3, "127.0.0.1", 1, "gloo", trainers, engines)


@pytest.mark.parametrize("planned", [True, False])
def test_an_update_refused_before_any_byte_says_so(planned):
    """An update the group refused at its agreement (nothing sent, no rank has a result):
    the report says it was refused, what it was to be, and no bytes or densities."""
    from sglang.srt.weight_sync.delta_rounds import RECEIVER_FIGURES, DeltaFigures
    from sglang.srt.weight_sync.remote.trainer import DeltaOutcome, _delta_report

    membership = _membership(2, [("a", 2)])
    mine = DeltaFigures()
    row = mine.ints() + mine.engine_rows([range(2, 4)])
    rows = [[v, v] for v in row]  # figures x trainer ranks
    assert len(rows) == len(DeltaFigures().ints()) + len(RECEIVER_FIGURES)
    why = "" if planned else "no update delivered yet"
    outcome = DeltaOutcome(2, membership, None, True, planned)
    report = _delta_report(rows, outcome, why, {"a": {"success": False}})
    assert report["mode"] == "refused", report
    assert report["planned"] == ("delta" if planned else "full"), report
    assert report["why_full"] == why, report
    assert report["wire_bytes"] == [0, 0] and report["density"] == 0.0, report
    assert report["engines"]["a"]["wire_bytes"] == 0, report


def test_an_engine_reply_counts_what_it_received():
    """A receiver counts each record it read (``DeltaFigures.record``): its bytes by what it
    carries and its changes per tensor class; the reply (``delta_reply``) gives them per
    TP rank, with the densities."""
    from sglang.srt.weight_sync.delta_rounds import DeltaFigures
    from sglang.srt.weight_sync.remote.protocol import (
        DELTA_REPLY_FIGURES,
        delta_reply,
    )

    old = torch.zeros(1000, dtype=torch.bfloat16)
    new = old.clone()
    new[::100] = 1.0  # 10 of 1000 changed
    ranks = [DeltaFigures(), DeltaFigures()]
    ranks[0].record("model.layers.0.mlp.up_proj.weight", encode(old, new), 40)
    ranks[0].record("model.norm.weight", encode(old, old), 8)
    ranks[1].record("model.embed_tokens.weight", encode(None, new), 2008)
    table = [r.reply_ints() for r in ranks]
    figures = {k: [t[i] for t in table] for i, k in enumerate(DELTA_REPLY_FIGURES)}
    reply = delta_reply(figures)
    assert reply["bytes_as_delta"] == [40, 0]
    assert reply["bytes_as_full"] == [0, 2008]
    assert reply["bytes_as_unchanged"] == [8, 0]
    assert reply["changed"] == [10, 1000] and reply["elements"] == [2000, 1000]
    assert reply["density"] == [10 / 2000, 1.0]
    assert reply["density_by_class"] == {
        "embedding": [0.0, 1.0],
        "mlp": [10 / 1000, 0.0],
        "norm": [0.0, 0.0],
    }
    assert delta_reply({}) == {}


@pytest.mark.parametrize("density", [0.001, 0.1])
def test_large_regions_beside_small_ones(density):
    """A region of at least ``SMALL_REGION`` elements is compared alone, the small ones
    together; each decodes exactly either way."""
    from sglang.srt.weight_sync.delta_codec import SMALL_REGION

    g = torch.Generator().manual_seed(3)
    pairs = []
    for numel in (SMALL_REGION + 5, 100, SMALL_REGION * 2, 7):
        old = torch.randn(numel, generator=g).to(torch.bfloat16)
        new = old.clone()
        bits_of(new)[torch.rand(numel, generator=g) < density] ^= 1
        pairs.append((old, new))
    for (old, new), enc in zip(pairs, encode_many(pairs)):
        assert _bits_equal(decode(enc, old), new) and enc.nbytes <= enc.full_bytes


def test_thousands_of_small_regions_encode_like_one_by_one():
    """A MoE model's experts are thousands of small regions of one bucket: encoded in one
    pass (the group's changed positions and ``GAPS`` payloads found together), each equals
    its encoding alone (kind, count, payload bytes), at every density in one group, empty
    and one-element regions included."""
    g = torch.Generator().manual_seed(11)
    pairs = []
    for i in range(2000):
        numel = [0, 1, 64, 700, 4096][i % 5]
        density = [0.0, 0.0005, 0.01, 0.05, 0.5, 1.0][i % 6]
        old = torch.randn(numel, generator=g).to(torch.bfloat16)
        new = old.clone()
        bits_of(new)[torch.rand(numel, generator=g) < density] ^= 1 << (i % 15)
        pairs.append((old, new))
    batch = encode_many(pairs)
    kinds = set()
    for (old, new), enc in zip(pairs, batch):
        single = encode(old, new)
        assert (enc.kind, enc.changed) == (single.kind, single.changed)
        assert torch.equal(enc.payload, single.payload), enc.kind
        kinds.add(enc.kind)
    # every kind but INDICES, which GAPS beats wherever gaps take fewer than 4 bytes
    assert kinds == set(Kind) - {Kind.INDICES}, kinds
    # decoded in one pass, each onto a copy of its base: the new values, bases untouched
    olds = [old for old, _ in pairs]
    kept = [old.clone() for old in olds]
    news, errors = decode_many(batch, olds)
    assert not any(errors), [e for e in errors if e][:3]
    for (old, new), got, before in zip(pairs, news, kept):
        assert _bits_equal(got, new) and _bits_equal(old, before)


def test_one_bad_record_among_many_is_named_and_the_others_decode():
    """A GAPS record naming a position past its region, among many that fit: that one is
    refused with ``decode_into``'s message, every other decodes exactly."""
    g = torch.Generator().manual_seed(5)
    pairs = []
    for _ in range(50):
        old = torch.randn(300, generator=g).to(torch.bfloat16)
        new = old.clone()
        bits_of(new)[torch.rand(300, generator=g) < 0.01] ^= 1
        bits_of(new)[-1] ^= 1  # at least one change, the last element
        pairs.append((old, new))
    batch = encode_many(pairs)
    assert all(enc.kind == Kind.GAPS for enc in batch)
    bad = batch[7]
    # the last gap one larger: the last position falls one past the region
    payload = bad.payload.clone()
    payload[-1] += 1
    batch[7] = Encoded(bad.kind, bad.numel, bad.itemsize, bad.changed, payload)
    news, errors = decode_many(batch, [old for old, _ in pairs])
    assert news[7] is None and "outside [0, 300)" in errors[7], errors[7]
    for i, ((_, new), got) in enumerate(zip(pairs, news)):
        if i != 7:
            assert not errors[i] and _bits_equal(got, new), i
