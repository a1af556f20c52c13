"""Trainer-side resharding in one hop, straight to the engine's own layout.

When the shards beside an engine do not cover what its ranks need (FSDP over
more GPUs than one engine has, training TP wider than one engine), the trainer
ranks plan once over the trainer's world with the engine's published targets
(``manifest.py``): trainer rank k needs exactly what the engine rank beside it
needs, in that rank's parameter shapes and dtypes. The executor moves only the
bytes each rank lacks, cast at the sender to the engine's dtype, into
parameter-shaped buffers; the trainer hands those to the engine rank beside it,
which only copies them into its parameters (no second round of communication).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.executor import ExecutionStats, execute
from sglang.srt.weight_sync.manifest import EngineManifest, targets_by_trainer_rank
from sglang.srt.weight_sync.planner import Plan, forget_indexes, holder_boxes, resolve_aliases, sources_digest
from sglang.srt.weight_sync.rank_plan import Receivers, plan_for_rank
from sglang.srt.weight_sync.source_layout import SourceLayout, SourceTensor
from sglang.srt.weight_sync.target_layout import ParamTarget

_PLAN_CAPACITY = 512  # one plan per chunk of a streamed update
_plans: Dict[str, Plan] = {}
_digest_memo: Optional[Tuple[SourceLayout, str]] = None
_targets_memo: Optional[tuple] = None


def uncovered(source: SourceTensor, ranks: Optional[Set[int]] = None) -> Optional[Box]:
    """A region of the tensor that none of its holders (among ``ranks``, default all)
    has, or None when they cover it."""
    remaining = [Box.full(source.shape)]
    for box, holding in holder_boxes(source):
        if ranks is None or not ranks.isdisjoint(holding):
            remaining = [piece for rem in remaining for piece in rem.subtract(box)]
    return remaining[0] if remaining else None


def first_uncovered(sources: SourceLayout, engine_groups: Sequence[Sequence[int]]) -> Optional[str]:
    """The first tensor that the trainer ranks beside some engine do not hold in full
    (then the engine alone cannot reshard it); None when every engine is covered."""
    groups = [set(g) for g in engine_groups]
    for name in sorted(sources):
        if any(uncovered(sources[name], g) for g in groups):
            return name
    return None


def restrict(wanted: Iterable[ParamTarget], delivered: Iterable[str], aliases: Mapping[str, str]) -> List[ParamTarget]:
    """Only the pieces filled from the HF tensors of this update (a trainer may send its
    weights in batches); a parameter with none of them is left out. Zero fills stay
    with a parameter that is written."""
    return _restrict({aliases.get(n, n) for n in delivered}, wanted)


def _restrict(names: Set[str], wanted: Iterable[ParamTarget]) -> List[ParamTarget]:
    out = []
    for t in wanted:
        pieces = tuple(p for p in t.pieces if p.tensor in names)
        if pieces:
            out.append(dataclasses.replace(t, pieces=pieces))
    return out


def chunks(manifest: EngineManifest, names: Iterable[str], bucket_bytes: int) -> List[Tuple[str, ...]]:
    """Parameters in manifest order, cut so that no engine rank's buffers for one chunk
    exceed ``bucket_bytes``: a model larger than the cap streams through the engine one
    chunk at a time (a parameter larger than the cap is a chunk of its own). The same
    on every trainer rank: it depends on the manifest and the names only."""
    names = list(names)
    size: Dict[str, int] = {}
    for rank_targets in manifest.ranks:
        for t in restrict(rank_targets, names, manifest.aliases):
            size[t.name] = max(size.get(t.name, 0), _nbytes(t))
    out: List[List[str]] = []
    used = 0
    for name, nbytes in size.items():
        if not out or used + nbytes > bucket_bytes:
            out.append([])
            used = 0
        out[-1].append(name)
        used += nbytes
    return [tuple(c) for c in out]


def _nbytes(t: ParamTarget) -> int:
    n = t.dtype.itemsize
    for s in t.shape:
        n *= s
    return n


@dataclass
class TrainerSideResult:
    """This trainer rank's parameter-shaped buffers for the engine rank beside it."""

    buffers: Dict[str, torch.Tensor]
    stats: ExecutionStats
    plan: Plan

    def lower_bound_bytes(self, rank: int) -> int:
        return self.plan.lower_bound_bytes(rank)


def check_sources(sources: SourceLayout, manifest: EngineManifest) -> None:
    """Raises ``ValueError`` naming a tensor the engine does not have, or of another shape."""
    expected = manifest.tensor_shapes
    for name, src in sources.items():
        canonical = manifest.aliases.get(name, name)
        if canonical not in expected:
            raise ValueError(f"unknown tensor {name!r}: the engine's manifest has no such weight")
        if tuple(src.shape) != tuple(expected[canonical]):
            raise ValueError(f"tensor {name!r}: global shape {tuple(src.shape)}, "
                             f"the engine expects {tuple(expected[canonical])}")


def plan_to_engines(
    sources: SourceLayout,
    manifest: EngineManifest,
    engine_groups: Sequence[Sequence[int]],
    bucket_bytes: int,
    params: Iterable[str],
    rank: int,
) -> Tuple[Plan, List[ParamTarget]]:
    """``rank``'s part of the plan over the trainer's (default) group to every engine
    rank's targets among ``params`` (one chunk), and ``rank``'s own targets; cached.

    ``sources`` (any layout: DTensor meshes, Megatron-core holders) are in global
    trainer ranks; rank k's targets are those of the engine rank beside it. Each rank
    plans only the moves it sends or receives (``rank_plan``); every rank's part fits
    the others' (same moves, same rounds), and ``Plan.fingerprint`` is a digest of the
    inputs that every rank can compare.
    """
    params = tuple(params)
    digest = inputs_digest(sources, manifest, engine_groups, bucket_bytes)
    key = hashlib.sha256(repr((digest, params, rank)).encode()).hexdigest()
    plan = _plans.get(key)
    if plan is None:
        receivers = chunk_receivers(sources, manifest, engine_groups, params)
        plan = plan_for_rank(_class_targets(sources, manifest)[0], receivers, rank, bucket_bytes=bucket_bytes,
                             fingerprint=chunk_digest(digest, params))
        if len(_plans) >= _PLAN_CAPACITY:
            _plans.pop(next(iter(_plans)))
        _plans[key] = plan
    mine = next((i for g in engine_groups for i, r in enumerate(g) if r == rank), None)
    by_name = {} if mine is None else _class_targets(sources, manifest)[1][mine]
    return plan, [by_name[n] for n in params if n in by_name]


def forget_plans() -> None:
    """Drop cached plans, digests and holder indexes (a cold start, for timing)."""
    global _digest_memo, _targets_memo
    _plans.clear()
    forget_indexes()
    _digest_memo = _targets_memo = None


def chunk_receivers(sources: SourceLayout, manifest: EngineManifest, engine_groups: Sequence[Sequence[int]],
                    params: Sequence[str]) -> Receivers:
    """Trainer ranks by the engine rank beside them, each class needing that engine rank's
    targets among ``params`` (filled from the HF tensors in ``sources``)."""
    tp = manifest.parallel.tp_size
    if any(len(g) != tp for g in engine_groups):
        targets_by_trainer_rank(manifest, engine_groups)  # raises, naming the group size and the engine's TP
    by_name = _class_targets(sources, manifest)[1]
    classes = tuple(tuple(d[n] for n in params if n in d) for d in by_name)
    ranks = tuple(tuple(sorted(g[i] for g in engine_groups)) for i in range(len(by_name)))
    return Receivers(classes, ranks)


def inputs_digest(sources: SourceLayout, manifest: EngineManifest, engine_groups: Sequence[Sequence[int]],
                  bucket_bytes: int) -> str:
    """Everything an update's plans depend on, the same on every trainer rank that agrees
    on the layouts (``sources_digest`` is remembered for the sources of the running update)."""
    global _digest_memo
    if _digest_memo is None or _digest_memo[0] is not sources:
        _digest_memo = (sources, sources_digest(sources))
    return hashlib.sha256(repr((_digest_memo[1], manifest.fingerprint, [tuple(g) for g in engine_groups],
                                bucket_bytes)).encode()).hexdigest()


def chunk_digest(digest: str, params: Tuple[str, ...]) -> str:
    """The fingerprint of one chunk's plan: the update's ``inputs_digest`` and the chunk's names."""
    return hashlib.sha256(repr((digest, tuple(params))).encode()).hexdigest()


def _class_targets(sources: SourceLayout, manifest: EngineManifest):
    """``sources`` under the names targets use (aliases resolved), and per engine rank its
    targets by name restricted to those tensors; remembered for the running update, as
    every chunk picks from them."""
    global _targets_memo
    if _targets_memo is None or _targets_memo[0] is not sources or _targets_memo[1] is not manifest:
        names = {manifest.aliases.get(n, n) for n in sources}
        by_name = tuple({t.name: t for t in _restrict(names, ts)} for ts in manifest.ranks)
        _targets_memo = (sources, manifest, (resolve_aliases(sources, manifest.aliases), by_name))
    return _targets_memo[2]


def reshard_to_engines(
    sources: SourceLayout,
    local: Mapping[str, torch.Tensor],
    manifest: EngineManifest,
    engine_groups: Sequence[Sequence[int]],
    rank: int,
    bucket_bytes: int,
    params: Iterable[str],
    timeout_s: Optional[float] = None,
) -> TrainerSideResult:
    """Plan (``plan_to_engines``) and run one chunk: this rank's buffers, filled from
    ``local`` (this rank's tensors by holder key). Every trainer rank calls this with
    the same names and chunk; each round waits at most ``timeout_s`` for its peers."""
    plan, targets = plan_to_engines(sources, manifest, engine_groups, bucket_bytes, params, rank)
    device = next(iter(local.values())).device if local else torch.device("cpu")
    buffers = {t.name: torch.empty(t.shape, dtype=t.dtype, device=device) for t in targets}
    stats = execute(plan, rank, local, buffers, timeout_s=timeout_s)
    return TrainerSideResult(buffers, stats, plan)


def check_buffers(
    params: Mapping[str, torch.Tensor], targets: Sequence[ParamTarget], buffers: Mapping[str, torch.Tensor], rank: int
) -> List[str]:
    """Problems with delivered buffers against this engine rank's parameters (empty when fine)."""
    problems = []
    for t in targets:
        buf, param = buffers.get(t.name), params.get(t.name)
        if buf is None:
            problems.append(f"engine rank {rank}: no buffer for parameter {t.name!r} from the trainer side")
        elif param is None:
            problems.append(f"engine rank {rank}: no parameter {t.name!r}")
        elif tuple(buf.shape) != tuple(param.shape) or buf.dtype != param.dtype:
            problems.append(
                f"engine rank {rank}: parameter {t.name!r} buffer is {tuple(buf.shape)} {buf.dtype}, "
                f"the parameter is {tuple(param.shape)} {param.dtype}"
            )
    return problems


def _filled_regions(target: ParamTarget) -> List[Tuple[Tuple[int, ...], Box]]:
    """Where a buffer holds delivered data: its pieces of this chunk. A parameter whose HF
    tensors arrive in several chunks (a fused ``gate_up_proj`` split by the trainer's
    batches) has a buffer of its full shape, the rest of it never written."""
    return [(p.index, p.dest_box()) for p in target.pieces]


def nonfinite_buffers(targets: Sequence[ParamTarget], buffers: Mapping[str, torch.Tensor]) -> List[str]:
    """Parameters whose delivered regions hold NaN or inf (only those regions are read)."""
    bad = []
    for t in targets:
        buf = buffers[t.name]
        if buf.is_floating_point() and not all(
                bool(torch.isfinite(buf[index][box.slices()]).all()) for index, box in _filled_regions(t)):
            bad.append(t.name)
    return bad


def copy_buffers(
    params: Mapping[str, torch.Tensor], targets: Sequence[ParamTarget], buffers: Mapping[str, torch.Tensor]
) -> int:
    """Copy the delivered regions into the parameters in place; returns bytes copied.

    A parameter the update fills whole is copied in one ``copy_``; otherwise only
    its delivered pieces (and zero fills) are.
    """
    copied = 0
    for t in targets:
        param, buf = params[t.name], buffers[t.name]
        regions = _filled_regions(t) + [((), z) for z in t.zeros]
        if sum(box.numel for _, box in regions) == param.numel():
            param.copy_(buf)
            copied += param.numel() * param.element_size()
            continue
        for index, box in regions:
            view = param[index][box.slices()]
            view.copy_(buf[index][box.slices()])
            copied += view.numel() * view.element_size()
    if any(p.is_cuda for p in params.values()):
        torch.cuda.current_stream().synchronize()  # the trainer may reuse its buffers once we reply
    return copied
