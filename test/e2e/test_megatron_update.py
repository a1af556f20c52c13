"""A real megatron-core GPTModel (CPU, gloo) updates a real SGLang CPU engine, no gather.

Trainer ranks hold a Qwen2-shaped ``GPTModel`` (local spec, padded vocab) at
Megatron TP x PP, loaded with "trained" weights from the tiny HF checkpoint; its
forward must equal HF's logits. Then ``megatron_flow`` updates the engines: where
the ranks beside an engine hold everything it needs, each engine rank gets the local
parameters beside it (fused ``linear_qkv`` and ``linear_fc1`` as they are); else
(PP 2, EP 2, an engine narrower than Megatron's TP) the trainer ranks move the
bytes in one hop straight to the engine's published layout. The engine's
parameters must equal SGLang's slicing of the weights bit for bit, its greedy
generation must equal HF's, and no ``full_tensor`` / ``gather_object`` /
``all_gather_object`` may run.

Bytes: every rank receives exactly the one-hop bound, computed by the test from
megatron-core's own pieces straight to SGLang's layout (what the engine rank lacks
from the trainer ranks' own parameters, in the engine's dtype): engine-side, the
engine ranks' reply figures; trainer-side, each trainer rank's report.
"""

from __future__ import annotations

import pytest
import tiny_models
from engine import hf_greedy, stable_prompts
from megatron_cases import megatron_job
from ranks import run_ranks
from update_cases import MAX_NEW, new_weights
from update_checks import expected_checksums

SEED = 7


@pytest.mark.parametrize(
    "tp,pp,engine_tp,padded_vocab",
    [(2, 1, 2, 520), (2, 1, 1, 512), (2, 2, 2, 520), (2, 2, 1, 512)],
)
def test_megatron_gpt_updates_engine(tp, pp, engine_tp, padded_vocab, tmp_path):
    check_megatron_update("qwen2", tp, pp, 1, engine_tp, padded_vocab, tmp_path)


@pytest.mark.parametrize("engine_tp", [2, 1])
def test_megatron_moe_ep2_updates_engine(engine_tp, tmp_path):
    """Qwen3-MoE-shaped GPTModel (SequentialMLP experts) at EP 2: each rank holds half the
    experts; an engine at TP 1 lacks the other half (moved on the trainer side first)."""
    check_megatron_update("qwen3_moe", 1, 1, 2, engine_tp, 512, tmp_path)


def check_megatron_update(kind, tp, pp, ep, engine_tp, padded_vocab, tmp_path):
    world = tp * pp * max(ep // tp, 1)
    model_dir, config = tiny_models.make_tiny_model(kind, tmp_path / kind)
    weights = new_weights(model_dir, SEED)
    prompts = stable_prompts([(model_dir, weights)], 3, MAX_NEW)
    forbidden_log = tmp_path / "forbidden-calls"
    forbidden_log.mkdir()
    job = dict(
        kind=kind,
        model_dir=model_dir,
        tp=tp,
        pp=pp,
        ep=ep,
        engine_tp=engine_tp,
        padded_vocab=padded_vocab,
        seed=SEED,
        prompts=prompts,
        forbidden_log=str(forbidden_log),
    )
    records = run_ranks(world, megatron_job, job, timeout=900)
    reference = hf_greedy(model_dir, prompts, MAX_NEW, weights=weights)
    expected = expected_checksums(config, weights, engine_tp, 1)
    for rank, record in enumerate(records):
        if record["forward_max_diff"] is not None:
            assert record["forward_max_diff"] < 1e-4, (
                f"rank {rank}: megatron-core logits differ from HF's"
            )
        assert record["success"], f"rank {rank}: {record['message']}"
        assert record["message"] == "Success", record["message"]
        assert record["forbidden_calls"] == 0, (
            f"rank {rank}: full_tensor/gather_object called during the update"
        )
        assert record["generation"] == reference, (
            f"rank {rank}: generation differs from HF transformers"
        )
        if record["leader"]:
            wrong = sorted(
                n
                for r in expected
                for n in expected[r]
                if record["checksums"][r][n] != expected[r][n]
            )
            assert not wrong, (
                f"engine of rank {rank}: parameters differ from SGLang's slicing: {wrong[:5]}"
            )
    assert sum(r["forward_max_diff"] is not None for r in records) == world // pp, (
        "no last stage checked its logits"
    )
    modes = {r["mode"] for r in records}
    assert len(modes) == 1, modes
    moved = []
    for rank, record in enumerate(records):
        if record["mode"] == "engine":
            # a CPU channel's first update opens it (a "describe" request), then one update
            opened, reply = records[rank - rank % engine_tp]["engine_replies"]
            assert opened["describe"] and opened["success"], opened
            assert not reply["describe"], reply
            received = reply["bytes_received"][rank % engine_tp]
            assert received == reply["lower_bound_bytes"][rank % engine_tp], reply
        else:
            received = record["trainer_received"]
            assert received == record["trainer_bound"], f"rank {rank}: {record}"
        moved.append((received, record["one_hop_bound"]))
    print(
        f"{kind} TP {tp} x PP {pp} x EP {ep} -> engine TP {engine_tp}, {modes.pop()}-side: "
        f"(bytes received by each rank, one-hop bound) {moved}"
    )
    assert all(m == bound for m, bound in moved), moved
