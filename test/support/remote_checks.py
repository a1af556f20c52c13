"""Checks of remote engines after an update, shared by the remote-engine e2e tests: each
server's parameters bit-exact (``update_checks.expected_checksums``) and its greedy
generation HF's on prompts with no bf16 near-tie (``prompts_for``)."""

from __future__ import annotations

from engine import hf_greedy, stable_prompts
from update_cases import MAX_NEW, new_weights
from update_checks import expected_checksums

__all__ = ["TP", "check_state", "prompts_for"]

TP = 2


def prompts_for(model_dir, seed):
    return stable_prompts([(model_dir, new_weights(model_dir, seed))], 2, MAX_NEW)


def check_state(states, model_dir, config, seed, prompts, what, tp=TP):
    """Every server's parameters bit-exact (``states``: ``remote_cases.server_state``), its
    greedy generation HF's."""
    weights = new_weights(model_dir, seed)
    expected = expected_checksums(config, weights, tp, 1)
    reference = hf_greedy(model_dir, prompts, MAX_NEW, weights=weights)
    for i, state in enumerate(states):
        got = state["checksums"]
        for r in range(tp):
            wrong = sorted(n for n in expected[r] if got[r][n] != expected[r][n])
            assert not wrong, (
                f"{what}: server {i} rank {r} differs from SGLang's slicing: {wrong[:5]}"
            )
        assert state["generation"] == reference, f"{what}: server {i} generation"
