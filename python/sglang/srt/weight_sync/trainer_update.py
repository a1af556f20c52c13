"""The trainer side of a distributed weight update: every rank delivers only its own shards.

Each trainer rank sits beside one engine TP rank (its rank in the inference-TP
mesh). It keeps its local shards (``DTensor.to_local()``, never
``full_tensor()``), describes their layout (``MeshSpec``) and sends both to the
engine rank beside it over the group's private channel. Nothing is gathered.

When the shards beside an engine do not cover a tensor (FSDP over more GPUs
than one engine has, train TP > infer TP across several engines), resharding
runs on the trainer side first (``mode="trainer"``, chosen automatically): the
same planner and executor move, over the trainer's world, exactly the rows each
rank lacks so that every engine group holds its tensor split evenly on dim 0
(``Shard(0)`` within the group); the engine then reshards that to its own layout.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from typing import Dict, Iterable, List, Literal, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.delivery import CHANNEL_PREFIX, DEFAULT_TIMEOUT_S, ShardSender, check_timeout, local_shard
from sglang.srt.weight_sync.executor import execute
from sglang.srt.weight_sync.planner import PlanCache
from sglang.srt.weight_sync.source_layout import HoldersSpec, MeshSpec, SourceLayout, SourceTensor
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece
from sglang.srt.weight_sync.waits import GRACE_S, barrier

logger = logging.getLogger(__name__)

Mode = Literal["auto", "engine", "trainer"]
Shards = List[Tuple[str, torch.Tensor, MeshSpec]]
_plans = PlanCache()


@dataclass
class TrainerChannel:
    """One engine TP group's channel, seen from one trainer rank of that group."""

    channel: str
    group_ranks: Tuple[int, ...]  # trainer global ranks, in engine TP rank order
    engine_groups: Tuple[Tuple[int, ...], ...]  # every engine's group, for trainer-side resharding
    engine_rank: int
    sender: ShardSender
    token: str
    updates: int = 0

    @property
    def rank_map(self) -> Dict[int, int]:
        return {r: i for i, r in enumerate(self.group_ranks)}

    def next_update_id(self) -> str:
        self.updates += 1
        return f"{self.token}-{self.updates}"


_channels: Dict[Tuple[int, ...], TrainerChannel] = {}


def open_channel(group_ranks: Sequence[int], group: Optional[dist.ProcessGroup]) -> TrainerChannel:
    """The channel of an engine TP group (one per process and group, made once).

    Every trainer rank calls this together. The group's first rank draws a
    token and broadcasts it (a few bytes of control, no payload); every rank
    makes the private directory on its node and connects to the socket of the
    engine rank beside it; one small integer all-gather tells every rank all
    engine groups.
    """
    key = tuple(int(r) for r in group_ranks)
    if key not in _channels:
        token = [uuid.uuid4().hex if dist.get_rank() == key[0] else None]
        dist.broadcast_object_list(token, src=key[0], group=group)
        channel = os.path.join(tempfile.gettempdir(), f"{CHANNEL_PREFIX}{token[0]}")
        os.makedirs(channel, mode=0o700, exist_ok=True)
        os.chmod(channel, 0o700)
        engine_rank = key.index(dist.get_rank())
        if not _channels:
            atexit.register(close_channels)
        _channels[key] = TrainerChannel(
            channel, key, _engine_groups(key[0], engine_rank), engine_rank, ShardSender(channel, engine_rank), token[0]
        )
    return _channels[key]


def close_channels() -> None:
    """Close this process's senders and remove their channel directories (with the engine
    sockets in them): the trainer made them, so the trainer takes them away."""
    while _channels:
        _, chan = _channels.popitem()
        chan.sender.close()
        shutil.rmtree(chan.channel, ignore_errors=True)


def _engine_groups(first_rank: int, engine_rank: int) -> Tuple[Tuple[int, ...], ...]:
    """All engine groups, from each trainer rank's (group's first rank, engine rank)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    mine = torch.tensor([first_rank, engine_rank], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size() * 2, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine)
    groups: Dict[int, Dict[int, int]] = {}
    for rank, (first, index) in enumerate(every.view(-1, 2).tolist()):
        groups.setdefault(first, {})[index] = rank
    return tuple(tuple(g[i] for i in sorted(g)) for _, g in sorted(groups.items()))


def prepare_shards(named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> Shards:
    """Local shard and layout of each tensor: DTensors keep their own mesh; a plain
    tensor is the full tensor, held by every trainer rank."""
    everyone = list(range(dist.get_world_size()))
    out = []
    for name, tensor in named_tensors:
        spec = None if _is_dtensor(tensor) else MeshSpec.full(tensor.shape, tensor.dtype, everyone)
        local, spec = local_shard(tensor, spec)
        out.append((name, local, spec))
    return out


def uncovered(source: SourceTensor) -> Optional[Box]:
    """A region of the tensor that none of the holders has, or None when they cover it."""
    remaining = [Box.full(source.shape)]
    for h in source.holders:
        if not h.box.is_empty():
            remaining = [piece for rem in remaining for piece in rem.subtract(h.box)]
    return remaining[0] if remaining else None


def trainer_side_names(shards: Shards, engine_groups: Sequence[Sequence[int]], mode: Mode = "auto") -> List[str]:
    """Tensors to reshard on the trainer side first: in "auto" mode, those some engine
    group's trainer ranks do not cover. The same answer on every rank."""
    if mode == "engine":
        return []
    if mode == "trainer":
        return [name for name, _, _ in shards]
    maps = [{r: i for i, r in enumerate(g)} for g in engine_groups]
    names = [name for name, _, spec in shards if any(uncovered(spec.describe(name, m)) for m in maps)]
    if names:
        logger.info("weight update: %d of %d tensors (e.g. %s) are not covered beside an engine; "
                    "resharding them on the trainer side first", len(names), len(shards), names[0])
    return names


def reshard_for_engines(
    shards: Shards, engine_groups: Sequence[Sequence[int]], bucket_bytes: int, timeout_s: Optional[float] = None
) -> Shards:
    """Trainer-side mode: over the default (trainer) group, each rank receives the rows
    of each tensor that ``Shard(0)`` within its engine group gives it, and no more.
    Every trainer rank must call this with the same tensors."""
    sources = {name: spec.describe(name) for name, _, spec in shards}
    return reshard_to_engine_groups(sources, {name: t for name, t, _ in shards}, engine_groups, bucket_bytes,
                                    timeout_s)


def reshard_to_engine_groups(
    sources: SourceLayout, buffers: Dict[str, torch.Tensor], engine_groups: Sequence[Sequence[int]], bucket_bytes: int,
    timeout_s: Optional[float] = None,
) -> Shards:
    """``reshard_for_engines`` for any source layout (trainer ranks), reading this rank's
    local ``buffers`` by holder key."""
    groups = [list(g) for g in engine_groups]
    targets, neutral = {}, {}
    device = next(iter(buffers.values())).device if buffers else None
    for name, src in sorted(sources.items()):
        neutral[name] = MeshSpec.sharded(src.shape, src.dtype, 0, groups)
        for h in neutral[name].describe(name).holders:
            piece = Piece(name, h.box, (), (0,) * h.box.ndim)
            targets.setdefault(h.rank, []).append(
                ParamTarget(name, h.box.sizes, src.dtype, (piece,) if h.box.numel else ()))
    me = dist.get_rank()
    plan = _plans.get(sources, targets, bucket_bytes=bucket_bytes)
    mine = {t.name: torch.empty(t.shape, dtype=t.dtype, device=device) for t in targets.get(me, ())}
    execute(plan, me, buffers, mine, timeout_s=timeout_s)
    return [(name, mine[name], neutral[name]) for name in sorted(sources)]


def deliver(chan: TrainerChannel, shards: Shards, pieces: Optional[Mapping[str, HoldersSpec]] = None) -> str:
    """Send this rank's shards (and buffers that ``pieces`` describe, spec None) to the
    engine rank beside it; returns the update id."""
    update_id = chan.next_update_id()
    if any(t.is_cuda for _, t, _ in shards):
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # CUDA IPC names GPUs by UUID (breaks CPU tensors, so GPU only)
    chan.sender.send(update_id, dist.get_rank(), chan.rank_map, shards, pieces)
    return update_id


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def send_weights(
    named_tensors: Iterable[Tuple[str, torch.Tensor]],
    group_ranks: Sequence[int],
    group: Optional[dist.ProcessGroup],
    mode: Mode = "auto",
    bucket_bytes: int = 512 << 20,
    timeout_s: Optional[float] = None,
) -> Tuple[TrainerChannel, str]:
    """Deliver this rank's shards of ``named_tensors`` to the engine rank beside it.

    Every trainer rank calls this with the same names. Returns the channel and
    the update id for the engine's control request. Trainer-side resharding waits
    at most ``timeout_s`` per round for its peers.
    """
    chan = open_channel(group_ranks, group)
    shards = prepare_shards(named_tensors)
    names = set(trainer_side_names(shards, chan.engine_groups, mode))
    if names:
        moved = {n: (t, s) for n, t, s in reshard_for_engines([x for x in shards if x[0] in names],
                                                               chan.engine_groups, bucket_bytes, timeout_s)}
        shards = [(n, *moved[n]) if n in names else (n, t, s) for n, t, s in shards]
    return chan, deliver(chan, shards)


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
    peer dies the survivors raise ``waits.PeerLost`` naming the phase.
    """
    from sglang.srt.managers.io_struct import UpdateWeightsDistributedReqInput
    from sglang.srt.weight_sync.engine_update import as_tensor_request
    from sglang.srt.weight_sync.source_layout import LayoutError

    timeout_s = check_timeout(timeout_s)
    mesh = device_mesh[device_mesh_key]
    ranks, group = [int(r) for r in mesh.mesh.tolist()], mesh.get_group()
    reason = f"load_format={load_format!r}" if load_format is not None else None
    if reason is None:
        try:
            chan, update_id = send_weights(params_batch, ranks, group, timeout_s=timeout_s)
        except LayoutError as e:
            reason = str(e)
    if reason is not None:
        logger.warning("update_weights: using the gathered (full_tensor) path: %s", reason)
        return await fallback(engine, params_batch, device_mesh_key, device_mesh, load_format)
    me = dist.get_rank()
    barrier(group, timeout_s, f"trainer rank {me}: before the engine reads the payloads")
    result = None
    if mesh.get_local_rank() == 0:
        obj = UpdateWeightsDistributedReqInput(update_id=update_id, channel=chan.channel, timeout_s=timeout_s,
                                               flush_cache=True if flush_cache is None else flush_cache)
        req = as_tensor_request(obj, len(ranks))
        result = await engine.update_weights_from_tensor(req)
    # the engine has read every shard before the trainer may change them; it waits at most
    # timeout_s for payloads and timeout_s + GRACE_S for its own ranks
    barrier(group, 2 * timeout_s + GRACE_S, f"trainer rank {me}: while the engine applies the update")
    return result
