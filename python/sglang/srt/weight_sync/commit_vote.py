"""The commit vote: the last step before an engine's first write of an update, on every TP
rank (docs/design.md, "One outcome per update").

Engine rank 0 records in the update's channel that it is being applied (unless the
tokenizer manager already gave up on it), then every rank votes with a digest of the
update's id. The colocated path and remote engines commit the same way.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Optional, Tuple

from sglang.srt.weight_sync.control_plane import ControlGroup, PeerLost
from sglang.srt.weight_sync.outcome import Outcome, decide
from sglang.srt.weight_sync.protocol import MIXED, REFUSED, DeliveryError

__all__ = ("commit_to_write",)

logger = logging.getLogger(__name__)


def commit_to_write(
    control: ControlGroup, rank: int, channel, update_id: str, bound: float
) -> Tuple[Optional[str], bool]:
    """The last step before the first write, on every TP rank of ``control``: (None, False)
    to write, else why not and whether the weights may be mixed.

    Engine rank 0 records in ``channel`` that the update is being applied, unless the
    tokenizer manager has recorded that it gave up on it (``outcome``): an update whose
    caller was told it failed is never applied later. Then one all-reduce: every rank writes
    only if rank 0 committed and all hold the same update (a rank left behind by a fault may
    be a whole update late). A rank whose wait fails here has voted, and a peer that comes
    late completes the vote with it and writes: from here on, a failure says the weights are
    mixed, whatever this rank wrote itself. The colocated path and remote engines
    (``remote.engine``) both commit so.

    A round trip of its own, after the agreement's: folded into that one, rank 0 would
    record the commit before it knew that every rank is ready, so a rank stalled before the
    agreement would leave an update committed that the tokenizer manager could otherwise
    abandon cleanly, and a lost agreement would say mixed instead of refused."""
    why = _claim(rank, channel, update_id) if rank == 0 else None
    vote = 0 if why else _update_digest(update_id)
    try:
        agreed = control.all_equal(
            vote, bound, f"engine rank {rank}: committing to write update {update_id!r}"
        )
    except PeerLost as e:
        return (
            f"distributed weight update FAILED on engine rank {rank} as the TP ranks "
            f"committed to write ({e}): another rank may have begun writing, so {MIXED} as "
            "far as anyone can tell (some parameters new, some old); generation is refused "
            "until a distributed weight update succeeds"
        ), True
    if agreed and vote:
        return None, False
    return REFUSED + (
        why
        or f"engine rank {rank}: the TP ranks did not all commit to update "
        f"{update_id!r} (engine rank 0 records its outcome, see its answer)"
    ), False


def _claim(rank: int, channel, update_id: str) -> Optional[str]:
    """Rank 0: record that ``update_id`` is being applied; why not, or None."""
    try:
        recorded = decide(channel, update_id, Outcome.COMMITTED)
    except (OSError, ValueError, DeliveryError) as e:
        return (
            f"engine rank {rank}: cannot record in its channel that update {update_id!r} "
            f"is being applied ({type(e).__name__}: {e})"
        )
    if recorded is Outcome.ABANDONED:
        logger.error(
            "distributed weight update %s: the tokenizer manager gave up on it before the "
            "engine could apply it: refused",
            update_id,
        )
        return (
            f"engine rank {rank}: the engine's tokenizer manager had already given up on "
            f"update {update_id!r} (no answer within its bound: its caller was told it failed), "
            "so the engine does not apply it"
        )
    return None


def _update_digest(update_id: str) -> int:
    """A non-zero 60-bit integer standing for ``update_id`` in the commit vote."""
    digest = hashlib.sha256(str(update_id).encode("utf-8", "surrogatepass")).hexdigest()
    return int(digest[:15], 16) | 1
