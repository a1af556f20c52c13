"""The engine side of a distributed weight update, called by thin hooks in SGLang.

Each engine TP rank (its scheduler process) keeps one ``EngineWeightSync``, made on the
first update and held by the tp worker (0.5.23) or the model runner (older releases);
it goes with them. The hooks call, on every TP rank:

1. ``receive_shards(recv_req, owner)`` (tp worker): take this rank's payload from its
   channel socket, waiting at most ``timeout_s``. Never raises: a problem is this
   rank's refusal, shared in step 2.
2. ``apply_shards(model, model_config, received, recv_req)`` (each selected model
   runner; every rank together): describe the targets from SGLang's own loaders
   (``derive.target_cache``) and the sources from the payload, validate, then agree on every
   rank's problems, the delivered tensors and the plan (``control_plane``, one
   all-reduce, bounded by ``timeout_s + GRACE_S``). Any problem on any rank refuses the
   update on every rank before a parameter changes. Then make the data group ready
   (made, warmed up and connected: ``ready_data_group``; a failure is a refusal), commit
   (rank 0 records with the tokenizer manager that the update is being applied, unless
   it gave up on it first: ``outcome``; one all-reduce), execute the plan (``executor``) and refresh what
   SGLang derives from parameters (``apply``); share the figures and every rank's phases
   (``phase_timing``; one all-reduce).
3. ``end_of_update(received, recv_req, success, message)`` (scheduler): upstream's
   closing TP barrier, bounded.

The engine never dies of an update: every exception becomes ``success=False`` with a
message naming the rank; a failure after the commit is ``mixed`` (the reply's field,
and ``protocol.MIXED`` in its message). The collectives run on a control group of the
engine's own, made anew on every TP rank after a wait on it failed (``renew_control``).
"""

# pr: here
# Releases before 0.5.23 have a single hook in the model runner:
# ``tensor_path.update_from_payload`` runs all three steps and the post-load fixups.
# pr: here end

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from sglang.srt.weight_sync.apply import (
    nonfinite_tensors,
    refresh_derived,
    release_cached_memory,
    synchronize,
)
from sglang.srt.weight_sync.control_plane import (
    GRACE_S,
    Agreement,
    ControlGroup,
    PeerLost,
    PlanDisagreement,
    check_group_timeout,
    plan_disagreement,
)
from sglang.srt.weight_sync.delivered import delivery_digest, explain_delivery
from sglang.srt.weight_sync.delivery import Payload, ShardReceiver
from sglang.srt.weight_sync.derive import DerivedTargets
from sglang.srt.weight_sync.engine_layout import EngineLayout
from sglang.srt.weight_sync.executor import (
    DataGroup,
    ExecutionStats,
    check_inputs,
    execute,
)
from sglang.srt.weight_sync.phase_timing import (
    Count,
    Phase,
    PhaseClock,
    describe_phases,
    from_wire,
)
from sglang.srt.weight_sync.planner import CoverageError, Plan, PlanCache
from sglang.srt.weight_sync.protocol import (
    DATA_GROUP_TIMEOUT_S,
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    DISTRIBUTED_LOAD_FORMAT,
    FIGURES,
    MIXED,
    REFUSED,
    DeliveryError,
    HeaderBound,
    check_timeout,
    request_problems,
    resolve_channel,
)
from sglang.srt.weight_sync.sglang_compat import (
    field_names,
    tp_state,
)
from sglang.srt.weight_sync.source_layout import LayoutError, SourceLayout
from sglang.srt.weight_sync.target_layout import restrict

# isort: split
# pr: safety
from sglang.srt.weight_sync.commit_vote import commit_to_write

# pr: safety end
# isort: split
# pr: fp8
from sglang.srt.weight_sync.fp8_sender import SenderFp8Plan, sender_quantized
from sglang.srt.weight_sync.fp8_targets import QuantizedParam
from sglang.srt.weight_sync.fp8_wire import ColocatedFp8, quantized_targets

# pr: fp8 end
# isort: split
# pr: scale
from sglang.srt.weight_sync.engine_trainer_side import local_step
from sglang.srt.weight_sync.manifest import EngineManifest, write_manifest
from sglang.srt.weight_sync.protocol import PayloadKind
from sglang.srt.weight_sync.source_layout import MeshSpec
from sglang.srt.weight_sync.wire_dtypes import cast_problems

# pr: scale end

__all__ = (
    "DISTRIBUTED_LOAD_FORMAT",
    "EngineWeightSync",
    "ReceivedShards",
    "apply_shards",
    "end_of_update",
    "header_bound",
    "receive_shards",
    # pr: safety
    "release_data_group",
    # pr: safety end
)

logger = logging.getLogger(__name__)

# Checkpoint names SGLang's own loaders skip; trainers may send them.
IGNORED_SUFFIXES = (
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)


@dataclass
class ReceivedShards:
    """This rank's payload, or why there is none; after the update, every TP rank's figures
    (``FIGURES``, summed over the runners the update wrote), every TP rank's phases
    (``phase_timing``, by name) and whether writes failed midway. ``clock`` times this
    rank's phases from the moment the scheduler takes the update."""

    sync: EngineWeightSync
    payload: Optional[Payload]
    error: Optional[str] = None
    figures: Dict[str, List[int]] = dataclasses.field(default_factory=dict)
    mixed: bool = False
    clock: PhaseClock = dataclasses.field(default_factory=PhaseClock)
    phases: Dict[str, List[float]] = dataclasses.field(default_factory=dict)
    # (the model config, its derived targets or None, why not): derived as the update was
    # received, so that apply never derives again, alone, what its peers already derived
    derivation: Optional[Tuple[object, Optional[DerivedTargets], List[str]]] = None

    def release(self) -> None:
        """Drop the payload's tensors (CUDA IPC maps of the trainer's memory, or CPU frames)
        once the update is over, so that nothing of it outlives the update."""
        self.payload = None

    def reply(self, output_cls, success: bool, message: str):
        """The scheduler's reply: upstream's fields, plus the figures and ``mixed`` where
        ``output_cls`` has them (``UpdateWeightsDistributedReqOutput``; the tensor path
        keeps upstream's struct)."""
        fields = field_names(output_cls)
        extra = {k: v for k, v in self.figures.items() if k in fields}
        if "phases" in fields:
            extra["phases"] = self.phases
        if "mixed" in fields:
            extra["mixed"] = self.mixed and not success
        return output_cls(success=success, message=message, **extra)


@dataclass
class _Validated:
    """What step 2 found on this rank before any write: its problems, and the plan to
    execute (with the shards it reads and the parameters it writes)."""

    problems: List[str]
    plan: Optional[Plan] = None
    shards: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    params: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # pr: scale
    # or, instead of a plan, the work this rank does alone (returns its ``FIGURES``; the
    # data plane is not used)
    local: Optional[Callable[[], Tuple[int, int, int]]] = None
    # pr: scale end
    # pr: fp8
    # block-FP8 weights: the plan cut for sender quantization, the staging of the blocks
    # left, the live e4m3 weights and scales (``params`` holds the staging instead)
    fp8: Optional[ColocatedFp8] = None
    # pr: fp8 end


# pr: scale
def _nothing() -> Tuple[int, int, int]:
    """The local work of a payload that writes nothing ("describe")."""
    return 0, 0, 0


# pr: scale end
class EngineWeightSync:
    """One engine TP rank's state across distributed updates: its channel sockets, the
    derived targets, the targets with live dtypes and their digest, cached plans, the
    data plane's own group over the TP ranks (``data_group``), and the TP group's control
    collectives. ``close()`` releases the sockets; the owner (tp worker or model runner)
    going away releases the rest."""

    def __init__(self, rank: int, layout: Optional[EngineLayout] = None) -> None:
        self.rank = rank
        self._receiver: Optional[ShardReceiver] = None
        self.plans = PlanCache()
        # targets, their provenance check, live dtypes and digest (shared with remote engines)
        self.layout = layout if layout is not None else EngineLayout(rank)
        self._data: Optional[DataGroup] = None
        self._control: Optional[ControlGroup] = None
        # how many control groups this rank made: names them apart (barrier marks in the store)
        self._controls_made = 0
        # how many data groups this rank made or tried to: its proposal for the next one's
        # number (``_agree``, ``data_group``)
        self.data_groups_made = 0

    @classmethod
    def of(cls, owner) -> EngineWeightSync:
        """The weight sync kept on ``owner``, made on first use."""
        sync = getattr(owner, "_weight_sync", None)
        if sync is None:
            rank = tp_state().rank
            sync = owner._weight_sync = cls(rank, EngineLayout.of(owner, rank))
        return sync

    @property
    def control(self) -> ControlGroup:
        """The control collectives over the engine's TP ranks, on a gloo group of their own:
        never SGLang's TP CPU group, which serving's own collectives use in lockstep (a wait
        given up there would leave it out of step). Made on first use by every TP rank at
        the same point of an update; ``renew_control`` replaces it after a failed wait."""
        if self._control is None:
            self._make_control(None)
        return self._control

    def _make_control(self, setup_s: Optional[float]) -> None:
        """The control group, made within ``setup_s`` (``ControlGroup``)."""
        self._controls_made += 1
        self._control = ControlGroup(
            tp_state().cpu_group,
            f"engine-{self._controls_made - 1}",
            own=True,
            setup_s=setup_s,
        )

    def renew_control(self, setup_s: float) -> None:
        """At the start of every update, on every TP rank: make a new control group if a wait
        on the current one failed (``ControlGroup.lost``). Every TP rank lost it in that same
        update: a rank whose wait failed never uses the group again, so each peer's next wait
        on it fails too, at the latest at the closing barrier (``end``), which every update
        ends with. So all ranks make the new group together, here, within ``setup_s``: a
        rank that never comes is ``PeerLost`` on the others, and the next update tries again."""
        if self._control is not None and self._control.lost:
            logger.warning(
                "engine rank %d: making a new control group with the other TP ranks (a wait "
                "on the last one failed: %s)",
                self.rank,
                self._control.lost,
            )
            self._control = None
        if self._control is None:  # made here, at the same point on every rank
            self._make_control(setup_s)

    def _data_group_terms(self) -> Tuple[Dict[str, bool], Dict[str, int]]:
        """This rank's part of agreeing on the data group (``ControlGroup.agree``'s flags
        and proposals): whether it lacks one, and the number it would give the next."""
        lacks = self._data is None or self._data.abandoned
        return (
            {"no data group": lacks},
            {
                "data group number": DataGroup.number_proposal(
                    tp_state().device_group, self.data_groups_made, lacks
                )
            },
        )

    @staticmethod
    def _data_group_number(agreed: Agreement) -> Optional[int]:
        """The data group the ranks agreed to make (the highest proposal), None: keep."""
        if "no data group" not in agreed.raised:
            return None
        return agreed.highest["data group number"]

    def agree_on_data_group(self, bound: float) -> Optional[int]:
        """Whether some TP rank lacks a data group and the number of the one to make (one
        all-reduce), for a caller whose agreement does not carry it (``_agree`` does)."""
        flags, proposals = self._data_group_terms()
        agreed = self.control.agree(
            [],
            {},
            flags,
            bound,
            f"engine rank {self.rank}: agreeing whether to make the data group",
            proposals,
        )
        return self._data_group_number(agreed)

    def data_group(self, bound: float, number: Optional[int]) -> DataGroup:
        """The data plane's own group over the TP ranks, never SGLang's serving TP group: a
        wait that times out on NCCL aborts its group's communicator, which must not be the
        one serving uses. Made, with the TP device group's backend and the explicit timeout
        ``DATA_GROUP_TIMEOUT_S`` (above every bound), when an update is about to execute a
        plan that every TP rank agreed on, if any TP rank has none (the first update, or
        one dropped after a failed wait): the ranks agree on that and on the group's
        ``number`` first (``_agree``), so all of them make it together, only they take part
        (``control_plane.fresh_group``), within ``bound`` (gloo meets every peer while it is
        made). None: every rank has one. ``ready_data_group`` warms it up and connects it
        before the commit vote."""
        if number is not None:
            self.drop_data_group()
            self.data_groups_made = number + 1
            timeout_s = check_group_timeout(
                DATA_GROUP_TIMEOUT_S, f"engine rank {self.rank}: the data group"
            )
            self._data = DataGroup.over_ranks_of(
                tp_state().device_group, timeout_s, number, setup_s=bound
            )
        if self._data is None:
            raise RuntimeError(
                f"engine rank {self.rank}: no data group, and the TP ranks agreed that "
                "every rank has one"
            )
        return self._data

    def ready_data_group(
        self, plan: Plan, number: Optional[int], bound: float
    ) -> Tuple[Optional[DataGroup], Optional[str]]:
        """The data group made, warmed up and connected for ``plan`` (``DataGroup.set_up``),
        before the commit vote, on every TP rank: the group, or the refusal (``REFUSED``,
        nothing written) with every rank's failure, the group dropped on every rank so that
        the next update makes a new one. NCCL makes its communicator and connects pairs
        there, blocking the host; a failure after the vote would say ``mixed`` although
        nothing was written, and keep a broken group. When a set-up had work (the same on
        every rank: ``DataGroup.needs_set_up``), the ranks agree on how it went (one
        all-reduce), a rank that failed at once waiting for a peer whose wait in the set-up
        ran out its bound; a group already set up for the plan costs no round trip.
        ``number``: the data group to make (``data_group``), None: keep this rank's."""
        who = f"engine rank {self.rank}"
        problem, needed = None, True
        try:
            data = self.data_group(bound, number)
            needed = data.needs_set_up(plan)
            if needed:
                data.set_up(plan, self.rank, bound, who)
        except Exception as e:  # noqa: BLE001 - nothing was written: a refusal
            logger.exception("%s: the data group could not be made ready", who)
            problem = (
                f"{who}: making, warming up or connecting the data group failed: "
                f"{type(e).__name__}: {e}"
            )
        if not needed:
            return data, None
        try:
            problems = self.control.agree(
                [problem] if problem else [],
                {},
                {},
                2 * bound,
                f"{who}: agreeing that every TP rank's data group is ready "
                f"({self.control.size} ranks)",
            ).problems
        except PeerLost as e:
            problems = (str(e),)
        if not problems:
            return data, None
        self.drop_data_group()
        return None, REFUSED + "; ".join(problems)

    def drop_data_group(self) -> None:
        """Abort and forget the data group (after a failed wait on it); the next update that
        executes a plan makes a new one on every TP rank."""
        if self._data is not None:
            self._data.abandon()
            self._data = None

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    # ---------------------------------------------------------------- step 1

    def receive(self, recv_req, model_config) -> ReceivedShards:
        """This rank's payload for ``recv_req.update_id``, or why there is none (never raises);
        its clock starts here (``phase_timing``)."""
        clock = PhaseClock()
        with clock.phase(Phase.DELIVER):
            received = self._receive(recv_req, model_config, clock)
        received.clock = clock
        return received

    def _receive(self, recv_req, model_config, clock: PhaseClock) -> ReceivedShards:
        """The engine's targets come first, on every rank (derived once, then memoised; the
        first derivation is collective, like ``renew_control`` before it): their tensor
        count bounds the payload's header (``header_bound``)."""
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        derivation = None
        try:
            self.renew_control(_timeout(recv_req) + GRACE_S)
            with clock.phase(Phase.DESCRIBE):
                derived, why_not = self._derived_targets(
                    model_config, _timeout(recv_req) + GRACE_S
                )
            derivation = (model_config, derived, why_not)
            # a request whose control payload could not be read carries why (``tensor_path``)
            unreadable = getattr(recv_req, "problem", None)
            problems = [unreadable] if unreadable else request_problems(recv_req)
            if problems:
                return ReceivedShards(
                    self,
                    None,
                    f"engine rank {self.rank}: " + "; ".join(problems),
                    derivation=derivation,
                )
            monkey_patch_torch_reductions()  # CUDA IPC handles name GPUs by UUID (no effect on CPU tensors)
            if self._receiver is None:
                self._receiver = ShardReceiver(self.rank)
            return ReceivedShards(
                self,
                self._receiver.receive(
                    recv_req.channel,
                    recv_req.update_id,
                    recv_req.timeout_s,
                    header_bound(derived),
                ),
                derivation=derivation,
            )
        except DeliveryError as e:  # its message names the engine rank
            return ReceivedShards(self, None, str(e), derivation=derivation)
        except Exception as e:  # noqa: BLE001 - the engine never dies of an update
            logger.exception(
                "engine rank %d: receiving a distributed weight update failed",
                self.rank,
            )
            return ReceivedShards(
                self,
                None,
                f"engine rank {self.rank}: receiving the payload failed: "
                f"{type(e).__name__}: {e}",
                derivation=derivation,
            )

    # ---------------------------------------------------------------- step 2

    def apply(
        self, model: torch.nn.Module, model_config, received: ReceivedShards, recv_req
    ) -> Tuple[bool, str]:
        """Validate, agree, plan and execute on this rank; every TP rank calls it together."""
        # pr: scale
        # A "params" payload (trainer-side resharding) is only checked and copied in place;
        # a "describe" payload publishes this engine's manifest into the channel.
        # pr: scale end
        bound = (
            _timeout(recv_req) + GRACE_S
        )  # every rank waited at most timeout_s for its payload
        clock, trips = received.clock, self.control.round_trips
        with clock.phase(Phase.DESCRIBE):
            carried = received.derivation
            if carried is not None and carried[0] is model_config:
                derived, problems = carried[1], list(carried[2])
            else:  # another model runner's config (a draft model), or never derived
                derived, problems = self._derived_targets(model_config, bound)
            # pr: scale
            if derived is not None:
                problems += self.layout.provenance_problems(model, derived)
            # pr: scale end
            problems += self.layout.refusals(model)
        with clock.phase(Phase.VALIDATE):
            found = (
                self._validate(model, derived, received, recv_req)
                if derived is not None
                else _Validated([])
            )
        try:
            with clock.phase(Phase.AGREE):
                refusal, number = self._agree(
                    problems + found.problems, found.plan, bound, received.payload
                )
        except PeerLost as e:
            return False, f"{REFUSED}engine rank {self.rank}: {e}"
        if refusal is not None:
            return False, refusal
        data = None
        if found.plan is not None:
            with clock.phase(Phase.AGREE):
                data, refusal = self.ready_data_group(found.plan, number, bound)
            if refusal is not None:
                return False, refusal
        # pr: safety
        with clock.phase(Phase.AGREE):
            refusal = self._commit(received, recv_req, bound)
        if refusal is not None:
            return False, refusal
        # pr: safety end
        try:
            figures = self._write(model, received, found, recv_req, bound, data, trips)
        except Exception as e:  # noqa: BLE001 - a peer died or a copy failed after writes began
            logger.exception(
                "engine rank %d: a distributed weight update failed while writing",
                self.rank,
            )
            received.mixed = True
            return False, (
                f"distributed weight update FAILED after writes began on engine rank {self.rank} "
                f"({type(e).__name__}: {e}): {MIXED} (some parameters new, some old); "
                "generation is refused until a distributed weight update succeeds"
            )
        for key, values in zip(FIGURES, figures):
            previous = received.figures.get(key, [0] * self.control.size)
            received.figures[key] = [a + b for a, b in zip(previous, values)]
        received.phases = from_wire(figures[len(FIGURES) :])  # as of the last runner's
        return True, "Success"  # upstream's text: callers test for it

    # pr: safety
    def _commit(
        self, received: ReceivedShards, recv_req, bound: float
    ) -> Optional[str]:
        """The last step before the first write, on every TP rank (``commit_to_write``):
        None to write, else why not; a failed vote marks ``received`` mixed."""
        why, mixed = commit_to_write(
            self.control, self.rank, recv_req.channel, recv_req.update_id, bound
        )
        received.mixed = received.mixed or mixed
        return why

    # pr: safety end
    def _derived_targets(
        self, model_config, bound: float
    ) -> Tuple[Optional[DerivedTargets], List[str]]:
        """Every TP rank's derived targets; on every rank, even one without a payload: the
        first call is collective (``derive.target_cache``)."""
        phase = f"exchanging derived targets with the other TP ranks ({self.control.size} ranks)"
        try:
            return self.layout.derived(
                model_config,
                functools.partial(
                    self.control.share_bytes, timeout_s=bound, phase=phase
                ),
            ), []
        except (ValueError, PeerLost) as e:
            return None, [f"engine rank {self.rank}: {e}"]
        except Exception as e:  # noqa: BLE001 - refuses the update, never kills the scheduler
            logger.exception(
                "engine rank %d: the derived targets could not be assembled", self.rank
            )
            return None, [
                f"engine rank {self.rank}: the derived targets could not be assembled: "
                f"{type(e).__name__}: {e}"
            ]

    def _validate(
        self, model, derived: DerivedTargets, received: ReceivedShards, recv_req
    ) -> _Validated:
        """This rank's problems with its payload, and the plan (or local work) if there are none."""
        if received.error:
            return _Validated([received.error])
        rank, clock, kind = self.rank, received.clock, received.payload.kind
        try:
            with clock.phase(Phase.DESCRIBE):
                live = self.layout.live(
                    model,
                    derived,
                    # pr: fp8
                    block_fp8=True,
                    # pr: fp8 end
                )
                targets, params = live.targets, live.params
            # pr: scale
            manifest = live.manifest
            if kind != PayloadKind.PARAMS:
                # the dtypes the trainer casts shards to, from its first payload on (a
                # "describe" opens an engine-side channel: ``trainer_flow._open``)
                kept = self.layout.kept_dtypes(manifest, recv_req.channel)
            if kind == PayloadKind.DESCRIBE:
                self._publish(manifest, recv_req.channel)
                return _Validated([], local=_nothing)
            if kind == PayloadKind.PARAMS:
                step = local_step(
                    received.payload,
                    targets,
                    manifest,
                    params,
                    rank,
                    live.fp8,
                    live.tensors,
                )
                return _Validated(step.problems, local=step.run)
            # pr: scale end
            sources, shards = _sources(
                received.payload,
                targets,
                # pr: scale
                kept,
                # pr: scale end
            )
            with clock.phase(Phase.PLAN):
                misses = self.plans.misses
                plan = self._plan(
                    received.payload, sources, targets, live.digest, recv_req
                )
                clock.count(Count.PLAN_COLD, self.plans.misses - misses)
            # pr: fp8
            if live.fp8 is not None:
                return self._block_fp8(plan, live, sources, shards)
            # pr: fp8 end
            return _Validated(
                check_inputs(plan, rank, shards, params), plan, shards, params
            )
        except (LayoutError, CoverageError, ValueError, KeyError) as e:
            return _Validated([f"engine rank {rank}: {e}"])
        except Exception as e:  # noqa: BLE001 - any other fault refuses the update, never kills the scheduler
            logger.exception(
                "engine rank %d: validating a distributed weight update failed", rank
            )
            return _Validated(
                [
                    f"engine rank {rank}: validating the update failed: {type(e).__name__}: {e}"
                ]
            )

    # pr: scale
    def _publish(self, manifest: EngineManifest, channel: str) -> None:
        """A "describe" payload's work: this rank's manifest written into the channel, for
        the trainer rank beside it (nothing is written to the model)."""
        path = write_manifest(resolve_channel(channel, self.rank), self.rank, manifest)
        logger.info(
            "engine rank %d: published the engine layout %s at %s",
            self.rank,
            manifest.fingerprint[:12],
            path,
        )

    # pr: scale end
    # pr: fp8
    def _block_fp8(
        self,
        plan: Plan,
        live,
        sources: SourceLayout,
        shards: Dict[str, torch.Tensor],
    ) -> _Validated:
        """Block FP8: the blocks a sending rank holds whole travel quantized and land in the
        e4m3 weights; the rest meet in bf16 staging, quantized after the plan ran."""
        rank, targets, params = self.rank, live.targets, live.params
        quantized = live.fp8.own.quantized
        fp8_params = {q.weight: params[q.weight] for q in quantized}
        fp8_params.update((q.scale, live.tensors[q.scale].data) for q in quantized)
        names = {q.weight for q in quantized}
        colocated = ColocatedFp8.of(
            self._cut(plan, quantized, sources, targets),
            rank,
            quantized,
            [
                t
                for t in restrict(targets.for_rank(rank), sources, targets.aliases)
                if t.name in names
            ],
            fp8_params,
            next(iter(params.values())).device,
        )
        params = colocated.destinations(params)
        problems = [f"engine rank {rank}: {p}" for p in live.fp8.own.problems]
        return _Validated(
            problems + colocated.check(plan, rank, shards, params),
            plan,
            shards,
            params,
            fp8=colocated,
        )

    def _cut(
        self,
        plan: Plan,
        quantized: Tuple[QuantizedParam, ...],
        sources: SourceLayout,
        targets: DerivedTargets,
    ) -> SenderFp8Plan:
        """``plan`` cut for sender quantization (``fp8_sender.sender_quantized``, every
        engine rank receiving for itself, its block-FP8 weights those of ``quantized``'s
        names and blocks, this rank's: the same on every TP rank): a pure function of the
        plan, so kept in the plan's memo and gone with it."""
        cut = plan.memo.get(("fp8 cut",))
        if cut is not None:
            return cut
        if not quantized:
            raise ValueError("the engine has block-FP8 weights, but names none")
        shapes = {n: tuple(s) for n, s in targets.tensor_shapes().items()}
        shapes.update((n, tuple(s.shape)) for n, s in sources.items())
        blocks = {q.weight: q.block for q in quantized}
        cut = sender_quantized(
            plan,
            {
                r: quantized_targets(targets.for_rank(r), blocks)
                for r in range(self.control.size)
            },
            shapes,
        )
        plan.memo[("fp8 cut",)] = cut
        return cut

    # pr: fp8 end

    def _agree(
        self,
        problems: List[str],
        plan: Optional[Plan],
        bound: float,
        payload: Optional[Payload] = None,
    ) -> Tuple[Optional[str], Optional[int]]:
        """Every rank's problems on every rank, the delivered tensors and the plan agreed,
        and whether some rank lacks a data group, in one round trip (the problems' text,
        or the names some trainer rank did not deliver, follow only when there are some):
        the refusal or None, and the number of the data group to make (the highest of the
        ranks' proposals) or None when every rank has one."""
        if problems:
            logger.error(
                "distributed weight update, rank %d: %s", self.rank, "; ".join(problems)
            )
        who = f"rank {self.rank}"
        flags, proposals = self._data_group_terms()
        agreed = self.control.agree(
            problems,
            {
                "delivery": delivery_digest(payload, IGNORED_SUFFIXES),
                "plan": int(plan.fingerprint[:15], 16) if plan is not None else 0,
            },
            flags,
            bound,
            f"agreeing on problems, deliveries and the plan with the other TP ranks "
            f"(one is dead or stuck; {self.control.size} ranks)",
            proposals,
        )
        if agreed.problems:
            return REFUSED + "; ".join(agreed.problems), None
        try:
            if "delivery" in agreed.unequal:
                explain_delivery(self.control, payload, bound, who, IGNORED_SUFFIXES)
            if "plan" in agreed.unequal or "delivery" in agreed.unequal:
                raise plan_disagreement(plan.fingerprint if plan else "0" * 15, who)
        except PlanDisagreement as e:
            return f"{REFUSED}{e}", None
        return None, self._data_group_number(agreed)

    def _plan(
        self,
        payload: Payload,
        sources: SourceLayout,
        targets: DerivedTargets,
        digest: str,
        recv_req,
    ) -> Plan:
        """This rank's plan for ``sources`` into ``targets`` (``PlanCache``): a pure function
        of the layout, the targets, the bucket size and the TP ranks, so kept in the payload's
        layout memo too, where an unchanged layout finds it without restricting the targets
        or digesting the sources per tensor again."""
        bucket_bytes = recv_req.bucket_bytes or DEFAULT_BUCKET_BYTES
        size = self.control.size
        memo = payload.layout_memo if payload.layout_memo is not None else {}
        key = _layout_key(
            payload,
            "plan",
            id(targets),
            digest,
            bucket_bytes,
            size,
            self.rank,
        )
        known = memo.get(key)
        if known is not None and known[0] is targets:
            return known[1]
        needed = {
            r: restrict(targets.for_rank(r), sources, targets.aliases)
            for r in range(size)
        }
        # needed follows from the targets and the sources' names: their digest stands for it
        plan = self.plans.get(
            sources,
            needed,
            bucket_bytes=bucket_bytes,
            aliases=targets.aliases,
            targets_digest=digest,
            local_ranks=(self.rank,),
        )
        memo[key] = (targets, plan)
        return plan

    def _execute(
        self, found: _Validated, data: Optional[DataGroup], bound: float
    ) -> ExecutionStats:
        """Run the plan this rank validated (``executor.execute``)."""
        # pr: fp8
        if found.fp8 is not None:
            return found.fp8.run(
                self.rank, found.shards, found.params, data, bound, checked=True
            )
        # pr: fp8 end
        return execute(
            found.plan,
            self.rank,
            found.shards,
            found.params,
            group=data,
            timeout_s=bound,
            checked=True,  # _validate checked them; the ranks agreed on it
        )

    def _run(
        self,
        found: _Validated,
        recv_req,
        bound: float,
        data: Optional[DataGroup],
        clock: PhaseClock,
    ) -> Tuple[int, int, int]:
        """Execute the plan over ``data`` and make sure its writes are done: this rank's
        figures (bytes received, their lower bound, the staging peak)."""
        # pr: scale
        if found.local is not None:  # the work this rank does alone: no data plane
            with clock.phase(Phase.APPLY):
                return found.local()
        # pr: scale end
        try:
            with clock.phase(Phase.EXECUTE):
                stats = self._execute(found, data, bound)
                clock.add(Phase.APPLY, stats.copy_seconds)
        except PeerLost:
            self.drop_data_group()  # its pending work must not outlive the update
            raise
        clock.count_execution(stats)
        with clock.phase(Phase.APPLY):
            written = list(found.params.values())
            lower_bound = found.plan.lower_bound_bytes(self.rank)
            # pr: fp8
            if found.fp8 is not None:
                # every element of every block left has met in staging: quantize in place
                found.fp8.quantize_left()
                written += found.fp8.fp8_params.values()
                lower_bound = found.fp8.sender.lower_bound_bytes(self.rank)
            # pr: fp8 end
            synchronize(written)  # the trainer may reuse what we read once we reply
        if stats.peak_staging_bytes:
            release_cached_memory(found.params.values())
        mine = (stats.bytes_received, lower_bound, stats.peak_staging_bytes)
        logger.info(
            "distributed weight update %s, engine rank %d: received %d bytes (lower bound %d), "
            "staged at most %d",
            recv_req.update_id,
            self.rank,
            *mine,
        )
        return mine

    def _write(
        self,
        model,
        received: ReceivedShards,
        found: _Validated,
        recv_req,
        bound: float,
        data: Optional[DataGroup],
        trips: int,
    ) -> List[List[int]]:
        """Run the plan (``_run``), refresh derived tensors, share the figures
        and this rank's phases (one all-reduce)."""
        clock = received.clock
        mine = self._run(found, recv_req, bound, data, clock)
        refresh = True
        # pr: scale
        refresh = received.payload.kind != PayloadKind.DESCRIBE  # it wrote nothing
        # pr: scale end
        if refresh:
            # Tensors computed from parameters in weight loaders (Gemma norms) are refreshed here, those
            # computed by post-load processing (MLA's w_kc/w_vc) by end_weight_update(); both in place.
            with clock.phase(Phase.REFRESH):
                refresh_derived(model)
        clock.count(Count.ROUND_TRIPS, self.control.round_trips - trips + 1)
        with clock.phase(Phase.CONTROL):
            return self.control.share_figures(
                [*mine, *clock.to_wire()],
                bound,
                f"sharing the update's figures with the other TP ranks "
                f"({self.control.size} ranks)",
            )

    # ---------------------------------------------------------------- step 3

    def end(self, recv_req, success: bool, message: str) -> Tuple[bool, str]:
        """Upstream's closing barrier, bounded by the update's bound: a peer that never comes
        fails the update here, named (every write had ended if it succeeded so far). Skipped
        once a wait of this update failed: the update has failed, and the group is not used
        again (its peers' own closing barrier then fails, so every rank renews it)."""
        if self.control.lost:
            return success, message
        try:
            self.control.barrier(
                _timeout(recv_req) + GRACE_S,
                f"engine rank {self.rank}: at the end of the update",
            )
        except PeerLost as e:
            logger.error("distributed weight update %s: %s", recv_req.update_id, e)
            return (
                False,
                f"{message}; {e}"
                if not success
                else f"distributed weight update failed: {e}",
            )
        return success, message


# -------------------------------------------------------------------- the hooks


def receive_shards(recv_req, owner) -> ReceivedShards:
    """Step 1 on this TP rank, with the weight sync ``owner`` keeps (the tp worker, or the
    model runner on older releases: both hold the model's config)."""
    return EngineWeightSync.of(owner).receive(recv_req, owner.model_config)


# pr: safety
def release_data_group(owner) -> None:
    """SGLang's memory saver released the engine's memory (``release_memory_occupation``):
    the weight sync's data group goes too (``drop_data_group``: NCCL's communicator and its
    buffers on the GPU, which the memory saver does not hold); the next update that executes
    a plan makes a new one on every TP rank. ``owner``: what keeps the weight sync, as for
    ``receive_shards``; nothing happens where no update ran."""
    sync = getattr(owner, "_weight_sync", None)
    if sync is not None:
        sync.drop_data_group()


# pr: safety end
def header_bound(targets: Optional[DerivedTargets]) -> HeaderBound:
    """The payload header bound of an engine with ``targets`` (``HeaderBound``): its HF
    tensors and their aliases, or the parameters of its largest rank, whichever are more;
    the fixed part alone while its targets are unknown (their derivation failed: the
    update is refused anyway)."""
    if targets is None:
        return HeaderBound()
    params = max((len(t) for t in targets.per_rank), default=0)
    return HeaderBound(max(len(targets.shapes) + len(targets.aliases), params))


def apply_shards(
    model: torch.nn.Module, model_config, received: ReceivedShards, recv_req
) -> Tuple[bool, str]:
    """Step 2 on this TP rank, for one model runner."""
    return received.sync.apply(model, model_config, received, recv_req)


def end_of_update(
    received: ReceivedShards, recv_req, success: bool, message: str
) -> Tuple[bool, str]:
    """Step 3: the scheduler's last step of an update on every TP rank; the payload is
    released here, before the reply. Logs this rank's phases (one line)."""
    received.release()
    with received.clock.phase(Phase.CONTROL):
        success, message = received.sync.end(recv_req, success, message)
    logger.info(
        "distributed weight update %s, engine rank %d, %s: %s",
        recv_req.update_id,
        received.sync.rank,
        "applied" if success else "not applied",
        describe_phases(received.clock.snapshot()),
    )
    return success, message


def _sources(
    payload: Payload,
    targets: DerivedTargets,
    # pr: scale
    kept: Optional[Dict[str, torch.dtype]] = None,
    # pr: scale end
):
    """Source layout from the payload's specs, and the local buffers it reads (by key);
    refuses names and shapes the model does not have, tensors SGLang's loader does not
    copy (quantised, computed: an update cannot write them) and non-finite values."""
    sources = _described(payload, targets)
    # pr: scale
    # a tensor the trainer cast to a dtype the engine does not keep it in (``kept``:
    # ``wire_dtypes``) is refused too
    cast = _cast_problems(payload, kept or {})
    if cast:
        raise ValueError(cast[0] + (f" (and {len(cast) - 1} more)" if cast[1:] else ""))
    # pr: scale end
    bad = nonfinite_tensors(
        payload.tensors,
        # pr: scale
        payload.runs,
        # pr: scale end
    )
    if bad:
        raise ValueError(
            f"tensor {bad[0]!r}: the shard from trainer rank {payload.trainer_rank} holds NaN or inf "
            "values (refused: an update never writes non-finite weights)"
        )
    return sources, payload.tensors


# pr: scale
def _cast_problems(payload: Payload, kept: Dict[str, torch.dtype]) -> List[str]:
    """``cast_problems`` of ``payload`` against the dtypes this engine keeps, kept in the
    payload's layout memo for a payload in a shared-memory segment: there its layout
    fixes every tensor's dtype (the header's placements), so the same layout and the same
    ``kept`` give the same answer, read once instead of per tensor every update."""
    memo = payload.layout_memo if payload.runs is not None else None
    key = _layout_key(payload, "cast", payload.trainer_rank)
    known = memo.get(key) if memo is not None else None
    if known is not None and known[0] is kept:
        return known[1]
    held = {n: s.dtype for n, s in payload.specs.items() if isinstance(s, MeshSpec)}
    found = cast_problems(payload.tensors, held, kept, payload.trainer_rank)
    if memo is not None:
        memo[key] = (kept, found)
    return found


# pr: scale end
def _layout_key(payload: Payload, *rest) -> tuple:
    """A key of ``payload.layout_memo`` for what follows from the layout, the rank map (it
    travels in the head) and ``rest``."""
    return (tuple(sorted(payload.rank_map.items())), *rest)


def _described(payload: Payload, targets: DerivedTargets) -> SourceLayout:
    """The payload's source layout, checked against ``targets``: kept in the payload's
    layout memo (with the targets it was checked against), so an unchanged layout is
    described and checked once."""
    memo = payload.layout_memo if payload.layout_memo is not None else {}
    key = _layout_key(payload, "sources", id(targets))
    known = memo.get(key)
    if known is not None and known[0] is targets:
        return dict(known[1])
    expected = targets.tensor_shapes()
    sources = {}
    for name, spec in payload.specs.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        canonical = targets.aliases.get(name, name)
        if canonical not in expected:
            raise KeyError(f"unknown tensor {name!r}: not a weight of this model")
        if canonical in targets.not_copied:
            raise ValueError(
                f"tensor {name!r} is not a copy in SGLang's loader: {targets.not_copied[canonical]}"
            )
        if spec.shape != expected[canonical]:
            raise ValueError(
                f"tensor {name!r}: global shape {spec.shape}, the model expects {expected[canonical]}"
            )
        if not spec.dtype.is_floating_point:
            raise ValueError(
                f"tensor {name!r}: dtype {spec.dtype} cannot be cast to the model's floating dtype"
            )
        sources[name] = spec.describe(name, payload.rank_map)
    memo[key] = (targets, sources)
    return dict(sources)


def _timeout(recv_req) -> float:
    try:
        return check_timeout(recv_req.timeout_s)
    except (
        DeliveryError
    ):  # already refused by request_problems; still bound the collectives
        return DEFAULT_TIMEOUT_S
