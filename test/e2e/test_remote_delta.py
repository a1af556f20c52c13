"""Delta updates to remote engines (``RemoteSync(delta=True)``): only what changed crosses
the wire, and every engine parameter is what a full update would have written.

FSDP2 fp32 over 4 trainer ranks trains the tiny Qwen2 with AdamW (real steps, lr 1e-5 then
1e-6) and updates two bf16 servers of TP 2 after each step. The first update of the epoch
is full; each later one is a delta whose parameters on every engine rank equal SGLang's
slicing of the trainer's bf16-cast weights bit for bit, and whose bytes on the wire are at
most 5% of a full update's when at most 3% of the elements changed, never more than the
full update's plus 1%. Then one engine rank's parameter is changed behind the trainer's
back: the next update's digest check finds it, that engine refuses (nothing written) and
the report says so; the update after it is full, and exact again, and deltas resume.
"""

from __future__ import annotations

import os

import pytest
import tiny_models
from delta_cases import delta_trainer_job
from ports import free_port
from ranks import run_ranks
from remote_checks import TP

TIMEOUT_S = 60
STEPS_AT_1E5 = 10
STEPS_AT_1E6 = 10


@pytest.fixture(scope="module")
def delta_servers(tmp_path_factory):
    """Two bf16 TP-2 servers of the tiny Qwen2, each with a fault directory of its own."""
    from servers import launch_with_fault_dirs

    directory = tmp_path_factory.mktemp("delta")
    model_dir, _ = tiny_models.make_tiny_model("qwen2", directory / "qwen2")
    servers, faults = launch_with_fault_dirs(model_dir, TP, 2, directory)
    try:
        yield servers, faults, model_dir
    finally:
        for server in servers:
            server.kill()


def _check_bytes(record, what):
    """What travelled: the trainer's records, received as sent; at most a full update's
    plus 1%, at most 5% of it at a density of at most 3%; a full update at the lower bound."""
    delta, engines = record["delta"], record["engines"].values()
    wire, full = sum(delta["wire_bytes"]), sum(delta["full_bytes"])
    assert sum(record["bytes_sent"]) == wire, (what, record["bytes_sent"], wire)
    assert sum(sum(e["bytes_received"]) for e in engines) == wire, (what, engines)
    assert sum(sum(e["lower_bound_bytes"]) for e in engines) == full, what
    assert all(len(e["decode_us"]) == TP for e in engines), (what, engines)
    if delta["mode"] == "full":
        assert wire == full, (what, wire, full)
        return
    assert wire <= 1.01 * full, (what, wire, full)
    if delta["density"] <= 0.03:
        assert wire <= 0.05 * full, (what, delta["density"], wire, full)


def test_delta_updates_after_adamw_steps_are_exact_and_small(delta_servers):
    servers, faults, model_dir = delta_servers
    urls = [s.url for s in servers]
    steps = (
        [("full", None)]
        + [("train", 1e-5)] * STEPS_AT_1E5
        + [("train", 1e-6)] * STEPS_AT_1E6
        + [("corrupt", os.path.join(faults[1], "corrupt_param.rank1"))]
        + [("train", 1e-6)] * 3
    )
    job = dict(
        group="delta",
        port=free_port(),
        urls=urls,
        model_dir=str(model_dir),
        tp=TP,
        bucket=1 << 20,
        timeout=TIMEOUT_S,
        steps=steps,
    )
    results = run_ranks(4, delta_trainer_job, job, timeout=1500)
    records = results[0]
    strip = ("seconds", "wrong", "loss")
    for other in results[1:]:
        for a, b in zip(records, other):
            a = {k: v for k, v in a.items() if k not in strip}
            b = {k: v for k, v in b.items() if k not in strip}
            a["delta"] = dict(a["delta"], encode_seconds=None)
            b["delta"] = dict(b["delta"], encode_seconds=None)
            assert a == b, "trainer ranks report differently"
    rows = []
    for i, record in enumerate(records):
        what = f"update {i} ({record['kind']}, lr {record['lr']})"
        delta = record["delta"]
        rows.append(
            f"  {what}: {delta['mode']}, density {delta['density']:.4f}, wire "
            f"{sum(delta['wire_bytes'])} of {sum(delta['full_bytes'])} bytes, "
            f"{record['seconds']:.3f}s, encode {max(delta['encode_seconds']):.4f}s "
            f"{delta['why_full']!r}"
        )
        if i == STEPS_AT_1E5 + STEPS_AT_1E6 + 1:  # the one after the corruption
            assert not record["success"], what
            assert "digest mismatch" in record["message"], record["message"]
            assert urls[1] in record["message"], record["message"]
            continue
        assert record["success"], (what, record["message"])
        assert all(not wrong for wrong in record["wrong"].values()), (
            what,
            record["wrong"],
        )
        if i in (0, STEPS_AT_1E5 + STEPS_AT_1E6 + 2):
            assert delta["mode"] == "full" and delta["why_full"], (what, delta)
        else:
            assert delta["mode"] == "delta", (what, delta)
        _check_bytes(record, what)
    assert "failed" in records[STEPS_AT_1E5 + STEPS_AT_1E6 + 2]["delta"]["why_full"]
    print("delta updates, FSDP 4 fp32 -> 2 bf16 engines of TP 2:\n" + "\n".join(rows))


def test_megatron_tp2_pp2_delta_updates_are_exact(delta_servers):
    """A megatron-core GPTModel at TP 2 x PP 2 (fused QKV and fc1, padded vocab) updates one
    server with deltas after Adam-sized steps: each update bit-exact, and small."""
    from delta_cases import megatron_delta_job

    servers, _, model_dir = delta_servers
    job = dict(
        group="megatron-delta",
        port=free_port(),
        urls=[servers[0].url],
        model_dir=str(model_dir),
        tp=2,
        pp=2,
        engine_tp=TP,
        padded_vocab=520,
        seed=7,
        steps=4,
        lr=1e-5,
        bucket=1 << 20,
        timeout=TIMEOUT_S,
    )
    records = run_ranks(4, megatron_delta_job, job, timeout=1500)[0]
    for i, record in enumerate(records):
        what = f"megatron update {i}"
        assert record["success"], (what, record["message"])
        assert not record["wrong"], (what, record["wrong"][:5])
        assert record["delta"]["mode"] == ("full" if i == 0 else "delta"), what
        _check_bytes(record, what)
    print(
        "megatron TP 2 x PP 2 -> TP 2, deltas: "
        + ", ".join(
            f"density {r['delta']['density']:.4f} wire {sum(r['delta']['wire_bytes'])}/"
            f"{sum(r['delta']['full_bytes'])}"
            for r in records
        )
    )
