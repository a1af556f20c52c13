"""Describe: targets derived from SGLang's own loaders, for any model SGLang can load.

For each engine TP rank, the engine's model is built on the meta device as that
rank (the engine's published server args and parallel layout, placement-only
process groups, the platform's own loader branches), then SGLang's own
``load_weights`` and post-load processing run on meta checkpoint tensors under
``LoadRecorder``. What landed where becomes ``ParamTarget``s: pieces of HF
tensors (possibly permuted) and zero-filled boxes. Nothing is allocated at full
size, so a 671B model is described on a laptop.

What is not a copy (quantisation, computed values, replaced storage) is kept
per checkpoint tensor in ``not_copied`` so an update sending it is refused,
naming tensor and op. Tensors the loader's post-processing computes from
checkpoint tensors (DeepSeek MLA's ``w_kc``/``w_vc``) are listed in
``post_load``: SGLang's own post-load processing refreshes them after an update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.apply import refresh_derived
from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.derive.load_recorder import (
    Const,
    Entry,
    Leaf,
    LoadRecorder,
    Opaque,
)
from sglang.srt.weight_sync.derive.view_geometry import unit_dim
from sglang.srt.weight_sync.phase_timing import collector_paused
from sglang.srt.weight_sync.sglang_compat import (
    after_load,
    after_update,
    as_tp_rank,
    initialize_meta_model,
)
from sglang.srt.weight_sync.target_layout import (
    EngineParallel,
    ParamTarget,
    Piece,
)

__all__ = (
    "CheckpointLayout",
    "CheckpointSpec",
    "DerivedTargets",
    "PIECE_FIELDS",
    "PlacementGroup",
    "RankTargets",
    "as_engine_rank",
    "build_meta_model",
    "checkpoint_layout",
    "Derive",
    "derive_engine_rank",
    "derive_rank",
    "entries_to_target",
    # pr: scale
    "tensor_specs",
    # pr: scale end
)

# (name, shape, dtype) of every tensor of the checkpoint, as save_pretrained writes it.
CheckpointSpec = Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...]


@dataclass(frozen=True)
class CheckpointLayout:
    """The checkpoint's tensors (names, shapes, dtypes) and tied names a trainer may also send."""

    tensors: CheckpointSpec
    aliases: Mapping[str, str] = field(default_factory=dict)

    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {n: s for n, s, _ in self.tensors}


def checkpoint_layout(
    hf_config, dtype: Optional[torch.dtype] = None
) -> CheckpointLayout:
    """What ``save_pretrained`` would write for this config, without data: the HF model on
    meta, then transformers' own reverse weight conversion (per-expert tensors, ...); tied
    copies are dropped and become aliases, as on disk."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        model = (
            cls._from_config(hf_config)
            if cls is not None
            else (transformers.AutoModelForCausalLM.from_config(hf_config))
        )
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    state = revert_weight_conversion(model, model.state_dict())
    tensors = tuple(
        sorted(
            (n, tuple(t.shape), dtype or t.dtype)
            for n, t in state.items()
            if n not in tied
        )
    )
    names = {n for n, _, _ in tensors}
    return CheckpointLayout(tensors, {a: b for a, b in tied.items() if b in names})


class PlacementGroup:
    """A process group stand-in carrying placement only: what layer construction reads."""

    def __init__(self, rank_in_group: int, world_size: int):
        self.rank_in_group = rank_in_group
        self.world_size = world_size
        self.ranks = list(range(world_size))
        self.cpu_group = None
        self.device_group = None

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def __getattr__(self, name):
        raise AttributeError(
            f"PlacementGroup({self.rank_in_group}/{self.world_size}) has no {name!r}: "
            "building the model on meta needed a real process group"
        )


def as_engine_rank(rank: int):
    """Act as TP ``rank`` of the published engine layout, with SGLang's own rank formulas and
    placement-only groups (each release's way: ``sglang_compat.as_tp_rank``)."""
    return as_tp_rank(rank, PlacementGroup)


def build_meta_model(model_config, load_config=None) -> torch.nn.Module:
    """The model exactly as ``DefaultModelLoader`` builds it (architecture, quantisation,
    shared-expert fusion, default dtype), on the meta device."""
    from sglang.srt.configs.load_config import LoadConfig

    return initialize_meta_model(model_config, load_config or LoadConfig())


@dataclass(frozen=True)
class RankTargets:
    """One engine rank's derivation.

    ``targets``: every parameter (and buffer) the loader fills from the checkpoint.
    ``not_copied``: checkpoint tensor -> why an update cannot copy it (param, box, op).
    ``post_load``: derived tensor attribute -> the checkpoint tensors it is computed from.
    ``read``: checkpoint tensors this rank's loader read.
    """

    targets: Tuple[ParamTarget, ...]
    not_copied: Mapping[str, str]
    post_load: Mapping[str, Tuple[str, ...]]
    read: frozenset

    def to_builtins(self) -> dict:
        """Plain lists, dicts, strings and ints: what the disk cache holds and TP ranks exchange.

        Compact, because a large MoE model's rank has tens of thousands of pieces: boxes and index tuples (the
        same for every expert) are stored once and referenced by number, and a target's
        pieces are one flat list of ``PIECE_FIELDS`` entries each."""
        boxes: Dict[Box, int] = {}
        tuples: Dict[Tuple[int, ...], int] = {}
        targets = []
        for t in self.targets:
            flat = []
            for p in t.pieces:
                flat += [
                    p.tensor,
                    boxes.setdefault(p.box, len(boxes)),
                    tuples.setdefault(p.index, len(tuples)),
                    tuples.setdefault(p.offsets, len(tuples)),
                    -1 if p.perm is None else tuples.setdefault(p.perm, len(tuples)),
                ]
            targets.append(
                [
                    t.name,
                    list(t.shape),
                    str(t.dtype).removeprefix("torch."),
                    flat,
                    [boxes.setdefault(z, len(boxes)) for z in t.zeros],
                ]
            )
        return {
            "boxes": [[list(b.offsets), list(b.sizes)] for b in boxes],
            "tuples": [list(t) for t in tuples],
            "targets": targets,
            "not_copied": dict(self.not_copied),
            "post_load": {n: list(d) for n, d in self.post_load.items()},
            "read": sorted(self.read),
        }

    @classmethod
    def from_builtins(cls, d: dict) -> RankTargets:
        boxes = [Box(tuple(o), tuple(s)) for o, s in d["boxes"]]
        tuples = [tuple(t) for t in d["tuples"]]
        targets = []
        with collector_paused():
            for name, shape, dtype, flat, zeros in d["targets"]:
                pieces = tuple(
                    Piece(
                        flat[k],
                        boxes[flat[k + 1]],
                        tuples[flat[k + 2]],
                        tuples[flat[k + 3]],
                        None if flat[k + 4] < 0 else tuples[flat[k + 4]],
                    )
                    for k in range(0, len(flat), PIECE_FIELDS)
                )
                targets.append(
                    ParamTarget(
                        name,
                        tuple(shape),
                        getattr(torch, dtype),
                        pieces,
                        tuple(boxes[z] for z in zeros),
                    )
                )
        return cls(
            tuple(targets),
            dict(d["not_copied"]),
            {n: tuple(v) for n, v in d["post_load"].items()},
            frozenset(d["read"]),
        )


PIECE_FIELDS = 5  # tensor, box, index, offsets, perm (-1: identity)


def derive_rank(model: torch.nn.Module, checkpoint: CheckpointLayout) -> RankTargets:
    """Run ``model.load_weights`` and the loader's post-load processing on meta checkpoint
    tensors under the recorder and describe what every tensor of the model now holds; then
    run what follows an update (``apply.refresh_derived``, then ``sglang_compat.after_update``)
    to see which computed tensors SGLang refreshes in place."""
    with collector_paused():
        rec = LoadRecorder()
        rec.register_module_tensors(model)
        before = {n: rec.key(t) for n, t in _named_tensors(model)}
        leaves = []
        for name, shape, dtype in checkpoint.tensors:
            leaf = torch.empty(shape, dtype=dtype, device="meta")
            rec.add_leaf(name, leaf)
            leaves.append((name, leaf))
        with torch.no_grad(), rec:
            model.load_weights(iter(leaves))
            after_load(model)
            computed = _computed_tensors(model, rec)
            writes = {n: len(rec.prov(t).entries) for n, (t, _) in computed.items()}
            refresh_derived(model)
            after_update(model)
        refreshed = {
            n
            for n, (t, _) in computed.items()
            if _lookup(model, n) is t and len(rec.prov(t).entries) > writes[n]
        }
        return _describe(model, rec, before, computed, refreshed)


def _named_tensors(model: torch.nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _lookup(model: torch.nn.Module, name: str):
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name), attr, None)


def _computed_tensors(
    model, rec: LoadRecorder
) -> Dict[str, Tuple[torch.Tensor, frozenset]]:
    """Buffers and plain tensor attributes computed from checkpoint tensors while loading
    (Gemma's ``gemma_weight``, MLA's ``w_kc``/``w_vc``), with the tensors they read."""
    params = {rec.key(p) for p in model.parameters()}
    out = {}
    for mname, module in model.named_modules():
        candidates = list(module.named_buffers(recurse=False))
        candidates += [
            (a, v) for a, v in vars(module).items() if isinstance(v, torch.Tensor)
        ]
        for attr, val in candidates:
            if rec.key(val) in params:
                continue  # a view of a parameter follows it
            prov = rec.storages.get(rec.key(val))
            if prov is None or not any(
                isinstance(e.src, Opaque) or prov.kind == "derived"
                for e in prov.entries
            ):
                continue
            deps = rec.deps(val)
            if deps:
                out[f"{mname}.{attr}" if mname else attr] = (val, deps)
    return out


def _describe(
    model, rec: LoadRecorder, before: Mapping[str, int], computed, refreshed
) -> RankTargets:
    targets: List[ParamTarget] = []
    not_copied: Dict[str, str] = {}
    read = set()
    seen = {rec.key(t) for t, _ in computed.values()}
    for name, t in _named_tensors(model):
        key = rec.key(t)
        if key in seen:  # tied (the first name owns the storage) or computed
            continue
        seen.add(key)
        target, deps, reasons = entries_to_target(name, t, rec.describe(t))
        read |= deps
        if before.get(name) != key:
            reasons = {
                d: f"{name}: its storage is replaced while loading" for d in deps
            } | reasons
        for dep, why in reasons.items():
            not_copied.setdefault(dep, why)
        if target.pieces and not reasons:
            targets.append(target)
    post_load = {}
    for name, (t, deps) in computed.items():
        read |= deps
        if name in refreshed:
            post_load[name] = tuple(sorted(deps))
        else:
            for dep in deps:
                not_copied.setdefault(
                    dep,
                    f"{name} is computed from it while loading and SGLang's post-load "
                    "processing does not recompute it in place",
                )
    return RankTargets(tuple(targets), not_copied, post_load, frozenset(read))


def entries_to_target(name: str, t: torch.Tensor, entries: Sequence[Entry]):
    """(ParamTarget, checkpoint tensors read, {tensor: why it is not a copy}) for one tensor."""
    pieces: List[Piece] = []
    zeros: List[Box] = []
    deps, reasons = set(), {}
    for e in entries:
        box = e.box if t.dim() else Box((), ())
        if isinstance(e.src, Leaf):
            deps.add(e.src.name)
            src = (
                e.src
                if t.dim()
                else Leaf(e.src.name, e.src.l0, tuple(() for _ in e.src.L))
            )
            if not _leaf_pieces(box, src, pieces):
                reasons[e.src.name] = (
                    f"{name}{box}: reshaped from {e.src.name} (not a box of it)"
                )
        elif isinstance(e.src, Const):
            if e.src.value == 0.0:
                zeros.append(box)
        elif isinstance(e.src, Opaque):
            deps |= e.src.deps
            for dep in e.src.deps:
                reasons.setdefault(
                    dep, f"{name}{box} is computed from it by {e.src.op}"
                )
    return (
        ParamTarget(name, tuple(t.shape), t.dtype, tuple(pieces), tuple(zeros)),
        deps,
        reasons,
    )


def _leaf_pieces(box: Box, src: Leaf, out: List[Piece]) -> bool:
    """Append the pieces that write ``box`` of a parameter from ``src``; False when it is no
    (permuted) box of the leaf (a reshape across dims)."""
    how = _piece_shape(box.sizes, src.L)
    if how is None:
        return False
    if isinstance(
        how, int
    ):  # a strided or merged map, or an index dim with extent: one piece per index
        e = how
        ok = True
        for v in range(box.sizes[e]):
            o, s = list(box.offsets), list(box.sizes)
            o[e], s[e] = o[e] + v, 1
            l0 = tuple(a + row[e] * v for a, row in zip(src.l0, src.L))
            ok &= _leaf_pieces(Box(tuple(o), tuple(s)), Leaf(src.name, l0, src.L), out)
        return ok
    n_index, leaf_sizes, perm = how
    out.append(
        Piece(
            src.name,
            Box(src.l0, leaf_sizes),
            box.offsets[:n_index],
            box.offsets[n_index:],
            perm,
        )
    )
    return True


@lru_cache(maxsize=4096)
def _piece_shape(sizes: Tuple[int, ...], L: Tuple[Tuple[int, ...], ...]):
    """How a box of ``sizes`` written through the leaf map ``L`` becomes pieces, which depends
    on neither offset (cached: a rank's many entries come in a few dozen shapes):
    (index dims, the leaf box's sizes, perm or None) for one piece; the dim to enumerate, one
    piece per index, when a dim of extent > 1 is strided, merged or an index dim; None when
    the box has fewer dims than the leaf."""
    P, Q = len(sizes), len(L)
    leaf_dim: Dict[int, int] = {}
    for e in range(P):
        if sizes[e] <= 1:
            continue
        q = unit_dim(tuple(row[e] for row in L))
        if q is None or q in leaf_dim.values() or e < P - Q:
            return e
        leaf_dim[e] = q
    n_index = P - Q
    if n_index < 0:
        return None
    leaf_sizes = [1] * Q
    for e, q in leaf_dim.items():
        leaf_sizes[q] = sizes[e]
    free = iter(q for q in range(Q) if q not in leaf_dim.values())
    perm = tuple(
        leaf_dim[e] if e in leaf_dim else next(free) for e in range(n_index, P)
    )
    return n_index, tuple(leaf_sizes), None if perm == tuple(range(Q)) else perm


@dataclass(frozen=True)
class DerivedTargets:
    """Every rank's derived targets: stands in for ``ModelTargets`` (for_rank, by_rank,
    tensor_shapes, aliases, dtype_of), plus what an update must refuse or refresh."""

    parallel: EngineParallel
    per_rank: Tuple[Tuple[ParamTarget, ...], ...]
    shapes: Mapping[str, Tuple[int, ...]]
    aliases: Mapping[str, str] = field(default_factory=dict)
    not_copied: Mapping[str, str] = field(default_factory=dict)
    post_load: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    dtype_of: Mapping[str, torch.dtype] = field(default_factory=dict)

    def tensor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return dict(self.shapes)

    def for_rank(self, rank: int) -> List[ParamTarget]:
        if not self.dtype_of:
            return list(self.per_rank[rank])
        return [
            ParamTarget(
                t.name, t.shape, self.dtype_of.get(t.name, t.dtype), t.pieces, t.zeros
            )
            for t in self.per_rank[rank]
        ]

    def by_rank(self) -> Dict[int, List[ParamTarget]]:
        return {r: self.for_rank(r) for r in range(self.parallel.tp_size)}

    @classmethod
    def of_ranks(
        cls,
        parallel: EngineParallel,
        ranks: Sequence[RankTargets],
        shapes: Mapping[str, Tuple[int, ...]],
        aliases: Mapping[str, str],
    ) -> DerivedTargets:
        """Every rank's derivation, in rank order, as one engine's targets."""
        not_copied, post_load = {}, {}
        for r, derived in enumerate(ranks):
            for n, why in derived.not_copied.items():
                not_copied.setdefault(n, f"engine rank {r}: {why}")
            post_load.update(derived.post_load)
        return cls(
            parallel,
            tuple(d.targets for d in ranks),
            dict(shapes),
            dict(aliases),
            not_copied,
            post_load,
        )


# How a rank's targets are derived from a fresh meta model (``build()``) and the checkpoint.
Derive = Callable[[Callable[[], torch.nn.Module], CheckpointLayout], RankTargets]


def derive_engine_rank(
    model_config,
    checkpoint: CheckpointLayout,
    rank: int,
    load_config=None,
    derive: Optional[Derive] = None,
) -> RankTargets:
    """TP ``rank`` of the published engine layout: its model built on meta as that rank and
    loaded from ``checkpoint`` by SGLang's loaders, every layer of it unless ``derive`` says
    otherwise (``derive(build, checkpoint)``)."""
    build = partial(build_meta_model, model_config, load_config)
    with as_engine_rank(rank):
        if derive is None:
            return derive_rank(build(), checkpoint)
        return derive(build, checkpoint)


# pr: scale
def tensor_specs(
    model: torch.nn.Module,
) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every parameter and buffer of ``model``, as ``derive_rank`` sees them."""
    return [(n, tuple(t.shape), t.dtype) for n, t in _named_tensors(model)]


# pr: scale end
