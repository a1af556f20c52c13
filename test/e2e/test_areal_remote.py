"""AReaL 1.0.4 switched to this wheel's weight-sync group by its companion patch
(``integrations/areal/0001-fsdp-weight-sync-group.patch``), side by side with its released
``xccl`` broadcast on the same server (``areal_remote_cases``).

The patch applies to AReaL 1.0.4's ``areal/engine/fsdp_engine.py`` with ``--fuzz=0``; its
two methods, run with ``AREAL_SGLANG_WEIGHT_SYNC=1``, update a TP-1 server (a process tree
of its own) from two FSDP2 fp32 trainer ranks, each sending its own shard; AReaL's released
path (``full_tensor()`` on every rank, the first rank's broadcast into
``init_weights_update_group``'s group) updates it with other weights first. After each,
the server's parameters equal the weights bit for bit and greedy generation equals HF's; the
engine rank receives exactly its parameters' bytes and the two trainer ranks send within
10% of each other; seconds and bytes of both are printed. With the patch's delta switch
(``AREAL_SGLANG_WEIGHT_SYNC_DELTA=1``) that first update of the group is full and the same
weights sent again are a delta of nothing: record headers only, which the engine's reply
counts as unchanged regions.
"""

from __future__ import annotations

from pathlib import Path

import tiny_models
from areal_remote_cases import areal_side_by_side_job
from ports import free_port
from ranks import run_ranks
from remote_checks import check_state, prompts_for
from servers import http_server
from verl_helpers import patched_copy

PATCH = (
    Path(__file__).resolve().parents[2]
    / "integrations"
    / "areal"
    / "0001-fsdp-weight-sync-group.patch"
)


def _patched_source(tmp_path: Path) -> str:
    import areal

    assert areal.__version__ == "1.0.4", areal.__version__
    src = Path(areal.__file__).parent / "engine" / "fsdp_engine.py"
    return patched_copy(src, "areal/engine", tmp_path, PATCH, "AReaL 1.0.4")


def test_areal_companion_patch_beside_its_broadcast(tmp_path):
    model_dir, config = tiny_models.make_tiny_model("llama", tmp_path / "llama")
    job = dict(
        model_dir=str(model_dir),
        seed=4,
        broadcast_seed=3,
        prompts={s: prompts_for(model_dir, s) for s in (3, 4)},
        broadcast_port=free_port(),
        patched=_patched_source(tmp_path / "src"),
        name_resolve=str(tmp_path / "name_resolve"),
        fileroot=str(tmp_path / "files"),
        delta=True,
    )
    with http_server(model_dir, 1, log_dir=str(tmp_path)) as server:
        job["url"] = server.url
        results = run_ranks(2, areal_side_by_side_job, job, timeout=900)
    first = results[0]
    check_state(
        first["broadcast"]["state"],
        model_dir,
        config,
        3,
        job["prompts"][3],
        "AReaL xccl",
        tp=1,
    )
    check_state(
        first["state"],
        model_dir,
        config,
        4,
        job["prompts"][4],
        "AReaL + weight-sync group",
        tp=1,
    )
    patched = first["patched_report"]
    [full] = patched["engines"].values()
    assert patched["success"] and patched["delta"]["mode"] == "full", patched["delta"]
    assert full["bytes_received"] == full["lower_bound_bytes"], full
    # the same weights again, with AREAL_SGLANG_WEIGHT_SYNC_DELTA=1: a delta of nothing
    report = first["report"]
    assert report["success"], report["message"]
    [reply] = report["engines"].values()
    delta = report["delta"]
    assert delta["mode"] == "delta" and delta["density"] == 0, delta
    assert reply["bytes_received"] == [sum(delta["wire_bytes"])], (reply, delta)
    assert sum(delta["wire_bytes"]) < 0.01 * sum(delta["full_bytes"]), delta
    assert reply["delta"]["bytes_as_unchanged"] == reply["bytes_received"], reply
    sent = patched["bytes_sent"]
    assert max(sent) <= 1.1 * min(sent), sent
    b = first["broadcast"]
    print(
        f"AReaL 1.0.4, FSDP2 2 fp32 ranks -> SGLang TP 1: released xccl: full_tensor {b['gather_s']:.3f}s + "
        f"broadcast {b['update_s']:.3f}s, rank 0 sent {b['bytes']} bytes; weight-sync group: "
        f"{first['ours_s']:.3f}s, trainer ranks sent {sent}, engine rank received {full['bytes_received']} "
        f"(= lower bound), paused {full['pause_seconds']}s; the same weights by delta: "
        f"{reply['bytes_received']} bytes"
    )
