"""Trainer ranks update SGLang engines on other GPUs or hosts: every trainer rank sends its
own shard straight to the engine ranks that need it (``remote.trainer.RemoteSync``).

Two bf16 HTTP servers of TP 2, each in a process tree of its own, join one weight-sync
group with the trainer: FSDP2 fp32 over 4 trainer ranks updates both; then a megatron-core
GPTModel at TP 2 x PP 2 updates one of them through a group of its own. After every
update every engine rank's parameters equal SGLang's slicing of the new weights bit for
bit (its own weight checker), greedy generation equals HF transformers', every engine
rank received exactly its parameters' bytes (its lower bound: it holds none of the
trainer's data) and every trainer rank sent within 10% of the mean. In the same test,
upstream's broadcast path (``init_weights_update_group`` + ``update_weights_from_distributed``,
after the gather stock trainers run) updates the same servers with other weights: bytes
and seconds side by side, and the same exactness.
"""

from __future__ import annotations

import pytest
import tiny_models
from ports import free_port
from ranks import run_ranks
from remote_cases import fsdp_trainer_job, megatron_trainer_job
from remote_checks import TP, check_state, prompts_for
from update_cases import new_weights
from update_checks import expected_checksums

TIMEOUT_S = 60


@pytest.fixture
def servers(remote_tp2_servers):
    """Two bf16 servers of TP 2 of the tiny Qwen2 (``conftest.remote_tp2_servers``)."""
    servers, model_dir, config, _ = remote_tp2_servers
    assert all(s.tp_size == TP for s in servers)
    return servers, model_dir, config


def check_bytes(report, servers, what):
    """Received = lower bound on every engine rank; sent within 10% of the mean."""
    assert report["success"], f"{what}: {report['message']}"
    for server in servers:
        reply = report["engines"][server.url]
        assert len(reply["bytes_received"]) == TP, reply
        assert reply["bytes_received"] == reply["lower_bound_bytes"], (what, reply)
        assert all(b > 0 for b in reply["bytes_received"]), reply
    sent = report["bytes_sent"]
    mean = sum(sent) / len(sent)
    assert min(sent) > 0 and max(sent) <= 1.1 * mean, (what, sent)
    received = sum(sum(report["engines"][s.url]["bytes_received"]) for s in servers)
    assert sum(sent) == received, (what, sent, received)


def check_phases(report, what):
    """The trainer rank's phases cover its update: what no phase covered (``other``) is
    under a tenth of its seconds, which are the phases' total; the rounds ran in
    ``execute`` and the engines' answers were waited for in ``engine``."""
    phases = report["phases"]
    total = phases["total_us"] / 1e6
    assert abs(report["seconds"] - total) < 1e-6, (what, report["seconds"], phases)
    assert phases["other"] < 0.1 * total, (what, phases)
    for name in ("describe", "validate", "plan", "agree", "execute", "engine"):
        assert phases[name] > 0, (what, name, phases)
    assert phases["rounds"] >= 1 and phases["bytes_moved"] == 0, (what, phases)


def test_fsdp_trainer_updates_two_remote_engines(servers):
    servers, model_dir, config = servers
    prompts = {seed: prompts_for(model_dir, seed) for seed in (2, 3)}
    job = dict(
        group="fsdp",
        prompts=prompts[2],
        port=free_port(),
        broadcast_port=free_port(),
        urls=[s.url for s in servers],
        model_dir=str(model_dir),
        tp=TP,
        seeds=[1, 2],
        broadcast_seed=3,
        bucket=1 << 20,
        timeout=TIMEOUT_S,
    )
    results = run_ranks(4, fsdp_trainer_job, job, timeout=900)
    first = results[0]
    for step, seed in enumerate(job["seeds"]):
        reports = [dict(r["ours"][step], seconds=0, phases={}) for r in results]
        assert all(r == reports[0] for r in reports[1:]), (
            "trainer ranks report differently"
        )
        check_bytes(results[0]["ours"][step], servers, f"update {step}")
        for r in results:
            check_phases(r["ours"][step], f"update {step}")
    check_state(first["state"], model_dir, config, 2, prompts[2], "ours")
    broadcast = first["broadcast"]
    assert all(r["success"] for r in broadcast["replies"]), broadcast["replies"]
    from remote_cases import server_state

    after = server_state([s.url for s in servers], prompts[3])
    check_state(after, model_dir, config, 3, prompts[3], "upstream broadcast")
    ours = first["ours"][-1]
    rows = [
        f"  ours: {ours['seconds']:.3f}s wall on trainer rank 0; trainer ranks sent {ours['bytes_sent']} "
        f"bytes; engine ranks received {[ours['engines'][s.url]['bytes_received'] for s in servers]} "
        f"(= lower bound); per engine: receiving while serving "
        f"{[ours['engines'][s.url]['receive_seconds'] for s in servers]}s, paused "
        f"{[ours['engines'][s.url]['pause_seconds'] for s in servers]}s",
        f"  upstream broadcast: gather {broadcast['gather_s']:.3f}s + update {broadcast['update_s']:.3f}s "
        f"(group init {broadcast['join_s']:.3f}s); trainer rank 0 sent >= {broadcast['sent_by_rank0']} "
        f"bytes, every engine rank received {broadcast['received_per_engine_rank']} bytes; the whole "
        "update under the engine's writer lock",
    ]
    print("FSDP 4 fp32 ranks -> 2 bf16 engines of TP 2:\n" + "\n".join(rows))


def test_megatron_tp2_pp2_trainer_updates_a_remote_engine(servers):
    """A megatron-core GPTModel at TP 2 x PP 2 (fused QKV and fc1, padded vocab, other
    stages' layers elsewhere) updates one of the servers through a group of its own: each
    rank sends from its own local parameters straight to the engine ranks."""
    servers, model_dir, config = servers
    seed = 7
    prompts = prompts_for(model_dir, seed)
    job = dict(
        group="megatron",
        port=free_port(),
        urls=[servers[0].url],
        model_dir=str(model_dir),
        tp=2,
        pp=2,
        padded_vocab=520,
        seed=seed,
        bucket=1 << 20,
        timeout=TIMEOUT_S,
        prompts=prompts,
    )
    results = run_ranks(4, megatron_trainer_job, job, timeout=900)
    report = results[0]
    same = [
        {k: v for k, v in r.items() if k not in ("state", "seconds", "phases")}
        for r in results
    ]
    assert all(r == same[0] for r in same[1:]), "trainer ranks report differently"
    check_bytes(report, servers[:1], "megatron")
    for r in results:
        check_phases(r, "megatron")
    check_state(report["state"], model_dir, config, seed, prompts, "megatron")
    reply = report["engines"][servers[0].url]
    print(
        f"Megatron TP 2 x PP 2 -> engine TP 2: trainer ranks sent {report['bytes_sent']} bytes, engine "
        f"ranks received {reply['bytes_received']} (= lower bound) in {report['seconds']:.3f}s, paused "
        f"{reply['pause_seconds']}s"
    )


def test_qwen3_30b_a3b_tensor_count_to_a_remote_engine(tmp_path):
    """Qwen3-30B-A3B's 18,432 expert tensors (metadata-like sizes) from FSDP2 fp32 over 2
    trainer ranks into a remote TP-2 server of its own: the trainer's source layout and the
    plan at a real MoE model's tensor count; every engine rank at its lower bound and
    bit-exact (parameters only, as ``test_any_model_update`` says why)."""
    from servers import launch

    model_dir, config = tiny_models.make_tiny_model(
        "qwen3_30b_a3b_count", tmp_path / "moe"
    )
    server = launch(model_dir, TP, log_dir=str(tmp_path))
    try:
        job = dict(
            group="moe",
            prompts=[[1, 2, 3]],
            port=free_port(),
            urls=[server.url],
            model_dir=str(model_dir),
            tp=TP,
            seeds=[1],
            bucket=64 << 20,
            timeout=TIMEOUT_S,
        )
        results = run_ranks(2, fsdp_trainer_job, job, timeout=900)
    finally:
        server.kill()
    report = results[0]["ours"][0]
    check_bytes(report, [server], "qwen3-30b-a3b count")
    for rank in results:
        check_phases(rank["ours"][0], "qwen3-30b-a3b count")
    weights = new_weights(model_dir, 1)
    assert sum(".mlp.experts." in n for n in weights) == 48 * 128 * 3
    expected = expected_checksums(config, weights, TP, 1)
    got = results[0]["state"][0]["checksums"]
    for r in range(TP):
        wrong = sorted(n for n in expected[r] if got[r][n] != expected[r][n])
        assert not wrong, f"engine rank {r} differs from SGLang's slicing: {wrong[:5]}"
    print(
        f"Qwen3-30B-A3B count, FSDP 2 -> remote TP 2: {report['seconds']:.3f}s, engine ranks "
        f"received {report['engines'][server.url]['bytes_received']} (= lower bound)"
    )
