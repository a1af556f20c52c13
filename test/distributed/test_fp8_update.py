"""Block-FP8 engine ranks updated from BF16 FSDP2 trainer ranks, without a gather.

Each 128 x 128 block is quantized where all its elements meet: at the sending rank when one
trainer shard holds it whole (e4m3 and scales on the wire, landed in place: ``fp8_wire``),
else on the receiving engine rank, which stages the BF16 pieces its plan brings and
quantizes them into the e4m3 weight and float32 ``weight_scale_inv`` (``fp8_targets``,
``apply.write_quantized``). Every parameter
must then equal SGLang's own load of the same weights quantized by the reference quantizer
(checksums of every parameter, e4m3 weights, scales, and the unquantized embeddings, norms
and biases). SGLang's CPU engine cannot load block FP8 (its post-load step asserts an AMX CPU
with sgl-kernel's CPU ops), so SGLang's own load is its model classes built on the CPU as
each engine rank, outside an engine (``fp8_cases``). Trainer shards cut 128-blocks at 3 ranks
(rows 86 and 172 of every 256-row tensor). Gathers are forbidden in every rank
(``ranks.run_ranks``); no rank keeps a full tensor after sharding.
"""

import pytest
import tiny_models
from fp8_cases import (
    DEEPSEEK,
    SPECS,
    engine_sync_rank,
    sglang_fp8_load,
    sglang_fp8_loads,
    update_rank,
    write_fp8_checkpoint,
)
from fp8_remote import remote_fp8_job
from fp8_sender_cases import sender_side_update
from ports import free_port
from ranks import run_ranks

# (trainer ranks = world, engine TP, batches of tensors): engine-side at world == TP (the
# engine's own step, ``fp8_wire.ColocatedFp8``); otherwise
# the trainer-side one hop as the runtime runs it (``fp8_sender_cases.trainer_side_rank``:
# rank k beside engine rank k % TP, sender-quantized blocks, regions to the engine); in 2 batches
# the fused parameters are filled by two updates, each quantizing only its own blocks
CASES = ((1, 1, 1), (2, 2, 1), (2, 1, 1), (3, 1, 1), (2, 2, 2), (3, 1, 2))
BUCKET = 1 << 16  # several rounds per update
# trainer-side cases whose rounds hold whole blocks: the per-rank planner (``rank_plan``)
# splits moves at windows of half the bucket, and a window edge inside a block leaves that
# block to the engine; at 1 GiB one window holds every tensor
WINDOW_HOLDS_BLOCKS = {(2, 1, 1): 1 << 30, (3, 1, 1): 1 << 30}


@pytest.fixture(scope="module", params=sorted(SPECS))
def checkpoints(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"fp8-{request.param}")
    spec = SPECS[request.param]
    bf16, _ = tiny_models.make_tiny_model(request.param, work / "bf16", seed=3, **spec)
    fp8 = write_fp8_checkpoint(bf16, work / "fp8")
    loads = sglang_fp8_load(fp8, bf16, [(1, 0), (2, 0), (2, 1)], work)
    return bf16, loads


def test_sglang_post_load_step_is_idempotent_on_block_fp8(checkpoints):
    """What an update runs after its writes (the model's post-load fixups, then each quant
    method's post-load step) leaves a loaded block-FP8 model's parameters as they were, in
    their storage: on this branch it may run once per update."""
    _, loads = checkpoints
    for key, load in loads.items():
        assert load["post_load_idempotent"], (key, load["post_load_changed"])


@pytest.mark.parametrize(
    "world,tp,batches", CASES, ids=[f"fsdp{w}-tp{t}-b{b}" for w, t, b in CASES]
)
def test_fp8_params_equal_sglang_load_of_reference_checkpoint(
    checkpoints, world, tp, batches
):
    bf16, loads = checkpoints
    bucket = WINDOW_HOLDS_BLOCKS.get((world, tp, batches), BUCKET)
    results = run_ranks(world, update_rank, tp, str(bf16), loads, bucket, batches)
    for rank, r in enumerate(results):
        # every e4m3 parameter (qkv, o, gate_up or the experts' w13, down or w2; 2 layers)
        assert r["quantized"] == r["fp8_live"] == 4 * 2, r
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        # only the FP8 KV-cache scales (constants of the quant config) are not written
        assert all(
            n.endswith(("attn.k_scale", "attn.v_scale")) for n in r["not_written"]
        ), r
        assert r["received"] == r["lower_bound"] == r["planned"], r
        if world == tp:
            # engine-side resharding (``fp8_wire.ColocatedFp8``): every block lies whole
            # in one trainer shard, so it travels e4m3 and scales from that engine rank
            # (or is quantized where it lies): the quantized lower bound counted block by
            # block, and no block left to quantize from staging
            assert r["peak"] <= BUCKET, r
            assert r["received"] == r["counted"], r
            assert r["blocks_quantized_here"] == 0 == r["fp8_staging_bytes"], r
            if world > 1:
                assert r["blocks_received_quantized"] > 0, r
                assert r["received"] < 0.6 * r["bf16_lower_bound"], r
            continue
        # trainer-side, one hop (``trainer_reshard``): the blocks a trainer rank holds whole
        # travel quantized between the trainer ranks and on to the engine rank, the rest
        # in bf16 regions (no parameter-shaped buffer of a block-FP8 weight)
        assert r["peak"] <= r["staging_bound"], r
        assert r["fp8_buffers"] == 0, r
        assert r["lower_bound"] <= r["bf16_lower_bound"], r
        assert r["handed_bound"] <= r["handed"] <= r["handed_bf16"], r
        if bucket == BUCKET:
            # windows of 32 KiB (64 rows of 256 bf16 columns) cut the blocks between
            # ranks: bf16 on the wire; a rank's own whole blocks that a window holds are
            # quantized there, the rest on the engine from bf16 regions
            assert r["staged_regions"] > 0, r
            assert r["received"] == r["bf16_lower_bound"], r
            continue
        assert r["handed"] == r["handed_bound"], r
        # some block lies whole on one trainer rank (none of the MoE's at 3 ranks: its
        # 256-row tensors are cut at rows 86 and 172)
        whole = r["handed_bound"] < r["handed_bf16"]
        assert (r["quantized_regions"] > 0) == whole, r
        if world == 2:  # every block whole on one trainer rank: e4m3 and scales only
            assert r["staged_regions"] == 0, r
            assert r["lower_bound"] < r["bf16_lower_bound"], r
            assert r["handed"] < 0.6 * r["handed_bf16"], r
        else:  # rows 86 and 172 cut blocks: both kinds travel where some lie whole
            assert r["staged_regions"] > 0, r


def test_engine_weight_sync_sends_whole_blocks_quantized(checkpoints, tmp_path):
    """``EngineWeightSync``'s own steps on 2 engine ranks of a block-FP8 engine (TP 2),
    each fed the ``Shard(0)`` chunk of the trainer rank beside it: every parameter equals
    SGLang's load of the reference checkpoint, each engine rank receives the cut plan's
    bound (e4m3 and scales for every block: each lies whole in one chunk) and stages no FP8
    weight in bf16; the cut is cached with the plan. A NaN in one trainer rank's chunk
    refuses the update on both engine ranks when they agree, naming the tensor, and no
    parameter changes."""
    bf16, loads = checkpoints
    channel = (
        tmp_path / "sglang-weights-fp8"
    )  # the engine tells the trainer its dtypes there
    channel.mkdir(mode=0o700)
    ok = run_ranks(2, engine_sync_rank, str(bf16), loads, str(channel))
    for rank, r in enumerate(ok):
        assert not r["problems"] and not r["differ"], (rank, r)
        assert r["figures"]["received"] == r["figures"]["lower_bound"] > 0, r
        assert r["staged"] == [] and r["cut_cached"], r
    poison = "model.layers.0.self_attn.o_proj.weight"
    refused = run_ranks(2, engine_sync_rank, str(bf16), loads, str(channel), poison)
    for r in refused:  # refused on both ranks, before any write
        assert r["changed"] == [] and poison in r["refusal"], r
    assert refused[0]["problems"] == [], refused[0]
    assert any(poison in p and "NaN" in p for p in refused[1]["problems"]), refused[1]


# block FP8 at engine TP 4 (a tiny Qwen3, head_dim apart from the hidden size): every TP split
# a multiple of 128 (q, k, v, gate and up rows, o and down columns: 512 / 4); FSDP 4 chunks of
# the 640-row o and down cut rows 160, 320 and 480, inside blocks (their first and last
# blocks lie whole on ranks 0 and 3), while every 512-row tensor's chunks are whole blocks
TP4_SPEC = dict(
    hidden_size=640,
    head_dim=64,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=512,
)


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    work = tmp_path_factory.mktemp("fp8-tp4")
    bf16, _ = tiny_models.make_tiny_model("qwen3", work / "bf16", seed=3, **TP4_SPEC)
    fp8 = write_fp8_checkpoint(bf16, work / "fp8")
    return bf16, sglang_fp8_load(fp8, bf16, [(4, r) for r in range(4)], work)


def test_fp8_engine_tp4_engine_side_with_blocks_cut_by_shards(tp4):
    """Engine TP 4 in block FP8, engine-side resharding from 4 FSDP2 ranks: both kinds
    travel, e4m3 and scales for the blocks one trainer shard holds whole, bf16 for the blocks
    the shards cut (quantized on the engine rank from staging); every parameter equals
    SGLang's load of the reference checkpoint, and the bytes received equal the quantized
    lower bound counted block by block."""
    bf16, loads = tp4
    results = run_ranks(4, update_rank, 4, str(bf16), loads, 1 << 30)
    for rank, r in enumerate(results):
        assert r["quantized"] == r["fp8_live"] == 4 * 2, r
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        assert r["received"] == r["lower_bound"] == r["counted"], r
        assert r["blocks_received_quantized"] > 0, r
        assert r["blocks_quantized_here"] > 0 and r["fp8_staging_bytes"] > 0, r
        assert r["received"] < r["bf16_lower_bound"], r


def test_fp8_engine_tp4_trainer_side_one_hop(tp4):
    """Engine TP 4 in block FP8 on the trainer-side one hop (``mode="trainer"``: 4 FSDP2 ranks
    plan over their world to the engine's published layout, ``trainer_side_rank``): the
    blocks a trainer shard holds whole travel e4m3 and scales between the trainer ranks and
    on to the engine rank, the blocks the shards cut (the 640-row tensors' at rows 160, 320
    and 480) as bf16 regions quantized on the engine rank; every parameter equals SGLang's
    load, and each engine rank is handed exactly the quantized lower bound."""
    from fp8_sender_cases import trainer_side_rank

    bf16, loads = tp4
    results = run_ranks(4, trainer_side_rank, 4, str(bf16), loads, 1 << 30, 1)
    for rank, r in enumerate(results):
        assert r["quantized"] == r["fp8_live"] == 4 * 2, r
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        assert r["received"] == r["lower_bound"] == r["planned"], r
        assert r["handed"] == r["handed_bound"] < r["handed_bf16"], r
        assert r["quantized_regions"] > 0 and r["staged_regions"] > 0, r
        assert r["fp8_buffers"] == 0, r


def test_fp8_engine_tp4_trainer_side_delta(tp4):
    """The trainer-side one hop into a block-FP8 engine of TP 4 with delta updates
    (``reshard_delta``): a full update, a delta to weights with a few elements changed on
    every trainer rank, a delta back; the engine rank's parameters garbage before each. The
    delta is taken after quantization (e4m3 bytes and scales against the blocks last sent,
    the cut blocks in bf16), and the last update's parameters equal SGLang's load, with
    each engine rank handed the quantized lower bound as before."""
    from fp8_sender_cases import trainer_side_rank

    bf16, loads = tp4
    results = run_ranks(4, trainer_side_rank, 4, str(bf16), loads, 1 << 30, 1, 0, True)
    for rank, r in enumerate(results):
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        assert r["handed"] == r["handed_bound"] < r["handed_bf16"], r
        assert r["quantized_regions"] > 0 and r["staged_regions"] > 0, r
        first, changed, back = r["deltas"]
        assert first["mode"] == "full", first
        assert first["bytes_received"] == first["full_bytes_received"] > 0, first
        for d in (changed, back):
            assert d["mode"] == "delta" and d["digest_checked"], d
            assert 0 < d["density"] < 0.05, d
            assert d["bytes_received"] <= 0.05 * d["full_bytes_received"], d
            assert d["regions"]["delta"] > 0, d


def test_megatron_into_fp8_engines_trainer_side_delta(checkpoints):
    """Megatron-core TP 2 x PP 2 (a real ``GPTModel``'s local parameters, fused buffers)
    into block-FP8 engines of TP 2 on the trainer-side one hop with delta updates, as
    ``test_fp8_engine_tp4_trainer_side_delta``: full, a delta, a delta back to the
    reference weights, after which every parameter equals SGLang's load."""
    from fp8_sender_cases import trainer_side_rank

    bf16, loads = checkpoints
    results = run_ranks(4, trainer_side_rank, 2, str(bf16), loads, 1 << 30, 1, 2, True)
    for rank, r in enumerate(results):
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        assert r["handed"] == r["handed_bound"] < r["handed_bf16"], r
        first, changed, back = r["deltas"]
        assert first["mode"] == "full", first
        for d in (changed, back):
            assert d["mode"] == "delta" and d["digest_checked"], d
            assert d["bytes_received"] <= 0.05 * d["full_bytes_received"], d


def test_fp8_engine_tp4_remote(tp4):
    """A remote block-FP8 engine of TP 4 in a weight-sync group with 2 trainer ranks (the
    640-row tensors cut at row 320, inside a block; every 512-row tensor's blocks whole on
    one rank): as ``test_remote_fp8_engines_equal_sglang_load``."""
    engines = (("e0", 4),)
    results = remote_update(tp4, 2, engines, ONE_WINDOW)
    check_remote_fp8(results, 2, engines, ONE_WINDOW, 4 * 2, False)


def test_megatron_into_fp8_engines(checkpoints):
    """Megatron-core (a real ``GPTModel``'s local parameters: fused ``linear_qkv`` and
    ``linear_fc1``, fp32) into block-FP8 engines of TP 2. At TP 2 x PP 1 engine-side, each
    engine rank resharding the fused buffers handed to it; at TP 2 x PP 2, one engine per
    two trainer ranks, on the trainer-side one hop (the ranks beside an engine lack the
    other stage's layers, as ``megatron_flow`` routes it). Every parameter equals SGLang's
    load of the reference checkpoint, the blocks a Megatron rank holds whole travel
    quantized, and each engine rank receives (engine-side) or is handed (trainer-side)
    exactly the quantized lower bound counted block by block."""
    bf16, loads = checkpoints
    for rank, r in enumerate(
        run_ranks(2, update_rank, 2, str(bf16), loads, BUCKET, 1, 1)
    ):
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        # aligned (Megatron TP = engine TP): every element is the rank's own, nothing is
        # received; o, gate, up and down blocks are quantized where they lie, q, k and v
        # (one piece per query group in ``linear_qkv``) meet in staging first
        assert r["received"] == r["lower_bound"] == r["counted"] == 0, r
        assert r["blocks_quantized_here"] == 3 * 2 * 2, r
    results = run_ranks(4, update_rank, 2, str(bf16), loads, 1 << 30, 1, 2)
    for rank, r in enumerate(results):
        assert r["quantized"] == r["fp8_live"] == 4 * 2, r
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        assert r["received"] == r["lower_bound"] == r["planned"], r
        assert r["handed"] == r["handed_bound"] < r["handed_bf16"], r
        assert r["quantized_regions"] > 0 and r["fp8_buffers"] == 0, r


def test_engine_end_on_sglang_live_fp8_model(checkpoints):
    """The engine end's own steps on SGLang's live FP8 model (TP 1): the targets derived from
    the unquantized twin pass the provenance check against the live FP8 loaders; nothing
    SGLang derived must be refused on this branch; a path that does not quantize refuses by
    name; scrambled weights and scales come back to SGLang's load, in their own storage,
    after SGLang's post-load step; and again through the trainer-side path's engine step,
    from parameter-shaped buffers and from regions (e4m3 and bf16), a region that does not
    match the plan refused by name."""
    _, loads = checkpoints
    e = loads[(1, 0)]["engine"]
    assert e["provenance"] == [] and e["refusals"] == [], e
    assert "block-FP8 parameter 'model.layers." in e["refused_elsewhere"], e
    assert e["quantized"] == 8 and not e["differ"] and not e["moved"], e
    assert e["derived_stale"] == e["derived_differ"] == [], e
    # trainer-side, one hop: the buffers the trainer planned, in two batches
    side = dict(e["trainer_side"])
    regions = side.pop("regions")
    # nothing these models derive from their weights goes stale (none derive any)
    assert side.pop("derived") == {"stale": [], "differ": []}, e
    assert side == {"problems": [], "differ": []}, side
    # and every block-FP8 weight in regions, e4m3 and bf16, no parameter-shaped buffer
    assert regions["kinds"] == ["e4m3", "staged"], regions
    assert not regions["problems"] and not regions["differ"], regions
    # a payload that does not match the plan is refused by name, before any write
    expected = {
        "block": "blocks (64, 64), the weight's are (128, 128)",
        "not_fp8": "not a block-FP8 weight this update fills",
        "overlap": "overlaps region 'fp8-region/0'",
        "missing": "no buffer for parameter",
        "size": "its tensor is",
    }
    for case, text in expected.items():
        found = regions["refused"][case]
        assert found and any(text in p for p in found), (case, found)


def test_engine_transform_of_other_ranks_equals_their_own(checkpoints):
    """An engine rank transforms every rank's targets (the plan needs them all) but sees only
    its own live parameters: what it infers for the others (same FP8 names, scales the block
    grid of their shard) must be what each rank finds from its own live parameters."""
    import torch

    from sglang.srt.weight_sync.derive.derived_targets import DerivedTargets
    from sglang.srt.weight_sync.fp8_targets import block_fp8_targets, engine_block_fp8
    from sglang.srt.weight_sync.target_layout import EngineParallel

    bf16, loads = checkpoints
    shapes = {n: tuple(t.shape) for n, t in tiny_models.load_checkpoint(bf16).items()}
    ranks = [loads[(2, r)] for r in range(2)]
    derived = DerivedTargets.of_ranks(
        EngineParallel(2), [x["derived"] for x in ranks], shapes, {}
    )
    for r, own in enumerate(ranks):
        live = {
            n: torch.empty(s, dtype=d, device="meta")
            for n, (s, d) in own["live"].items()
        }
        fp8 = engine_block_fp8(derived, live, r)
        assert not fp8.own.problems
        for k, other in enumerate(ranks):
            expected = block_fp8_targets(
                other["derived"].targets, other["live"], shapes
            )
            assert fp8.targets.for_rank(k) == list(expected.targets), (r, k)
        assert (
            fp8.own.quantized
            == block_fp8_targets(own["derived"].targets, own["live"], shapes).quantized
        )


# (trainer ranks, engines as (name, TP), bucket): remote engines in one weight-sync group. The
# blocks a trainer rank holds whole travel quantized (``fp8_wire``), the others in bf16 and meet
# in the engine's staging: at 2 trainer ranks every block lies whole on one; at 3 every
# 256-row tensor's shards cut 128-blocks (both kinds travel). At ONE_WINDOW no round boundary
# cuts a block; at REMOTE_BUCKET (windows of 512 KiB, the pause's writes streaming through
# staging smaller than the share) a window edge that cuts a block leaves it in bf16
REMOTE_BUCKET = 1 << 20  # the least bucket a remote update takes
ONE_WINDOW = 1 << 25  # a window larger than the model: one round per kind
REMOTE = (
    (2, (("e0", 1), ("e1", 2)), ONE_WINDOW),
    (3, (("e0", 2),), ONE_WINDOW),
    (3, (("e0", 2),), REMOTE_BUCKET),
)
REMOTE_STAGING = 1 << 18  # less than each rank's share: the pause's writes stream it in


@pytest.mark.parametrize(
    "trainers,engines,bucket",
    REMOTE,
    ids=[
        f"trainers{t}-" + "-".join(f"tp{n}" for _, n in e) + f"-{b >> 20}MiB"
        for t, e, b in REMOTE
    ],
)
def test_remote_fp8_engines_equal_sglang_load(checkpoints, trainers, engines, bucket):
    """Remote block-FP8 engines in a weight-sync group (``remote.engine``: receive into the
    engine's staging while serving, then the pause writes it): blocks lying whole on one
    trainer rank are quantized there and land as e4m3 and scales, the others' bf16 pieces are
    written into bf16 staging and quantized in place. Every parameter equals SGLang's load of
    the reference-quantized checkpoint; each rank received exactly what its plan says, which
    is the quantized lower bound counted block by block from the trainer's shards
    (``quantized_lower_bound``) where no round boundary cuts a block, and above it by the
    blocks a window edge cuts; the trainer sent what the engines received."""
    results = remote_update(checkpoints, trainers, engines, bucket)
    # at 2 trainer ranks every block lies whole on one
    check_remote_fp8(results, trainers, engines, bucket, 4 * 2, trainers == 2)


def remote_update(checkpoint, trainers: int, engines, bucket: int) -> list:
    """One update of remote block-FP8 engines ``engines`` ((name, TP) each) from ``trainers``
    ranks holding ``checkpoint``'s BF16 weights (``fp8_remote.remote_fp8_job``): every
    rank's figures, trainers first."""
    bf16, loads = checkpoint
    job = dict(
        port=free_port(),
        trainers=trainers,
        engines=[list(e) for e in engines],
        bucket=bucket,
        staging=REMOTE_STAGING,
    )
    world = trainers + sum(tp for _, tp in engines)
    return run_ranks(world, remote_fp8_job, job, str(bf16), loads, timeout=300)


def check_trainer_side_fp8(results, fp8_weights: int) -> None:
    """What every rank of a trainer-side one hop into block-FP8 engines (``update_rank`` or
    ``trainer_side_rank`` with more trainer ranks than engine TP) must find: each engine rank
    quantized its ``fp8_weights`` e4m3 weights, every parameter equals SGLang's load, only
    the FP8 KV-cache scales are not written, each rank received its plan's bound and staged
    at most the staging bound, and was handed exactly the quantized lower bound with both
    kinds (e4m3 regions and bf16 regions the engine quantizes), never an FP8 buffer."""
    for rank, r in enumerate(results):
        assert r["quantized"] == r["fp8_live"] == fp8_weights, r
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        assert all(n.endswith((".k_scale", ".v_scale")) for n in r["not_written"]), r
        assert r["received"] == r["lower_bound"] == r["planned"], r
        assert r["peak"] <= r["staging_bound"], r
        assert r["handed"] == r["handed_bound"] < r["handed_bf16"], r
        assert r["quantized_regions"] > 0 and r["staged_regions"] > 0, r
        assert r["fp8_buffers"] == 0, r


def check_remote_fp8(
    results, trainers: int, engines, bucket: int, fp8_weights: int, all_whole: bool
):
    """What every rank of a remote block-FP8 update (``fp8_remote.remote_fp8_job``) must
    find: each engine rank quantized its ``fp8_weights`` e4m3 weights, every parameter
    equals SGLang's load, only the FP8 KV-cache scales are not written, each rank received
    exactly its plan's bound, which is the quantized lower bound counted block by block
    where no round boundary cuts a block, and the trainer sent what the engines received.
    ``all_whole``: every block lies whole on one trainer rank (e4m3 and scales only)."""
    sent = sum(r["sent"] for r in results[:trainers])
    # what every trainer rank heard at join: each engine's block-FP8 weights over its TP
    # ranks (a delta report names them)
    quantized = iter(r["quantized"] for r in results[trainers:])
    heard = {name: sum(next(quantized) for _ in range(tp)) for name, tp in engines}
    assert all(heard.values()), heard
    for r in results[:trainers]:
        assert r["block_fp8"] == heard, (r["block_fp8"], heard)
    received = 0
    for rank, r in enumerate(results[trainers:], start=trainers):
        assert r["quantized"] == fp8_weights and r["released"], r
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        assert all(n.endswith((".k_scale", ".v_scale")) for n in r["not_written"]), r
        assert not r["unchanged"], r
        bf16_way = (
            r["staged_bytes"] + r["unquantized_bytes"]
        )  # every FP8 weight in bf16
        assert r["received"] == r["lower_bound"], r
        if bucket == ONE_WINDOW:
            assert r["received"] == r["quantized_bound"], r
        else:
            assert r["quantized_bound"] <= r["received"], r
            # the share streamed through staging smaller than it (a round, at most about
            # half a bucket, is admitted into empty staging whatever its size)
            assert r["staging_peak"] < r["received"], r
        fp8_in_bf16 = r["received"] - r["quantized_received"] - r["unquantized_bytes"]
        if all_whole:  # every block whole on one trainer rank
            assert r["blocks_at_sender"] > 0 and r["received"] < 0.6 * bf16_way, r
            if bucket == ONE_WINDOW:
                assert fp8_in_bf16 == 0, r
        elif (
            r["quantized_bound"] < bf16_way
        ):  # a shard holds some blocks whole: both kinds
            assert r["blocks_at_sender"] > 0 and fp8_in_bf16 > 0, r
        else:  # the MoE's 256-row tensors cut at 86 and 172: no block whole anywhere
            assert r["blocks_at_sender"] == 0 and r["received"] == bf16_way, r
        received += r["received"]
    assert sent == received, (sent, received)


# A DeepSeek-V3-shaped model in block FP8 (``fp8_cases.DEEPSEEK``: MLA, a dense first layer,
# 8 routed experts and a shared expert; 4 decoder layers), its shared expert a layer of its
# own (as SGLang builds it on CPU) or fused into the experts as a ninth (as on CUDA GPUs,
# ``num_fused_shared_experts``: ``enforce_shared_experts_fusion`` here). Its e4m3 weights:
# per layer the fused q_a + kv_a (``fused_qkv_a_proj_with_mqa``, 320 rows: kv_a's 192 end in
# a ragged block), q_b, kv_b and o; the dense layer's gate_up and down; each MoE layer's
# experts' w13 and w2, and the shared expert's gate_up and down where it is not fused
DEEPSEEK_VARIANTS = {
    "shared": ({}, 4 * 4 + 2 + 3 * 4),
    "fused_shared": ({"enforce_shared_experts_fusion": True}, 4 * 4 + 2 + 3 * 2),
}


@pytest.fixture(scope="module")
def deepseek_loads(tmp_path_factory):
    """The BF16 checkpoint and SGLang's loads at TP 1 and 2 of every variant (one worker)."""
    work = tmp_path_factory.mktemp("fp8-deepseek")
    bf16, _ = tiny_models.make_tiny_model(
        "deepseek_v3", work / "bf16", seed=3, **DEEPSEEK
    )
    fp8 = write_fp8_checkpoint(bf16, work / "fp8")
    cases = [(1, 0), (2, 0), (2, 1)]
    variants = {name: (args, cases) for name, (args, _) in DEEPSEEK_VARIANTS.items()}
    # expert parallelism: each of TP 2's ranks holds 4 whole experts (``moe_ep_size`` 2)
    variants["ep2"] = ({"moe_ep_size": 2}, [(2, 0), (2, 1)])
    return bf16, sglang_fp8_loads(fp8, bf16, work, variants)


@pytest.fixture(scope="module", params=sorted(DEEPSEEK_VARIANTS))
def deepseek(request, deepseek_loads):
    """(BF16 checkpoint, SGLang's loads at TP 1 and 2, e4m3 weights per engine rank)."""
    bf16, loads = deepseek_loads
    return bf16, loads[request.param], DEEPSEEK_VARIANTS[request.param][1]


def test_deepseek_v3_fp8_derived_state_equals_a_fresh_load(deepseek):
    """MLA derives ``w_kc``/``w_vc`` from ``kv_b_proj`` after loading (SGLang's
    ``post_load_weights``, which every update runs after its writes): on this branch from the
    block-FP8 weight and scales, requantized per tensor (``block_quant_to_tensor_quant``: e4m3
    ``w_kc``, ``w_vc`` and a float32 ``w_scale``). After an update that wrote the parameters
    in place over garbage (whose derived state SGLang had derived first, so a stale one shows)
    every derived tensor equals a fresh load's: through the engine end's own steps on SGLang's
    live FP8 model at TP 1 (engine-side, trainer-side from buffers and from regions), and at
    every rank of TP 1 and 2 after the loaded parameters are written back. ``w_kc`` and
    ``w_vc`` keep their storage; ``w_scale`` is a new tensor after each post-load step (SGLang
    assigns it), with the same bits."""
    _, loads, fp8_weights = deepseek
    mla = {
        f"model.layers.{i}.self_attn.{n}" for i in range(4) for n in ("w_kc", "w_vc")
    }
    scales = {f"model.layers.{i}.self_attn.w_scale" for i in range(4)}
    for key, load in loads.items():
        assert mla | scales <= set(load["computed"]), (key, load["computed"])
        assert load["post_load_idempotent"], (key, load["post_load_changed"])
        assert load["post_load_replaced"] == sorted(scales), key
        refresh = load["refresh"]
        assert mla | scales <= set(refresh["stale"]), (key, refresh)
        assert refresh["differ"] == [] and refresh["replaced"] == sorted(scales), key
    e = loads[(1, 0)]["engine"]
    assert e["provenance"] == [] and e["refusals"] == [], e
    assert e["quantized"] == fp8_weights and not e["differ"] and not e["moved"], e
    side, regions = e["trainer_side"], e["trainer_side"]["regions"]
    assert not side["problems"] and not side["differ"], side
    assert not regions["problems"] and not regions["differ"], regions
    for found in (
        {"stale": e["derived_stale"], "differ": e["derived_differ"]},
        side["derived"],
        regions["derived"],
    ):
        assert mla | scales <= set(found["stale"]) and found["differ"] == [], found


# (trainer ranks = world, engine TP): engine-side at TP 1 and 2 (FSDP2 chunks of the 128-row
# q_a and 192-row kv_a cut their blocks at TP 2: both kinds travel), the trainer-side one hop
# from 3 ranks (every 256-row tensor cut at rows 86 and 172)
DEEPSEEK_CASES = ((1, 1), (2, 2), (3, 1))


@pytest.mark.parametrize(
    "world,tp", DEEPSEEK_CASES, ids=[f"fsdp{w}-tp{t}" for w, t in DEEPSEEK_CASES]
)
def test_deepseek_v3_fp8_params_equal_sglang_load(deepseek, world, tp):
    """A DeepSeek-V3-shaped block-FP8 engine updated from BF16 FSDP2 ranks on the colocated
    paths: every parameter (e4m3 weights, scales, the unquantized router, its
    ``e_score_correction_bias``, norms and embeddings) equals SGLang's load of the
    reference-quantized checkpoint, and each engine rank receives exactly the quantized lower
    bound counted block by block from the trainer's shards (engine-side, rounds of a 64 KiB
    bucket, no rank staging more) or its plan's bound (trainer-side, one window: the
    per-rank planner's windows would cut blocks)."""
    bf16, loads, fp8_weights = deepseek
    bucket = BUCKET if world == tp else 1 << 30
    results = run_ranks(world, update_rank, tp, str(bf16), loads, bucket)
    if world != tp:  # trainer-side: both kinds reach the engine rank
        check_trainer_side_fp8(results, fp8_weights)
        return
    for rank, r in enumerate(results):
        assert r["quantized"] == r["fp8_live"] == fp8_weights, r
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        assert all(n.endswith((".k_scale", ".v_scale")) for n in r["not_written"]), r
        assert r["received"] == r["lower_bound"] == r["planned"], r
        assert r["received"] == r["counted"] and r["peak"] <= BUCKET, r
        if world == 2:
            assert r["blocks_received_quantized"] > 0, r
            assert r["blocks_quantized_here"] > 0 and r["fp8_staging_bytes"] > 0, r
            assert r["received"] < r["bf16_lower_bound"], r


def test_deepseek_v3_fp8_expert_parallel_engine_side(deepseek_loads):
    """The DeepSeek-V3-shaped block-FP8 engine at TP 2 with expert parallelism 2 (each rank
    holds 4 of the 8 routed experts whole, ``w13_weight`` (4, 512, 256)), engine-side from 2
    FSDP2 ranks: every parameter equals SGLang's load, and each rank receives exactly the
    quantized lower bound counted block by block."""
    bf16, loads = deepseek_loads
    loads = loads["ep2"]
    assert loads[(2, 0)]["live"]["model.layers.1.mlp.experts.w13_weight"][0] == (
        4,
        512,
        256,
    )
    for rank, r in enumerate(run_ranks(2, update_rank, 2, str(bf16), loads, BUCKET)):
        assert r["quantized"] == r["fp8_live"] == DEEPSEEK_VARIANTS["shared"][1], r
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        assert r["received"] == r["lower_bound"] == r["counted"] < r["bf16_lower_bound"]
        assert r["peak"] <= BUCKET, r


def test_deepseek_v3_fp8_expert_parallel_trainer_side_one_hop(deepseek_loads):
    """The DeepSeek-V3-shaped block-FP8 engine at TP 2 with expert parallelism 2 on the
    trainer-side one hop: 4 FSDP2 ranks, two such engines (rank k beside engine rank k % 2),
    each trainer rank planning over the world to the manifest of whole experts per rank. The
    chunks cut every 256-row tensor's blocks at rows 64 and 192 (the experts', o_proj, the
    dense and shared MLPs') and hold the 512-row q_b and kv_b's blocks whole: both kinds
    reach the engine rank. Every parameter equals SGLang's load, each engine rank receives
    its plan's bound and is handed exactly the quantized lower bound."""
    bf16, loads = deepseek_loads
    # the manifest publishes the engine's widths: (TP, attention TP, MoE EP)
    widths = loads["ep2"][(2, 0)]["parallel"]
    assert widths == (2, 2, 2), widths
    results = run_ranks(4, update_rank, 2, str(bf16), loads["ep2"], 1 << 30)
    check_trainer_side_fp8(results, DEEPSEEK_VARIANTS["shared"][1])


def test_deepseek_v3_fp8_expert_parallel_remote(deepseek_loads):
    """A remote DeepSeek-V3-shaped block-FP8 engine at TP 2 with expert parallelism 2 (4
    whole experts per rank) in a weight-sync group with 3 trainer ranks, whose chunks cut
    every 256-row tensor's blocks at rows 86 and 172 and hold the 512-row ones' first and
    last whole: as ``test_remote_fp8_engines_equal_sglang_load``."""
    bf16, loads = deepseek_loads
    engines = (("e0", 2),)
    results = remote_update((bf16, loads["ep2"]), 3, engines, ONE_WINDOW)
    check_remote_fp8(
        results, 3, engines, ONE_WINDOW, DEEPSEEK_VARIANTS["shared"][1], False
    )


def test_deepseek_v3_engine_weight_sync_stages_only_cut_blocks(deepseek, tmp_path):
    """``EngineWeightSync``'s own steps (``_validate``, ``_agree``, ``_write``) on 2 engine
    ranks of the DeepSeek-V3-shaped block-FP8 engine, each fed the ``Shard(0)`` chunk of the
    trainer rank beside it: every parameter equals SGLang's load, each rank receives the cut
    plan's bound, and only the fused ``q_a`` + ``kv_a`` (whose 128 and 192 rows the chunks
    cut at 64 and 96) is staged in bf16, in each of the 4 layers."""
    bf16, loads, _ = deepseek
    channel = tmp_path / "sglang-weights-fp8"
    channel.mkdir(mode=0o700)
    fused = [
        f"model.layers.{i}.self_attn.fused_qkv_a_proj_with_mqa.weight" for i in range(4)
    ]
    for rank, r in enumerate(
        run_ranks(2, engine_sync_rank, str(bf16), loads, str(channel))
    ):
        assert not r["problems"] and not r["differ"], (rank, r)
        assert r["figures"]["received"] == r["figures"]["lower_bound"] > 0, r
        assert r["staged"] == fused and r["cut_cached"], r


def test_deepseek_v3_remote_fp8_engines_equal_sglang_load(deepseek):
    """Remote DeepSeek-V3-shaped block-FP8 engines of TP 1 and 2 in one weight-sync group,
    from 3 trainer ranks whose shards cut 128-blocks: as ``test_remote_fp8_engines_equal_sglang_load``."""
    engines = (("e0", 1), ("e1", 2))
    results = remote_update(deepseek[:2], 3, engines, ONE_WINDOW)
    check_remote_fp8(results, 3, engines, ONE_WINDOW, deepseek[2], False)


# DeepSeek-V3-shaped at engine TP 4: ``DEEPSEEK`` with 8 heads (o_proj 512 columns, 128 per
# rank; q_b_proj and kv_b_proj 1024 rows, 256 per rank) and intermediate sizes of 512 (the
# dense layer's, each routed and the shared expert's: 128 rows of gate and up per rank), so
# that every TP split is a multiple of 128; ``DEEPSEEK``'s 4 heads of v_head_dim 64 would cut
# o_proj's blocks at 64 columns, which SGLang refuses. FSDP 4 chunks cut the 256-row tensors
# (o, down, the experts' down) and kv_a's 192 rows inside blocks; the TP-split 512- and
# 1024-row ones' chunks are each the blocks of the engine rank beside them, so q_lora_rank
# 512: q_a's chunks are whole blocks that every rank needs (the fused q_a + kv_a is
# replicated), which engine-side travel quantized between the ranks. Two layers, the dense
# one and one with routed and shared experts, keep it within ONE_WINDOW's 16 MiB windows
DEEPSEEK_TP4 = dict(
    DEEPSEEK,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=512,
    moe_intermediate_size=512,
    q_lora_rank=512,
    num_hidden_layers=2,
)
# its e4m3 weights per engine rank: each layer's fused q_a + kv_a, q_b, kv_b and o; the dense
# layer's gate_up and down; the MoE layer's w13 and w2 and its shared expert's gate_up and down
DEEPSEEK_TP4_FP8 = 2 * 4 + 2 + 4


@pytest.fixture(scope="module")
def deepseek_tp4(tmp_path_factory):
    """The BF16 checkpoint of ``DEEPSEEK_TP4`` and SGLang's loads at TP 4 (its shared expert
    a layer of its own, as SGLang builds it on CPU)."""
    work = tmp_path_factory.mktemp("fp8-deepseek-tp4")
    bf16, _ = tiny_models.make_tiny_model(
        "deepseek_v3", work / "bf16", seed=3, **DEEPSEEK_TP4
    )
    fp8 = write_fp8_checkpoint(bf16, work / "fp8")
    return bf16, sglang_fp8_load(fp8, bf16, [(4, r) for r in range(4)], work)


def test_deepseek_v3_fp8_engine_tp4_engine_side(deepseek_tp4):
    """The DeepSeek-V3-shaped block-FP8 engine at TP 4, engine-side resharding from 4 FSDP2
    ranks in rounds of a 64 KiB bucket: e4m3 and scales for the blocks one trainer shard
    holds whole, bf16 for the blocks the chunks cut (quantized on the engine rank from
    staging); every parameter equals SGLang's load of the reference checkpoint, and each
    rank receives exactly the quantized lower bound counted block by block."""
    bf16, loads = deepseek_tp4
    for rank, r in enumerate(run_ranks(4, update_rank, 4, str(bf16), loads, BUCKET)):
        assert r["quantized"] == r["fp8_live"] == DEEPSEEK_TP4_FP8, r
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        assert all(n.endswith((".k_scale", ".v_scale")) for n in r["not_written"]), r
        assert r["received"] == r["lower_bound"] == r["planned"] == r["counted"], r
        assert r["peak"] <= BUCKET, r
        assert r["blocks_received_quantized"] > 0, r
        assert r["blocks_quantized_here"] > 0 and r["fp8_staging_bytes"] > 0, r
        assert r["received"] < r["bf16_lower_bound"], r


def test_deepseek_v3_fp8_engine_tp4_trainer_side_one_hop(deepseek_tp4):
    """The DeepSeek-V3-shaped block-FP8 engine at TP 4 on the trainer-side one hop from 4
    FSDP2 ranks (``trainer_side_rank``): both kinds reach the engine rank (the 512- and
    1024-row tensors' blocks e4m3 and scales, the cut ones' as bf16 regions); every parameter
    equals SGLang's load, each engine rank receives its plan's bound and is handed exactly
    the quantized lower bound."""
    from fp8_sender_cases import trainer_side_rank

    bf16, loads = deepseek_tp4
    results = run_ranks(4, trainer_side_rank, 4, str(bf16), loads, 1 << 30, 1)
    check_trainer_side_fp8(results, DEEPSEEK_TP4_FP8)


def test_deepseek_v3_fp8_engine_tp4_remote(deepseek_tp4):
    """A remote DeepSeek-V3-shaped block-FP8 engine of TP 4 in a weight-sync group with 2
    trainer ranks (kv_a's 192 rows cut at row 96, inside a block; every other tensor's blocks
    whole on one rank): as ``test_remote_fp8_engines_equal_sglang_load``."""
    engines = (("e0", 4),)
    results = remote_update(deepseek_tp4, 2, engines, ONE_WINDOW)
    check_remote_fp8(results, 2, engines, ONE_WINDOW, DEEPSEEK_TP4_FP8, False)


REFUSED = {
    # derived state SGLang's post-load step cannot redo (``sglang_compat.update_refusals``)
    "amx": "model.layers.0.self_attn.qkv_proj: SGLang's CPU AMX post-load step packed",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_remote_fp8_engine_refuses_before_any_write(checkpoints, case):
    """What a remote FP8 engine cannot take is refused by name by every member of the
    group before a byte moves, and the engine keeps its old weights."""
    bf16, loads = checkpoints
    job = dict(
        port=free_port(),
        trainers=2,
        engines=[["e0", 1]],
        bucket=REMOTE_BUCKET,
        staging=REMOTE_STAGING,
        **{case: True},
    )
    results = run_ranks(3, remote_fp8_job, job, str(bf16), loads, timeout=300)
    for r in results:
        assert REFUSED[case] in r["error"], r
    assert results[2]["unchanged"], results[2]


# (trainer ranks, engine TP, bucket): at 2 ranks every block lies whole on one trainer rank;
# at 3 the 512-row tensors' first and last blocks do, the rest meet only in the engine's
# staging; a bucket of 96 KiB splits 256-column moves every 192 rows, inside blocks
SENDER = ((1, 1, 1 << 30), (2, 2, 1 << 30), (3, 1, 1 << 30), (3, 2, 1 << 30))
SPLIT = (2, 1, 3 << 15)


@pytest.mark.parametrize(
    "trainers,tp,bucket",
    SENDER + (SPLIT,),
    ids=[f"trainers{t}-tp{n}" for t, n, _ in SENDER] + ["trainers2-tp1-split"],
)
def test_blocks_quantized_at_the_sender_equal_sglang_load(
    checkpoints, trainers, tp, bucket
):
    """The plan cut by ``fp8_sender.sender_quantized``: blocks lying whole on one trainer
    rank are quantized there and land as e4m3 and scales, the others meet and are quantized
    in the engine rank's staging. Every parameter equals SGLang's load (the same bits as the
    engine-side way, which the tests above compare with the same load); each engine rank
    receives exactly the quantized lower bound, counted block by block."""
    bf16, loads = checkpoints
    out = sender_side_update(str(bf16), loads, trainers, tp, bucket)
    sent = out.pop("sent")
    assert sent == sum(r["received"] for r in out.values())
    for rank, r in out.items():
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
        if (
            trainers,
            tp,
            bucket,
        ) == SPLIT:  # a block the split cuts meets on the engine
            # (the Qwen2's 512-row tensors; the MoE's 128-row chunks are not split)
            assert r["lower_bound"] <= r["received"] < r["staged_bound"], r
            continue
        assert r["received"] == r["lower_bound"], r
        assert r["received"] <= r["staged_bound"], r
        # the plan quantizes at the sender every block ``fp8_targets.block_sites`` counts there
        assert r["blocks_at_sender"] == r["sites"].at_sender, r
        assert r["sites"].local == 0, r
        if trainers < 3:  # every block whole on one rank: e4m3 and scales on the wire
            assert r["blocks_at_sender"] > 0, r
            assert r["received"] < 0.6 * r["staged_bound"] + r["unquantized_received"]


# (kind, density): each update after the trainer changed that share of its elements. A delta
# update of the same weights as the full update after it must leave every parameter (e4m3
# weights, scales, unquantized tensors) as that full update writes it; densities as the
# bf16 cast sees after AdamW steps at lr 1e-6 and 1e-5 (results.md "Delta updates"), 3%,
# and 1.0: every element changed (every block's scale too)
DELTA_UPDATES = (
    ("full", 0.0),
    ("delta", 0.001),
    ("full", 0.0),
    ("delta", 0.01),
    ("full", 0.0),
    ("delta", 0.03),
    ("full", 0.0),
    ("delta", 1.0),
    ("full", 0.0),
)
# (trainer ranks, engines): at 2 every block lies whole on one trainer rank (all its delta
# is taken after quantization); at 3 both kinds travel (the pieces the engine quantizes
# from its staging, where a shard edge cuts a block, against the staging it kept); TP 1 and
# TP 2 engines of different layouts in one group
DELTA_CASES = ((2, (("e0", 1), ("e1", 2))), (3, (("e0", 1), ("e1", 2))))
# at 3 trainer ranks, after DELTA_UPDATES: a delta after every engine rank changed one
# element of the bf16 staging it kept (refused by the digest), then a full update, then a
# delta that must equal the full update after it (the full one rewrote the kept staging)
KEPT_CORRUPTION = (
    ("corrupt-kept", 0.01),
    ("full", 0.0),
    ("delta", 0.01),
    ("full", 0.0),
)


def _kept_corruption_refused_then_rewritten(tops, engines) -> None:
    """``KEPT_CORRUPTION``'s steps (after ``DELTA_UPDATES``'): each engine rank whose kept
    staging changed refuses the delta by its digest, naming the tensor, and writes
    nothing; the full update after it succeeds, and the delta after that equals the full
    update of the same weights, at about the density of the pieces' bytes."""
    at = len(DELTA_UPDATES)
    assert any(r["steps"][at]["corrupted"] for r in engines)
    for rank, r in enumerate(engines):
        refused = r["steps"][at]
        if refused["corrupted"]:
            assert "digest mismatch" in refused["error"], (rank, refused)
            assert "region" in refused["error"] and "model." in refused["error"]
            assert refused["unchanged"], (rank, "the refused update wrote parameters")
            assert refused["kept_bytes"] == 0, "a refused update left its base kept"
        full, delta, then = (r["steps"][at + k] for k in (1, 2, 3))
        assert "error" not in full and "error" not in delta, (rank, full, delta)
        assert delta["checksums"] == then["checksums"], rank
        assert delta["checksums"] != full["checksums"], rank
        assert (delta["kept_bytes"] > 0) == (full["kept_bytes"] > 0), rank
    figures = [t["steps"][at + 2]["figures"] for t in tops]
    staged = sum(f["sent_staged"] for f in figures)
    assert 0 < staged < 0.05 * sum(f["staged_full_bytes"] for f in figures), staged
    assert all(not t["steps"][at + 2]["why_full"] for t in tops)


@pytest.mark.parametrize(
    "trainers,engines",
    DELTA_CASES,
    ids=[f"trainers{t}-" + "-".join(f"tp{n}" for _, n in e) for t, e in DELTA_CASES],
)
def test_remote_fp8_delta_updates_equal_full_updates(checkpoints, trainers, engines):
    """Delta updates of remote block-FP8 engines of different layouts in one group
    (``delta_rounds``): the blocks a trainer rank quantizes travel as the bytes of their
    e4m3 values and scales that changed since the last delivery, the pieces an engine
    quantizes from its staging (shard edges inside blocks, at 3 trainer ranks) as their
    bf16 values that changed since, against the staging the engine kept
    (``KeptStaging``): about the density of their bytes, not whole. After each delta
    update every parameter of every engine rank equals what the full update of the same
    weights writes next, and the delta changed them (the first equals SGLang's load); the
    engines receive what the trainer sent, below the full update's bytes at low density,
    at most 1% above it at any. A kept staging changed behind the trainer's back refuses
    the next delta by its digest; the full update after it rewrites it."""
    bf16, loads = checkpoints
    job = dict(
        port=free_port(),
        trainers=trainers,
        engines=[list(e) for e in engines],
        bucket=ONE_WINDOW,
        staging=REMOTE_STAGING,
        updates=[list(u) for u in DELTA_UPDATES],
    )
    if trainers == 2:  # every block came quantized: a changed e4m3 byte has a digest
        job["updates"].append(["corrupt", 0.01])
    else:  # pieces quantized from staging: a changed kept bf16 element has a digest
        job["updates"] += [list(u) for u in KEPT_CORRUPTION]
    world = trainers + sum(tp for _, tp in engines)
    results = run_ranks(world, remote_fp8_job, job, str(bf16), loads, timeout=600)
    tops = results[:trainers]
    if trainers == 2:
        # each engine rank's base differs from what the trainer delivered: its receive
        # fails naming the tensor, and nothing landed, although the pause writes while
        # later rounds arrive (the staging holds less than the rank's share) and the
        # changed weight's blocks come in the last rounds: every base is checked first
        for rank, r in enumerate(results[trainers:], start=trainers):
            assert "digest mismatch" in r["error"], (rank, r["error"])
            assert "block-FP8 tensor 'model." in r["error"], (rank, r["error"])
            assert r["unchanged"], (rank, "the refused update wrote parameters")
            del r["error"], r["unchanged"]
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    if trainers == 3:
        _kept_corruption_refused_then_rewritten(tops, results[trainers:])
    rows = []
    staged_sent = 0
    for i, (kind, density) in enumerate(DELTA_UPDATES):
        figures = [t["steps"][i]["figures"] for t in tops]
        sent = sum(t["steps"][i]["sent"] for t in tops)
        got = [r["steps"][i] for r in results[trainers:]]
        assert sent == sum(g["received"] for g in got), (i, sent)
        wire = sum(f["wire_bytes"] for f in figures)
        full = sum(f["full_bytes"] for f in figures)
        assert wire == sent, (i, wire, sent)
        if kind == "full":
            assert wire == full, (i, wire, full)
            continue
        # each engine rank counted the records it decoded as the trainer counted them
        assert sum(g["wire_bytes"] for g in got) == wire, i
        assert sum(g["full_bytes"] for g in got) == full, i
        assert all(not t["steps"][i]["why_full"] for t in tops), i
        staged = sum(f["sent_staged"] for f in figures)
        staged_full = sum(f["staged_full_bytes"] for f in figures)
        staged_sent += staged
        for rank, r in enumerate(results[trainers:], start=trainers):
            after, then = r["steps"][i]["checksums"], r["steps"][i + 1]["checksums"]
            assert after == then, (
                f"update {i}: rank {rank}: a delta left "
                f"{sorted(n for n in after if after[n] != then[n])[:6]} unlike a full update"
            )
            earlier = r["steps"][i - 1]["checksums"]
            assert after != earlier, f"update {i}: rank {rank}: nothing changed"
        assert wire <= 1.01 * full, (i, wire, full)
        if density <= 0.03:  # most of a full update is not sent
            assert wire < 0.5 * full, (i, density, wire, full)
            # the pieces quantized from staging: their changed bf16 values and gaps, and
            # the records' headers (24 bytes a region with its digest)
            headers = 24 * sum(f["regions_staged"] for f in figures)
            assert staged <= 2 * density * staged_full + headers, (
                i,
                staged,
                staged_full,
            )
        rows.append(
            f"  density {density}: {wire} of {full} bytes (the pieces the engines "
            f"quantize from staging: {staged} of {staged_full}), per engine rank "
            f"{[(g['wire_bytes'], g['full_bytes']) for g in got]}"
        )
    for rank, r in enumerate(results[trainers:], start=trainers):
        assert not r["differ"], f"rank {rank}: differ from SGLang's load: {r['differ']}"
    # the pieces no trainer rank holds whole: at 2 ranks none, at 3 some
    assert (staged_sent > 0) == (trainers == 3), staged_sent
    # what the engines keep between updates: those pieces' bf16 bytes, no more
    kept = [r["steps"][0]["kept_bytes"] for r in results[trainers:]]
    assert sum(kept) == sum(t["steps"][0]["figures"]["staged_full_bytes"] for t in tops)
    rows.append(f"  kept bf16 staging per engine rank: {kept} bytes")
    print(f"FP8 delta, {trainers} trainer ranks -> TP 1 + TP 2:\n" + "\n".join(rows))
