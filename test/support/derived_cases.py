"""The architectures and cases of the derived-targets tests, and their oracle, shared by the
CPU (``test/unit/test_derived_targets.py``) and CUDA (``test/gpu/test_derived_cuda.py``) runs.

``ARCHS`` (tiny configs of the architectures checked, their T and EP sizes), ``CASES`` (one per
architecture, T, EP and sampled rank), what a release refuses (``REFUSED``) or cannot load
(``UNLOADABLE``), and ``load_problems``: what differs between SGLang's real load and the
derived targets, element by element on index-encoded checkpoints.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import sglang_fakes
import torch

from benchmark.weight_sync.hand_rules import reference_param

__all__ = [
    "ARCHS",
    "BASE",
    "CASES",
    "Case",
    "MOE_LAYOUTS",
    "REFUSED",
    # pr: here
    "RULE_ARCHS",
    # pr: here end
    "UNLOADABLE",
    "load_problems",
]

# 3 decoder layers (4 for DeepSeek, whose first is dense): a kind of repeated layer whose middle
# layer the engine's derivation does not load but renames from the first (``derive.repeated_layers``)
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
    # pr: scale
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
    # pr: scale end
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
    # pr: scale
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
    # pr: scale end
    "deepseek_v3": (_DSV3, (1, 2, 4, 8), (1, 2, 4), {}),
    # pr: scale
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
    # pr: scale end
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
    # pr: scale
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
    # pr: scale end
}
# pr: here
RULE_ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
)  # the hand rules describe these too
# pr: here end
# (rope scaling and swiglu_limit as the released Gemma 3 and gpt-oss configs have them: SGLang 0.5.12 reads both)

# What a release's own loading makes impossible to update in place, and what the refusal must
# name: 0.5.12's and 0.5.15.post1's GemmaRMSNorm (Gemma 2's norms) computes gemma_weight = weight + 1 into a new
# tensor in its weight loader, and nothing recomputes it after parameters are written in place,
# so every norm weight is refused (naming gemma_weight); everything else must still equal
# SGLang's load. (Gemma 3's norms there compute nothing; 0.5.23 refreshes gemma_weight in place.)
BASE = __import__("sglang").__version__.split("+")[0]
REFUSED = {
    "0.5.12": {"gemma2": "gemma_weight"},
    "0.5.15.post1": {"gemma2": "gemma_weight"},
}.get(BASE, {})
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


def _reference(target, actual: torch.Tensor, full) -> torch.Tensor:
    return reference_param(dataclasses.replace(target, dtype=actual.dtype), full)


def load_problems(result: dict, full, refused: str = "") -> List[str]:
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
