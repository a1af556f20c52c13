"""What crosses a process boundary in a weight-sync group with remote engines, defined once.

A weight-sync group spans the trainer's ranks (group ranks ``0 .. T-1``) and the TP ranks
of one or more SGLang engines on other GPUs or hosts (each engine at a rank offset). It
is made by the trainer: its first rank hosts a TCP store at ``(address, port)``; every
engine joins with a control request (``JoinWeightSyncGroupReqInput``: address, port,
group name, rank offset, world size, backend, membership epoch), and each membership
epoch is a process group of its own in that store (``membership prefix``).

* The requests' checks (``join_problems``, ``update_problems``, ``leave_problems``): the
  tokenizer manager refuses a bad field before any scheduler sees the request.
* ``Membership``: who is in one epoch of the group, as JSON (trainer ranks hear it from
  the trainer's first rank; an engine hears its own part in its join request).
* ``UpdateHeader``: what the trainer's first rank tells every member at the start of an
  update (update id, the digest and size of the trainer's source layout, the bucket).
* The source layout on the wire (``layout_wire`` / ``read_layout``): every HF tensor's
  ``MeshSpec`` or ``HoldersSpec``, JSON, decoded with bounds.
* ``UpdateStep`` and ``ReceiveState``: the steps the tokenizer manager walks an update
  through (receive while serving, poll, apply in a short pause), and what a rank reports.
* A delta update's records (``delta_records`` / ``read_delta_records``): per region,
  its kind, changed count and payload size; before its first round, the digests of the
  bases the regions apply to (``base_digests`` / ``read_base_digests``).
* The reply: ``REMOTE_FIGURES`` per engine TP rank, and the pause.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple, Union

from sglang.srt.weight_sync.delta_codec import CLASSES
from sglang.srt.weight_sync.protocol import (
    GRACE_S,
    MAX_UPDATE_ID_CHARS,
    MIN_BUCKET_BYTES,
    DeliveryError,
    _bounded_int,
    _is_holders_wire,
    _is_mesh_wire,
    _no_float,
    _unique_keys,
    check_timeout,
)
from sglang.srt.weight_sync.source_layout import HoldersSpec, LayoutError, MeshSpec

__all__ = (
    "BACKENDS",
    "DEFAULT_STAGING_BYTES",
    "DELTA_REPLY_FIGURES",
    "HEADER_LIMIT",
    "LAYOUT_LIMIT",
    "MEMBERSHIP_LIMIT",
    "Member",
    "Membership",
    "POLL_S",
    "REMOTE_FIGURES",
    "ReceiveState",
    "Spec",
    "UpdateHeader",
    "UpdateStep",
    "delta_reply",
    "epoch_prefix",
    "join_problems",
    "layout_wire",
    "leave_problems",
    "read_layout",
    "receive_bound_s",
    "remote_reply",
    "update_problems",
)

Spec = Union[MeshSpec, HoldersSpec]

BACKENDS = ("gloo", "nccl")
# An engine rank's staging for what it receives while it keeps serving: regions wait there
# until the pause writes them; a rank whose share is larger streams the rest in the pause.
DEFAULT_STAGING_BYTES = 4 << 30
HEADER_LIMIT = 1 << 16  # an update header, as broadcast to every member
MEMBERSHIP_LIMIT = 1 << 20  # an epoch's membership, as broadcast to every member
LAYOUT_LIMIT = (
    1 << 30
)  # a trainer's source layout (Megatron holders of a large model fit)
MAX_GROUP_NAME_CHARS = 128
MAX_WORLD = 1 << 20
# how often the tokenizer manager asks the schedulers how far receiving is
POLL_S = 0.02


def receive_bound_s(timeout_s: float) -> float:
    """How long the tokenizer manager polls an update bounded by ``timeout_s`` before it
    gives the receive up: its thread waits at most ``timeout_s`` for the trainer's header
    (the trainer sends as it asks), then its rounds until every region landed or the
    staging is full, each wait bounded by ``timeout_s``; a receive not done by then is
    stuck where no bound reaches (NCCL's first communicator init blocks the host) or fed
    by a trainer that stopped sending."""
    return 2 * timeout_s + GRACE_S


# Per engine TP rank in the reply: bytes received and the least any plan could receive (the
# rank's parameters' bytes: it holds none of the trainer's data), the staging peak, and
# microseconds spent receiving (while serving) and writing (in the pause).
REMOTE_FIGURES = (
    "bytes_received",
    "lower_bound_bytes",
    "peak_staging_bytes",
    "receive_us",
    "apply_us",
    "decode_us",  # a delta update's decoding, inside receive_us
)

# Per engine TP rank in a delta update's reply (its ``delta``; empty for an update sent
# without delta records): the bytes of the records received by what they carry (changes,
# whole regions, nothing: headers only), the elements changed among those compared, then
# changed and compared per tensor class (``CLASSES``).
DELTA_REPLY_FIGURES = (
    "bytes_as_delta",
    "bytes_as_full",
    "bytes_as_unchanged",
    "changed",
    "elements",
) + tuple(f"{c}_{what}" for c in CLASSES for what in ("changed", "elements"))


class UpdateStep(str, enum.Enum):
    """The steps of one remote update as the tokenizer manager sends them to the schedulers;
    a caller sends ``UPDATE`` (the whole update) and never the others."""

    UPDATE = "update"
    # start receiving into staging, in the background; serving goes on
    RECEIVE = "receive"
    # how far every TP rank is (one small all-reduce over the TP group)
    STATUS = "status"
    APPLY = "apply"  # under the writer lock, between batches: write the staged regions
    ABORT = "abort"  # forget a receive that failed or was given up


class ReceiveState(enum.IntEnum):
    """One rank's receive, as the status step combines it over the TP ranks (the largest
    wins, so one failure fails all)."""

    IDLE = 0
    RECEIVING = 1
    FULL = 2  # staging full: the rest streams in during the pause
    DONE = 3  # every round received
    FAILED = 4


def _name_problem(value, what: str, most: int) -> List[str]:
    if isinstance(value, str) and 0 < len(value) <= most and value.isprintable():
        return []
    return [
        f"{what}={value!r}: must be a non-empty printable string of at most {most} characters"
    ]


def _int_problem(value, what: str, low: int, high: int) -> List[str]:
    if type(value) is int and low <= value < high:
        return []
    return [f"{what}={value!r}: must be an integer in [{low}, {high})"]


def _timeout_problem(value) -> List[str]:
    try:
        check_timeout(value)
    except DeliveryError as e:
        return [str(e)]
    return []


def join_problems(req) -> List[str]:
    """What is wrong with a join request's fields (empty when nothing)."""
    problems = _name_problem(req.group_name, "group_name", MAX_GROUP_NAME_CHARS)
    problems += _name_problem(req.master_address, "master_address", 255)
    problems += _int_problem(req.master_port, "master_port", 1, 1 << 16)
    problems += _int_problem(req.world_size, "world_size", 2, MAX_WORLD)
    problems += _int_problem(req.rank_offset, "rank_offset", 1, MAX_WORLD)
    problems += _int_problem(req.epoch, "epoch", 0, 1 << 62)
    if req.backend not in BACKENDS:
        problems.append(f"backend={req.backend!r}: must be one of {list(BACKENDS)}")
    return problems + _timeout_problem(req.timeout_s)


def update_problems(req) -> List[str]:
    """What is wrong with an update request's fields (empty when nothing)."""
    problems = _name_problem(req.group_name, "group_name", MAX_GROUP_NAME_CHARS)
    if req.update_id is not None:
        problems += _name_problem(req.update_id, "update_id", MAX_UPDATE_ID_CHARS)
    staging = req.staging_bytes
    if staging is not None and (type(staging) is not int or staging < MIN_BUCKET_BYTES):
        problems.append(
            f"staging_bytes={staging!r}: must be None (default {DEFAULT_STAGING_BYTES}) or an "
            f"integer >= {MIN_BUCKET_BYTES} (1 MiB)"
        )
    return problems + _timeout_problem(req.timeout_s)


def leave_problems(req) -> List[str]:
    return _name_problem(req.group_name, "group_name", MAX_GROUP_NAME_CHARS)


# ---------------------------------------------------------------------------- membership


def epoch_prefix(group_name: str, epoch: int) -> str:
    """Where in the group's store one epoch's process groups meet."""
    return f"weight_sync/{group_name}/epoch{epoch}"


@dataclass(frozen=True)
class Member:
    """One engine of an epoch: its name (the trainer's, e.g. its URL), its group rank
    offset and its TP size (group ranks ``offset .. offset + tp_size - 1``)."""

    name: str
    offset: int
    tp_size: int

    @property
    def ranks(self) -> range:
        return range(self.offset, self.offset + self.tp_size)


@dataclass(frozen=True)
class Membership:
    """Who is in one epoch of a weight-sync group: ``trainers`` trainer ranks (group ranks
    ``0 .. trainers-1``, the trainer's own ranks) and the engines after them."""

    group_name: str
    epoch: int
    address: str
    port: int
    backend: str
    trainers: int
    engines: Tuple[Member, ...] = field(default_factory=tuple)

    @staticmethod
    def of(
        group_name: str,
        epoch: int,
        address: str,
        port: int,
        backend: str,
        trainers: int,
        engines: List[Tuple[str, int]],
    ) -> Membership:
        """Engines ``(name, tp_size)`` placed after the trainer ranks, in order."""
        members, offset = [], trainers
        for name, tp in engines:
            members.append(Member(name, offset, tp))
            offset += tp
        return Membership(
            group_name, epoch, address, port, backend, trainers, tuple(members)
        )

    @property
    def world_size(self) -> int:
        return self.trainers + sum(m.tp_size for m in self.engines)

    @property
    def prefix(self) -> str:
        return epoch_prefix(self.group_name, self.epoch)

    def engine_of(self, rank: int) -> Optional[Member]:
        return next((m for m in self.engines if rank in m.ranks), None)

    def who(self, rank: int) -> str:
        """A group rank in words: ``trainer rank 2`` or ``engine 'http://...' TP rank 1``."""
        member = self.engine_of(rank)
        if member is None:
            return f"trainer rank {rank}"
        return f"engine {member.name!r} TP rank {rank - member.offset}"

    def legend(self) -> str:
        """Every group rank in words, for error messages."""
        parts = [f"0-{self.trainers - 1}: trainer ranks"]
        parts += [
            f"{m.offset}-{m.offset + m.tp_size - 1}: engine {m.name!r}"
            for m in self.engines
        ]
        return f"group {self.group_name!r} epoch {self.epoch} ranks " + "; ".join(parts)

    def join_request(self, member: Member, timeout_s: float) -> dict:
        """The fields of ``member``'s join request (``JoinWeightSyncGroupReqInput``)."""
        return dict(
            group_name=self.group_name,
            master_address=self.address,
            master_port=self.port,
            rank_offset=member.offset,
            world_size=self.world_size,
            epoch=self.epoch,
            backend=self.backend,
            timeout_s=timeout_s,
        )

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def from_json(raw: bytes) -> Membership:
        data = json.loads(raw)
        engines = tuple(Member(**m) for m in data.pop("engines"))
        return Membership(engines=engines, **data)


# ---------------------------------------------------------------------------- an update


@dataclass(frozen=True)
class UpdateHeader:
    """What the trainer's first rank broadcasts to every member when an update starts."""

    update_id: str
    layout_digest: str
    layout_bytes: int
    bucket_bytes: int
    tensors: int
    # regions travel as delta records (``delta_records``); with ``digest`` every sender
    # first sends the digest of each region's base (``base_digests``), which the engine
    # checks before anything lands
    delta: bool = False
    digest: bool = False
    # the group runs delta updates (this one full or not): a block-FP8 engine keeps the
    # bf16 staging of the blocks it quantizes itself as their base (``delta_rounds.
    # KeptStaging``); without it it lets that staging go
    keep_base: bool = False

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(raw: bytes) -> UpdateHeader:
        """The header, checked field by field (``DeliveryError`` says what is wrong)."""
        try:
            header = UpdateHeader(**_strict_json(raw))
        except (ValueError, TypeError, RecursionError) as e:
            raise DeliveryError(f"unreadable update header: {e}") from None
        problems = _name_problem(header.update_id, "update_id", MAX_UPDATE_ID_CHARS)
        problems += _name_problem(header.layout_digest, "layout_digest", 64)
        problems += _int_problem(header.layout_bytes, "layout_bytes", 0, LAYOUT_LIMIT)
        problems += _int_problem(
            header.bucket_bytes, "bucket_bytes", MIN_BUCKET_BYTES, 1 << 62
        )
        problems += _int_problem(header.tensors, "tensors", 0, 1 << 31)
        for name in ("delta", "digest", "keep_base"):
            if type(getattr(header, name)) is not bool:
                problems.append(
                    f"{name}={getattr(header, name)!r}: must be true or false"
                )
        if header.digest and not header.delta:
            problems.append("digest=true without delta=true")
        if header.delta and not header.keep_base:
            problems.append("delta=true without keep_base=true")
        if problems:
            raise DeliveryError("update header: " + "; ".join(problems))
        return header


def _strict_json(raw: bytes):
    """JSON with integers only (no float, NaN or inf; at most 19 digits) and unique keys."""
    return json.loads(
        raw,
        parse_float=_no_float,
        parse_constant=_no_float,
        parse_int=_bounded_int,
        object_pairs_hook=_unique_keys,
    )


def layout_wire(specs: Mapping[str, Spec]) -> bytes:
    """A source layout (every HF tensor's spec, by name) as JSON."""
    return json.dumps(
        [[name, specs[name].to_wire()] for name in sorted(specs)]
    ).encode()


def read_layout(raw: bytes, limit: int = LAYOUT_LIMIT) -> Dict[str, Spec]:
    """A source layout from ``layout_wire``: integers only, every entry a mesh or holders
    spec, each name once; ``LayoutError`` says what is wrong."""
    if len(raw) > limit:
        raise LayoutError(f"a source layout of {len(raw)} bytes; at most {limit}")
    try:
        entries = _strict_json(raw)
    except (ValueError, RecursionError) as e:
        raise LayoutError(f"unreadable source layout: {e}") from None
    if not isinstance(entries, list):
        raise LayoutError("a source layout is a list of [name, spec]")
    out: Dict[str, Spec] = {}
    for entry in entries:
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
        wire = entry[1] if ok else None
        if ok and _is_mesh_wire(wire):
            spec = MeshSpec.from_wire(wire)
        elif ok and _is_holders_wire(wire):
            spec = HoldersSpec.from_wire(wire)
        else:
            raise LayoutError(
                f"source layout entry {str(entry)[:120]}: not [name, spec]"
            )
        if entry[0] in out:
            raise LayoutError(f"tensor {entry[0]!r} appears twice in the source layout")
        out[entry[0]] = spec
    return out


def remote_reply(
    success: bool,
    message: str,
    output=None,
    pause_s: float = 0.0,
    receive_s: float = 0.0,
) -> dict:
    """What ``Engine.update_weights_remote`` and the HTTP route return: upstream's
    ``success``/``message``, ``mixed``, the update id, the figures of every engine TP rank
    (``REMOTE_FIGURES``), a delta update's figures (``delta_reply``) and, measured by the
    tokenizer manager, the seconds receiving (generation went on) and paused (generation
    waited for the writes)."""
    body = {
        "success": success,
        "message": message,
        "mixed": bool(getattr(output, "mixed", False)),
        "update_id": str(getattr(output, "update_id", "") or ""),
        "receive_seconds": round(receive_s, 6),
        "pause_seconds": round(pause_s, 6),
    }
    for key in REMOTE_FIGURES:
        body[key] = list(getattr(output, key, []) or [])
    body["delta"] = delta_reply(getattr(output, "delta", None) or {})
    return body


def delta_reply(figures: Mapping[str, List[int]]) -> Dict[str, object]:
    """A delta update's part of an engine's reply from its ``DELTA_REPLY_FIGURES`` per TP
    rank (empty: the update carried no delta records): per TP rank the bytes received as
    changes, whole regions and unchanged regions' headers, the elements changed and
    compared, the density, and the density per tensor class (classes it received)."""
    if not figures:
        return {}
    ranks = len(figures["changed"])
    out: Dict[str, object] = {
        key: list(figures[key]) for key in DELTA_REPLY_FIGURES[:5]
    }
    out["density"] = [
        _ratio(figures["changed"][r], figures["elements"][r]) for r in range(ranks)
    ]
    out["density_by_class"] = {
        c: [
            _ratio(figures[f"{c}_changed"][r], figures[f"{c}_elements"][r])
            for r in range(ranks)
        ]
        for c in CLASSES
        if any(figures[f"{c}_elements"])
    }
    return out


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
