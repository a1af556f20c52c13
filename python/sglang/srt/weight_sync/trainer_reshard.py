"""Trainer-side resharding in one hop, straight to the engine's own layout.

When the shards beside an engine do not cover what its ranks need (FSDP over
more GPUs than one engine has, training TP wider than one engine), the trainer
ranks plan once over the trainer's world with the engine's published targets
(``manifest.py``): trainer rank k needs exactly what the engine rank beside it
needs, in that rank's parameter shapes and dtypes. The executor moves only the
bytes each rank lacks, cast at the sender to the engine's dtype, into
parameter-shaped buffers; the trainer hands those to the engine rank beside it,
which only copies them into its parameters (no second round of communication).

Into a block-FP8 engine the blocks one trainer rank holds whole travel quantized
(``fp8_wire.cut_for_groups``, ``run_quantized``: e4m3 and float32 scales) between the
trainer ranks and on to the engine rank (``Fp8Region`` entries of the payload,
landed straight into its e4m3 weight and scales); the blocks left are staged here in
the weight's staged dtype and handed as regions of it, which the engine quantizes. No
parameter-shaped buffer of a block-FP8 weight is handed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import (
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)

import torch

from sglang.srt.weight_sync.executor import (
    DataGroup,
    Deferred,
    ExecutionStats,
    check_inputs,
    execute,
)
from sglang.srt.weight_sync.fp8_sender import SenderFp8Plan
from sglang.srt.weight_sync.fp8_wire import (
    QuantizedLanding,
    cut_for_groups,
    run_quantized,
)
from sglang.srt.weight_sync.manifest import EngineManifest, targets_by_trainer_rank
from sglang.srt.weight_sync.phase_timing import Count, Phase, PhaseClock
from sglang.srt.weight_sync.planner import (
    Plan,
    resolve_aliases,
    sources_digest,
)
from sglang.srt.weight_sync.protocol import Fp8Region, Fp8RegionKind
from sglang.srt.weight_sync.rank_plan import Receivers, plan_for_rank

# pr: remote
from sglang.srt.weight_sync.reshard_delta import ReshardDelta

# pr: remote end
from sglang.srt.weight_sync.source_layout import (
    SourceLayout,
)
from sglang.srt.weight_sync.target_layout import (
    ParamTarget,
    restrict,
    restrict_to_names,
)

__all__ = (
    "REGION_KEY",
    "TrainerPlans",
    "TrainerSideResult",
    "chunk_digest",
    "chunks",
    "fp8_regions",
)


def chunks(
    manifest: EngineManifest, names: Iterable[str], bucket_bytes: int
) -> List[Tuple[str, ...]]:
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


# the payload key of the i-th block-FP8 region handed (``Fp8Region.key``)
REGION_KEY = "fp8-region/{}"


@dataclass
class TrainerSideResult:
    """This trainer rank's parameter-shaped buffers for the engine rank beside it, and its
    block-FP8 weights' regions (``fp8_regions``: each with the tensor that carries it; the
    blocks that came quantized, then the rest in the staged dtype); ``sender``: the plan's
    cut for sender quantization (None: no block-FP8 weight)."""

    buffers: Dict[str, torch.Tensor]
    stats: ExecutionStats
    plan: Plan
    sender: Optional[SenderFp8Plan] = None
    fp8_regions: List[Tuple[Fp8Region, torch.Tensor]] = field(default_factory=list)

    def lower_bound_bytes(self, rank: int) -> int:
        if self.sender is not None:
            return self.sender.lower_bound_bytes(rank)
        return self.plan.lower_bound_bytes(rank)

    def handed_bytes(self) -> int:
        """Bytes handed to the engine rank: the buffers and the block-FP8 regions."""
        return sum(b.nbytes for b in self.buffers.values()) + sum(
            t.nbytes for _, t in self.fp8_regions
        )


def fp8_regions(
    landings: Sequence[QuantizedLanding],
    staged: Sequence[ParamTarget],
    buffers: Mapping[str, torch.Tensor],
    blocks: Mapping[str, Tuple[int, int]],
) -> List[Tuple[Fp8Region, torch.Tensor]]:
    """What the engine rank gets of its block-FP8 weights: each landing's region of a
    weight (e4m3 then scales, as received), then each piece of ``staged`` (the blocks left
    to quantize, filled in ``buffers``) copied out in the staged dtype, region-shaped."""
    out: List[Tuple[Fp8Region, torch.Tensor]] = []
    for x in landings:
        move = x.quantized.move
        for d in move.dests:
            if d.rank == x.rank:
                box = d.box(move.region)
                region = Fp8Region(
                    REGION_KEY.format(len(out)),
                    Fp8RegionKind.QUANTIZED,
                    d.param,
                    d.index,
                    box.offsets,
                    box.sizes,
                    x.quantized.block,
                )
                out.append((region, x.buf))
    for t in staged:
        for p in t.pieces:
            box = p.dest_box()
            region = Fp8Region(
                REGION_KEY.format(len(out)),
                Fp8RegionKind.STAGED,
                t.name,
                p.index,
                box.offsets,
                box.sizes,
                blocks[t.name],
            )
            out.append((region, buffers[t.name][p.index][box.slices()].contiguous()))
    return out


class _Kept(Deferred):
    """Keeps the quantized regions a rank receives, for its engine rank to land."""

    def __init__(self) -> None:
        self.landings: List[QuantizedLanding] = []

    def landed(self, landings) -> None:
        self.landings += landings


class TrainerPlans:
    """A trainer's plans to its engines' layouts, with what they are computed from;
    owned by the trainer's flow (``trainer_flow.TrainerSync``), one per process.

    Plans are kept by (inputs, chunk, rank), at most ``capacity`` (one per chunk of a
    streamed update); the sources' digest and their targets by engine rank are kept for
    the running update's sources, which every chunk plans from.
    """

    def __init__(self, capacity: int = 512) -> None:
        self.capacity = capacity
        # each plan and its cut for sender quantization (None: no block-FP8 weight)
        self._plans: Dict[str, Tuple[Plan, Optional[SenderFp8Plan]]] = {}
        self._digest: Optional[Tuple[SourceLayout, str]] = None
        self._targets: Optional[tuple] = None
        self.misses = 0  # plans made (not found in the cache) so far

    def __len__(self) -> int:
        return len(self._plans)

    def plan_to_engines(
        self,
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
        plan, _ = self._entry(
            sources, manifest, engine_groups, bucket_bytes, params, rank
        )
        return plan, self._own_targets(sources, manifest, engine_groups, params, rank)

    def _entry(
        self,
        sources: SourceLayout,
        manifest: EngineManifest,
        engine_groups: Sequence[Sequence[int]],
        bucket_bytes: int,
        params: Tuple[str, ...],
        rank: int,
    ) -> Tuple[Plan, Optional[SenderFp8Plan]]:
        """``rank``'s plan of chunk ``params`` and its cut for sender quantization
        (``fp8_wire.cut_for_groups``; None when the engine has no block-FP8 weight), made
        once and cached together."""
        digest, key = self._key(
            sources, manifest, engine_groups, bucket_bytes, params, rank
        )
        found = self._plans.get(key)
        if found is None:
            self.misses += 1
            resolved = self._class_targets(sources, manifest)[0]
            receivers = self.chunk_receivers(sources, manifest, engine_groups, params)
            plan = plan_for_rank(
                resolved,
                receivers,
                rank,
                bucket_bytes=bucket_bytes,
                fingerprint=chunk_digest(digest, params),
            )
            if len(self._plans) >= self.capacity:
                self._plans.pop(next(iter(self._plans)))
            found = self._plans[key] = (
                plan,
                cut_for_groups(
                    plan,
                    manifest,
                    engine_groups,
                    {n: s.shape for n, s in resolved.items()},
                ),
            )
        return found

    def _own_targets(
        self,
        sources: SourceLayout,
        manifest: EngineManifest,
        engine_groups: Sequence[Sequence[int]],
        params: Tuple[str, ...],
        rank: int,
    ) -> List[ParamTarget]:
        """The targets among ``params`` of the engine rank beside trainer ``rank``."""
        mine = next(
            (i for g in engine_groups for i, r in enumerate(g) if r == rank), None
        )
        by_name = (
            {} if mine is None else self._class_targets(sources, manifest)[1][mine]
        )
        return [by_name[n] for n in params if n in by_name]

    def _key(
        self,
        sources: SourceLayout,
        manifest: EngineManifest,
        engine_groups: Sequence[Sequence[int]],
        bucket_bytes: int,
        params: Tuple[str, ...],
        rank: int,
    ) -> Tuple[str, str]:
        """The update's inputs digest, and the key of ``rank``'s plan of chunk ``params``."""
        digest = self.inputs_digest(sources, manifest, engine_groups, bucket_bytes)
        return digest, hashlib.sha256(repr((digest, params, rank)).encode()).hexdigest()

    def chunk_receivers(
        self,
        sources: SourceLayout,
        manifest: EngineManifest,
        engine_groups: Sequence[Sequence[int]],
        params: Sequence[str],
    ) -> Receivers:
        """Trainer ranks by the engine rank beside them, each class needing that engine rank's
        targets among ``params`` (filled from the HF tensors in ``sources``)."""
        tp = manifest.parallel.tp_size
        if any(len(g) != tp for g in engine_groups):
            targets_by_trainer_rank(
                manifest, engine_groups
            )  # raises, naming the group size and the engine's TP
        by_name = self._class_targets(sources, manifest)[1]
        classes = tuple(tuple(d[n] for n in params if n in d) for d in by_name)
        ranks = tuple(
            tuple(sorted(g[i] for g in engine_groups)) for i in range(len(by_name))
        )
        return Receivers(classes, ranks)

    def inputs_digest(
        self,
        sources: SourceLayout,
        manifest: EngineManifest,
        engine_groups: Sequence[Sequence[int]],
        bucket_bytes: int,
    ) -> str:
        """Everything an update's plans depend on, the same on every trainer rank that agrees
        on the layouts (``sources_digest`` is kept for the sources of the running update)."""
        if self._digest is None or self._digest[0] is not sources:
            self._digest = (sources, sources_digest(sources))
        return hashlib.sha256(
            repr(
                (
                    self._digest[1],
                    manifest.fingerprint,
                    [tuple(g) for g in engine_groups],
                    bucket_bytes,
                )
            ).encode()
        ).hexdigest()

    def _class_targets(self, sources: SourceLayout, manifest: EngineManifest):
        """``sources`` under the names targets use (aliases resolved), and per engine rank its
        targets by name restricted to those tensors; kept for the running update, as every
        chunk picks from them."""
        if (
            self._targets is None
            or self._targets[0] is not sources
            or self._targets[1] is not manifest
        ):
            names = {manifest.aliases.get(n, n) for n in sources}
            by_name = tuple(
                {t.name: t for t in restrict_to_names(names, ts)}
                for ts in manifest.ranks
            )
            self._targets = (
                sources,
                manifest,
                (resolve_aliases(sources, manifest.aliases), by_name),
            )
        return self._targets[2]

    def shard_problems(
        self,
        sources: SourceLayout,
        local: Mapping[str, torch.Tensor],
        manifest: EngineManifest,
        engine_groups: Sequence[Sequence[int]],
        bucket_bytes: int,
        parts: Sequence[Sequence[str]],
        rank: int,
        device: Optional[torch.device] = None,
    ) -> List[str]:
        """This rank's problems with its ``local`` tensors against its plan of every chunk in
        ``parts`` (``executor.check_inputs``; a plan that cannot be made is one too), named
        by trainer rank: run before the trainer ranks agree to the update, so that a wrong
        shard on one rank refuses it on every rank. The plans stay cached for the rounds."""
        problems: List[str] = []
        try:
            for part in parts:
                plan, _ = self.plan_to_engines(
                    sources, manifest, engine_groups, bucket_bytes, part, rank
                )
                problems += check_inputs(plan, rank, local, None, device)
        except (ValueError, KeyError) as e:  # CoverageError, LayoutError: no plan
            problems.append(f"{type(e).__name__}: {e}")
        return [f"trainer rank {rank}: {p}" for p in sorted(set(problems))]

    def reshard_to_engines(
        self,
        sources: SourceLayout,
        local: Mapping[str, torch.Tensor],
        manifest: EngineManifest,
        engine_groups: Sequence[Sequence[int]],
        rank: int,
        bucket_bytes: int,
        params: Iterable[str],
        timeout_s: Optional[float] = None,
        data: Optional[DataGroup] = None,
        clock: Optional[PhaseClock] = None,
        alloc: Optional[
            Callable[[Sequence[ParamTarget]], Optional[Dict[str, torch.Tensor]]]
        ] = None,
        checked: bool = False,
        # pr: remote
        delta: Optional[ReshardDelta] = None,
        # pr: remote end
    ) -> TrainerSideResult:
        """Plan (``plan_to_engines``) and run one chunk: this rank's buffers, filled from
        ``local`` (this rank's tensors by holder key), on the data group's device. Every
        trainer rank calls this with the same names and chunk; each round waits at most
        ``timeout_s`` for its peers. ``data``: the owner's data plane over the default group
        (None: one for this chunk). ``clock``: the update's phases, which this adds to.
        ``alloc``: where the buffers go (the sender's shared memory, so that the executor
        writes straight into what the engine reads), when it has room for them; not used
        into a block-FP8 engine (its regions, made after the rounds, go with the buffers).
        Into one, the plan is cut for sender quantization (cached with it) and the
        result carries the block-FP8 weights' regions (``fp8_regions``). ``checked``: every rank's ``shard_problems`` were agreed on (none), so the executor
        does not check the shards again."""
        # pr: remote
        # ``delta``: this rank's bases (``reshard_delta``): only what changed since the last
        # update crosses between the trainer ranks, the buffers filled as a full update's
        # pr: remote end
        clock = clock if clock is not None else PhaseClock()
        params = tuple(params)
        with clock.phase(Phase.PLAN):
            misses = self.misses
            plan, sender = self._entry(
                sources, manifest, engine_groups, bucket_bytes, params, rank
            )
            targets = self._own_targets(sources, manifest, engine_groups, params, rank)
            clock.count(Count.PLAN_COLD, self.misses - misses)
        data = data if data is not None else DataGroup(None)
        staged: List[ParamTarget] = []
        if (
            sender is not None
        ):  # a block-FP8 weight's blocks left to quantize, staged here
            fp8 = [t for t in targets if t.name in manifest.block_fp8]
            staged = sender.engine_targets(fp8, rank)
            targets = [t for t in targets if t.name not in manifest.block_fp8]
        with clock.phase(Phase.EXECUTE):
            # the regions are not in the sender's shared memory: ``ShardSender.send`` copies
            # the whole payload into it (a buffer in it would be remapped under the copy)
            shared = alloc is not None and sender is None
            buffers = alloc(targets) if shared else None
            if buffers is None:
                buffers = {
                    t.name: torch.empty(t.shape, dtype=t.dtype, device=data.device)
                    for t in targets
                }
            staging = {
                t.name: torch.empty(t.shape, dtype=t.dtype, device=data.device)
                for t in staged
            }
            run = plan if sender is None else sender.plan
            landings: List[QuantizedLanding] = []
            stats = None
            # pr: remote
            if delta is not None:
                stats, landings = delta.run(
                    plan,
                    sender,
                    rank,
                    local,
                    {**buffers, **staging},
                    data,
                    timeout_s,
                    checked,
                )
            # pr: remote end
            if stats is None:
                stats = execute(
                    run,
                    rank,
                    local,
                    {**buffers, **staging},
                    data,
                    timeout_s,
                    checked=checked,
                )
                if sender is not None:
                    kept = _Kept()
                    run_quantized(sender, rank, local, {}, data, timeout_s, kept, stats)
                    landings = kept.landings
            regions: List[Tuple[Fp8Region, torch.Tensor]] = []
            if sender is not None:
                regions = fp8_regions(landings, staged, staging, manifest.block_fp8)
            clock.add(Phase.APPLY, stats.copy_seconds)
        clock.count_execution(stats)
        return TrainerSideResult(buffers, stats, plan, sender, regions)


def chunk_digest(digest: str, params: Tuple[str, ...]) -> str:
    """The fingerprint of one chunk's plan: the update's ``inputs_digest`` and the chunk's names."""
    return hashlib.sha256(repr((digest, tuple(params))).encode()).hexdigest()
