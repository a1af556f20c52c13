"""Describe a Megatron-core model's local parameters as pieces of HF tensors.

Pure and communication-free: from a ``TransformerConfig`` (plus what only the
model knows: padded vocab, tied embeddings, layer spec) and one rank's parallel
coordinates (TP, PP, VPP chunks, EP, expert-TP), list every parameter that rank
holds with the boxes of HF tensors inside it and where each box sits. Any rank
can describe any other rank this way, so a plan over many trainer ranks needs
no exchange. Layouts, as megatron-core builds them (``test_megatron_layout.py`` checks
them against megatron-core itself):

* ``linear_qkv`` interleaves, per query group, q heads, k, v; a rank holds rows
  ``[t*R, (t+1)*R)`` of that, which may cut a group or a head when
  ``num_query_groups < TP``;
* GLU ``linear_fc1`` (dense, shared and routed experts) holds ``[gate_t; up_t]``;
* row-parallel ``linear_proj``/``linear_fc2`` hold a column block;
* vocab-parallel embedding and output layer hold rows ``[t*per, (t+1)*per)`` of
  the padded vocab, padding rows (past the HF vocab) in no piece;
* routed experts: EP rank e holds experts ``[e*E/Ep, (e+1)*E/Ep)``, split over
  the expert-TP group like a dense MLP;
* PP/VPP layer offsets by megatron-core's own rules (default, uneven first/last
  stage, embedding/loss accounting); a ``pipeline_model_parallel_layout`` is refused;
* tied embeddings: no ``output_layer.weight`` when one chunk holds both ends,
  otherwise the last stage's copy is one more holder of ``embed_tokens``; the MTP
  stage's embedding copy likewise; ``router.expert_bias`` (a buffer) is described.

Buffer keys are ``chunk{v}/{local name}`` (VPP chunks repeat local names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.source_layout import (
    Holder,
    LayoutError,
    SourceLayout,
    SourceTensor,
)

__all__ = (
    "MegatronModel",
    "MegatronRank",
    "describe_model_chunks",
    "megatron_sources",
    "qkv_pieces",
    "rank_params",
)


@dataclass(frozen=True, slots=True)
class MegatronRank:
    """One trainer rank's coordinates: TP rank, PP stage, EP rank, expert-TP rank.
    DP and CP replicas share coordinates, hence pieces."""

    tp: int = 0
    pp: int = 0
    ep: int = 0
    etp: int = 0


@dataclass(frozen=True, slots=True)
class SourcePiece:
    """``box`` of HF tensor ``tensor`` (global shape ``shape``) at ``offsets`` in a local buffer."""

    tensor: str
    shape: Tuple[int, ...]
    box: Box
    offsets: Tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LocalParam:
    """One local parameter (or persistent buffer) and the HF pieces inside it."""

    buffer: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    pieces: Tuple[SourcePiece, ...]


@dataclass(frozen=True)
class MegatronModel:
    """What the layout depends on beyond the config, read from the model where
    frameworks differ: ``padded_vocab`` (``GPTModel.vocab_size``), ``tied``
    (``share_embeddings_and_output_weights``), ``te_spec`` (norms fused into
    ``linear_qkv``/``linear_fc1`` as ``layer_norm_weight``, MLA down-projections
    duplicated) and the HF spelling of shared experts."""

    config: object
    hf_vocab: int
    padded_vocab: int
    tied: bool
    te_spec: bool = True
    shared_expert_hf: str = "shared_experts"

    def __post_init__(self):
        c = self.config
        if getattr(c, "pipeline_model_parallel_layout", None) is not None:
            raise LayoutError(
                "pipeline_model_parallel_layout is not supported; use the default or uneven split"
            )
        if not getattr(c, "gated_linear_unit", False):
            raise LayoutError("only gated (SwiGLU) MLPs map to HF gate_proj/up_proj")
        if self.padded_vocab % self.tp or self.padded_vocab < self.hf_vocab:
            raise LayoutError(
                f"padded vocab {self.padded_vocab} must be >= the HF vocab {self.hf_vocab} and divisible by TP {self.tp}"
            )

    @property
    def tp(self) -> int:
        return self.config.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.config.pipeline_model_parallel_size

    @property
    def vpp(self) -> int:
        return self.config.virtual_pipeline_model_parallel_size or 1

    @property
    def ep(self) -> int:
        return self.config.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.config.expert_tensor_parallel_size or self.tp

    def is_moe_layer(self, g: int) -> bool:
        c = self.config
        if not c.num_moe_experts:
            return False
        if g >= c.num_layers:  # MTP layers use the decoder's (MoE) layer spec
            return True
        freq = c.moe_layer_freq
        return bool(freq[g]) if isinstance(freq, (list, tuple)) else g % freq == 0

    def layers(self, pp: int, vp: int) -> Tuple[int, int]:
        """(first global layer, count) of chunk (pp, vp): megatron-core's
        ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` in closed form."""
        c, P, V = self.config, self.pp, self.vpp
        L = c.num_layers
        first, last = (
            c.num_layers_in_first_pipeline_stage,
            c.num_layers_in_last_pipeline_stage,
        )
        if P == 1:
            return vp * L // V, L // V
        if first is None and last is None:
            emb = bool(c.account_for_embedding_in_pipeline_split)
            loss = bool(c.account_for_loss_in_pipeline_split)
            total = L + emb + loss
            per = total // (P * V)
            head = vp == 0 and pp == 0
            off = vp * (total // V) + pp * per - (emb and not head)
            return off, per - (emb and head) - (loss and vp == V - 1 and pp == P - 1)
        f, la = (first or 0) // V, (last or 0) // V
        middle = P - (first is not None) - (last is not None)
        m = ((L - (first or 0) - (last or 0)) // middle if middle else 0) // V
        off = vp * (f + m * middle + la) + (
            0 if pp == 0 else f + (pp - (first is not None)) * m
        )
        if pp == 0 and first is not None:
            return off, f
        if pp == P - 1 and last is not None:
            return off, la
        return off, m


def _div(n: int, t: int, what: str) -> int:
    if n % t:
        raise LayoutError(f"{what}: {n} is not divisible by {t}")
    return n // t


def _whole(tensor: str, shape: Sequence[int]) -> Tuple[SourcePiece, ...]:
    shape = tuple(shape)
    return (SourcePiece(tensor, shape, Box.full(shape), (0,) * len(shape)),)


def _block(
    tensor: str, shape: Sequence[int], dim: int, start: int, size: int, at: int = 0
) -> SourcePiece:
    """Rows (dim 0) or columns (dim 1) ``[start, start+size)`` of ``tensor``, placed at ``at`` along dim."""
    shape = tuple(shape)
    offsets, sizes, local = [0] * len(shape), list(shape), [0] * len(shape)
    offsets[dim], sizes[dim], local[dim] = start, size, at
    return SourcePiece(tensor, shape, Box(tuple(offsets), tuple(sizes)), tuple(local))


def qkv_pieces(
    prefix: str, t: int, T: int, nq: int, ng: int, d: int, cols: Tuple[int, ...]
) -> Tuple[SourcePiece, ...]:
    """Rows ``[t*R, (t+1)*R)`` of the per-group interleaved ``[q heads; k; v]`` tensor as
    boxes of ``{prefix}{q,k,v}_proj`` (weight when ``cols`` is ``(H,)``, bias when ``()``)."""
    if ng % T and T % ng:
        raise LayoutError(
            f"linear_qkv: num_query_groups {ng} and TP {T} must divide one another"
        )
    q = nq // ng * d
    block = q + 2 * d
    rows = _div((nq + 2 * ng) * d, T, "linear_qkv rows")
    lo, hi = t * rows, (t + 1) * rows
    out = []
    for j in range(lo // block, (hi - 1) // block + 1):
        base = j * block
        for name, s, e, hf0, n in (
            ("q", 0, q, j * q, nq * d),
            ("k", q, q + d, j * d, ng * d),
            ("v", q + d, block, j * d, ng * d),
        ):
            a, b = max(lo, base + s), min(hi, base + e)
            if a < b:
                out.append(
                    _block(
                        f"{prefix}{name}_proj.{'weight' if cols else 'bias'}",
                        (n,) + cols,
                        0,
                        hf0 + a - base - s,
                        b - a,
                        a - lo,
                    )
                )
    return tuple(out)


def glu_pieces(
    gate: str, up: str, r: int, T: int, F: int, H: int
) -> Tuple[SourcePiece, ...]:
    """``linear_fc1`` of a gated MLP on TP rank r of T: ``[gate rows r*c..; up rows r*c..]``."""
    c = _div(F, T, f"{gate} rows")
    return (_block(gate, (F, H), 0, r * c, c, 0), _block(up, (F, H), 0, r * c, c, c))


def _vocab(tensor: str, model: MegatronModel, t: int) -> Tuple[SourcePiece, ...]:
    H, per = model.config.hidden_size, model.padded_vocab // model.tp
    n = min((t + 1) * per, model.hf_vocab) - t * per
    return (_block(tensor, (model.hf_vocab, H), 0, t * per, n),) if n > 0 else ()


class _Params:
    """Collects one chunk's parameters with their local shapes and pieces."""

    def __init__(self, chunk: int, dtype: torch.dtype):
        self.chunk, self.dtype, self.out = chunk, dtype, []

    def add(
        self,
        name: str,
        shape: Sequence[int],
        pieces: Sequence[SourcePiece],
        dtype: Optional[torch.dtype] = None,
    ):
        self.out.append(
            LocalParam(
                f"chunk{self.chunk}/{name}",
                tuple(int(s) for s in shape),
                dtype or self.dtype,
                tuple(pieces),
            )
        )


def _attention(
    p: _Params, model: MegatronModel, rank: MegatronRank, pre: str, hf: str
) -> None:
    c, t, T = model.config, rank.tp, model.tp
    H, nq = c.hidden_size, c.num_attention_heads
    if c.multi_latent_attention:
        _mla(p, model, rank, pre, hf)
        return
    ng, d = c.num_query_groups or nq, c.kv_channels
    rows = _div((nq + 2 * ng) * d, T, "linear_qkv rows")
    if model.te_spec:
        p.add(
            f"{pre}self_attention.linear_qkv.layer_norm_weight",
            (H,),
            _whole(f"{hf}input_layernorm.weight", (H,)),
        )
    else:
        p.add(
            f"{pre}input_layernorm.weight",
            (H,),
            _whole(f"{hf}input_layernorm.weight", (H,)),
        )
    p.add(
        f"{pre}self_attention.linear_qkv.weight",
        (rows, H),
        qkv_pieces(f"{hf}self_attn.", t, T, nq, ng, d, (H,)),
    )
    if c.add_qkv_bias:
        p.add(
            f"{pre}self_attention.linear_qkv.bias",
            (rows,),
            qkv_pieces(f"{hf}self_attn.", t, T, nq, ng, d, ()),
        )
    if c.qk_layernorm:
        p.add(
            f"{pre}self_attention.q_layernorm.weight",
            (d,),
            _whole(f"{hf}self_attn.q_norm.weight", (d,)),
        )
        p.add(
            f"{pre}self_attention.k_layernorm.weight",
            (d,),
            _whole(f"{hf}self_attn.k_norm.weight", (d,)),
        )
    cols = _div(nq * d, T, "linear_proj columns")
    p.add(
        f"{pre}self_attention.linear_proj.weight",
        (H, cols),
        (_block(f"{hf}self_attn.o_proj.weight", (H, nq * d), 1, t * cols, cols),),
    )


def _mla(
    p: _Params, model: MegatronModel, rank: MegatronRank, pre: str, hf: str
) -> None:
    """Multi-latent attention: identity on mcore-global coordinates; down-projections are
    duplicated in the TE spec and column-parallel in the local spec."""
    c, t, T = model.config, rank.tp, model.tp
    H, nq = c.hidden_size, c.num_attention_heads
    qk, dv, kl = c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim, c.kv_lora_rank
    a, sa = f"{pre}self_attention.", f"{hf}self_attn."
    p.add(
        f"{pre}input_layernorm.weight",
        (H,),
        _whole(f"{hf}input_layernorm.weight", (H,)),
    )

    def column(
        name: str, tensor: str, shape: Tuple[int, int], sharded: bool = True
    ) -> None:
        if not sharded:
            p.add(name, shape, _whole(tensor, shape))
            return
        rows = _div(shape[0], T, f"{name} rows")
        p.add(name, (rows, shape[1]), (_block(tensor, shape, 0, t * rows, rows),))

    def norm(te_name: str, local_name: str, tensor: str, size: int) -> None:
        p.add(
            te_name if model.te_spec else local_name, (size,), _whole(tensor, (size,))
        )

    if c.q_lora_rank is None:
        column(f"{a}linear_q_proj.weight", f"{sa}q_proj.weight", (nq * qk, H))
    else:
        ql = c.q_lora_rank
        column(
            f"{a}linear_q_down_proj.weight",
            f"{sa}q_a_proj.weight",
            (ql, H),
            not model.te_spec,
        )
        norm(
            f"{a}linear_q_up_proj.layer_norm_weight",
            f"{a}q_layernorm.weight",
            f"{sa}q_a_layernorm.weight",
            ql,
        )
        column(f"{a}linear_q_up_proj.weight", f"{sa}q_b_proj.weight", (nq * qk, ql))
    column(
        f"{a}linear_kv_down_proj.weight",
        f"{sa}kv_a_proj_with_mqa.weight",
        (kl + c.qk_pos_emb_head_dim, H),
        not model.te_spec,
    )
    norm(
        f"{a}linear_kv_up_proj.layer_norm_weight",
        f"{a}kv_layernorm.weight",
        f"{sa}kv_a_layernorm.weight",
        kl,
    )
    column(
        f"{a}linear_kv_up_proj.weight",
        f"{sa}kv_b_proj.weight",
        (nq * (c.qk_head_dim + dv), kl),
    )
    cols = _div(nq * dv, T, "linear_proj columns")
    p.add(
        f"{a}linear_proj.weight",
        (H, cols),
        (_block(f"{sa}o_proj.weight", (H, nq * dv), 1, t * cols, cols),),
    )


def _gated_mlp(p: _Params, pre: str, hf: str, r: int, T: int, F: int, H: int) -> None:
    """A gated MLP's fc1/fc2 (``pre`` = mcore module prefix, ``hf`` = HF module prefix)."""
    c = _div(F, T, f"{pre}linear_fc2 columns")
    p.add(
        f"{pre}linear_fc1.weight",
        (2 * c, H),
        glu_pieces(f"{hf}gate_proj.weight", f"{hf}up_proj.weight", r, T, F, H),
    )
    p.add(
        f"{pre}linear_fc2.weight",
        (H, c),
        (_block(f"{hf}down_proj.weight", (H, F), 1, r * c, c),),
    )


def _mlp(
    p: _Params, model: MegatronModel, rank: MegatronRank, pre: str, hf: str, g: int
) -> None:
    c, H = model.config, model.config.hidden_size
    post_norm = _whole(f"{hf}post_attention_layernorm.weight", (H,))
    if not model.is_moe_layer(g):
        p.add(
            f"{pre}mlp.linear_fc1.layer_norm_weight"
            if model.te_spec
            else f"{pre}pre_mlp_layernorm.weight",
            (H,),
            post_norm,
        )
        _gated_mlp(
            p, f"{pre}mlp.", f"{hf}mlp.", rank.tp, model.tp, c.ffn_hidden_size, H
        )
        return
    E = c.num_moe_experts
    p.add(f"{pre}pre_mlp_layernorm.weight", (H,), post_norm)
    p.add(f"{pre}mlp.router.weight", (E, H), _whole(f"{hf}mlp.gate.weight", (E, H)))
    if c.moe_router_enable_expert_bias:
        p.add(
            f"{pre}mlp.router.expert_bias",
            (E,),
            _whole(f"{hf}mlp.gate.e_score_correction_bias", (E,)),
            torch.float32,
        )
    local = _div(E, model.ep, "num_moe_experts over EP")
    Fm = c.moe_ffn_hidden_size
    for k in range(local):
        x = rank.ep * local + k
        expert_hf = f"{hf}mlp.experts.{x}."
        if c.moe_grouped_gemm:
            if not model.te_spec:
                raise LayoutError(
                    "the legacy GroupedMLP (local spec with moe_grouped_gemm) stores experts transposed"
                )
            fc = _Params(p.chunk, p.dtype)
            _gated_mlp(fc, f"{pre}mlp.experts.", expert_hf, rank.etp, model.etp, Fm, H)
            for (
                param
            ) in fc.out:  # TEGroupedMLP: linear_fc1.weight{k}, linear_fc2.weight{k}
                p.out.append(
                    LocalParam(
                        f"{param.buffer}{k}", param.shape, param.dtype, param.pieces
                    )
                )
        else:
            _gated_mlp(
                p,
                f"{pre}mlp.experts.local_experts.{k}.",
                expert_hf,
                rank.etp,
                model.etp,
                Fm,
                H,
            )
    Fs = c.moe_shared_expert_intermediate_size
    if Fs:
        _gated_mlp(
            p,
            f"{pre}mlp.shared_experts.",
            f"{hf}mlp.{model.shared_expert_hf}.",
            rank.tp,
            model.tp,
            Fs,
            H,
        )
        if c.moe_shared_expert_gate:
            p.add(
                f"{pre}mlp.shared_experts.gate_weight",
                (1, H),
                _whole(f"{hf}mlp.shared_expert_gate.weight", (1, H)),
            )


def _layer(
    p: _Params, model: MegatronModel, rank: MegatronRank, pre: str, g: int
) -> None:
    hf = f"model.layers.{g}."
    _attention(p, model, rank, pre, hf)
    _mlp(p, model, rank, pre, hf, g)


def rank_params(model: MegatronModel, rank: MegatronRank) -> List[LocalParam]:
    """Every parameter (and persistent buffer) ``rank`` holds, chunk by chunk, with its pieces."""
    c = model.config
    H, L, P, V = c.hidden_size, c.num_layers, model.pp, model.vpp
    dtype = getattr(c, "params_dtype", torch.float32)
    vocab_rows = model.padded_vocab // model.tp
    mtp = c.mtp_num_layers or 0
    out: List[LocalParam] = []
    for v in range(V):
        p = _Params(v, dtype)
        first, last = rank.pp == 0 and v == 0, rank.pp == P - 1 and v == V - 1
        if first or (last and mtp):
            p.add(
                "embedding.word_embeddings.weight",
                (vocab_rows, H),
                _vocab("model.embed_tokens.weight", model, rank.tp),
            )
        off, count = model.layers(rank.pp, v)
        for i in range(count):
            _layer(p, model, rank, f"decoder.layers.{i}.", off + i)
        if last:
            p.add(
                "decoder.final_layernorm.weight",
                (H,),
                _whole("model.norm.weight", (H,)),
            )
            for k in range(mtp):
                hf, pre = f"model.layers.{L + k}.", f"mtp.layers.{k}."
                for norm in ("enorm", "hnorm"):
                    p.add(
                        f"{pre}{norm}.weight", (H,), _whole(f"{hf}{norm}.weight", (H,))
                    )
                rows = _div(H, model.tp, "eh_proj rows")
                p.add(
                    f"{pre}eh_proj.weight",
                    (rows, 2 * H),
                    (
                        _block(
                            f"{hf}eh_proj.weight", (H, 2 * H), 0, rank.tp * rows, rows
                        ),
                    ),
                )
                p.add(
                    f"{pre}final_layernorm.weight",
                    (H,),
                    _whole(f"{hf}shared_head.norm.weight", (H,)),
                )
                _layer(p, model, rank, f"{pre}transformer_layer.", L + k)
            if not (model.tied and first):
                head = "model.embed_tokens.weight" if model.tied else "lm_head.weight"
                p.add(
                    "output_layer.weight", (vocab_rows, H), _vocab(head, model, rank.tp)
                )
        out.extend(p.out)
    return out


def megatron_sources(
    model: MegatronModel, ranks: Mapping[int, MegatronRank]
) -> SourceLayout:
    """The source layout over ``ranks`` (plan rank -> coordinates; DP replicas repeat
    coordinates): every HF tensor with every holder. Same answer on every rank."""
    holders: Dict[str, List[Holder]] = {}
    shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    by_coords: Dict[MegatronRank, List[LocalParam]] = {}
    for r in sorted(ranks):
        coords = ranks[r]
        if coords not in by_coords:
            by_coords[coords] = rank_params(model, coords)
        for param in by_coords[coords]:
            for piece in param.pieces:
                shapes.setdefault(piece.tensor, (piece.shape, param.dtype))
                holders.setdefault(piece.tensor, []).append(
                    Holder(r, piece.box, param.buffer, piece.offsets, param.shape)
                )
    return {
        name: SourceTensor(name, shapes[name][0], shapes[name][1], tuple(hs))
        for name, hs in holders.items()
    }


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (their ``module`` attribute)."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def local_buffers(
    model_chunks: Sequence[torch.nn.Module],
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(buffer key, tensor) of every parameter and persistent buffer of every chunk, as
    ``rank_params`` names them (wrapper prefixes stripped, ``_extra_state`` skipped)."""
    for v, chunk in enumerate(model_chunks):
        for name, tensor in unwrap(chunk).state_dict(keep_vars=True).items():
            if not name.endswith("_extra_state") and isinstance(tensor, torch.Tensor):
                yield f"chunk{v}/{name}", tensor


def describe_model_chunks(
    model_chunks: Sequence[torch.nn.Module],
    hf_vocab: int,
    rank: MegatronRank,
    shared_expert_hf: str = "shared_experts",
) -> Tuple[MegatronModel, Dict[str, torch.Tensor]]:
    """The layout facts of a live model and this rank's buffers, checked against each other.

    Reads the padded vocab and tying from the model, the layer spec from its names,
    and refuses (``LayoutError``) unless every local parameter and persistent buffer
    is exactly one described by ``rank_params``, with the same shape, and every
    layer's own ``layer_number`` is the global index the description uses.
    """
    gpt = unwrap(model_chunks[0])
    buffers = dict(local_buffers(model_chunks))
    # The TE spec fuses norms into the next linear (``layer_norm_weight``); the local spec never does.
    te_spec = any(k.endswith(".layer_norm_weight") for k in buffers) or not any(
        ".layers." in k for k in buffers
    )
    model = MegatronModel(
        gpt.config,
        hf_vocab,
        gpt.vocab_size,
        bool(gpt.share_embeddings_and_output_weights),
        te_spec,
        shared_expert_hf,
    )
    described = {p.buffer: p for p in rank_params(model, rank)}
    problems = [f"{k}: not described" for k in buffers if k not in described]
    problems += [f"{k}: described but absent" for k in described if k not in buffers]
    problems += [
        f"{k}: local shape {tuple(buffers[k].shape)}, expected {described[k].shape}"
        for k in described
        if k in buffers and tuple(buffers[k].shape) != described[k].shape
    ]
    for v, chunk in enumerate(model_chunks):
        off, count = model.layers(rank.pp, v)
        layers = list(unwrap(chunk).decoder.layers)
        numbers = [layer.layer_number - 1 for layer in layers]
        if numbers != list(range(off, off + count)):
            problems.append(
                f"chunk {v}: layers {numbers}, expected global layers {off}..{off + count - 1}"
            )
    if problems:
        raise LayoutError(f"Megatron model on {rank}: " + "; ".join(problems[:8]))
    return model, buffers
