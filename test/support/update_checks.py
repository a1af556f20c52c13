"""The engine-update runner and its oracle, shared by the e2e and reliability tests.

* ``run``: trainer ranks (``ranks.run_ranks``) update a real CPU engine step by step
  (``update_cases.engine_job``), gathers forbidden; returns every rank's records.
* ``expected_checksums``: every engine rank's parameter checksums after an update, from the
  simulator's hand rules (``benchmark/weight_sync/hand_rules.py``: SGLang's slicing written
  out by hand). Test modules take ``model_targets_from_config`` from here too.
* ``check_update``: a record's parameters bit-exact and its greedy generation HF's.
* ``engine_figures``: every engine rank's figures from ``SGLANG_TEST_FIGURES_LOG``
  (``sitecustomize``): [update_id, rank, received, lower_bound, staged] rows.
"""

from __future__ import annotations

import tiny_models
import torch
from engine import hf_greedy, stable_prompts
from ranks import run_ranks
from update_cases import (
    GATHERING_CHECKER,
    MAX_NEW,
    checksum,
    engine_job,
    new_weights,
)

import sglang
from benchmark.weight_sync.hand_rules import model_targets_from_config, reference_param

__all__ = [
    "check_update",
    "engine_figures",
    "expected_checksums",
    "model_targets_from_config",
    "run",
]


def engine_figures(directory) -> list:
    """[update_id, rank, received, lower_bound, staged] of every engine rank's update so far."""
    import json
    from pathlib import Path

    rows = []
    for f in Path(directory).iterdir():
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def expected_checksums(config, weights, tp: int, ep: int):
    from sglang.srt.weight_sync.target_layout import EngineParallel

    targets = model_targets_from_config(
        config, EngineParallel(tp, moe_ep_size=ep), torch.bfloat16
    )
    return {
        r: {t.name: checksum(reference_param(t, weights)) for t in targets.for_rank(r)}
        for r in range(tp)
    }


def check_update(record, model_dir, config, seed, tp, prompts, ep=1):
    """Parameters bit-exact and greedy generation equal to HF's (when ``prompts`` are given)."""
    weights = new_weights(model_dir, seed)
    expected = expected_checksums(config, weights, tp, ep)
    for r in range(tp):
        got = {n: record["checksums"][r][n] for n in expected[r]}
        wrong = sorted(n for n in expected[r] if got[n] != expected[r][n])
        assert not wrong, (
            f"{record['step']}: engine rank {r} parameters differ from SGLang's slicing: {wrong[:5]}"
        )
    if prompts is None:
        return
    reference = hf_greedy(model_dir, prompts[seed], MAX_NEW, weights=weights)
    assert record["generation"] == reference, (
        f"{record['step']}: generation differs from HF transformers"
    )


def run(
    kind,
    tp,
    world,
    steps,
    tmp_path,
    generate=True,
    reports_dir=None,
    host=None,
    **engine_kwargs,
):
    """Run the steps; each weight set gets prompts whose greedy path has no bf16 near-tie
    for it, which makes exact comparison with HF meaningful. With ``reports_dir`` every
    rank writes its update reports there (``update_cases._write_report``). ``host``: what
    hosts each engine (a picklable class with ``hosted_engine.HostedEngine``'s interface;
    None: that one)."""
    model_dir, config = tiny_models.make_tiny_model(kind, tmp_path / kind)
    seeds = sorted(
        {
            seed
            for kind_, _, seed in steps
            if kind_ not in ("fail", "verl_bad", "memory", "released")
        }
    )
    prompts = None
    if generate:
        prompts = {
            s: stable_prompts([(model_dir, new_weights(model_dir, s))], 3, MAX_NEW)
            for s in seeds
        }
        prompts["start"] = stable_prompts([model_dir], 3, MAX_NEW)
    forbidden_log = tmp_path / "forbidden-calls"
    forbidden_log.mkdir()
    job = dict(
        model_dir=model_dir,
        tp=tp,
        steps=steps,
        engine_kwargs=engine_kwargs,
        prompts=prompts or {"start": None},
        generate=generate,
        forbidden_log=str(forbidden_log),
        reports_dir=reports_dir,
        host=host,
    )
    results = [r for r in run_ranks(world, engine_job, job, timeout=600) if r]
    for records in results:
        for record in records[1:]:
            assert record["forbidden_calls"] == 0, (
                f"{record['step']}: full_tensor/gather_object called during the update"
            )
    # the recorder is live in the engine's processes: it saw the weight checker's gathers (only
    # 0.5.23's and 0.5.15.post1's checkers gather objects; older releases read the parameters without any)
    if tp > 1 and sglang.__version__.split("+")[0] in GATHERING_CHECKER:
        assert any(f.read_text() for f in forbidden_log.iterdir()), (
            "forbidden-call recorder is not active"
        )
    return model_dir, config, prompts, results
