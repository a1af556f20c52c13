"""The engine end of a weight-sync group: an SGLang engine on other GPUs or hosts than the trainer.

Each engine TP rank (its scheduler process) keeps one ``RemoteEngineSync``, made on the
first request and held by the tp worker; it goes with it. The hooks hand it the requests
(``scheduler_step``), every TP rank in the same scheduler iteration:

* join (``JoinWeightSyncGroupReqInput``): the rank derives its engine's targets (the same
  derivation, provenance check and manifest as the colocated path, ``engine_update``),
  meets every member of the epoch in the trainer's store (rank ``rank_offset + TP rank``),
  hears the membership and publishes the engine's layout (its first TP rank) through the
  group (``remote.group.SyncGroup``). A group of the same name held from an earlier epoch
  is released first: an engine that restarted, or whose trainer restarted, just joins.
* update, in the steps the tokenizer manager sends (``remote.protocol.UpdateStep``):
  ``receive`` starts a thread that takes part in the group's update and receives this
  rank's regions into staging (``Staging``, at most ``staging_bytes``) while the scheduler
  goes on serving; ``status`` tells how far every TP rank is (one small all-reduce over the
  TP group); ``apply``, under the tokenizer manager's writer lock and between batches,
  commits as the colocated path does (``commit_vote.commit_to_write``: engine rank 0
  records the update's outcome in the directory the tokenizer manager names, so an update
  the tokenizer manager gave up on is never written), writes the staged regions into the live parameters (and streams the rest when the
  staging was too small to hold the rank's share; blocks a trainer rank quantized land as
  e4m3 and scales, ``fp8_wire``), refreshes what SGLang derives from
  them, and reports the figures. A failure before the first write leaves the old weights
  serving; after it, the reply says ``mixed`` and the tokenizer manager refuses generation
  until an update succeeds, as on the colocated path.
* leave (``LeaveWeightSyncGroupReqInput``): the groups, the store connection and the
  receiving thread are released.
* An update of a group that failed or was refused on this rank leaves it ``stale``: the
  group's next delta update is refused before any byte moves (a trainer that does not hear
  the engines' answers committed its snapshot anyway), until a join or a full update.
* A block-FP8 engine in a group that runs delta updates keeps, per membership, the bf16
  staging of the pieces it quantizes itself (``delta_rounds.KeptStaging``, host memory:
  2 bytes per element of the blocks a trainer shard edge cuts) as the next delta's base;
  written after each successful pause, let go on a failure, a refusal, when the group
  stops running deltas, and when the engine leaves.

The engine never dies of a request: every exception becomes ``success=False`` naming the
rank and phase.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from sglang.srt.weight_sync.apply import (
    nonfinite_tensors,
    refresh_derived,
    release_cached_memory,
    synchronize,
)
from sglang.srt.weight_sync.commit_vote import commit_to_write
from sglang.srt.weight_sync.control_plane import (
    GRACE_S,
    ControlGroup,
    PeerLost,
)
from sglang.srt.weight_sync.delta_rounds import DeltaFigures, KeptStaging
from sglang.srt.weight_sync.engine_layout import EngineLayout
from sglang.srt.weight_sync.executor import (
    Deferred,
    Landing,
    PackLanding,
    write_landings,
    write_zero_fills,
)
from sglang.srt.weight_sync.fp8_staging import Fp8Staging
from sglang.srt.weight_sync.fp8_wire import QuantizedLanding
from sglang.srt.weight_sync.manifest import ManifestError
from sglang.srt.weight_sync.phase_timing import collector_paused
from sglang.srt.weight_sync.protocol import MIXED, REFUSED
from sglang.srt.weight_sync.remote.group import (
    GroupRefusal,
    SyncGroup,
    UpdateResult,
    check_specs_against,
)
from sglang.srt.weight_sync.remote.protocol import (
    DEFAULT_STAGING_BYTES,
    DELTA_REPLY_FIGURES,
    REMOTE_FIGURES,
    ReceiveState,
    UpdateStep,
    join_problems,
    leave_problems,
    update_problems,
)
from sglang.srt.weight_sync.remote.rendezvous import open_store
from sglang.srt.weight_sync.sglang_compat import (
    field_names,
    settle_weight_update,
    tp_state,
    weights_released,
)
from sglang.srt.weight_sync.staging_budget import staging_cap

# isort: split
# pr: here
from sglang.srt.weight_sync.apply import run_post_load
from sglang.srt.weight_sync.sglang_compat import has_weight_update_sessions

# pr: here end

__all__ = ("Receive", "RemoteEngineSync", "Staging", "scheduler_step", "write_staged")

logger = logging.getLogger(__name__)


class Staging(Deferred):
    """Where one rank's regions wait between the round that received them and the pause
    that writes them: at most ``cap`` bytes (a round is admitted into empty staging
    whatever its size; rounds are at most half a bucket). A full staging makes the
    receiving thread wait, at most ``timeout_s``, for the pause to drain it. Each round's
    regions are checked for NaN/inf as they land, in the receiving thread while the engine
    serves (``nonfinite``), so the pause holds only the writes and the agreement steps."""

    def __init__(self, cap: int, timeout_s: float, who: str) -> None:
        self.cap, self.timeout_s, self.who = cap, timeout_s, who
        self.held = self.peak = 0
        self.full = False
        self.nonfinite = False  # a region that landed holds NaN or inf
        self.done = False
        self.queue: List[Landing] = []
        self.cond = threading.Condition()

    def reserve(self, nbytes: int) -> None:
        with self.cond:
            if self.held and self.held + nbytes > self.cap:
                self.full = True
                if not self.cond.wait_for(
                    lambda: not self.held or self.held + nbytes <= self.cap,
                    self.timeout_s,
                ):
                    raise PeerLost(
                        f"{self.who}: its staging ({self.cap} bytes) was not written within "
                        f"{self.timeout_s:g}s (no pause came to write it)"
                    )
                self.full = False

    def landed(
        self, landings: List[Union[Landing, PackLanding, QuantizedLanding]]
    ) -> None:
        bad = not self.nonfinite and bool(
            nonfinite_tensors(
                {f"{i}.{j}": v for i, x in enumerate(landings) for j, v in _values(x)}
            )
        )
        with self.cond:
            self.nonfinite = self.nonfinite or bad
            self.queue.extend(landings)
            self.held += sum(x.nbytes for x in landings)
            self.peak = max(self.peak, self.held)
            self.cond.notify_all()

    def finish(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def take(self, timeout_s: float) -> Optional[List[Landing]]:
        """What landed since the last take; [] once receiving ended and all was taken; None
        when nothing came within ``timeout_s``."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.queue or self.done, timeout_s):
                return None
            out, self.queue = self.queue, []
            return out

    def written(self, nbytes: int) -> None:
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()


class Receive:
    """One update's receiving on this rank, in a thread of its own, on the group's device
    (the engine rank's GPU, made current in the thread); a block-FP8 engine's staged
    weights (``fp8``), quantized once the pause wrote every region, and the base of their
    pieces it keeps between the updates of a delta group (``kept``)."""

    def __init__(
        self,
        group: SyncGroup,
        staging: Staging,
        check,
        params,
        timeout_s,
        fp8: Optional[Fp8Staging] = None,
        kept: Optional[KeptStaging] = None,
    ):
        self.group, self.staging, self.fp8 = group, staging, fp8
        self.kept = kept if fp8 is not None else None
        if fp8 is not None:  # a delta of quantized blocks reads their e4m3 and scales
            params = {**params, **fp8.live}
        self.result: Optional[UpdateResult] = None
        self.error: Optional[str] = None
        self.refused = False  # this rank's thread raised ``GroupRefusal``
        # some TP rank's did (``status``): every member of the group refused the update
        # before any byte moved, this rank's thread too (or it is about to)
        self.group_refused = False
        self.started = time.monotonic()
        self.seconds = 0.0
        self.thread = threading.Thread(
            target=self._run,
            args=(check, params, timeout_s),
            name="weight-sync-receive",
            daemon=True,
        )
        self.thread.start()

    def _run(self, check, params, timeout_s) -> None:
        try:
            # a new thread's current GPU is GPU 0: the group's first collective would make
            # a CUDA context there in every scheduler process, and move data on the wrong GPU
            device = self.group.data.device
            if device.type == "cuda":
                torch.cuda.set_device(device)
            with collector_paused():
                self.result = self.group.run_update(
                    None, timeout_s, check, params, self.staging, kept=self.kept
                )
        except GroupRefusal as e:
            self.refused, self.error = True, str(e)
        except Exception as e:  # noqa: BLE001 - a dead or stuck peer, named; never the scheduler's death
            self.error = f"{self.group.who}: {type(e).__name__}: {e}"
            logger.error("weight sync: receiving failed: %s", self.error)
        finally:
            self.seconds = time.monotonic() - self.started
            self.staging.finish()

    @property
    def state(self) -> ReceiveState:
        if self.error is not None:
            return ReceiveState.FAILED
        if self.result is not None:
            return ReceiveState.DONE
        return ReceiveState.FULL if self.staging.full else ReceiveState.RECEIVING


@dataclass
class _Member:
    """This rank's membership of one group (by name): its epoch's ``SyncGroup`` and the
    store connection it was made in."""

    group: SyncGroup
    store: object
    derived: object  # the engine's derived targets (target_cache)
    # a block-FP8 engine's base for the pieces it quantizes itself, in a delta group
    kept: KeptStaging = field(default_factory=KeptStaging)

    def close(self) -> None:
        self.group.close()
        self.store = None
        self.kept.clear()


class RemoteEngineSync:
    """One engine TP rank's memberships of weight-sync groups and its update in flight."""

    def __init__(self, rank: int, layout: Optional[EngineLayout] = None) -> None:
        self.rank = rank
        # targets, their provenance check, live dtypes and manifest (shared with the
        # colocated path: derived and checked once, whichever path updates the engine)
        self.layout = layout if layout is not None else EngineLayout(rank)
        self.members: Dict[str, _Member] = {}
        self.receiving: Optional[Tuple[str, Receive]] = None
        # per group: why this rank's parameters may differ from what the trainer last
        # delivered (an update of it failed or was refused here); a delta is refused until
        # a full update succeeds or a new epoch forms (``stale_problems``)
        self.stale: Dict[str, str] = {}
        self._control: Optional[ControlGroup] = None

    @classmethod
    def of(cls, owner) -> RemoteEngineSync:
        sync = getattr(owner, "_remote_weight_sync", None)
        if sync is None:
            rank = tp_state().rank
            sync = owner._remote_weight_sync = cls(rank, EngineLayout.of(owner, rank))
        return sync

    @property
    def control(self) -> ControlGroup:
        """The control collectives over the engine's TP ranks (status and apply agree through
        it), on a gloo group of their own, as the colocated path's (``EngineWeightSync``):
        never SGLang's TP CPU group, which a wait given up on would leave out of step for
        serving. Made on first use, by every TP rank in the same step."""
        if self._control is None:
            self._control = ControlGroup(
                tp_state().cpu_group, "remote-engine", own=True
            )
        return self._control

    # ------------------------------------------------------------------ join / leave

    def join(self, worker, req) -> Tuple[bool, str]:
        """Join epoch ``req.epoch`` of group ``req.group_name`` (every TP rank together);
        ``worker``: the tp worker, which keeps the engine's layout (``EngineLayout``)."""
        runner = worker.model_runner
        problems = join_problems(req)
        if problems:
            return False, f"engine rank {self.rank}: " + "; ".join(problems)
        self.leave_group(req.group_name)
        bound = req.timeout_s + GRACE_S
        layout = self.layout
        derived, problem, fp8_weights = None, None, 0
        try:
            derived = layout.derived(
                runner.model_config,
                functools.partial(
                    self.control.share_bytes,
                    timeout_s=bound,
                    phase="exchanging derived targets with the other TP ranks",
                ),
            )
            checked = layout.provenance_problems(runner.model, derived)
            live = layout.live(runner.model, derived, block_fp8=True)
            manifest, fp8_weights = live.manifest, live.block_fp8_weights
            problem = "; ".join(checked) or None
        except Exception as e:  # noqa: BLE001 - published to every member, then refused
            logger.exception("engine rank %d: deriving its targets failed", self.rank)
            manifest, problem = (
                None,
                f"engine rank {self.rank}: {type(e).__name__}: {e}",
            )
        rank = req.rank_offset + self.rank
        try:
            store = open_store(
                req.master_address, req.master_port, False, req.timeout_s
            )
            group = SyncGroup(
                req.group_name,
                req.epoch,
                req.world_size,
                req.backend,
                rank,
                store,
                req.timeout_s,
            )
        except Exception as e:  # noqa: BLE001 - the trainer is told by its own bounded wait
            return False, (
                f"engine rank {self.rank} (group rank {rank}) could not join group "
                f"{req.group_name!r} epoch {req.epoch} at {req.master_address}:{req.master_port}: "
                f"{type(e).__name__}: {e}"
            )
        try:
            membership = group.hear_membership(None, bound)
            member = membership.engine_of(rank)
            if member is None or member.offset != req.rank_offset:
                raise ManifestError(
                    f"group rank {rank} is not this engine's place in {membership.legend()}"
                )
            group.exchange_layouts(
                manifest if self.rank == 0 else None,
                problem if self.rank == 0 else None,
                bound,
                fp8_weights,  # a delta report names the engines that have any
            )
        except Exception as e:  # noqa: BLE001 - every member hears the same refusal
            group.close()
            return False, f"{group.who}: {type(e).__name__}: {e}"
        if problem:
            group.close()
            return False, problem
        self.members[req.group_name] = _Member(group, store, derived)
        self.stale.pop(req.group_name, None)  # a new epoch: its first update is full
        logger.info("weight sync: %s joined %s", group.who, membership.legend())
        return True, f"joined {membership.legend()} as {group.who}"

    def leave_group(self, name: str) -> bool:
        """Release group ``name`` (its process groups, the store connection) and give up an
        update of it in flight (its thread ends as its waits fail). True if it was held."""
        member = self.members.pop(name, None)
        if member is None:
            return False
        member.close()
        if self.receiving is not None and self.receiving[0] == name:
            self.receiving = None
        return True

    def leave(self, req) -> Tuple[bool, str]:
        problems = leave_problems(req)
        if problems:
            return False, "; ".join(problems)
        held = self.leave_group(req.group_name)
        return True, (
            f"engine rank {self.rank} left group {req.group_name!r}"
            if held
            else f"engine rank {self.rank} held no group {req.group_name!r}"
        )

    def close(self) -> None:
        for name in list(self.members):
            self.leave_group(name)

    # ------------------------------------------------------------------ an update

    def receive(self, worker, req) -> Tuple[bool, str]:
        """Start receiving this rank's regions of the group's next update into staging."""
        problems = update_problems(req)
        member = self.members.get(req.group_name)
        if member is None:
            problems.append(
                f"engine rank {self.rank} is in no weight-sync group {req.group_name!r} "
                "(join_weight_sync_group first)"
            )
        if self.receiving is not None and self.receiving[1].thread.is_alive():
            problems.append(
                f"engine rank {self.rank}: an update is already being received"
            )
        if self._control is not None and self._control.lost:
            problems.append(
                f"a wait among the engine's TP ranks failed in an earlier update "
                f"({self._control.lost}): restart the engine"
            )
        if problems:
            return False, f"{REFUSED}engine rank {self.rank}: " + "; ".join(problems)
        # an earlier update received, never applied nor aborted (a step left unanswered)
        earlier = self.receive_of(req)
        if earlier is not None:
            self._mark_stale(req.group_name, earlier, "it was never applied")
        model = worker.model_runner.model
        live = self.layout.live(model, member.derived, block_fp8=True)
        targets, params = live.targets, live.params
        who = member.group.who
        refusals = self.layout.refusals(model)
        fp8 = Fp8Staging.of(live, self.rank, _device_of(params), who)
        cap, cut = staging_cap(
            req.staging_bytes or DEFAULT_STAGING_BYTES, member.group.data.device
        )
        if cut:
            logger.info("%s: %s", who, cut)

        def check(header, specs) -> List[str]:
            problems = check_specs_against(
                specs,
                targets.tensor_shapes(),
                targets.aliases,
                targets.not_copied,
                who,
            )
            problems += refusals
            if fp8 is not None:  # block FP8: pieces cutting a block
                problems += fp8.check(specs)
            if req.update_id is not None and req.update_id != header.update_id:
                problems.append(
                    f"{who}: asked to take part in update {req.update_id!r}, the trainer runs "
                    f"{header.update_id!r}"
                )
            return problems + self.stale_problems(req.group_name, header, who)

        receive = Receive(
            member.group,
            Staging(cap, req.timeout_s, who),
            check,
            params,  # checked against the plan only: the FP8 weights have the staged shapes
            req.timeout_s,
            fp8,
            member.kept,
        )
        self.receiving = (req.group_name, receive)
        return True, f"{who}: receiving"

    def status(self, req) -> Tuple[ReceiveState, str]:
        """Every TP rank's receive, combined (the worst wins) with every rank's error."""
        mine = self.receive_of(req)
        state = mine.state if mine is not None else ReceiveState.IDLE
        bound = req.timeout_s + GRACE_S
        states, refused = self.control.share_figures(
            [int(state), int(mine is not None and mine.refused)],
            bound,
            f"engine rank {self.rank}: sharing how far receiving is",
        )
        if mine is not None and any(refused):
            mine.group_refused = True
        worst = ReceiveState(max(states))
        if ReceiveState.IDLE in states:
            worst = ReceiveState.FAILED
        if worst != ReceiveState.FAILED:
            ready = all(s in (ReceiveState.FULL, ReceiveState.DONE) for s in states)
            return (ReceiveState.DONE if ready else ReceiveState.RECEIVING), ""
        if mine is None:
            why = [f"engine rank {self.rank}: no update is being received"]
        else:
            why = [mine.error] if mine.error else []
        errors = self.control.share_problems(
            why, bound, f"engine rank {self.rank}: sharing why receiving failed"
        )
        return ReceiveState.FAILED, (REFUSED if any(refused) else "") + "; ".join(
            errors
        )

    def stale_problems(self, name: str, header, who: str) -> List[str]:
        """A delta update of group ``name`` refused while this rank's parameters may differ
        from what the trainer last delivered: a trainer that does not hear the engines'
        answers (``drive=False``: verl's rollout workers send them) commits its snapshot
        whenever its rounds succeed, so the engine says it. Refused before any byte
        moves; the trainer's next update forms a new epoch, which starts full."""
        why = self.stale.get(name)
        if not header.delta or why is None:
            return []
        return [
            f"{who}: refuses delta update {header.update_id!r}: its parameters may differ "
            f"from what the trainer last delivered ({why}); a full update must come first"
        ]

    def _mark_stale(self, name: str, mine: Optional[Receive], why: str) -> None:
        member = self.members.get(name)
        if member is not None:  # what it kept may not be what the trainer delivered
            member.kept.clear()
        result = mine.result if mine is not None else None
        update = result.header.update_id if result is not None else "an update"
        self.stale[name] = f"{update} of group {name!r} failed here: {why[:300]}"

    def receive_of(self, req) -> Optional[Receive]:
        if self.receiving is None or self.receiving[0] != req.group_name:
            return None
        return self.receiving[1]

    @collector_paused()
    def apply(self, worker, req) -> Tuple[bool, str, bool, Dict[str, List[int]]]:
        """Write the staged regions into the live parameters (every TP rank together, in the
        pause): (success, message, mixed, figures per TP rank)."""
        mine = self.receive_of(req)
        bound = req.timeout_s + GRACE_S
        runner = worker.model_runner
        layout = self.layout
        started = time.monotonic()
        wrote, error = False, None
        params = {}
        if mine is None:
            error = f"engine rank {self.rank}: no update is being received"
        elif mine.error is not None:
            error = mine.error
        else:
            member = self.members[req.group_name]
            params = layout.live(runner.model, member.derived, block_fp8=True).params
            if mine.fp8 is not None:  # the plan lands block-FP8 pieces in staging
                params = mine.fp8.params(params)
            # every round is in (checked as it landed): refuse it before any write
            if mine.result is not None and mine.staging.nonfinite:
                error = (
                    f"{mine.group.who}: the regions received hold NaN or inf values "
                    "(refused: an update never writes non-finite weights)"
                )
        before = self.control.share_problems(
            [error] if error else [],
            bound,
            f"engine rank {self.rank}: agreeing to write the received weights",
        )
        if before:
            self._mark_stale(req.group_name, mine, "; ".join(before))
            self._done(mine)
            return False, REFUSED + "; ".join(before), False, {}
        why, mixed = commit_to_write(
            self.control, self.rank, req.outcome_channel, req.outcome_id, bound
        )
        if why is not None:
            self._mark_stale(req.group_name, mine, why)
            self._done(mine)
            return False, why, mixed, {}
        try:
            wrote = write_staged(mine, params, req.timeout_s)
            refresh_derived(runner.model)
            # pr: here
            if wrote and not has_weight_update_sessions():
                run_post_load(runner.model)  # no session end runs them on this release
            # pr: here end
            synchronize(params.values())
            release_cached_memory(params.values())
        except Exception as e:  # noqa: BLE001 - a peer died mid-stream or a copy failed
            logger.exception(
                "engine rank %d: writing the received weights failed", self.rank
            )
            error = f"{mine.group.who}: {type(e).__name__}: {e}"
        applied_us = int((time.monotonic() - started) * 1e6)
        result = mine.result
        mine_figures = [
            result.stats.bytes_received if result else 0,
            result.lower_bound_bytes(mine.group.rank) if result else 0,
            mine.staging.peak,
            int(mine.seconds * 1e6),
            applied_us,
            result.delta.decode_us if result is not None and result.delta else 0,
        ]
        # a delta update's figures (zeros when it carried no delta records: every rank
        # of the engine heard the same header, so all or none of them carry some)
        records = result is not None and result.header.delta
        delta = result.delta if records and result.delta else DeltaFigures()
        mine_figures += delta.reply_ints()
        self._done(mine)
        after = self.control.share_problems(
            [error] if error else [],
            bound,
            f"engine rank {self.rank}: sharing how writing went",
        )
        table = self.control.share_figures(
            mine_figures + [int(wrote)],
            bound,
            f"engine rank {self.rank}: sharing the update's figures",
        )
        figures = dict(zip(REMOTE_FIGURES, table))
        if records:
            figures["delta"] = dict(
                zip(DELTA_REPLY_FIGURES, table[len(REMOTE_FIGURES) : -1])
            )
        if after:
            self._mark_stale(req.group_name, mine, "; ".join(after))
            mixed = any(table[-1])
            message = "; ".join(after)
            if mixed:
                message = (
                    f"remote weight update FAILED after writes began: {message}: {MIXED} (some "
                    "parameters new, some old); generation is refused until a weight update "
                    "succeeds"
                )
            return False, message, mixed, figures
        logger.info(
            "remote weight update %s, %s: received %d bytes (lower bound %d), staged at most %d, "
            "receiving %.3fs while serving, writing %.3fs in the pause; keeps %d bytes of "
            "block-FP8 staging in host memory as the next delta's base",
            result.header.update_id,
            mine.group.who,
            mine_figures[0],
            mine_figures[1],
            mine_figures[2],
            mine_figures[3] / 1e6,
            applied_us / 1e6,
            mine.kept.nbytes if mine.kept is not None else 0,
        )
        self.stale.pop(req.group_name, None)
        return True, "Success", False, figures

    def _done(self, mine: Optional[Receive]) -> None:
        if self.receiving is not None and self.receiving[1] is mine:
            self.receiving = None

    def abort(self, req) -> None:
        """Give up the group's receive: its data group is abandoned now (on NCCL the
        thread's pending round ends at once, on gloo at its bound), and a receive whose
        thread still runs stays known, so that no new receive starts beside it (``receive``
        refuses while it runs; the trainer forms a new epoch after a failed update). A
        receive the group refused by agreement (``GroupRefusal``: every member, before
        any byte moved) never used the data group: it is kept, and so is the epoch. That
        is known on every TP rank once ``status`` has shared it, also on a rank whose
        thread has yet to raise the refusal (it is past the agreement's collective)."""
        mine = self.receive_of(req)
        if mine is None:
            return
        self._mark_stale(req.group_name, mine, mine.error or "its receive was aborted")
        if mine.refused or mine.group_refused:
            mine.thread.join(GRACE_S)  # it ends as its refusal is raised
            if not mine.thread.is_alive():
                self._done(mine)
                return
        mine.group.data.abandon()
        if not mine.thread.is_alive():
            self._done(mine)


def write_staged(mine: Receive, params: Mapping[str, torch.Tensor], timeout_s) -> bool:
    """The pause's writes on one rank: every staged region as it comes (a share larger than
    the staging streams in: the receiving thread refills what each write frees, so a round
    is written while the next is on the wire), until receiving ended, then the zero fills;
    then a block-FP8 engine's delivered blocks are quantized from their staging into the
    live weights and scales (``fp8_staging``), the staging of their pieces kept first as
    the next delta's base when the group runs deltas (``KeptStaging``, else let go).
    Whether anything was written."""
    wrote = False
    while True:
        landings = mine.staging.take(timeout_s)
        if landings is None:
            raise PeerLost(
                f"{mine.group.who}: no region arrived within {timeout_s:g}s while writing"
            )
        if not landings:
            break
        plain = [x for x in landings if isinstance(x, (Landing, PackLanding))]
        written = write_landings(params, plain) if plain else 0
        quantized = [x for x in landings if isinstance(x, QuantizedLanding)]
        if quantized:  # e4m3 and scales, straight into the live weights
            written += mine.fp8.land(quantized)
        mine.staging.written(written)
        wrote = True
    if mine.error is not None:
        if mine.kept is not None:  # a failed or refused update: no base any more
            mine.kept.clear()
        raise RuntimeError(mine.error)
    plan = mine.result.plan
    write_zero_fills(plan, mine.group.rank, params)
    if mine.kept is not None:
        if mine.result.header.keep_base:
            mine.kept.keep(plan, mine.group.rank, params, mine.result.staged)
        else:
            mine.kept.clear()
    if wrote and mine.fp8 is not None:
        # every element of every block not sent quantized has met in staging
        mine.fp8.quantize(mine.result.fp8, mine.group.rank)
    return wrote or bool(plan.zero_fills)


def _values(
    x: Union[Landing, PackLanding, QuantizedLanding],
) -> Iterable[Tuple[int, torch.Tensor]]:
    """What a landing's NaN/inf check reads, numbered: its region, a pack's runs of
    regions, or the scales of quantized blocks (a non-finite value in a block makes its
    scale non-finite)."""
    if isinstance(x, QuantizedLanding):
        return ((0, x.scales),)
    if isinstance(x, PackLanding):
        return enumerate(x.runs())
    return ((0, x.buf),)


def _device_of(params: Mapping[str, torch.Tensor]) -> torch.device:
    """The device of the engine rank's parameters (where its staging goes)."""
    return next(iter(params.values())).device


# -------------------------------------------------------------------- the hook


def scheduler_step(manager, recv_req):
    """A weight-sync group request on this TP rank (``manager``: the scheduler's weight
    updater on 0.5.23, the scheduler itself on older releases; its ``tp_worker`` keeps the
    ``RemoteEngineSync``). Join, leave and the update's steps; the apply step runs inside a
    weight-update session where the release has them (a one-shot one when none is open),
    then records the weight version and flushes the cache, as SGLang's own updates do."""
    from sglang.srt.managers import io_struct

    worker = manager.tp_worker
    sync = RemoteEngineSync.of(worker)
    kind = type(recv_req).__name__
    try:
        if kind == "JoinWeightSyncGroupReqInput":
            success, message = sync.join(worker, recv_req)
            return io_struct.JoinWeightSyncGroupReqOutput(
                success=success, message=message
            )
        if kind == "LeaveWeightSyncGroupReqInput":
            success, message = sync.leave(recv_req)
            return io_struct.LeaveWeightSyncGroupReqOutput(
                success=success, message=message
            )
        return _update_step(manager, sync, worker, recv_req)
    except Exception as e:  # noqa: BLE001 - the engine never dies of a request
        logger.exception("engine rank %d: %s failed", sync.rank, kind)
        out = getattr(io_struct, kind.replace("ReqInput", "ReqOutput"))
        return out(
            success=False, message=f"engine rank {sync.rank}: {type(e).__name__}: {e}"
        )


def _update_step(manager, sync: RemoteEngineSync, worker, req):
    from sglang.srt.managers.io_struct import UpdateWeightsRemoteReqOutput
    from sglang.srt.weight_sync.sessions import run_in_session

    step = UpdateStep(req.step)
    if step == UpdateStep.RECEIVE:
        if weights_released(manager):
            return UpdateWeightsRemoteReqOutput(
                success=False,
                message=REFUSED + "weights are released (release_memory_occupation); "
                "call resume_memory_occupation(tags=['weights']) first",
            )
        success, message = sync.receive(worker, req)
        return UpdateWeightsRemoteReqOutput(
            success=success, message=message, state=ReceiveState.RECEIVING.name.lower()
        )
    if step == UpdateStep.STATUS:
        state, message = sync.status(req)
        return UpdateWeightsRemoteReqOutput(
            success=state != ReceiveState.FAILED,
            message=message,
            state=state.name.lower(),
        )
    if step == UpdateStep.ABORT:
        sync.abort(req)
        return UpdateWeightsRemoteReqOutput(success=True, message="aborted")

    def apply(recv_req):
        mine = sync.receive_of(recv_req)
        result = mine.result if mine is not None else None
        update_id = result.header.update_id if result is not None else ""
        success, message, mixed, figures = sync.apply(worker, recv_req)
        if success:
            success, message = settle_weight_update(manager, recv_req, success, message)
        return UpdateWeightsRemoteReqOutput(
            success=success,
            message=message,
            state=ReceiveState.DONE.name.lower() if success else "failed",
            mixed=mixed,
            update_id=update_id,
            **{
                k: v
                for k, v in figures.items()
                if k in field_names(UpdateWeightsRemoteReqOutput)
            },
        )

    if step != UpdateStep.APPLY:
        return UpdateWeightsRemoteReqOutput(
            success=False,
            message=f"step {step.value!r} is the tokenizer manager's, not a scheduler's",
        )
    return run_in_session(manager, apply, req)
