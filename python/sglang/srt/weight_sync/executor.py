"""Execute: run a plan over a process group. The data plane: the only code that moves tensors between ranks.

Every rank runs the same plan. Zero fills and local copies need no
communication; then each round runs its point-to-point moves as one batch
(``batch_isend_irecv``) followed by its broadcasts, in plan order, over
subgroups created once. Data is received straight into the destination
parameter when the region is contiguous there, and staged otherwise; a sender
stages only to make a region contiguous or to cast it to the destination dtype
(so an fp32 trainer shard travels as bf16, one bucket at a time). All buffers
live on the device of the tensor they serve: gloo on CPU, NCCL on GPU, no
host/device copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.apply import write_region, write_zeros
from sglang.srt.weight_sync.control_plane import wait
from sglang.srt.weight_sync.planner import Dest, Move, Plan

__all__ = ("ExecutionError", "ExecutionStats", "Subgroups", "check_inputs", "execute")


class ExecutionError(RuntimeError):
    """Inputs that do not match the plan (named tensor, rank and expectation in the message)."""


@dataclass
class ExecutionStats:
    """What one rank did; bytes are payload bytes in the destination dtype."""

    bytes_received: int = 0
    bytes_sent: int = 0
    bytes_copied_locally: int = 0
    peak_staging_bytes: int = 0
    largest_round_bytes: int = 0
    rounds: int = 0
    p2p_ops: int = 0
    broadcasts: int = 0


class Subgroups:
    """Broadcast subgroups, created once per rank set and reused across the updates of their
    owner (the engine's weight sync).

    ``new_group`` is collective over the default process group: every rank of
    it creates every subgroup of the plan, members or not, in the plan's
    sorted order, which is the same everywhere. So the plan's group must be the
    default group (an engine's TP group with pp_size 1) whenever the plan has
    broadcasts.
    """

    def __init__(self) -> None:
        self._groups: Dict[Tuple[int, ...], Optional[dist.ProcessGroup]] = {}

    def get(self, global_ranks: Sequence[int]) -> dist.ProcessGroup:
        return self._groups[tuple(sorted(global_ranks))]

    def ensure(self, plan: Plan, group: Optional[dist.ProcessGroup], to_global) -> None:
        if not plan.broadcast_groups:
            return
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ExecutionError(
                f"plan has {len(plan.broadcast_groups)} broadcast subgroups but runs over a group of "
                f"{dist.get_world_size(group)} of {dist.get_world_size()} ranks; subgroups need every rank"
            )
        for ranks in plan.broadcast_groups:
            key = tuple(sorted(to_global(r) for r in ranks))
            if key not in self._groups:
                self._groups[key] = dist.new_group(list(key))


class _Staging:
    """Counts the executor's own buffers so the peak can be checked against the cap."""

    def __init__(self, stats: ExecutionStats) -> None:
        self.stats, self.live = stats, 0
        self.sent: Dict[tuple, torch.Tensor] = {}

    def empty(self, sizes, dtype, device) -> torch.Tensor:
        buf = torch.empty(sizes, dtype=dtype, device=device)
        self._add(buf)
        return buf

    def contiguous_cast(self, view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if view.dtype == dtype and view.is_contiguous():
            return view
        buf = self.empty(view.shape, dtype, view.device)
        buf.copy_(view)
        return buf

    def send_buffer(self, shards, move: Move) -> torch.Tensor:
        """The region ``move`` sends, cast and made contiguous once per round however many
        ranks it goes to (a rank-local plan sends one region to each receiver separately)."""
        key = (move.tensor, move.holder.buffer, move.region, move.dtype)
        buf = self.sent.get(key)
        if buf is None:
            buf = self.sent[key] = self.contiguous_cast(
                _src_view(shards, move), move.dtype
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
    params: Mapping[str, torch.Tensor],
) -> List[str]:
    """Problems with this rank's inputs against the plan, as messages; empty when fine.

    Run before anything is written so a bad update can be refused as a whole.
    """
    problems: List[str] = []
    seen = set()
    moves = list(plan.local_for(rank)) + [
        m for rnd in plan.rounds for m in rnd if rank in m.group
    ]
    for move in moves:
        h = move.holder
        if move.src == rank and (move.tensor, h.buffer) not in seen:
            seen.add((move.tensor, h.buffer))
            shard = shards.get(h.buffer)
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
        for d in move.dests:
            if d.rank == rank:
                problems.extend(_check_param(params, rank, d.param, d.index, d.shape))
    for z in plan.zero_fills:
        if z.rank == rank and z.param not in params:
            problems.append(f"rank {rank}: no parameter {z.param!r}")
    return sorted(set(problems))


def execute(
    plan: Plan,
    rank: int,
    shards: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    group: Optional[dist.ProcessGroup] = None,
    subgroups: Optional[Subgroups] = None,
    timeout_s: Optional[float] = None,
) -> ExecutionStats:
    """Run ``plan`` as ``rank`` (a rank of ``group``): read ``shards`` (buffer key -> this
    rank's local tensor, see ``source_layout.Holder``), write ``params`` (parameter name
    -> this rank's tensor) in place. Each round waits at most ``timeout_s`` for its peers
    (``control_plane.PeerLost``). ``subgroups``: the owner's broadcast subgroups, reused
    across updates (None: made for this call, for plans run once)."""
    problems = check_inputs(plan, rank, shards, params)
    if problems:
        raise ExecutionError("; ".join(problems))

    def to_global(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    stats = ExecutionStats()
    staging = _Staging(stats)
    subgroups = subgroups if subgroups is not None else Subgroups()
    subgroups.ensure(plan, group, to_global)

    for z in plan.zero_fills:
        if z.rank == rank:
            write_zeros(params[z.param][z.box.slices()])
    for move in plan.local_for(rank):
        write_region(_dest_view(params, move.dests[0], move), _src_view(shards, move))
        stats.bytes_copied_locally += move.nbytes

    for moves in plan.rounds:
        mine = [m for m in moves if rank in m.group]
        if not mine:
            continue
        stats.rounds += 1
        stats.largest_round_bytes = max(
            stats.largest_round_bytes,
            sum(m.nbytes for m in mine if m.src == rank or _my_dests(m, rank)),
        )
        peers = sorted(
            ({m.src for m in mine} | {d.rank for m in mine for d in m.dests}) - {rank}
        )
        phase = f"rank {rank}: executor round {stats.rounds} with ranks {peers}"
        _run_p2p(
            plan,
            rank,
            [m for m in mine if len(_receivers(m)) == 1],
            shards,
            params,
            group,
            staging,
            to_global,
            lambda work: wait(work, timeout_s, phase),
        )
        for move in mine:
            if len(_receivers(move)) > 1:
                _run_broadcast(
                    plan,
                    rank,
                    move,
                    shards,
                    params,
                    staging,
                    subgroups,
                    to_global,
                    lambda work: wait(
                        work, timeout_s, f"{phase} (broadcast of {move.tensor!r})"
                    ),
                )
        staging.release_all()
    return stats


def _run_p2p(
    plan, rank, moves, shards, params, group, staging, to_global, wait_for
) -> None:
    ops: List[dist.P2POp] = []
    landings: List[Tuple[torch.Tensor, Move, List[Dest]]] = []
    for move in moves:
        if move.src == rank:
            buf = staging.send_buffer(shards, move)
            ops.append(
                dist.P2POp(dist.isend, buf, to_global(move.dests[0].rank), group)
            )
            staging.stats.bytes_sent += move.nbytes
            staging.stats.p2p_ops += 1
        mine = _my_dests(move, rank)
        if mine:
            buf = _landing(params, mine[0], move, staging)
            ops.append(dist.P2POp(dist.irecv, buf, to_global(move.src), group))
            landings.append((buf, move, mine))
            staging.stats.bytes_received += move.nbytes
            staging.stats.p2p_ops += 1
    if ops:
        for work in dist.batch_isend_irecv(ops):
            wait_for(work)
    for buf, move, mine in landings:
        _finish_landing(params, buf, move, mine)


def _run_broadcast(
    plan, rank, move, shards, params, staging, subgroups, to_global, wait_for
) -> None:
    group = subgroups.get([to_global(r) for r in _receivers(move) + [move.src]])
    if move.src == rank:
        buf = staging.contiguous_cast(_src_view(shards, move), move.dtype)
        staging.stats.bytes_sent += move.nbytes
        wait_for(
            dist.broadcast(buf, src=to_global(move.src), group=group, async_op=True)
        )
    else:
        mine = _my_dests(move, rank)
        buf = _landing(params, mine[0], move, staging)
        wait_for(
            dist.broadcast(buf, src=to_global(move.src), group=group, async_op=True)
        )
        staging.stats.bytes_received += move.nbytes
        _finish_landing(params, buf, move, mine)
    staging.stats.broadcasts += 1


def _receivers(move: Move) -> List[int]:
    return list(dict.fromkeys(d.rank for d in move.dests))


def _my_dests(move: Move, rank: int) -> List[Dest]:
    return [d for d in move.dests if d.rank == rank]


def _landing(params, dest: Dest, move: Move, staging: _Staging) -> torch.Tensor:
    """Receive straight into the parameter when the region is contiguous there."""
    view = _dest_view(params, dest, move)
    if view.is_contiguous():
        return view
    return staging.empty(view.shape, move.dtype, view.device)


def _finish_landing(params, buf: torch.Tensor, move: Move, dests: List[Dest]) -> None:
    for dest in dests:
        write_region(_dest_view(params, dest, move), buf)


def _src_view(shards, move: Move) -> torch.Tensor:
    return shards[move.holder.buffer][move.src_box().slices()]


def _dest_view(params, dest: Dest, move: Move) -> torch.Tensor:
    """The parameter region a move lands in, with its dims in the moved region's (HF) order."""
    view = params[dest.param][dest.index][dest.box(move.region).slices()]
    if dest.perm is None:
        return view
    return view.permute(sorted(range(len(dest.perm)), key=dest.perm.__getitem__))


def _check_param(
    params, rank: int, name: str, index: Tuple[int, ...], shape: Tuple[int, ...]
) -> List[str]:
    param = params.get(name)
    if param is None:
        return [f"rank {rank}: no parameter {name!r}"]
    if tuple(param.shape[len(index) :]) != shape:
        return [
            f"rank {rank}: parameter {name!r} has shape {tuple(param.shape)}, plan expects {shape} after index {index}"
        ]
    return []


def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src.is_floating_point and dst.is_floating_point)
