"""Execute: run a plan over a process group. The data plane: the only code that moves tensors between ranks.

Every rank runs the same plan. Zero fills and local copies need no
communication, and run while the first round's transfers are in flight; each round
runs all its moves as one batch of point-to-point operations (``batch_isend_irecv``), a region that several ranks need sent to each
of them from its holder (no broadcast subgroups, see ``DataGroup``). Data is
received straight into the destination parameter when the region is contiguous
there and on the group's device, and staged otherwise; a sender stages only to
make a region contiguous, to cast it to the destination dtype (so an fp32 trainer
shard travels as bf16, one bucket at a time) or to bring it onto the group's
device (a CPU-offloaded shard on an NCCL group), one round at a time.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
import weakref
from dataclasses import dataclass
from typing import (
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
    Union,
)

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.apply import write_regions, write_zeros
from sglang.srt.weight_sync.box import contiguous_strides
from sglang.srt.weight_sync.control_plane import (
    PeerLost,
    fresh_group,
    group_number_proposal,
    leave_group,
    poll,
    wait,
)
from sglang.srt.weight_sync.planner import Dest, Move, Plan
from sglang.srt.weight_sync.source_layout import Holder

# isort: split
# pr: safety
from sglang.srt.weight_sync.setup_bound import SetUpStranded, issue_within

# pr: safety end
# isort: split
# pr: fp8
from typing import Sequence

# pr: fp8 end
# isort: split
# pr: scale
from sglang.srt.weight_sync.copy_program import CopyProgram, FixedShards

# pr: scale end
# isort: split
# pr: remote
from sglang.srt.weight_sync.staging_budget import keep_for_stream

# pr: remote end

__all__ = (
    "DataGroup",
    "Deferred",
    "ExecutionError",
    "ExecutionStats",
    "Landing",
    "PackLanding",
    "check_inputs",
    "data_device",
    "execute",
    "write_zero_fills",
    # pr: fp8
    "dest_region",
    "exchange_payloads",
    "exchange_round",
    "rank_rounds",
    "source_region",
    # pr: fp8 end
    # pr: remote
    "write_landings",
    # pr: remote end
)


class ExecutionError(RuntimeError):
    """Inputs that do not match the plan (named tensor, rank and expectation in the message)."""


@dataclass
class ExecutionStats:
    """What one rank did; bytes are payload bytes in the destination dtype (``bytes_sent``
    counts a region once per receiver). ``broadcasts``: moves with several receivers,
    each run as one send per receiver."""

    bytes_received: int = 0
    bytes_sent: int = 0
    bytes_copied_locally: int = 0
    peak_staging_bytes: int = 0
    largest_round_bytes: int = 0
    rounds: int = 0
    p2p_ops: int = 0
    broadcasts: int = 0
    # wall seconds of zero fills, local copies and landing copies (``phase_timing``'s apply),
    # and of waiting for the rounds' point-to-point operations
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0


def data_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """The device the data plane moves tensors on over ``group``: the current GPU when the
    group has an NCCL backend (``nccl``, ``cpu:gloo,cuda:nccl``), else the CPU (also
    outside a process group: a plan of local copies only)."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _ranks_of(parent: Optional[dist.ProcessGroup]) -> List[int]:
    """``parent``'s ranks in this world (None: the default group's)."""
    if parent is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(parent)


class DataGroup:
    """The process group a data plane runs over, on ``device``, warmed up once.

    Owned by whoever owns the group (the engine's weight sync, the trainer's sync) and
    kept across its updates. NCCL creates a group's communicator lazily, in the group's
    first collective, and torch requires every rank to join a ``batch_isend_irecv`` that
    is a group's first call; the executor skips rounds in which a rank has no move, so
    a rank might never join that init and the others would block inside it, outside
    any bounded wait. ``warm_up`` therefore issues one tiny all-reduce on ``device`` on
    every rank of the group, once, bounded like every other wait, before the first
    round. On gloo (the CPU tests) it is just that all-reduce; what it guards against
    is NCCL's only.

    NCCL also connects two ranks for point-to-point lazily, in the first batch that
    pairs them, and that setup blocks the host until the peer posts its side, outside
    any ``Work`` a bounded wait could time out (pytorch/pytorch#113281). A peer that dies
    mid-update would then hang its partners in the first round that meets it.
    ``connect`` therefore exchanges one byte over every pair a plan uses that this group
    has not carried yet, before the first round, when every rank has just agreed to the
    update: a later round's transfer to a dead peer is then only a wait that times out.
    ``set_up`` does both for a plan, so that an owner can run them before it commits to
    write (the engine does), where a failure is still a refusal.

    On NCCL both block the host inside the call that posts the work (communicator init,
    the pair's connection), before a poll could start (``issue``).

    Every wait on the group goes through ``wait``: on NCCL it polls the work against the
    bound and aborts the group before it raises (``control_plane.poll``), never
    ``work.wait(timeout=...)``, which would leave the teardown to NCCL's watchdog (the
    process ends about a minute later); on gloo, whose send and receive works complete only
    inside ``wait``, it waits with the bound. Either way a wait that fails abandons the
    group at once (``abandon``), and the owner makes a new one for its next update.

    Moves with several receivers are sent point-to-point to each: a broadcast subgroup
    per distinct rank set would be one more NCCL communicator (and its buffers) for the
    process's life, and with GQA (kv heads < TP) there are many; point-to-point reuses
    this group's one communicator, at the cost of the holder sending such a (small,
    replicated) region once per receiver.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        device: Optional[torch.device] = None,
        own: bool = False,
        polled: Optional[bool] = None,
    ) -> None:
        self.group = group
        # made for this DataGroup (``over_ranks_of``): destroyed when abandoned
        self.own = own
        self.device = device if device is not None else data_device(group)
        # its works are polled (NCCL's: ``wait``); None: on a GPU
        self.polled = self.device.type == "cuda" if polled is None else polled
        # why a wait on it failed (then it is abandoned and never used again)
        self.lost: Optional[str] = None
        self.warm = False
        # (sender, receiver) pairs, in the group's ranks, that a batch has carried
        self.connected: Set[Tuple[int, int]] = set()
        # fingerprints of the plans ``set_up`` warmed up and connected this group for
        self.set_up_for: Set[str] = set()
        self.abandoned = False

    @classmethod
    def over_ranks_of(
        cls,
        parent: Optional[dist.ProcessGroup],
        timeout_s: float,
        number: int,
        setup_s: Optional[float] = None,
    ) -> DataGroup:
        """A new group over ``parent``'s ranks (None: the default group's), with its backend
        and an explicit ``timeout_s``: the data plane's own, so that a wait that times out
        (on NCCL the communicator is then aborted) never poisons ``parent`` (SGLang's
        serving TP group). Only ``parent``'s ranks take part, all of them together, as group
        ``number`` over them, the number its owners agreed on (``control_plane.fresh_group``);
        its communicator is never split from the default group's, so a default group bound to
        a device needs no other rank.
        ``setup_s``: the bound of its making (``control_plane.join_group``)."""
        group = fresh_group(
            _ranks_of(parent), str(dist.get_backend(parent)), timeout_s, number, setup_s
        )
        return cls(group, own=True)

    @staticmethod
    def number_proposal(
        parent: Optional[dist.ProcessGroup], made: int, lacks: bool = True
    ) -> int:
        """This rank's proposal for the number of the next group over ``parent``'s ranks
        (``control_plane.group_number_proposal``), its owner having made ``made``: the
        owners agree on the highest and pass it to ``over_ranks_of``. An owner that has a
        usable group (``lacks`` False) proposes ``made`` without reading the store: a
        group is made only when some rank lacks one, and that rank's proposal reads the
        store's floor, so the highest still covers it (no store round trip per update)."""
        return group_number_proposal(_ranks_of(parent), made) if lacks else made

    def abandon(self) -> None:
        """Abort the group's communicators after a failed wait and never use it again: its
        pending work would outlive the update, and once past the group's timeout NCCL's
        watchdog would end the process. A group of its own is destroyed too, so that its
        threads and torch's record of it go with it (``control_plane.leave_group``); a new
        group over the same ranks gets a name of its own (``control_plane.fresh_group``)."""
        if self.lost is None:
            self.lost = "abandoned"
        if not self.abandoned:
            self.abandoned = True
            leave_group(self.group, destroy=self.own)
        self.warm = False
        self.connected = set()
        self.set_up_for = set()

    def post(
        self, ops: List[dist.P2POp], phase: str, timeout_s: Optional[float] = None
    ) -> list:
        """Post ``ops`` as one batch (``batch_isend_irecv``); a failure to post (on gloo, a
        peer whose connection closed: a killed process) abandons the group as a failed wait
        does. ``timeout_s``: the post may set up NCCL (``issue``), bounded so."""
        return self.issue(lambda: dist.batch_isend_irecv(ops), timeout_s, phase)

    def wait(self, work, timeout_s: Optional[float], phase: str) -> None:
        """Wait for ``work`` of this group at most ``timeout_s`` (None: the group's own
        timeout, outside an update): polled on NCCL (``control_plane.poll``, the group
        aborted before ``PeerLost`` is raised), with the bound on gloo. A wait that fails
        abandons the group (``abandon``) before the error leaves."""
        try:
            if self.polled and timeout_s is not None:
                poll(work, timeout_s, phase, self.abandon)
            else:
                wait(work, timeout_s, phase)
        except PeerLost as e:
            self.lost = str(e)
            self.abandon()
            raise
        except RuntimeError as e:  # a peer's connection closed (gloo), a NCCL error
            self.lost = f"{phase}: {type(e).__name__}: {e}"
            self.abandon()
            raise

    def issue(self, call, timeout_s: Optional[float], phase: str):
        """``call()``, which posts works on this group (on NCCL its set-up may block the
        host: the communicator's init, a pair's first connection). A call that raises
        (NCCL's init failed; on gloo, a killed peer's closed connection) abandons the group
        as a failed wait does."""
        try:
            # pr: safety
            # bounded on NCCL by ``timeout_s`` (``setup_bound.issue_within``): still inside
            # NCCL at the bound, ``PeerLost`` naming ``phase``, the group lost, and left to
            # that call's thread, which aborts it once the call returns (nothing here
            # touches it meanwhile)
            group = self.group
            if self.polled and timeout_s is not None:
                return issue_within(
                    call,
                    timeout_s,
                    self.device,
                    lambda: leave_group(group, destroy=False),
                    f"weight-sync set-up: {phase}"[:60],
                )
            # pr: safety end
            return call()
        # pr: safety
        except SetUpStranded as e:
            self.lost = f"{phase}: {e}; the group is dropped"
            self.abandoned = True  # its thread aborts it (``abandon`` leaves it alone)
            self.abandon()
            raise PeerLost(self.lost) from None
        # pr: safety end
        except RuntimeError as e:
            self.lost = f"{phase}: {type(e).__name__}: {e}"
            self.abandon()
            raise

    def _deadline(self, timeout_s: Optional[float]) -> Optional[float]:
        """When a set-up step's bound ends: the NCCL set-up (``issue``) and the wait after it
        share it on a polled group; elsewhere (gloo) each wait keeps ``timeout_s`` as
        before, nothing blocking the host ahead of it. None: no deadline."""
        if not self.polled or timeout_s is None:
            return None
        return time.monotonic() + timeout_s

    def warm_up(self, timeout_s: Optional[float], phase: str) -> None:
        """Join the group's first collective on every rank (once per group; nothing to join
        outside a process group). On NCCL the communicator is made in it (``issue``)."""
        if self.warm or not dist.is_initialized():
            return
        deadline = self._deadline(timeout_s)
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        phase = f"{phase} (warming up the data group on {self.device})"
        work = self.issue(
            lambda: dist.all_reduce(flag, group=self.group, async_op=True),
            timeout_s,
            f"{phase}: making its communicator",
        )
        self.wait(work, _left(deadline, timeout_s), phase)
        self.warm = True

    def needs_set_up(self, plan: Plan) -> bool:
        """Whether ``set_up`` has work for ``plan``: the same answer on every rank of a group
        whose ranks made it together and ran the same agreed plans on it, so they all take
        the agreement that follows a set-up, or none does."""
        return not self.warm or plan.fingerprint not in self.set_up_for

    def set_up(
        self, plan: Plan, rank: int, timeout_s: Optional[float], phase: str
    ) -> None:
        """Warm up (``warm_up``) and connect every pair of ``plan`` that involves ``rank``
        (``connect``): the NCCL setup that blocks the host, done before the owner commits to
        write, so that a failure here is a refusal (nothing written) instead of a failure
        between writes. ``execute`` then finds nothing left to set up."""
        self.warm_up(timeout_s, phase)
        self.connect(_rounds(plan, rank), rank, timeout_s, phase)
        self.set_up_for.add(plan.fingerprint)

    def connect(
        self,
        rounds: List[List[Move]],
        rank: int,
        timeout_s: Optional[float],
        phase: str,
        pairs: Optional[Set[Tuple[int, int]]] = None,
    ) -> None:
        """One byte over each (sender, receiver) pair of ``rounds`` (``rank``'s moves of a
        plan) that involves ``rank`` and that no batch of this group has carried: both ranks
        of a pair run the same plan, so each posts its side exactly once. ``pairs``: those
        of ``rounds``, when the caller has them (``_pairs``)."""
        if pairs is None:
            pairs = _pairs(rounds)
        new = sorted(p for p in pairs - self.connected if rank in p and p[0] != p[1])
        if not new or not dist.is_initialized():
            return
        ops = []
        for src, dst in new:
            peer = dst if src == rank else src
            if self.group is not None:
                peer = dist.get_global_rank(self.group, peer)
            op = dist.isend if src == rank else dist.irecv
            buf = torch.zeros(1, dtype=torch.uint8, device=self.device)
            ops.append(dist.P2POp(op, buf, peer, self.group))
        phase = f"{phase} (connecting the ranks it pairs with)"
        deadline = self._deadline(timeout_s)
        for work in self.post(ops, phase, timeout_s):
            self.wait(work, _left(deadline, timeout_s), phase)
        self.connected.update(new)


def _left(deadline: Optional[float], timeout_s: Optional[float]) -> Optional[float]:
    """What is left of a bound ending at ``deadline``; ``timeout_s`` itself when there is
    no deadline (a wait of its own on gloo: see ``DataGroup._deadline``)."""
    return timeout_s if deadline is None else max(0.0, deadline - time.monotonic())


@dataclass(frozen=True)
class Landing:
    """A region received into staging (``buf``, in the move's dtype) and where it lands
    (``dests``, this rank's), written later by ``write_landings``."""

    buf: torch.Tensor
    move: Move
    dests: Tuple[Dest, ...]

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


@dataclass(frozen=True)
class PackLanding:
    """Small moves from one sender received in one buffer (``PACK_BELOW``: ``buf``, flat
    bytes; ``bases``, per move the buffer in its dtype), written later by
    ``write_landings`` as the rounds of ``execute`` write a pack: one object per pack
    however many regions it holds (a MoE layer's experts are hundreds), its regions
    viewed only where the pack's copy program (kept by the plan) cannot run."""

    buf: torch.Tensor
    bases: Tuple[torch.Tensor, ...]
    pack: _Pack
    regions: _Regions

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def runs(self) -> List[torch.Tensor]:
        """The buffer as few 1-d views, one per run of regions of one dtype (what a
        NaN/inf check reads)."""
        return [
            self.bases[i].as_strided((count,), (1,), offset)
            for i, offset, count in self.pack.runs
        ]


class Deferred:
    """A receiver whose writes into its parameters come later than the rounds (an engine
    that keeps serving while it receives): every region lands in staging of its own,
    handed over per round (``landed``) and written by the owner (``write_landings``).
    ``reserve`` is called before a round with the bytes the round will stage and may wait
    (bounded, the owner's policy) until that much staging is free."""

    def reserve(self, nbytes: int) -> None:
        """Called before a round allocates ``nbytes`` of staging."""

    def landed(self, landings: List[Landing]) -> None:
        """The round's regions, received; the owner keeps them until it writes them."""
        raise NotImplementedError


class _Staging:
    """Counts the executor's own buffers so the peak can be checked against the cap."""

    def __init__(self, stats: ExecutionStats, device: torch.device) -> None:
        self.stats, self.device, self.live = stats, device, 0
        self.sent: Dict[tuple, torch.Tensor] = {}

    def empty(self, sizes, dtype) -> torch.Tensor:
        buf = torch.empty(sizes, dtype=dtype, device=self.device)
        self._add(buf)
        return buf

    def ready_to_send(self, view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``view`` as the group can send it: contiguous, in ``dtype``, on the group's device
        (a shard elsewhere, e.g. CPU-offloaded, is staged here one region at a time)."""
        if view.dtype == dtype and view.is_contiguous() and view.device == self.device:
            return view
        buf = self.empty(view.shape, dtype)
        buf.copy_(view)
        return buf

    def send_buffer(self, shards, move: Move, regions: _Regions) -> torch.Tensor:
        """The region ``move`` sends, staged once per round however many ranks it goes to."""
        key = (move.tensor, move.holder.buffer, move.region, move.dtype)
        buf = self.sent.get(key)
        if buf is None:
            buf = self.sent[key] = self.ready_to_send(
                regions.src(shards, move), move.dtype
            )
        return buf

    def _add(self, buf: torch.Tensor) -> None:
        self.live += buf.numel() * buf.element_size()
        self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes, self.live)

    def release_all(self) -> None:
        self.live = 0
        self.sent.clear()


def check_inputs(
    plan: Plan,
    rank: int,
    shards: Mapping[str, torch.Tensor],
    params: Optional[Mapping[str, torch.Tensor]],
    device: Optional[torch.device] = None,
) -> List[str]:
    """Problems with this rank's inputs against the plan, as messages; empty when fine.

    Run before the ranks agree to the update, its problems part of what they agree on, so
    that a bad update is refused as a whole on every rank. A shard or parameter on another
    device than the data group's ``device`` is fine (staged one round at a time); one
    without data (the meta device) is refused, naming both devices. ``params`` None: the
    shards only (the caller makes the parameters from the plan's own targets)."""
    needs = plan.memo.get(("inputs", rank))
    if needs is None:
        needs = plan.memo[("inputs", rank)] = _InputNeeds.of(plan, rank)
    problems: List[str] = []
    # the shards found fine last time (a weak reference and the address): a caller that
    # hands the same tensors every update has each checked in full once
    # pr: scale
    # (an engine rank does, from the shared-memory segment it keeps mapped: there, the
    # same ``FixedShards`` as last time, found fine then, is fine without a look at each)
    # pr: scale end
    fine = plan.memo.get(("inputs fine", rank))
    same = False
    # pr: scale
    kept = plan.memo.get(("inputs fixed", rank))
    same = kept is not None and kept() is shards
    # pr: scale end
    if not same:
        if fine is None or not _all_fine(needs, shards, *fine):
            plan.memo[("inputs fine", rank)] = _check_shards(
                needs, shards, fine, rank, device, problems
            )
        # pr: scale
        plan.memo[("inputs fixed", rank)] = (
            weakref.ref(shards)
            if isinstance(shards, FixedShards) and not problems
            else None
        )
        # pr: scale end
    if params is not None:
        for name, index, shape in needs.params:
            problems.extend(_check_param(params, rank, name, index, shape, device))
        problems.extend(
            f"rank {rank}: no parameter {name!r}"
            for name in needs.zero_fills
            if name not in params
        )
    return sorted(set(problems))


def _all_fine(
    needs: _InputNeeds,
    shards: Mapping[str, torch.Tensor],
    refs: List[Callable[[], Optional[torch.Tensor]]],
    ptrs: List[int],
) -> bool:
    """Whether every shard is the one found fine last time (``refs``), at the same address
    (``ptrs``) and in its shape: a list at a time, a few passes over a MoE model's tens of
    thousands of shards rather than a loop."""
    got = list(map(shards.get, needs.buffers))
    return (
        all(map(operator.is_not, got, itertools.repeat(None)))
        and all(map(operator.is_, got, map(_CALL, refs)))
        and list(map(torch.Tensor.data_ptr, got)) == ptrs
        and tuple(map(_SHAPE, got)) == needs.shapes
    )


_SHAPE = operator.attrgetter("shape")
_CALL = operator.methodcaller("__call__")  # (``operator.call`` is Python 3.11's)


def _check_shards(
    needs: _InputNeeds,
    shards: Mapping[str, torch.Tensor],
    fine: Optional[Tuple[list, list]],
    rank: int,
    device: Optional[torch.device],
    problems: List[str],
) -> Tuple[List[Callable[[], Optional[torch.Tensor]]], List[int]]:
    """``check_inputs`` of each shard, those found fine last time (``fine``) by identity,
    the others in full; appends to ``problems`` and returns what to find fine next time."""
    castable: Dict[Tuple[torch.dtype, torch.dtype], bool] = {}
    found: List[Tuple[Callable[[], Optional[torch.Tensor]], int]] = []
    for i, (move, h) in enumerate(needs.shards):
        shard = shards.get(h.buffer)
        if (
            fine is not None
            and shard is not None
            and fine[0][i]() is shard
            and shard.data_ptr() == fine[1][i]
            and shard.shape == h.buffer_shape
        ):
            found.append((fine[0][i], fine[1][i]))
            continue
        found.append((_GONE, 0))
        if shard is not None and tuple(shard.shape) == h.buffer_shape:
            pair = (shard.dtype, move.dtype)
            ok = castable.get(pair)
            if ok is None:
                ok = castable[pair] = _castable(*pair)
            if ok and shard.device.type != "meta":
                found[-1] = (weakref.ref(shard), shard.data_ptr())
                continue
        where = f"tensor {move.tensor!r} box {h.box} (local buffer {h.buffer!r})"
        if shard is None:
            problems.append(f"rank {rank}: no local shard for {where}")
        elif tuple(shard.shape) != h.buffer_shape:
            problems.append(
                f"rank {rank}: {where} local shard has shape {tuple(shard.shape)}, expected {h.buffer_shape}"
            )
        elif not _castable(shard.dtype, move.dtype):
            problems.append(
                f"rank {rank}: {where} dtype {shard.dtype} cannot be cast to {move.dtype}"
            )
        else:
            problems.append(
                f"rank {rank}: {where} local shard is on {shard.device}, which holds no data; "
                f"the data group moves tensors on {device or 'its device'}"
            )
    return [ref for ref, _ in found], [ptr for _, ptr in found]


@dataclass(frozen=True)
class _InputNeeds:
    """What ``check_inputs`` looks at on one rank, from the plan alone: the first move
    that reads each of its shards (with that shard's holder), each parameter it lands
    in by the shape after its index (name, the largest index along each indexed dim,
    shape: a fused MoE parameter takes hundreds of regions, one check), and the
    parameters it zero-fills."""

    shards: Tuple[Tuple[Move, Holder], ...]
    params: Tuple[Tuple[str, Tuple[int, ...], Tuple[int, ...]], ...]
    zero_fills: Tuple[str, ...]
    # each shard's buffer key and shape, in ``shards``' order (``_all_fine``)
    buffers: Tuple[str, ...] = ()
    shapes: Tuple[Tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, plan: Plan, rank: int) -> _InputNeeds:
        shards, seen = [], set()
        params: Dict[Tuple[str, int, Tuple[int, ...]], Tuple[int, ...]] = {}
        moves = list(plan.local_for(rank)) + [
            m for rnd in plan.rounds for m in rnd if rank in m.group
        ]
        for move in moves:
            h = move.holder
            if move.src == rank and (move.tensor, h.buffer) not in seen:
                seen.add((move.tensor, h.buffer))
                shards.append((move, h))
            for d in move.dests:
                if d.rank == rank:
                    key = (d.param, len(d.index), d.shape)
                    top = params.get(key)
                    params[key] = (
                        d.index if top is None else tuple(map(max, top, d.index))
                    )
        return cls(
            tuple(shards),
            tuple((name, top, shape) for (name, _, shape), top in params.items()),
            tuple(dict.fromkeys(z.param for z in plan.zero_fills if z.rank == rank)),
            tuple(h.buffer for _, h in shards),
            tuple(tuple(h.buffer_shape) for _, h in shards),
        )


def execute(
    plan: Plan,
    rank: int,
    shards: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    group: Union[DataGroup, dist.ProcessGroup, None] = None,
    timeout_s: Optional[float] = None,
    deferred: Optional[Deferred] = None,
    checked: bool = False,
    # pr: remote
    pack_casts: bool = False,
    # pr: remote end
) -> ExecutionStats:
    """Run ``plan`` as ``rank`` (a rank of ``group``): read ``shards`` (buffer key -> this
    rank's local tensor, see ``source_layout.Holder``), write ``params`` (parameter name
    -> this rank's tensor) in place. Every rank of the group calls it together. ``group``:
    the owner's ``DataGroup``, warmed up on its first use (a plain group or None, the
    default group: one made for this call). Each round waits at most ``timeout_s`` for
    its peers (``control_plane.PeerLost``). With ``deferred`` nothing is written into
    ``params`` (checked against the plan only): zero fills wait for ``write_zero_fills``
    and every region received or copied is handed to ``deferred`` instead. ``checked``:
    the caller ran ``check_inputs`` before its ranks agreed to the update (its problems
    part of the agreement), so it is not run again; otherwise a problem raises
    ``ExecutionError`` on this rank alone."""
    # pr: remote
    # ``pack_casts`` (every rank passes the same): the receivers stage every region (remote
    # engines), so a move its sender casts travels in the pack to its receiver whatever
    # its size: the sender copies it to cast it anyway, and a point-to-point operation per
    # region is saved (a MoE model's experts are tens of thousands)
    # pr: remote end
    data = group if isinstance(group, DataGroup) else DataGroup(group)
    problems = [] if checked else check_inputs(plan, rank, shards, params, data.device)
    if problems:
        raise ExecutionError("; ".join(problems))

    def to_global(r: int) -> int:
        return r if data.group is None else dist.get_global_rank(data.group, r)

    stats = ExecutionStats()
    staging = _Staging(stats, data.device)
    packing = False
    # pr: remote
    packing = pack_casts
    # pr: remote end
    regions = _Regions.of(plan, rank, packing)
    # every rank, before any round (a rank-local plan may have none on some ranks)
    data.warm_up(timeout_s, f"rank {rank}: executor")
    rounds = regions.rounds
    data.connect(rounds, rank, timeout_s, f"rank {rank}: executor", regions.pairs)

    flight = None
    local = regions.local
    if deferred is not None:
        # nothing is written here: local regions are handed over like received ones
        if local:
            deferred.landed(
                [Landing(regions.src(shards, m).clone(), m, m.dests[:1]) for m in local]
            )
        stats.bytes_copied_locally += regions.local_bytes
    else:
        # the first round's transfers run while this rank makes its local copies
        if rounds:
            flight = _start_round(
                rank,
                regions.route(0),
                shards,
                params,
                data,
                staging,
                to_global,
                regions,
            )
        t0 = time.perf_counter()
        try:
            write_zero_fills(plan, rank, params)
            regions.copy(
                "local",
                [params[m.dests[0].param] for m in local],
                lambda: [shards[m.holder.buffer] for m in local],
                lambda: (
                    [regions.dest(params, m.dests[0], m) for m in local],
                    [regions.src(shards, m) for m in local],
                ),
                shards,
            )
            stats.bytes_copied_locally += regions.local_bytes
        except BaseException:
            if flight is not None:  # no transfer of this update outlives it
                for work in flight[0]:
                    try:
                        data.wait(
                            work,
                            timeout_s,
                            f"rank {rank}: executor, after a failed copy",
                        )
                    except Exception:  # noqa: BLE001 - the copy's error is the one to raise
                        pass
            raise
        stats.copy_seconds += time.perf_counter() - t0

    for i in range(len(rounds)):
        route = regions.route(i)
        if flight is None:
            flight = _start_round(
                rank, route, shards, params, data, staging, to_global, regions, deferred
            )
        stats.rounds += 1
        stats.largest_round_bytes = max(stats.largest_round_bytes, route.nbytes)
        phase = (
            f"rank {rank}: executor round {stats.rounds} with ranks {list(route.peers)}"
        )
        _finish_round(
            params,
            flight,
            staging,
            lambda work: data.wait(work, timeout_s, phase),
            deferred,
            regions,
        )
        flight = None
        staging.release_all()
    return stats


def _mine(moves: List[Move], rank: int) -> List[Move]:
    return [m for m in moves if rank in m.group]


def _rounds(plan: Plan, rank: int) -> List[List[Move]]:
    """``rank``'s moves of each round of ``plan`` in which it has one."""
    return [mine for mine in (_mine(moves, rank) for moves in plan.rounds) if mine]


def write_zero_fills(plan: Plan, rank: int, params: Mapping[str, torch.Tensor]) -> None:
    """Zero the regions of ``rank``'s parameters that no checkpoint tensor fills."""
    for z in plan.zero_fills:
        if z.rank == rank:
            write_zeros(params[z.param][z.box.slices()])


# pr: remote
def write_landings(
    params: Mapping[str, torch.Tensor], landings: List[Union[Landing, PackLanding]]
) -> int:
    """Write deferred landings into ``params`` (``apply.write_regions``, cast on the fly);
    returns the bytes written. A pack is written as the rounds of ``execute`` write one
    (``_Pack.land``: views kept by the plan from update to update, and one copy program
    per pack, a MoE layer's experts in a few strided copies, not one copy each). The
    buffers were allocated where they were received (another thread, another stream):
    each is kept for this stream's writes (``record_stream``)."""
    alone = [(x.buf, x.move, x.dests) for x in landings if isinstance(x, Landing)]
    _finish_landings(params, alone)
    for x in landings:
        if isinstance(x, PackLanding):
            x.pack.land(x.regions, params, list(x.bases))
    keep_for_stream(landing.buf for landing in landings)
    return sum(landing.nbytes for landing in landings)


# pr: remote end
# A move smaller than this travels in one transfer with the round's other small moves
# between the same two ranks (``_start_round``): a MoE layer's experts are hundreds of small
# regions, and a point-to-point op costs far more than copying a small region once more.
PACK_BELOW = 256 << 10


def _start_round(
    rank,
    route,
    shards,
    params,
    data: DataGroup,
    staging,
    to_global,
    regions,
    deferred=None,
) -> Tuple[list, List[Tuple[torch.Tensor, Move, Tuple[Dest, ...]]]]:
    """Start one round's moves (``route``: this rank's part of it) as one batch of
    point-to-point operations (a move with several receivers is sent to each, in receiver
    order, the same on both ends); returns the pending work and where the received regions
    land (with ``deferred``: staging the owner keeps, reserved first). Moves below
    ``PACK_BELOW`` from one sender to one receiver (and no other) travel packed in one
    buffer, after the round's other moves between them, in the order ``_packed`` gives
    both ends; the receiver lands views of it. Each move is staged at most once on a rank,
    so staging stays within the plan's cap."""
    ops: List[dist.P2POp] = []
    landings: List[Tuple[torch.Tensor, Move, Tuple[Dest, ...]]] = []
    group = data.group
    if deferred is not None:
        deferred.reserve(route.received)
    stats = staging.stats
    stats.broadcasts += route.broadcasts
    stats.bytes_sent += route.sent
    stats.bytes_received += route.received
    for move, peer, mine in route.ops:
        if not mine:  # a send (a move with several receivers is staged once)
            buf = staging.send_buffer(shards, move, regions)
            ops.append(dist.P2POp(dist.isend, buf, to_global(peer), group))
            continue
        buf = (
            _landing(params, mine[0], move, staging, regions)
            if deferred is None
            else torch.empty(move.region.sizes, dtype=move.dtype, device=staging.device)
        )
        ops.append(dist.P2POp(dist.irecv, buf, to_global(peer), group))
        landings.append((buf, move, mine))
    for receiver, pack in route.packs_out:
        flat, bases = pack.buffer(staging, None)
        regions.copy(  # cast to the engine's dtype on the way
            id(pack),
            bases,
            lambda: [shards[m.holder.buffer] for m in pack.moves],
            lambda: (pack.views(bases), [regions.src(shards, m) for m in pack.moves]),
            shards,
        )
        ops.append(dist.P2POp(dist.isend, flat, to_global(receiver), group))
    packs: List[Tuple[_Pack, List[torch.Tensor]]] = []
    for sender, pack in route.packs_in:
        flat, bases = pack.buffer(staging, deferred)
        ops.append(dist.P2POp(dist.irecv, flat, to_global(sender), group))
        if deferred is None:
            packs.append((pack, bases))
        else:
            landings.append(PackLanding(flat, tuple(bases), pack, regions))
    stats.p2p_ops += len(ops)
    works = data.post(ops, f"rank {rank}: executor, posting a round") if ops else []
    return works, landings, packs


def _packed(moves: List[Move]) -> List[Move]:
    """The order small moves lie in their pack, the same on both ends: larger elements
    first (each region's bytes are a multiple of its element size, so every region starts
    aligned for its dtype without padding), then the round's order."""
    return sorted(moves, key=lambda m: -m.dtype.itemsize)


@dataclass(frozen=True)
class _Pack:
    """Small moves between one sender and one receiver in one flat byte buffer
    (``_packed``'s order): where each region lies in it, worked out once per plan."""

    moves: Tuple[Move, ...]
    dests: Tuple[
        Tuple[Dest, ...], ...
    ]  # the receiver's dests of each (empty on the sender)
    nbytes: int
    # per move: its dtype, the region's sizes and contiguous strides, and its offset in
    # elements of that dtype
    places: Tuple[Tuple[torch.dtype, Tuple[int, ...], Tuple[int, ...], int], ...]
    # regions of one dtype back to back, as (the first one's move, its offset, elements)
    runs: Tuple[Tuple[int, int, int], ...]

    @classmethod
    def of(cls, moves: List[Move], rank: int) -> _Pack:
        ordered = _packed(moves)
        places, offset = [], 0
        runs: List[List[int]] = []
        for i, m in enumerate(ordered):
            sizes = tuple(m.region.sizes)
            at, count = offset // m.dtype.itemsize, math.prod(sizes)
            places.append((m.dtype, sizes, contiguous_strides(sizes), at))
            last = runs[-1] if runs else None
            if last and ordered[last[0]].dtype == m.dtype and last[1] + last[2] == at:
                last[2] += count
            elif count:
                runs.append([i, at, count])
            offset += m.nbytes
        return cls(
            tuple(ordered),
            tuple(tuple(_my_dests(m, rank)) for m in ordered),
            offset,
            tuple(places),
            tuple(tuple(r) for r in runs),
        )

    def buffer(
        self, staging: _Staging, deferred
    ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """One flat byte buffer (staging the executor counts, or, with ``deferred``, memory
        the owner keeps) and, per move, the buffer viewed in the move's dtype."""
        total = self.nbytes
        if deferred is None:
            flat = staging.empty((total,), torch.uint8)
        else:
            flat = torch.empty((total,), dtype=torch.uint8, device=staging.device)
        typed: Dict[torch.dtype, torch.Tensor] = {}
        bases = []
        for dtype, _, _, _ in self.places:
            base = typed.get(dtype)
            if base is None:
                size = dtype.itemsize
                base = typed[dtype] = flat[: total - total % size].view(dtype)
            bases.append(base)
        return flat, bases

    def views(self, bases: List[torch.Tensor]) -> List[torch.Tensor]:
        """Each move's region in the buffer (``bases``: ``buffer``'s), one ``as_strided``
        each."""
        return [
            base.as_strided(sizes, strides, offset)
            for base, (_, sizes, strides, offset) in zip(bases, self.places)
        ]

    def land(self, regions: _Regions, params, bases: List[torch.Tensor]) -> None:
        """Write the received buffer (``bases``) into this rank's parameter regions."""
        pairs = [(j, d) for j, dests in enumerate(self.dests) for d in dests]

        def views():
            src = self.views(bases)
            return (
                [regions.dest(params, d, self.moves[j]) for j, d in pairs],
                [src[j] for j, _ in pairs],
            )

        regions.copy(
            id(self),
            [params[d.param] for _, d in pairs],
            lambda: [bases[j] for j, _ in pairs],
            views,
        )


@dataclass(frozen=True)
class _Route:
    """One rank's part of one round, worked out once per plan: its point-to-point moves in
    the order both ends post them (``ops``: move, peer, this rank's dests; no dests: a
    send), its packs each way, what it sends and receives (bytes in the destination dtype)
    and the ranks it meets."""

    ops: Tuple[Tuple[Move, int, Tuple[Dest, ...]], ...]
    packs_out: Tuple[Tuple[int, _Pack], ...]
    packs_in: Tuple[Tuple[int, _Pack], ...]
    sent: int
    received: int
    broadcasts: int
    nbytes: int  # of the moves it sends or receives
    peers: Tuple[int, ...]

    @classmethod
    def of(cls, moves: List[Move], rank: int, pack_casts: bool = False) -> _Route:
        """``rank``'s part of a round of ``moves``; ``pack_casts``: see ``execute``."""
        ops: List[Tuple[Move, int, Tuple[Dest, ...]]] = []
        packs_out: Dict[int, List[Move]] = {}  # receiver -> the small moves sent to it
        packs_in: Dict[
            int, List[Move]
        ] = {}  # sender -> the small moves received from it
        sent = received = broadcasts = nbytes = 0
        for move in moves:
            receivers = _receivers(move)
            # one receiver only: a move sent to several is staged once (``send_buffer``),
            # which keeps every rank's staging within the plan's cap on the bytes it moves
            small = len(receivers) == 1 and (
                move.nbytes < PACK_BELOW
                or (pack_casts and move.src_dtype != move.dtype)
            )
            if len(receivers) > 1:
                broadcasts += 1
            mine = tuple(_my_dests(move, rank))
            if move.src == rank or mine:
                nbytes += move.nbytes
            if move.src == rank:
                for receiver in receivers:
                    if small:
                        packs_out.setdefault(receiver, []).append(move)
                    else:
                        ops.append((move, receiver, ()))
                sent += move.nbytes * len(receivers)
            if not mine:
                continue
            received += move.nbytes
            if small:
                packs_in.setdefault(move.src, []).append(move)
            else:
                ops.append((move, move.src, mine))
        peers = {m.src for m in moves} | {d.rank for m in moves for d in m.dests}
        return cls(
            tuple(ops),
            tuple((r, _Pack.of(p, rank)) for r, p in packs_out.items()),
            tuple((r, _Pack.of(p, rank)) for r, p in packs_in.items()),
            sent,
            received,
            broadcasts,
            nbytes,
            tuple(sorted(peers - {rank})),
        )


class _Regions:
    """What ``execute`` derives from a plan for one rank, once per plan (kept in its
    ``memo``; a plan runs every update of a run): its rounds and their routes, its local
    copies, and the views of every region its moves read and write. A view is made by
    slicing the first time (``Move.src_index``, ``Move.dest_index``) and then by one
    ``as_strided`` from its sizes, strides and offset in its base, for as long as the
    base has the same shape and strides (a shard received anew, the same parameters): a
    MoE plan has tens of thousands of regions, and slicing one
    costs several times that."""

    def __init__(self, plan: Plan, rank: int, pack_casts: bool = False) -> None:
        self.rank, self.pack_casts = rank, pack_casts
        self.rounds = _rounds(plan, rank)
        self.pairs = _pairs(self.rounds)
        self.local = plan.local_for(rank)
        self.local_bytes = sum(m.nbytes for m in self.local)
        self._routes: List[Optional[_Route]] = [None] * len(self.rounds)
        self._specs: Dict[tuple, tuple] = {}
        # pr: scale
        self._programs: Dict[object, Optional[CopyProgram]] = {}
        # pr: scale end

    @classmethod
    def of(cls, plan: Plan, rank: int, pack_casts: bool = False) -> _Regions:
        key = ("regions", rank, pack_casts)
        found = plan.memo.get(key)
        if found is None:
            found = plan.memo[key] = cls(plan, rank, pack_casts)
        return found

    def route(self, i: int) -> _Route:
        found = self._routes[i]
        if found is None:
            found = self._routes[i] = _Route.of(
                self.rounds[i], self.rank, self.pack_casts
            )
        return found

    def copy(self, key, dst_bases, src_bases, views, src_from=None) -> None:
        """Copy regions of ``src_bases()`` into regions of ``dst_bases`` (``apply.
        write_regions`` of ``views()``: destination and source views); ``key`` names the
        copies of one kind of an update (the local ones, one round's landings)."""
        # pr: scale
        # as the few strided copies of the ``CopyProgram`` kept under ``key``, while the
        # tensors lie as they did when it was made; made from this update's views otherwise
        # (``src_from``: the mapping the sources come from, ``CopyProgram.run``)
        program = self._programs.get(key)
        if program is not None and program.run(
            dst_bases, None if program.keeps(src_from) else src_bases(), src_from
        ):
            return
        # pr: scale end
        dst, src = views()
        # pr: scale
        if key not in self._programs or program is not None:
            self._programs[key] = CopyProgram.compile(dst, src, dst_bases, src_bases())
        # pr: scale end
        write_regions(dst, src)

    def src(self, shards, move: Move) -> torch.Tensor:
        """``_src_view``."""
        base = shards[move.holder.buffer]
        key = id(move)
        spec = self._specs.get(key)
        if spec is not None and spec[0] == base.shape and spec[1] == base.stride():
            return base.as_strided(spec[2], spec[3], base.storage_offset() + spec[4])
        return self._keep(key, base, base[move.src_index])

    def dest(self, params, dest: Dest, move: Move) -> torch.Tensor:
        """``_dest_view``."""
        for i, d in enumerate(move.dests):
            if d is dest:
                break
        else:  # an equal dest that is not one of the move's own objects
            return _dest_view(params, dest, move)
        base = params[dest.param]
        key = (id(move), i)
        spec = self._specs.get(key)
        if spec is not None and spec[0] == base.shape and spec[1] == base.stride():
            return base.as_strided(spec[2], spec[3], base.storage_offset() + spec[4])
        return self._keep(key, base, _dest_view(params, dest, move))

    def _keep(self, key, base: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """Keep how ``view`` lies in ``base`` (a plain strided tensor only: a subclass may
        slice otherwise)."""
        if type(base) in _PLAIN and view.untyped_storage().data_ptr() == (
            base.untyped_storage().data_ptr()
        ):
            self._specs[key] = (
                base.shape,
                base.stride(),
                tuple(view.shape),
                view.stride(),
                view.storage_offset() - base.storage_offset(),
            )
        return view


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _pairs(rounds: List[List[Move]]) -> Set[Tuple[int, int]]:
    """Every (sender, receiver) pair of ``rounds``."""
    return {(m.src, r) for moves in rounds for m in moves for r in _receivers(m)}


def _finish_round(
    params, flight, staging, wait_for, deferred=None, regions=None
) -> None:
    """Wait for a started round's work, then land what it received (with ``deferred``:
    hand it over)."""
    works, landings, packs = flight
    t0 = time.perf_counter()
    for work in works:
        wait_for(work)
    staging.stats.wait_seconds += time.perf_counter() - t0
    if deferred is not None:
        deferred.landed(
            [
                x if isinstance(x, PackLanding) else Landing(x[0], x[1], tuple(x[2]))
                for x in landings
            ]
        )
        return
    t0 = time.perf_counter()
    _finish_landings(params, landings, regions)
    for pack, bases in packs:
        pack.land(regions, params, bases)
    staging.stats.copy_seconds += time.perf_counter() - t0


def _receivers(move: Move) -> List[int]:
    return list(dict.fromkeys(d.rank for d in move.dests))


def _my_dests(move: Move, rank: int) -> List[Dest]:
    return [d for d in move.dests if d.rank == rank]


def _landing(
    params, dest: Dest, move: Move, staging: _Staging, regions: _Regions
) -> torch.Tensor:
    """Receive straight into the parameter when the region is contiguous there and on the
    group's device; otherwise into staging on that device."""
    view = regions.dest(params, dest, move)
    if view.is_contiguous() and view.device == staging.device:
        return view
    return staging.empty(view.shape, move.dtype)


def _finish_landings(params, landings, regions: Optional[_Regions] = None) -> None:
    """Write each (received buffer, move, this rank's dests) into its parameter regions."""
    view_of = _dest_view if regions is None else regions.dest
    views, bufs = [], []
    for buf, move, dests in landings:
        for dest in dests:
            views.append(view_of(params, dest, move))
            bufs.append(buf)
    write_regions(views, bufs)


# pr: fp8
def exchange_payloads(
    data: DataGroup,
    rank: int,
    outgoing: Mapping[int, torch.Tensor],
    incoming: Sequence[int],
    timeout_s: Optional[float],
    phase: str,
) -> Dict[int, torch.Tensor]:
    """Byte payloads whose sizes only the sender knows (a delta update's records, blocks
    quantized at the sender): every buffer of ``outgoing`` (receiver -> 1-d uint8,
    non-empty) to its receiver, one from each rank of ``incoming``, in two batches of
    point-to-point operations: the sizes (one int64 each), then the payloads. Both ends
    list the same pairs (the same plan). Posted and waited as the rounds of ``execute``
    are (``DataGroup.post``, ``DataGroup.wait``): NCCL's set-up within ``timeout_s``, a
    wait that runs out polled and the group abandoned before ``PeerLost`` leaves."""

    def to_global(r: int) -> int:
        return r if data.group is None else dist.get_global_rank(data.group, r)

    def run(pairs_out, pairs_in, what: str) -> None:
        ops = [
            dist.P2POp(dist.isend, buf, to_global(peer), data.group)
            for peer, buf in pairs_out
        ] + [
            dist.P2POp(dist.irecv, buf, to_global(peer), data.group)
            for peer, buf in pairs_in
        ]
        if not ops:
            return
        step = f"{phase} ({what})"
        for work in data.post(ops, step, timeout_s):
            data.wait(work, timeout_s, step)

    out = {p: b.to(data.device).contiguous() for p, b in sorted(outgoing.items())}
    sizes_out = [
        (p, torch.tensor([b.numel()], dtype=torch.int64, device=data.device))
        for p, b in out.items()
    ]
    sizes_in = [
        (p, torch.zeros(1, dtype=torch.int64, device=data.device))
        for p in sorted(incoming)
    ]
    run(sizes_out, sizes_in, "the payloads' sizes")
    bufs = {
        p: torch.empty(int(n.item()), dtype=torch.uint8, device=data.device)
        for p, n in sizes_in
    }
    run(list(out.items()), list(bufs.items()), "the payloads")
    return bufs


def exchange_round(
    data: DataGroup,
    rank: int,
    outgoing: Mapping[int, torch.Tensor],
    senders: Sequence[int],
    timeout_s: Optional[float],
    phase: str,
    stats: ExecutionStats,
) -> Dict[int, torch.Tensor]:
    """One round of byte payloads (``exchange_payloads``): ``outgoing`` to their receivers
    and one from each of ``senders``, the phase naming the round's peers; its bytes each
    way, its wait and its point-to-point operations counted in ``stats``."""
    peers = sorted(set(outgoing) | set(senders))
    stats.bytes_sent += sum(b.numel() for b in outgoing.values())
    t0 = time.perf_counter()
    got = exchange_payloads(
        data, rank, outgoing, senders, timeout_s, f"{phase} with ranks {peers}"
    )
    stats.wait_seconds += time.perf_counter() - t0
    stats.p2p_ops += 2 * (len(outgoing) + len(got))
    stats.bytes_received += sum(b.numel() for b in got.values())
    return got


def source_region(shards, move: Move) -> torch.Tensor:
    """The region ``move`` reads, in its holder's local buffer (a view)."""
    return _src_view(shards, move)


def dest_region(params, dest: Dest, move: Move) -> torch.Tensor:
    """The parameter region ``move`` writes at ``dest``, dims in the region's order (a view)."""
    return _dest_view(params, dest, move)


def rank_rounds(plan: Plan, rank: int) -> List[List[Move]]:
    """``rank``'s moves of each round of ``plan`` in which it has one."""
    return _rounds(plan, rank)


def _src_view(shards, move: Move) -> torch.Tensor:
    return shards[move.holder.buffer][move.src_index]


# pr: fp8 end
def _dest_view(params, dest: Dest, move: Move) -> torch.Tensor:
    """The parameter region a move lands in, with its dims in the moved region's (HF) order
    (the move's index tuples: ``Move.dest_index``)."""
    for d, (index, unperm) in zip(move.dests, move.dest_index):
        if d is dest:
            break
    else:  # an equal dest that is not one of the move's own objects
        index, unperm = move.dest_index[move.dests.index(dest)]
    param = params[dest.param]
    view = (param[dest.index] if dest.index else param)[index]
    return view if unperm is None else view.permute(unperm)


def _check_param(
    params,
    rank: int,
    name: str,
    index: Tuple[int, ...],
    shape: Tuple[int, ...],
    device: Optional[torch.device],
) -> List[str]:
    param = params.get(name)
    if param is None:
        return [f"rank {rank}: no parameter {name!r}"]
    if tuple(param.shape[len(index) :]) != shape or any(
        i >= n for i, n in zip(index, param.shape)
    ):
        return [
            f"rank {rank}: parameter {name!r} has shape {tuple(param.shape)}, plan expects {shape} "
            f"after indices up to {index}"
        ]
    if param.device.type == "meta":
        return [
            f"rank {rank}: parameter {name!r} is on {param.device}, which holds no data; "
            f"the data group moves tensors on {device or 'its device'}"
        ]
    return []


def _GONE() -> None:
    """A weak reference's answer once its tensor is gone: no shard is it."""
    return None


def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src.is_floating_point and dst.is_floating_point)
