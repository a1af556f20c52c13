"""Trainer-side resharding in one hop against real engines on CPU.

Several engines sit side by side on the trainer's ranks, and the shards beside one
engine do not cover what it needs, so the trainer ranks plan over the whole trainer
world straight to the layout each engine publishes, moving bytes in the engine's
dtype; the engines only copy. Per update: parameters bit-exact on every engine,
greedy generation equal to HF transformers, and each trainer rank's received bytes
(the runtime's counters) equal to the lower bound computed here from the layouts:
what the engine rank beside it needs minus what that trainer rank already holds.
"""

from __future__ import annotations

import json

import torch
from phase_checks import check_trainer_breakdown
from update_cases import hsdp_ranks, placements
from update_checks import check_update, run


def lower_bound(config, layout: str, world: int, tp: int, rank: int) -> int:
    """Bytes trainer ``rank`` must receive: the bf16 pieces of the engine rank beside it
    (engines on contiguous ranks) minus their intersection with this rank's shards."""
    from update_checks import model_targets_from_config

    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import EngineParallel

    targets = model_targets_from_config(config, EngineParallel(tp), torch.bfloat16)
    shapes = targets.tensor_shapes()
    mesh = hsdp_ranks(world) if layout == "hsdp" else list(range(world))
    total = 0
    for target in targets.for_rank(rank % tp):
        for piece in target.pieces:
            spec = MeshSpec(
                shapes[piece.tensor],
                torch.float32,
                mesh,
                placements(piece.tensor, layout),
            )
            held = spec.describe(piece.tensor).box_of(rank)
            overlap = held.intersect(piece.box) if held is not None else None
            total += (
                piece.box.numel - (overlap.numel if overlap else 0)
            ) * target.dtype.itemsize
    return total


def reports(tmp_path, world: int):
    out = {}
    for rank in range(world):
        for line in (
            (tmp_path / "reports" / f"rank{rank}.jsonl").read_text().splitlines()
        ):
            r = json.loads(line)
            out[(tuple(r["step"]), rank)] = r
    return out


def check_bytes(tmp_path, config, steps, world: int, tp: int):
    got = reports(tmp_path, world)
    for step in steps:
        for rank in range(world):
            r = got[(tuple(step), rank)]
            assert r["mode"] == "trainer", (
                f"{step}: resharding ran on the {r['mode']} side"
            )
            expected = lower_bound(config, step[1], world, tp, rank)
            assert r["bytes_received"] == expected, (
                f"{step}: trainer rank {rank} received {r['bytes_received']} bytes, lower bound {expected}"
            )
            assert r["lower_bound_bytes"] == expected
            assert expected > 0


def run_and_check(
    tmp_path, world: int, tp: int, steps, kind="qwen2", generate=True, **engine_kwargs
):
    """Every engine bit-exact (and generating as HF, with ``generate``) after every step;
    verl steps at the lower bound."""
    (tmp_path / "reports").mkdir()
    model_dir, config, prompts, engines = run(
        kind,
        tp,
        world,
        steps,
        tmp_path,
        generate=generate,
        reports_dir=str(tmp_path / "reports"),
        **engine_kwargs,
    )
    assert len(engines) == world // tp
    for records in engines:
        for record in records[1:]:
            check_update(record, model_dir, config, record["step"][2], tp, prompts)
    check_bytes(tmp_path, config, [s for s in steps if s[0] == "verl"], world, tp)


def test_four_trainer_ranks_to_two_engines_of_tp2(tmp_path):
    """FSDP Shard(0) over 4 ranks in fp32, HSDP 2 x 2 (replicas interleaved, so both DP
    replicas send) and training TP 4, each into two bf16 engines of TP 2 on contiguous
    ranks (engines shared by the three layouts)."""
    run_and_check(
        tmp_path, 4, 2, [("verl", "fsdp32", 1), ("verl", "hsdp", 2), ("verl", "tp", 3)]
    )
    described = [r["described"] for (step, _), r in reports(tmp_path, 4).items()]
    assert described.count(True) == 4, (
        "the engines' layout is asked for once per channel, on the first update"
    )
    for (step, rank), r in reports(tmp_path, 4).items():  # where every rank's time went
        check_trainer_breakdown(r["seconds"], r["phases"])


def test_fsdp2_to_two_engines_of_tp1_streams_a_model_larger_than_the_cap(tmp_path):
    """FSDP Shard(0) over 2 ranks, one TP-1 engine per rank: the shards beside one engine
    cover half of each tensor; also through ``weight_sync.utils.update_weights``. Each
    engine rank's model (~830 KiB bf16) is larger than the host's 160 KiB cap, so the
    update streams in chunks, and neither the executor's staging (fp32 -> bf16 casts
    included) nor the buffers held for the engine exceed the cap on any rank."""
    cap = 160 << 10
    steps = [("verl", "fsdp", 1), ("utils", "fsdp", 2), ("verl", "fsdp32", 3)]
    run_and_check(tmp_path, 2, 1, steps, weight_sync_bucket_bytes=cap)
    for (step, rank), r in reports(tmp_path, 2).items():
        assert r["chunks"] >= 5, (
            f"{step} rank {rank}: {r['chunks']} chunks for a model 5x the cap"
        )
        assert 0 < r["peak_buffer_bytes"] <= cap, (
            f"{step} rank {rank}: buffers {r['peak_buffer_bytes']} over the cap"
        )
        assert r["peak_staging_bytes"] <= cap, (
            f"{step} rank {rank}: staging {r['peak_staging_bytes']} over the cap"
        )
        if step[1] == "fsdp32":
            assert r["peak_staging_bytes"] > 0, (
                "an fp32 trainer's shards are cast in staging buffers"
            )


def test_qwen3_30b_a3b_tensor_count_to_two_engines_of_tp1(tmp_path):
    """Qwen3-30B-A3B's 18,432 expert tensors (metadata-like sizes) from FSDP Shard(0) over
    2 ranks into one TP-1 engine per rank: the engine's published layout and each trainer
    rank's "params" payload at a real MoE model's tensor count, at the lower bound."""
    run_and_check(
        tmp_path, 2, 1, [("verl", "fsdp", 1)], "qwen3_30b_a3b_count", generate=False
    )
