"""Bounded waits: no process of an update waits for a peer that is gone.

Every collective of an update is started asynchronously and waited for with a
bound derived from the update's ``timeout_s``. A peer that died or never came
makes the wait raise ``PeerLost`` naming the phase (gloo's monitored barrier
also names the ranks that did not arrive), instead of blocking for the process
group's default timeout (30 minutes) or for ever.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Tuple

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


def wait(work, timeout_s: float, phase: str) -> None:
    """Wait for an async collective's ``work`` at most ``timeout_s`` seconds."""
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PeerLost(f"{phase}: a peer did not answer within {timeout_s:g}s ({e})") from None


def barrier(group: Optional[dist.ProcessGroup], timeout_s: float, phase: str) -> None:
    """A barrier bounded by ``timeout_s``; on gloo, the error names the missing ranks."""
    if dist.get_backend(group) == "gloo":
        try:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as e:
            raise PeerLost(f"{phase}: {e} (within {timeout_s:g}s)") from None
    else:
        wait(dist.barrier(group=group, async_op=True), timeout_s, phase)


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
