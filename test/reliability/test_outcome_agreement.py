"""The trainer and the engine agree on every update's outcome after a fault (issue 24, item 7).

Measured before: with one engine scheduler stopped (SIGSTOP) during an update
(``timeout_s=5``), the caller was told the update failed and, after SIGCONT, the engine
applied it anyway and served the new weights (or, stopped a moment later, the engine
died at its next TP barrier); with a trainer rank killed after delivery, the engine
answered "Success" to the surviving rank, which raised without saying so.

Each fault runs on the shared TP-2 engine and is followed by a good update that must
succeed. Generation is checked throughout: served with the weights of the last update
whose answer said success, or refused with a message saying why, never serving weights
the caller was told were not applied.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import threading
import time

import psutil
import pytest
from faults import (
    TP,
    full_shards,
    generate,
    generate_async,
    run_trainers,
    state,
    update,
)
from update_cases import new_weights
from update_checks import expected_checksums

TIMEOUT_S = 5.0
PROMPT = [5, 17, 42, 7]
# after SIGCONT: the resumed rank's own bounded waits (timeout_s + grace each) end first
SETTLE_S = 150


def _channel():
    from sglang.srt.weight_sync.protocol import make_channel

    return make_channel()


def _scheduler(rank: int) -> psutil.Process:
    for child in psutil.Process().children(recursive=True):
        try:
            if f"sglang::scheduler_TP{rank}" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no scheduler of TP rank {rank} under this process")


def _good_update(eng, config, model_dir, seed: int, update_id: str):
    """A good update that must succeed: weights bit-exact, generation served."""
    channel = _channel()
    try:
        success, message, _ = update(
            eng,
            channel,
            update_id,
            [full_shards(new_weights(model_dir, seed))] * TP,
            timeout_s=60,
        )
    finally:
        shutil.rmtree(channel, ignore_errors=True)
    assert success, message
    assert state(eng) == expected_checksums(config, new_weights(model_dir, seed), TP, 1)
    served = generate(eng, [PROMPT])[0]
    assert len(served) == 4
    return served


def _refusal(tm) -> str:
    """Why the tokenizer manager refuses generation now ("" when it serves)."""
    from sglang.srt.weight_sync.answer_guard import refuse_generation_if_unsafe

    try:
        refuse_generation_if_unsafe(tm)
        return ""
    except ValueError as e:
        return str(e)


async def _stopped_update(eng, channel, update_id, weights, stop_at):
    """Update ``update_id`` while TP rank 1's scheduler is stopped: before the request
    (``stop_at`` None: both payloads already delivered) or ``stop_at`` seconds after it,
    while rank 1 waits for its payload (delivered once it is stopped). SIGCONT comes 5 s
    after the tokenizer manager's bound. Generation asked 2 s into the update, and again
    each second until the engine serves once more, checks what is served throughout."""
    from sglang.srt.managers.io_struct import UpdateWeightsDistributedReqInput
    from sglang.srt.weight_sync.delivery import ShardSender
    from sglang.srt.weight_sync.protocol import answer_bound_s

    tm, victim = eng.tokenizer_manager, _scheduler(1)
    bound = answer_bound_s(TIMEOUT_S)
    senders = [ShardSender(channel, 0)]
    senders[0].send(update_id, 0, {0: 0, 1: 1}, weights)

    def stop_then_deliver():
        victim.send_signal(signal.SIGSTOP)
        senders.append(ShardSender(channel, 1))
        senders[-1].send(update_id, 1, {0: 0, 1: 1}, weights)

    if stop_at is None:
        stop_then_deliver()

    def signals():
        if stop_at is not None:
            time.sleep(stop_at)
            stop_then_deliver()
        time.sleep(max(0.0, bound + 5 - (time.monotonic() - start)))
        victim.send_signal(signal.SIGCONT)

    start = time.monotonic()
    signaller = threading.Thread(target=signals, daemon=True)
    signaller.start()
    try:
        call = asyncio.ensure_future(
            tm.update_weights_distributed(
                UpdateWeightsDistributedReqInput(
                    update_id=update_id, channel=channel, timeout_s=TIMEOUT_S
                ),
                None,
            )
        )  # no session opened: the schedulers run it in a one-shot session, as VerlEngine's
        await asyncio.sleep(2.0)
        early = asyncio.ensure_future(generate_async(tm, PROMPT, 4))
        reply = await call
        answered_s = time.monotonic() - start
        refusals = [_refusal(tm)]
        while refusals[-1] and time.monotonic() - start < bound + 5 + SETTLE_S:
            await asyncio.sleep(1.0)
            refusals.append(_refusal(tm))
        served_again_s = time.monotonic() - start
        early_out = (await asyncio.wait_for(early, 60))["output_ids"]
        now = (await generate_async(tm, PROMPT, 4))["output_ids"]
        return dict(
            reply=reply,
            answered_s=answered_s,
            refusals=refusals,
            served_again_s=served_again_s,
            early=early_out,
            now=now,
        )
    finally:
        signaller.join(timeout=2 * bound)
        victim.send_signal(signal.SIGCONT)  # whatever happened, never leave it stopped
        for s in senders:
            s.close()


@pytest.mark.parametrize(
    "stop_at",
    [None, 1.0],
    ids=["stopped-before-the-request", "stopped-waiting-for-its-payload"],
)
def test_a_stopped_scheduler_never_applies_an_update_its_caller_was_told_failed(
    engine, stop_at
):
    from sglang.srt.weight_sync.outcome import record_path
    from sglang.srt.weight_sync.protocol import answer_bound_s

    eng, model_dir, config = engine
    tag = "before" if stop_at is None else "waiting"
    served = _good_update(eng, config, model_dir, 1, f"agree-{tag}-1")
    old = state(eng)
    channel = _channel()
    try:
        out = eng.loop.run_until_complete(
            _stopped_update(
                eng,
                channel,
                f"agree-{tag}-2",
                full_shards(new_weights(model_dir, 2)),
                stop_at,
            )
        )
        record_left = os.path.lexists(record_path(channel, f"agree-{tag}-2"))
    finally:
        shutil.rmtree(channel, ignore_errors=True)
    bound = answer_bound_s(TIMEOUT_S)
    reply = out["reply"]
    # the caller is told within the bound that the update failed and will never be applied
    assert reply["success"] is False and not reply["mixed"], reply
    assert out["answered_s"] < bound + 10, out["answered_s"]
    assert f"no answer from the engine within {bound:g}s" in reply["message"]
    assert (
        "The update is abandoned: the engine will not apply it" in reply["message"]
    ), reply["message"]
    # until the engine answers, generation is refused with that reason; then it is served
    first = out["refusals"][0]
    assert (
        first.startswith(
            "generation refused: the engine has not answered distributed weight update "
            f"'agree-{tag}-2'"
        )
        and "abandoned and will not be applied" in first
    ), first
    assert out["refusals"][-1] == "", (
        f"still refused {out['served_again_s']:.0f}s after the update: {out['refusals'][-1]}"
    )
    assert not record_left, "the outcome record outlived the update's answer"
    # ... with the weights of the last update that succeeded: the abandoned one never landed
    assert state(eng) == old, "the engine applied an update its caller was told failed"
    assert out["early"] == served and out["now"] == served, (
        "generation served other weights than those of the last successful update"
    )
    _good_update(eng, config, model_dir, 3, f"agree-{tag}-3")


def test_a_trainer_rank_killed_after_delivery_is_told_what_the_engine_did(engine):
    """Rank 1 dies once both payloads are on their way; rank 0 asks the engine, then finds
    its peer gone. Its ``PeerLost`` names the phase and the missing rank within the bound
    (as ``test_trainer_death.py`` checks for the other phases) and says whether the engine
    applied the update, which the engine's weights must confirm."""
    eng, model_dir, config = engine
    survivors, left = run_trainers(
        eng,
        TP,
        dict(
            model_dir=model_dir,
            timeout_s=TIMEOUT_S,
            die_rank=1,
            when="after_delivery",
        ),
    )
    assert not left, (
        f"channel directories left after the survivor closed its channels: {left}"
    )
    assert list(survivors) == [0], f"only rank 0 survives, got {sorted(survivors)}"
    survivor = survivors[0]
    assert survivor["first"][0] is True, survivor["first"]
    assert survivor["elapsed"] < 2 * TIMEOUT_S + 30 + 5, survivor["elapsed"]
    outcome, known = survivor["outcome"], survivor["known"]
    assert outcome.startswith("PeerLost: ") and (
        "while the engine applies the update" in outcome
    ), outcome
    assert re.search(r"\b[Rr]anks? \[?1\b", outcome), (
        f"the missing rank is not named: {outcome}"
    )
    assert known is not None and known["applied"] in (True, False), known
    applied = new_weights(model_dir, 2 if known["applied"] else 1)
    assert state(eng) == expected_checksums(config, applied, TP, 1), (
        f"the survivor says applied={known['applied']}, the engine's weights disagree"
    )
    if known["applied"]:
        assert known["answer"].startswith("Success"), known
        assert f"the engine APPLIED update {known['update_id']!r}" in outcome, outcome
    else:
        assert f"the engine answered that update {known['update_id']!r} failed" in (
            outcome
        ), outcome
    assert len(generate(eng, [PROMPT])[0]) == 4, "the engine no longer serves"
    _good_update(eng, config, model_dir, 3, "agree-trainer-3")
