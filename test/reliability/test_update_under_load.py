"""Updates while generation requests are in flight: every request finishes (or, with
``abort_all_requests``, ends as aborted), none hangs, and afterwards greedy output is the
new model's (equal to a generation after the same weights were applied with nothing in
flight, and different from the old model's)."""

from __future__ import annotations

import asyncio

import pytest
from faults import TP, full_shards, generate, generate_async, update_async
from update_cases import new_weights

PROMPTS = [[5, 17, 42, 7], [300, 2, 9, 11], [77, 1, 3, 120], [8, 8, 8, 8]]
MAX_NEW = 16
BOUND_S = 300  # no request, no update may hang


def _run(eng, coro):
    return eng.loop.run_until_complete(asyncio.wait_for(coro, BOUND_S))


@pytest.mark.parametrize("abort", [False, True], ids=["finish", "abort_all_requests"])
def test_update_with_generation_in_flight(engine, abort):
    from sglang.srt.weight_sync.protocol import make_channel

    eng, model_dir, _ = engine
    channel = make_channel()
    weights = {
        seed: [full_shards(new_weights(model_dir, seed))] * TP for seed in (1, 2)
    }

    def set_weights(seed, tag):
        success, message = _run(
            eng,
            update_async(
                eng, channel, f"load-{abort}-{tag}", weights[seed], timeout_s=60
            ),
        )
        assert success, message

    set_weights(1, "old")
    old = generate(eng, PROMPTS, MAX_NEW)

    async def update_under_load():
        tm = eng.tokenizer_manager
        requests = [
            asyncio.create_task(generate_async(tm, p, MAX_NEW)) for p in PROMPTS
        ]
        await asyncio.sleep(0.05)  # the requests reach the scheduler first
        result = await update_async(
            eng,
            channel,
            f"load-{abort}-loaded",
            weights[2],
            timeout_s=60,
            abort_all_requests=abort,
        )
        return result, await asyncio.gather(*requests, return_exceptions=True)

    (success, message), outs = _run(eng, update_under_load())
    assert success, message
    for out in outs:
        if isinstance(
            out, Exception
        ):  # upstream raises for a non-streamed request aborted with a status code
            assert abort and "abort" in str(out).lower(), repr(out)
            continue
        reason = out["meta_info"]["finish_reason"]["type"]
        assert reason in (("abort", "length") if abort else ("length",)), out[
            "meta_info"
        ]
        if reason == "length":
            assert len(out["output_ids"]) == MAX_NEW, out
    after = generate(eng, PROMPTS, MAX_NEW)

    set_weights(1, "again-old")
    assert generate(eng, PROMPTS, MAX_NEW) == old
    set_weights(2, "again-new")
    assert after == generate(eng, PROMPTS, MAX_NEW), (
        "output after the loaded update is not the new model's"
    )
    assert after != old, (
        "the two weight sets generate the same tokens: the test cannot tell them apart"
    )
