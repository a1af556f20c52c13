"""Bit-exact resharding from trainer layouts to SGLang TP layouts over gloo ranks.

Each test starts one set of processes and runs several scenarios in it. Every
rank checks its parameters against SGLang's slicing of the full tensors, and
the parent checks bytes received against the lower bound (needed - held) and
the executor's staging peak against the bucket cap.
"""

import pytest
import torch
from ranks import run_ranks
from reshard_cases import (
    Scenario,
    disagreeing_plans,
    llama_tied,
    qwen2,
    qwen3_moe,
    run_all,
)


def check(scenarios, results):
    for i, s in enumerate(scenarios):
        per_rank = [r[i] for r in results]
        assert len({r["fingerprint"] for r in per_rank}) == 1, (
            f"{s}: ranks computed different plans"
        )
        for rank, r in enumerate(per_rank):
            assert r["received"] == r["lower_bound"] == r["planned"], (
                f"{s} rank {rank}: {r}"
            )
            assert r["peak"] <= r["bucket"], (
                f"{s} rank {rank}: staging {r['peak']} over cap {r['bucket']}"
            )
            assert r["peak"] <= 1.5 * r["largest_round"] or r["peak"] == 0, (
                f"{s} rank {rank}: {r}"
            )


def pairs(world):
    """Every (train TP, infer TP) pair from {1,2,4,8} x {1,2,4,8,16} that needs ``world`` GPUs."""
    return [
        (t, i) for t in (1, 2, 4, 8) for i in (1, 2, 4, 8, 16) if max(t, i) == world
    ]


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
def test_megatron_tp_pairs(world):
    scenarios = [Scenario(qwen2(), "megatron", t, i) for t, i in pairs(world)]
    check(scenarios, run_ranks(world, run_all, scenarios))


def test_dtensor_shard0_shard1_and_dtypes():
    scenarios = [
        Scenario(qwen2(), "dtensor0", 2, 4),
        Scenario(qwen2(), "dtensor1", 2, 4),
        Scenario(qwen2(), "dtensor1", 4, 2),
        Scenario(
            qwen2(),
            "dtensor0",
            4,
            4,
            train_dtype=torch.float32,
            engine_dtype=torch.bfloat16,
        ),
        Scenario(
            qwen2(),
            "dtensor0",
            2,
            4,
            train_dtype=torch.bfloat16,
            engine_dtype=torch.bfloat16,
        ),
        Scenario(
            qwen2(),
            "dtensor1",
            4,
            4,
            train_dtype=torch.float16,
            engine_dtype=torch.float16,
        ),
    ]
    check(scenarios, run_ranks(4, run_all, scenarios))


def test_fsdp2_shard0_over_8_to_tp2_and_hsdp_2x4_to_tp4():
    scenarios = [
        Scenario(qwen2(), "fsdp", 8, 2, world=8),
        Scenario(qwen2(), "hsdp", 4, 4, world=8, hsdp_shape=(2, 4)),
        Scenario(
            llama_tied(),
            "fsdp",
            8,
            8,
            world=8,
            train_dtype=torch.float32,
            engine_dtype=torch.bfloat16,
        ),
    ]
    check(scenarios, run_ranks(8, run_all, scenarios))


def test_fsdp2_over_tp_strided_shards_without_a_gather():
    """FSDP2 over a TP-parallel model on a (dp 2, tp 2) mesh: column-parallel tensors are
    (_StridedShard(0, sf=2), Shard(0)) DTensors, described from their placements and moved
    like any other; engines at TP 2 (covered by each dp row) and TP 4."""
    scenarios = [
        Scenario(qwen2(), "fsdp_tp", 2, 2, world=4),
        Scenario(qwen2(), "fsdp_tp", 2, 4),
        Scenario(
            llama_tied(),
            "fsdp_tp",
            2,
            4,
            train_dtype=torch.float32,
            engine_dtype=torch.bfloat16,
        ),
    ]
    check(scenarios, run_ranks(4, run_all, scenarios))


def test_gqa_two_kv_heads_vocab_padding_and_tied_embeddings():
    scenarios = [
        Scenario(llama_tied(), "megatron", 2, 4, world=8),
        Scenario(llama_tied(vocab_size=500), "megatron", 1, 8, world=8),
        Scenario(
            qwen2(num_attention_heads=8, hidden_size=64, vocab_size=500),
            "megatron",
            2,
            8,
        ),
    ]
    results = run_ranks(8, run_all, scenarios)
    check(scenarios, results)
    assert any(r[2]["broadcasts"] for r in results), (
        "replicated kv heads should travel by broadcast"
    )


@pytest.mark.parametrize("ep,train_tp", [(2, 2), (4, 4), (2, 4), (4, 2)])
def test_moe_experts_ep_and_moe_tp(ep, train_tp):
    scenarios = [Scenario(qwen3_moe(), "megatron", train_tp, 4, moe_ep=ep)]
    check(scenarios, run_ranks(4, run_all, scenarios))


def test_ranks_with_different_plans_refuse_together():
    messages = run_ranks(2, disagreeing_plans)
    assert all("ranks computed different plans" in m for m in messages), messages
