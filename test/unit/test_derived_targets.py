"""Targets derived from SGLang's own loaders (``weight_sync.derived_targets``) equal SGLang's real load.

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

The targets compared are the engine's derivation, which loads each kind of repeated layer
once (its first and last layer) and renames the first for the others (``repeated_layers``):
every model here has a kind of 3 layers or more, so its middle layer is one SGLang's
loaders never saw while deriving; that derivation must also equal loading every layer.

Where the simulator's hand-written rules (``benchmark/weight_sync/hand_rules.py``) also describe a config, derived
and rule targets must be the same pieces and zero boxes.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Tuple

import pytest
import sglang_fakes  # noqa: E402
import torch
import transformers

from benchmark.weight_sync.hand_rules import (  # noqa: E402
    model_targets_from_config,
    reference_param,
)
from sglang.srt.weight_sync.derived_targets import RankTargets  # noqa: E402
from sglang.srt.weight_sync.repeated_layers import sample_layers  # noqa: E402
from sglang.srt.weight_sync.target_layout import EngineParallel  # noqa: E402

# 3 decoder layers (4 for DeepSeek, whose first is dense): a kind of repeated layer whose middle
# layer the engine's derivation does not load but renames from the first (``repeated_layers``)
_C = dict(hidden_size=64, num_hidden_layers=3, vocab_size=500)
_ATTN = dict(num_attention_heads=8, num_key_value_heads=2)
_DSV3 = dict(
    model_type="deepseek_v3",
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_group=2,
    topk_group=1,
    moe_layer_freq=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    tie_word_embeddings=False,
    **{**_C, "num_hidden_layers": 4},
)

# (hf kwargs, T sizes, EP sizes, extra server args)
ARCHS: Dict[str, Tuple[dict, Tuple[int, ...], Tuple[int, ...], dict]] = {
    "llama": (
        dict(
            model_type="llama",
            intermediate_size=128,
            tie_word_embeddings=True,
            attention_bias=True,
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1,),
        {},
    ),
    "mistral": (
        dict(
            model_type="mistral",
            intermediate_size=128,
            head_dim=8,
            tie_word_embeddings=False,
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1,),
        {},
    ),
    "qwen2": (
        dict(
            model_type="qwen2",
            intermediate_size=128,
            tie_word_embeddings=False,
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1,),
        {},
    ),
    "qwen2_moe": (
        dict(
            model_type="qwen2_moe",
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=64,
            tie_word_embeddings=False,
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1, 2, 4),
        {},
    ),
    "qwen3": (
        dict(
            model_type="qwen3",
            intermediate_size=128,
            head_dim=16,
            tie_word_embeddings=True,
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1,),
        {},
    ),
    "qwen3_moe": (
        dict(
            model_type="qwen3_moe",
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            tie_word_embeddings=False,
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1, 2, 4),
        {},
    ),
    "deepseek_v2_lite": (
        dict(
            model_type="deepseek_v2",
            intermediate_size=128,
            moe_intermediate_size=32,
            num_attention_heads=8,
            num_key_value_heads=8,
            n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_group=1,
            topk_group=1,
            topk_method="greedy",
            scoring_func="softmax",
            moe_layer_freq=1,
            tie_word_embeddings=False,
            **{**_C, "num_hidden_layers": 4},
        ),
        (1, 2, 4, 8),
        (1, 2, 4),
        {},
    ),
    "deepseek_v3": (_DSV3, (1, 2, 4, 8), (1, 2, 4), {}),
    "deepseek_v3_fused_shared": (
        _DSV3,
        (1, 2, 4, 8),
        (1, 2),
        {"enforce_shared_experts_fusion": True},
    ),
    "gemma2": (
        dict(
            model_type="gemma2",
            intermediate_size=128,
            hidden_act="gelu_pytorch_tanh",
            head_dim=16,
            num_attention_heads=8,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            **_C,
        ),
        (1, 2, 4, 8),
        (1,),
        {},
    ),
    "gemma3_text": (
        dict(
            model_type="gemma3_text",
            intermediate_size=128,
            head_dim=16,
            tie_word_embeddings=True,
            sliding_window=32,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1,),
        {},
    ),
    "phi3": (
        dict(
            model_type="phi3",
            intermediate_size=128,
            tie_word_embeddings=False,
            pad_token_id=0,
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1,),
        {},
    ),
    "glm4": (
        dict(
            model_type="glm4",
            intermediate_size=128,
            head_dim=8,
            tie_word_embeddings=False,
            pad_token_id=0,
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1,),
        {},
    ),
    "gpt_oss": (
        dict(
            model_type="gpt_oss",
            intermediate_size=32,
            head_dim=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            sliding_window=16,
            swiglu_limit=7.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **_ATTN,
            **_C,
        ),
        (1, 2, 4),
        (1,),
        {},
    ),
    "olmo2": (
        dict(
            model_type="olmo2",
            intermediate_size=128,
            tie_word_embeddings=False,
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1,),
        {},
    ),
    "granite": (
        dict(
            model_type="granite",
            intermediate_size=128,
            tie_word_embeddings=True,
            **_ATTN,
            **_C,
        ),
        (1, 2, 4, 8),
        (1,),
        {},
    ),
    "qwen2_5_vl": (
        dict(
            model_type="qwen2_5_vl",
            tie_word_embeddings=False,
            text_config=dict(
                vocab_size=500,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=3,
                rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
                tie_word_embeddings=False,
                **_ATTN,
            ),
            vision_config=dict(
                depth=3,
                hidden_size=32,
                intermediate_size=64,
                num_heads=4,
                out_hidden_size=64,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
                window_size=16,
                fullatt_block_indexes=[1],
                in_channels=3,
            ),
        ),
        (1, 2, 4),
        (1,),
        {},
    ),
}
RULE_ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
)  # the hand rules describe these too
# (rope scaling and swiglu_limit as the released Gemma 3 and gpt-oss configs have them: SGLang 0.5.12 reads both)

# What a release's own loading makes impossible to update in place, and what the refusal must
# name: 0.5.12's GemmaRMSNorm (Gemma 2's norms) computes gemma_weight = weight + 1 into a new
# tensor in its weight loader, and nothing recomputes it after parameters are written in place,
# so every norm weight is refused (naming gemma_weight); everything else must still equal
# SGLang's load. (Gemma 3's norms there compute nothing; 0.5.23 refreshes gemma_weight in place.)
BASE = __import__("sglang").__version__.split("+")[0]
REFUSED = {"0.5.12": {"gemma2": "gemma_weight"}}.get(BASE, {})
# (arch, platform) a release's own loaders cannot load at all, and where they fail: nothing can be
# updated there, and deriving runs the same loader code, so an update is refused with that error.
# The CPU branch of 0.5.10.post1 and 0.5.12 narrows a 3-d expert weight of gpt-oss as if it were 2-d.
_GPT_OSS_ON_CPU = {("gpt_oss", "cpu"): "narrow_padded_param_and_loaded_weight"}
UNLOADABLE = {"0.5.10.post1": _GPT_OSS_ON_CPU, "0.5.12": _GPT_OSS_ON_CPU}.get(BASE, {})

Case = Tuple[str, str, int, int, int, dict]  # (id, arch, T, rank, EP, server args)


MOE_LAYOUTS = (
    (1, 1),
    (2, 1),
    (2, 2),
    (4, 1),
    (4, 4),
    (8, 2),
)  # (T, EP): every T, every EP


def _ranks(tp: int) -> Tuple[int, ...]:
    """Every rank up to T=2; beyond, an inner and the last rank (kv-head replicas and padding differ there)."""
    return tuple(range(tp)) if tp <= 2 else (1, tp - 1)


def _cases() -> List[Case]:
    out = []
    for arch, (_, tps, eps, server_args) in ARCHS.items():
        layouts = (
            [(tp, ep) for tp, ep in MOE_LAYOUTS if ep in eps]
            if len(eps) > 1
            else [(tp, 1) for tp in tps]
        )
        for tp, ep in layouts:
            if tp in tps:
                out += [
                    (f"{arch}-tp{tp}-ep{ep}-r{r}", arch, tp, r, ep, server_args)
                    for r in _ranks(tp)
                ]
    return out


CASES = _cases()
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


def _reference(target, actual: torch.Tensor, full) -> torch.Tensor:
    return reference_param(dataclasses.replace(target, dtype=actual.dtype), full)


def _problems(result: dict, full, refused: str = "") -> List[str]:
    """What differs from SGLang's load. ``refused``: what every refusal must name on this
    release (``REFUSED``); the parameters refused are then SGLang's load's, not targets."""
    derived = result["derived"]
    targets = {t.name: t for t in derived.targets}
    params, problems = result["params"], []
    if refused:
        unnamed = {
            n: why for n, why in derived.not_copied.items() if refused not in why
        }
        if not derived.not_copied or unnamed:
            problems.append(
                f"refusals naming {refused!r} expected, got {dict(derived.not_copied)}"
            )
    elif derived.not_copied:
        problems.append(f"not copies: {dict(derived.not_copied)}")
    for name in sorted(set(targets) - set(params)):
        problems.append(f"{name}: a target but no parameter of SGLang's model")
    for name, actual in sorted(params.items()):
        target = targets.get(name)
        holds_data = bool(((actual != sglang_fakes.SENTINEL) & (actual != 0)).any())
        if target is None and name in derived.not_copied:
            continue  # the checkpoint tensor of its name is refused: an update sending it writes nothing
        if target is None:
            if holds_data:
                problems.append(
                    f"{name}: SGLang loaded data into it but it is no target: "
                    f"{sglang_fakes.describe_layout(actual, full, 4)}"
                )
            continue
        if tuple(actual.shape) != target.shape:
            problems.append(
                f"{name}: SGLang shape {tuple(actual.shape)}, derived {target.shape}"
            )
            continue
        expected = _reference(target, actual, full)
        if not torch.equal(actual, expected):
            problems.append(
                f"{name}: {int((actual != expected).sum())} elements differ; SGLang: "
                f"{sglang_fakes.describe_layout(actual, full, 4)}; derived: "
                f"{sglang_fakes.describe_layout(expected, full, 4)}"
            )
    computed = {n for n in result["computed"] if not (refused and refused in n)}
    if computed != set(derived.post_load):
        problems.append(
            f"post-load tensors: SGLang computed {sorted(computed)}, derived {sorted(derived.post_load)}"
        )
    problems += [
        f"{n}: {why}"
        for n, why in result.get("refresh_problems", {}).items()
        if not (refused and refused in n)
    ]
    return problems


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
    problems = _problems(result, _full(loaded, mode, case[1]), REFUSED.get(case[1], ""))
    if problems:
        pytest.fail(
            f"{case[0]} ({mode}, config changes {result['config_changes']}):\n"
            + "\n".join(problems[:8]),
            pytrace=False,
        )


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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", RULE_ARCHS)
def test_hand_rules_equal_derived_targets(loaded, mode, arch):
    """The simulator's hand rules describe exactly what derivation finds, wherever both exist
    (on the CPU engine, only where it does not pad)."""
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


def test_builtins_round_trip(loaded):
    """A rank's description as cached on disk and exchanged between TP ranks is plain data and loses nothing."""
    for case_id in (
        "gpt_oss-tp2-ep1-r1",
        "deepseek_v3-tp8-ep2-r7",
        "qwen2_moe-tp4-ep4-r3",
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
