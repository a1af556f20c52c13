"""Faults in a weight-sync group with remote engines: an update the group refuses before
any byte moves (the epoch goes on), an engine killed mid-update, the engine restarted and
rejoining (with delta updates: its first update is full), a trainer rank killed
mid-update.

Two TP-1 SGLang HTTP servers (each in a process tree of its own) and two trainer ranks
(FSDP2 fp32 shards). When a process dies mid-update every other process returns an error
within the bound naming the rank and the phase; the surviving engine keeps serving its old
weights (nothing was written: it receives into staging first) and never mixed ones; the
dead engine leaves the group and the next update of the others succeeds; a restarted
engine joins again under a new membership epoch without restarting the trainer; after a
trainer rank died, a new trainer joins the same engines and updates them.
"""

from __future__ import annotations

import os

import pytest
import tiny_models
from ports import free_port
from ranks import run_ranks
from remote_fault_cases import remote_steps_job
from servers import launch, launch_with_fault_dirs
from update_cases import new_weights
from update_checks import expected_checksums

TIMEOUT_S = 10.0
# A trainer rank's bound: its rounds (TIMEOUT_S each), the engines' answer after theirs
# (trainer_bound_s), with slack for a loaded machine.
BOUND_S = 2 * TIMEOUT_S + 30 + 15
PROMPTS = [[5, 17, 42, 7]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two TP-1 servers, each with a fault directory of its own; killed at the end."""
    directory = tmp_path_factory.mktemp("remote_faults")
    model_dir, config = tiny_models.make_tiny_model("qwen2", directory / "qwen2")
    servers, faults = launch_with_fault_dirs(model_dir, 1, 2, directory)
    try:
        yield dict(
            servers=servers,
            faults=faults,
            model_dir=model_dir,
            config=config,
            dir=directory,
        )
    finally:
        for s in servers:
            s.kill()


def state(server, model_dir, config, seeds):
    """Which of ``seeds``' weights the server holds, bit for bit (None: none of them)."""
    got = server.checksums()
    for seed in seeds:
        if got == expected_checksums(config, new_weights(model_dir, seed), 1, 1):
            return seed
    return None


def run(cluster, steps, urls, world=2, may_die=(), delta=False):
    job = dict(
        group="faults",
        port=free_port(),
        urls=urls,
        model_dir=str(cluster["model_dir"]),
        bucket=1 << 20,
        timeout=TIMEOUT_S,
        steps=steps,
        delta=delta,
    )
    return run_ranks(world, remote_steps_job, job, timeout=900, may_die=may_die)


def test_an_update_refused_before_any_byte_keeps_the_epoch(cluster):
    """A NaN on trainer rank 0: the group refuses the update by agreement before any byte
    moves, every trainer rank's report names the tensor and the rank, and both engines keep
    their old weights. The epoch's groups were not used, so the next update runs in the
    same epoch (no join) and is exact on both engines."""
    a, b = cluster["servers"]
    model_dir, config = cluster["model_dir"], cluster["config"]
    steps = [("update", 1), ("nan", 2), ("state", [a.url, b.url]), ("update", 3)]
    results = run(cluster, steps, [a.url, b.url])
    held = results[0][2]["state"]
    old = expected_checksums(config, new_weights(model_dir, 1), 1, 1)
    assert [s["checksums"] for s in held] == [old, old], "a refused update wrote"
    name = sorted(new_weights(model_dir, 2))[0]
    for rank, records in enumerate(results):
        first, refused, _, after = records
        assert first["success"], first["message"]
        assert not refused["success"], f"rank {rank}: a NaN update succeeded"
        message = refused["message"]
        assert "NaN" in message and "trainer rank 0" in message, message
        assert name in message, message
        assert sum(refused["bytes_sent"]) == 0, refused["bytes_sent"]
        assert all(not r.get("mixed") for r in refused["engines"].values()), refused
        assert after["success"], after["message"]
        assert after["epoch"] == refused["epoch"] == first["epoch"], (
            "a refusal agreed before any byte moved formed a new epoch",
            [first["epoch"], refused["epoch"], after["epoch"]],
        )
        for reply in after["engines"].values():
            assert reply["bytes_received"] == reply["lower_bound_bytes"], reply
    assert (
        state(a, model_dir, config, [3]) == 3 and state(b, model_dir, config, [3]) == 3
    )


def test_engine_killed_mid_update_leaves_and_a_restarted_one_rejoins(cluster):
    a, b = cluster["servers"]
    model_dir, config = cluster["model_dir"], cluster["config"]
    flag = os.path.join(cluster["faults"][1], "die_in_receive.rank0")
    steps = [
        ("update", 1),
        ("arm", flag),
        ("update", 2),
        ("state", [a.url]),
        ("update", 3),
    ]
    results = run(cluster, steps, [a.url, b.url])
    [survivor] = results[0][2]["state"]
    old = expected_checksums(config, new_weights(model_dir, 1), 1, 1)
    assert survivor["checksums"] == old, (
        "the surviving engine's weights changed (or are mixed)"
    )
    assert len(survivor["generation"][0]) == 8, survivor["generation"]
    for rank, records in enumerate(results):
        first, killed, _, after = records
        assert first["success"], first["message"]
        assert not killed["success"], (
            f"rank {rank}: the update with a dead engine succeeded"
        )
        assert killed["seconds_here"] < BOUND_S, killed
        message = killed.get("message") or killed.get("raised")
        assert b.url in message, f"the dead engine is not named: {message}"
        assert (
            "executor round" in message
            or "receiving" in message
            or "PeerLost" in message
        ), message
        assert after["success"], after["message"]
        assert after["left"] == [b.url] and list(after["engines"]) == [a.url], after
        reply = after["engines"][a.url]
        assert reply["bytes_received"] == reply["lower_bound_bytes"], reply
    assert not b.alive(), "the engine was not killed"
    assert state(a, model_dir, config, [3]) == 3, (
        "the surviving engine did not take the next update"
    )
    killed_reply = results[0][1].get("engines", {}).get(a.url, {})
    assert not killed_reply.get("mixed"), killed_reply

    # the engine restarts (a new server) and joins again, without restarting the trainer;
    # the trainer sends deltas: the restarted engine's first update is full (a new epoch,
    # the report says so) and exact, through the same executor as a plain update
    restarted = launch(
        model_dir,
        1,
        env={"SGLANG_TEST_FAULT_DIR": str(cluster["faults"][1])},
        log_dir=str(cluster["dir"]),
    )
    cluster["servers"][1] = restarted
    results = run(
        cluster,
        [("update", 4), ("join", restarted.url), ("update", 5)],
        [a.url],
        delta=True,
    )
    for records in results:
        before, joined, both = records
        assert before["success"] and list(before["engines"]) == [a.url], before
        assert joined["epoch"] == 2, joined
        assert both["success"], both["message"]
        assert sorted(both["engines"]) == sorted([a.url, restarted.url]), both
        assert both["delta"]["mode"] == "full", both["delta"]
        assert "a new membership epoch (2" in both["delta"]["why_full"], both["delta"]
        for reply in both["engines"].values():
            assert reply["bytes_received"] == reply["lower_bound_bytes"], reply
    assert state(a, model_dir, config, [5]) == 5
    assert state(restarted, model_dir, config, [5]) == 5


def test_trainer_rank_killed_mid_update(cluster):
    servers = [s for s in cluster["servers"] if s.alive()]
    urls = [s.url for s in servers]
    model_dir, config = cluster["model_dir"], cluster["config"]
    results = run(cluster, [("update", 6), ("die", 7)], urls, may_die=[1])
    survivor = results[0]
    assert results[1] is None, "trainer rank 1 did not die"
    first, died = survivor
    assert first["success"], first["message"]
    assert not died["success"] and died["seconds_here"] < BOUND_S, died
    message = died.get("raised") or died.get("message")
    assert "[1]" in message and "trainer rank 0" in message, message
    for server in servers:
        assert state(server, model_dir, config, [6, 7]) == 6, (
            "an engine took a partial update"
        )
        status, _ = server.generate(PROMPTS, 4)
        assert status == 200, "an engine no longer serves after the trainer rank died"
    # a new trainer (a restarted job) joins the same engines and updates them
    results = run(cluster, [("update", 8)], urls)
    assert all(r[0]["success"] for r in results), results[0][0]["message"]
    for server in servers:
        assert state(server, model_dir, config, [8]) == 8
