"""The trainer side of a distributed weight update: every rank delivers only its own shards.

Each trainer rank sits beside one engine TP rank (its rank in the inference-TP
mesh). It keeps its local shards (the DTensor's own local tensor, never
``full_tensor()``), describes their layout (``MeshSpec``) and sends both to the
engine rank beside it over the group's private channel. Nothing is gathered.
An update is a short sequence of control requests (``update_flow``) that the
caller serves with ``drive``/``adrive``. ``sources_flow`` is the same for any
source layout (Megatron-core buffers too).
"""

# pr: scale
# When the shards beside an engine do not cover a tensor (FSDP over more GPUs than one
# engine has, train TP > infer TP across several engines), resharding runs on the trainer
# side instead (``mode="trainer"``, chosen automatically, ``trainer_reshard.py``): in one
# hop straight to the layout the engine publishes (``manifest.py``), after which the engine
# only copies; the engine's layout is asked for once per channel.
# pr: scale end
# pr: remote
# With ``TrainerSync.delta`` (``VerlEngine(weight_sync_delta=True)``) only what changed since
# the last update crosses between the trainer ranks (``reshard_delta.py``): worth it where
# their exchange crosses hosts; the engine still gets whole buffers.
# pr: remote end

from __future__ import annotations

import contextlib
import logging
import operator
import os
import shutil
import tempfile
import uuid
import weakref
from dataclasses import dataclass, field
from typing import (
    Callable,
    Dict,
    Generator,
    Iterable,
    List,
    Literal,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.control_plane import (
    ControlGroup,
    GroupRefusal,
    PeerLost,
    check_bound,
    check_group_timeout,
    collective_device,
)
from sglang.srt.weight_sync.delivery import ShardSender, local_shard
from sglang.srt.weight_sync.executor import data_device
from sglang.srt.weight_sync.phase_timing import (
    Count,
    Phase,
    PhaseClock,
    describe_phases,
)
from sglang.srt.weight_sync.planner import first_uncovered
from sglang.srt.weight_sync.protocol import (
    CHANNEL_PREFIX,
    DATA_GROUP_TIMEOUT_S,
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    PayloadKind,
    check_timeout,
    trainer_bound_s,
)
from sglang.srt.weight_sync.source_layout import (
    Described,
    HoldersSpec,
    LayoutError,
    MeshRanks,
    MeshSpec,
    SourceLayout,
)

# isort: split
# pr: scale
from sglang.srt.weight_sync.executor import DataGroup
from sglang.srt.weight_sync.manifest import (
    EngineManifest,
    ManifestError,
    fingerprint_int,
    read_manifest,
)
from sglang.srt.weight_sync.trainer_reshard import (
    TrainerPlans,
    TrainerSideResult,
    chunks,
)

# pr: scale end
# isort: split
# pr: remote
from sglang.srt.weight_sync.reshard_delta import ReshardDelta, agreement_values

# pr: remote end


__all__ = (
    "ControlRequest",
    "Flow",
    # pr: scale
    "KeptShards",
    # pr: scale end
    "Mode",
    "TrainerChannel",
    "TrainerSync",
    "UpdateOutcome",
    "UpdateReport",
    "adrive",
    # pr: scale
    "agree_on_inputs",
    # pr: scale end
    "as_reply",
    "deliver",
    "delivered_flow",
    "described_side",
    "drive",
    "prepare_shards",
    "sources_flow",
    "update_flow",
    "update_weights_distributed",
)

logger = logging.getLogger(__name__)

Mode = Literal["auto", "engine", "trainer"]
# Where resharding can run (``choose_side``): beside each engine, within its TP group
SIDES: Tuple[str, ...] = (
    "engine",
    # pr: scale
    "trainer",  # in one hop over the trainer's world (``trainer_reshard``)
    # pr: scale end
)
Shards = List[Tuple[str, torch.Tensor, MeshSpec]]
TOKEN_BYTES = 32  # a channel token: uuid4().hex


@dataclass
class TrainerChannel:
    """One engine TP group's channel, seen from one trainer rank of that group."""

    channel: str
    group_ranks: Tuple[int, ...]  # trainer global ranks, in engine TP rank order
    engine_groups: Tuple[
        Tuple[int, ...], ...
    ]  # every engine's group, for trainer-side resharding
    engine_rank: int
    sender: ShardSender
    token: str
    control: ControlGroup  # the group's control collectives (its barriers, the engine's answer)
    updates: int = 0
    # pr: scale
    # the engine's published layout, read once
    manifest: Optional[EngineManifest] = None
    # pr: scale end

    @property
    def rank_map(self) -> Dict[int, int]:
        return {r: i for i, r in enumerate(self.group_ranks)}

    def next_update_id(self) -> str:
        self.updates += 1
        return f"{self.token}-{self.updates}"

    def close(self) -> None:
        """Close the sender and remove the channel directory (with the engine sockets in it):
        the trainer made it, so the trainer takes it away."""
        self.sender.close()
        shutil.rmtree(self.channel, ignore_errors=True)


class TrainerSync:
    """One trainer process's side of distributed updates: its channels (one per engine TP
    group), its plans to the engines' layouts, and the world's control collectives.

    Owned by what drives updates (``VerlEngine``, or the engine client that
    device mesh ``update_weights_distributed`` is called with, see ``TrainerSync.of``); ``close()``
    releases the channels, and so does the owner's end (a finalizer) or the process's exit.
    """

    def __init__(self) -> None:
        self._channels: Dict[Tuple[int, ...], TrainerChannel] = {}
        self.described = Described()
        # pr: scale
        self.shards = KeptShards()  # ``prepare_shards``' last answer
        # pr: scale end
        self.megatron_coords: Dict[
            object, dict
        ] = {}  # MegatronRank -> every rank's coordinates
        self._world: Optional[ControlGroup] = None
        # pr: scale
        self.plans = TrainerPlans()
        self._data: Optional[DataGroup] = None
        # how many data groups this rank made or tried to: its proposal for the next one's
        # number (``ready_data``)
        self.data_groups_made = 0
        # pr: scale end
        # pr: remote
        # the trainer-side hop's bases while the owner asks for delta updates
        self.delta: Optional[ReshardDelta] = None
        # pr: remote end
        self._finalizer = weakref.finalize(self, TrainerSync._close_all, self._channels)

    @classmethod
    def of(cls, owner) -> TrainerSync:
        """The ``TrainerSync`` kept on ``owner`` (the device mesh a stateless caller passes
        every update), made on first use: it lives as long as the mesh whose groups its
        channels serve. Every rank must pass alike owners (they all keep it, or none does)."""
        sync = getattr(owner, "_weight_sync", None)
        if not isinstance(sync, cls):
            sync = cls()
            try:
                owner._weight_sync = sync
            except (
                AttributeError
            ):  # an object without attributes: the sync lives for this update only
                pass
        return sync

    @property
    def world(self) -> ControlGroup:
        """Control collectives over every trainer rank (the default group)."""
        if self._world is None:
            self._world = ControlGroup(None, "trainer-world")
        return self._world

    @property
    def data_device(self) -> torch.device:
        """Where the trainer's tensors move: the trainer-side data plane's device, the default
        group's backend's until it has one."""
        # pr: scale
        if self._data is not None:
            return self._data.device
        # pr: scale end
        return data_device(None)

    # pr: scale
    @property
    def lacks_data(self) -> bool:
        """Whether this rank has no usable data group (none yet, or a wait on it failed)."""
        return self._data is None or self._data.abandoned

    @property
    def data(self) -> DataGroup:
        """The trainer-side data plane, made by ``ready_data`` (``executor.DataGroup``)."""
        if self._data is None:
            raise RuntimeError("the trainer's data group is made by ready_data first")
        return self._data

    def ready_data(self, number: Optional[int], setup_s: float) -> DataGroup:
        """The data plane's own group over every trainer rank, never the default group
        (the communicator FSDP computes with: a wait that runs out aborts its group). Made,
        with the default group's backend and ``DATA_GROUP_TIMEOUT_S`` (above every bound),
        within ``setup_s``, as group ``number`` when the trainer ranks agreed that some rank
        lacks one and on that number (the same on every rank: ``agree_on_inputs``), so all
        make it together; None: every rank has one."""
        if number is not None:
            if self._data is not None:
                self._data.abandon()
                self._data = None
            self.data_groups_made = number + 1
            timeout_s = check_group_timeout(
                DATA_GROUP_TIMEOUT_S,
                f"trainer rank {dist.get_rank()}: the trainer-side data group",
            )
            self._data = DataGroup.over_ranks_of(None, timeout_s, number, setup_s)
        return self.data

    # pr: scale end

    def channel(
        self,
        group_ranks: Sequence[int],
        group: Optional[dist.ProcessGroup],
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> TrainerChannel:
        """The channel of an engine TP group (made once per group).

        Every trainer rank calls this together. The group's first rank draws a token and
        broadcasts it (a few bytes of control, no payload); every rank makes the private
        directory on its node and connects to the socket of the engine rank beside it; one
        small integer all-gather tells every rank all engine groups.
        """
        key = tuple(int(r) for r in group_ranks)
        check_bound(
            group,
            trainer_bound_s(timeout_s),
            f"timeout_s={timeout_s:g}: trainer rank {dist.get_rank()}, while the engine applies "
            "an update,",
            collective_device(group),
        )
        if key not in self._channels:
            me = dist.get_rank()
            control = ControlGroup(group, "trainer")
            token = control.broadcast_bytes(
                uuid.uuid4().hex.encode() if me == key[0] else None,
                key[0],
                TOKEN_BYTES,
                timeout_s,
                f"trainer rank {me}: hearing the channel token from rank {key[0]}",
            ).decode()
            channel = os.path.join(tempfile.gettempdir(), f"{CHANNEL_PREFIX}{token}")
            os.makedirs(channel, mode=0o700, exist_ok=True)
            os.chmod(channel, 0o700)
            engine_rank = key.index(me)
            every = self.world.all_gather_ints(
                [key[0], engine_rank],
                timeout_s,
                f"trainer rank {me}: learning every engine's group",
            )
            self._channels[key] = TrainerChannel(
                channel,
                key,
                _engine_groups(every),
                engine_rank,
                ShardSender(channel, engine_rank),
                token,
                ControlGroup(group, f"trainer-{token}"),
            )
        return self._channels[key]

    def close(self) -> None:
        """Close every channel and destroy the data group (idempotent)."""
        TrainerSync._close_all(self._channels)
        # pr: scale
        if self._data is not None:
            self._data.abandon()
            self._data = None
        # pr: scale end

    @staticmethod
    def _close_all(channels: Dict[Tuple[int, ...], TrainerChannel]) -> None:
        while channels:
            channels.popitem()[1].close()


def _engine_groups(every: Sequence[Sequence[int]]) -> Tuple[Tuple[int, ...], ...]:
    """All engine groups, from each trainer rank's (group's first rank, engine rank)."""
    groups: Dict[int, Dict[int, int]] = {}
    for rank, (first, index) in enumerate(every):
        groups.setdefault(first, {})[index] = rank
    return tuple(tuple(g[i] for i in sorted(g)) for _, g in sorted(groups.items()))


def prepare_shards(
    named_tensors: Iterable[Tuple[str, torch.Tensor]],
    ranks: Optional[MeshRanks] = None,
    # pr: scale
    kept: Optional[KeptShards] = None,
    # pr: scale end
) -> Shards:
    """Local shard and layout of each tensor: DTensors keep their own mesh; a plain
    tensor is the full tensor, held by every trainer rank. ``ranks``: the meshes and
    layouts known so far (``TrainerSync.described``), each layout one ``MeshSpec``."""
    from torch.distributed.tensor import DTensor

    named = list(named_tensors)
    # pr: scale
    # ``kept``: the last call's answer (``KeptShards``), reused while it still holds
    if kept is not None:
        found = kept.get(named)
        if found is not None:
            return found
    # pr: scale end
    everyone = list(range(dist.get_world_size()))
    out, ranks = [], ranks if ranks is not None else MeshRanks()
    with torch.no_grad():
        for name, tensor in named:
            spec = (
                None
                if isinstance(tensor, DTensor)
                else ranks.full(tensor.shape, tensor.dtype, everyone)
            )
            local, spec = local_shard(tensor, spec, ranks)
            out.append((name, local, spec))
    # pr: scale
    if kept is not None:
        kept.keep(named, out)
    # pr: scale end
    return out


_NAME, _TENSOR = operator.itemgetter(0), operator.itemgetter(1)
_IS_CUDA = operator.attrgetter("is_cuda")


# pr: scale
_DEREF = weakref.ref.__call__
_LOCAL, _SPEC = operator.attrgetter("_local_tensor"), operator.attrgetter("_spec")
# what a DTensor's layout is read from (``MeshSpec.of_dtensor``) beside its shape and
# dtype: its spec's mesh and placements, each replaced (never changed in place) when the
# layout changes
_LAYOUT = (operator.attrgetter("mesh"), operator.attrgetter("placements"))


class KeptShards:
    """``prepare_shards``' last answer for a list of DTensors, for the next call with the
    same ones: a training run hands the same parameters over every step, and reading a
    MeshSpec and a local shard from each DTensor anew costs about 2 us a tensor (0.04 s
    at a MoE model's 18,867). It holds while the names, the DTensor objects, their local
    tensors and their layouts' objects (``_LAYOUT``) are the same objects; the tensors are
    held weakly (their memory is never kept here), the layouts' objects strongly."""

    def __init__(self) -> None:
        self._forget()

    def _forget(self) -> None:
        self._names: List[str] = []
        self._tensors: List[weakref.ref] = []
        self._locals: List[weakref.ref] = []
        self._layouts: List[list] = []
        self._specs: List[object] = []

    def get(self, named: List[Tuple[str, torch.Tensor]]) -> Optional[Shards]:
        """The last answer for ``named``, or None when anything it was read from changed."""
        if not self._names or len(named) != len(self._names):
            return None
        tensors = list(map(_TENSOR, named))
        try:
            locals_ = list(map(_LOCAL, tensors))
            specs = list(map(_SPEC, tensors))
            same = (
                list(map(_NAME, named)) == self._names
                and all(map(operator.is_, tensors, map(_DEREF, self._tensors)))
                and all(map(operator.is_, locals_, map(_DEREF, self._locals)))
                and all(
                    all(map(operator.is_, map(get, specs), was))
                    for get, was in zip(_LAYOUT, self._layouts)
                )
            )
        except AttributeError:  # a plain tensor, or one holding no layout
            return None
        return list(zip(self._names, locals_, self._specs)) if same else None

    def keep(self, named: List[Tuple[str, torch.Tensor]], out: Shards) -> None:
        """Keep ``out``, ``prepare_shards``' answer for ``named``, when every tensor is a
        DTensor (forget the last answer otherwise)."""
        from torch.distributed.tensor import DTensor

        self._forget()
        tensors = list(map(_TENSOR, named))
        if not all(isinstance(t, DTensor) for t in tensors):
            return
        try:
            specs = list(map(_SPEC, tensors))
            self._layouts = [list(map(get, specs)) for get in _LAYOUT]
            self._tensors = list(map(weakref.ref, tensors))
            self._locals = [weakref.ref(local) for _, local, _ in out]
        except (AttributeError, TypeError):
            self._forget()
            return
        if any(local is not _LOCAL(t) for (_, local, _), t in zip(out, tensors)):
            self._forget()
            return
        self._names = list(map(_NAME, named))
        self._specs = [spec for _, _, spec in out]


# pr: scale end


def described_side(
    described: Described,
    sources: SourceLayout,
    engine_groups: Sequence[Sequence[int]],
    mode: Mode = "auto",
) -> str:
    """``choose_side``, once per description kept in ``described`` and engines."""
    return described.remembered(
        sources,
        ("side", tuple(map(tuple, engine_groups)), mode),
        lambda: choose_side(sources, engine_groups, mode),
    )


def choose_side(
    sources: SourceLayout, engine_groups: Sequence[Sequence[int]], mode: Mode = "auto"
) -> str:
    """Where resharding runs: "engine" when the trainer ranks beside every engine hold all
    of every tensor (the engine reshards within its TP group), else "trainer" (one hop
    over the trainer's world). ``mode`` overrides. The same answer on every rank. A side
    not in ``SIDES`` raises ``LayoutError`` (``weight_sync.utils.update_weights`` then
    takes upstream's gathered path)."""
    why = f"mode={mode!r}"
    if mode == "auto":
        name = first_uncovered(sources, engine_groups)
        if name is None:
            return "engine"
        mode = "trainer"
        why = f"tensor {name} is not held whole by the trainer ranks beside an engine"
    if mode not in SIDES:
        raise LayoutError(
            f"weight update: {why}, and resharding runs only {' or '.join(SIDES)}-side"
        )
    if mode == "trainer":
        logger.info(
            "weight update: %s; resharding on the trainer side, straight to the engine's "
            "layout",
            why,
        )
    return mode


def deliver(
    chan: TrainerChannel,
    shards: Shards,
    pieces: Optional[Mapping[str, HoldersSpec]] = None,
    # pr: scale
    # the description kept for ``shards`` (``TrainerSync.described``: see
    # ``ShardSender.send``)
    layout: Optional[SourceLayout] = None,
    # pr: scale end
) -> str:
    """Send this rank's shards (and buffers that ``pieces`` describe, spec None) to the
    engine rank beside it; returns the update id."""
    update_id = chan.next_update_id()
    _cuda_ipc_ready(map(_TENSOR, shards))
    chan.sender.send(
        update_id,
        dist.get_rank(),
        chan.rank_map,
        shards,
        pieces,
        # pr: scale
        layout=layout,
        # pr: scale end
    )
    return update_id


def _cuda_ipc_ready(tensors) -> None:
    if any(map(_IS_CUDA, tensors)):
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # CUDA IPC names GPUs by UUID (breaks CPU tensors, so GPU only)


@dataclass(frozen=True)
class ControlRequest:
    """What the group's first rank asks the engine to do: take update ``update_id`` from
    ``channel``. ``final``: the last request of this update, after which the engine may
    flush its cache. ``control``: the group's control collectives, with which ``drive``
    hears and shares the answer. ``clock``: the update's phases on this rank (``drive``
    adds its waits; ``as_reply`` keeps the engine's phases from its answer)."""

    update_id: str
    channel: str
    control: ControlGroup = field(compare=False, repr=False)
    # pr: scale
    describe: bool = False  # publish the engine's layout into ``channel`` instead
    # pr: scale end
    final: bool = True
    clock: Optional[PhaseClock] = field(default=None, compare=False, repr=False)


@dataclass
class UpdateReport:
    """One update as this trainer rank saw it. Bytes are payload bytes this rank received
    from other trainer ranks (trainer-side mode; in the engine's dtype) and the lower
    bound for it (needed - held); engine-side moves are counted by the engine (message).
    ``peak_buffer_bytes``: the largest chunk of parameter buffers held for the engine
    (with the block-FP8 regions that came quantized); ``handed_bytes``: what this rank
    handed the engine rank beside it in all (trainer-side); ``inline_bytes``: what its
    last payload carried through the socket (CPU payloads). ``phases``: where this rank's
    seconds went (``phase_timing``: seconds by phase, and counters); ``engine_phases``:
    the engine's, per name one value per engine TP rank, as its last answer gave them (on
    the rank that called the engine; empty elsewhere)."""

    mode: str
    update_id: str = ""
    success: bool = False
    message: str = ""
    bytes_received: int = 0
    lower_bound_bytes: int = 0
    peak_staging_bytes: int = 0
    peak_buffer_bytes: int = 0
    handed_bytes: int = 0
    chunks: int = 0
    # pr: scale
    # this update read the engines' layout first (``_describe``)
    described: bool = False
    # the shared memory this rank keeps for the engine rank beside it (``shared_segment``:
    # CPU payloads only; ``inline_bytes`` is 0 while it carries them)
    shared_bytes: int = 0
    # pr: scale end
    # pr: remote
    # trainer-side with delta updates (``reshard_delta``): full or delta and why, the bytes
    # this rank sent and received between the trainer ranks against a full update's, the
    # density of the changes, the seconds encoding and decoding, the bases' host memory
    delta: Dict[str, object] = field(default_factory=dict)
    # pr: remote end
    inline_bytes: int = 0
    phases: Dict[str, float] = field(default_factory=dict)
    engine_phases: Dict[str, List[float]] = field(default_factory=dict)

    def finish(self, clock: PhaseClock, rank: int, sender: ShardSender) -> UpdateReport:
        """Take this rank's phases (and the engine's) from ``clock`` and what its last
        payload carried inline from ``sender``; log them in one line."""
        self.phases, self.engine_phases = clock.snapshot(), dict(clock.engine)
        # pr: scale
        self.shared_bytes = sender.shared_bytes  # the shared memory it holds
        # pr: scale end
        self.inline_bytes = sender.inline_bytes
        moved = (
            f"; {self.chunks} chunk(s), received {self.bytes_received} bytes (lower bound "
            f"{self.lower_bound_bytes}), staged at most {self.peak_staging_bytes}, buffers at "
            f"most {self.peak_buffer_bytes}"
            if self.mode == "trainer"
            else ""
        )
        logger.info(
            "weight update %s (%s-side), trainer rank %d, %s: %s%s",
            self.update_id,
            self.mode,
            rank,
            "applied" if self.success else "not applied",
            describe_phases(self.phases),
            moved,
            extra={
                "weight_update_report": self
            },  # the figures, typed, for log handlers
        )
        return self


@dataclass(frozen=True)
class UpdateOutcome:
    """What a trainer rank that raises ``PeerLost`` during an update knows of the engine's
    answer to it (the exception's ``outcome``): ``applied`` True when the engine answered
    that it applied update ``update_id`` (it then serves those weights), False when it
    answered that it failed or was never asked, None when this rank cannot know (the rank
    that asks the engine, the group's first, did not pass the answer on). ``answer``: the
    engine's message, or why there is none."""

    update_id: str
    applied: Optional[bool]
    answer: str


Reply = Tuple[bool, str]
Flow = Generator[ControlRequest, Reply, UpdateReport]


def update_flow(
    sync: TrainerSync,
    named_tensors: Iterable[Tuple[str, torch.Tensor]],
    group_ranks: Sequence[int],
    group: Optional[dist.ProcessGroup],
    mode: Mode = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Flow:
    """One update on one trainer rank, as the control requests the engine must serve.

    Every trainer rank of every engine runs it together (trainer-side mode plans
    over the whole trainer world); ``drive``/``adrive`` serve the requests. The
    first trainer-side update, and the one after a refused trainer-side update,
    first asks every engine to publish its layout and reads it from the channel.
    Trainer-side rounds wait at most ``timeout_s`` for their peers.
    """
    clock = PhaseClock()
    with clock.phase(Phase.CONTROL):
        chan = sync.channel(group_ranks, group, timeout_s)
    with clock.phase(Phase.DESCRIBE):
        shards = None
        # pr: scale
        # the last update's answer while the same DTensors come (``KeptShards``)
        shards = prepare_shards(named_tensors, sync.described.meshes, sync.shards)
        # pr: scale end
        if shards is None:
            shards = prepare_shards(named_tensors, sync.described.meshes)
        sources = sync.described.sources([(n, s) for n, _, s in shards])
    return (
        yield from sources_flow(
            sync,
            chan,
            sources,
            {n: t for n, t, _ in shards},
            lambda: deliver(
                chan,
                shards,
                # pr: scale
                layout=sources,
                # pr: scale end
            ),
            mode,
            bucket_bytes,
            timeout_s,
            clock,
        )
    )


def sources_flow(
    sync: TrainerSync,
    chan: TrainerChannel,
    sources: SourceLayout,
    local: Mapping[str, torch.Tensor],
    deliver_beside: Callable[[], str],
    mode: Mode = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    clock: Optional[PhaseClock] = None,
) -> Flow:
    """``update_flow`` for any source layout: ``sources`` (HF tensors as holders of this
    rank's ``local`` tensors, by holder key; DTensor shards or Megatron-core buffers).
    Engine-side, ``deliver_beside()`` hands this rank's part to the engine rank beside it
    and returns the update id; trainer-side, one hop straight to the engine's layout.
    ``clock``: the update's phases on this rank so far (a new one when None)."""
    clock = clock if clock is not None else PhaseClock()
    with clock.phase(Phase.DESCRIBE):
        side = described_side(sync.described, sources, chan.engine_groups, mode)
    # pr: scale
    if side == "trainer":
        return (
            yield from _trainer_side(
                sync, chan, sources, local, bucket_bytes, timeout_s, clock
            )
        )
    if chan.updates == 0 and sync.data_device.type == "cpu":
        yield from _open(chan, clock)
    # pr: scale end
    with clock.phase(Phase.DELIVER):
        update_id = deliver_beside()
    return (yield from delivered_flow(chan, update_id, clock))


# pr: scale
def _trainer_side(
    sync: TrainerSync,
    chan: TrainerChannel,
    sources: SourceLayout,
    local: Mapping[str, torch.Tensor],
    bucket_bytes: int,
    timeout_s: float,
    clock: PhaseClock,
) -> Flow:
    """Trainer-side resharding in one hop: the engines' layout read once (``_describe``),
    the inputs agreed, then per chunk this rank's moves over the trainer's world into
    parameter-shaped buffers handed to the engine rank beside it, one request each."""
    report = UpdateReport("trainer")
    rank = dist.get_rank()
    check_bound(
        None,
        timeout_s,
        f"timeout_s={timeout_s:g}: trainer rank {rank}, in each trainer-side round,",
        sync.data_device,
    )
    with clock.phase(Phase.CONTROL):
        describe = sync.world.any(
            chan.manifest is None,
            timeout_s,
            f"trainer rank {rank}: agreeing whether the engines' layout must be read",
        )
    if describe:
        report.described = True
        chan.manifest = yield from _describe(sync, chan, timeout_s, clock)
    delta = None
    # pr: scale end
    # pr: remote
    delta = sync.delta
    # pr: remote end
    # pr: scale
    parts = agree_on_inputs(
        sync,
        sources,
        local,
        chan.manifest,
        chan.engine_groups,
        bucket_bytes,
        timeout_s,
        clock,
        # pr: scale end
        # pr: remote
        delta,
        # pr: remote end
        # pr: scale
    )
    flow = _chunks_flow(
        sync, chan, sources, local, parts, bucket_bytes, timeout_s, clock, report, delta
    )
    # pr: scale end
    # pr: remote
    if delta is not None:
        flow = _delta_outcome(flow, delta, rank)
    # pr: remote end
    # pr: scale
    yield from flow
    return report.finish(clock, rank, chan.sender)


def _chunks_flow(
    sync: TrainerSync,
    chan: TrainerChannel,
    sources: SourceLayout,
    local: Mapping[str, torch.Tensor],
    parts: List[Tuple[str, ...]],
    bucket_bytes: int,
    timeout_s: float,
    clock: PhaseClock,
    report: UpdateReport,
    delta=None,
) -> Flow:
    """The agreed update's chunks on this rank, one request each, into ``report``; stops
    at the first the engine does not apply."""
    rank, names = dist.get_rank(), sorted(sources)
    for i, part in enumerate(parts):
        result = sync.plans.reshard_to_engines(
            sources,
            local,
            chan.manifest,
            chan.engine_groups,
            rank,
            bucket_bytes,
            part,
            timeout_s,
            sync.data,
            clock,
            _segment_buffers(chan.sender) if sync.data_device.type == "cpu" else None,
            checked=True,
            # pr: scale end
            # pr: remote
            delta=delta,
            # pr: remote end
            # pr: scale
        )
        with clock.phase(Phase.DELIVER):
            _count_chunk(report, result, rank)
            report.update_id = chan.next_update_id()
            _send_chunk(chan, report.update_id, rank, result, names)
        del result  # the sender keeps the buffers alive until the engine answers
        report.success, report.message = yield ControlRequest(
            report.update_id,
            chan.channel,
            chan.control,
            final=i == len(parts) - 1,
            clock=clock,
        )
        with clock.phase(Phase.DELIVER):
            chan.sender.release()  # the engine has answered: it no longer reads the buffers
        if not report.success:
            # the engine may have changed its layout: read it again next time
            chan.manifest = None
            break
    return report


# pr: scale end
# pr: remote
def _delta_outcome(flow: Flow, delta: ReshardDelta, rank: int) -> Flow:
    """``flow``'s chunks, then ``delta``'s bases kept when the engine applied the update,
    dropped when it did not or anything raised here (``reshard_delta``: the next update's
    agreement then finds the ranks apart, and that update is full on every rank)."""
    try:
        report = yield from flow
    except BaseException as e:
        delta.drop(
            f"the last update failed on trainer rank {rank}: {type(e).__name__}: {e}"
        )
        raise
    report.delta = delta.summary()
    if report.success:
        delta.commit()
    else:
        delta.drop(f"the engine did not apply the last update: {report.message}")
    return report


# pr: remote end
# pr: scale
def _count_chunk(report: UpdateReport, result, rank: int) -> None:
    """Add one trainer-side chunk's figures to ``report``."""
    report.chunks += 1
    report.bytes_received += result.stats.bytes_received
    report.lower_bound_bytes += result.lower_bound_bytes(rank)
    report.peak_staging_bytes = max(
        report.peak_staging_bytes, result.stats.peak_staging_bytes
    )
    handed = result.handed_bytes()
    report.handed_bytes += handed
    report.peak_buffer_bytes = max(report.peak_buffer_bytes, handed)


def _send_chunk(
    chan: TrainerChannel,
    update_id: str,
    rank: int,
    result: TrainerSideResult,
    names: List[str],
) -> None:
    """Hand one chunk's parameter-shaped buffers, and its block-FP8 weights' regions
    (``TrainerSideResult.fp8_regions``), to the engine rank beside this rank."""
    tensors = [(n, t, None) for n, t in result.buffers.items()]
    tensors += [(r.key, t, None) for r, t in result.fp8_regions]
    _cuda_ipc_ready([t for _, t, _ in tensors])
    chan.sender.send(
        update_id,
        rank,
        chan.rank_map,
        tensors,
        kind=PayloadKind.PARAMS,
        names=names,
        fingerprint=chan.manifest.fingerprint,
        fp8_regions=[r for r, _ in result.fp8_regions],
    )


def agree_on_inputs(
    sync: TrainerSync,
    sources: SourceLayout,
    local: Mapping[str, torch.Tensor],
    manifest: EngineManifest,
    engine_groups: Sequence[Sequence[int]],
    bucket_bytes: int,
    timeout_s: float,
    clock: PhaseClock,
    # pr: scale end
    # pr: remote
    delta: Optional[ReshardDelta] = None,
    # pr: remote end
    # pr: scale
) -> List[Tuple[str, ...]]:
    """The update's chunks, once every trainer rank agreed (one all-reduce) that all plan
    from the same inputs and that every rank's ``local`` tensors fit its plans
    (``TrainerPlans.shard_problems``, checked before the agreement): a wrong shard on one
    rank is then a ``GroupRefusal`` naming it on every rank, where a check raising on that
    rank alone after the agreement would leave its peers waiting in rounds that end in
    ``PeerLost``. Different inputs raise ``ValueError`` on every rank. The agreement also
    says whether some rank lacks a data group (the first update, or a wait on it failed):
    then every rank makes a new one (``TrainerSync.ready_data``)."""
    # pr: scale end
    # pr: remote
    # With ``delta`` (``reshard_delta``) it also settles whether the update is a delta: every
    # rank asks for deltas or none does, and all hold bases of the same update.
    # pr: remote end
    # pr: scale
    rank, names = dist.get_rank(), sorted(sources)
    with clock.phase(Phase.PLAN):
        digest = sync.plans.inputs_digest(
            sources, manifest, engine_groups, bucket_bytes
        )
        parts = chunks(manifest, names, bucket_bytes)
        problems = sync.plans.shard_problems(
            sources,
            local,
            manifest,
            engine_groups,
            bucket_bytes,
            parts,
            rank,
            sync.data_device,
        )
    values = {"inputs": fingerprint_int(digest)}
    proposals = {
        "data group number": DataGroup.number_proposal(
            None, sync.data_groups_made, sync.lacks_data
        )
    }
    # pr: scale end
    # pr: remote
    more_values, more_proposals = agreement_values(delta, digest)
    values.update(more_values)
    proposals.update(more_proposals)
    # pr: remote end
    # pr: scale
    with clock.phase(Phase.AGREE):
        agreed = sync.world.agree(
            problems,
            values,
            {"no data group": sync.lacks_data},
            timeout_s,
            f"trainer rank {rank}: checking that every rank plans alike, from tensors "
            "that fit its plan",
            proposals,
        )
    # pr: scale end
    # pr: remote
    if "delta" in agreed.unequal:
        raise ValueError(
            f"trainer rank {rank}: some trainer ranks ask for delta updates and some do "
            f"not (this rank: delta={delta is not None}); every rank must ask alike"
        )
    # pr: remote end
    # pr: scale
    if "inputs" in agreed.unequal:
        raise ValueError(
            f"trainer rank {rank}: the trainer ranks described different tensors or layouts for this update "
            f"(this rank's inputs {digest[:12]}): each rank plans only its own moves, so all must plan from "
            "the same sources"
        )
    if agreed.problems:
        raise GroupRefusal(
            "the trainer ranks refused the update before any byte moved: "
            + "; ".join(agreed.problems)
        )
    with clock.phase(Phase.CONTROL):
        sync.ready_data(
            (
                agreed.highest["data group number"]
                if "no data group" in agreed.raised
                else None
            ),
            timeout_s,
        )
    # pr: scale end
    # pr: remote
    if delta is not None:
        delta.begin(agreed, digest)
    # pr: remote end
    # pr: scale
    return parts


def _segment_buffers(sender: ShardSender):
    """Parameter buffers in ``sender``'s shared memory (None while it has none to give)."""

    def alloc(targets) -> Optional[Dict[str, torch.Tensor]]:
        views = sender.buffers([t.shape for t in targets], [t.dtype for t in targets])
        return None if views is None else {t.name: v for t, v in zip(targets, views)}

    return alloc


# pr: scale end
def delivered_flow(
    chan: TrainerChannel, update_id: str, clock: Optional[PhaseClock] = None
) -> Flow:
    """The engine-side flow once every rank has delivered under ``update_id``: one request.
    ``clock``: the update's phases on this rank so far (a new one when None)."""
    clock = clock if clock is not None else PhaseClock()
    report = UpdateReport("engine", update_id)
    report.success, report.message = yield ControlRequest(
        update_id, chan.channel, chan.control, clock=clock
    )
    with clock.phase(Phase.DELIVER):
        chan.sender.release()  # the engine has answered: it no longer reads the shards
    return report.finish(
        clock, dist.get_rank() if dist.is_initialized() else 0, chan.sender
    )


# pr: scale
def _ask_to_describe(
    chan: TrainerChannel, clock: PhaseClock, final: bool = True
) -> Generator[ControlRequest, Reply, Reply]:
    """A "describe" payload to the engine rank beside this rank, then the request that
    makes the engine publish its layout into the channel; the engine's answer."""
    update_id = chan.next_update_id()
    with clock.phase(Phase.DELIVER):
        chan.sender.send(
            update_id, dist.get_rank(), chan.rank_map, [], kind=PayloadKind.DESCRIBE
        )
    return (
        yield ControlRequest(
            update_id,
            chan.channel,
            chan.control,
            describe=True,
            final=final,
            clock=clock,
        )
    )


def _open(
    chan: TrainerChannel, clock: PhaseClock
) -> Generator[ControlRequest, Reply, None]:
    """Before the first engine-side payload on a CPU channel, one round trip (the engine
    publishes its layout, which is all a request without weights can ask of it) so that the
    engine binds the channel's sockets first. The first payload then goes through shared
    memory, as every later one does: sent inline, it would be a layout of its own, and the
    second update would pay for mapping the segment and for the engine's first sight of
    every tensor (seconds, at a MoE model's tensor count). Every rank of every group opens
    alike (its channel's first update, the world's data device); an engine that cannot
    answer is the update's to report, so a refusal here is only logged."""
    # not final: the engine flushes no cache for it
    success, message = yield from _ask_to_describe(chan, clock, final=False)
    if not success:
        logger.warning(
            "trainer rank %d: the engine did not open channel %s before the first update "
            "(its payload goes inline): %s",
            dist.get_rank(),
            chan.channel,
            message,
        )


def _describe(
    sync: TrainerSync, chan: TrainerChannel, timeout_s: float, clock: PhaseClock
) -> Generator[ControlRequest, Reply, EngineManifest]:
    """Ask the engine to publish its layout; every trainer rank reads its engine rank's
    copy, and all must agree (one tiny all-reduce): engines are replicas of one layout."""
    success, message = yield from _ask_to_describe(chan, clock)
    manifest, problem = None, message
    with clock.phase(Phase.DESCRIBE):
        if success:
            try:
                manifest = read_manifest(chan.sender.channel, chan.engine_rank)
            except ManifestError as e:
                problem = str(e)
    digest = fingerprint_int(manifest.fingerprint) if manifest else 0
    with clock.phase(Phase.AGREE):
        agreed = sync.world.all_equal(
            digest,
            timeout_s,
            f"trainer rank {dist.get_rank()}: checking that every engine published one layout",
        )
    if manifest is None or not agreed:
        raise ManifestError(
            f"trainer rank {dist.get_rank()}: engines did not publish one common layout "
            f"(this rank's engine: {problem if manifest is None else manifest.fingerprint[:12]})"
        )
    return manifest


# pr: scale end
def as_reply(result, request: Optional[ControlRequest] = None) -> Reply:
    """(success, message) from an Engine tuple or an HTTP adapter's JSON body; the body's
    ``phases`` (the engine's, per TP rank) go to ``request``'s clock."""
    if not isinstance(result, dict):
        return bool(result[0]), str(result[1])
    if request is not None and request.clock is not None:
        request.clock.engine = dict(result.get("phases") or {})
    return result["success"], result["message"]


class _Driver:
    """Walks a flow: before each request every payload is on its way (barrier); the
    group's first rank serves it and every rank of the group hears the reply, which
    also keeps every rank's buffers alive until the engine has read them. Waits are
    bounded by ``timeout_s`` (the engine waits at most that for payloads, and
    ``timeout_s + GRACE_S`` for its own ranks)."""

    def __init__(
        self,
        flow: Flow,
        group_ranks: Sequence[int],
        request: Optional[ControlRequest],
        timeout_s: float,
    ) -> None:
        self.flow, self.group_ranks, self.timeout_s = flow, group_ranks, timeout_s
        self.request, self.report = request or next(flow), None
        self.me = dist.get_rank()
        self.leader = self.me == group_ranks[0]

    def timed(self, phase: Phase):
        """Time a step of the driver in the request's clock (when it has one), as a round trip."""
        clock = self.request.clock
        if clock is None:
            return contextlib.nullcontext()
        clock.count(Count.ROUND_TRIPS)
        return clock.phase(phase)

    def ready(self) -> bool:
        try:
            with self.timed(Phase.CONTROL):
                self.request.control.barrier(
                    self.timeout_s,
                    f"trainer rank {self.me}: before the engine reads the payloads",
                )
        except PeerLost as e:
            raise self._lost(e, None, asked=False) from None
        return self.leader

    def advance(self, reply: Optional[Reply]) -> bool:
        """Hand the reply to the flow; False once the update is over. The barrier comes first
        so that a rank lost meanwhile is named (gloo's monitored barrier); the engine waits at
        most timeout_s for payloads and timeout_s + GRACE_S for its own ranks."""
        control = self.request.control
        try:
            with self.timed(Phase.ENGINE):
                control.barrier(
                    trainer_bound_s(self.timeout_s),
                    f"trainer rank {self.me}: while the engine applies the update",
                )
            with self.timed(Phase.CONTROL):
                shared = control.broadcast_result(
                    reply,
                    self.group_ranks[0],
                    self.timeout_s,
                    f"trainer rank {self.me}: hearing the engine's answer from rank "
                    f"{self.group_ranks[0]}",
                )
        except PeerLost as e:
            raise self._lost(e, reply, asked=True) from None
        try:
            self.request = self.flow.send(shared)
            return True
        except StopIteration as done:
            self.report = done.value
            return False

    def _lost(self, e: PeerLost, reply: Optional[Reply], asked: bool) -> PeerLost:
        """``e`` saying what this rank knows of the engine's answer to the request (and in
        ``outcome``): the first rank holds the answer, or knows the engine was not asked; the
        others know only that the engine is asked once every rank has passed the first barrier."""
        update_id, first = self.request.update_id, self.group_ranks[0]
        if reply is not None:
            applied, answer = bool(reply[0]), reply[1]
            said = (
                f"the engine APPLIED update {update_id!r} before this rank lost its peer, and "
                f"serves its weights (its answer: {answer})"
                if applied
                else f"the engine answered that update {update_id!r} failed: {answer}"
            )
        elif self.leader and not asked:
            applied, answer = False, "not asked"
            said = f"the engine was not asked to apply update {update_id!r}"
        else:
            applied = None
            answer = (
                f"trainer rank {first} asks the engine once every rank has passed the barrier "
                f"before it, and its answer did not reach trainer rank {self.me}"
            )
            said = f"whether the engine applied update {update_id!r} is unknown here: {answer}"
        lost = PeerLost(f"{e}; {said}")
        lost.outcome = UpdateOutcome(update_id, applied, answer)
        return lost


def _failed(e: Exception) -> Reply:
    return (
        False,
        f"{type(e).__name__}: {e}",
    )  # e.g. an HTTP 400: every rank must hear it, not hang


def drive(
    flow: Flow,
    group_ranks: Sequence[int],
    group,
    call: Callable[[ControlRequest], Reply],
    request: Optional[ControlRequest] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> UpdateReport:
    """Serve a flow's control requests with ``call`` on the group's first rank (from
    ``request`` when the flow has already been started)."""
    d = _Driver(flow, group_ranks, request, timeout_s)
    while True:
        reply = None
        if d.ready():
            try:
                with d.timed(Phase.ENGINE):
                    reply = call(d.request)
            except Exception as e:  # noqa: BLE001
                reply = _failed(e)
        if not d.advance(reply):
            return d.report


async def adrive(
    flow: Flow,
    group_ranks: Sequence[int],
    group,
    call,
    request=None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> UpdateReport:
    """``drive`` with an async ``call``."""
    d = _Driver(flow, group_ranks, request, timeout_s)
    while True:
        reply = None
        if d.ready():
            try:
                with d.timed(Phase.ENGINE):
                    reply = await call(d.request)
            except Exception as e:  # noqa: BLE001
                reply = _failed(e)
        if not d.advance(reply):
            return d.report


async def update_weights_distributed(
    engine,
    params_batch: List[Tuple[str, torch.Tensor]],
    device_mesh_key: str,
    device_mesh,
    load_format: Optional[str] = None,
    flush_cache: Optional[bool] = None,
    *,
    fallback,
    timeout_s: float = DEFAULT_TIMEOUT_S,
):
    """``weight_sync.utils.update_weights`` without full_tensor() or gather_object.

    Called on every rank of ``device_mesh`` (e.g. ("dp", "infer_tp", "infer_pp")).
    Each rank of ``device_mesh[device_mesh_key]`` delivers its own shards; its
    first rank then sends ``engine`` (anything with an async
    ``update_weights_from_tensor(req)``, e.g. an HTTP client) a tensor-path
    request whose reserved ``load_format`` makes the engine take the payloads
    from the channel. ``fallback`` (upstream's gathered path) runs only for what
    this path cannot serve: another ``load_format``, or a layout that is not
    boxes (``Partial`` placements). Every wait is bounded by ``timeout_s``: when a
    peer dies the survivors raise ``control_plane.PeerLost`` naming the phase.
    """
    from sglang.srt.managers.io_struct import UpdateWeightsDistributedReqInput
    from sglang.srt.weight_sync.protocol import as_tensor_request

    timeout_s = check_timeout(timeout_s)
    mesh = device_mesh[device_mesh_key]
    ranks, group = [int(r) for r in mesh.mesh.tolist()], mesh.get_group()
    reason = f"load_format={load_format!r}" if load_format is not None else None
    if reason is None:
        flow = update_flow(
            TrainerSync.of(device_mesh), params_batch, ranks, group, timeout_s=timeout_s
        )
        try:
            first = next(flow)
        except LayoutError as e:
            reason = str(e)
    if reason is not None:
        logger.warning(
            "update_weights: using the gathered (full_tensor) path: %s", reason
        )
        return await fallback(
            engine, params_batch, device_mesh_key, device_mesh, load_format
        )
    raw = []

    async def call(request: ControlRequest) -> Reply:
        final_flush = (
            (True if flush_cache is None else flush_cache) if request.final else False
        )
        obj = UpdateWeightsDistributedReqInput(
            update_id=request.update_id,
            channel=request.channel,
            timeout_s=timeout_s,
            flush_cache=final_flush,
        )
        raw[:] = [
            await engine.update_weights_from_tensor(as_tensor_request(obj, len(ranks)))
        ]
        return as_reply(raw[0], request)

    await adrive(flow, ranks, group, call, first, timeout_s)
    return raw[0] if raw else None
