"""The trainer end of a weight-sync group with engines on other GPUs and hosts.

Every trainer rank keeps one ``RemoteSync`` per group (made with the same arguments on
every rank). The trainer's first rank hosts the group's TCP store at ``(address, port)``
and is the only rank that talks to the engines (``EngineEndpoint``: an HTTP server, or an
``Engine`` in this process); the other trainer ranks hear what it decided through the
trainer's own process group.

* ``join`` forms a new membership epoch: the first rank asks every engine that answers
  to join (``/join_weight_sync_group``), every trainer rank and every engine TP rank meet
  in the store, and every engine's layout reaches every member (``SyncGroup``).
* ``update`` (named tensors: DTensor shards or full tensors), ``update_sources`` (any
  source layout) and ``update_megatron`` (Megatron-core model chunks): the first rank
  asks every engine to take part (``/update_weights_remote``; an engine receives into
  staging while it serves and writes in a short pause), and every trainer rank sends its
  own regions, cast to the engine's dtype, straight to the engine ranks that need them
  (``SyncGroup.run_update``). Every trainer rank returns the same ``RemoteReport``, or
  raises the same ``RemoteSyncError``.
* After a failed update (an engine or a trainer rank died, a wait ran out), the epoch is
  dropped; the next update forms a new one with the engines that still answer, so a dead
  engine leaves and the others go on; an engine restarted joins again with ``join``.
* ``delta=True``: every trainer rank keeps the engine-dtype values it last delivered
  (``delta_rounds.Snapshot``, host memory) and sends each region as what changed since
  (``delta_codec``); the snapshot advances only when every engine answered success, and
  the first update of an epoch, or after any failure, is full (``RemoteReport.delta``
  says which and why). For a block-FP8 engine the delta of the blocks a trainer rank
  quantizes is taken after quantization (e4m3 bytes and scales); the pieces the engine
  quantizes itself (blocks a shard edge cuts) are taken against the bf16 staging the
  engine keeps for them (``RemoteReport.delta["engine_quantized"]``). Every
  ``digest_every``-th update the engines check that they hold what the trainer
  delivered; one that does not refuses, and the next update is full.
* ``leave`` lets one engine go (it releases its groups); ``close`` lets all go and stops
  the store.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.apply import nonfinite_tensors
from sglang.srt.weight_sync.control_plane import (
    ControlGroup,
    PeerLost,
)
from sglang.srt.weight_sync.delta_rounds import (
    RECEIVER_FIGURES,
    DeltaFigures,
    Snapshot,
    delta_summary,
)
from sglang.srt.weight_sync.executor import ExecutionError
from sglang.srt.weight_sync.manifest import EngineManifest, ManifestError
from sglang.srt.weight_sync.phase_timing import (
    Count,
    Phase,
    PhaseClock,
    collector_paused,
    describe_phases,
)
from sglang.srt.weight_sync.protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    GRACE_S,
    MIN_BUCKET_BYTES,
    REFUSED,
    check_timeout,
    trainer_bound_s,
)
from sglang.srt.weight_sync.remote.endpoints import (
    EngineEndpoint,
    HttpEndpoint,
    LocalEndpoint,
    RemoteSyncError,
)
from sglang.srt.weight_sync.remote.group import (
    GroupRefusal,
    SyncGroup,
    TrainerPart,
    UpdateResult,
)
from sglang.srt.weight_sync.remote.protocol import (
    Membership,
    Spec,
    UpdateHeader,
)
from sglang.srt.weight_sync.remote.rendezvous import open_store
from sglang.srt.weight_sync.source_layout import (
    Described,
    HoldersSpec,
    MeshRanks,
    SourceLayout,
)
from sglang.srt.weight_sync.trainer_flow import KeptShards, prepare_shards

__all__ = (
    "EngineEndpoint",
    "HttpEndpoint",
    "LocalEndpoint",
    "RemoteReport",
    "RemoteSync",
    "RemoteSyncError",
    "named_specs",
)

logger = logging.getLogger(__name__)

IGNORED_SUFFIXES = (
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)


def named_specs(
    named_tensors: Iterable[Tuple[str, torch.Tensor]],
    ranks: Optional[MeshRanks] = None,
    kept: Optional[KeptShards] = None,
) -> Tuple[Dict[str, Spec], Dict[str, torch.Tensor]]:
    """Every tensor's layout and this rank's local part (``trainer_flow.prepare_shards``: a
    DTensor's own mesh and shard, never ``full_tensor()``; a plain tensor whole on every
    trainer rank, the default group's). Rotary caches, which SGLang's loaders skip, are
    left out; a name given twice is refused. ``ranks``: the meshes and layouts known so far
    (``RemoteSync.described``), each layout one ``MeshSpec``; ``kept``: the last call's
    answer (``KeptShards``), reused while the same DTensors come."""
    named = [item for item in named_tensors if not item[0].endswith(IGNORED_SUFFIXES)]
    names = list(map(_NAME, named))
    if len(set(names)) != len(names):
        seen = set()
        for name in names:
            if name in seen:
                raise ValueError(f"tensor {name!r} is named twice in one update")
            seen.add(name)
    shards = prepare_shards(named, ranks, kept)
    local = list(map(_LOCAL_OF, shards))
    # the tensors themselves unless autograd tracks them: the same objects every update
    # keep ``executor.check_inputs``' memo of the shards found fine
    if any(map(_REQUIRES_GRAD, local)):
        local = [t.detach() if t.requires_grad else t for t in local]
    return dict(zip(names, map(_SPEC_OF, shards))), dict(zip(names, local))


_NAME, _LOCAL_OF, _SPEC_OF = (operator.itemgetter(i) for i in range(3))
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


@dataclass
class RemoteReport:
    """One update as every trainer rank reports it. ``engines``: each engine's reply (its
    per-TP-rank ``bytes_received``, ``lower_bound_bytes``, ``receive_us``, ``apply_us``,
    ``decode_us``, a delta update's own figures under ``delta``: ``remote.protocol.
    delta_reply``, the ``pause_seconds`` its tokenizer manager measured); ``bytes_sent``:
    per trainer rank, in the engines' dtypes (a delta update's: its records); ``seconds``:
    the update's wall time on this rank, and ``phases`` where it went; ``delta``
    (``delta=True``):
    ``delta_rounds.delta_summary``: what travelled (delta, full, or refused before any
    byte), what was planned and why full, bytes on the wire against a full update's and by
    what the records carry (``sent_as``), encoding seconds per trainer rank, densities
    overall and per tensor class, per engine its bytes, densities and decoding seconds per
    TP rank, and whether the next update may be a delta (``next``, ``next_why_full``)."""

    success: bool
    message: str
    update_id: str = ""
    epoch: int = 0
    engines: Dict[str, dict] = field(default_factory=dict)
    bytes_sent: List[int] = field(default_factory=list)
    peak_staging_bytes: List[int] = field(default_factory=list)
    seconds: float = 0.0
    left: List[str] = field(default_factory=list)
    delta: Dict[str, object] = field(default_factory=dict)
    # where this trainer rank's seconds went (``phase_timing``: seconds per phase, then the
    # counters; ``other`` what no phase covered), ``seconds`` their total
    phases: Dict[str, float] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()


class RemoteSync:
    """One trainer rank's side of a weight-sync group (see the module's text). Every trainer
    rank makes it with the same arguments; ``engines`` matter on the first rank only.
    ``backend``: the data group's ("nccl" on GPUs, "gloo" on CPUs; default: NCCL when CUDA
    is available). ``delta``: send what changed since the last update (module text);
    ``digest_every``: how often the engines check their base (1: every update);
    ``snapshot_device``: where the delivered values are kept."""

    def __init__(
        self,
        group_name: str,
        address: str,
        port: int,
        engines: Sequence[EngineEndpoint] = (),
        backend: Optional[str] = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        delta: bool = False,
        digest_every: int = 8,
        snapshot_device: str = "cpu",
    ) -> None:
        if not isinstance(digest_every, int) or digest_every < 1:
            raise ValueError(f"digest_every={digest_every!r}: a positive integer")
        self.group_name, self.address, self.port = group_name, address, port
        self.delta, self.digest_every = bool(delta), digest_every
        self.snapshot = Snapshot(snapshot_device) if delta else None
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = check_timeout(timeout_s)
        self.rank, self.trainers = dist.get_rank(), dist.get_world_size()
        self.world = ControlGroup(None, f"remote-trainer-{group_name}")
        self.engines: Dict[str, EngineEndpoint] = {e.name: e for e in engines}
        self.store = open_store(address, port, self.rank == 0, self.timeout_s)
        self.membership: Optional[Membership] = None
        self.group: Optional[SyncGroup] = None
        self.epoch = 0
        self.updates = 0
        self.broken: Optional[str] = None
        self.left: List[str] = []  # engines that left at the last join (did not answer)
        # a TrainerSync for Megatron coordinates, made on first use
        self._megatron = None
        # the last update's description, its wire form and digest (``update``)
        self.described = Described()
        self.shards = KeptShards()  # ``named_specs``' last answer
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="weight-sync-engines"
        )

    # ------------------------------------------------------------------ membership

    @property
    def manifests(self) -> Dict[str, EngineManifest]:
        return self.group.manifests if self.group is not None else {}

    def add(self, engine: EngineEndpoint) -> None:
        """Count ``engine`` in (first rank; it joins with the next ``join`` or update)."""
        self.engines[engine.name] = engine

    def join(
        self,
        engines: Optional[Sequence[EngineEndpoint]] = None,
        timeout_s: Optional[float] = None,
        membership: Optional[Membership] = None,
    ) -> Membership:
        """Form a new membership epoch (every trainer rank calls it). The first rank asks
        every engine it knows (``engines`` are added) that answers to join; one that does
        not answer, or fails to join, leaves and is named. With ``membership`` (the same on
        every trainer rank) someone else asks the engines (verl's rollout workers), and
        this rank only meets them. Returns the epoch's membership; raises
        ``RemoteSyncError`` on every trainer rank when a member did not join."""
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        for engine in engines or ():
            self.add(engine)
        self._drop_group()
        drive = membership is None
        if drive:
            membership = self._next_membership(timeout_s)
        self.epoch = membership.epoch
        joins = {}
        if self.rank == 0 and drive:
            for member in membership.engines:
                body = membership.join_request(member, timeout_s)
                joins[member.name] = self._pool.submit(
                    self.engines[member.name].join, body, trainer_bound_s(timeout_s)
                )
        problem, group = None, None
        try:
            group = SyncGroup(
                self.group_name,
                membership.epoch,
                membership.world_size,
                membership.backend,
                self.rank,
                self.store,
                timeout_s,
            )
            group.hear_membership(membership, timeout_s)
            group.exchange_layouts(None, None, timeout_s)
        except (PeerLost, ManifestError, RuntimeError) as e:
            problem = f"trainer rank {self.rank}: {e}"
        failed = [
            (name, f"engine {name!r}: {reply.get('message')}")
            for name, reply in self._replies(joins, timeout_s).items()
            if not reply.get("success")
        ]
        for name, _ in failed:
            self.engines.pop(name, None)  # it joins again with join([engine])
        outcome = self.world.share_problems(
            ([problem] if problem else []) + [f for _, f in failed],
            trainer_bound_s(timeout_s) + GRACE_S,
            f"trainer rank {self.rank}: sharing whether every member joined",
        )
        if outcome:
            if group is not None:
                group.close()
            raise RemoteSyncError(
                f"weight-sync group {self.group_name!r} epoch {membership.epoch}: "
                + "; ".join(outcome)
            )
        self.membership, self.group, self.broken = membership, group, None
        logger.info("weight-sync group formed: %s", membership.legend())
        return membership

    def _next_membership(self, timeout_s: float) -> Membership:
        """The next epoch's members, decided by the first rank (every engine it knows that
        answers) and heard by every trainer rank."""
        membership, gone = None, []
        if self.rank == 0:
            present = []
            probes = {
                name: self._pool.submit(engine.alive, timeout_s)
                for name, engine in self.engines.items()
            }  # side by side: one bound for all
            for name, probe in probes.items():
                try:
                    up = probe.result(timeout_s + GRACE_S)
                except Exception:  # noqa: BLE001 - an engine that cannot say is gone
                    up = False
                if up:
                    present.append((name, self.engines[name].tp_size()))
                else:
                    gone.append(name)
                    del self.engines[name]
            membership = Membership.of(
                self.group_name,
                self.epoch + 1,
                self.address,
                self.port,
                self.backend,
                self.trainers,
                present,
            )
        membership, gone = self.world.broadcast_object(
            (membership, gone),
            0,
            timeout_s,
            f"trainer rank {self.rank}: hearing the membership of {self.group_name!r}",
        )
        for name in gone:
            logger.warning(
                "weight-sync group %r: engine %r does not answer; it leaves the group",
                self.group_name,
                name,
            )
        self.left = sorted(set(self.left) | set(gone))
        if not membership.engines:  # an update that reaches no engine is no success
            raise RemoteSyncError(
                f"weight-sync group {self.group_name!r}: no engine to update "
                f"(did not answer within {timeout_s:g}s: {sorted(gone)}); add one with "
                "join([engine])"
            )
        return membership

    def leave(self, name: str, timeout_s: Optional[float] = None) -> None:
        """Let engine ``name`` go (every trainer rank calls it): it releases its groups; the
        others form a new epoch at the next update."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._drop_group()
        if self.rank == 0 and name in self.engines:
            engine = self.engines.pop(name)
            try:
                engine.leave({"group_name": self.group_name}, timeout_s)
            except Exception as e:  # noqa: BLE001 - an engine already gone has nothing to release
                logger.warning("engine %r did not answer leave: %s", name, e)
        self.world.barrier(
            timeout_s, f"trainer rank {self.rank}: engine {name!r} leaving"
        )

    def close(self) -> None:
        """Let every engine go and stop the store (every trainer rank calls it)."""
        for name in sorted(self.engines) if self.rank == 0 else []:
            try:
                self.engines[name].leave(
                    {"group_name": self.group_name}, self.timeout_s
                )
            except Exception as e:  # noqa: BLE001 - an engine already gone has nothing to release
                logger.warning("engine %r did not answer leave: %s", name, e)
        self.engines.clear()
        self._drop_group()
        self._pool.shutdown(wait=False)
        self.store = None

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def _replies(self, futures: Mapping[str, concurrent.futures.Future], timeout_s):
        """Each engine's answer (first rank), waiting at most the trainer's bound."""
        out = {}
        deadline = time.monotonic() + trainer_bound_s(timeout_s)
        for name, future in futures.items():
            try:
                out[name] = future.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                out[name] = {
                    "success": False,
                    "message": f"no answer within {trainer_bound_s(timeout_s):g}s",
                }
            except Exception as e:  # noqa: BLE001 - a dead engine's HTTP error is its answer
                out[name] = {"success": False, "message": f"{type(e).__name__}: {e}"}
        return out

    # ------------------------------------------------------------------ updates

    @collector_paused()
    def update(
        self, named_tensors: Iterable[Tuple[str, torch.Tensor]], **kwargs
    ) -> RemoteReport:
        """Update every engine of the group from this rank's tensors (DTensors: their local
        shards; plain tensors: whole on every trainer rank); every trainer rank calls it
        with the same names. See ``update_sources`` for the keyword arguments."""
        clock = PhaseClock()
        with clock.phase(Phase.DESCRIBE):
            specs, local = named_specs(
                named_tensors, self.described.meshes, self.shards
            )
            sources = self.described.sources(list(specs.items()))
        return self.update_sources(specs, local, sources=sources, clock=clock, **kwargs)

    @collector_paused()
    def update_megatron(
        self,
        model_chunks,
        hf_vocab: int,
        shared_expert_hf: str = "shared_experts",
        **kwargs,
    ) -> RemoteReport:
        """Update from this rank's Megatron-core model chunks (``megatron_layout``): each rank
        sends from its own local parameters, fused ones included."""
        from sglang.srt.weight_sync.megatron_flow import all_coords, this_rank
        from sglang.srt.weight_sync.megatron_layout import (
            describe_model_chunks,
            megatron_sources,
        )
        from sglang.srt.weight_sync.trainer_flow import TrainerSync

        clock, me = PhaseClock(), this_rank()
        with clock.phase(Phase.DESCRIBE):
            model, buffers = describe_model_chunks(
                model_chunks, hf_vocab, me, shared_expert_hf
            )
        if self._megatron is None:
            self._megatron = TrainerSync()
        with clock.phase(Phase.CONTROL):  # every rank's coordinates
            coords = all_coords(self._megatron, me, self.timeout_s)
        with clock.phase(Phase.DESCRIBE):
            sources = megatron_sources(model, coords)
            specs = {
                name: HoldersSpec(s.shape, s.dtype, tuple(s.holders))
                for name, s in sources.items()
            }
            local = {k: t.detach() for k, t in buffers.items()}
        return self.update_sources(specs, local, clock=clock, **kwargs)

    @collector_paused()
    def update_sources(
        self,
        specs: Mapping[str, Spec],
        local: Mapping[str, torch.Tensor],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        staging_bytes: Optional[int] = None,
        timeout_s: Optional[float] = None,
        flush_cache: bool = True,
        weight_version: Optional[str] = None,
        drive: bool = True,
        sources: Optional[SourceLayout] = None,
        clock: Optional[PhaseClock] = None,
    ) -> RemoteReport:
        """One update from any source layout: ``specs`` (every HF tensor's spec, the same on
        every trainer rank) and this rank's ``local`` tensors by holder key. ``drive=False``:
        someone else sends the engines their update requests (verl's rollout workers);
        this rank only takes part in the group. ``staging_bytes``: each engine rank's
        staging while it serves (default ``DEFAULT_STAGING_BYTES``). ``sources``: the
        layout ``specs`` describe, when the caller keeps it (``update``: ``described``,
        whose memo then keeps its wire form and digest too). ``clock``: the update's phases
        so far, when the caller timed a part of it (``update``: the description);
        ``RemoteReport.phases`` says where this rank's time went."""
        clock = PhaseClock() if clock is None else clock
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        if not isinstance(bucket_bytes, int) or bucket_bytes < MIN_BUCKET_BYTES:
            raise ValueError(
                f"bucket_bytes={bucket_bytes!r}: at least {MIN_BUCKET_BYTES}"
            )
        self.left = []
        if self.group is None or self.broken:
            with clock.phase(Phase.CONTROL):
                self.join(timeout_s=timeout_s)
        group, membership = self.group, self.membership
        self.updates += 1
        update_id = f"{self.group_name}-e{membership.epoch}-u{self.updates}"
        part = TrainerPart(specs, local, sources=sources)
        replies = {}
        # the first update of an epoch (or after a failure) is a plain full one; the
        # snapshot is the same on every trainer rank, so each decides alike
        planned = self.delta and self.snapshot.epoch == membership.epoch
        if self.rank == 0:
            with clock.phase(Phase.DESCRIBE):
                part.wire, digest = self._wire_of(specs, sources)
            part.header = UpdateHeader(
                update_id,
                digest,
                len(part.wire),
                bucket_bytes,
                len(specs),
                delta=planned,
                digest=planned and self.updates % self.digest_every == 0,
                keep_base=self.delta,
            )
            if drive:
                body = dict(
                    group_name=self.group_name,
                    update_id=update_id,
                    timeout_s=timeout_s,
                    staging_bytes=staging_bytes,
                    flush_cache=flush_cache,
                    weight_version=weight_version,
                )
                replies = {
                    m.name: self._pool.submit(self.engines[m.name].update, body, None)
                    for m in membership.engines
                }
        problem, sent, staged, result, refused = None, 0, 0, None, False
        try:
            result = group.run_update(
                part,
                timeout_s,
                check=lambda _h, _s: self._finite_problems(local),
                snapshot=self.snapshot,
                clock=clock,
            )
            sent, staged = result.stats.bytes_sent, result.stats.peak_staging_bytes
        except GroupRefusal as e:  # every member refused it before any byte moved
            problem, refused = f"trainer rank {self.rank}: {e}", True
        except (PeerLost, ExecutionError) as e:
            problem = f"trainer rank {self.rank}: {e}"
        except RuntimeError as e:  # a peer's connection closed mid-round (gloo), named
            problem = f"trainer rank {self.rank}: {type(e).__name__}: {e}"
        try:
            with clock.phase(Phase.CONTROL):
                figures, problems = self._after_rounds(
                    problem, result, refused, sent, staged, timeout_s
                )
            with clock.phase(Phase.ENGINE):
                answers = self._replies(replies, timeout_s) if self.rank == 0 else {}
                answers = self.world.broadcast_object(
                    answers,
                    0,
                    trainer_bound_s(timeout_s) + GRACE_S,
                    f"trainer rank {self.rank}: hearing the engines' answers from trainer rank 0",
                )
            clock.count(Count.ROUND_TRIPS, 4)
        except PeerLost as e:
            self._broken(str(e))
            if self.snapshot is not None:
                self.snapshot.drop(f"update {update_id} was not answered: {e}")
            raise RemoteSyncError(
                f"weight update {update_id}: {e} ({membership.legend()})"
            ) from None
        failed = [
            f"engine {name!r}: {a.get('message')}"
            for name, a in answers.items()
            if not a.get("success")
        ]
        report = RemoteReport(
            success=not problems and not failed,
            message="; ".join(problems + failed) or "Success",
            update_id=update_id,
            epoch=membership.epoch,
            engines=answers,
            bytes_sent=figures[0][: self.trainers],
            peak_staging_bytes=figures[1][: self.trainers],
            left=list(self.left),
        )
        if self.delta:
            why_planned = (
                "" if planned else self.snapshot.why_full_now(membership.epoch)
            )
            report.delta = _delta_report(
                figures[3:],
                DeltaOutcome(
                    self.trainers, membership, result, any(figures[2]), planned
                ),
                why_planned,
                answers,
            )
        if self.snapshot is not None:
            if report.success:
                self.snapshot.commit(membership.epoch, result.plan.fingerprint)
            else:
                what = "was refused" if any(figures[2]) else "failed"
                self.snapshot.drop(f"update {update_id} {what}: {report.message[:300]}")
            report.delta.update(self.snapshot.next_update(membership.epoch))
            # each block-FP8 engine's weights over its TP ranks, as heard at join
            report.delta["block_fp8"] = {
                name: n for name, n in group.block_fp8.items() if n
            }
        if (problems or failed) and not _agreed_refusal(
            figures[2][: self.trainers], answers
        ):
            self._broken(report.message)
        report.phases = clock.snapshot()
        report.seconds = report.phases[Count.TOTAL_US.value] / 1e6
        logger.info(
            "weight update %s (epoch %d): %s; trainer ranks sent %s bytes; trainer rank %d: %s",
            update_id,
            membership.epoch,
            report.message[:500],
            report.bytes_sent,
            self.rank,
            describe_phases(report.phases),
        )
        return report

    def _after_rounds(
        self,
        problem: Optional[str],
        result: Optional[UpdateResult],
        refused: bool,
        sent: int,
        staged: int,
        timeout_s: float,
    ) -> Tuple[List[List[int]], List[str]]:
        """Every trainer rank's figures (bytes sent, peak staging, whether the group
        refused, its delta figures) and problems, once all sent their regions."""
        self.world.barrier(
            trainer_bound_s(timeout_s),
            f"trainer rank {self.rank}: after sending its regions",
        )
        problems = self.world.share_problems(
            [problem] if problem else [],
            trainer_bound_s(timeout_s),
            f"trainer rank {self.rank}: sharing how the update went on every trainer rank",
        )
        mine = result.delta if result is not None and result.delta else None
        mine = mine or DeltaFigures()
        engine_ranks = [
            range(m.offset, m.offset + m.tp_size) for m in self.membership.engines
        ]
        figures = self.world.share_figures(
            [sent, staged, int(refused)] + mine.ints() + mine.engine_rows(engine_ranks),
            timeout_s,
            f"trainer rank {self.rank}: sharing the bytes every trainer rank sent",
        )
        return figures, problems

    def _wire_of(
        self, specs: Mapping[str, Spec], sources: Optional[SourceLayout]
    ) -> Tuple[bytes, str]:
        """``SyncGroup.wire_of``, once per description ``described`` keeps."""
        if sources is None:
            return SyncGroup.wire_of(specs)
        return self.described.remembered(
            sources, "wire", lambda: SyncGroup.wire_of(specs, sources)
        )

    def _broken(self, why: str) -> None:
        """Drop the epoch after a failed update: the next one forms a new epoch with the
        engines that still answer (a dead engine leaves). Not after a refusal the group
        agreed on before any byte moved (``_agreed_refusal``)."""
        self.broken = why
        self._drop_group()

    def _finite_problems(self, local: Mapping[str, torch.Tensor]) -> List[str]:
        return [
            f"trainer rank {self.rank}: tensor {name!r} holds NaN or inf values "
            "(refused: an update never writes non-finite weights)"
            for name in nonfinite_tensors(local)
        ]


def _agreed_refusal(refused: Sequence[int], answers: Mapping[str, dict]) -> bool:
    """Whether an update that did not succeed was refused by the group's agreement before
    any byte moved: on every trainer rank (``refused``: each one's flag), and every engine
    that answered said it refused, nothing written. The epoch's groups were then not
    used, and the next update runs in it (no new join, its plans kept)."""
    return all(refused) and all(
        a.get("success") or str(a.get("message", "")).startswith(REFUSED)
        for a in answers.values()
    )


@dataclass(frozen=True)
class DeltaOutcome:
    """What ``_delta_report`` needs of one update besides the figures: the trainer ranks,
    the epoch's members, this rank's ``UpdateResult`` (None when its rounds did not run
    or failed), whether the group refused the update before any byte moved (the same on
    every trainer rank: the refusal is agreed), and whether it was planned as a delta."""

    trainers: int
    membership: Membership
    result: Optional[UpdateResult]
    refused: bool
    planned_delta: bool


def _delta_report(
    rows: List[List[int]], outcome: DeltaOutcome, why_planned: str, answers
) -> Dict[str, object]:
    """``RemoteReport.delta`` from the shared figures (``DeltaFigures.ints`` then
    ``engine_rows`` of every trainer rank, a figures x ranks table): ``delta_summary``,
    each engine's with the seconds its TP ranks spent decoding (from its reply).
    ``mode`` says what travelled: ``delta``, ``full``, or ``refused`` (nothing: the group
    refused the update before any byte moved); ``planned`` what the update was to be;
    ``why_full`` why it was (to be) full. A rank whose rounds failed reports the plan's."""
    trainers, membership, result = outcome.trainers, outcome.membership, outcome.result
    scalars = len(DeltaFigures().ints())
    per_rank = [
        DeltaFigures.from_ints([row[r] for row in rows[:scalars]])
        for r in range(trainers)
    ]
    width = len(RECEIVER_FIGURES)
    engines = {
        m.name: [sum(rows[scalars + i * width + k][:trainers]) for k in range(width)]
        for i, m in enumerate(membership.engines)
    }
    ran = result is not None and not outcome.refused
    summary = delta_summary(
        per_rank,
        why_planned or (result.why_full if ran else ""),
        result.header.digest if ran else False,
        engines,
    )
    summary["planned"] = "delta" if outcome.planned_delta else "full"
    if outcome.refused:
        summary["mode"] = "refused"
    for name, engine in summary["engines"].items():
        decode_us = (answers.get(name) or {}).get("decode_us") or []
        engine["decode_seconds"] = [us / 1e6 for us in decode_us]
    return summary
