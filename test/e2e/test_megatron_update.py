"""A real megatron-core GPTModel (CPU, gloo) updates a real SGLang CPU engine, no gather.

Trainer ranks hold a Qwen2-shaped ``GPTModel`` (local spec, padded vocab) at
Megatron TP x PP, loaded with "trained" weights from the tiny HF checkpoint. At
PP 1 its forward must equal HF's logits. Then ``send_megatron_weights`` hands
each engine rank the local parameters beside it (fused ``linear_qkv`` and
``linear_fc1`` as they are; other stages' layers moved on the trainer side
first): the engine's parameters must equal SGLang's slicing of the weights bit
for bit, its greedy generation must equal HF's, no ``full_tensor`` /
``gather_object`` / ``all_gather_object`` may run, and engine rank 0 must
receive exactly its lower bound.
"""

from __future__ import annotations

import re

import pytest

import tiny_models
from engine import hf_greedy, stable_prompts
from megatron_cases import megatron_job
from ranks import run_ranks
from test_distributed_update import expected_checksums
from update_cases import MAX_NEW, new_weights

SEED = 7


@pytest.mark.parametrize("tp,pp,engine_tp,padded_vocab", [(2, 1, 2, 520), (2, 1, 1, 512), (2, 2, 2, 520)])
def test_megatron_gpt_updates_engine(tp, pp, engine_tp, padded_vocab, tmp_path):
    model_dir, config = tiny_models.make_tiny_model("qwen2", tmp_path / "qwen2")
    weights = new_weights(model_dir, SEED)
    prompts = stable_prompts([(model_dir, weights)], 3, MAX_NEW)
    forbidden_log = tmp_path / "forbidden-calls"
    forbidden_log.mkdir()
    job = dict(model_dir=model_dir, tp=tp, pp=pp, engine_tp=engine_tp, padded_vocab=padded_vocab, seed=SEED,
               prompts=prompts, forbidden_log=str(forbidden_log))
    records = run_ranks(tp * pp, megatron_job, job, timeout=900, start_method="spawn")
    reference = hf_greedy(model_dir, prompts, MAX_NEW, weights=weights)
    expected = expected_checksums(config, weights, engine_tp, 1)
    for rank, record in enumerate(records):
        if pp == 1:
            assert record["forward_max_diff"] < 1e-4, f"rank {rank}: megatron-core logits differ from HF's"
        assert record["success"], f"rank {rank}: {record['message']}"
        assert record["forbidden_calls"] == 0, f"rank {rank}: full_tensor/gather_object called during the update"
        assert record["generation"] == reference, f"rank {rank}: generation differs from HF transformers"
        if record["leader"]:
            wrong = sorted(n for r in expected for n in expected[r] if record["checksums"][r][n] != expected[r][n])
            assert not wrong, f"engine of rank {rank}: parameters differ from SGLang's slicing: {wrong[:5]}"
            received, bound = map(int, re.search(r"received (\d+) bytes \(lower bound (\d+)\)", record["message"]).groups())
            assert received == bound, record["message"]
