"""Targets derived from SGLang's own loaders (``weight_sync.derive.derived_targets``) equal SGLang's real load.

For every architecture below, every engine TP size T in {1, 2, 4, 8} the model allows
(MoE models also at EP 2 and 4) and sampled ranks, a worker process acts as engine rank r
(``sglang_fakes``), derives the rank's targets on the meta device (SGLang's ``load_weights``
under the load recorder, nothing allocated) and loads the real model on CPU from
index-encoded checkpoint tensors. Every parameter SGLang loaded must equal, element by
element, what the derived pieces and zero boxes say; every parameter that holds checkpoint
data must be a target; the tensors loading computes (MLA's ``w_kc``/``w_vc``, Gemma's
``weight + 1``) must be listed for refresh, and SGLang's refresh after parameters are written
in place (as an update does) must recompute them in their own storage (CUDA graphs hold it). Both platforms, each in its own worker: the default (CUDA
loader branches) and SGLang's CPU engine, whose config adjustment pads heads and
intermediate sizes that do not divide T (8 q / 2 kv heads at T 4 and 8 here): the padding
is what the loader writes, so it is in the derived targets as zero boxes.

The targets compared are the engine's derivation.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Tuple

import pytest
import sglang_fakes  # noqa: E402
import torch
from derived_cases import (
    ARCHS,
    BASE,
    CASES,
    REFUSED,
    UNLOADABLE,
    load_problems,
)

from sglang.srt.weight_sync.derive.derived_targets import RankTargets  # noqa: E402

# isort: split
# pr: scale
from sglang.srt.weight_sync.derive.repeated_layers import sample_layers  # noqa: E402

# pr: scale end
# isort: split
# pr: here
import transformers
from derived_cases import RULE_ARCHS

from benchmark.weight_sync.hand_rules import model_targets_from_config  # noqa: E402
from sglang.srt.weight_sync.target_layout import EngineParallel  # noqa: E402

# pr: here end

MODES = ("default", "cpu")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """SGLang's real load and the derived targets of every case, one worker per platform, in parallel."""
    base = tmp_path_factory.mktemp("derived")

    def run(mode):
        job = {
            "mode": mode,
            "workdir": str(base / mode),
            "derive": True,
            "configs": {a: ARCHS[a][0] for a in ARCHS},
            "cases": [list(c) for c in CASES],
        }
        return sglang_fakes.run_job_in_worker(job, base, mode)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(MODES, pool.map(run, MODES)))


_FULL: Dict[Tuple[str, str], Dict[str, torch.Tensor]] = {}


def _full(loaded, mode: str, arch: str) -> Dict[str, torch.Tensor]:
    """The index-encoded checkpoint of ``arch`` (built once per platform)."""
    if (mode, arch) not in _FULL:
        _FULL[mode, arch] = sglang_fakes.index_encoded(
            loaded[mode]["checkpoints"][arch]["tensors"]
        )
    return _FULL[mode, arch]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_derived_targets_equal_sglang_load(loaded, mode, case):
    result_set = loaded[mode]
    result = result_set["results"][case[0]]
    fails_in = UNLOADABLE.get((case[1], mode))
    if fails_in:
        error = result.get("error", "")
        assert "load_rank" in error and fails_in in error, (
            f"{case[0]} ({mode}): SGLang's own load was expected "
            f"to fail in {fails_in} on {BASE}; got {error or 'no error'}"
        )
        return
    if "error" in result:
        pytest.fail(
            f"{case[0]} ({mode}): SGLang could not build, load or derive:\n{result['error']}"
        )
    problems = load_problems(
        result, _full(loaded, mode, case[1]), REFUSED.get(case[1], "")
    )
    if problems:
        pytest.fail(
            f"{case[0]} ({mode}, config changes {result['config_changes']}):\n"
            + "\n".join(problems[:8]),
            pytrace=False,
        )


# pr: scale
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_repeated_layers_loaded_once_equal_every_layer_loaded(loaded, mode, arch):
    """The engine's derivation loads each kind of repeated layer once (its first and last layer)
    and renames the first for the others; it must give exactly what loading every layer gives,
    and must not have needed to load them: every architecture here has a kind of 3 layers or
    more, whose middle layers SGLang's loaders never saw."""
    compared = 0
    for case_id, a, *_ in CASES:
        result = loaded[mode]["results"][case_id]
        if a != arch or "error" in result:
            continue  # errors are test_derived_targets_equal_sglang_load's
        sampling = sample_layers(result["layout"].tensors)
        assert sampling is not None and any(k.renamed for k in sampling.kinds), case_id
        assert result["derived"] == result["every_layer"], case_id
        compared += 1
    assert compared >= (0 if (arch, mode) in UNLOADABLE else 1)


# pr: scale end
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_checkpoint_layout_is_what_save_pretrained_writes(loaded, arch):
    """Names and shapes from the HF model on meta (the engine's source) equal the files on disk."""
    saved = loaded["default"]["checkpoints"][arch]
    layout = loaded["default"]["results"][f"{arch}-tp1-ep1-r0"]["layout"]
    assert [(n, list(s)) for n, s, _ in layout.tensors] == [
        (n, list(s)) for n, s in saved["tensors"]
    ]
    tied = saved["config"].get("tie_word_embeddings") or (
        saved["config"].get("text_config") or {}
    ).get("tie_word_embeddings")
    assert bool(layout.aliases) == bool(tied)


# pr: here
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", RULE_ARCHS)
def test_hand_rules_equal_derived_targets(loaded, mode, arch):
    """The simulator's hand-written rules (``benchmark/weight_sync/hand_rules.py``) describe
    exactly what derivation finds, wherever both exist (on the CPU engine, only where it
    does not pad): the same pieces and zero boxes."""
    result_set = loaded[mode]
    config = transformers.AutoConfig.from_pretrained(
        result_set["checkpoints"][arch]["dir"]
    )
    compared = 0
    for case_id, a, tp, rank, ep, _ in CASES:
        result = result_set["results"][case_id]
        if a != arch or result.get("config_changes"):
            continue
        rules = model_targets_from_config(
            config, EngineParallel(tp, moe_ep_size=ep), torch.float32
        ).for_rank(rank)
        as_set = lambda ts: {
            (t.name, t.shape, frozenset(t.pieces), frozenset(t.zeros)) for t in ts
        }  # noqa: E731
        assert as_set(rules) == as_set(result["derived"].targets), case_id
        compared += 1
    assert compared >= 1


# pr: here end
def test_builtins_round_trip(loaded):
    """A rank's description as cached on disk and exchanged between TP ranks is plain data and loses nothing."""
    for case_id in (
        "gpt_oss-tp2-ep1-r1",
        "deepseek_v3-tp8-ep2-r7",
        # pr: scale
        "qwen2_moe-tp4-ep4-r3",
        # pr: scale end
    ):
        derived = loaded["default"]["results"][case_id]["derived"]
        plain = derived.to_builtins()
        assert json.loads(json.dumps(plain)) == plain
        assert RankTargets.from_builtins(plain) == derived, case_id
    gpt_oss = RankTargets.from_builtins(
        loaded["default"]["results"]["gpt_oss-tp2-ep1-r1"]["derived"].to_builtins()
    )
    assert any(
        p.perm for t in gpt_oss.targets for p in t.pieces
    )  # gpt-oss experts land transposed
