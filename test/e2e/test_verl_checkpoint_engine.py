"""verl 0.9.1's checkpoint-engine registry selects our ``sglang_remote`` backend with no
verl patch: ``checkpoint_engine.custom_backend_module`` names
``sglang.srt.weight_sync.remote.verl_checkpoint_engine`` (verl imports it on every worker) and
``checkpoint_engine.backend=sglang_remote`` picks it.

verl's own code runs: ``CheckpointEngineRegistry`` (import, registration, ``new``,
``get(...).build_topology``), the rollout side's ``CheckpointEngineWorker`` (its
``__init__``, ``execute_checkpoint_engine`` and ``update_weights``, which hands what our
engine yields to verl's ``ServerAdapter.update_weights`` and so to this wheel's
``weight_sync.utils.update_weights``), the actor side's construction of the engine as
``engine_workers`` makes it and ``send_weights`` with ``FSDPEngine.get_per_tensor_param``'s
producer, stock and with the companion patch (``integrations/verl``). Stand-ins: the Ray
dispatch of ``CheckpointEngineManager`` (``verl_ce_cases``), verl's server actor lookup.

Two FSDP2 fp32 actor ranks update one TP-2 bf16 server, in a process tree of its own,
through the weight-sync group: every step leaves the server's parameters bit-exact and its
greedy generation HF's, the rollout workers hold no weight (one engine request each), and
every engine rank received exactly its parameters' bytes, the group persists across steps
(the engine joins once); with the patched producer the actor ranks send within 10% of each
other.
"""

from __future__ import annotations

import pytest
from ports import free_port
from ranks import run_ranks
from remote_checks import check_state, prompts_for
from verl_ce_cases import verl_ce_job
from verl_helpers import give_tokenizer, verl_sources

TP = 2
STEPS = [("patched", 1), ("stock", 2), ("patched", 3)]


@pytest.fixture
def server(remote_tp2_servers):
    """The first of the remote-engine tests' TP-2 servers (``conftest.remote_tp2_servers``),
    its model directory given the tokenizer verl's ``HFModelConfig`` loads."""
    (first, _), model_dir, config, directory = remote_tp2_servers
    if not (model_dir / "tokenizer_config.json").exists():
        give_tokenizer(model_dir, directory)
    return first, model_dir, config, directory


def _job(server, steps, name: str, **engine_kwargs) -> dict:
    """The job of ``verl_ce_cases.verl_ce_job``: 2 actor ranks, 2 rollout workers, ``steps``."""
    server, model_dir, _, directory = server
    work = directory / name
    work.mkdir()
    return dict(
        actors=2,
        tp=TP,
        url=server.url,
        dir=str(work),
        model_dir=str(model_dir),
        steps=steps,
        prompts={seed: prompts_for(model_dir, seed) for _, seed in steps},
        rollout_port=free_port(),
        verl_sources=verl_sources(work),
        engine_kwargs=dict(
            rollout_tp=TP,
            group_name=name,
            timeout_s=60,
            port=free_port(),
            **engine_kwargs,
        ),
    )


def test_verl_checkpoint_engine_registry_selects_sglang_remote(server):
    job = _job(server, STEPS, "verl-test")
    server, model_dir, config, directory = server
    prompts = job["prompts"]
    results = run_ranks(4, verl_ce_job, job, timeout=900)
    actors, rollouts = results[:2], results[2:]
    for step, (kind, seed) in enumerate(STEPS):
        check_state(
            actors[0][step]["state"],
            model_dir,
            config,
            seed,
            prompts[seed],
            f"step {step + 1} ({kind})",
        )
        leader = rollouts[0][step]
        assert rollouts[1][step]["replies"] == [], (
            "a non-leader rollout worker drove the engine"
        )
        [reply] = leader["replies"]
        assert (
            reply["success"] and reply["bytes_received"] == reply["lower_bound_bytes"]
        ), reply
        assert leader["steps_reported"][-1] == step + 1, leader["steps_reported"]
        for r in rollouts:
            [(name, numel, joins)] = r[step]["held"]
            assert name.startswith("__sglang") and numel < 4096, r[step]["held"]
            assert joins == (step == 0), "the group did not persist across updates"
        sent = [dict(a[step]["metrics"], **{"weight_sync/seconds": 0}) for a in actors]
        assert sent[0] == sent[1], sent
        if kind == "patched":
            assert (
                sent[0]["weight_sync/bytes_sent_max"]
                <= 1.1 * sent[0]["weight_sync/bytes_sent_min"]
            ), sent
    print(
        f"verl 0.9.1 checkpoint engine {job['engine_kwargs']}: per step, actor ranks sent "
        f"{[a['metrics'] for a in actors[0]]}; engine ranks received "
        f"{[s['replies'][0]['bytes_received'] for s in rollouts[0]]} (= lower bound)"
    )


def test_verl_checkpoint_engine_delta_switch(server):
    """``engine_kwargs.sglang_remote.delta``: the first update is full (at the lower bound),
    the same weights again travel as headers only, new weights as whole regions within 1%
    of a full update; every step bit-exact."""
    steps = [("patched", 4), ("patched", 4), ("patched", 5)]
    job = _job(server, steps, "verl-delta", delta=True, digest_every=1)
    _, model_dir, config, _ = server
    prompts = job["prompts"]
    results = run_ranks(4, verl_ce_job, job, timeout=900)
    actors, rollouts = results[:2], results[2:]
    for step, (kind, seed) in enumerate(steps):
        what = f"step {step + 1} ({kind}, seed {seed})"
        check_state(
            actors[0][step]["state"], model_dir, config, seed, prompts[seed], what
        )
        [reply] = rollouts[0][step]["replies"]
        assert reply["success"], (what, reply)
        received, bound = sum(reply["bytes_received"]), sum(reply["lower_bound_bytes"])
        metrics = actors[0][step]["metrics"]
        assert metrics["weight_sync/delta"] == float(step > 0), (what, metrics)
        if step == 0:
            assert received == bound, (what, reply)
        elif step == 1:
            assert metrics["weight_sync/density"] == 0 and received < bound / 20, (
                what,
                received,
                bound,
            )
        else:
            assert metrics["weight_sync/density"] > 0.5, (what, metrics)
            assert bound <= received <= 1.01 * bound, (what, received, bound)
