"""The tensor counts of real MoE models: their HF configs' shapes (public ``config.json``
values), built on the meta device with ``transformers``' own classes, so every checkpoint
name and shape is the real one and no data exists. For tests of what grows with the number
of tensors (payload headers, layouts) at the size users run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple

import torch

__all__ = ("REAL_MOE", "RealMoe", "checkpoint_shapes", "saved_shapes")


@dataclass(frozen=True)
class RealMoe:
    """A model's ``model_type``, its config values, and how many routed-expert tensors
    its checkpoint has (layers with experts x experts x 3)."""

    model_type: str
    config: Dict[str, object] = field(hash=False)
    expert_tensors: int


_MLA = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    n_shared_experts=1,
    num_experts_per_tok=8,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    tie_word_embeddings=False,
)

REAL_MOE = {
    "qwen3-30b-a3b": RealMoe(
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
        ),
        48 * 128 * 3,
    ),
    "deepseek-v3": RealMoe(
        "deepseek_v3",
        dict(
            _MLA,
            vocab_size=129280,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=256,
            first_k_dense_replace=3,
        ),
        58 * 256 * 3,
    ),
    "kimi-k2": RealMoe(
        "deepseek_v3",
        dict(
            _MLA,
            vocab_size=163840,
            num_attention_heads=64,
            num_key_value_heads=64,
            n_routed_experts=384,
            first_k_dense_replace=1,
        ),
        60 * 384 * 3,
    ),
}


def checkpoint_shapes(model: str) -> Dict[str, Tuple[int, ...]]:
    """Every checkpoint tensor of ``model`` (a key of ``REAL_MOE``) and its shape."""
    import transformers

    spec = REAL_MOE[model]
    return saved_shapes(
        transformers.AutoConfig.for_model(spec.model_type, **spec.config)
    )


def saved_shapes(config) -> Dict[str, Tuple[int, ...]]:
    """Every checkpoint tensor of a model of ``config`` and its shape, named as
    ``save_pretrained`` writes them: ``transformers`` keeps a layer's experts fused in its
    modules and splits them into per-expert tensors on saving (its
    ``revert_weight_conversion``), as real checkpoints hold them. Built on the meta device."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    saved = revert_weight_conversion(hf, hf.state_dict())
    return {n: tuple(t.shape) for n, t in saved.items()}
