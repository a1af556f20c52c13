"""``VerlEngine`` (verl 0.4.7's contract, which stays in this repository) on a real CPU engine.

The end-to-end cases (``update_cases.engine_job``) drive the series' own entry points through
``hosted_engine.HostedEngine``; here the same steps run with ``VerlEngine`` hosting the engine
(``verl_hosted.VerlHost``). Two trainer ranks update a TP-2 engine through
``update_weights_from_tensor`` from FSDP, Megatron-style TP and plain full tensors: after each,
every parameter equals SGLang's slicing of the new weights bit for bit and greedy generation
equals HF's, with no gather. A refused update raises on every rank and leaves the old weights
serving; ``release_memory_occupation`` drops every rank's data group and the same model comes
back; an update while the weights are released is refused. The HTTP server backend
(``backend="server"``) updates and refuses alike.
"""

from __future__ import annotations

from phase_checks import check_trainer_breakdown
from ports import free_port
from update_cases import BAD_NAME
from update_checks import check_update, run
from verl_hosted import VerlHost

from sglang.srt.weight_sync.protocol import WEIGHTS_RELEASED

TP = 2
REFUSED = f"unknown tensor '{BAD_NAME}'"


def _unchanged(record: dict, last_good: dict, what: str) -> None:
    assert record["generation"] == last_good["generation"], (
        f"{what} changed what the engine generates"
    )
    assert record["checksums"] == last_good["checksums"], f"{what} changed a parameter"


def test_verl_engine_updates_refuses_and_releases(tmp_path):
    steps = [("verl", "fsdp", 1), ("verl", "tp", 2), ("verl", "full", 3)]
    steps += [("verl_bad", "fsdp", 4), ("memory", "release_resume", 3)]
    steps += [("released", "fsdp", 5), ("verl", "fsdp", 6)]
    model_dir, config, prompts, (records,) = run(
        "qwen2", TP, TP, steps, tmp_path, host=VerlHost
    )
    last_good, dropped = None, None
    for record in records[1:]:
        kind, _, seed = record["step"]
        if kind == "verl_bad":
            assert record["success"] is False and REFUSED in record["message"], (
                record.get("message")
            )
            _unchanged(record, last_good, "the refused update")
        elif kind == "memory":
            _unchanged(record, last_good, "releasing and resuming the memory")
            assert record["data_group_released"] == [None] * TP, record
            dropped = record["data_group_before"]
            assert len(dropped) == TP and None not in dropped, dropped
        elif kind == "released":
            assert (
                record["success"] is False and WEIGHTS_RELEASED in record["message"]
            ), record.get("message")
            _unchanged(record, last_good, "an update while the weights were released")
        else:
            check_update(record, model_dir, config, seed, TP, prompts)
            check_trainer_breakdown(record["seconds"], record["phases"])
            assert record["inline_bytes"] == 0, (record["step"], record["inline_bytes"])
            if dropped is not None:  # the first update after the release: a new group
                made = record["data_group"]
                assert None not in made and not set(made) & set(dropped), (
                    dropped,
                    made,
                )
                dropped = None
            last_good = record
    assert dropped is None, "no update after the release"


def test_verl_engine_http_server_backend(tmp_path):
    """``VerlEngine(backend="server")``: its update goes through POST
    /update_weights_distributed of a real HTTP server (``HttpServerEngineAdapter``); a
    refused one raises on every rank."""
    steps = [("verl", "fsdp", 1), ("verl_bad", "fsdp", 2)]
    model_dir, config, prompts, (records,) = run(
        "qwen2",
        TP,
        TP,
        steps,
        tmp_path,
        host=VerlHost,
        backend="server",
        port=free_port(),
    )
    good, bad = records[1:]
    check_update(good, model_dir, config, 1, TP, prompts)
    assert bad["success"] is False and REFUSED in bad["message"], bad["message"]
    _unchanged(bad, good, "the refused update")
