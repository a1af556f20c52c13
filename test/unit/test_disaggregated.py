"""The simulator's disaggregated scenarios (``benchmark.weight_sync.disaggregated``) on a
small case: Qwen3-8B, 8 Megatron trainer ranks -> 2 engines of TP4 on other nodes. Every
engine rank receives exactly its parameters' bytes (asserted inside ``run`` too), the
trainer ranks share the sending within 10%, and our modelled time beats rank-0 broadcast by
about the number of NICs at work. With delta updates (``delta_model``), at each density the
codec's bytes are a small multiple of the changed values' and the modelled bytes and
seconds are the full update's scaled by that fraction."""

import pytest

from benchmark.weight_sync.delta_model import DENSITIES, model_rows, wire_fraction
from benchmark.weight_sync.disaggregated import Disaggregated, run
from benchmark.weight_sync.simulate import InferLayout, TrainLayout
from sglang.srt.weight_sync.target_layout import EngineParallel


def _small() -> Disaggregated:
    return Disaggregated(
        "qwen3-8b-8-to-2x4-remote",
        "Qwen3-8B",
        TrainLayout("megatron", 8, tp=2),
        InferLayout(EngineParallel(4), engines=2),
        anchors="",
    )


def test_small_disaggregated_scenario():
    r = run(_small())
    assert r["received_per_engine_rank_max"] == r["lower_bound_per_engine_rank_max"]
    assert r["trainer_ranks_sending"] == 8 and r["sent_spread"] <= 1.1, r
    # every byte of both engines leaves some trainer rank once
    assert abs(
        r["sent_per_trainer_rank_mean"] * 8 - 2 * 4 * r["received_per_engine_rank_max"]
    ) <= (0.01 * r["sent_per_trainer_rank_mean"] * 8), r
    assert r["modelled_seconds"] < r["broadcast_modelled_seconds"] / 3, r


@pytest.mark.parametrize("density", [0.0, 0.001, 0.01, 0.03, 0.5])
def test_wire_fraction_follows_the_density(density):
    fraction = wire_fraction(density, numel=1 << 16)
    assert fraction <= 1.0
    if density:
        # every changed value is sent (2 bytes), with at most 3 more bytes for its position
        # (a gap below 2**21), and the payload's size
        assert 0.8 * density <= fraction <= 2.6 * density, fraction
    else:
        assert fraction == 0.0


def test_small_scenario_modelled_with_deltas():
    [row] = model_rows([_small()])
    assert [d["density"] for d in row["deltas"]] == [d.density for d in DENSITIES]
    for d in row["deltas"]:
        f = d["wire_fraction"]
        assert 0 < f < 0.05, d
        assert d["received_per_engine_rank"] == row["received_per_engine_rank_max"] * f
        assert d["modelled_seconds"] == pytest.approx(row["modelled_seconds"] * f)
