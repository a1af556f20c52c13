"""The weight-sync simulator on a small scenario: the planner meets the lower bound,
the baselines do not, and ``--json`` prints the documented records."""

import json

import pytest
import torch

from benchmark.weight_sync import (
    simulate,  # the repo root is on sys.path (test/conftest.py)
)

SMALL = "qwen3-8b-tp2-to-tp4"
REQUIRED_KEYS = {
    "scenario",
    "model",
    "ranks",
    "design",
    "bytes_received_max",
    "lower_bound_bytes_max",
    "peak_bytes_max",
    "plan_seconds",
    "modelled_seconds",
}


@pytest.fixture
def no_tensors(monkeypatch):
    """The simulator is metadata only: allocating a parameter-like tensor is a bug.
    (torch's own DTensor shard arithmetic, used by describe_mesh, builds small
    ``arange`` index tensors of one dim's length; those are left alone.)"""

    def boom(*args, **kwargs):
        raise AssertionError("the simulator allocated a tensor")

    for fn in (
        "empty",
        "zeros",
        "ones",
        "full",
        "rand",
        "randn",
        "empty_like",
        "zeros_like",
    ):
        monkeypatch.setattr(torch, fn, boom)


def _by_design(rows):
    return {r["design"]: r for r in rows}


def test_small_scenario_meets_lower_bound(no_tensors):
    rows = _by_design(simulate.run_scenario(simulate.get_scenario(SMALL)))
    assert set(rows) == set(simulate.DESIGNS)
    dist = rows["distributed"]
    assert dist["lower_bound_bytes_max"] > 0
    assert dist["bytes_received_max"] == dist["lower_bound_bytes_max"]
    assert 0 < dist["peak_bytes_max"] <= dist["bucket_bytes"]
    assert dist["plan_seconds"] > 0 and dist["modelled_seconds"] > 0
    for design in ("full_tensor", "rank0_funnel"):
        assert rows[design]["bytes_received_max"] > dist["bytes_received_max"], design
        assert rows[design]["modelled_seconds"] > dist["modelled_seconds"], design
        assert rows[design]["lower_bound_bytes_max"] == dist["lower_bound_bytes_max"]


def test_aligned_layouts_move_nothing():
    rows = _by_design(
        simulate.run_scenario(simulate.get_scenario("qwen3-8b-tp4-to-tp4"))
    )
    assert (
        rows["distributed"]["bytes_received_max"]
        == 0
        == rows["distributed"]["lower_bound_bytes_max"]
    )
    assert rows["full_tensor"]["bytes_received_max"] > 0


def test_json_output(capsys):
    assert simulate.main(["--json", "--scenario", SMALL]) == 0
    records = json.loads(capsys.readouterr().out)
    assert isinstance(records, list) and len(records) == len(simulate.DESIGNS)
    assert {r["design"] for r in records} == set(simulate.DESIGNS)
    for r in records:
        assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
        assert r["scenario"] == SMALL and r["model"] == "Qwen3-8B" and r["ranks"] == 4
    dist = _by_design(records)["distributed"]
    assert dist["bytes_received_max"] == dist["lower_bound_bytes_max"]
    assert _by_design(records)["full_tensor"]["plan_seconds"] is None


def test_default_scenarios_listed(capsys):
    assert simulate.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek-V3-671B" in out and "Qwen3-235B-A22B" in out and "Qwen3-8B" in out
    big = [s for s in simulate.SCENARIOS if s.model == "DeepSeek-V3-671B"]
    assert any(s.infer.size == 256 for s in big)


def test_trainer_side_plans_rank_by_rank_through_the_runtime_entry_point(monkeypatch):
    """Trainer-side scenarios call trainer_reshard.plan_to_engines once per rank and chunk,
    and say which ranks were timed; the whole-world baseline is timed on request."""
    from sglang.srt.weight_sync import trainer_reshard

    calls = []
    real = simulate.plan_to_engines
    monkeypatch.setattr(
        simulate, "plan_to_engines", lambda *a: calls.append(a[-1]) or real(*a)
    )
    rows = _by_design(
        simulate.run_scenario(
            simulate.get_scenario("qwen3-8b-fsdp8-to-tp2"), global_baseline=True
        )
    )
    dist = rows["distributed"]
    assert dist["mode"] == "trainer" and dist["metrics_ranks"] == "all"
    assert sorted(set(calls)) == list(range(8)) and set(
        dist["plan_seconds_by_rank"]
    ) == {str(r) for r in range(8)}
    assert dist["plan_seconds_per_rank"] == max(dist["plan_seconds_by_rank"].values())
    assert (
        dist["global_plan_seconds"] > 0
        and dist["bytes_received_max"] == dist["lower_bound_bytes_max"]
    )
    assert not hasattr(trainer_reshard, "_plans"), (
        "plans are cached per TrainerPlans, never process-wide"
    )
    assert simulate.sample_ranks(256) == [0, 128, 255]


def test_engine_side_plans_as_the_engine_runs_it(monkeypatch):
    """Engine-side scenarios time the plan an engine rank makes on its first update (its
    plan cache keyed with the manifest's fingerprint, its own local copies listed) and take
    their figures from the same plan with every rank's local copies."""
    calls = []
    real = simulate.PlanCache.get
    monkeypatch.setattr(
        simulate.PlanCache,
        "get",
        lambda self, *a, **k: calls.append(k) or real(self, *a, **k),
    )
    rows = _by_design(
        simulate.run_scenario(
            simulate.get_scenario("qwen3-8b-tp2-to-tp4"), global_baseline=True
        )
    )
    dist = rows["distributed"]
    assert dist["mode"] == "engine" and set(dist["plan_seconds_by_rank"]) == {"0", "4"}
    mine = [k for k in calls if k.get("local_ranks")]
    assert [k["local_ranks"] for k in mine] == [(0,), (4,)] and all(
        len(k["targets_digest"]) == 64 for k in mine
    )
    assert (
        dist["global_plan_seconds"] > 0
        and dist["bytes_received_max"] == dist["lower_bound_bytes_max"] > 0
    )


def test_dsv3_scenarios_in_the_default_run():
    names = {s.name for s in simulate.SCENARIOS}
    assert {"dsv3-fsdp256-to-8x32", "dsv3-tp8ep256-1024-to-32x32"} <= names
    assert any(s.gpus == 1024 for s in simulate.SCENARIOS)
