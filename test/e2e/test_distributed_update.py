"""A real SGLang engine on CPU updated from trainer shards, through every entry point.

Trainer ranks (gloo processes, gathers forbidden) hold DTensor or plain shards of
perturbed weights and update a running engine that the first of them hosts
(``hosted_engine.HostedEngine``: ``trainer_flow``'s update, as ``VerlEngine`` drives it),
``weight_sync.utils.update_weights`` (with a verl-like client that only has the
tensor endpoint) and ``Engine.update_weights_distributed``. After each update the
engine's parameters must equal SGLang's slicing of the new weights bit for bit
(per-rank SHA-256 from SGLang's weight checker) and its greedy generation must
equal HF transformers' with the same weights. Bad updates must be refused with a
message naming tensor and rank, leaving the old weights serving.
"""

from __future__ import annotations

import pytest
from phase_checks import check_engine_breakdown, check_trainer_breakdown
from ports import free_port
from update_cases import (
    BAD_NAME,
)
from update_checks import check_update, run

import sglang
from sglang.srt.weight_sync.protocol import WEIGHTS_RELEASED

UPDATES = [
    ("verl", "fsdp", 1),
    ("verl", "tp", 2),
    ("verl", "full", 3),
    ("utils", "fsdp", 4),
    ("engine", "tp", 5),
    ("engine", "fsdp", 6),
]
FAILURES = {
    "unknown_name": f"unknown tensor '{BAD_NAME}'",
    "wrong_shape": "global shape",
    "missing": "engine rank 1: no payload for update",
    "stale": "no payload for update 'stale-2'",
    "bad_dtype": "dtype torch.int32 cannot be cast",
    "not_covered": "is held by no rank",
}


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen2_every_entry_point_and_refusals(tp, tmp_path):
    fails = [
        ("fail", kind, 10 + i)
        for i, kind in enumerate(FAILURES)
        if tp > 1 or kind != "missing"
    ]
    steps = UPDATES + fails + [("verl", "fsdp", 20)]
    # pr: safety
    # the memory saver's release drops the data group, and an update while the weights are
    # released is refused (``weight_sync.sessions``); the next one succeeds
    steps += [("memory", "release_resume", 20)]
    steps += [("released", "fsdp", 21), ("verl", "fsdp", 22)]
    # pr: safety end
    model_dir, config, prompts, (records,) = run("qwen2", tp, tp, steps, tmp_path)
    last_good, dropped = None, None
    for record in records[1:]:
        kind, arg, seed = record["step"]
        if kind == "memory":
            assert (
                record["generation"] == last_good["generation"]
                and record["checksums"] == last_good["checksums"]
            )
            # the release drops every rank's data group; the next update makes a new one
            assert record["data_group_released"] == [None] * tp, record
            dropped = record["data_group_before"]
            assert len(dropped) == tp and (tp == 1 or None not in dropped), dropped
        elif kind == "released":
            assert (
                record["success"] is False and WEIGHTS_RELEASED in record["message"]
            ), record.get("message")
            assert (
                record["generation"] == last_good["generation"]
                and record["checksums"] == last_good["checksums"]
            ), "an update while the weights were released changed what serves"
        elif kind == "fail":
            assert record["success"] is False and FAILURES[arg] in record["message"], (
                record["message"]
            )
            assert "no parameter changed" in record["message"]
            assert record["generation"] == last_good["generation"], (
                f"{arg}: old weights no longer serving"
            )
            assert record["checksums"] == last_good["checksums"], (
                f"{arg}: a parameter changed"
            )
        else:
            assert record.get("success", True), record.get("message")
            if kind in (
                "utils",
                "engine",
            ):  # upstream's reply text; the figures in their own fields
                assert record["message"] == "Success", record["message"]
            if (
                kind == "engine"
            ):  # every engine rank received exactly the bytes it lacked
                assert (
                    len(record["bytes_received"]) == tp
                    and record["bytes_received"] == record["lower_bound_bytes"]
                )
            check_update(record, model_dir, config, seed, tp, prompts)
            check_phases(record, tp, first=record is records[1])
            # pr: scale
            if (
                kind == "verl"
            ):  # the channel is opened first: shared memory from the start
                assert record["inline_bytes"] == 0, (
                    record["step"],
                    record["inline_bytes"],
                )
            # pr: scale end
            last_good = record
            if dropped is not None and any(
                dropped
            ):  # the first update after the release
                made = record["data_group"]
                assert None not in made and not set(made) & set(dropped), (
                    dropped,
                    made,
                )
                dropped = None


def check_phases(record: dict, tp: int, first: bool) -> None:
    """Where a successful update's time went: a hosted update's trainer phases cover its
    clock within 10 %, and the clock the measured call; on 0.5.23 the engine's reply gives
    every TP rank's phases. The first update plans; an Engine.update_weights_distributed update of a layout seen
    before finds its plan cached and waits on its control round trips: the agreement and
    the figures' share."""
    kind, layout, _ = record["step"]
    replies_phases = sglang.__version__.split("+")[0] == "0.5.23"
    if kind == "verl":
        check_trainer_breakdown(record["seconds"], record["phases"])
        if replies_phases and first:
            engine = check_engine_breakdown(
                record["engine_phases"], tp, record["phases"]["engine"]
            )
            assert engine["plan_cold"] == [1.0] * tp  # the first update plans
    elif kind == "engine" and layout == "fsdp" and replies_phases:
        engine = check_engine_breakdown(record["phases"], tp, float("inf"))
        assert engine["plan_cold"] == [0.0] * tp
        trips = 2.0
        # pr: safety
        trips += 1.0  # the commit vote (``engine_update._commit``)
        # pr: safety end
        assert engine["round_trips"] == [trips] * tp


def test_smoke_fsdp_trainer_updates_engine(tmp_path):
    """The end-to-end smoke CI runs on every older SGLang base wheel (``make smoke BASE=...``):
    FSDP Shard(0) trainer ranks update a TP-2 engine through the host's update (trainer_flow),
    weight_sync.utils.update_weights and Engine.update_weights_distributed; after each,
    parameters bit-exact and generation equal to HF. ``make test`` deselects it on the primary
    base, where ``test_qwen2_every_entry_point_and_refusals[2]`` runs these steps and more on
    the same engine. Every update says where its time went (``check_phases``)."""
    steps = [("verl", "fsdp", 1), ("utils", "fsdp", 2), ("engine", "fsdp", 3)]
    model_dir, config, prompts, (records,) = run("qwen2", 2, 2, steps, tmp_path)
    for record in records[1:]:
        assert record.get("success", True), record.get("message")
        check_update(record, model_dir, config, record["step"][2], 2, prompts)
        check_phases(record, 2, first=record is records[1])


# pr: scale
@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_moe"])
def test_models_at_tp2(kind, tmp_path):
    steps = [("verl", "fsdp", 1), ("verl", "tp", 2), ("utils", "fsdp", 3)]
    model_dir, config, prompts, (records,) = run(kind, 2, 2, steps, tmp_path)
    for record in records[1:]:
        assert record.get("success", True), record.get("message")
        check_update(record, model_dir, config, record["step"][2], 2, prompts)


def test_qwen2_at_tp4(tmp_path):
    """TP 4 on this 2-core machine (ranks share cores): four trainer ranks, kv heads split 4/4."""
    steps = [("verl", "fsdp", 1), ("verl", "tp", 2), ("utils", "fsdp", 3)]
    model_dir, config, prompts, (records,) = run("qwen2", 4, 4, steps, tmp_path)
    for record in records[1:]:
        assert record.get("success", True), record.get("message")
        check_update(record, model_dir, config, record["step"][2], 4, prompts)


# pr: scale end
def test_http_server_backend(tmp_path):
    """An engine hosted as a real HTTP server (``HostedEngine(backend="server")``, through
    HttpServerEngineAdapter): the update goes through POST /update_weights_distributed; a
    refused one raises on every rank."""
    port = free_port()
    steps = [("verl", "fsdp", 1), ("verl_bad", "fsdp", 2)]
    model_dir, config, prompts, (records,) = run(
        "qwen2", 2, 2, steps, tmp_path, backend="server", port=port
    )
    good, bad = records[1:]
    check_update(good, model_dir, config, 1, 2, prompts)
    assert (
        bad["success"] is False and f"unknown tensor '{BAD_NAME}'" in bad["message"]
    ), bad["message"]
    assert bad["generation"] == good["generation"], (
        "the refused update changed what the server generates"
    )
    assert bad["checksums"] == good["checksums"], (
        "the refused update changed a parameter"
    )


# pr: scale
def test_moe_expert_parallel_parameters(tmp_path):
    """Experts split over EP 2 (MoE-TP 1). SGLang 0.5.23's CPU engine cannot run a forward
    pass with ep_size > 1 (its MoE path indexes expert -1), so only the parameters are
    checked here, bit for bit; generation with EP needs a GPU."""
    engine_kwargs = {"ep_size": 2}
    steps = [("verl", "fsdp", 1), ("utils", "tp", 2)]
    model_dir, config, prompts, (records,) = run(
        "qwen3_moe", 2, 2, steps, tmp_path, generate=False, **engine_kwargs
    )
    for record in records[1:]:
        assert record.get("success", True), record.get("message")
        check_update(
            record,
            model_dir,
            config,
            record["step"][2],
            2,
            prompts,
            engine_kwargs.get("ep_size", 1),
        )


# pr: scale end
