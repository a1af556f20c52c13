"""A loader permutation the derived targets do not know is refused before any write.

A fresh engine (the provenance check runs on the first update with its derived targets)
whose rank 1 sees SGLang's ``gate_up_proj`` loaders swap gate and up during the check
(``SGLANG_TEST_FAULT_DIR``, ``test/support/sitecustomize.py``): a shape-preserving
permutation that a shape check cannot see. The update must be refused on every rank,
naming the parameter and the first differing element, with every parameter as it was and
the old weights serving; the outcome is kept for those derived targets, so the next
update is refused the same way without running the check again.
"""

from __future__ import annotations

from faults import TP, full_shards, generate, running_engine, state, update
from update_cases import new_weights

PROMPTS = [[5, 17, 42, 7]]


def _update(eng, update_id, model_dir, seed):
    from sglang.srt.weight_sync.protocol import REFUSED, make_channel

    success, message, _ = update(
        eng,
        make_channel(),
        update_id,
        [full_shards(new_weights(model_dir, seed))] * TP,
        timeout_s=60,
    )
    return success, message, REFUSED


def test_a_permuting_loader_refuses_the_first_update_before_any_write(tmp_path):
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "permute_gate_up.rank1").touch()
    with running_engine(tmp_path / "model", faults) as (eng, model_dir, _):
        before, served = state(eng), generate(eng, PROMPTS)
        success, message, refused = _update(eng, "permuted-1", model_dir, 1)
        assert success is False and message.startswith(refused), message
        assert (
            "engine rank 1: parameter 'model.layers.0.mlp.gate_up_proj.weight' "
            "(checkpoint tensor 'model.layers.0.mlp.gate_proj.weight')" in message
        ), message
        assert (
            "the targets place model.layers.0.mlp.gate_proj.weight[128, 0], "
            "the loader placed model.layers.0.mlp.up_proj.weight[128, 0]" in message
        ), message
        assert not list(faults.iterdir()), "engine rank 1 did not run the check"
        assert state(eng) == before, "a parameter changed"
        assert generate(eng, PROMPTS) == served
        # the same derived targets: the kept outcome, no second check (the plant is gone)
        success, again, _ = _update(eng, "permuted-2", model_dir, 2)
        assert success is False and "gate_up_proj" in again, again
        assert state(eng) == before
