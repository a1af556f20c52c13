"""A weight-sync group spanning the trainer's ranks and remote engines: one rank's view of it.

Both ends use what is here. A ``SyncGroup`` is this process's membership of one epoch of
the group (``remote.protocol.Membership``): a data group (the epoch's backend: NCCL on
GPUs, gloo on CPUs, a ``DataGroup`` warmed up once) and a gloo control group over the
same ranks (``ControlGroup``), both made in the trainer's TCP store under the epoch's
prefix after every rank arrived (``remote.rendezvous.meet``: bounded, names who did not).
``close()`` releases both; a new epoch (an engine restarted, left, or died) is a new
``SyncGroup`` on every member.

When an epoch forms, every engine's first TP rank publishes its layout (its
``EngineManifest``) to every member through the group (``exchange_layouts``: one small
all-gather of fingerprints, then one broadcast per distinct layout). An update then runs
the same steps on every rank (``run_update``), each bounded by the update's timeout:

1. the trainer's first rank broadcasts the ``UpdateHeader`` (update id, the digest and
   size of its source layout, the bucket);
2. members that do not know that source layout (engines, on the first update or after
   the trainer's layout changed) say so in one all-reduce, and then hear it (one
   broadcast of the specs, ``remote.protocol.layout_wire``);
3. every rank plans only its own moves (``rank_plan.plan_for_rank``: trainer ranks what
   they send, engine ranks what they receive), from the same inputs;
4. every rank's problems are shared (one all-reduce): any problem refuses the update on
   every rank before a byte moves;
5. the ranks agree on the plan's inputs (one all-reduce);
6. the executor moves the data: trainer ranks send their own regions, cast to the
   engine's dtype, straight to the engine ranks that need them; engine ranks receive
   into staging (``executor.Deferred``) that the engine writes later, in a short pause.
   Where an engine's manifest names block-FP8 weights (``EngineManifest.block_fp8``),
   every rank cuts the same plan (``fp8_wire.cut_for_engines``): the blocks a trainer
   rank holds whole travel quantized, e4m3 and scales (``fp8_wire.run_quantized``, after
   the rest of the plan ran), and the engine quantizes only the rest. A delta update is
   cut the same way (``delta_rounds``: the quantized blocks' delta is taken after
   quantization; the pieces the engine quantizes against the bf16 staging it keeps for
   them, ``delta_rounds.KeptStaging``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.control_plane import (
    ControlGroup,
    GroupRefusal,
    PeerLost,
    check_group_timeout,
    join_group,
    leave_group,
)
from sglang.srt.weight_sync.delta_rounds import (
    DeltaFigures,
    KeptStaging,
    Snapshot,
    engine_quantized,
    execute_delta,
    stage_full,
)
from sglang.srt.weight_sync.executor import (
    DataGroup,
    Deferred,
    ExecutionStats,
    check_inputs,
    execute,
)
from sglang.srt.weight_sync.fp8_sender import SenderFp8Plan
from sglang.srt.weight_sync.fp8_wire import cut_for_engines, run_quantized
from sglang.srt.weight_sync.manifest import (
    EngineManifest,
    ManifestError,
    fingerprint_int,
)
from sglang.srt.weight_sync.phase_timing import Phase, PhaseClock
from sglang.srt.weight_sync.planner import CoverageError, Plan, sources_digest
from sglang.srt.weight_sync.protocol import DATA_GROUP_TIMEOUT_S
from sglang.srt.weight_sync.rank_plan import Receivers, plan_for_rank
from sglang.srt.weight_sync.remote.protocol import (
    HEADER_LIMIT,
    MEMBERSHIP_LIMIT,
    Membership,
    Spec,
    UpdateHeader,
    epoch_prefix,
    layout_wire,
    read_layout,
)
from sglang.srt.weight_sync.remote.rendezvous import (
    forget_before,
    meet,
    prefixed_store,
)
from sglang.srt.weight_sync.source_layout import (
    LayoutError,
    SourceLayout,
    describe_specs,
)
from sglang.srt.weight_sync.target_layout import restrict

__all__ = (
    "GroupRefusal",
    "LayoutError",
    "SyncGroup",
    "TrainerPart",
    "UpdateResult",
    "check_specs_against",
    "source_layout",
)

logger = logging.getLogger(__name__)

PLANS_KEPT = 4
LAYOUTS_KEPT = 2


@dataclass
class TrainerPart:
    """What a trainer rank brings to an update: its source layout (every HF tensor's spec,
    the same on every trainer rank) and its local tensors by holder key. The first
    trainer rank also brings the header."""

    specs: Mapping[str, Spec]
    local: Mapping[str, torch.Tensor]
    header: Optional[UpdateHeader] = None
    wire: bytes = b""
    # the layout ``specs`` describe, when the trainer keeps it (else described here)
    sources: Optional[SourceLayout] = None


@dataclass
class UpdateResult:
    """One rank's part of an update, once the data moved: the plan (zero fills, lower
    bound) and the executor's figures."""

    header: UpdateHeader
    plan: Plan
    stats: ExecutionStats
    # a delta update's figures (``delta_rounds``), and why it was full ("" when not)
    delta: Optional[DeltaFigures] = None
    why_full: str = ""
    # the blocks sent quantized (``plan`` is then what is left of the plan)
    fp8: Optional[SenderFp8Plan] = None
    # (group rank, weight) of the block-FP8 weights engines quantize pieces of from their
    # staging (``delta_rounds.engine_quantized``)
    staged: FrozenSet[Tuple[int, str]] = frozenset()

    def lower_bound_bytes(self, rank: int) -> int:
        """The least ``rank`` receives: the plan's, less what quantized blocks save."""
        if self.fp8 is not None:
            return self.fp8.lower_bound_bytes(rank)
        return self.plan.lower_bound_bytes(rank)


def source_layout(specs: Mapping[str, Spec]) -> SourceLayout:
    """The layout the specs describe (trainer ranks are the group's first ranks)."""
    return describe_specs(specs.items())


def check_specs_against(
    specs: Mapping[str, Spec],
    tensor_shapes: Mapping[str, Tuple[int, ...]],
    aliases: Mapping[str, str],
    not_copied: Mapping[str, str],
    who: str,
) -> List[str]:
    """An engine rank's problems with the trainer's source layout: a name the model does
    not have, a global shape it does not expect, a dtype it cannot cast, a tensor its
    loader does not copy (quantised or computed: no update can write it)."""
    problems = []
    for name in sorted(specs):
        spec, canonical = specs[name], aliases.get(name, name)
        if canonical not in tensor_shapes:
            problems.append(
                f"{who}: unknown tensor {name!r}: not a weight of this model"
            )
        elif canonical in not_copied:
            problems.append(
                f"{who}: tensor {name!r} is not a copy in SGLang's loader: {not_copied[canonical]}"
            )
        elif tuple(spec.shape) != tuple(tensor_shapes[canonical]):
            problems.append(
                f"{who}: tensor {name!r}: global shape {tuple(spec.shape)}, the model expects "
                f"{tuple(tensor_shapes[canonical])}"
            )
        elif not spec.dtype.is_floating_point:
            problems.append(
                f"{who}: tensor {name!r}: dtype {spec.dtype} cannot be cast to the model's "
                "floating dtype"
            )
    return problems


@dataclass
class _Layouts:
    """Source layouts heard from the trainer, by digest (the last few), with their plans."""

    specs: Dict[str, Tuple[Mapping[str, Spec], SourceLayout]] = field(
        default_factory=dict
    )
    plans: Dict[str, Tuple[Plan, Optional[SenderFp8Plan]]] = field(default_factory=dict)

    def keep(self, table: dict, key: str, value, most: int) -> None:
        if len(table) >= most:
            table.pop(next(iter(table)))
        table[key] = value


class SyncGroup:
    """This process's membership of one epoch of a weight-sync group (see the module's text).

    ``rank`` is this process's group rank; ``store`` the group's TCP store (the trainer's
    first rank hosts it). Making one blocks until every one of the ``world_size`` ranks of
    the epoch arrived and made the epoch's two groups with it, at most ``timeout_s`` in all
    (an engine joins in its scheduler loop: serving waits meanwhile); then every member
    hears the membership from the trainer's first rank (``hear_membership``)."""

    def __init__(
        self,
        group_name: str,
        epoch: int,
        world_size: int,
        backend: str,
        rank: int,
        store: dist.Store,
        timeout_s: float,
    ) -> None:
        self.rank, self.who = rank, f"group {group_name!r} rank {rank}"
        self.membership: Optional[Membership] = None
        group_timeout_s = check_group_timeout(
            DATA_GROUP_TIMEOUT_S, f"{self.who}: the groups of epoch {epoch}"
        )
        prefix = epoch_prefix(group_name, epoch)
        deadline = time.monotonic() + timeout_s
        meet(
            store,
            prefix,
            rank,
            world_size,
            timeout_s,
            f"{self.who}: meeting the {world_size} ranks of epoch {epoch}",
        )
        if rank == 0:  # every member left its earlier epochs before it came here
            forget_before(store, epoch_prefix(group_name, 0)[:-1], epoch)
        self._groups: List[dist.ProcessGroup] = []
        try:
            for kind, kind_backend in (("data", backend), ("control", "gloo")):
                self._groups.append(
                    self._make(
                        store,
                        f"{prefix}/{kind}",
                        (rank, world_size, kind_backend),
                        group_timeout_s,
                        deadline - time.monotonic(),
                        f"{self.who}: making the {kind} group of epoch {epoch} "
                        f"({world_size} ranks, {kind_backend})",
                    )
                )
        except Exception:
            self.close()
            raise
        data, control = self._groups
        self.data = DataGroup(data)
        self.control = ControlGroup(
            control,
            f"remote-{group_name}-{epoch}",
            rank=rank,
            store=prefixed_store(store, prefix),
        )
        self.manifests: Dict[str, EngineManifest] = {}
        # per engine, its block-FP8 weights over its TP ranks (``exchange_layouts``), which
        # a delta report names
        self.block_fp8: Dict[str, int] = {}
        self._layouts = _Layouts()

    @staticmethod
    def _make(
        store, prefix: str, shape, timeout_s: float, left_s: float, phase: str
    ) -> dist.ProcessGroup:
        """One of the epoch's groups (``shape``: this rank, the size, the backend), made
        within ``left_s``, what is left of the join's bound (gloo meets every peer while it
        is made, over addresses a peer may not reach), with the group's own ``timeout_s``
        after that; ``PeerLost`` naming ``phase`` when a peer did not make it in time."""
        rank, size, backend = shape
        if left_s <= 0:
            raise PeerLost(f"{phase}: the join's bound ran out before it")
        try:
            return join_group(
                store, prefix, rank, size, backend, timeout_s, setup_s=left_s
            )
        except (RuntimeError, dist.DistStoreError) as e:
            raise PeerLost(
                f"{phase}: not every rank made it within {left_s:.3g}s ({e})"
            ) from None

    def hear_membership(
        self, membership: Optional[Membership], timeout_s: float
    ) -> Membership:
        """The epoch's membership, from the trainer's first rank (group rank 0)."""
        raw = self.control.broadcast_bytes(
            membership.to_json() if self.rank == 0 else None,
            0,
            MEMBERSHIP_LIMIT,
            timeout_s,
            f"{self.who}: hearing the membership from trainer rank 0",
        )
        self.membership = Membership.from_json(raw)
        self.who = self.membership.who(self.rank)
        return self.membership

    def close(self) -> None:
        """Release this epoch's groups (pending work aborted where the backend can)."""
        while self._groups:
            leave_group(self._groups.pop())

    # ------------------------------------------------------------------ layouts

    def exchange_layouts(
        self,
        mine: Optional[EngineManifest],
        problem: Optional[str],
        timeout_s: float,
        block_fp8: int = 0,
    ) -> Dict[str, EngineManifest]:
        """Every engine's layout, on every member: each engine's first TP rank publishes its
        manifest (``mine``) or why it has none (``problem``), and every engine rank the
        number of its block-FP8 weights (``block_fp8``; summed per engine in
        ``self.block_fp8``). ``ManifestError`` names every engine that published none, and
        engines of one group that serve different models (other tensors or aliases)."""
        text = (
            problem.encode() if problem else (mine.to_json().encode() if mine else b"")
        )
        kind = 2 if problem else (1 if mine is not None else 0)
        fp = (
            fingerprint_int(mine.fingerprint) if mine is not None and not problem else 0
        )
        phase = f"{self.who}: hearing every engine's layout"
        rows = self.control.all_gather_ints(
            [kind, fp, len(text), block_fp8], timeout_s, phase
        )
        heard: Dict[int, EngineManifest] = {}
        problems: List[str] = []
        for member in self.membership.engines:
            self.block_fp8[member.name] = sum(rows[r][3] for r in member.ranks)
            kind, fp, size, _ = rows[member.offset]
            if kind == 1 and fp in heard:
                self.manifests[member.name] = heard[fp]
                continue
            raw = self.control.broadcast_bytes(
                text if self.rank == member.offset else None,
                member.offset,
                size,
                timeout_s,
                f"{phase} (engine {member.name!r})",
            )
            if kind == 2:
                problems.append(
                    f"engine {member.name!r}: {raw.decode(errors='replace')}"
                )
            elif kind == 0:
                problems.append(f"engine {member.name!r} published no layout")
            else:
                try:
                    manifest = EngineManifest.from_json(raw.decode())
                except (ManifestError, ValueError) as e:
                    problems.append(f"engine {member.name!r}: {e}")
                    continue
                if manifest.parallel.tp_size != member.tp_size:
                    problems.append(
                        f"engine {member.name!r} joined with {member.tp_size} ranks but publishes "
                        f"TP {manifest.parallel.tp_size}"
                    )
                heard[fp] = self.manifests[member.name] = manifest
        models = {
            (tuple(sorted(m.tensor_shapes.items())), tuple(sorted(m.aliases.items())))
            for m in self.manifests.values()
        }
        if len(models) > 1:
            problems.append(
                "the engines of one weight-sync group serve different models (their tensors "
                "or aliases differ)"
            )
        if problems:
            raise ManifestError(f"{self.membership.legend()}: " + "; ".join(problems))
        return self.manifests

    # ------------------------------------------------------------------ an update

    def hear_update(
        self,
        part: Optional[TrainerPart],
        timeout_s: float,
    ) -> Tuple[UpdateHeader, Mapping[str, Spec], SourceLayout]:
        """Steps 1-2: the header from the trainer's first rank, then the source layout for
        members that do not know it yet (cached by digest). ``LayoutError`` when the
        layout heard is unreadable or does not match its digest (every collective of
        these steps is joined first, so the others go on to share this rank's problem)."""
        raw = self.control.broadcast_bytes(
            part.header.encode() if self.rank == 0 else None,
            0,
            HEADER_LIMIT,
            timeout_s,
            f"{self.who}: hearing the update header from trainer rank 0",
        )
        header = UpdateHeader.decode(raw)
        known = (
            (
                part.specs,
                part.sources if part.sources is not None else source_layout(part.specs),
            )
            if part is not None
            else self._layouts.specs.get(header.layout_digest)
        )
        need = self.control.any(
            known is None,
            timeout_s,
            f"{self.who}: asking who lacks the trainer's source layout",
        )
        if need:
            raw = self.control.broadcast_bytes(
                part.wire if self.rank == 0 else None,
                0,
                header.layout_bytes,
                timeout_s,
                f"{self.who}: hearing the trainer's source layout ({header.layout_bytes} bytes)",
            )
        if known is not None:
            return header, known[0], known[1]
        specs = read_layout(raw)
        sources = source_layout(specs)
        if sources_digest(sources) != header.layout_digest:
            raise LayoutError(
                "the source layout heard differs from its digest in the update header"
            )
        self._layouts.keep(
            self._layouts.specs, header.layout_digest, (specs, sources), LAYOUTS_KEPT
        )
        return header, specs, sources

    def plan(
        self, header: UpdateHeader, specs: Mapping[str, Spec], sources: SourceLayout
    ) -> Tuple[Plan, Optional[SenderFp8Plan]]:
        """Step 3: this rank's moves (cached by the update's inputs), and for block-FP8
        engines the blocks sent quantized (the plan then without them)."""
        fingerprint = self.inputs_digest(header)
        key = fingerprint  # a delta update runs the same plan as a full one
        found = self._layouts.plans.get(key)
        if found is None:
            aliases = (
                next(iter(self.manifests.values())).aliases if self.manifests else {}
            )
            receivers = self.receivers(set(specs), aliases)
            plan = plan_for_rank(
                sources,
                receivers,
                self.rank,
                bucket_bytes=header.bucket_bytes,
                aliases=aliases,
                fingerprint=fingerprint,
            )
            shapes = {n: tuple(t.shape) for n, t in sources.items()}
            fp8 = cut_for_engines(plan, self._engines(), shapes)
            found = (plan if fp8 is None else fp8.plan, fp8)
            self._layouts.keep(self._layouts.plans, key, found, PLANS_KEPT)
        return found

    def _engines(self) -> List[Tuple[EngineManifest, int]]:
        """Every engine's manifest and first group rank."""
        return [(self.manifests[m.name], m.offset) for m in self.membership.engines]

    def receivers(self, names, aliases: Mapping[str, str]) -> Receivers:
        """Every engine rank's targets among the HF tensors ``names``: one class per
        (layout, TP rank), whose ranks are that TP rank of every engine of the layout."""
        classes: Dict[Tuple[str, int], Tuple[tuple, List[int]]] = {}
        for member in self.membership.engines:
            manifest = self.manifests[member.name]
            for t in range(member.tp_size):
                key = (manifest.fingerprint, t)
                if key not in classes:
                    wanted = restrict(manifest.ranks[t], names, aliases)
                    classes[key] = (tuple(wanted), [])
                classes[key][1].append(member.offset + t)
        return Receivers(
            tuple(c[0] for c in classes.values()),
            tuple(tuple(c[1]) for c in classes.values()),
        )

    def inputs_digest(self, header: UpdateHeader) -> str:
        """What every rank's plan follows from: the source layout, every engine's layout and
        place, the bucket."""
        layouts = [
            (m.offset, m.tp_size, self.manifests[m.name].fingerprint)
            for m in self.membership.engines
        ]
        return hashlib.sha256(
            repr(
                (
                    header.layout_digest,
                    layouts,
                    header.bucket_bytes,
                    self.membership.trainers,
                )
            ).encode()
        ).hexdigest()

    def agree(
        self, problems: Sequence[str], plan: Optional[Plan], timeout_s: float
    ) -> None:
        """Steps 4-5: every rank's problems (``GroupRefusal`` with all of them), then one
        all-reduce that every rank runs the same plan."""
        everyone = self.control.share_problems(
            problems,
            timeout_s,
            f"{self.who}: sharing problems with every member ({self.membership.legend()})",
        )
        if everyone:
            raise GroupRefusal("; ".join(everyone))
        self.control.agree_on_plan(plan.fingerprint, timeout_s, self.who)

    def run_update(
        self,
        part: Optional[TrainerPart],
        timeout_s: float,
        check: Optional[Callable[[UpdateHeader, Mapping[str, Spec]], List[str]]] = None,
        params: Optional[Mapping[str, torch.Tensor]] = None,
        deferred: Optional[Deferred] = None,
        snapshot: Optional[Snapshot] = None,
        kept: Optional[KeptStaging] = None,
        clock: Optional[PhaseClock] = None,
    ) -> UpdateResult:
        """Steps 1-6 on this rank. A trainer rank passes ``part``; every rank may pass
        ``check`` (its problems with the update: the header and specs), an engine rank its
        live ``params`` (checked against the plan only)
        and ``deferred`` (its staging). Every local check (``check``, the plan, this rank's
        tensors against it: ``executor.check_inputs``) runs before the agreement and its
        problems are part of it: one raising after it would leave the peers waiting in
        rounds that end in ``PeerLost``. Raises ``GroupRefusal`` before any byte moved,
        ``PeerLost`` when a member did not answer within ``timeout_s``. A header that says
        ``delta`` runs the rounds as delta records (``delta_rounds``: a trainer rank encodes
        against its ``snapshot``, an engine rank decodes against ``params``, and the pieces
        it quantizes from block-FP8 staging against ``kept``). ``clock``: where the
        update's seconds go on this rank (``phase_timing``)."""
        clock = PhaseClock() if clock is None else clock
        problems: List[str] = []
        plan, fp8, device = None, None, self.data.device
        local = part.local if part is not None else {}
        try:
            with clock.phase(Phase.CONTROL):
                header, specs, sources = self.hear_update(part, timeout_s)
            if check is not None:
                with clock.phase(Phase.VALIDATE):
                    problems += check(header, specs)
            if not problems:
                with clock.phase(Phase.PLAN):
                    plan, fp8 = self.plan(header, specs, sources)
                with clock.phase(Phase.VALIDATE):
                    problems += [
                        f"{self.who}: {p}"
                        for p in check_inputs(
                            plan, self.rank, local, params or {}, device
                        )
                    ]
        except (CoverageError, LayoutError, KeyError, ValueError) as e:
            problems.append(f"{self.who}: {e}")
        with clock.phase(Phase.AGREE):
            self.agree(problems, plan, timeout_s)
        args = (plan, self.rank, local, params or {}, self.data, timeout_s, deferred)
        # block-FP8 pieces the engines quantize from staging: based on their kept staging
        staged = engine_quantized(self._engines()) if fp8 is not None else frozenset()
        try:
            with clock.phase(Phase.EXECUTE):
                stats, delta, why_full = self._rounds(
                    args, header, fp8, staged, snapshot, kept
                )
        except PeerLost as e:  # name the group ranks of the round
            raise PeerLost(f"{e} [{self.membership.legend()}]") from None
        clock.count_execution(stats)
        return UpdateResult(header, plan, stats, delta, why_full, fp8, staged)

    def _rounds(
        self,
        args: tuple,
        header: UpdateHeader,
        fp8: Optional[SenderFp8Plan],
        staged: FrozenSet[Tuple[int, str]],
        snapshot: Optional[Snapshot],
        kept: Optional[KeptStaging],
    ) -> Tuple[ExecutionStats, Optional[DeltaFigures], str]:
        """Step 6: the plan's rounds (``execute``; a delta's records, ``execute_delta``;
        then the blocks sent quantized, ``run_quantized``; a full update of a delta group
        staged in ``snapshot``, ``stage_full``): (stats, delta figures, why it was full).
        ``args``: ``execute``'s positional arguments."""
        if header.delta:
            return execute_delta(
                *args, snapshot, self.membership.epoch, header.digest, fp8, staged, kept
            )
        # an engine rank stages every region it receives: a region its sender casts travels
        # in the sender's pack to it, whatever its size
        stats = execute(*args, checked=True, pack_casts=True)
        if fp8 is not None:
            run_quantized(fp8, *args[1:], stats)
        delta, why_full = None, ""
        if snapshot is not None:
            plan, _, local = args[:3]
            delta, why_full = stage_full(
                plan,
                self.rank,
                local,
                snapshot,
                self.membership.epoch,
                fp8,
                staged,
                self.data,
            )
        return stats, delta, why_full

    @staticmethod
    def wire_of(
        specs: Mapping[str, Spec], sources: Optional[SourceLayout] = None
    ) -> Tuple[bytes, str]:
        """The trainer's source layout on the wire, and its digest (of ``sources``, the
        layout ``specs`` describe, described here when None)."""
        sources = source_layout(specs) if sources is None else sources
        return layout_wire(specs), sources_digest(sources)
