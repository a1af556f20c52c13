"""An update that fails after writes began leaves the weights mixed: the engine says so and
refuses generation (instead of serving them silently) until an update succeeds.

On one node the real cause is a TP peer lost mid-update, which upstream SGLang answers by
killing the engine; the fault is injected instead (the ``fault_dir`` the engine fixture
gives its processes as ``SGLANG_TEST_FAULT_DIR``, see ``test/support/sitecustomize.py``):
each engine rank's executor writes its parameters, then raises.
"""

from __future__ import annotations

import pytest
from faults import TP, full_shards, generate, state, update
from update_cases import new_weights
from update_checks import expected_checksums

PROMPTS = [[5, 17, 42, 7]]


def _update(eng, update_id, model_dir, seed):
    from sglang.srt.weight_sync.protocol import make_channel

    return update(
        eng,
        make_channel(),
        update_id,
        [full_shards(new_weights(model_dir, seed))] * TP,
        timeout_s=60,
    )


def test_failure_after_writes_refuses_generation_until_an_update_succeeds(
    engine, fault_dir
):
    eng, model_dir, config = engine
    success, message, _ = _update(eng, "mixed-1", model_dir, 1)
    assert success, message
    for rank in range(TP):
        (fault_dir / f"fail_after_writes.rank{rank}").touch()
    success, message, _ = _update(eng, "mixed-2", model_dir, 2)
    assert success is False
    assert (
        "FAILED after writes began on engine rank" in message
        and "the weights are now MIXED" in message
    ), message
    assert "fault injected by the test" in message, message
    assert not list(fault_dir.iterdir()), "an engine rank did not reach its fault"
    with pytest.raises(
        ValueError,
        match=r"generation refused until a distributed weight update succeeds: "
        r"distributed weight update 'mixed-2': .*MIXED",
    ):
        generate(eng, PROMPTS)
    success, message, _ = _update(eng, "mixed-3", model_dir, 3)
    assert success, message
    assert state(eng) == expected_checksums(config, new_weights(model_dir, 3), TP, 1)
    assert len(generate(eng, PROMPTS)[0]) == 4, (
        "the engine does not serve again after a successful update"
    )
