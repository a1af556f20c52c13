"""Megatron-core source layouts proved with megatron-core's own code (the PyPI wheel, CPU).

For Llama/Qwen2/Qwen3 (GQA with num_query_groups < and >= TP, QKV bias, q/k norm,
tied embeddings), Qwen3-MoE (TEGroupedMLP ``weightK`` and SequentialMLP, EP x ETP)
and a DeepSeek-V3-shaped model (MLA, shared experts, expert bias, MTP), every
(TP, PP, VPP, EP, ETP) rank's pieces are replayed on index-encoded HF tensors
(every element distinct) and the rebuilt local tensors are checked against what
megatron-core itself produces or expects:

* TP splits: ``tensor_parallel.layers._initialize_affine_weight_cpu`` (the master
  weight chunked with the parameter's stride, 2 for GLU ``linear_fc1``);
* ``linear_qkv``: ``SelfAttention.get_query_key_value_tensors`` run on each rank's
  rebuilt weight (its all-gather stubbed with the other ranks' outputs) yields
  exactly that rank's HF q heads and its groups' k and v heads;
* GLU order: ``fusions.fused_bias_swiglu.swiglu`` of fc1's output is silu(gate) * up;
* vocab: ``VocabUtility.vocab_range_from_global_vocab_size``; padding rows get no piece;
* layers: ``get_transformer_layer_offset`` / ``get_num_layers_to_build``;
* experts: ``BaseMoELayer.local_expert_indices``.

Every HF tensor element is held by exactly one piece per (TP, PP, EP, ETP) replica set.
"""

import itertools
import types
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

from megatron.core.fusions.fused_bias_swiglu import swiglu  # noqa: E402
from megatron.core.tensor_parallel import layers as mcore_layers  # noqa: E402
from megatron.core.tensor_parallel.utils import VocabUtility  # noqa: E402
from megatron.core.transformer import attention as mcore_attention  # noqa: E402
from megatron.core.transformer.moe.moe_layer import BaseMoELayer  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import (  # noqa: E402
    MLATransformerConfig,
    TransformerConfig,
)
from megatron.core.transformer.transformer_layer import (  # noqa: E402
    get_transformer_layer_offset,
)

from sglang.srt.weight_sync.megatron_layout import (  # noqa: E402
    MegatronModel,
    MegatronRank,
    megatron_sources,
    rank_params,
)
from sglang.srt.weight_sync.source_layout import LayoutError  # noqa: E402

H = 16


def dense(
    tp, pp=1, vpp=None, nq=8, ng=2, bias=False, qk_norm=False, layers=4, ffn=24, **extra
):
    return TransformerConfig(
        num_layers=layers,
        hidden_size=H,
        num_attention_heads=nq,
        num_query_groups=ng,
        kv_channels=4,
        ffn_hidden_size=ffn,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=bias,
        qk_layernorm=qk_norm,
        **extra,
    )


def qwen3_moe(tp, pp, ep, etp, grouped, vpp=None):
    return TransformerConfig(
        num_layers=4,
        hidden_size=H,
        num_attention_heads=8,
        num_query_groups=2,
        kv_channels=4,
        ffn_hidden_size=24,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        num_moe_experts=8,
        moe_ffn_hidden_size=8,
        moe_grouped_gemm=grouped,
        gated_linear_unit=True,
        add_bias_linear=False,
        qk_layernorm=True,
    )


def deepseek(tp, pp, ep, etp, grouped=True):
    return MLATransformerConfig(
        num_layers=4,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=24,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        q_lora_rank=8,
        kv_lora_rank=6,
        qk_head_dim=4,
        qk_pos_emb_head_dim=2,
        v_head_dim=4,
        num_moe_experts=4,
        moe_ffn_hidden_size=8,
        moe_shared_expert_intermediate_size=8,
        moe_layer_freq=[0, 1, 1, 1],
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        moe_grouped_gemm=grouped,
        gated_linear_unit=True,
        add_bias_linear=False,
        mtp_num_layers=1,
    )


CASES = {
    # name: (config, hf vocab, padded vocab, tied, te_spec)
    "llama_tp4_ng2_lt_tp": (dense(4, ng=2), 50, 64, False, True),
    "llama_tp8_half_heads": (
        dense(8, nq=8, ng=2),
        50,
        64,
        False,
        True,
    ),  # 1.5 q heads... per rank: cuts heads
    "llama_tp2_pp2_ng_ge_tp": (dense(2, 2, ng=4), 50, 64, False, True),
    "qwen2_tp2_pp2_vpp2_bias_tied": (
        dense(2, 2, 2, bias=True, layers=8),
        50,
        52,
        True,
        True,
    ),
    "qwen2_tp4_tied_local_spec": (dense(4, bias=True), 50, 64, True, False),
    "qwen3_tp4_qk_norm_uneven_pp": (
        dense(
            4,
            3,
            qk_norm=True,
            layers=5,
            num_layers_in_first_pipeline_stage=1,
            num_layers_in_last_pipeline_stage=2,
        ),
        50,
        64,
        False,
        True,
    ),
    "qwen3_accounting_pp": (
        dense(
            2,
            2,
            qk_norm=True,
            layers=6,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
        50,
        64,
        False,
        True,
    ),
    "qwen3_moe_grouped_tp2_ep2_etp1": (
        qwen3_moe(2, 2, 2, 1, True),
        50,
        64,
        False,
        True,
    ),
    "qwen3_moe_grouped_tp2_ep4_etp2": (
        qwen3_moe(2, 1, 4, 2, True),
        50,
        64,
        False,
        True,
    ),
    "qwen3_moe_sequential_tp4_ep2_etp2_vpp": (
        qwen3_moe(4, 2, 2, 2, False, vpp=2),
        50,
        64,
        False,
        True,
    ),
    "deepseek_tp2_pp2_ep2_etp1": (deepseek(2, 2, 2, 1), 50, 64, False, True),
    "deepseek_tp2_ep4_etp2_local_spec": (
        deepseek(2, 1, 4, 2, grouped=False),
        50,
        64,
        False,
        False,
    ),
}


def hf_tensors(model):
    """Index-encoded HF tensors: element values are distinct across the whole model."""
    out, start = {}, 0
    for name, src in sorted(megatron_sources(model, all_ranks(model)).items()):
        n = torch.Size(src.shape).numel()
        out[name] = torch.arange(start, start + n, dtype=torch.float64).reshape(
            src.shape
        )
        start += n
    return out


def all_ranks(model):
    coords = itertools.product(
        range(model.tp), range(model.pp), range(model.ep), range(model.etp)
    )
    return {i: MegatronRank(t, p, e, r) for i, (t, p, e, r) in enumerate(coords)}


def rebuild(model, rank, hf):
    """Each local tensor of ``rank`` written from its pieces only (NaN where none writes)."""
    out = {}
    for param in rank_params(model, rank):
        local = torch.full(param.shape, float("nan"), dtype=torch.float64)
        for piece in param.pieces:
            local[
                piece.box.translate(
                    [o - b for o, b in zip(piece.offsets, piece.box.offsets)]
                ).slices()
            ] = hf[piece.tensor][piece.box.slices()]
        out[param.buffer] = local
    return out


def split(master, rank, world, dim, stride=1):
    """megatron-core's own TP split of a master weight (what each rank is initialised with)."""
    shape = list(master.shape) if master.ndim == 2 else [master.shape[0], 1]
    local = torch.empty(
        [shape[0] // world, shape[1]] if dim == 0 else [shape[0], shape[1] // world],
        dtype=torch.float64,
    )
    mcore_layers._initialize_affine_weight_cpu(
        local,
        shape[0],
        shape[1],
        local.shape[dim],
        dim,
        lambda w: w.copy_(master.reshape(shape)),
        stride=stride,
        params_dtype=torch.float64,
        rank=rank,
        world_size=world,
        skip_set_tensor_parallel_attributes=True,
    )
    return local.reshape(-1) if master.ndim == 1 else local


def qkv_forward(config, t, T, locals_by_rank, x):
    """Run megatron-core's SelfAttention.get_query_key_value_tensors as TP rank t, with the
    linear_qkv weights rebuilt for every rank (the all-gather gets the other ranks' outputs)."""
    nq, ng = config.num_attention_heads, config.num_query_groups
    outs = [x @ w.T for w in locals_by_rank]
    # per-partition head counts as Attention.__init__ sets them (one group, post all-gather, when ng < T)
    me = types.SimpleNamespace(
        config=config,
        world_size=T,
        num_attention_heads_per_partition=nq // T if ng >= T else nq // ng,
        num_query_groups_per_partition=ng // T if ng >= T else 1,
        hidden_size_per_attention_head=config.kv_channels,
        linear_qkv=lambda h: (outs[t], None),
        q_layernorm=None,
        k_layernorm=None,
    )
    saved = (
        mcore_attention.all_gather_last_dim_from_tensor_parallel_region,
        mcore_attention.get_tensor_model_parallel_rank,
    )
    mcore_attention.all_gather_last_dim_from_tensor_parallel_region = lambda _: (
        torch.cat(outs, dim=-1)
    )
    mcore_attention.get_tensor_model_parallel_rank = lambda: t
    saved_apply = mcore_attention.apply_module
    mcore_attention.apply_module = lambda m: m
    try:
        return mcore_attention.SelfAttention.get_query_key_value_tensors(me, x, None)
    finally:
        (
            mcore_attention.all_gather_last_dim_from_tensor_parallel_region,
            mcore_attention.get_tensor_model_parallel_rank,
        ) = saved
        mcore_attention.apply_module = saved_apply


class _Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class _MoE(BaseMoELayer):
    def forward(self, hidden_states):  # abstract in megatron-core; never called
        raise NotImplementedError


def expert_indices(config, ep_rank, ep, monkeypatch):
    """BaseMoELayer's own local_expert_indices on EP rank ``ep_rank`` (groups answer rank/size only)."""
    with monkeypatch.context() as m:
        m.setattr(torch.distributed, "is_initialized", lambda: True)
        group = _Group(ep_rank, ep)
        return _MoE(
            config, 1, pg_collection=types.SimpleNamespace(ep=group, tp=_Group(0, 1))
        ).local_expert_indices


def glu_master(hf, prefix):
    """The TP-1 fc1 [gate; up]; megatron-core's own swiglu must read it as silu(gate) * up."""
    master = torch.cat([hf[f"{prefix}gate_proj.weight"], hf[f"{prefix}up_proj.weight"]])
    x = (
        torch.linspace(-1, 1, master.shape[1], dtype=torch.float64).view(1, -1)
        / master.abs().max()
    )
    gate, up = (
        x @ hf[f"{prefix}gate_proj.weight"].T,
        x @ hf[f"{prefix}up_proj.weight"].T,
    )
    assert torch.allclose(swiglu(x @ master.T), torch.nn.functional.silu(gate) * up), (
        prefix
    )
    return master


def expected_locals(model, rank, hf, built, monkeypatch):
    """The local tensors megatron-core expects on ``rank``, from megatron-core's functions."""
    c, t, T = model.config, rank.tp, model.tp
    exp = {}
    V = model.vpp
    Vpad, per = model.padded_vocab, model.padded_vocab // T
    lo, hi = VocabUtility.vocab_range_from_global_vocab_size(Vpad, t, T)
    for v in range(V):
        pre = f"chunk{v}/"
        vp = v if c.virtual_pipeline_model_parallel_size else None
        off = get_transformer_layer_offset(c, vp, rank.pp)
        count = get_num_layers_to_build(c, vp, rank.pp)
        first, last = rank.pp == 0 and v == 0, rank.pp == model.pp - 1 and v == V - 1

        def vocab(name):
            padded = torch.full((Vpad, H), float("nan"), dtype=torch.float64)
            padded[: model.hf_vocab] = hf[name]
            return padded[lo:hi]

        if first or (last and c.mtp_num_layers):
            exp[pre + "embedding.word_embeddings.weight"] = vocab(
                "model.embed_tokens.weight"
            )
        layers = [(f"decoder.layers.{i}.", off + i) for i in range(count)]
        if last:
            exp[pre + "decoder.final_layernorm.weight"] = hf["model.norm.weight"]
            if not (model.tied and first):
                exp[pre + "output_layer.weight"] = vocab(
                    "model.embed_tokens.weight" if model.tied else "lm_head.weight"
                )
            for k in range(c.mtp_num_layers or 0):
                g, m = c.num_layers + k, f"mtp.layers.{k}."
                for n in ("enorm", "hnorm"):
                    exp[pre + f"{m}{n}.weight"] = hf[f"model.layers.{g}.{n}.weight"]
                exp[pre + f"{m}eh_proj.weight"] = split(
                    hf[f"model.layers.{g}.eh_proj.weight"], t, T, 0
                )
                exp[pre + f"{m}final_layernorm.weight"] = hf[
                    f"model.layers.{g}.shared_head.norm.weight"
                ]
                layers.append((f"{m}transformer_layer.", g))
        for p, g in layers:
            L, a = f"model.layers.{g}.", f"{pre}{p}self_attention."
            norm = hf[f"{L}input_layernorm.weight"]
            if c.multi_latent_attention:
                exp[pre + p + "input_layernorm.weight"] = norm
                sa = f"{L}self_attn."
                for mc, hname in (
                    ("linear_q_down_proj", "q_a_proj"),
                    ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
                ):
                    w = hf[f"{sa}{hname}.weight"]
                    exp[f"{a}{mc}.weight"] = w if model.te_spec else split(w, t, T, 0)
                for mc, local_norm, hname in (
                    ("linear_q_up_proj", "q_layernorm", "q_a_layernorm"),
                    ("linear_kv_up_proj", "kv_layernorm", "kv_a_layernorm"),
                ):
                    key = (
                        f"{a}{mc}.layer_norm_weight"
                        if model.te_spec
                        else f"{a}{local_norm}.weight"
                    )
                    exp[key] = hf[f"{sa}{hname}.weight"]
                exp[f"{a}linear_q_up_proj.weight"] = split(
                    hf[f"{sa}q_b_proj.weight"], t, T, 0
                )
                exp[f"{a}linear_kv_up_proj.weight"] = split(
                    hf[f"{sa}kv_b_proj.weight"], t, T, 0
                )
            else:
                exp[
                    f"{a}linear_qkv.layer_norm_weight"
                    if model.te_spec
                    else f"{pre}{p}input_layernorm.weight"
                ] = norm
                check_qkv(model, rank, hf, built, a, L, c.add_qkv_bias)
                if c.qk_layernorm:
                    exp[f"{a}q_layernorm.weight"] = hf[f"{L}self_attn.q_norm.weight"]
                    exp[f"{a}k_layernorm.weight"] = hf[f"{L}self_attn.k_norm.weight"]
            exp[f"{a}linear_proj.weight"] = split(
                hf[f"{L}self_attn.o_proj.weight"], t, T, 1
            )
            post = hf[f"{L}post_attention_layernorm.weight"]
            mp = f"{pre}{p}mlp."
            if not model.is_moe_layer(g):
                exp[
                    f"{mp}linear_fc1.layer_norm_weight"
                    if model.te_spec
                    else f"{pre}{p}pre_mlp_layernorm.weight"
                ] = post
                exp[f"{mp}linear_fc1.weight"] = split(
                    glu_master(hf, f"{L}mlp."), t, T, 0, stride=2
                )
                exp[f"{mp}linear_fc2.weight"] = split(
                    hf[f"{L}mlp.down_proj.weight"], t, T, 1
                )
                continue
            exp[f"{pre}{p}pre_mlp_layernorm.weight"] = post
            exp[f"{mp}router.weight"] = hf[f"{L}mlp.gate.weight"]
            if c.moe_router_enable_expert_bias:
                exp[f"{mp}router.expert_bias"] = hf[
                    f"{L}mlp.gate.e_score_correction_bias"
                ]
            for k, x in enumerate(expert_indices(c, rank.ep, model.ep, monkeypatch)):
                e = f"{L}mlp.experts.{x}."
                fc1 = split(glu_master(hf, e), rank.etp, model.etp, 0, stride=2)
                fc2 = split(hf[f"{e}down_proj.weight"], rank.etp, model.etp, 1)
                if c.moe_grouped_gemm:
                    (
                        exp[f"{mp}experts.linear_fc1.weight{k}"],
                        exp[f"{mp}experts.linear_fc2.weight{k}"],
                    ) = fc1, fc2
                else:
                    exp[f"{mp}experts.local_experts.{k}.linear_fc1.weight"] = fc1
                    exp[f"{mp}experts.local_experts.{k}.linear_fc2.weight"] = fc2
            if c.moe_shared_expert_intermediate_size:
                s = f"{L}mlp.shared_experts."
                exp[f"{mp}shared_experts.linear_fc1.weight"] = split(
                    glu_master(hf, s), t, T, 0, stride=2
                )
                exp[f"{mp}shared_experts.linear_fc2.weight"] = split(
                    hf[f"{s}down_proj.weight"], t, T, 1
                )
    return exp


def check_qkv(model, rank, hf, built, a, L, bias):
    """linear_qkv: the TP split of megatron-core, and its forward's q/k/v equal HF's."""
    c, t, T = model.config, rank.tp, model.tp
    nq, ng, d = c.num_attention_heads, c.num_query_groups, c.kv_channels
    weights = [
        built[MegatronRank(r, rank.pp, rank.ep, rank.etp)][f"{a}linear_qkv.weight"]
        for r in range(T)
    ]
    x = torch.eye(H, dtype=torch.float64).reshape(
        H, 1, H
    )  # hidden [sq=H, b=1, H]: outputs are weight columns
    q, k, v = qkv_forward(c, t, T, weights, x)
    heads = slice(t * nq // T, (t + 1) * nq // T)
    groups = [t * ng // T] if ng < T else list(range(t * ng // T, (t + 1) * ng // T))
    hf_q = hf[f"{L}self_attn.q_proj.weight"].T.reshape(H, 1, nq, d)
    hf_k = hf[f"{L}self_attn.k_proj.weight"].T.reshape(H, 1, ng, d)
    hf_v = hf[f"{L}self_attn.v_proj.weight"].T.reshape(H, 1, ng, d)
    assert torch.equal(q, hf_q[:, :, heads]), f"rank {rank}: {a} q heads"
    assert torch.equal(k, hf_k[:, :, groups]) and torch.equal(v, hf_v[:, :, groups]), (
        f"rank {rank}: {a} k/v"
    )
    if bias:
        biases = [
            built[MegatronRank(r, rank.pp, rank.ep, rank.etp)][f"{a}linear_qkv.bias"]
            for r in range(T)
        ]
        qb, kb, vb = qkv_forward(
            c,
            t,
            T,
            [b.reshape(-1, 1) for b in biases],
            torch.ones(1, 1, 1, dtype=torch.float64),
        )
        assert torch.equal(
            qb.flatten(),
            hf[f"{L}self_attn.q_proj.bias"].reshape(nq, d)[heads].flatten(),
        )
        assert torch.equal(
            kb.flatten(),
            hf[f"{L}self_attn.k_proj.bias"].reshape(ng, d)[groups].flatten(),
        )
        assert torch.equal(
            vb.flatten(),
            hf[f"{L}self_attn.v_proj.bias"].reshape(ng, d)[groups].flatten(),
        )


@pytest.mark.parametrize("case", sorted(CASES))
def test_pieces_rebuild_what_megatron_core_expects(case, monkeypatch):
    config, hf_vocab, padded, tied, te = CASES[case]
    model = MegatronModel(config, hf_vocab, padded, tied, te)
    hf = hf_tensors(model)
    ranks = set(all_ranks(model).values())
    built = {r: rebuild(model, r, hf) for r in ranks}
    for rank in sorted(ranks, key=lambda r: (r.tp, r.pp, r.ep, r.etp)):
        exp = expected_locals(model, rank, hf, built, monkeypatch)
        qkv = {
            k for k in built[rank] if "linear_qkv.weight" in k or "linear_qkv.bias" in k
        }
        assert set(built[rank]) == set(exp) | qkv, (
            f"{case} {rank}: {set(built[rank]) ^ (set(exp) | qkv)}"
        )
        for name, tensor in exp.items():
            assert torch.equal(
                built[rank][name], tensor.reshape(built[rank][name].shape)
            ) or (
                torch.equal(built[rank][name].isnan(), tensor.isnan())
                and torch.equal(built[rank][name].nan_to_num(-1), tensor.nan_to_num(-1))
            ), f"{case} {rank}: {name}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_hf_element_has_one_holder_per_replica_set(case):
    """Over one copy of each (TP, PP, EP, ETP) coordinate, pieces tile every HF tensor exactly once,
    except documented replicas: whole-tensor copies (norms, router, duplicated MLA down-projections)
    held by every TP rank, dense tensors repeated on every EP/ETP rank, and the tied/MTP embedding copies."""
    config, hf_vocab, padded, tied, te = CASES[case]
    model = MegatronModel(config, hf_vocab, padded, tied, te)
    sources = megatron_sources(model, all_ranks(model))
    for name, src in sources.items():
        count = torch.zeros(src.shape, dtype=torch.int64)
        for h in src.holders:
            count[h.box.slices()] += 1
        assert count.min() >= 1, f"{case}: {name} not fully held"
        assert (count == count.flatten()[0]).all(), (
            f"{case}: {name} held unevenly {count.unique().tolist()}"
        )


def test_refusals_name_the_problem():
    with pytest.raises(
        LayoutError,
        match="padded vocab 60 must be >= the HF vocab 50 and divisible by TP 8",
    ):
        MegatronModel(dense(8), 50, 60, False)
    with pytest.raises(LayoutError, match="pipeline_model_parallel_layout"):
        MegatronModel(
            types.SimpleNamespace(pipeline_model_parallel_layout="Et|tL"), 50, 64, False
        )
    model = MegatronModel(qwen3_moe(2, 1, 2, 1, True), 50, 64, False, te_spec=False)
    with pytest.raises(LayoutError, match="legacy GroupedMLP"):
        rank_params(model, MegatronRank())


def test_qkv_worked_examples_from_the_research_notes():
    """Qwen3-235B-A22B at TP 16 (nq 64, ng 4, d 128): rank 0 holds q heads 0-3 and half of head 4."""
    from sglang.srt.weight_sync.megatron_layout import qkv_pieces

    got = [
        (p.tensor[0], p.box.offsets[0], p.offsets[0], p.box.sizes[0])
        for p in qkv_pieces("", 0, 16, 64, 4, 128, (8,))
    ]
    assert got == [("q", 0, 0, 576)]
    got = [
        (p.tensor[0], p.box.offsets[0], p.offsets[0], p.box.sizes[0])
        for p in qkv_pieces("", 1, 8, 32, 4, 128, (8,))
    ]
    assert got == [("q", 640, 0, 384), ("k", 0, 384, 128), ("v", 0, 512, 128)]


# QKV, PP and vocab cases worked out by hand from megatron-core's source, here against megatron-core itself.
VERIFY_QKV = [
    (8, 8, 4, 4),
    (8, 2, 2, 4),
    (8, 2, 4, 4),
    (8, 2, 8, 4),
    (32, 4, 8, 4),
    (64, 4, 16, 4),
    (64, 4, 8, 2),
    (12, 2, 4, 3),
    (16, 1, 8, 4),
    (4, 4, 1, 2),
]


@pytest.mark.parametrize("nq,ng,tp,d", VERIFY_QKV)
def test_qkv_verify_layouts_cases(nq, ng, tp, d):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=nq,
        num_query_groups=ng,
        kv_channels=d,
        ffn_hidden_size=H * tp,
        tensor_model_parallel_size=tp,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=True,
    )
    model = MegatronModel(config, 50, 64 * tp, False)
    hf = hf_tensors(model)
    built = {MegatronRank(t): rebuild(model, MegatronRank(t), hf) for t in range(tp)}
    for t in range(tp):
        check_qkv(
            model,
            MegatronRank(t),
            hf,
            built,
            "chunk0/decoder.layers.0.self_attention.",
            "model.layers.0.",
            True,
        )


VERIFY_PP = [
    (28, 4, None, None, None, False, False),
    (28, 2, 2, None, None, False, False),
    (32, 4, 2, None, None, False, False),
    (61, 8, None, 4, 3, False, False),
    (61, 4, None, 13, None, False, False),
    (64, 4, 2, 14, 18, False, False),
    (30, 4, None, None, None, True, True),
    (30, 4, 2, None, None, True, True),
    (62, 8, None, None, None, True, True),
    (94, 8, None, 10, 12, False, False),
]


@pytest.mark.parametrize("L,pp,vpp,first,last,emb,loss", VERIFY_PP)
def test_layer_ranges_verify_layouts_cases(L, pp, vpp, first, last, emb, loss):
    config = dense(
        1,
        pp,
        vpp,
        layers=L,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=emb,
        account_for_loss_in_pipeline_split=loss,
    )
    model = MegatronModel(config, 50, 64, False)
    owned = []
    for v in range(vpp or 1):
        for p in range(pp):
            vp = v if vpp else None
            expected = (
                get_transformer_layer_offset(config, vp, p),
                get_num_layers_to_build(config, vp, p),
            )
            assert model.layers(p, v) == expected, (p, v)
            owned += range(expected[0], expected[0] + expected[1])
    assert sorted(owned) == list(range(L))


@pytest.mark.parametrize(
    "hf_vocab,divisible_by,tp",
    [
        (151936, 128, 8),
        (152064, 128, 8),
        (151669, 128, 4),
        (129280, 1280, 8),
        (128256, 128, 16),
        (100, 128, 8),
    ],
)
def test_vocab_verify_layouts_cases(hf_vocab, divisible_by, tp):
    """Megatron-LM's padding (a multiple of divisible_by * TP): each rank's real rows, none past the HF vocab."""
    padded = -(-hf_vocab // (divisible_by * tp)) * divisible_by * tp
    model = MegatronModel(dense(tp, nq=16, ng=16, ffn=16 * tp), hf_vocab, padded, False)
    rows = 0
    for t in range(tp):
        lo, hi = VocabUtility.vocab_range_from_global_vocab_size(padded, t, tp)
        (param,) = [
            p
            for p in rank_params(model, MegatronRank(t))
            if p.buffer.endswith("word_embeddings.weight")
        ]
        assert param.shape == (hi - lo, H)
        real = [(p.box.offsets[0], p.box.sizes[0], p.offsets[0]) for p in param.pieces]
        assert real == ([(lo, min(hi, hf_vocab) - lo, 0)] if lo < hf_vocab else [])
        rows += sum(n for _, n, _ in real)
    assert rows == hf_vocab


@pytest.mark.parametrize("ffn,tp", [(12, 1), (12, 2), (12, 3), (16, 4)])
def test_fc1_verify_layouts_cases(ffn, tp):
    """GLU fc1 at every TP (3 included): each rank's [gate_t; up_t] is megatron-core's stride-2 split."""
    model = MegatronModel(
        dense(tp, nq=12 if tp == 3 else 8, ng=12 if tp == 3 else 8, ffn=ffn, layers=1),
        50,
        64 * tp,
        False,
    )
    hf = hf_tensors(model)
    name = "chunk0/decoder.layers.0.mlp.linear_fc1.weight"
    for t in range(tp):
        local = rebuild(model, MegatronRank(t), hf)[name]
        assert torch.equal(
            local, split(glu_master(hf, "model.layers.0.mlp."), t, tp, 0, stride=2)
        ), (ffn, tp, t)
