"""Model descriptions for the weight-sync simulator (metadata only, no tensors).

Each ``ModelSpec`` turns an engine layout (``EngineParallel``) into the
``ModelTargets`` our planner consumes: every SGLang parameter of the model,
which HF tensors fill it and how it is split over the engine's ranks. The
numbers are copied from the models' public Hugging Face ``config.json`` files
(named next to each config). Nothing here allocates a tensor.

Qwen3 models go through ``hand_rules.model_targets_from_config``. DeepSeek-V3 has
no config-driven hand rules, so ``deepseek_v3_targets`` below spells them out from
the rule classes, following SGLang 0.5.23 ``models/deepseek_v2.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Tuple

import torch

from benchmark.weight_sync.hand_rules import (
    ExpertsW2,
    ExpertsW13,
    Replicated,
    Rule,
    Sharded,
    Stacked,
    Vocab,
    model_targets_from_config,
)
from sglang.srt.weight_sync.target_layout import (
    EngineParallel,
    ModelTargets,
    ParamTarget,
)

# Qwen/Qwen3-8B config.json (huggingface.co/Qwen/Qwen3-8B/blob/main/config.json); the
# fields the layout needs. 8.19e9 parameters.
QWEN3_8B: Dict = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "attention_bias": False,
    "tie_word_embeddings": False,
}

# Qwen/Qwen3-235B-A22B config.json (huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json).
# 2.35e11 parameters; every layer is sparse (decoder_sparse_step 1, mlp_only_layers []).
QWEN3_235B_A22B: Dict = {
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "attention_bias": False,
    "tie_word_embeddings": False,
}

# deepseek-ai/DeepSeek-V3 config.json (huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json).
# 6.71e11 parameters in the main model. The checkpoint also carries one MTP layer
# (model.layers.61, num_nextn_predict_layers 1, ~14e9 parameters); SGLang's main model
# does not load it (a NextN draft does), so it is left out here.
DEEPSEEK_V3: Dict = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
}

# moonshotai/Kimi-K2-Instruct config.json (huggingface.co/moonshotai/Kimi-K2-Instruct): DeepSeek-V3's
# architecture with 384 routed experts, 64 heads, one dense layer; 1.03e12 parameters. The
# disaggregated simulator's 1-trillion-parameter MoE.
KIMI_K2: Dict = {
    **DEEPSEEK_V3,
    "first_k_dense_replace": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "vocab_size": 163840,
}


def deepseek_v3_targets(
    config: Mapping, parallel: EngineParallel, dtype: torch.dtype = torch.bfloat16
) -> ModelTargets:
    """Rules for DeepSeek-V3 (MLA with q_lora, MoE with one non-fused shared expert).

    As SGLang 0.5.23 builds ``DeepseekV2ForCausalLM`` (``models/deepseek_v2.py``):
    - ``fused_qkv_a_proj_with_mqa`` is a ``ReplicatedLinear``; the loader concatenates
      ``q_a_proj`` and ``kv_a_proj_with_mqa`` on dim 0 -> ``Stacked`` on group "replicated";
    - ``q_b_proj``/``kv_b_proj`` are column-parallel and ``o_proj`` row-parallel on "attn_tp";
    - ``q_a_layernorm``/``kv_a_layernorm``/layer norms are replicated;
    - ``embed_tokens`` is vocab-parallel on "attn_tp" under DP attention
      (``get_embedding_tp_kwargs``); ``lm_head`` on "tp" (``enable_dp_lm_head`` off);
    - the first ``first_k_dense_replace`` layers have a dense MLP on "tp"
      (``moe_dense_tp_size`` unset);
    - sparse layers: ``MoEGate`` weight [E, H] and ``e_score_correction_bias`` [E]
      (fp32) replicated, routed experts in ``FusedMoE`` (``w13_weight``/``w2_weight``),
      the shared expert a ``DeepseekV2MLP`` on "tp". (With a DeepEP/a2a MoE backend
      SGLang puts the shared expert on "replicated" instead, and with shared-expert
      fusion it becomes expert ``n_routed``; both are left out here.)
    """
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v_dim = (
        config["qk_nope_head_dim"],
        config["qk_rope_head_dim"],
        config["v_head_dim"],
    )
    vocab = config["vocab_size"]
    experts = config["n_routed_experts"]
    moe_inter = config["moe_intermediate_size"]
    shared_inter = moe_inter * config["n_shared_experts"]
    inter = config["intermediate_size"]

    rules: List[Rule] = [
        Vocab(
            "model.embed_tokens.weight",
            "model.embed_tokens.weight",
            (vocab, h),
            group="attn_tp",
        )
    ]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        rules += [
            Stacked(
                f"{a}.fused_qkv_a_proj_with_mqa.weight",
                (
                    (f"{a}.q_a_proj.weight", (q_lora, h)),
                    (f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, h)),
                ),
                group="replicated",
            ),
            Replicated(
                f"{a}.q_a_layernorm.weight", f"{a}.q_a_layernorm.weight", (q_lora,)
            ),
            Sharded(
                f"{a}.q_b_proj.weight",
                f"{a}.q_b_proj.weight",
                (heads * (nope + rope), q_lora),
                0,
                "attn_tp",
            ),
            Replicated(
                f"{a}.kv_a_layernorm.weight", f"{a}.kv_a_layernorm.weight", (kv_lora,)
            ),
            Sharded(
                f"{a}.kv_b_proj.weight",
                f"{a}.kv_b_proj.weight",
                (heads * (nope + v_dim), kv_lora),
                0,
                "attn_tp",
            ),
            Sharded(
                f"{a}.o_proj.weight",
                f"{a}.o_proj.weight",
                (h, heads * v_dim),
                1,
                "attn_tp",
            ),
            Replicated(
                f"{p}.input_layernorm.weight", f"{p}.input_layernorm.weight", (h,)
            ),
            Replicated(
                f"{p}.post_attention_layernorm.weight",
                f"{p}.post_attention_layernorm.weight",
                (h,),
            ),
        ]
        m = f"{p}.mlp"
        if layer < config["first_k_dense_replace"]:
            rules += _dense_mlp(m, inter, h)
        else:
            rules += [
                Replicated(f"{m}.gate.weight", f"{m}.gate.weight", (experts, h)),
                Replicated(
                    f"{m}.gate.e_score_correction_bias",
                    f"{m}.gate.e_score_correction_bias",
                    (experts,),
                ),
                ExpertsW13(
                    f"{m}.experts.w13_weight",
                    m + ".experts.{e}.gate_proj.weight",
                    m + ".experts.{e}.up_proj.weight",
                    experts,
                    moe_inter,
                    h,
                ),
                ExpertsW2(
                    f"{m}.experts.w2_weight",
                    m + ".experts.{e}.down_proj.weight",
                    experts,
                    moe_inter,
                    h,
                ),
            ]
            rules += _dense_mlp(f"{m}.shared_experts", shared_inter, h)
    rules.append(Replicated("model.norm.weight", "model.norm.weight", (h,)))
    rules.append(Vocab("lm_head.weight", "lm_head.weight", (vocab, h), group="tp"))
    return ModelTargets(tuple(rules), parallel, dtype)


def _dense_mlp(prefix: str, inter: int, h: int) -> List[Rule]:
    return [
        Stacked(
            f"{prefix}.gate_up_proj.weight",
            (
                (f"{prefix}.gate_proj.weight", (inter, h)),
                (f"{prefix}.up_proj.weight", (inter, h)),
            ),
        ),
        Sharded(
            f"{prefix}.down_proj.weight", f"{prefix}.down_proj.weight", (h, inter), 1
        ),
    ]


@dataclass(frozen=True)
class ModelSpec:
    """A model: its config and how to build its target rules for an engine layout.

    ``param_dtypes`` names SGLang parameters kept in another dtype than the
    model's (DeepSeek's ``e_score_correction_bias`` is fp32), by name suffix.
    """

    name: str
    hf_id: str
    config: Mapping
    build: Callable[[Mapping, EngineParallel, torch.dtype], ModelTargets]
    param_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)

    def targets(
        self, parallel: EngineParallel, dtype: torch.dtype = torch.bfloat16
    ) -> ModelTargets:
        return self.build(self.config, parallel, dtype)

    def for_rank(self, targets: ModelTargets, rank: int) -> List[ParamTarget]:
        """``targets.for_rank(rank)`` with the per-parameter dtype overrides applied."""
        out = targets.for_rank(rank)
        if not self.param_dtypes:
            return out
        for i, t in enumerate(out):
            dtype = self._override(t.name)
            if dtype is not None and dtype != t.dtype:
                out[i] = dataclasses.replace(t, dtype=dtype)
        return out

    def _override(self, name: str):
        for suffix, dtype in self.param_dtypes.items():
            if name.endswith(suffix):
                return dtype
        return None

    def tensor_dtype(self, tensor: str, default: torch.dtype) -> torch.dtype:
        """Dtype of an HF tensor on the trainer (the override when the tensor carries one)."""
        return self._override(tensor) or default

    def num_params(self) -> int:
        shapes = self.targets(EngineParallel(1)).tensor_shapes()
        total = 0
        for shape in shapes.values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total


MODELS: Dict[str, ModelSpec] = {
    "Qwen3-8B": ModelSpec(
        "Qwen3-8B", "Qwen/Qwen3-8B", QWEN3_8B, model_targets_from_config
    ),
    "Qwen3-235B-A22B": ModelSpec(
        "Qwen3-235B-A22B",
        "Qwen/Qwen3-235B-A22B",
        QWEN3_235B_A22B,
        model_targets_from_config,
    ),
    "DeepSeek-V3-671B": ModelSpec(
        "DeepSeek-V3-671B",
        "deepseek-ai/DeepSeek-V3",
        DEEPSEEK_V3,
        deepseek_v3_targets,
        param_dtypes={"e_score_correction_bias": torch.float32},
    ),
    "Kimi-K2-1T": ModelSpec(
        "Kimi-K2-1T",
        "moonshotai/Kimi-K2-Instruct",
        KIMI_K2,
        deepseek_v3_targets,
        param_dtypes={"e_score_correction_bias": torch.float32},
    ),
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def rule_tensors(rule: Rule) -> List[Tuple[str, Tuple[int, ...]]]:
    return list(rule.tensors().items())
