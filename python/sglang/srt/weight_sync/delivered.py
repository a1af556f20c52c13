"""Which trainer ranks delivered which tensors: checked across the engine's TP ranks
before their plans are compared.

Every trainer rank beside an engine sends every tensor of an update (its shard, or a
full copy). When one leaves a tensor out, the engine ranks plan from different inputs
and their plans differ; comparing plans says only that. Comparing the delivered names
first names the tensor, the trainer ranks that delivered it and those that did not.
One small all-reduce of a digest per update; the names themselves are exchanged only
when the digests differ.
"""

from __future__ import annotations

import hashlib
import json
from typing import Dict, List, Optional, Sequence, Tuple

from sglang.srt.weight_sync.control_plane import ControlGroup, PlanDisagreement
from sglang.srt.weight_sync.delivery import Payload

__all__ = ("delivery_digest", "explain_delivery", "missing_deliveries")

SHOWN = 3  # tensors named in full in a refusal; the rest are counted


def missing_deliveries(delivered: Sequence[Tuple[int, Sequence[str]]]) -> List[str]:
    """For each tensor some trainer ranks delivered and others did not (``delivered``:
    each engine rank's (trainer rank, tensor names)), what was delivered by whom; empty
    when every trainer rank delivered the same tensors."""
    by_rank: Dict[int, set] = {}
    for trainer, names in delivered:
        by_rank.setdefault(trainer, set()).update(names)
    every = set().union(*by_rank.values()) if by_rank else set()
    problems = []
    for name in sorted(every):
        have = sorted(r for r, names in by_rank.items() if name in names)
        lack = sorted(r for r, names in by_rank.items() if name not in names)
        if lack:
            problems.append(
                f"tensor {name!r} was delivered by trainer rank(s) {have} but not by "
                f"trainer rank(s) {lack}"
            )
    return problems


def _names(payload: Optional[Payload], ignored: Tuple[str, ...]) -> List[str]:
    return sorted(
        n
        for n in (payload.specs if payload is not None else ())
        if not n.endswith(ignored)
    )


def delivery_digest(payload: Optional[Payload], ignored: Tuple[str, ...] = ()) -> int:
    """A digest of the tensor names ``payload`` delivered (60 bits), the same on every
    engine rank whose trainer rank delivered the same tensors. Kept in the payload's
    layout memo: the names are its layout's, and sorting a MoE model's tens of thousands
    of them every update costs milliseconds."""
    memo = payload.layout_memo if payload is not None else None
    key = ("delivery digest", ignored)
    if memo is not None and key in memo:
        return memo[key]
    digest = hashlib.blake2b(
        "\n".join(_names(payload, ignored)).encode(), digest_size=8
    ).hexdigest()
    found = int(digest[:15], 16)
    if memo is not None:
        memo[key] = found
    return found


def explain_delivery(
    control: ControlGroup,
    payload: Optional[Payload],
    timeout_s: float,
    who: str,
    ignored: Tuple[str, ...] = (),
) -> None:
    """Once the digests differ: every rank's names (one exchange), and ``PlanDisagreement``
    naming the tensors that only some trainer ranks delivered; every TP rank calls it
    together."""
    phase = f"{who}: comparing the delivered tensor names"
    names = _names(payload, ignored)
    trainer = payload.trainer_rank if payload is not None else -1
    mine = json.dumps([trainer, names]).encode()
    every = [json.loads(b) for b in control.share_bytes(mine, timeout_s, phase)]
    problems = missing_deliveries([(t, n) for t, n in every if t >= 0])
    if problems:
        more = len(problems) - SHOWN
        raise PlanDisagreement(
            f"{who}: the trainer ranks delivered different tensors: "
            + "; ".join(problems[:SHOWN])
            + (f"; and {more} more tensor(s) likewise" if more > 0 else "")
            + " (every trainer rank beside the engine must send every tensor of an "
            "update: its shard, or a full copy)"
        )
