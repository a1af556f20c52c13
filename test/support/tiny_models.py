"""Tiny Hugging Face checkpoints with seeded random weights, for end-to-end engine tests.

Every model is bf16, 2 layers, vocabulary 512, saved with ``save_pretrained``
(safetensors, on-disk names exactly as SGLang's loaders expect them: per-expert
``mlp.experts.{e}.gate_proj.weight`` for MoE, no ``lm_head.weight`` when tied). No
tokenizer is written: run the engine with ``skip_tokenizer_init=True`` and token ids.

Sizes are chosen so that SGLang's CPU engine does not pad anything at TP 1, 2 or 4
(``adjust_config_with_unaligned_cpu_tp``, ``sglang/srt/configs/update_config.py``):
attention and KV head counts divisible by 4, ``intermediate_size`` and
``moe_intermediate_size`` multiples of 4 * 32 = 128 (``DEFAULT_MOE_PADDING_SIZE`` is 32
per TP rank), vocabulary a multiple of 4 * 64. The checkpoint on disk therefore has
the same shapes SGLang shards at every TP size used here, and a weight update can be
written with the HF shapes.

``eos_token_id``/``bos_token_id`` are None, so neither SGLang nor HF stops early on
some random token. Matrices use ``initializer_range=0.2`` (HF's default 0.02 gives
nearly flat logits); norm weights are 1 + N(0, 0.1) and biases N(0, 0.1) instead of
HF's constant 1 and 0, so every tensor (and every shard of it) affects the output.

bf16 near-ties: even so, some greedy steps have top-1/top-2 logits within a few bf16
ulps, and SGLang's and HF's roundings differ, so exact token comparison can flip on
arbitrary prompts (seen: 3 of 48 steps at TP 1 with gaps of 1-3 ulps). Use
``engine.stable_prompts`` for exact comparisons.

Usage::

    path, config = make_tiny_model("qwen2", tmp_path / "qwen2")
    path, config = qwen3_moe(tmp_path / "moe", seed=1, num_experts=16)

All builders take ``directory``, ``seed`` and keyword overrides of the config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple, Union

import torch

PathLike = Union[str, Path]

VOCAB = 512
INIT_RANGE = 0.2

# The HF config of each tiny model (``transformers.AutoConfig.for_model(**spec)``).
SPECS: Dict[str, dict] = {
    # GQA 8 q / 4 kv heads, head_dim 16, untied lm_head (the Qwen2 default).
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=256,
        tie_word_embeddings=False,
    ),
    # q/k RMSNorm, explicit head_dim 32 (q_proj out 256 != hidden 128), untied.
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=256,
        tie_word_embeddings=False,
    ),
    # Tied embeddings: the checkpoint has no lm_head.weight.
    "llama": dict(
        model_type="llama",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=256,
        tie_word_embeddings=True,
    ),
    # Every layer sparse (decoder_sparse_step 1, no mlp_only_layers): 8 experts, top-2.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    # Qwen3-30B-A3B's tensor count (48 layers of 128 experts, top 8: 18,432 expert tensors)
    # at metadata-like sizes: what a real MoE model's payload header and per-tensor costs
    # are, on a model this machine loads in seconds. Aligned for TP 2 only.
    "qwen3_30b_a3b_count": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    # Architectures only the derived targets describe (weight_sync.derive.derived_targets).
    # Three layers: the engine's derivation loads the first and last, and renames the first for the middle one.
    "mistral": dict(
        model_type="mistral",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=256,
        tie_word_embeddings=False,
        num_hidden_layers=3,
    ),
    # Gemma norms: SGLang keeps weight + 1 in a buffer that an update must refresh.
    "gemma2": dict(
        model_type="gemma2",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=256,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=16,
        sliding_window=64,
        tie_word_embeddings=True,
    ),
    # The checkpoint fuses qkv_proj and gate_up_proj.
    "phi3": dict(
        model_type="phi3",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=256,
        tie_word_embeddings=False,
    ),
    # DeepSeek-V3-shaped: MLA (q_lora, kv_b_proj -> w_kc/w_vc), a dense first layer, then three
    # with routed experts plus a shared expert (the middle one renamed from the first by the derivation).
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=256,
        moe_intermediate_size=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        num_hidden_layers=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        # SGLang's CPU engine builds MLA rope only as deepseek_yarn; factor 1 is plain rope
        rope_scaling=dict(
            rope_type="yarn",
            factor=1.0,
            original_max_position_embeddings=512,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        tie_word_embeddings=False,
    ),
    # gpt-oss: attention sinks, a sliding and a full layer, experts stored fused in the
    # checkpoint ([E, H, 2I] gate_up interleaved, [E, I, H] down) that SGLang loads transposed.
    "gpt_oss": dict(
        model_type="gpt_oss",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    ),
    # One kv head: SGLang's CPU engine pads heads at TP 2 (adjust_config_with_unaligned_cpu_tp).
    "llama_kv1": dict(
        model_type="llama",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=256,
        tie_word_embeddings=False,
    ),
}

COMMON = dict(
    vocab_size=VOCAB,
    num_hidden_layers=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=INIT_RANGE,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny_config(kind: str, **overrides):
    """The ``transformers`` config of tiny model ``kind`` (see ``SPECS``), bf16."""
    import transformers

    if kind not in SPECS:
        raise KeyError(f"unknown tiny model {kind!r}; known: {sorted(SPECS)}")
    spec = {**COMMON, **SPECS[kind], **overrides}
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
    config.dtype = torch.bfloat16
    return config


def make_tiny_model(
    kind: str, directory: PathLike, seed: int = 0, **overrides
) -> Tuple[Path, object]:
    """Create tiny model ``kind`` with weights seeded by ``seed`` and ``save_pretrained`` it to ``directory``.

    Returns ``(directory, config)``. The same (kind, seed, overrides) gives bit-identical weights.
    """
    import transformers

    directory = Path(directory)
    config = tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomize them too, so every tensor matters
        for name, param in model.named_parameters():
            if param.dim() == 1:
                if "norm" in name:
                    param.normal_(1.0, 0.1)
                else:
                    param.normal_(0.0, 0.1)
            elif bool(
                (param == param.flatten()[0]).all()
            ):  # e.g. gpt-oss expert biases [E, 2I], zeros
                param.normal_(0.0, 0.1)
    model = model.to(torch.bfloat16).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    written = json.loads((directory / "config.json").read_text())
    if written.get("dtype", written.get("torch_dtype")) != "bfloat16":
        raise AssertionError(
            f"{directory}/config.json does not say bfloat16: {written}"
        )
    return directory, config


def qwen2(directory: PathLike, seed: int = 0, **overrides) -> Tuple[Path, object]:
    return make_tiny_model("qwen2", directory, seed, **overrides)


def qwen3(directory: PathLike, seed: int = 0, **overrides) -> Tuple[Path, object]:
    return make_tiny_model("qwen3", directory, seed, **overrides)


def llama_tied(directory: PathLike, seed: int = 0, **overrides) -> Tuple[Path, object]:
    return make_tiny_model("llama", directory, seed, **overrides)


def qwen3_moe(directory: PathLike, seed: int = 0, **overrides) -> Tuple[Path, object]:
    return make_tiny_model("qwen3_moe", directory, seed, **overrides)


# ----------------------------------------------------------------------------------------------
# Checkpoint tensors (HF on-disk names), e.g. to build update payloads or a modified copy.


def load_checkpoint(directory: PathLike) -> Dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint in ``directory``, by its on-disk (HF) name."""
    from safetensors.torch import load_file

    out: Dict[str, torch.Tensor] = {}
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    for f in files:
        out.update(load_file(str(f)))
    return out


def write_modified_checkpoint(
    src: PathLike,
    dst: PathLike,
    weights: Mapping[str, torch.Tensor],
    allow_new: bool = False,
) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with the tensors in ``weights`` replaced (HF names).

    Each replacement must match the original's shape; it is cast to the original's dtype.
    Names not in the checkpoint raise unless ``allow_new`` (e.g. ``lm_head.weight`` of a
    tied model, which HF then ignores when ``tie_word_embeddings`` is set).
    """
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    tensors = load_checkpoint(src)
    for name, value in weights.items():
        if name in tensors:
            if tuple(value.shape) != tuple(tensors[name].shape):
                raise ValueError(
                    f"{name}: shape {tuple(value.shape)} != checkpoint {tuple(tensors[name].shape)}"
                )
            tensors[name] = value.detach().to("cpu", tensors[name].dtype).contiguous()
        elif allow_new:
            tensors[name] = value.detach().to("cpu").contiguous()
        else:
            raise KeyError(f"{name} is not in the checkpoint at {src}")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name != "model.safetensors.index.json"
        ):
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def random_like(
    tensor: torch.Tensor, seed: int, std: Optional[float] = None
) -> torch.Tensor:
    """A seeded random tensor with ``tensor``'s shape and dtype (std defaults to ``tensor``'s)."""
    g = torch.Generator().manual_seed(seed)
    scale = float(tensor.float().std()) if std is None else std
    return (torch.randn(tensor.shape, generator=g) * scale).to(tensor.dtype)
