"""One outcome per update: whether it may still be applied, decided once by the engine's
tokenizer manager and its first TP rank.

The tokenizer manager answers an update that its schedulers leave unanswered past its
bound (``answer_guard``): the caller is then told that the update failed. A scheduler
that was only stopped or slow could resume afterwards and apply it, so that the engine
would serve weights its caller believes were never applied. So each update has one
record, made at most once: engine rank 0 records ``COMMITTED`` right before the first
write (``engine_update``), the tokenizer manager records ``ABANDONED`` when its bound
passes. Whichever comes first holds; the other side reads it and acts on it: the engine
refuses an abandoned update on every TP rank before any write, and the tokenizer manager
knows, when it gives up, whether writes may have begun.

The record is a symbolic link whose target is the word: creating it is atomic and fails
if one exists, and its content is complete the moment it exists. It lives in the
update's channel, a private directory of the engine's user on the host where the
tokenizer manager and engine rank 0 run (both resolve the same path); the tokenizer
manager removes it once the update is answered.
"""

from __future__ import annotations

import enum
import hashlib
import os

from sglang.srt.weight_sync.protocol import DeliveryError, resolve_channel

__all__ = ("Outcome", "decide", "forget", "record_path")

RECORD_PREFIX = "outcome-"


class Outcome(str, enum.Enum):
    """What the record of an update says."""

    # engine rank 0 is about to write: the update may be applied
    COMMITTED = "committed"
    # the tokenizer manager answered that it failed: never applied
    ABANDONED = "abandoned"


def record_path(channel: str, update_id: str) -> str:
    """Where the record of ``update_id`` lives: in its channel (checked, resolved), named by
    a digest of the id (ids are free text, up to 256 characters)."""
    digest = hashlib.sha256(update_id.encode("utf-8", "surrogatepass")).hexdigest()
    return os.path.join(resolve_channel(channel), f"{RECORD_PREFIX}{digest[:32]}")


def decide(channel: str, update_id: str, wanted: Outcome) -> Outcome:
    """Record ``wanted`` for ``update_id`` unless an outcome is recorded already; return the
    one that holds. Raises ``OSError`` or ``protocol.ChannelError`` when nothing can be
    recorded or read, ``ValueError`` for a record this module did not write."""
    path = record_path(channel, update_id)
    try:
        os.symlink(Outcome(wanted).value, path)
        return Outcome(wanted)
    except FileExistsError:
        return Outcome(os.readlink(path))


def forget(channel: str, update_id: str) -> None:
    """Remove the record once the update is answered (nothing to remove is fine)."""
    try:
        os.unlink(record_path(channel, update_id))
    except (OSError, ValueError, DeliveryError):
        pass
