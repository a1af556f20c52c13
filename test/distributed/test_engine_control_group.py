"""The engine's control group after a wait on it failed: every TP rank loses it in the same
update and makes a new one at the next (``EngineWeightSync.renew_control``), never touching
SGLang's own TP group."""

from outcome_cases import engine_control_after_a_lost_wait
from ranks import run_ranks


def test_a_control_group_lost_on_one_rank_is_lost_on_all_and_made_anew():
    first, late = run_ranks(2, engine_control_after_a_lost_wait)
    for r in (first, late):
        assert r["own"] and r["warm"] is True, r
        assert r["lost"] and r["renewed"] and r["agree"] is True, r
        assert (r["name"], r["renamed"]) == ("engine-0", "engine-1"), r
    assert first["vote"].startswith("vote: a peer did not answer within 1s"), first
    assert first["end"] == (False, "failed") and first["end_s"] < 3.0, (
        "the rank that gave up skips the closing barrier"
    )
    assert late["vote"] is True, (
        "gloo completed the vote given up: why a lost vote is MIXED"
    )
    success, message = late["end"]
    assert success is False and "at the end of the update" in message, late
    assert "never reached it" in message, message
