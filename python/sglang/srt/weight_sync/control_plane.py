"""Bounded waits: no process of an update waits for a peer that is gone.

Every collective of an update is started asynchronously and waited for with a
bound derived from the update's ``timeout_s``. A peer that died or never came
makes the wait raise ``PeerLost`` naming the phase (and, at barriers, the ranks
that never arrived), instead of blocking for the process
group's default timeout (30 minutes) or for ever.
"""

from __future__ import annotations

import collections
from datetime import timedelta
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

# Slack over ``timeout_s`` for collectives that follow a bounded wait on another rank
# (e.g. every engine rank waits up to timeout_s for its payload before they share problems).
GRACE_S = 30.0


def answer_bound_s(timeout_s: float) -> float:
    """How long the engine's tokenizer manager waits for the answer to an update bounded by
    ``timeout_s``: the schedulers apply payloads the trainer delivered before it asked (its
    ready barrier), each of their collectives waits at most ``timeout_s + GRACE_S``, and the
    trainer ranks beside the engine wait ``2 * timeout_s + GRACE_S`` for the answer."""
    return timeout_s + GRACE_S


class PeerLost(RuntimeError):
    """A peer of a collective did not answer within the bound (dead, hung or far behind)."""


def wait(work, timeout_s: Optional[float], phase: str) -> None:
    """Wait for an async collective's ``work`` at most ``timeout_s`` seconds (None: the
    process group's own timeout, for callers outside an update such as tests)."""
    if timeout_s is None:
        work.wait()
        return
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PeerLost(f"{phase}: a peer did not answer within {timeout_s:g}s ({e})") from None


def all_equal(value: int, group: Optional[dist.ProcessGroup], timeout_s: Optional[float], phase: str,
              device: Optional[torch.device] = None) -> bool:
    """Whether every rank of ``group`` holds the same ``value`` (one tiny all-reduce of
    ``[value, -value]`` with MAX; ``device``: where the group's backend reduces)."""
    both = torch.tensor([value, -value], dtype=torch.int64, device=device)
    wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout_s, phase)
    return both[0].item() == value and -both[1].item() == value


# Barriers entered so far per group (by its ranks): every rank of a group enters them in one
# order, so (group, count) names one barrier on every rank.
_entered: Dict[Tuple[int, ...], int] = collections.defaultdict(int)


def barrier(group: Optional[dist.ProcessGroup], timeout_s: float, phase: str) -> None:
    """A barrier bounded by ``timeout_s``. On failure the error names the ranks that never
    reached it: each rank marks its arrival in the process group's store first (a dead
    peer's closed connection makes gloo say only "Connection closed by peer")."""
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    me, tag = dist.get_rank(), ",".join(map(str, ranks))
    _entered[ranks] += 1
    keys = {r: f"weight_sync/barrier/{tag}/{_entered[ranks]}/{r}" for r in ranks}
    store = _store()
    if store is not None:
        store.set(keys[me], "1")
        if _entered[ranks] > 1:  # every rank passed the previous one: its mark is no longer needed
            store.delete_key(f"weight_sync/barrier/{tag}/{_entered[ranks] - 1}/{me}")
    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        else:
            dist.barrier(group=group, async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        absent = [r for r, k in keys.items() if store is not None and not store.check([k])]
        named = f"ranks {absent} never reached it; " if absent else ""
        raise PeerLost(f"{phase}: {named}{e} (within {timeout_s:g}s)") from None


def _store() -> Optional[dist.Store]:
    """The default process group's store (every rank reaches it), if there is one."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


RESULT_BYTES = 4096


def broadcast_result(result: Optional[Tuple[bool, str]], src: int, group: Optional[dist.ProcessGroup],
                     timeout_s: float, phase: str) -> Tuple[bool, str]:
    """``src``'s (success, message) on every rank of ``group``, waiting at most ``timeout_s``
    (a fixed-size tensor broadcast; ``broadcast_object_list`` cannot be bounded)."""
    buf = torch.zeros(RESULT_BYTES, dtype=torch.uint8)
    if result is not None:
        data = (b"1" if result[0] else b"0") + result[1].encode()[: RESULT_BYTES - 1]
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    wait(dist.broadcast(buf, src=src, group=group, async_op=True), timeout_s, phase)
    data = bytes(buf[: int(buf.nonzero().max()) + 1].tolist()) if buf.any() else b"0"
    return data[:1] == b"1", data[1:].decode(errors="replace")
