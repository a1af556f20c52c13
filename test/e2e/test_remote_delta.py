"""Delta updates to remote engines (``RemoteSync(delta=True)``): only what changed crosses
the wire, and every engine parameter is what a full update would have written.

FSDP2 fp32 over 4 trainer ranks trains the tiny Qwen2 with AdamW (real steps, lr 1e-5 then
1e-6) and updates two bf16 servers of TP 2 after each step. The first update of the epoch
is full; each later one is a delta whose parameters on every engine rank equal SGLang's
slicing of the trainer's bf16-cast weights bit for bit, and whose bytes on the wire are at
most 5% of a full update's when at most 3% of the elements changed, never more than the
full update's plus 1%. Then one engine rank's parameter is changed behind the trainer's
back: the next update's digest check finds it, that engine refuses (nothing written) and
the report says so; the update after it is full, and exact again, and deltas resume. Then
the other faults of a delta update, on the same servers: one engine refuses an update it
received in full (its answer is failure: the trainer keeps no snapshot of it, and the other
engine, which answered success, holds it; the refusing one its old weights); an engine
leaves and joins again (a new membership epoch: full); a trainer rank dies in the middle of
a delta (every engine keeps what it held) and fresh trainer ranks update in full, exactly.
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
# the trainer-death case waits out a bound on purpose: its rounds and the engines' answer
# (``trainer_bound_s``), with slack for a loaded machine
DEATH_TIMEOUT_S = 10
DEATH_BOUND_S = 2 * DEATH_TIMEOUT_S + 30 + 15


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


def _job(group, urls, model_dir, timeout_s, **more) -> dict:
    """A trainer job of ``delta_cases`` updating ``urls`` through group ``group``."""
    job = dict(group=group, port=free_port(), urls=urls, model_dir=str(model_dir))
    return dict(job, tp=TP, bucket=1 << 20, timeout=timeout_s, **more)


def _check_bytes(record, what):
    """What travelled: the trainer's records, received as sent; at most a full update's
    plus 1%, at most 5% of it at a density of at most 3%; a full update at the lower bound."""
    delta, engines = record["delta"], record["engines"].values()
    wire, full = sum(delta["wire_bytes"]), sum(delta["full_bytes"])
    assert sum(record["bytes_sent"]) == wire, (what, record["bytes_sent"], wire)
    assert sum(sum(e["bytes_received"]) for e in engines) == wire, (what, engines)
    assert sum(sum(e["lower_bound_bytes"]) for e in engines) == full, what
    assert all(len(e["decode_us"]) == TP for e in engines), (what, engines)
    _check_figures(record, what)
    if delta["mode"] == "full":
        assert wire == full, (what, wire, full)
        return
    assert wire <= 1.01 * full, (what, wire, full)
    if delta["density"] <= 0.03:
        assert wire <= 0.05 * full, (what, delta["density"], wire, full)


def _check_figures(record, what):
    """The report's delta figures: the wire bytes split by what the records carry, each
    engine's bytes as its own reply counts them, densities per class, coding seconds."""
    delta, trainers = record["delta"], len(record["bytes_sent"])
    sent_as = delta["sent_as"]
    assert [sum(k) for k in zip(*sent_as.values())] == delta["wire_bytes"], (
        what,
        delta,
    )
    assert len(delta["encode_seconds"]) == trainers, (what, delta)
    assert all(s >= 0 for s in delta["encode_seconds"]), (what, delta)
    assert sorted(delta["engines"]) == sorted(record["engines"]), (what, delta)
    for name, engine in delta["engines"].items():
        reply = record["engines"][name]
        assert engine["wire_bytes"] == sum(reply["bytes_received"]), (what, name)
        assert engine["full_bytes"] == sum(reply["lower_bound_bytes"]), (what, name)
        assert engine["decode_seconds"] == [us / 1e6 for us in reply["decode_us"]]
        classes = engine["density_by_class"]
        assert set(classes) == {"embedding", "attention", "mlp", "norm"}, (
            what,
            classes,
        )
        assert all(0 <= d <= 1 for d in classes.values()), (what, classes)
        _check_reply(reply, engine, delta["planned"] == "delta", what)
    if delta["mode"] == "full":
        assert sent_as["full"] == delta["wire_bytes"], (what, sent_as)
        assert all(e["density"] == 1 for e in delta["engines"].values()), (what, delta)
    else:
        assert sum(sent_as["delta"]) > 0, (what, sent_as)
        assert all(e["density"] < 0.05 for e in delta["engines"].values()), (
            what,
            delta,
        )


def _check_reply(reply, engine, records, what):
    """An engine's own reply: with delta records, per TP rank the bytes received by what
    the records carry (summing to what it received), its changes against the senders'
    count of them, the densities per class of what it received; without, nothing."""
    mine = reply["delta"]
    if not records:
        assert mine == {}, (what, mine)
        return
    kinds = zip(
        mine["bytes_as_delta"], mine["bytes_as_full"], mine["bytes_as_unchanged"]
    )
    assert [sum(k) for k in kinds] == reply["bytes_received"], (what, mine, reply)
    assert len(mine["density"]) == TP, (what, mine)
    assert sum(mine["changed"]) / sum(mine["elements"]) == engine["density"], what
    assert sorted(mine["density_by_class"]) == sorted(engine["density_by_class"])
    for c, per_rank in mine["density_by_class"].items():
        assert len(per_rank) == TP and all(0 <= d <= 1 for d in per_rank), (what, c)
    if engine["density"] < 1:  # some region changed little: sent as changes
        assert sum(mine["bytes_as_delta"]) + sum(mine["bytes_as_unchanged"]) > 0


def _check_refused(records, i, urls, fault):
    """Update ``i``, after ``fault``, was refused by one engine: which, and what each engine
    holds."""
    record, what = records[i], f"update {i} (after {fault})"
    assert not record["success"], what
    assert record["delta"]["mode"] == "delta", (what, record["delta"])
    after = records[i + 1]["delta"]
    assert after["mode"] == "full", (what, after)
    assert record["update_id"] in after["why_full"], after["why_full"]
    if fault == "corrupt":
        # engine 1's rank 1 finds its base changed: that engine writes nothing (the
        # corrupted element stays), engine 0 takes the update
        assert "digest mismatch" in record["message"], record["message"]
        assert urls[1] in record["message"] and urls[1] in after["why_full"]
        assert not record["wrong"][urls[0]], (what, record["wrong"])
        assert record["wrong_before"][urls[1]] == [
            "rank 1: model.layers.0.mlp.down_proj.weight"
        ], (what, record["wrong_before"])
        return
    # engine 0 received every region and refused in its apply step: only its answer says
    # so. One outcome per engine: engine 1 answered success and holds the update, engine 0
    # holds what it held; the trainer commits no snapshot, so the next update is full.
    refused, took = record["engines"][urls[0]], record["engines"][urls[1]]
    assert not refused["success"] and not refused["mixed"], refused
    assert "refused before any write" in refused["message"], refused
    assert took["success"], took
    assert urls[0] in record["message"] and urls[0] in after["why_full"]
    assert not record["wrong"][urls[1]], (what, record["wrong"])
    assert not record["wrong_before"][urls[0]], (what, record["wrong_before"])


def test_delta_updates_after_adamw_steps_are_exact_and_small(delta_servers):
    servers, faults, model_dir = delta_servers
    urls = [s.url for s in servers]
    steps = (
        [("full", None)]
        + [("train", 1e-5)] * STEPS_AT_1E5
        + [("train", 1e-6)] * STEPS_AT_1E6
        + [("corrupt", os.path.join(faults[1], "corrupt_param.rank1"))]
        + [("train", 1e-6)] * 3
        + [("refuse", os.path.join(faults[0], "refuse_apply.rank0"))]
        + [("train", 1e-6)] * 2
        + [("leave", urls[1]), ("train", 1e-6), ("join", urls[1])]
        + [("train", 1e-6)] * 2
    )
    corrupted = STEPS_AT_1E5 + STEPS_AT_1E6 + 1
    refused = corrupted + 3
    left, joined = refused + 2, refused + 3
    full_after = {0: "no update delivered", corrupted + 1: "failed"}
    full_after.update({refused + 1: "failed", left: "epoch", joined: "epoch"})
    job = _job("delta", urls, model_dir, TIMEOUT_S, steps=steps)
    results = run_ranks(4, delta_trainer_job, job, timeout=1500)
    records = results[0]
    assert len(records) == joined + 2, len(records)
    strip = ("seconds", "phases", "wrong", "wrong_before", "loss")
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
        if i in (corrupted, refused):
            _check_refused(records, i, urls, "corrupt" if i == corrupted else "refuse")
            assert delta["next"] == "full", (what, delta)
            assert record["update_id"] in delta["next_why_full"], (what, delta)
            continue
        assert delta["next"] == "delta" and not delta["next_why_full"], (what, delta)
        assert record["success"], (what, record["message"])
        members = sorted(record["engines"])
        assert members == sorted(urls[:1] if i == left else urls), (what, members)
        assert all(not record["wrong"][u] for u in members), (what, record["wrong"])
        if i in full_after:
            assert delta["mode"] == "full", (what, delta)
            assert full_after[i] in delta["why_full"], (what, delta["why_full"])
        else:
            assert delta["mode"] == "delta", (what, delta)
        _check_bytes(record, what)
    print("delta updates, FSDP 4 fp32 -> 2 bf16 engines of TP 2:\n" + "\n".join(rows))


def test_trainer_rank_killed_mid_delta_then_fresh_ranks_update_in_full(delta_servers):
    """Two trainer ranks: a full update, a delta after an AdamW step, then trainer rank 1 dies
    in its first round of the next delta. The other rank fails within its bound naming the
    lost rank; every engine keeps the weights delivered last, bit for bit, and serves; fresh
    trainer ranks (a restarted job, same group name) update them in full, exactly, then by
    delta."""
    from delta_cases import delta_death_job

    servers, _, model_dir = delta_servers
    urls = [s.url for s in servers]
    job = _job("delta-death", urls, model_dir, DEATH_TIMEOUT_S)
    survivor, dead = run_ranks(2, delta_death_job, job, timeout=900, may_die=[1])
    assert dead is None, "trainer rank 1 did not die"
    first, second = survivor["reports"]
    assert first["success"] and first["delta"]["mode"] == "full", first["message"]
    assert second["success"] and second["delta"]["mode"] == "delta", second["message"]
    died = survivor["died"]
    message = died.get("raised") or died.get("message")
    assert not died["success"] and died["seconds_here"] < DEATH_BOUND_S, died
    assert "trainer rank 0" in message and "[1]" in message, message
    assert survivor["stale"] == {u: [] for u in urls}, survivor["stale"]
    assert all(survivor["new"][u] for u in urls), "the new weights equal the old ones"
    for server in servers:
        status, _ = server.generate([[5, 17, 42, 7]], 4)
        assert status == 200, "an engine no longer serves after the trainer rank died"
    fresh = dict(job, port=free_port(), timeout=TIMEOUT_S)
    fresh["steps"] = [("full", None), ("train", 1e-5)]
    records = run_ranks(2, delta_trainer_job, fresh, timeout=900)[0]
    for i, record in enumerate(records):
        what = f"fresh trainer update {i}"
        assert record["success"], (what, record["message"])
        assert all(not w for w in record["wrong"].values()), (what, record["wrong"])
        _check_bytes(record, what)
    assert records[0]["delta"]["mode"] == "full", records[0]["delta"]
    assert "no update delivered" in records[0]["delta"]["why_full"]
    assert records[1]["delta"]["mode"] == "delta", records[1]["delta"]


def test_a_trainer_that_does_not_hear_the_engines_never_mixes(delta_servers):
    """``drive=False`` (verl: the rollout workers send the engines their requests): the
    trainer commits its snapshot when its rounds succeed, whatever the engines answer. Engine
    0 refuses a delta in its apply step (update 2; the trainer reports success, as it cannot
    know): it keeps its old weights and refuses the next delta before any byte moves,
    naming why, rather than decoding it on a base the trainer does not expect (with digests
    every 8th update only, nothing else would catch it). The group agreed on that refusal
    before any byte moved, so the epoch goes on: its next update is full, exact
    everywhere, and deltas resume."""
    from delta_cases import delta_undriven_job

    servers, faults, model_dir = delta_servers
    urls = [s.url for s in servers]
    flag = os.path.join(faults[0], "refuse_apply.rank0")
    job = _job("delta-undriven", urls, model_dir, TIMEOUT_S, flag=flag, digest_every=8)
    records = run_ranks(2, delta_undriven_job, job, timeout=900)[0]
    modes = [r["delta"]["mode"] for r in records]
    wrong = [
        len(r["wrong"][urls[0]]) for r in records
    ]  # engine 0's, against the trainer
    # update 3 is refused before its rounds: nothing was sent, its summary says so
    assert modes == ["full", "delta", "delta", "refused", "full", "delta"], (
        modes,
        wrong,
    )
    for i in (0, 1, 4, 5):
        assert records[i]["success"], (i, records[i]["message"])
        assert all(a["success"] for a in records[i]["heard_here"].values()), i
        assert all(not w for w in records[i]["wrong"].values()), (i, records[i])
    refused, after = records[2], records[3]
    assert refused["success"], "the trainer cannot hear the refusal"
    answer = refused["heard_here"][urls[0]]
    assert not answer["success"] and "refused before any write" in answer["message"]
    assert refused["heard_here"][urls[1]]["success"], refused["heard_here"]
    assert not refused["wrong"][urls[1]] and not refused["wrong_kept"][urls[0]]
    assert not after["success"], (
        "a delta was sent onto a base the trainer did not expect"
    )
    assert "a full update must come first" in after["message"], after["message"]
    assert not after["wrong_kept"][urls[0]], after["wrong_kept"]
    assert refused["update_id"] in after["message"], after["message"]
    # it was to be a delta; the next update is full because it was refused, and says so
    assert after["delta"]["planned"] == "delta", after["delta"]
    assert after["delta"]["why_full"] == "", after["delta"]
    assert after["delta"]["next"] == "full", after["delta"]
    because = f"update {after['update_id']} was refused"
    assert after["delta"]["next_why_full"].startswith(because), after["delta"]
    assert sum(after["bytes_sent"]) == 0, after["bytes_sent"]
    assert sum(after["delta"]["wire_bytes"]) == 0, after["delta"]
    # refused by the group's agreement before any byte moved: the epoch goes on
    assert after["epoch"] == records[4]["epoch"], [r["epoch"] for r in records]
    assert records[4]["delta"]["why_full"].startswith(because), records[4]["delta"]


def test_megatron_tp2_pp2_delta_updates_are_exact(delta_servers):
    """A megatron-core GPTModel at TP 2 x PP 2 (fused QKV and fc1, padded vocab) updates one
    server with deltas after Adam-sized steps: each update bit-exact, and small. The engine
    refuses one delta in its apply step: nothing of it is written (it holds the update
    before, bit for bit), the next update is full and exact, and deltas resume."""
    from delta_cases import megatron_delta_job

    servers, faults, model_dir = delta_servers
    refused = 3
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
        steps=5,
        lr=1e-5,
        bucket=1 << 20,
        timeout=TIMEOUT_S,
        refuse=(refused, os.path.join(faults[0], "refuse_apply.rank1")),
    )
    records = run_ranks(4, megatron_delta_job, job, timeout=1500)[0]
    for i, record in enumerate(records):
        what = f"megatron update {i}"
        if i == refused:
            assert not record["success"], what
            assert "refused before any write" in record["message"], record["message"]
            assert not record["wrong_before"], (what, record["wrong_before"][:5])
            assert record["wrong"], "the refused update's weights equal the old ones"
            continue
        assert record["success"], (what, record["message"])
        assert not record["wrong"], (what, record["wrong"][:5])
        full = i in (0, refused + 1)
        assert record["delta"]["mode"] == ("full" if full else "delta"), what
        if i == refused + 1:
            assert records[refused]["update_id"] in record["delta"]["why_full"]
        _check_bytes(record, what)
    print(
        "megatron TP 2 x PP 2 -> TP 2, deltas: "
        + ", ".join(
            f"density {r['delta']['density']:.4f} wire {sum(r['delta']['wire_bytes'])}/"
            f"{sum(r['delta']['full_bytes'])}"
            for r in records
        )
    )


def test_engines_of_different_layouts_in_one_group_take_exact_deltas(
    delta_servers, tmp_path
):
    """One group of a TP 2 and a TP 1 server (each engine its own plan class): after a
    full update and three AdamW steps, each delta leaves every parameter of both engines
    bit for bit what a full update writes, and each engine received the records of its
    own regions: fewer bytes than its full update, at most 5% of them at a density of at
    most 3%."""
    from servers import launch

    servers, _, model_dir = delta_servers
    single = launch(model_dir, 1, log_dir=str(tmp_path))
    try:
        urls = [servers[0].url, single.url]
        steps = [("full", None)] + [("train", 1e-5)] * 3
        job = _job(
            "delta-mixed", urls, model_dir, TIMEOUT_S, steps=steps, tp_of={urls[1]: 1}
        )
        records = run_ranks(4, delta_trainer_job, job, timeout=900)[0]
    finally:
        single.kill()
    rows = []
    for i, record in enumerate(records):
        what = f"mixed-layout update {i}"
        delta = record["delta"]
        assert record["success"], (what, record["message"])
        assert sorted(record["engines"]) == sorted(urls), what
        assert all(not record["wrong"][u] for u in urls), (what, record["wrong"])
        assert delta["mode"] == ("full" if i == 0 else "delta"), (what, delta)
        per_engine = {}
        for url, tp in zip(urls, (TP, 1)):
            engine, reply = delta["engines"][url], record["engines"][url]
            assert len(reply["bytes_received"]) == tp, (what, url, reply)
            assert engine["wire_bytes"] == sum(reply["bytes_received"]), (what, url)
            assert engine["full_bytes"] == sum(reply["lower_bound_bytes"]), (what, url)
            wire, full = engine["wire_bytes"], engine["full_bytes"]
            if i == 0:
                assert wire == full, (what, url, wire, full)
            else:
                assert wire <= 1.01 * full, (what, url, wire, full)
                if engine["density"] <= 0.03:
                    assert wire <= 0.05 * full, (what, url, engine["density"], wire)
            per_engine[f"TP {tp}"] = (
                f"{wire}/{full} bytes, density {engine['density']:.4f}"
            )
        rows.append(f"  {what}: {delta['mode']}: {per_engine}")
    print("delta updates, FSDP 4 fp32 -> TP 2 + TP 1 in one group:\n" + "\n".join(rows))
