"""Hand-written target rules: the simulator's fast model of SGLang's parameter layouts.

One rule per SGLang parameter category: ``Replicated`` (norms, q/k norm, MoE
router), ``Sharded`` (column dim 0, row dim 1), ``Stacked`` (merged column:
gate_up), ``QKV`` (fused q/k/v with kv-head replication), ``Vocab``
(vocab-parallel embedding and lm_head, zero padded), ``ExpertsW13``/``ExpertsW2``
(FusedMoE under expert parallelism and MoE-TP). A rule turns an engine TP rank
into a ``ParamTarget``: the parameter's per-rank shape plus the HF boxes that fill it.

The engine never uses these: it derives its targets from SGLang's own loaders
(``sglang.srt.weight_sync.derive.derived_targets``). The rules stay here because they are
pure and build no model, so the simulator describes any model size and rank count
cheaply, and tests use them (with ``reference_param``) as an oracle independent of
the derivation. ``test/unit/test_hand_rules.py`` proves them against
SGLang's weight loaders, ``test_derived_targets.py`` against the derived targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.target_layout import (
    EngineParallel,
    ModelTargets,
    ParamTarget,
    Piece,
)

__all__ = [
    "DEFAULT_VOCAB_PADDING",
    "ExpertsW13",
    "ExpertsW2",
    "QKV",
    "Replicated",
    "Rule",
    "Sharded",
    "Stacked",
    "Vocab",
    "group_of",
    "model_targets_from_config",
    "padded_vocab_size",
    "reference_param",
]

DEFAULT_VOCAB_PADDING = 64


def group_of(parallel: EngineParallel, kind: str, rank: int) -> Tuple[int, int]:
    """(rank in group, group size) of engine TP ``rank`` for a rule's group kind:
    "tp", "attn_tp", "moe_tp", "moe_ep" (MoE-EP x MoE-TP split the TP group) or "replicated"."""
    if kind == "tp":
        return rank, parallel.tp_size
    attn = parallel.attn_tp_size or parallel.tp_size
    moe_tp = parallel.tp_size // parallel.moe_ep_size
    if kind == "attn_tp":
        return rank % attn, attn
    if kind == "moe_tp":
        return rank % moe_tp, moe_tp
    if kind == "moe_ep":
        return rank // moe_tp, parallel.moe_ep_size
    if kind == "replicated":
        return 0, 1
    raise ValueError(f"unknown parallel group kind {kind!r}")


def _divide(n: int, t: int, what: str) -> int:
    if n % t:
        raise ValueError(f"{what}: {n} is not divisible by TP size {t}")
    return n // t


def _shard_box(shape: Sequence[int], dim: int, start: int, size: int) -> Box:
    offsets, sizes = [0] * len(shape), list(shape)
    offsets[dim], sizes[dim] = start, size
    return Box(tuple(offsets), tuple(sizes))


@dataclass(frozen=True, slots=True)
class Replicated:
    """Full copy on every rank (norms, q_norm/k_norm, row-parallel bias, MoE router)."""

    param: str
    tensor: str
    shape: Tuple[int, ...]
    group: str = "replicated"

    def tensors(self) -> Dict[str, Tuple[int, ...]]:
        return {self.tensor: self.shape}

    def target(
        self, rank: int, parallel: EngineParallel, dtype: torch.dtype
    ) -> ParamTarget:
        box = Box.full(self.shape)
        return ParamTarget(
            self.param, self.shape, dtype, (Piece(self.tensor, box, (), box.offsets),)
        )


@dataclass(frozen=True, slots=True)
class Sharded:
    """Contiguous equal shards along ``dim``: column-parallel (0) or row-parallel (1)."""

    param: str
    tensor: str
    shape: Tuple[int, ...]
    dim: int
    group: str = "tp"

    def tensors(self) -> Dict[str, Tuple[int, ...]]:
        return {self.tensor: self.shape}

    def target(
        self, rank: int, parallel: EngineParallel, dtype: torch.dtype
    ) -> ParamTarget:
        r, t = group_of(parallel, self.group, rank)
        size = _divide(self.shape[self.dim], t, f"{self.param} dim {self.dim}")
        box = _shard_box(self.shape, self.dim, r * size, size)
        return ParamTarget(
            self.param,
            box.sizes,
            dtype,
            (Piece(self.tensor, box, (), (0,) * box.ndim),),
        )


@dataclass(frozen=True, slots=True)
class Stacked:
    """Merged column-parallel: each part is sharded on dim 0 and the shards are stacked
    (``gate_up_proj`` = [gate_r; up_r]; with group "replicated" a plain concatenation)."""

    param: str
    parts: Tuple[Tuple[str, Tuple[int, ...]], ...]
    group: str = "tp"

    def tensors(self) -> Dict[str, Tuple[int, ...]]:
        return dict(self.parts)

    def target(
        self, rank: int, parallel: EngineParallel, dtype: torch.dtype
    ) -> ParamTarget:
        r, t = group_of(parallel, self.group, rank)
        pieces, row = [], 0
        for tensor, shape in self.parts:
            size = _divide(shape[0], t, f"{self.param} part {tensor}")
            box = _shard_box(shape, 0, r * size, size)
            pieces.append(Piece(tensor, box, (), (row,) + (0,) * (len(shape) - 1)))
            row += size
        trailing = self.parts[0][1][1:]
        return ParamTarget(self.param, (row,) + tuple(trailing), dtype, tuple(pieces))


@dataclass(frozen=True, slots=True)
class QKV:
    """Fused ``qkv_proj`` (weight or bias): q heads sharded, kv heads sharded or, when
    TP exceeds the kv head count, replicated over ``tp / num_kv_heads`` consecutive ranks."""

    param: str
    q: str
    k: str
    v: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    trailing: Tuple[int, ...]
    v_head_dim: Optional[int] = None
    group: str = "tp"

    def tensors(self) -> Dict[str, Tuple[int, ...]]:
        dv = self.v_head_dim or self.head_dim
        return {
            self.q: (self.num_heads * self.head_dim,) + self.trailing,
            self.k: (self.num_kv_heads * self.head_dim,) + self.trailing,
            self.v: (self.num_kv_heads * dv,) + self.trailing,
        }

    def target(
        self, rank: int, parallel: EngineParallel, dtype: torch.dtype
    ) -> ParamTarget:
        r, t = group_of(parallel, self.group, rank)
        nh = _divide(self.num_heads, t, f"{self.param} q heads")
        if t >= self.num_kv_heads:
            replicas = _divide(
                t, self.num_kv_heads, f"{self.param} kv heads {self.num_kv_heads} into"
            )
            nkv, kv_index = 1, r // replicas
        else:
            nkv, kv_index = _divide(self.num_kv_heads, t, f"{self.param} kv heads"), r
        d, dv = self.head_dim, self.v_head_dim or self.head_dim
        shapes = self.tensors()
        zeros = (0,) * len(self.trailing)
        q_box = _shard_box(shapes[self.q], 0, r * nh * d, nh * d)
        k_box = _shard_box(shapes[self.k], 0, kv_index * nkv * d, nkv * d)
        v_box = _shard_box(shapes[self.v], 0, kv_index * nkv * dv, nkv * dv)
        pieces = (
            Piece(self.q, q_box, (), (0,) + zeros),
            Piece(self.k, k_box, (), (nh * d,) + zeros),
            Piece(self.v, v_box, (), ((nh + nkv) * d,) + zeros),
        )
        return ParamTarget(
            self.param, ((nh + nkv) * d + nkv * dv,) + self.trailing, dtype, pieces
        )


def padded_vocab_size(vocab: int, tp: int, padding: int = DEFAULT_VOCAB_PADDING) -> int:
    """SGLang's padded vocab: a multiple of 64, or of 64*tp when 64 does not split evenly."""
    pad = lambda n, to: (n + to - 1) // to * to  # noqa: E731
    if pad(vocab, padding) % tp:
        padding *= tp
    return pad(vocab, padding)


@dataclass(frozen=True, slots=True)
class Vocab:
    """Vocab-parallel embedding or lm_head: rows of the padded vocab split evenly,
    real rows first on each rank, padding rows zero."""

    param: str
    tensor: str
    shape: Tuple[int, ...]
    padding: int = DEFAULT_VOCAB_PADDING
    group: str = "tp"

    def tensors(self) -> Dict[str, Tuple[int, ...]]:
        return {self.tensor: self.shape}

    def target(
        self, rank: int, parallel: EngineParallel, dtype: torch.dtype
    ) -> ParamTarget:
        r, t = group_of(parallel, self.group, rank)
        vocab = self.shape[0]
        per_rank = padded_vocab_size(vocab, t, self.padding) // t
        start, end = min(r * per_rank, vocab), min((r + 1) * per_rank, vocab)
        shape = (per_rank,) + tuple(self.shape[1:])
        pieces, zeros = (), ()
        trailing0 = (0,) * (len(shape) - 1)
        if end > start:
            box = _shard_box(self.shape, 0, start, end - start)
            pieces = (Piece(self.tensor, box, (), (0,) + trailing0),)
        if end - start < per_rank:
            zeros = (_shard_box(shape, 0, end - start, per_rank - (end - start)),)
        return ParamTarget(self.param, shape, dtype, pieces, zeros)


@dataclass(frozen=True, slots=True)
class ExpertsW13:
    """FusedMoE ``w13_weight`` [E_local, 2*I/moe_tp, H]: local expert j is global expert
    ``ep_rank*E_local + j`` and holds [gate shard; up shard] of the MoE-TP rank."""

    param: str
    gate: str  # format string with {e}
    up: str
    num_experts: int
    intermediate: int
    hidden: int

    def tensors(self) -> Dict[str, Tuple[int, ...]]:
        shape = (self.intermediate, self.hidden)
        return {
            f.format(e=e): shape
            for e in range(self.num_experts)
            for f in (self.gate, self.up)
        }

    def target(
        self, rank: int, parallel: EngineParallel, dtype: torch.dtype
    ) -> ParamTarget:
        ep, n_ep = group_of(parallel, "moe_ep", rank)
        tp, n_tp = group_of(parallel, "moe_tp", rank)
        local = _divide(self.num_experts, n_ep, f"{self.param} experts over EP")
        rows = _divide(
            self.intermediate, n_tp, f"{self.param} intermediate over MoE-TP"
        )
        box = Box((tp * rows, 0), (rows, self.hidden))
        pieces = []
        for j in range(local):
            e = ep * local + j
            pieces.append(Piece(self.gate.format(e=e), box, (j,), (0, 0)))
            pieces.append(Piece(self.up.format(e=e), box, (j,), (rows, 0)))
        return ParamTarget(
            self.param, (local, 2 * rows, self.hidden), dtype, tuple(pieces)
        )


@dataclass(frozen=True, slots=True)
class ExpertsW2:
    """FusedMoE ``w2_weight`` [E_local, H, I/moe_tp]: columns of each local expert's down_proj."""

    param: str
    down: str  # format string with {e}
    num_experts: int
    intermediate: int
    hidden: int

    def tensors(self) -> Dict[str, Tuple[int, ...]]:
        return {
            self.down.format(e=e): (self.hidden, self.intermediate)
            for e in range(self.num_experts)
        }

    def target(
        self, rank: int, parallel: EngineParallel, dtype: torch.dtype
    ) -> ParamTarget:
        ep, n_ep = group_of(parallel, "moe_ep", rank)
        tp, n_tp = group_of(parallel, "moe_tp", rank)
        local = _divide(self.num_experts, n_ep, f"{self.param} experts over EP")
        cols = _divide(
            self.intermediate, n_tp, f"{self.param} intermediate over MoE-TP"
        )
        box = Box((0, tp * cols), (self.hidden, cols))
        pieces = tuple(
            Piece(self.down.format(e=ep * local + j), box, (j,), (0, 0))
            for j in range(local)
        )
        return ParamTarget(self.param, (local, self.hidden, cols), dtype, pieces)


Rule = Union[Replicated, Sharded, Stacked, QKV, Vocab, ExpertsW13, ExpertsW2]


def _cfg(config: Union[Mapping, object], key: str, default=None):
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def model_targets_from_config(
    config: Union[Mapping, object],
    parallel: EngineParallel,
    dtype: torch.dtype = torch.bfloat16,
) -> ModelTargets:
    """Rules for the Llama / Qwen2 / Qwen3 / Qwen3-MoE families from an HF config.

    Mirrors how those SGLang models build their layers: attention on "tp"
    (Llama, Qwen2) or "attn_tp" (Qwen3, Qwen3-MoE), dense MLP on "tp", experts
    on MoE-EP x MoE-TP, and the lm_head dropped when embeddings are tied.
    """
    model_type = _cfg(config, "model_type")
    if model_type not in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        raise ValueError(f"no target rules for model_type {model_type!r}")
    hidden = _cfg(config, "hidden_size")
    heads = _cfg(config, "num_attention_heads")
    kv_heads = _cfg(config, "num_key_value_heads") or heads
    head_dim = _cfg(config, "head_dim") or hidden // heads
    vocab = _cfg(config, "vocab_size")
    attn_group = "attn_tp" if model_type in ("qwen3", "qwen3_moe") else "tp"
    qkv_bias = model_type == "qwen2" or bool(_cfg(config, "attention_bias", False))
    o_bias = model_type != "qwen2" and bool(_cfg(config, "attention_bias", False))
    tied = (
        bool(_cfg(config, "tie_word_embeddings", False)) and model_type != "qwen3_moe"
    )
    experts = 0
    if model_type == "qwen3_moe":
        # transformers 5 writes the expert count as num_local_experts; its config object aliases num_experts.
        experts = _cfg(config, "num_experts", None) or _cfg(
            config, "num_local_experts", None
        )
        if not experts:
            raise ValueError(
                "qwen3_moe config has neither num_experts nor num_local_experts"
            )
        if (
            _cfg(config, "mlp_only_layers", None)
            or (_cfg(config, "decoder_sparse_step", 1) or 1) != 1
        ):
            raise ValueError(
                "qwen3_moe with mlp_only_layers or decoder_sparse_step != 1 is not supported: SGLang 0.5.23 "
                "builds every layer sparse and never loads those layers' dense weights"
            )

    embed_group = (
        "tp" if model_type == "llama" else "attn_tp"
    )  # Qwen embeds on attn_tp under DP attention
    rules: List[Rule] = [
        Vocab(
            "model.embed_tokens.weight",
            "model.embed_tokens.weight",
            (vocab, hidden),
            group=embed_group,
        )
    ]
    for layer in range(_cfg(config, "num_hidden_layers")):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        for kind, trailing, enabled in (
            ("weight", (hidden,), True),
            ("bias", (), qkv_bias),
        ):
            if enabled:
                rules.append(
                    QKV(
                        f"{a}.qkv_proj.{kind}",
                        f"{a}.q_proj.{kind}",
                        f"{a}.k_proj.{kind}",
                        f"{a}.v_proj.{kind}",
                        heads,
                        kv_heads,
                        head_dim,
                        trailing,
                        group=attn_group,
                    )
                )
        rules.append(
            Sharded(
                f"{a}.o_proj.weight",
                f"{a}.o_proj.weight",
                (hidden, heads * head_dim),
                1,
                attn_group,
            )
        )
        if o_bias:
            rules.append(Replicated(f"{a}.o_proj.bias", f"{a}.o_proj.bias", (hidden,)))
        if model_type in ("qwen3", "qwen3_moe"):
            rules += [
                Replicated(f"{a}.{n}.weight", f"{a}.{n}.weight", (head_dim,))
                for n in ("q_norm", "k_norm")
            ]
        rules += [
            Replicated(f"{p}.{n}.weight", f"{p}.{n}.weight", (hidden,))
            for n in ("input_layernorm", "post_attention_layernorm")
        ]
        m = f"{p}.mlp"
        if experts:
            inter = _cfg(config, "moe_intermediate_size")
            rules.append(
                Replicated(f"{m}.gate.weight", f"{m}.gate.weight", (experts, hidden))
            )
            rules.append(
                ExpertsW13(
                    f"{m}.experts.w13_weight",
                    m + ".experts.{e}.gate_proj.weight",
                    m + ".experts.{e}.up_proj.weight",
                    experts,
                    inter,
                    hidden,
                )
            )
            rules.append(
                ExpertsW2(
                    f"{m}.experts.w2_weight",
                    m + ".experts.{e}.down_proj.weight",
                    experts,
                    inter,
                    hidden,
                )
            )
        else:
            inter = _cfg(config, "intermediate_size")
            rules.append(
                Stacked(
                    f"{m}.gate_up_proj.weight",
                    (
                        (f"{m}.gate_proj.weight", (inter, hidden)),
                        (f"{m}.up_proj.weight", (inter, hidden)),
                    ),
                )
            )
            rules.append(
                Sharded(
                    f"{m}.down_proj.weight", f"{m}.down_proj.weight", (hidden, inter), 1
                )
            )
    rules.append(Replicated("model.norm.weight", "model.norm.weight", (hidden,)))
    aliases = {}
    if tied:
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    else:
        rules.append(
            Vocab("lm_head.weight", "lm_head.weight", (vocab, hidden), group="tp")
        )
    return ModelTargets(tuple(rules), parallel, dtype, aliases)


def reference_param(
    target: ParamTarget, full: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The parameter a rank should end with, built by slicing full HF tensors (tests, checks);
    zero boxes and regions no piece covers are zero."""
    out = torch.zeros(target.shape, dtype=target.dtype)
    for piece in target.pieces:
        out[piece.index][piece.dest_box().slices()] = piece.region(full[piece.tensor])
    return out
