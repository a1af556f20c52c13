"""A remote engine rank's staging checks each round's regions for NaN/inf as they land, in
the receiving thread while the engine serves, so that the pause holds only the writes
(``remote_engine.Staging``); the apply step refuses what it flagged before any write."""

import torch

from sglang.srt.weight_sync.executor import Landing
from sglang.srt.weight_sync.remote_engine import Staging


def _landing(*values) -> Landing:
    return Landing(torch.tensor(values, dtype=torch.bfloat16), None, ())


def test_staging_flags_a_round_holding_nan_or_inf_as_it_lands():
    for bad in (float("nan"), float("inf"), -float("inf")):
        staging = Staging(1 << 20, 5.0, "engine rank 0")
        staging.landed([_landing(1.0, 2.0), _landing(3.0)])
        assert not staging.nonfinite
        staging.landed([_landing(4.0), _landing(5.0, bad)])
        assert staging.nonfinite, bad
        staging.landed([_landing(6.0)])  # a later finite round does not clear it
        assert staging.nonfinite
        assert staging.held == 7 * 2 and len(staging.take(1.0)) == 5
    integer = Staging(1 << 20, 5.0, "engine rank 0")
    integer.landed([Landing(torch.tensor([1, 2]), None, ())])
    assert not integer.nonfinite
