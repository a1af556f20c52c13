"""Describe: which boxes of which HF tensors each SGLang TP rank needs, and where they land.

One rule per SGLang parameter category (see shared research, "param layouts"):
``Replicated`` (norms, q/k norm, MoE router), ``Sharded`` (column dim 0, row dim 1),
``Stacked`` (merged column: gate_up), ``QKV`` (fused q/k/v with kv-head
replication), ``Vocab`` (vocab-parallel embedding and lm_head, zero padded),
``ExpertsW13``/``ExpertsW2`` (FusedMoE under expert parallelism and MoE-TP).
A rule turns an engine TP rank into a ``ParamTarget``: the parameter's per-rank
shape plus the HF boxes that fill it. Rules are pure and cheap, so the same
description serves the engine, the tests and the simulator.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from sglang.srt.weight_sync.box import Box


@contextmanager
def paused_gc() -> Iterator[None]:
    """Build many small acyclic objects (targets, pieces, moves: millions for a large engine)
    without the cyclic collector's passes, which only cost time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


DEFAULT_VOCAB_PADDING = 64


@dataclass(frozen=True, slots=True)
class Piece:
    """An HF tensor region landing at ``param[index][offsets : offsets + sizes]``.

    ``perm`` (None: identity) says which dim of the region feeds each dim of the
    destination, ``dest = region.permute(perm)``: gpt-oss experts land transposed.
    """

    tensor: str
    box: Box
    index: Tuple[int, ...]
    offsets: Tuple[int, ...]
    perm: Optional[Tuple[int, ...]] = None

    def dest_box(self) -> Box:
        if self.perm is None:
            return Box(self.offsets, self.box.sizes)
        return Box(self.offsets, tuple(self.box.sizes[q] for q in self.perm))

    def region(self, full: torch.Tensor) -> torch.Tensor:
        """This piece's data, laid out as it lands, from the full HF tensor."""
        data = full[self.box.slices()]
        return data if self.perm is None else data.permute(self.perm)


@dataclass(frozen=True, slots=True)
class ParamTarget:
    """One SGLang parameter on one rank: shape, dtype, pieces, and zero-filled regions."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    pieces: Tuple[Piece, ...]
    zeros: Tuple[Box, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineParallel:
    """The engine's TP layout: TP size plus the attention-TP and MoE-EP widths inside it."""

    tp_size: int
    attn_tp_size: Optional[int] = None
    moe_ep_size: int = 1

    def __post_init__(self):
        attn = self.attn_tp_size or self.tp_size
        if self.tp_size % attn or self.tp_size % self.moe_ep_size:
            raise ValueError(
                f"attn_tp_size={attn} and moe_ep_size={self.moe_ep_size} must divide tp_size={self.tp_size}"
            )

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.moe_ep_size

    def group(self, kind: str, rank: int) -> Tuple[int, int]:
        """(rank in group, group size) of engine TP ``rank`` for a layer's group kind."""
        if kind == "tp":
            return rank, self.tp_size
        if kind == "attn_tp":
            attn = self.attn_tp_size or self.tp_size
            return rank % attn, attn
        if kind == "moe_tp":
            return rank % self.moe_tp_size, self.moe_tp_size
        if kind == "moe_ep":
            return rank // self.moe_tp_size, self.moe_ep_size
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

    def target(self, rank: int, parallel: EngineParallel, dtype: torch.dtype) -> ParamTarget:
        box = Box.full(self.shape)
        return ParamTarget(self.param, self.shape, dtype, (Piece(self.tensor, box, (), box.offsets),))


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

    def target(self, rank: int, parallel: EngineParallel, dtype: torch.dtype) -> ParamTarget:
        r, t = parallel.group(self.group, rank)
        size = _divide(self.shape[self.dim], t, f"{self.param} dim {self.dim}")
        box = _shard_box(self.shape, self.dim, r * size, size)
        return ParamTarget(self.param, box.sizes, dtype, (Piece(self.tensor, box, (), (0,) * box.ndim),))


@dataclass(frozen=True, slots=True)
class Stacked:
    """Merged column-parallel: each part is sharded on dim 0 and the shards are stacked
    (``gate_up_proj`` = [gate_r; up_r]; with group "replicated" a plain concatenation)."""

    param: str
    parts: Tuple[Tuple[str, Tuple[int, ...]], ...]
    group: str = "tp"

    def tensors(self) -> Dict[str, Tuple[int, ...]]:
        return dict(self.parts)

    def target(self, rank: int, parallel: EngineParallel, dtype: torch.dtype) -> ParamTarget:
        r, t = parallel.group(self.group, rank)
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

    def target(self, rank: int, parallel: EngineParallel, dtype: torch.dtype) -> ParamTarget:
        r, t = parallel.group(self.group, rank)
        nh = _divide(self.num_heads, t, f"{self.param} q heads")
        if t >= self.num_kv_heads:
            replicas = _divide(t, self.num_kv_heads, f"{self.param} kv heads {self.num_kv_heads} into")
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
        return ParamTarget(self.param, ((nh + nkv) * d + nkv * dv,) + self.trailing, dtype, pieces)


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

    def target(self, rank: int, parallel: EngineParallel, dtype: torch.dtype) -> ParamTarget:
        r, t = parallel.group(self.group, rank)
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
        return {f.format(e=e): shape for e in range(self.num_experts) for f in (self.gate, self.up)}

    def target(self, rank: int, parallel: EngineParallel, dtype: torch.dtype) -> ParamTarget:
        ep, n_ep = parallel.group("moe_ep", rank)
        tp, n_tp = parallel.group("moe_tp", rank)
        local = _divide(self.num_experts, n_ep, f"{self.param} experts over EP")
        rows = _divide(self.intermediate, n_tp, f"{self.param} intermediate over MoE-TP")
        box = Box((tp * rows, 0), (rows, self.hidden))
        pieces = []
        for j in range(local):
            e = ep * local + j
            pieces.append(Piece(self.gate.format(e=e), box, (j,), (0, 0)))
            pieces.append(Piece(self.up.format(e=e), box, (j,), (rows, 0)))
        return ParamTarget(self.param, (local, 2 * rows, self.hidden), dtype, tuple(pieces))


@dataclass(frozen=True, slots=True)
class ExpertsW2:
    """FusedMoE ``w2_weight`` [E_local, H, I/moe_tp]: columns of each local expert's down_proj."""

    param: str
    down: str  # format string with {e}
    num_experts: int
    intermediate: int
    hidden: int

    def tensors(self) -> Dict[str, Tuple[int, ...]]:
        return {self.down.format(e=e): (self.hidden, self.intermediate) for e in range(self.num_experts)}

    def target(self, rank: int, parallel: EngineParallel, dtype: torch.dtype) -> ParamTarget:
        ep, n_ep = parallel.group("moe_ep", rank)
        tp, n_tp = parallel.group("moe_tp", rank)
        local = _divide(self.num_experts, n_ep, f"{self.param} experts over EP")
        cols = _divide(self.intermediate, n_tp, f"{self.param} intermediate over MoE-TP")
        box = Box((0, tp * cols), (self.hidden, cols))
        pieces = tuple(
            Piece(self.down.format(e=ep * local + j), box, (j,), (0, 0)) for j in range(local)
        )
        return ParamTarget(self.param, (local, self.hidden, cols), dtype, pieces)


Rule = Union[Replicated, Sharded, Stacked, QKV, Vocab, ExpertsW13, ExpertsW2]


@dataclass(frozen=True)
class ModelTargets:
    """Every parameter rule of a model plus the engine layout: the whole target description.

    ``aliases`` maps HF names that carry the same data as another name (tied
    ``lm_head.weight`` -> ``model.embed_tokens.weight``) so either may be sent.
    ``dtype_of`` overrides ``dtype`` per parameter (a live engine's fp32 norms, say).
    """

    rules: Tuple[Rule, ...]
    parallel: EngineParallel
    dtype: torch.dtype
    aliases: Mapping[str, str] = field(default_factory=dict)
    dtype_of: Mapping[str, torch.dtype] = field(default_factory=dict)

    def tensor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        shapes: Dict[str, Tuple[int, ...]] = {}
        for rule in self.rules:
            shapes.update(rule.tensors())
        return shapes

    def for_rank(self, rank: int) -> List[ParamTarget]:
        return [rule.target(rank, self.parallel, self.dtype_of.get(rule.param, self.dtype)) for rule in self.rules]

    def by_rank(self) -> Dict[int, List[ParamTarget]]:
        return {r: self.for_rank(r) for r in range(self.parallel.tp_size)}


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
    tied = bool(_cfg(config, "tie_word_embeddings", False)) and model_type != "qwen3_moe"
    experts = 0
    if model_type == "qwen3_moe":
        # transformers 5 writes the expert count as num_local_experts; its config object aliases num_experts.
        experts = _cfg(config, "num_experts", None) or _cfg(config, "num_local_experts", None)
        if not experts:
            raise ValueError("qwen3_moe config has neither num_experts nor num_local_experts")
        if _cfg(config, "mlp_only_layers", None) or (_cfg(config, "decoder_sparse_step", 1) or 1) != 1:
            raise ValueError(
                "qwen3_moe with mlp_only_layers or decoder_sparse_step != 1 is not supported: SGLang 0.5.23 "
                "builds every layer sparse and never loads those layers' dense weights"
            )

    embed_group = "tp" if model_type == "llama" else "attn_tp"  # Qwen embeds on attn_tp under DP attention
    rules: List[Rule] = [Vocab("model.embed_tokens.weight", "model.embed_tokens.weight", (vocab, hidden), group=embed_group)]
    for layer in range(_cfg(config, "num_hidden_layers")):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        for kind, trailing, enabled in (("weight", (hidden,), True), ("bias", (), qkv_bias)):
            if enabled:
                rules.append(
                    QKV(f"{a}.qkv_proj.{kind}", f"{a}.q_proj.{kind}", f"{a}.k_proj.{kind}", f"{a}.v_proj.{kind}",
                        heads, kv_heads, head_dim, trailing, group=attn_group)
                )
        rules.append(Sharded(f"{a}.o_proj.weight", f"{a}.o_proj.weight", (hidden, heads * head_dim), 1, attn_group))
        if o_bias:
            rules.append(Replicated(f"{a}.o_proj.bias", f"{a}.o_proj.bias", (hidden,)))
        if model_type in ("qwen3", "qwen3_moe"):
            rules += [Replicated(f"{a}.{n}.weight", f"{a}.{n}.weight", (head_dim,)) for n in ("q_norm", "k_norm")]
        rules += [Replicated(f"{p}.{n}.weight", f"{p}.{n}.weight", (hidden,)) for n in ("input_layernorm", "post_attention_layernorm")]
        m = f"{p}.mlp"
        if experts:
            inter = _cfg(config, "moe_intermediate_size")
            rules.append(Replicated(f"{m}.gate.weight", f"{m}.gate.weight", (experts, hidden)))
            rules.append(ExpertsW13(f"{m}.experts.w13_weight", m + ".experts.{e}.gate_proj.weight", m + ".experts.{e}.up_proj.weight", experts, inter, hidden))
            rules.append(ExpertsW2(f"{m}.experts.w2_weight", m + ".experts.{e}.down_proj.weight", experts, inter, hidden))
        else:
            inter = _cfg(config, "intermediate_size")
            rules.append(Stacked(f"{m}.gate_up_proj.weight", ((f"{m}.gate_proj.weight", (inter, hidden)), (f"{m}.up_proj.weight", (inter, hidden)))))
            rules.append(Sharded(f"{m}.down_proj.weight", f"{m}.down_proj.weight", (hidden, inter), 1))
    rules.append(Replicated("model.norm.weight", "model.norm.weight", (hidden,)))
    aliases = {}
    if tied:
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    else:
        rules.append(Vocab("lm_head.weight", "lm_head.weight", (vocab, hidden), group="tp"))
    return ModelTargets(tuple(rules), parallel, dtype, aliases)


def reference_param(target: ParamTarget, full: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The parameter a rank should end with, built by slicing full HF tensors (tests, checks);
    zero boxes and regions no piece covers are zero."""
    out = torch.zeros(target.shape, dtype=target.dtype)
    for piece in target.pieces:
        out[piece.index][piece.dest_box().slices()] = piece.region(full[piece.tensor])
    return out
