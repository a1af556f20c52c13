"""The simulator's disaggregated scenarios (``benchmark.weight_sync.disaggregated``) on a
small case: Qwen3-8B, 8 Megatron trainer ranks -> 2 engines of TP4 on other nodes. Every
engine rank receives exactly its parameters' bytes (asserted inside ``run`` too), the
trainer ranks share the sending within 10%, and our modelled time beats rank-0 broadcast by
about the number of NICs at work."""

from benchmark.weight_sync.disaggregated import Disaggregated, run
from benchmark.weight_sync.simulate import InferLayout, TrainLayout
from sglang.srt.weight_sync.target_layout import EngineParallel


def test_small_disaggregated_scenario():
    scenario = Disaggregated(
        "qwen3-8b-8-to-2x4-remote",
        "Qwen3-8B",
        TrainLayout("megatron", 8, tp=2),
        InferLayout(EngineParallel(4), engines=2),
        anchors="",
    )
    r = run(scenario)
    assert r["received_per_engine_rank_max"] == r["lower_bound_per_engine_rank_max"]
    assert r["trainer_ranks_sending"] == 8 and r["sent_spread"] <= 1.1, r
    # every byte of both engines leaves some trainer rank once
    assert abs(
        r["sent_per_trainer_rank_mean"] * 8 - 2 * 4 * r["received_per_engine_rank_max"]
    ) <= (0.01 * r["sent_per_trainer_rank_mean"] * 8), r
    assert r["modelled_seconds"] < r["broadcast_modelled_seconds"] / 3, r
