"""Control collectives over the groups GPU trainers hand us (backends naming NCCL)."""

from control_cases import (
    NCCL_BACKENDS,
    barrier_names_absent_rank,
    control_over_nccl_backends,
    delivered_names,
    one_round_trip_agreement,
)
from ranks import run_ranks


def test_control_group_runs_on_gloo_of_its_own_over_nccl_groups():
    results = run_ranks(3, control_over_nccl_backends)
    for rank, out in enumerate(results):
        for backend in NCCL_BACKENDS:
            r = out[backend]
            assert r["own_gloo_group"], f"rank {rank} {backend}: {r}"
            assert r["ranks"] == (0, 1, 2) and r["device"] == "cpu", r
            assert r["agree"] is True and r["disagree"] is False, r
            assert r["any"] is True, r


def test_barrier_over_nccl_group_names_the_absent_rank():
    results = run_ranks(3, barrier_names_absent_rank)
    assert results[2] == "absent"
    for message in results[:2]:
        assert "test barrier" in message and "[2]" in message, message


def test_tensors_only_some_trainer_ranks_delivered_are_named_on_every_rank():
    results = run_ranks(3, delivered_names)
    for rank, out in enumerate(results):
        assert out["same"] == "agreed", out
        message = out["differ"]
        assert message.startswith(
            f"rank {rank}: the trainer ranks delivered different tensors"
        ), message
        assert (
            "tensor 'b' was delivered by trainer rank(s) [0, 1] but not by trainer rank(s) [2]"
            in message
        ), message
        assert (
            "tensor 'z' was delivered by trainer rank(s) [0] but not by trainer rank(s) [1, 2]"
            in message
        ), message


def test_ranks_agree_in_one_round_trip_and_share_problems_only_when_there_are_some():
    results = run_ranks(3, one_round_trip_agreement)
    for r in results:
        assert r["quiet"] == ([], ["mine"], ["last"]) and r["quiet_trips"] == 1
        assert r["loud"] == (["rank 1 is unwell"], []) and r["loud_trips"] == 2
