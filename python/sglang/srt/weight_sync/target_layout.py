"""Describe: which boxes of which HF tensors each SGLang TP rank needs, and where they land.

A ``ParamTarget`` is one SGLang parameter on one engine TP rank: its per-rank shape
and dtype, the ``Piece``s (an HF tensor box landing at ``param[index][offsets...]``)
that fill it, and zero-filled boxes. The engine derives them from SGLang's own
loaders (``derive.derived_targets``); the planner and the executor consume them.
``ModelTargets`` is the same description as rules plus the engine's ``EngineParallel``
layout (the interface ``DerivedTargets`` shares).
"""

# pr: scale
# The engine's manifest publishes them, and trainer-side resharding plans with them.
# pr: scale end
# pr: here
# The simulator's hand-written rules live in ``benchmark/weight_sync/hand_rules.py``.
# pr: here end

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import (
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Protocol,
    Set,
    Tuple,
)

import torch

from sglang.srt.weight_sync.box import Box

__all__ = (
    "EngineParallel",
    "ModelTargets",
    "ParamTarget",
    "Piece",
    "restrict",
    "restrict_to_names",
)


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


class TargetRule(Protocol):
    """How one SGLang parameter is laid out over the engine's ranks: the HF tensors it is
    made of, and its ``ParamTarget`` on each rank."""

    param: str

    def tensors(self) -> Dict[str, Tuple[int, ...]]: ...

    def target(
        self, rank: int, parallel: EngineParallel, dtype: torch.dtype
    ) -> ParamTarget: ...


@dataclass(frozen=True)
class ModelTargets:
    """Every parameter rule of a model plus the engine layout: the whole target description.

    ``aliases`` maps HF names that carry the same data as another name (tied
    ``lm_head.weight`` -> ``model.embed_tokens.weight``) so either may be sent.
    ``dtype_of`` overrides ``dtype`` per parameter (a live engine's fp32 norms, say).
    """

    rules: Tuple[TargetRule, ...]
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
        return [
            rule.target(rank, self.parallel, self.dtype_of.get(rule.param, self.dtype))
            for rule in self.rules
        ]

    def by_rank(self) -> Dict[int, List[ParamTarget]]:
        return {r: self.for_rank(r) for r in range(self.parallel.tp_size)}


def restrict(
    wanted: Iterable[ParamTarget], delivered: Iterable[str], aliases: Mapping[str, str]
) -> List[ParamTarget]:
    """Only the pieces filled from the HF tensors of this update (a trainer may send its
    weights in batches); a parameter with none of them is left out. Zero fills stay
    with a parameter that is written."""
    return restrict_to_names({aliases.get(n, n) for n in delivered}, wanted)


def restrict_to_names(
    names: Set[str], wanted: Iterable[ParamTarget]
) -> List[ParamTarget]:
    """``restrict`` for names already resolved through the aliases."""
    out = []
    for t in wanted:
        pieces = tuple(p for p in t.pieces if p.tensor in names)
        if pieces:
            out.append(dataclasses.replace(t, pieces=pieces))
    return out
