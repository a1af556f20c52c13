"""A trainer rank dies before delivery or mid-update (trainer-side resharding): the
surviving rank raises within the update's bound with a message naming the missing rank
and the phase, and the engine keeps serving consistent weights. A rank that dies after
delivery: ``test_outcome_agreement.py``.

Measured before this suite: a killed trainer rank made the survivor wait 121 s.
"""

from __future__ import annotations

import re

import pytest
from faults import TP, generate, run_trainers, state
from update_cases import new_weights
from update_checks import expected_checksums

TIMEOUT_S = 5.0  # the survivors wait up to it (the monitored barrier): the bound is what is tested
PROMPTS = [[5, 17, 42, 7]]

CASES = {
    # phase named in the survivor's error; the bound it must fail within
    "before_delivery": ("before the engine reads the payloads", TIMEOUT_S + 5),
    # pr: scale
    "mid_update": ("executor round", TIMEOUT_S + 5),  # trainer-side resharding
    # pr: scale end
}
# "after_delivery" (the engine may apply the update before the survivor finds its peer gone):
# test_outcome_agreement.py, which also checks that the survivor's error says what the engine did


@pytest.mark.parametrize("when", list(CASES))
def test_trainer_rank_dies(engine, when):
    eng, model_dir, config = engine
    phase, bound = CASES[when]
    survivors, left = run_trainers(
        eng, TP, dict(model_dir=model_dir, timeout_s=TIMEOUT_S, die_rank=1, when=when)
    )
    assert not left, (
        f"channel directories left after the survivor closed its channels: {left}"
    )
    assert list(survivors) == [0], f"only rank 0 survives, got {sorted(survivors)}"
    survivor = survivors[0]
    assert survivor["first"][0] is True, survivor["first"]
    assert survivor["elapsed"] < bound, (
        f"{when}: the survivor took {survivor['elapsed']:.1f}s (bound {bound}s)"
    )
    outcome = survivor["outcome"]
    assert outcome.startswith("PeerLost: ") and phase in outcome, outcome
    assert re.search(r"\b[Rr]anks? \[?1\b", outcome), (
        f"the missing rank is not named: {outcome}"
    )
    before = expected_checksums(config, new_weights(model_dir, 1), TP, 1)
    assert state(eng) == before, "a parameter changed"
    assert len(generate(eng, PROMPTS)[0]) == 4, "the engine no longer serves"
