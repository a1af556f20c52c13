"""The CPU engine fixture works: a real sglang.Engine (TP 1 and 2) decodes the tiny Qwen2
greedily exactly as HF transformers does, and upstream's tensor weight update
(``begin_weight_update`` / ``update_weights_from_tensor`` / ``end_weight_update``)
changes what it generates to match HF with the same new ``lm_head``.
"""

import time

import pytest
import tiny_models
from engine import (
    COMPILED,
    cpu_engine,
    engine_greedy,
    greedy_mismatches,
    hf_greedy,
    stable_prompts,
)

MAX_NEW = 8


@pytest.fixture(scope="module")
def qwen2(tiny_model):
    path, config = tiny_model("qwen2")
    lm_head = tiny_models.load_checkpoint(path)["lm_head.weight"]
    new_lm_head = tiny_models.random_like(lm_head, seed=1)
    # Prompts whose greedy path has no bf16 near-tie, with either lm_head: exact comparison is robust.
    prompts = stable_prompts(
        [path, (path, {"lm_head.weight": new_lm_head})], count=3, max_new_tokens=MAX_NEW
    )
    return path, lm_head, new_lm_head, prompts


@pytest.fixture(scope="module", params=[1, 2], ids=lambda tp: f"tp{tp}")
def engine(request, qwen2):
    path = qwen2[0]
    with cpu_engine(path, tp_size=request.param, env=COMPILED) as eng:
        yield eng
    print(
        f"tp{request.param} timings: "
        + ", ".join(f"{k} {v:.2f}s" for k, v in eng.test_timings.items())
    )


def test_greedy_matches_hf(engine, qwen2):
    path, _, _, prompts = qwen2
    t0 = time.perf_counter()
    out = engine_greedy(engine, prompts, MAX_NEW)
    engine.test_timings["first_generate_s"] = time.perf_counter() - t0
    assert out == hf_greedy(path, prompts, MAX_NEW)
    # Arbitrary prompts: greedy up to bf16 near-ties (no exact comparison there).
    others = [[1, 5, 7, 9, 11], [1, 2, 3], [100, 200, 300, 400, 500, 17, 42]]
    assert greedy_mismatches(path, others, engine_greedy(engine, others, 16)) == []


def test_upstream_lm_head_update_matches_hf(engine, qwen2):
    path, lm_head, new_lm_head, prompts = qwen2
    before = engine_greedy(engine, prompts, MAX_NEW)
    expected = hf_greedy(
        path, prompts, MAX_NEW, weights={"lm_head.weight": new_lm_head}
    )
    assert expected != before, "the new lm_head should change greedy decoding"

    assert tuple(engine.begin_weight_update()) == (True, "Success")
    ok, msg = engine.update_weights_from_tensor(
        [("lm_head.weight", new_lm_head.clone())]
    )
    assert ok, msg
    assert tuple(engine.end_weight_update()) == (True, "Success")
    assert engine_greedy(engine, prompts, MAX_NEW) == expected

    # Put the original back (the engine is shared by the module's tests).
    assert engine.begin_weight_update()[0]
    assert engine.update_weights_from_tensor([("lm_head.weight", lm_head.clone())])[0]
    assert engine.end_weight_update()[0]
    assert engine_greedy(engine, prompts, MAX_NEW) == before
