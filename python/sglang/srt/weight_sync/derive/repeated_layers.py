"""Describe, faster: a model's repeated layers go through SGLang's loaders once, the rest follow by renaming.

DeepSeek-V3 has 61 decoder layers, 58 of them the same MoE layer, and running SGLang's
loaders on every one of them under the recorder is nearly all of a rank's derivation.
Layers of one *kind* (checkpoint tensors ``<prefix>.<i>.<rest>`` with the same ``rest``
names, shapes and dtypes for every ``i``) are loaded alike but for their number. So the
derivation loads the first and the last layer of each kind from a checkpoint without the
others (``sample_layers``), and describes every other layer of the kind as the first one
renamed (``LayerSampling.extend``).

That rests on SGLang's loaders treating two layers of one kind alike, which is checked on
every derivation: the last layer's derived targets (pieces, boxes, zero fills, refusals,
post-load tensors, tensors read) must equal the first's renamed, no target may mix layers,
and every layer of the kind must hold the same SGLang parameters (names after the number,
shapes, dtypes) as the first. Where one fails, ``extend`` raises ``LayersDiffer`` and the
caller derives every layer (as it does when a loader refuses a checkpoint without them).
What the check cannot see: a loader treating a *middle* layer of a kind differently by its
number alone (same checkpoint tensors, same SGLang parameters). No architecture tested does
(``test_derived_targets.py`` compares with every layer loaded and with SGLang's real load).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import (
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)

import torch

from sglang.srt.weight_sync.derive.derived_targets import (
    CheckpointLayout,
    RankTargets,
    derive_rank,
    tensor_specs,
)
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

__all__ = (
    "LayerKind",
    "LayerSampling",
    "LayersDiffer",
    "derive_once_per_layer_kind",
    "derive_sampled",
    "layer_of",
    "layer_pattern",
    "sample_layers",
)

logger = logging.getLogger(__name__)

_NUMBERED = re.compile(r"\.(\d+)\.")
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")

# (name, shape, dtype) of a tensor, checkpoint's or engine's.
TensorSpec = Tuple[str, Tuple[int, ...], torch.dtype]


class LayersDiffer(ValueError):
    """Layers of one checkpoint kind are not loaded alike: every layer must be derived."""


def layer_of(name: str) -> Optional[Tuple[str, int]]:
    """``(prefix, number)`` of the first numbered component of ``name``
    (``model.layers.7.mlp.experts.3.w1`` -> ``("model.layers", 7)``), or None."""
    split = _split(name)
    return None if split is None else split[:2]


def layer_pattern(name: str) -> str:
    """``name`` with every numbered component blanked (``model.layers.7.mlp.experts.w13_weight``
    -> ``model.layers.*.mlp.experts.w13_weight``): the same for a tensor of every layer of a kind."""
    return _NUMBER.sub("*", name)


def _split(name: str) -> Optional[Tuple[str, int, str]]:
    """``(prefix, number, rest)`` around the first numbered component of ``name``, or None."""
    m = _NUMBERED.search(name)
    return None if m is None else (name[: m.start()], int(m.group(1)), name[m.end() :])


@dataclass(frozen=True)
class LayerKind:
    """Checkpoint layers ``prefix.<i>.`` for ``i`` in ``numbers`` (ascending, at least 3)
    holding tensors of the same names after the number, shapes and dtypes."""

    prefix: str
    numbers: Tuple[int, ...]

    @property
    def first(self) -> int:
        return self.numbers[0]

    @property
    def last(self) -> int:
        return self.numbers[-1]

    @property
    def renamed(self) -> Tuple[int, ...]:
        """The layers not loaded: described as the first one renamed."""
        return self.numbers[1:-1]


@dataclass(frozen=True)
class LayerSampling:
    """What to load (``tensors``: the checkpoint without the renamed layers) and how to extend it."""

    kinds: Tuple[LayerKind, ...]
    tensors: Tuple[TensorSpec, ...]

    def extend(
        self, derived: RankTargets, engine_tensors: Sequence[TensorSpec]
    ) -> RankTargets:
        """``derived`` (a ``RankTargets`` of ``tensors``) with every renamed layer added, as a
        derivation of the whole checkpoint gives it: targets in ``engine_tensors``' order (the
        model's parameters and buffers). Raises ``LayersDiffer`` when the check (the module's
        text) finds the layers of a kind loaded differently."""
        parts = _Parts(derived)
        order = {name: k for k, (name, _, _) in enumerate(engine_tensors)}
        structure = _by_layer(engine_tensors)
        targets = list(derived.targets)
        not_copied, post_load, read = (
            dict(derived.not_copied),
            dict(derived.post_load),
            set(derived.read),
        )
        for kind in self.kinds:
            engine = parts.engine_prefix(kind)
            first = parts.part(kind, engine, kind.first)
            if first.renamed(kind.prefix, engine, kind.first, kind.last) != parts.part(
                kind, engine, kind.last
            ):
                raise LayersDiffer(
                    f"{kind.prefix}.{kind.last} is not loaded like {kind.prefix}.{kind.first}"
                )
            for i in kind.renamed:
                if parts.touches(kind, engine, i):
                    raise LayersDiffer(
                        f"{kind.prefix}.{i} was not loaded, yet the derivation holds some of it"
                    )
                if engine is not None and structure.get((engine, i)) != structure.get(
                    (engine, kind.first)
                ):
                    raise LayersDiffer(
                        f"SGLang's {engine}.{i} holds other tensors than {engine}.{kind.first}"
                    )
                part = first.renamed(kind.prefix, engine, kind.first, i)
                targets += part.targets
                not_copied.update(part.not_copied)
                post_load.update(part.post_load)
                read |= part.read
        targets.sort(key=lambda t: order[t.name])
        return replace(
            derived,
            targets=tuple(targets),
            not_copied=not_copied,
            post_load=post_load,
            read=frozenset(read),
        )


def derive_once_per_layer_kind(
    build: Callable[[], torch.nn.Module], checkpoint: CheckpointLayout
) -> RankTargets:
    """``derive_rank`` of a fresh ``build()``, with each kind of repeated layer loaded once
    (its first and last layer): what ``derive_rank`` of the whole checkpoint gives, at a
    fraction of the cost for a deep model (the engine's ``derive``). Where the check finds the
    layers of a kind loaded differently (``LayerSampling.extend``), or the loader refuses a
    checkpoint without the others, every layer is derived."""
    sampling = sample_layers(checkpoint.tensors)
    if sampling is not None:
        try:
            return derive_sampled(build(), checkpoint, sampling)
        except Exception as e:  # noqa: BLE001 - deriving every layer settles it: its error, if any, is the real one
            logger.info(
                "weight sync: deriving every layer (%s: %s)", type(e).__name__, e
            )
    return derive_rank(build(), checkpoint)


def derive_sampled(
    model: torch.nn.Module, checkpoint: CheckpointLayout, sampling: LayerSampling
) -> RankTargets:
    """``derive_rank`` of ``model`` loading the layers ``sampling`` keeps, extended to every
    layer of ``checkpoint``; raises ``LayersDiffer`` where that would not be what
    ``derive_rank`` of the whole checkpoint gives."""
    derived = derive_rank(model, replace(checkpoint, tensors=sampling.tensors))
    return sampling.extend(derived, tensor_specs(model))


def sample_layers(tensors: Iterable[TensorSpec]) -> Optional[LayerSampling]:
    """The layer kinds of a checkpoint with at least 3 layers each, and the checkpoint without
    their middle layers; None when no kind repeats (nothing to save)."""
    tensors = tuple(tensors)
    numbers = defaultdict(list)
    for (prefix, i), held in _by_layer(tensors).items():
        numbers[(prefix, tuple(sorted(held, key=lambda h: h[0])))].append(i)
    kinds = tuple(
        sorted(
            (
                LayerKind(prefix, tuple(sorted(ns)))
                for (prefix, _), ns in numbers.items()
                if len(ns) >= 3
            ),
            key=lambda k: (k.prefix, k.first),
        )
    )
    if not kinds:
        return None
    skipped = {(k.prefix, i) for k in kinds for i in k.renamed}
    return LayerSampling(
        kinds, tuple(t for t in tensors if layer_of(t[0]) not in skipped)
    )


@dataclass(frozen=True)
class _Part:
    """What a derivation holds of one layer: its engine targets, refusals and post-load
    tensors, and the checkpoint tensors of the layer it read."""

    targets: Tuple[ParamTarget, ...]
    not_copied: Mapping[str, str]
    post_load: Mapping[str, Tuple[str, ...]]
    read: FrozenSet[str]

    def renamed(self, prefix: str, engine: Optional[str], old: int, new: int) -> _Part:
        """This part as layer ``new``'s: checkpoint names ``prefix.old.`` and engine names
        ``engine.old.`` renumbered."""
        pairs = [(f"{prefix}.{old}.", f"{prefix}.{new}.")]
        if engine is not None and engine != prefix:
            pairs.append((f"{engine}.{old}.", f"{engine}.{new}."))

        def name(n: str) -> str:
            for a, b in pairs:
                if n.startswith(a):
                    return b + n[len(a) :]
            return n

        within = re.compile(
            r"(?<![\w.])(" + "|".join(re.escape(a) for a, _ in pairs) + ")"
        )
        lookup = dict(pairs)
        return _Part(
            tuple(
                ParamTarget(
                    name(t.name),
                    t.shape,
                    t.dtype,
                    tuple(
                        Piece(name(p.tensor), p.box, p.index, p.offsets, p.perm)
                        for p in t.pieces
                    ),
                    t.zeros,
                )
                for t in self.targets
            ),
            {
                name(n): within.sub(lambda m: lookup[m.group(1)], why)
                for n, why in self.not_copied.items()
            },
            {
                name(n): tuple(name(d) for d in deps)
                for n, deps in self.post_load.items()
            },
            frozenset(name(n) for n in self.read),
        )


class _Parts:
    """A derivation indexed by layer: engine tensors by engine layer, checkpoint tensors by checkpoint layer."""

    def __init__(self, derived):
        self.targets = defaultdict(list)
        self.sources: Dict[Tuple[str, int], set] = defaultdict(
            set
        )  # checkpoint layer -> engine tensors fed
        for t in derived.targets:
            self.targets[layer_of(t.name)].append(t)
            for p in t.pieces:
                self.sources[layer_of(p.tensor)].add(t.name)
        self.post_load = defaultdict(dict)
        for n, deps in derived.post_load.items():
            self.post_load[layer_of(n)][n] = deps
            for d in deps:
                self.sources[layer_of(d)].add(n)
        self.not_copied = defaultdict(dict)
        for n, why in derived.not_copied.items():
            self.not_copied[layer_of(n)][n] = why
        self.read = defaultdict(set)
        for n in derived.read:
            self.read[layer_of(n)].add(n)

    def engine_prefix(self, kind: LayerKind) -> Optional[str]:
        """The engine's name for the layers of ``kind`` (``model.language_model.layers`` loads
        into ``model.layers``): the one prefix of every tensor its first and last layers feed,
        each numbered like the layer; None when they feed nothing."""
        prefixes = set()
        for i in (kind.first, kind.last):
            for fed in self.sources.get((kind.prefix, i), ()):
                layer = layer_of(fed)
                if layer is None or layer[1] != i:
                    raise LayersDiffer(
                        f"{fed} is fed from {kind.prefix}.{i} but is not numbered {i}"
                    )
                prefixes.add(layer[0])
        if len(prefixes) > 1:
            raise LayersDiffer(
                f"{kind.prefix}.<i> feeds several engine layers: {sorted(prefixes)}"
            )
        return next(iter(prefixes), None)

    def part(self, kind: LayerKind, engine: Optional[str], i: int) -> _Part:
        targets = tuple(self.targets.get((engine, i), ())) if engine is not None else ()
        post_load = self.post_load.get((engine, i), {}) if engine is not None else {}
        fed = [(t.name, p.tensor) for t in targets for p in t.pieces]
        fed += [(n, d) for n, deps in post_load.items() for d in deps]
        foreign = sorted({(n, d) for n, d in fed if layer_of(d) != (kind.prefix, i)})
        if foreign:
            raise LayersDiffer(
                f"{foreign[0][0]} is fed from outside {kind.prefix}.{i}: {foreign[0][1]}"
            )
        return _Part(
            targets,
            self.not_copied.get((kind.prefix, i), {}),
            post_load,
            frozenset(self.read.get((kind.prefix, i), ())),
        )

    def touches(self, kind: LayerKind, engine: Optional[str], i: int) -> bool:
        return bool(
            self.read.get((kind.prefix, i))
            or self.not_copied.get((kind.prefix, i))
            or self.sources.get((kind.prefix, i))
            or (
                engine is not None
                and (self.targets.get((engine, i)) or self.post_load.get((engine, i)))
            )
        )


def _by_layer(tensors: Sequence[TensorSpec]) -> Dict[Tuple[str, int], Tuple]:
    """Layer (prefix, number) -> its tensors (name after the number, shape, dtype), in the
    given order: a checkpoint's, or the engine model's."""
    out = defaultdict(list)
    for name, shape, dtype in tensors:
        split = _split(name)
        if split is not None:
            out[split[:2]].append((split[2], shape, dtype))
    return {k: tuple(v) for k, v in out.items()}
