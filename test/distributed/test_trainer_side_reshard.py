"""Trainer-side resharding in one hop over gloo ranks, without engines, and the simulator's
model of it.

Four trainer ranks hold FSDP2 ``Shard(0)`` DTensors in fp32; two bf16 engines of TP 2
sit on ranks (0, 1) and (2, 3). ``reshard_to_engines`` fills each rank's buffers with
exactly its engine rank's parameters (bit-exact against SGLang's slicing), receiving
the lower bound, in one chunk or streamed in chunks under a small cap (staging and
buffers never over it). The simulator, given the same scenario, must report the bytes
the runtime moved.
"""

import torch
import torch.distributed as dist
from ranks import run_ranks

CONFIG = dict(
    model_type="qwen2",
    hidden_size=128,
    num_attention_heads=16,
    num_key_value_heads=2,
    vocab_size=1000,
    num_hidden_layers=2,
    intermediate_size=256,
    tie_word_embeddings=False,
)
GROUPS = ((0, 1), (2, 3))
SMALL_CAP = (
    144 << 10
)  # above the largest parameter (lm_head, 128 KiB per rank), ~1/4 of a rank's model


def _fsdp_sources(world: int):
    """The engines' manifest, the full fp32 weights, and this rank's ``Shard(0)`` sources
    and local tensors (by holder key)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from benchmark.weight_sync.hand_rules import model_targets_from_config
    from sglang.srt.weight_sync.manifest import EngineManifest
    from sglang.srt.weight_sync.target_layout import EngineParallel
    from sglang.srt.weight_sync.trainer_flow import prepare_shards

    targets = model_targets_from_config(CONFIG, EngineParallel(2), torch.bfloat16)
    manifest = EngineManifest.of(targets)
    mesh = init_device_mesh("cpu", (world,))
    full = {
        n: torch.randn(s, generator=torch.Generator().manual_seed(i))
        for i, (n, s) in enumerate(sorted(targets.tensor_shapes().items()))
    }
    shards = prepare_shards(
        [
            (n, distribute_tensor(t, mesh, (Shard(0),), src_data_rank=None))
            for n, t in full.items()
        ]
    )
    return (
        manifest,
        full,
        {n: spec.describe(n) for n, _, spec in shards},
        {n: t for n, t, _ in shards},
    )


def _one_hop(rank: int, world: int, bucket_bytes: int) -> dict:
    from benchmark.weight_sync.hand_rules import reference_param
    from sglang.srt.weight_sync.trainer_reshard import TrainerPlans, chunks

    manifest, full, sources, local = _fsdp_sources(world)
    out = dict(received=0, lower_bound=0, peak_staging=0, peak_buffers=0, chunks=0)
    plans = TrainerPlans()
    written = set()
    for part in chunks(manifest, list(full), bucket_bytes):
        result = plans.reshard_to_engines(
            sources, local, manifest, GROUPS, rank, bucket_bytes, part
        )
        for name, buf in result.buffers.items():
            want = next(t for t in manifest.ranks[rank % 2] if t.name == name)
            assert torch.equal(buf, reference_param(want, full)), (
                f"rank {rank}: {name} differs from SGLang's slicing"
            )
            written.add(name)
        out["chunks"] += 1
        out["received"] += result.stats.bytes_received
        out["lower_bound"] += result.lower_bound_bytes(rank)
        out["peak_staging"] = max(out["peak_staging"], result.stats.peak_staging_bytes)
        out["peak_buffers"] = max(
            out["peak_buffers"], sum(b.nbytes for b in result.buffers.values())
        )
        dist.barrier()
    assert written == {t.name for t in manifest.ranks[rank % 2]}, (
        f"rank {rank}: parameters left unwritten"
    )
    return out


def _independent_lower_bound(rank: int) -> int:
    """bf16 bytes the engine rank beside ``rank`` needs minus what its Shard(0) rows hold."""
    from torch.distributed.tensor import Shard

    from benchmark.weight_sync.hand_rules import model_targets_from_config
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import EngineParallel

    targets = model_targets_from_config(CONFIG, EngineParallel(2), torch.bfloat16)
    shapes, total = targets.tensor_shapes(), 0
    for t in targets.for_rank(rank % 2):
        for p in t.pieces:
            held = (
                MeshSpec(shapes[p.tensor], torch.float32, [0, 1, 2, 3], (Shard(0),))
                .describe(p.tensor)
                .box_of(rank)
            )
            overlap = held.intersect(p.box)
            total += (p.box.numel - (overlap.numel if overlap else 0)) * 2
    return total


def test_fsdp4_fp32_to_two_bf16_engines_of_tp2_in_one_hop_and_streamed():
    whole = run_ranks(4, _one_hop, 1 << 30)
    streamed = run_ranks(4, _one_hop, SMALL_CAP)
    for rank in range(4):
        expected = _independent_lower_bound(rank)
        for r in (whole[rank], streamed[rank]):
            assert r["received"] == r["lower_bound"] == expected, (
                f"rank {rank}: {r}, lower bound {expected}"
            )
        assert whole[rank]["chunks"] == 1 and streamed[rank]["chunks"] > 3
        assert (
            0 < streamed[rank]["peak_staging"] <= SMALL_CAP
            and streamed[rank]["peak_buffers"] <= SMALL_CAP
        )


def _wrong_shard_on_rank_1(rank: int, world: int) -> dict:
    """Every rank agrees on its inputs (``trainer_flow.agree_on_inputs``) with rank 1's
    first tensor delivered with a wrong shape; then again with the right one, and the
    update runs."""
    import time

    from sglang.srt.weight_sync.control_plane import GroupRefusal
    from sglang.srt.weight_sync.phase_timing import PhaseClock
    from sglang.srt.weight_sync.trainer_flow import TrainerSync, agree_on_inputs

    manifest, _, sources, local = _fsdp_sources(world)
    sync, name = TrainerSync(), sorted(local)[0]
    wrong = dict(local)
    if rank == 1:
        wrong[name] = local[name][:-1]
    out = dict(name=name)
    started = time.monotonic()
    try:
        agree_on_inputs(
            sync, sources, wrong, manifest, GROUPS, 1 << 30, 30, PhaseClock()
        )
        out["first"] = "agreed"
    except GroupRefusal as e:
        out["first"] = f"GroupRefusal: {e}"
    out["seconds"] = time.monotonic() - started
    parts = agree_on_inputs(
        sync, sources, local, manifest, GROUPS, 1 << 30, 30, PhaseClock()
    )
    result = sync.plans.reshard_to_engines(
        sources, local, manifest, GROUPS, rank, 1 << 30, parts[0], 30, checked=True
    )
    out["second"] = result.stats.bytes_received == result.lower_bound_bytes(rank)
    dist.barrier()
    return out


def test_a_wrong_shard_on_one_trainer_rank_is_a_refusal_on_every_rank():
    """A shard of the wrong shape on trainer rank 1 is found before the trainer ranks agree
    to the update: every rank raises the same ``GroupRefusal`` naming the tensor and the
    rank at once (no rank left waiting in a round for ``PeerLost``), and the next update,
    with the right shard, runs."""
    for rank, r in enumerate(run_ranks(4, _wrong_shard_on_rank_1)):
        message = r["first"]
        assert message.startswith("GroupRefusal"), (rank, message)
        assert "trainer rank 1" in message and repr(r["name"]) in message, message
        assert "shape" in message and "PeerLost" not in message, message
        assert r["seconds"] < 15, (rank, r)
        assert r["second"], rank


# pr: here
def test_simulator_reports_the_bytes_the_runtime_moves(monkeypatch):
    """One code path: the simulator plans with the shipped planner over the same layouts."""
    from benchmark.weight_sync import models, simulate
    from benchmark.weight_sync.hand_rules import model_targets_from_config
    from sglang.srt.weight_sync.target_layout import EngineParallel

    monkeypatch.setitem(
        models.MODELS,
        "tiny-qwen2",
        models.ModelSpec("tiny-qwen2", "", CONFIG, model_targets_from_config),
    )
    scenario = simulate.Scenario(
        "tiny-fsdp4-to-2x2",
        "tiny-qwen2",
        simulate.TrainLayout("fsdp", 4, dtype=torch.float32),
        simulate.InferLayout(EngineParallel(2), engines=2),
    )
    row = next(
        r for r in simulate.run_scenario(scenario) if r["design"] == "distributed"
    )
    runtime = run_ranks(4, _one_hop, simulate.DEFAULT_BUCKET_BYTES)
    assert row["mode"] == "trainer"
    assert row["bytes_received_max"] == max(r["received"] for r in runtime)
    assert row["lower_bound_bytes_max"] == max(r["lower_bound"] for r in runtime)


# pr: here end
