"""The control plane: every collective of an update that is not a data move, each bounded.

The executor moves tensors (the data plane); everything else the ranks say to each
other goes through a ``ControlGroup``: agreeing on a value or a plan, sharing problems,
figures and derived targets, barriers, the channel token, the engines' groups, Megatron
coordinates. Every call is started asynchronously and waited for at most ``timeout_s``:
a peer that died or never came makes it raise ``PeerLost`` naming the phase (and, at
barriers, the ranks that never arrived), instead of blocking for the process group's
timeout or for ever. Nothing here pickles what a peer sent, except
``broadcast_object``'s answer from a rank of the same trainer.

A ``ControlGroup`` belongs to the object that runs updates over its group (the
engine's weight sync, a trainer channel, ``VerlEngine``): its barrier count, which must
be the same on every rank, lives and dies with that object. Over a group that is not
gloo alone (a trainer's ``cpu:gloo,cuda:nccl`` or NCCL mesh group) it runs on a gloo group
of its own over the same ranks: control tensors stay on the host, barriers can name the
ranks that never came (``monitored_barrier`` is gloo's), and a control wait that times out
never aborts a NCCL communicator the trainer computes with.

A wait that fails leaves its group unusable: gloo keeps the collective given up on
pending (a peer that comes late completes it with this rank's contribution) and a barrier
that times out closes its connections. The group is then marked ``lost`` and its owner
makes a new one: the engine's weight sync does so on every TP rank at the start of the
next update, over a gloo group of its own (``own``), never SGLang's TP group, whose
collectives serving relies on.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.protocol import (
    GRACE_S,
    MAX_TIMEOUT_S,
    answer_bound_s,
    trainer_bound_s,
)
from sglang.srt.weight_sync.sglang_compat import unsplit_groups

# isort: split
# pr: safety
from sglang.srt.weight_sync.nccl_watchdog import data_plane_env

# pr: safety end

__all__ = (
    "Agreement",
    "BoundTooLong",
    "ControlGroup",
    "GRACE_S",
    "GroupRefusal",
    "PeerLost",
    "PlanDisagreement",
    "answer_bound_s",
    "check_bound",
    "check_group_timeout",
    "collective_device",
    "forget_keys",
    "fresh_group",
    "group_number_proposal",
    "plan_disagreement",
    "group_timeout_s",
    "poll",
    "join_group",
    "leave_group",
    "wait",
)

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 2048  # per rank, in the all-reduce that shares problems
RESULT_BYTES = 4096  # an engine's answer, as every trainer rank of its group hears it


class PeerLost(RuntimeError):
    """A peer of a collective did not answer within the bound (dead, hung or far behind).

    ``outcome``: raised by a trainer rank while an engine applied an update, what this rank
    knows of the engine's answer (``trainer_flow.UpdateOutcome``); None elsewhere."""

    outcome = None


class BoundTooLong(ValueError):
    """A bounded wait longer than its NCCL group's own timeout (the watchdog would end it first)."""


class PlanDisagreement(RuntimeError):
    """The ranks are about to run different plans (different inputs on some rank)."""


class GroupRefusal(RuntimeError):
    """An update every rank of a group refused before any byte moved: every rank's problems,
    shared (``ControlGroup.share_problems``), so that all raise the same refusal."""


def wait(work, timeout_s: Optional[float], phase: str) -> None:
    """Wait for an async collective's ``work`` at most ``timeout_s`` seconds (None: the
    process group's own timeout, for callers outside an update such as tests)."""
    if timeout_s is None:
        work.wait()
        return
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PeerLost(
            f"{phase}: a peer did not answer within {timeout_s:g}s ({e})"
        ) from None


# ``poll``'s pauses between two looks at a work: the first short (a round that is nearly done
# costs little more than a blocking wait), doubling up to the longest (a waiting rank takes a
# few per cent of a core, not one), and never longer than ``POLL_SHARE`` of the time waited
# so far (a pause overshoots a work's end by at most that share of its wait)
POLL_FIRST_S = 50e-6
POLL_LONGEST_S = 2e-3
POLL_SHARE = 0.125


def poll(
    work,
    timeout_s: float,
    phase: str,
    give_up: Callable[[], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait for ``work`` at most ``timeout_s`` seconds by asking whether it completed
    (``is_completed``), never through ``work.wait(timeout=...)``: on NCCL that wait aborts
    the work's communicator itself, and the group's watchdog, which holds the same work,
    then reads the communicator's error, signals a dump to every rank and rethrows in its
    own thread (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, the default: ``std::terminate``).
    When the bound runs out, ``give_up`` (the owner aborts the whole group:
    ``ProcessGroupNCCL::abort`` marks the group terminating before it aborts the
    communicators, and from then on the watchdog reads no communicator's error) runs
    before ``PeerLost`` is raised. A work that completed is then waited for once without a
    timeout: on NCCL that joins the current stream to the work's, and raises the work's own
    error, if any (a communicator error: ``give_up`` too). Gloo's send and receive works
    complete only inside ``wait``: poll NCCL work only (``executor.DataGroup``)."""
    start = clock()
    deadline = start + timeout_s
    pause = POLL_FIRST_S
    while not work.is_completed():
        now = clock()
        left = deadline - now
        if left <= 0:
            give_up()
            raise PeerLost(
                f"{phase}: a peer did not answer within {timeout_s:g}s (the group was aborted)"
            )
        sleep(min(pause, left))
        pause = min(
            2 * pause, POLL_LONGEST_S, max(POLL_FIRST_S, POLL_SHARE * (now - start))
        )
    try:
        work.wait()
    except RuntimeError as e:
        give_up()
        raise PeerLost(f"{phase}: the transfer failed ({e})") from None


def collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where small control tensors of ``group`` live: the CPU when the group has a CPU
    backend (``gloo``, ``cpu:gloo,cuda:nccl``), the current GPU when it is NCCL only.
    Every control tensor is allocated there explicitly, never on the default device
    (which a ``with torch.device(...)`` block around a caller may have changed)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def group_timeout_s(
    group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None
) -> Optional[float]:
    """The timeout ``group``'s backend for ``device`` (None: the CPU) was created with, or
    None where torch does not say."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = pg._get_backend(device or torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


def check_bound(
    group: Optional[dist.ProcessGroup],
    bound_s: float,
    what: str,
    device: Optional[torch.device],
) -> None:
    """Refuse (``BoundTooLong``) a wait of up to ``bound_s`` in a collective of ``group`` on
    ``device`` that the group's own timeout would cut short on NCCL: its watchdog aborts
    the communicator (and with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` the process) when a
    collective outlives the group's timeout, so every bound must stay below it. On gloo
    (``device`` None or the CPU) a wait past the timeout ends in gloo's own error: still
    bounded, never fatal, so it is not refused. The same answer on every rank."""
    if device is None or device.type != "cuda":
        return
    limit = group_timeout_s(group, device)
    if limit is not None and bound_s >= limit:
        raise BoundTooLong(
            f"{what} waits up to {bound_s:g}s on an NCCL group whose timeout is {limit:g}s: the "
            "NCCL watchdog would abort the group first; pass a smaller timeout_s or create the "
            "group with a longer timeout"
        )


def check_group_timeout(timeout_s: float, what: str) -> float:
    """``timeout_s`` for a group this package makes for itself (the engine's data group, a
    weight-sync group's data and control groups), refused (``BoundTooLong``) unless it is above
    every bound an update waits with: the largest, ``trainer_bound_s(MAX_TIMEOUT_S)``, is
    itself above ``MAX_TIMEOUT_S + GRACE_S``. Otherwise NCCL's watchdog could abort a wait on
    the group (and end the process) before its bound does. Checked where the group is made.
    The watchdog's other delays (``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``,
    ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``) count only from an error the watchdog found
    itself, which a polled wait never leaves it (``poll``); what it does with one is checked
    where the group is made (``join_group``: never the process's end)."""
    largest = trainer_bound_s(MAX_TIMEOUT_S)
    if not timeout_s > largest:
        raise BoundTooLong(
            f"{what}: a group timeout of {timeout_s:g}s is not above the largest bound an "
            f"update waits with, {largest:g}s (2 * MAX_TIMEOUT_S={MAX_TIMEOUT_S:g} + "
            f"GRACE_S={GRACE_S:g}): the NCCL watchdog could end a wait before its bound"
        )
    return timeout_s


@dataclass(frozen=True)
class Agreement:
    """What ``ControlGroup.agree`` found: every rank's problems (empty: none), the names of
    the values that differ between ranks, the names of the flags some rank raised, and the
    highest of each rank's proposals (a count every rank then takes, e.g. ``fresh_group``'s
    number)."""

    problems: Tuple[str, ...]
    unequal: Tuple[str, ...]
    raised: Tuple[str, ...]
    highest: Mapping[str, int] = field(default_factory=dict)


def plan_disagreement(fingerprint: str, who: str) -> PlanDisagreement:
    """The error for ranks about to run different plans (``fingerprint``: this rank's)."""
    return PlanDisagreement(
        f"{who}: the TP ranks computed different plans (this rank's {fingerprint[:15]}): "
        "the trainer ranks delivered different tensor names or layouts (MeshSpec) for this update"
    )


class ControlGroup:
    """The control collectives over ``group`` (None: the default group), each bounded.

    ``name`` keeps the barrier marks of two owners of the same ranks apart in the
    store; every rank of the group creates its ``ControlGroup`` with the same name and
    enters its barriers in the same order. ``own``: run on a gloo group of its own even
    over a gloo ``group`` (the engine's: a wait given up on SGLang's own TP group would
    leave that group out of step for serving). A wait that fails marks the group ``lost``.
    ``setup_s``: the bound of making that gloo group (its ranks meet in the store and
    connect to each other, waiting for the group's own timeout, hours, without one): a rank
    that never comes is ``PeerLost`` within it on the others.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        name: str,
        own: bool = False,
        rank: Optional[int] = None,
        store: Optional[dist.Store] = None,
        setup_s: Optional[float] = None,
    ) -> None:
        self.name = name
        self.ranks: Tuple[int, ...] = (
            tuple(dist.get_process_group_ranks(group))
            if group is not None
            else tuple(range(dist.get_world_size()))
        )
        try:
            self.group = _gloo_group(group, self.ranks, own, setup_s)
        except RuntimeError as e:  # gloo's rendezvous or connection ran out ``setup_s``
            raise PeerLost(
                f"making the control group {name!r} over ranks {list(self.ranks)}: "
                f"a rank never came within {setup_s:g}s ({type(e).__name__}: {e})"
            ) from None
        self.own = own
        self.device = collective_device(self.group)
        # this process's rank in the group; a group that spans processes of other worlds
        # (``join_group``) says so itself, as torch maps ranks through this world's
        self.rank = dist.get_rank(self.group) if rank is None else rank
        self._store = store
        self._barriers = 0
        self.round_trips = 0  # collectives waited on so far (``phase_timing``)
        # why a wait on this group failed: its peers may still complete the collective it
        # gave up (gloo keeps it pending) or find its connections closed, so it is not used again
        self.lost: Optional[str] = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _wait(self, work, timeout_s: Optional[float], phase: str) -> None:
        """``wait``, marking the group lost when the wait fails."""
        try:
            wait(work, timeout_s, phase)
        except PeerLost as e:
            self.lost = str(e)
            raise

    def _reduce(
        self,
        t: torch.Tensor,
        timeout_s: Optional[float],
        phase: str,
        op=dist.ReduceOp.SUM,
    ) -> torch.Tensor:
        self.round_trips += 1
        self._wait(
            dist.all_reduce(t, op=op, group=self.group, async_op=True), timeout_s, phase
        )
        return t

    def all_equal(self, value: int, timeout_s: Optional[float], phase: str) -> bool:
        """Whether every rank holds the same ``value`` (one all-reduce of ``[value, -value]`` with MAX)."""
        both = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        self._reduce(both, timeout_s, phase, dist.ReduceOp.MAX)
        return both[0].item() == value and -both[1].item() == value

    def any(self, flag: bool, timeout_s: Optional[float], phase: str) -> bool:
        """Whether any rank says so: keeps every rank on one path."""
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        return bool(self._reduce(t, timeout_s, phase, dist.ReduceOp.MAX).item())

    def agree_on_plan(
        self, fingerprint: str, timeout_s: Optional[float], who: str
    ) -> None:
        """Raise ``PlanDisagreement`` unless every rank is about to run the plan ``fingerprint``."""
        if not self.all_equal(
            int(fingerprint[:15], 16), timeout_s, f"{who}: plan agreement"
        ):
            raise plan_disagreement(fingerprint, who)

    def agree(
        self,
        problems: Sequence[str],
        values: Mapping[str, int],
        flags: Mapping[str, bool],
        timeout_s: Optional[float],
        phase: str,
        proposals: Optional[Mapping[str, int]] = None,
    ) -> Agreement:
        """Whether any rank has problems, which ``values`` (non-negative, below 2**62) differ
        between ranks, which ``flags`` some rank raised and the highest of ``proposals``, in
        one all-reduce; every rank's problems follow (``share_problems``) only when some rank
        has one. Every rank passes the same names, in the same order."""
        names, raised = list(values), list(flags)
        proposed = list(proposals or {})
        vector = [int(bool(problems))]
        for name in names:
            vector += [int(values[name]), -int(values[name])]
        vector += [int(bool(flags[name])) for name in raised]
        vector += [int(proposals[name]) for name in proposed]
        t = torch.tensor(vector, dtype=torch.int64, device=self.device)
        got = self._reduce(t, timeout_s, phase, dist.ReduceOp.MAX).tolist()
        every = tuple(self.share_problems(problems, timeout_s, phase)) if got[0] else ()
        unequal = tuple(
            name for i, name in enumerate(names) if got[1 + 2 * i] != -got[2 + 2 * i]
        )
        base = 1 + 2 * len(names)
        top = base + len(raised)
        return Agreement(
            every,
            unequal,
            tuple(name for i, name in enumerate(raised) if got[base + i]),
            {name: got[top + i] for i, name in enumerate(proposed)},
        )

    def all_gather_ints(
        self, mine: Sequence[int], timeout_s: Optional[float], phase: str
    ) -> List[List[int]]:
        """Every rank's ``mine`` (the same length everywhere), in group rank order."""
        t = torch.tensor(list(mine), dtype=torch.int64, device=self.device)
        every = torch.empty(
            self.size * len(mine), dtype=torch.int64, device=self.device
        )
        self.round_trips += 1
        self._wait(
            dist.all_gather_into_tensor(every, t, group=self.group, async_op=True),
            timeout_s,
            phase,
        )
        return every.view(self.size, len(mine)).tolist()

    def share_bytes(
        self, mine: bytes, timeout_s: Optional[float], phase: str
    ) -> List[bytes]:
        """Every rank's bytes, in rank order: lengths through one all-reduce, then one
        all-gather of byte tensors (no object gather, no pickle)."""
        if self.size == 1:
            return [mine]
        lengths = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        lengths[self.rank] = len(mine)
        self._reduce(lengths, timeout_s, phase)
        width = int(lengths.max())
        padded = torch.zeros(width, dtype=torch.uint8, device="cpu")
        padded[: len(mine)] = (
            torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else padded[:0]
        )
        padded = padded.to(self.device)
        gathered = [
            torch.empty(width, dtype=torch.uint8, device=self.device)
            for _ in range(self.size)
        ]
        self.round_trips += 1
        self._wait(
            dist.all_gather(gathered, padded, group=self.group, async_op=True),
            timeout_s,
            phase,
        )
        return [
            t[:n].cpu().numpy().tobytes() for t, n in zip(gathered, lengths.tolist())
        ]

    def share_problems(
        self, problems: Sequence[str], timeout_s: Optional[float], phase: str
    ) -> List[str]:
        """Every rank's problems (each rank's text cut at ``MESSAGE_BYTES``), through one all-reduce."""
        text = "; ".join(problems).encode()[:MESSAGE_BYTES]
        table = torch.zeros(self.size, MESSAGE_BYTES, dtype=torch.uint8, device="cpu")
        if text:
            table[self.rank, : len(text)] = torch.frombuffer(
                bytearray(text), dtype=torch.uint8
            )
        table = self._reduce(table.to(self.device), timeout_s, phase).cpu()
        return [
            bytes(row[row.nonzero().flatten()].tolist()).decode(errors="replace")
            for row in table
            if row.any()
        ]

    def share_figures(
        self, mine: Sequence[int], timeout_s: Optional[float], phase: str
    ) -> List[List[int]]:
        """Each figure of every rank (a figures x ranks table), on every rank: one all-reduce."""
        table = torch.zeros(len(mine), self.size, dtype=torch.int64, device=self.device)
        table[:, self.rank] = torch.tensor(
            list(mine), dtype=torch.int64, device=self.device
        )
        return self._reduce(table, timeout_s, phase).tolist()

    def broadcast_bytes(
        self,
        data: Optional[bytes],
        src: int,
        size: int,
        timeout_s: Optional[float],
        phase: str,
    ) -> bytes:
        """``src``'s ``data`` (at most ``size`` bytes, global rank ``src``) on every rank, as a
        fixed-size tensor broadcast (``broadcast_object_list`` cannot be bounded)."""
        buf = torch.zeros(size + 8, dtype=torch.uint8, device="cpu")
        if data is not None:
            if len(data) > size:
                raise ValueError(
                    f"{phase}: {len(data)} bytes to broadcast, at most {size}"
                )
            buf[:8] = torch.tensor(
                list(len(data).to_bytes(8, "little")), dtype=torch.uint8, device="cpu"
            )
            if data:
                buf[8 : 8 + len(data)] = torch.frombuffer(
                    bytearray(data), dtype=torch.uint8
                )
        buf = buf.to(self.device)
        self.round_trips += 1
        self._wait(
            dist.broadcast(buf, src=src, group=self.group, async_op=True),
            timeout_s,
            phase,
        )
        raw = bytes(buf.cpu().tolist())
        return raw[8 : 8 + int.from_bytes(raw[:8], "little")]

    def broadcast_result(
        self,
        result: Optional[Tuple[bool, str]],
        src: int,
        timeout_s: Optional[float],
        phase: str,
    ) -> Tuple[bool, str]:
        """``src``'s (success, message) on every rank (the message cut to fit ``RESULT_BYTES``)."""
        data = None
        if result is not None:
            data = ((b"1" if result[0] else b"0") + result[1].encode())[:RESULT_BYTES]
        got = self.broadcast_bytes(data, src, RESULT_BYTES, timeout_s, phase)
        return got[:1] == b"1", got[1:].decode(errors="replace")

    def broadcast_object(self, value, src: int, timeout_s: Optional[float], phase: str):
        """``src``'s picklable ``value`` on every rank: its length first, then its bytes (two
        bounded broadcasts). Only for values this group's own ranks produce."""
        data = pickle.dumps(value) if self.rank == self.ranks.index(src) else None
        length = torch.tensor(
            [len(data) if data is not None else 0],
            dtype=torch.int64,
            device=self.device,
        )
        self.round_trips += 1
        self._wait(
            dist.broadcast(length, src=src, group=self.group, async_op=True),
            timeout_s,
            phase,
        )
        return pickle.loads(
            self.broadcast_bytes(data, src, int(length.item()), timeout_s, phase)
        )

    def _device_barrier(self):
        """An async barrier on this group's device: on NCCL, on the current GPU by name
        (torch otherwise guesses the GPU from the rank)."""
        if self.device.type == "cuda":
            return dist.barrier(
                group=self.group, async_op=True, device_ids=[self.device.index]
            )
        return dist.barrier(group=self.group, async_op=True)

    def barrier(self, timeout_s: Optional[float], phase: str) -> None:
        """A barrier bounded by ``timeout_s``. On failure the error names the ranks that
        never reached it: each rank marks its arrival in the default group's store first
        (a dead peer's closed connection makes gloo say only "Connection closed by peer").
        ``timeout_s=None``: bounded by the group's own timeout only, for waits on work of
        unknown length outside an update (a peer starting an engine or generating).

        On a group of its own (``own``, the engine's) every rank's wait is bounded alike:
        gloo's ``monitored_barrier`` bounds only its first rank's wait, and the others wait
        without bound for that rank's reply, which never comes once it gave the group up."""
        self.round_trips += 1
        if timeout_s is None:
            try:
                self._wait(self._device_barrier(), None, phase)
            except RuntimeError as e:
                self.lost = f"{phase}: {e}"
                raise PeerLost(self.lost) from None
            return
        me, tag = self.ranks[self.rank], ",".join(map(str, self.ranks))
        self._barriers += 1
        prefix = f"weight_sync/{self.name}/barrier/{tag}"
        keys = {r: f"{prefix}/{self._barriers}/{r}" for r in self.ranks}
        store = self._store if self._store is not None else _store()
        if store is not None:
            store.set(keys[me], "1")
            if (
                self._barriers > 1
            ):  # every rank passed the previous one: its mark is no longer needed
                store.delete_key(f"{prefix}/{self._barriers - 1}/{me}")
        try:
            if self.device.type == "cpu" and not self.own:
                dist.monitored_barrier(
                    group=self.group,
                    timeout=timedelta(seconds=timeout_s),
                    wait_all_ranks=True,
                )
            else:
                self._device_barrier().wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            absent = [
                r for r, k in keys.items() if store is not None and not store.check([k])
            ]
            named = f"ranks {absent} never reached it; " if absent else ""
            self.lost = f"{phase}: {named}{e} (within {timeout_s:g}s)"
            raise PeerLost(self.lost) from None


def join_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    backend: str,
    timeout_s: float,
    ranks: Optional[Sequence[int]] = None,
    setup_s: Optional[float] = None,
) -> dist.ProcessGroup:
    """A process group of ``size`` ranks made in ``store`` under ``prefix``: ranks of other
    worlds (a trainer's ranks, SGLang engines' TP ranks) in one group, as upstream's
    ``init_weights_update_group`` makes them. Torch maps the ranks of such a group through
    this world's: its ranks are their own "global" ranks (``get_global_rank`` is the
    identity), and a caller takes its own rank from ``group.rank()``, never ``get_rank``.
    ``ranks``: the group is one of this world's ranks instead (``fresh_group``), mapped as
    ``new_group`` maps them. Its communicator is its own, never split from the default
    group's (``unsplit_groups``). ``setup_s``: the bound of its making (gloo's rendezvous in
    the store and its connections to every peer wait for the group's timeout, hours for a
    group whose timeout is above every update's bound): made with ``setup_s``, then given
    ``timeout_s``; a peer that never makes it is an error within ``setup_s`` everywhere."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    # the environment the group is made in: the process's own
    making = contextlib.nullcontext()
    # pr: safety
    # on NCCL, ``nccl_watchdog.DATA_PLANE_ENV``: the group's watchdog aborts its
    # communicators on an error it finds itself and never ends the process, writes no
    # dump signal, runs no heartbeat monitor
    making = data_plane_env(backend)
    # pr: safety end
    # its own communicator: split from the trainer's default one (bound to a device), it
    # would hold the trainer's ranks only
    with unsplit_groups(), making as watchdog:
        # pr: safety
        if watchdog is not None and watchdog.tears_down:
            raise BoundTooLong(
                f"group {prefix!r}: its NCCL watchdog would read TORCH_NCCL_ASYNC_ERROR_HANDLING="
                f"{watchdog.async_error_handling} and end the process on an error it finds"
            )
        # pr: safety end
        group, _ = _new_process_group_helper(
            size,
            rank,
            list(ranks or ()),
            Backend(backend),
            PrefixStore(prefix, store),
            group_name=prefix,
            timeout=timedelta(seconds=timeout_s if setup_s is None else setup_s),
        )
    _world.pg_group_ranks[group] = {g: r for r, g in enumerate(ranks or range(size))}
    if setup_s is not None:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
    return group


def fresh_group(
    ranks: Sequence[int],
    backend: str,
    timeout_s: float,
    number: int,
    setup_s: Optional[float] = None,
) -> dist.ProcessGroup:
    """Group ``number`` over ``ranks`` of this world (this rank among them), made by those
    ranks only, all together. ``new_group`` names a group after its ranks and how many groups
    the process holds, a count that falls back when a group is destroyed: the next group
    would take the destroyed one's name, and its ranks would meet that group's stale
    addresses in the store and hang. ``number`` names it instead: its owners agree on it
    (the highest of their proposals, ``ControlGroup.agree``) in the agreement that decides to
    make it, so a rank that missed an earlier making (it failed before, its peers timed out
    waiting for it) still takes the same number as its peers, where a count kept per rank
    or in the store would fall out of step for good. ``setup_s``: the bound of its making
    (``join_group``).

    The keys earlier groups over ``ranks`` left in the store (gloo's addresses, NCCL's
    unique id) are deleted once this one is made (``forget_keys``): every rank makes a new
    group only after the ranks agreed to drop the old one (a failed update's renewal), so no
    rank reads them again, and renewed groups leave the store no bigger than one group's keys.
    Only keys of lower numbers: a peer that already left this group (its first use failed
    at once) may be writing its address for the next one while this rank is still here.
    """
    store = _store()
    tag = _ranks_tag(ranks)
    try:
        group = join_group(
            store,
            f"weight_sync/group/{tag}/{number}",
            list(ranks).index(dist.get_rank()),
            len(ranks),
            backend,
            timeout_s,
            ranks,
            setup_s,
        )
    finally:  # made or not, the number is taken: no later group over ``ranks`` reuses it
        _take_number(store, f"weight_sync/groups/{tag}", number)
    forget_keys(store, f"weight_sync/group/{tag}", below=number)
    return group


def group_number_proposal(ranks: Sequence[int], made: int) -> int:
    """This rank's proposal for the number of the next ``fresh_group`` over ``ranks``: above
    every number its owner used (``made``, how many it made or tried) and every number any
    owner in this world took over these ranks (kept in the default store, which a second
    owner over the same ranks in one process, or a rank that restarted, reads too)."""
    store = _store()
    if store is None:
        return made
    return max(made, store.add(f"weight_sync/groups/{_ranks_tag(ranks)}", 0))


def _take_number(store: dist.Store, key: str, number: int) -> None:
    """Raise the count at ``key`` to ``number + 1`` unless it is there already (every rank
    of a group does it; the store swaps the value only while it is the one read)."""
    taken = store.add(key, 0)
    while taken <= number:
        taken = int(store.compare_set(key, str(taken), str(number + 1)))


def _ranks_tag(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks))


def forget_keys(store: dist.Store, prefix: str, below: Optional[int] = None) -> int:
    """Delete every key of ``store`` under ``prefix`` (the rendezvous of a group every rank
    left); with ``below``, only those under ``prefix/<n>/`` for a number ``n < below`` (the
    groups before group ``below``: never a later one's, which a faster peer may be making
    already). Returns how many it deleted. Listed through ``store`` itself and matched on
    ``prefix/`` exactly (a ``PrefixStore``'s own listing matches its prefix without the
    separator: group ``1`` would list group ``10``'s keys). A store that cannot list its
    keys (a torch without ``list_keys``, a store type without it) is left as it is: 0.
    Deleting a key a peer deleted first is harmless, so every rank may run it."""
    try:
        keys = store.list_keys()
    except (AttributeError, NotImplementedError, RuntimeError):
        return 0
    gone = [
        k for k in keys if k.startswith(f"{prefix}/") and _earlier(k, prefix, below)
    ]
    for key in gone:
        store.delete_key(key)
    return len(gone)


def _earlier(key: str, prefix: str, below: Optional[int]) -> bool:
    """Whether ``key`` (under ``prefix/``) is a key of a group numbered below ``below``
    (every key when ``below`` is None; a key not under a number is kept)."""
    if below is None:
        return True
    number = key[len(prefix) + 1 :].split("/", 1)[0]
    return number.isdigit() and int(number) < below


def leave_group(group: Optional[dist.ProcessGroup], destroy: bool = True) -> None:
    """Abort ``group``'s pending work where the backend can (NCCL) and destroy it: after a
    failed wait neither its work nor its threads (NCCL's watchdog and heartbeat monitor, gloo's
    workers) nor its entry in torch's registry may outlive it. ``destroy=False``: abort only (a
    group this package does not own). A group torch no longer knows (the default group went
    first) is left alone; any other failure to destroy is logged, never raised: the caller is
    already handling a failure."""
    if group is None:
        return
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - gloo has no abort; nothing pending outlives a wait there
        pass
    if not destroy:
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # "Invalid process group specified": already destroyed
        pass
    except Exception as e:  # noqa: BLE001 - cleanup after a failure must not raise
        logger.warning(
            "weight sync: destroying process group %r failed: %s: %s",
            getattr(group, "group_name", "?"),
            type(e).__name__,
            e,
        )


def _gloo_group(
    group: Optional[dist.ProcessGroup],
    ranks: Tuple[int, ...],
    own: bool = False,
    setup_s: Optional[float] = None,
) -> Optional[dist.ProcessGroup]:
    """``group`` itself when it is gloo alone (and ``own`` is not asked), else a gloo group
    over the same ranks (created by those ranks only, in the same order everywhere: the
    owners of a ``ControlGroup`` build it at the same point of their flow), made within
    ``setup_s`` when given. Its timeout is above every bound an update waits for, so the
    bounds here are what ends a wait."""
    if not dist.is_gloo_available() or (
        not own and str(dist.get_backend(group)).lower() == "gloo"
    ):
        return group
    timeout = timedelta(seconds=answer_bound_s(MAX_TIMEOUT_S) + GRACE_S)
    made = dist.new_group(
        list(ranks),
        backend="gloo",
        timeout=timeout if setup_s is None else timedelta(seconds=setup_s),
        use_local_synchronization=True,
    )
    if setup_s is not None and made is not None:
        dist.distributed_c10d._set_pg_timeout(timeout, made)
    return made


def _store() -> Optional[dist.Store]:
    """The default process group's store (every rank reaches it), if there is one."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
