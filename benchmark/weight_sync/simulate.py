"""Large-scale simulator for distributed weight updates (metadata only, no tensors).

A scenario is (model, training layout, inference layout, topology). Training and
inference are colocated: GPU ``g`` hosts trainer rank ``g`` and one engine rank;
``engines`` engines of ``tp_size`` ranks each sit on consecutive GPUs (engine
``e`` on GPUs ``[e*tp_size, (e+1)*tp_size)``), ``gpus_per_node`` GPUs per node.
Planner ranks are GPU ids, so trainer rank ``k`` delivers to the engine rank on
GPU ``k`` with no network traffic.

Where resharding runs (``docs/design.md``, "Where resharding runs"), chosen per scenario ("auto"):
* ``engine``: every engine's own ranks hold every source tensor in full between
  them; one plan per engine over that engine's ranks (sources outside it are
  ignored). All engines are planned; reported numbers are the max over engines,
  ``plan_seconds`` the slowest engine's plan (engines plan concurrently).
* ``trainer``: otherwise; one plan over all trainer ranks in which GPU ``g``
  needs the targets of engine rank ``g % tp_size``: the plan the runtime's
  one-hop trainer-side path computes (``trainer_reshard.plan_to_engines``, rank by
  rank; a test pins that the bytes agree with what the runtime moves). Its moves are
  point-to-point; ``bytes_sent_max`` counts each copy sent.

``plan_seconds_per_rank`` (JSON): what one rank spends planning (wall clock; the
largest over the timed ranks, ``plan_seconds_by_rank``; ``plan_cpu_seconds`` the CPU
time). Engine side, every engine rank computes its engine's whole plan, listing
only its own local copies (``planner.plan`` through a ``PlanCache`` keyed with the
engine manifest's fingerprint, as the runtime's first update does), timed for each
engine's first rank from a cold start; the figures come from the same plan with every
rank's local copies listed; the manifest is made once per engine layout (in
``describe``). Trainer side, each rank plans only its own
moves (``trainer_reshard.plan_to_engines`` for every chunk, as the runtime calls it,
from a cold cache): timed, and its figures computed, for ``metrics_ranks`` (every
rank up to 32 ranks; else the first, middle and last rank, so the trainer-side
maxima are over those ranks). Plans are made as the runtime makes them, without a
topology; the topology only sorts moved bytes into link classes.

Designs compared per scenario:
* ``distributed``: our planner (``sglang.srt.weight_sync.planner.plan``).
* ``full_tensor``: the upstream path (verl + SGLang ``update_weights_from_tensor``):
  every trainer rank all-gathers every full parameter (``DTensor.full_tensor()``,
  in the trainer's dtype), hands it to the engine rank beside it, which slices
  its part. Received per rank = full model bytes - bytes that rank already held.
  Peak = the largest batch of full tensors held at once: upstream gathers
  tensor by tensor and flushes a batch at the bucket size (so a tensor larger
  than the bucket is a batch on its own), i.e. it frees per batch, it does not
  keep the whole model.
* ``rank0_funnel``: every byte goes through trainer rank 0: rank 0 receives the
  full model (minus its own shards), then sends every other GPU its engine
  rank's part. Peak as for ``full_tensor``, on rank 0.

Metrics (all per rank, then the max over ranks):
* ``bytes_received_max``: bytes a rank receives from other ranks (over any link).
  Counted in the destination dtype for ``distributed`` (the sender casts) and in
  the trainer dtype for the baselines (they gather the trainer's tensors).
* ``lower_bound_bytes_max``: needed - held (``Plan.lower_bound_bytes``), the same
  value on every design row of a scenario.
* ``peak_bytes_max`` (``distributed``): the largest number of bytes any rank moves
  (sends + receives) within one round of the plan. The executor's extra memory
  per round is at most this (it stages at worst every byte it moves), and the
  bucketer keeps it <= ``bucket_bytes`` unless one row of a tensor is larger.
  ``staging_bytes_max`` is the exact staging need: bytes received into a
  non-contiguous destination region plus bytes sent from a non-contiguous or
  dtype-cast source region, per rank per round.
* ``modelled_seconds``: bandwidth-only model, no latency, no software overhead.
  Per rank, the links work concurrently; its time is
      max(local/HBM, nvl_in/NVL, nvl_out/NVL, net_in/NET, net_out/NET)
  where NVL = 450 GB/s per GPU per direction (NVLink 4), NET = 50 GB/s per GPU per
  direction (one 400 Gb/s NIC per GPU), HBM = 2 TB/s effective device-local copy
  (read + write); the scenario time is the max over ranks. ``local`` is the bytes
  a rank copies on its own device (distributed: its local moves; baselines: the
  engine slicing its part out of the gathered full tensors). Same-node traffic
  goes over NVLink, cross-node over the NIC. ``distributed`` broadcasts: the
  source sends once per link class it reaches, receivers' relays are not counted.
  ``full_tensor``: modelled as the best hierarchical all-gather: bytes no GPU of
  the node holds cross into the node once, spread evenly over the node's NICs
  (``net`` per GPU = node's missing bytes / GPUs per node); everything else a GPU
  lacks arrives over NVLink; a rank sends as much as it receives (ring). This
  flatters the baseline;
  ``modelled_seconds_flat`` (JSON only) is the flat variant in which every GPU
  pulls all of its node's missing bytes over its own NIC.
  ``rank0_funnel``: rank 0's receive and send set the time.

Run from the repository root::

    python -m benchmark.weight_sync.simulate            # table of the default scenarios
    python -m benchmark.weight_sync.simulate --json     # one JSON list
    python -m benchmark.weight_sync.simulate --list
    python -m benchmark.weight_sync.simulate --scenario dsv3-tp8ep256-to-tp256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from benchmark.weight_sync.hand_rules import (
    QKV,
    ExpertsW2,
    ExpertsW13,
    Replicated,
    Sharded,
    Stacked,
    Vocab,
)
from benchmark.weight_sync.models import ModelSpec, get_model
from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.manifest import EngineManifest
from sglang.srt.weight_sync.planner import (
    DEFAULT_BUCKET_BYTES,
    Dest,
    Move,
    Plan,
    PlanCache,
    Topology,
    forget_indexes,
    plan,
)
from sglang.srt.weight_sync.source_layout import (
    MeshSpec,
    SourceLayout,
    SourceTensor,
    describe_mesh,
)
from sglang.srt.weight_sync.target_layout import (
    EngineParallel,
    ModelTargets,
    ParamTarget,
)
from sglang.srt.weight_sync.trainer_reshard import TrainerPlans, chunk_digest, chunks


def plan_to_engines(
    plans: TrainerPlans, sources, manifest, groups, bucket_bytes, part, rank
):
    """``rank``'s plan of one chunk, as the runtime makes it (``TrainerPlans.plan_to_engines``)."""
    return plans.plan_to_engines(sources, manifest, groups, bucket_bytes, part, rank)


NVLINK_BYTES_PER_S = 450e9  # NVLink 4, per GPU per direction (H100/H200)
NETWORK_BYTES_PER_S = 50e9  # 400 Gb/s NDR NIC, one per GPU, per direction
HBM_COPY_BYTES_PER_S = 2e12  # effective device-local copy (read + write) on H100
GPUS_PER_NODE = 8

DESIGNS = ("distributed", "full_tensor", "rank0_funnel")

# Link classes, as Topology.distance returns them.
SAME_RANK, SAME_DEVICE, SAME_NODE, OTHER_NODE = 0, 1, 2, 3


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class TrainLayout:
    """How the trainer holds the HF-named tensors on ``world`` ranks (= GPUs).

    ``kind`` "megatron": tensor parallel ``tp`` over consecutive ranks (TP innermost,
    Megatron's default order), DP replicas of each TP group; column-parallel tensors
    (q/k/v, gate/up, q_b/kv_b, vocab) split on dim 0, row-parallel (o, down) on
    dim 1, the rest (norms, routers, MLA's q_a/kv_a "duplicated" linears) replicated
    on every rank.
    ``kind`` "fsdp": FSDP2 ``Shard(0)`` of every non-expert tensor over all ranks
    (``hsdp`` > 1: ``hsdp`` replicas of a ``world/hsdp``-rank shard group).
    ``ep`` > 0: routed experts are expert-parallel, expert-TP 1: expert ``e`` lives
    whole on EP rank ``e // (E/ep)``; global rank ``g`` is EP rank ``g % ep``
    (Megatron's tp-cp-ep-dp order with ETP 1), replicated ``world/ep`` times.
    ``dtype``: the trainer's tensors (Megatron keeps bf16 model weights; FSDP2 keeps
    fp32 sharded parameters, which ``full_tensor()`` gathers in fp32).
    """

    kind: str
    world: int
    tp: int = 1
    ep: int = 0
    hsdp: int = 1
    dtype: torch.dtype = torch.bfloat16

    def label(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        if self.kind == "megatron":
            s = f"Megatron TP{self.tp} x DP{self.world // self.tp}"
        else:
            s = f"FSDP Shard(0) x{self.world // self.hsdp}" + (
                f" x HSDP{self.hsdp}" if self.hsdp > 1 else ""
            )
        if self.ep:
            s += f", experts EP{self.ep}" + (
                f" x {self.world // self.ep} replicas" if self.world > self.ep else ""
            )
        return f"{s} ({dt})"


@dataclass(frozen=True)
class InferLayout:
    """``engines`` SGLang engines of ``parallel.tp_size`` ranks each."""

    parallel: EngineParallel
    engines: int = 1

    @property
    def size(self) -> int:
        return self.parallel.tp_size

    def label(self) -> str:
        p = self.parallel
        s = f"{self.engines} x TP{p.tp_size}"
        if p.attn_tp_size and p.attn_tp_size != p.tp_size:
            s += f" (attn_tp {p.attn_tp_size}, DP-attn {p.tp_size // p.attn_tp_size})"
        if p.moe_ep_size > 1:
            s += f" EP{p.moe_ep_size}"
        return s


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    train: TrainLayout
    infer: InferLayout
    why: str = ""
    mode: str = "auto"  # "auto", "engine" or "trainer"
    gpus_per_node: int = GPUS_PER_NODE

    @property
    def gpus(self) -> int:
        return self.train.world


# Default scenarios. GPU counts are colocated (trainer and engines on the same GPUs).
SCENARIOS: Tuple[Scenario, ...] = (
    Scenario(
        "qwen3-8b-tp2-to-tp4",
        "Qwen3-8B",
        TrainLayout("megatron", 8, tp=2),
        InferLayout(EngineParallel(4), engines=2),
        why="one node; shards shrink 2x on TP 2->4, each engine spans two whole training TP "
        "groups, so the engine-side plan covers everything; GQA kv heads split 8/4",
    ),
    Scenario(
        "qwen3-8b-tp4-to-tp4",
        "Qwen3-8B",
        TrainLayout("megatron", 8, tp=4),
        InferLayout(EngineParallel(4), engines=2),
        why="aligned layouts (fused qkv/gate_up per component, same vocab split): "
        "should move 0 bytes, only device-local copies",
    ),
    Scenario(
        "qwen3-8b-fsdp8-to-tp2",
        "Qwen3-8B",
        TrainLayout("fsdp", 8, dtype=torch.float32),
        InferLayout(EngineParallel(2), engines=4),
        why="verl-style FSDP2 over the node (fp32 shards) feeding 4 small TP2 engines: one "
        "engine's 2 GPUs hold 1/4 of the model, so the plan runs trainer-side",
    ),
    Scenario(
        "qwen3-235b-tp4ep64-to-tp8ep8",
        "Qwen3-235B-A22B",
        TrainLayout("megatron", 64, tp=4, ep=64),
        InferLayout(EngineParallel(8, moe_ep_size=8), engines=8),
        why="8 nodes; Megatron TP4 (4 kv heads) x DP16 with EP64 (2 experts/GPU, ~11 GB bf16 "
        "weights per GPU); 8 one-node engines TP8/EP8 (16 experts/GPU, ~59 GB): "
        "kv heads replicated x2, experts scattered over all nodes -> trainer-side",
    ),
    Scenario(
        "dsv3-tp8ep256-to-tp256",
        "DeepSeek-V3-671B",
        TrainLayout("megatron", 256, tp=8, ep=256),
        InferLayout(EngineParallel(256, attn_tp_size=8, moe_ep_size=256), engines=1),
        why="32 nodes; Megatron TP8 (in-node) x DP32 for attention/dense/shared/vocab with EP256 "
        "(1 expert/layer/GPU): ~4.8e9 params (~9.7 GB bf16) per GPU. One wide-EP engine: "
        "TP256 with DP attention (attn_tp 8) and EP256 (the DeepEP-style deployment). "
        "Experts and attention align; dense MLP/shared experts/lm_head go TP8->TP256 in-node",
    ),
    Scenario(
        "dsv3-tp8ep256-to-8x32",
        "DeepSeek-V3-671B",
        TrainLayout("megatron", 256, tp=8, ep=256),
        InferLayout(EngineParallel(32, attn_tp_size=8, moe_ep_size=32), engines=8),
        why="same trainer; 8 engines x 32 GPUs (4 nodes, TP32, attn_tp 8, EP32; ~42 GB/GPU), the "
        "hardest case: each engine needs all 256 experts, which live on "
        "all 32 nodes -> trainer-side plan over 256 ranks, experts cross the network",
    ),
    Scenario(
        "dsv3-fsdp256-to-8x32",
        "DeepSeek-V3-671B",
        TrainLayout("fsdp", 256, ep=256, dtype=torch.float32),
        InferLayout(EngineParallel(32, attn_tp_size=8, moe_ep_size=32), engines=8),
        why="the planner's stress case: FSDP2 Shard(0) of every non-expert tensor over 256 ranks means every "
        "replicated target (norms, router, MLA q_a/kv_a) is assembled from 256 slivers on every rank",
    ),
    Scenario(
        "dsv3-tp8ep256-1024-to-32x32",
        "DeepSeek-V3-671B",
        TrainLayout("megatron", 1024, tp=8, ep=256),
        InferLayout(EngineParallel(32, attn_tp_size=8, moe_ep_size=32), engines=32),
        why="128 nodes: the 8 x TP32 case at four times the world (TP8 x DP128, EP256 x 4 expert replicas, "
        "32 engines): a rank's plan should cost what it did at 256 ranks",
    ),
)


# Not in the default run: run with --scenario NAME.
EXTRA_SCENARIOS: Tuple[Scenario, ...] = ()


def get_scenario(name: str) -> Scenario:
    for s in SCENARIOS + EXTRA_SCENARIOS:
        if s.name == name:
            return s
    raise KeyError(f"unknown scenario {name!r}; --list shows them")


# ------------------------------------------------------------------ sources (trainer)


def tensor_roles(targets: ModelTargets) -> Dict[str, Tuple[Tuple[int, ...], Tuple]]:
    """HF tensor -> (shape, role). Role: ("rep",), ("shard", dim) or ("expert", e)."""
    out: Dict[str, Tuple[Tuple[int, ...], Tuple]] = {}
    for rule in targets.rules:
        if isinstance(rule, (ExpertsW13, ExpertsW2)):
            fmts = (
                (rule.gate, rule.up) if isinstance(rule, ExpertsW13) else (rule.down,)
            )
            shape = (
                (rule.intermediate, rule.hidden)
                if isinstance(rule, ExpertsW13)
                else (rule.hidden, rule.intermediate)
            )
            for e in range(rule.num_experts):
                for f in fmts:
                    out[f.format(e=e)] = (shape, ("expert", e))
            continue
        if isinstance(rule, Replicated):
            role = ("rep",)
        elif isinstance(rule, Stacked):
            role = ("rep",) if rule.group == "replicated" else ("shard", 0)
        elif isinstance(rule, Sharded):
            role = ("shard", rule.dim)
        elif isinstance(rule, (QKV, Vocab)):
            role = ("shard", 0)
        else:
            raise TypeError(f"no training role for rule {type(rule).__name__}")
        for name, shape in rule.tensors().items():
            out[name] = (shape, role)
    return out


def describe_sources(
    spec: ModelSpec, targets: ModelTargets, train: TrainLayout
) -> SourceLayout:
    """Every HF tensor's holders under ``train`` (metadata only)."""
    world = train.world
    all_ranks = list(range(world))
    num_experts = next(
        (r.num_experts for r in targets.rules if isinstance(r, ExpertsW13)), 0
    )
    if train.kind == "megatron":
        tp_grid = [
            [dp * train.tp + i for i in range(train.tp)]
            for dp in range(world // train.tp)
        ]
    elif train.kind == "fsdp":
        shard = world // train.hsdp
        fsdp_mesh = [
            [rep * shard + i for i in range(shard)] for rep in range(train.hsdp)
        ]
        fsdp_placements = (Replicate(), Shard(0))
    else:
        raise ValueError(f"unknown training layout kind {train.kind!r}")
    sources: SourceLayout = {}
    for name, (shape, role) in tensor_roles(targets).items():
        dtype = spec.tensor_dtype(name, train.dtype)
        if role[0] == "expert" and train.ep:
            ep_rank = role[1] // (num_experts // train.ep)
            holders = [rep * train.ep + ep_rank for rep in range(world // train.ep)]
            sources[name] = MeshSpec.full(shape, dtype, holders).describe(name)
        elif train.kind == "fsdp":
            sources[name] = describe_mesh(
                name, shape, dtype, fsdp_mesh, fsdp_placements
            )
        elif role[0] == "rep":
            sources[name] = MeshSpec.full(shape, dtype, all_ranks).describe(name)
        elif role[0] == "shard":
            sources[name] = MeshSpec.sharded(shape, dtype, role[1], tp_grid).describe(
                name
            )
        else:  # experts without EP under Megatron: expert TP = TP
            dim = 0 if name.endswith(("gate_proj.weight", "up_proj.weight")) else 1
            sources[name] = MeshSpec.sharded(shape, dtype, dim, tp_grid).describe(name)
    return sources


def _restrict(sources: SourceLayout, lo: int, hi: int) -> SourceLayout:
    return {
        n: SourceTensor(
            s.name, s.shape, s.dtype, tuple(h for h in s.holders if lo <= h.rank < hi)
        )
        for n, s in sources.items()
    }


def engine_covers(sources: SourceLayout, lo: int, hi: int) -> bool:
    """Whether ranks [lo, hi) hold every tensor in full (distinct boxes are disjoint in
    the layouts built here, so summing them measures the union)."""
    for s in sources.values():
        boxes = {h.box for h in s.holders if lo <= h.rank < hi}
        if sum(b.numel for b in boxes) < prod(s.shape):
            return False
    return True


# ------------------------------------------------------------------------ metrics


def _time(
    local: float, nvl_in: float, nvl_out: float, net_in: float, net_out: float
) -> float:
    return max(
        local / HBM_COPY_BYTES_PER_S,
        nvl_in / NVLINK_BYTES_PER_S,
        nvl_out / NVLINK_BYTES_PER_S,
        net_in / NETWORK_BYTES_PER_S,
        net_out / NETWORK_BYTES_PER_S,
    )


def is_contiguous_region(shape: Sequence[int], box: Box) -> bool:
    """Whether ``box`` is one contiguous run of memory in a row-major tensor of ``shape``:
    past some dim k the box spans whole dims and, before k, it is one index thick."""
    k = len(shape)
    while k > 0 and box.sizes[k - 1] == shape[k - 1]:
        k -= 1
    return all(s == 1 for s in box.sizes[: max(k - 1, 0)])


def lands_contiguous(dest: Dest, region: Box) -> bool:
    """Whether the executor receives ``region`` straight into the parameter (no staging)."""
    return dest.perm is None and is_contiguous_region(dest.shape, dest.box(region))


def needs_send_staging(move: Move) -> bool:
    """Whether the executor stages ``move`` to send it: a cast, or a region that is not
    contiguous in the holder's buffer."""
    return move.src_dtype != move.dtype or not is_contiguous_region(
        move.holder.buffer_shape, move.src_box()
    )


def distributed_metrics(plans: Sequence[Plan], topology: Topology) -> Dict:
    recv: Dict[int, List[int]] = defaultdict(lambda: [0, 0, 0, 0])
    send: Dict[int, List[int]] = defaultdict(lambda: [0, 0, 0, 0])
    local: Dict[int, int] = defaultdict(int)
    peak = staging_peak = moves = rounds = 0
    for p in plans:
        for m in p.local:
            local[m.src] += m.nbytes
        rounds += len(p.rounds)
        for rnd in p.rounds:
            load: Dict[int, int] = defaultdict(int)
            stage: Dict[int, int] = defaultdict(int)
            for m in rnd:
                moves += 1
                nb = m.nbytes
                classes = set()
                for d in m.dests:
                    c = topology.distance(m.src, d.rank)
                    recv[d.rank][c] += nb
                    classes.add(c)
                    load[d.rank] += nb
                    if not lands_contiguous(d, m.region):
                        stage[d.rank] += nb
                for c in classes:
                    send[m.src][c] += nb
                load[m.src] += nb
                if needs_send_staging(m):
                    stage[m.src] += nb
            peak = max(peak, max(load.values(), default=0))
            staging_peak = max(staging_peak, max(stage.values(), default=0))
    ranks = sorted({r for p in plans for r in p.needed_bytes})
    lower = max(
        (p.lower_bound_bytes(r) for p in plans for r in p.needed_bytes), default=0
    )
    times = []
    for r in ranks:
        rv, sd = recv[r], send[r]
        times.append(
            _time(
                local[r] + rv[SAME_DEVICE],
                rv[SAME_NODE],
                sd[SAME_NODE],
                rv[OTHER_NODE],
                sd[OTHER_NODE],
            )
        )
    return {
        "bytes_received_max": max((sum(recv[r]) for r in ranks), default=0),
        "bytes_sent_max": max((sum(send[r]) for r in ranks), default=0),
        "network_bytes_received_max": max(
            (recv[r][OTHER_NODE] for r in ranks), default=0
        ),
        "lower_bound_bytes_max": lower,
        "peak_bytes_max": peak,
        "staging_bytes_max": staging_peak,
        "rounds": rounds,
        "moves": moves,
        "modelled_seconds": max(times, default=0.0),
    }


def _full_batches_peak(sources: SourceLayout, bucket_bytes: int) -> int:
    """Largest batch of gathered full tensors: greedy per-tensor batching at the bucket size."""
    peak = cur = 0
    for s in sources.values():
        nb = prod(s.shape) * s.dtype.itemsize
        if cur and cur + nb > bucket_bytes:
            cur = 0
        cur += nb
        peak = max(peak, cur)
    return peak


def baseline_metrics(
    sources: SourceLayout,
    needed: Mapping[int, int],
    node_of: Mapping[int, int],
    bucket_bytes: int,
) -> Dict[str, Dict]:
    """``full_tensor`` and ``rank0_funnel`` over all trainer ranks. ``needed[g]`` is what
    the engine rank on GPU ``g`` needs, in its dtype."""
    full = 0
    held: Dict[int, int] = defaultdict(int)
    in_node: Dict[int, int] = defaultdict(
        int
    )  # node -> bytes of distinct boxes held on that node
    for s in sources.values():
        isz = s.dtype.itemsize
        full += prod(s.shape) * isz
        nodes_of_box: Dict = defaultdict(set)
        for h in s.holders:
            held[h.rank] += h.box.numel * isz
            nodes_of_box[h.box].add(node_of[h.rank])
        for b, nodes in nodes_of_box.items():
            for n in nodes:
                in_node[n] += b.numel * isz
    peak = _full_batches_peak(sources, bucket_bytes)
    gpus = sorted(needed)

    per_node: Dict[int, int] = defaultdict(int)
    for g in gpus:
        per_node[node_of[g]] += 1
    ft_recv, ft_net, ft_times, flat_times = [], [], [], []
    for g in gpus:
        recv = full - held[g]
        # Hierarchical all-gather: what the node lacks crosses into it once, spread over its NICs.
        net = (full - in_node[node_of[g]]) / per_node[node_of[g]]
        nvl = recv - net
        ft_recv.append(recv)
        ft_net.append(net)
        ft_times.append(_time(needed[g], nvl, nvl, net, net))
        # Flat: each GPU pulls every byte its node lacks over its own NIC.
        flat_net = full - in_node[node_of[g]]
        flat_times.append(
            _time(needed[g], recv - flat_net, recv - flat_net, flat_net, flat_net)
        )
    full_tensor = {
        "bytes_received_max": max(ft_recv),
        "bytes_sent_max": max(ft_recv),
        "network_bytes_received_max": int(max(ft_net)),
        "peak_bytes_max": peak,
        "modelled_seconds": max(ft_times),
        "modelled_seconds_flat": max(flat_times),
    }

    r0 = gpus[0]
    nvl_in = in_node[node_of[r0]] - held[r0]
    net_in = full - in_node[node_of[r0]]
    nvl_out = sum(needed[g] for g in gpus if g != r0 and node_of[g] == node_of[r0])
    net_out = sum(needed[g] for g in gpus if node_of[g] != node_of[r0])
    funnel = {
        "bytes_received_max": max(
            [nvl_in + net_in] + [needed[g] for g in gpus if g != r0]
        ),
        "bytes_sent_max": nvl_out + net_out,
        "network_bytes_received_max": max(
            [net_in] + [needed[g] for g in gpus if node_of[g] != node_of[r0]]
        ),
        "peak_bytes_max": peak,
        "modelled_seconds": _time(needed[r0], nvl_in, nvl_out, net_in, net_out),
    }
    return {
        "full_tensor": full_tensor,
        "rank0_funnel": funnel,
        "full_model_bytes": full,
    }


# ------------------------------------------------------------------------ running


def _needed_bytes(targets: Sequence[ParamTarget]) -> int:
    return sum(p.box.numel * t.dtype.itemsize for t in targets for p in t.pieces)


def rank_metrics(plans: Mapping[int, Sequence[Plan]], topology: Topology) -> Dict:
    """``distributed_metrics`` for rank-local plans (trainer-side): ``plans[r]`` are rank
    r's plans (one per chunk), which hold every move r sends or receives; the maxima are
    over the ranks in ``plans``."""
    out = defaultdict(int)
    for r, rank_plans in plans.items():
        recv, send, local = [0, 0, 0, 0], [0, 0, 0, 0], 0
        lower = rounds = moves = 0
        for p in rank_plans:
            local += sum(m.nbytes for m in p.local)
            lower += p.lower_bound_bytes(r)
            rounds += len(p.rounds)
            for rnd in p.rounds:
                load = stage = 0
                staged = set()
                for m in rnd:
                    moves += 1
                    c = topology.distance(m.src, m.dests[0].rank)
                    if m.src == r:
                        send[c] += m.nbytes
                        load += m.nbytes
                        if (
                            needs_send_staging(m)
                            and (m.tensor, m.holder.buffer, m.region) not in staged
                        ):
                            staged.add(
                                (m.tensor, m.holder.buffer, m.region)
                            )  # the executor casts it once per round
                            stage += m.nbytes
                    for d in m.dests:
                        if d.rank == r:
                            recv[c] += m.nbytes
                            load += m.nbytes
                            stage += 0 if lands_contiguous(d, m.region) else m.nbytes
                out["peak_bytes_max"] = max(out["peak_bytes_max"], load)
                out["staging_bytes_max"] = max(out["staging_bytes_max"], stage)
        t = _time(
            local + recv[SAME_DEVICE],
            recv[SAME_NODE],
            send[SAME_NODE],
            recv[OTHER_NODE],
            send[OTHER_NODE],
        )
        for key, value in (
            ("bytes_received_max", sum(recv)),
            ("bytes_sent_max", sum(send)),
            ("network_bytes_received_max", recv[OTHER_NODE]),
            ("lower_bound_bytes_max", lower),
            ("rounds", rounds),
            ("moves", moves),
            ("modelled_seconds", t),
        ):
            out[key] = max(out[key], value)
    return dict(out)


def sample_ranks(world: int, limit: int = 32) -> List[int]:
    """Every rank of a small world; else the first, middle and last rank."""
    return list(range(world)) if world <= limit else [0, world // 2, world - 1]


def run_scenario(
    scenario: Scenario,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ranks: Optional[Sequence[int]] = None,
    global_baseline: bool = False,
) -> List[Dict]:
    """Simulate one scenario; one result dict per design. Trainer-side scenarios plan
    with the runtime's entry point, rank by rank, for ``ranks`` (default ``sample_ranks``);
    ``global_baseline`` also times the plan every rank used to compute (``global_plan_seconds``):
    trainer side the whole world's ``planner.plan``, chunk by chunk as the runtime did; engine
    side the engine's plan listing every rank's local copies, its cache key hashing every
    rank's targets."""
    t0 = time.perf_counter()
    spec = get_model(scenario.model)
    size, engines = scenario.infer.size, scenario.infer.engines
    world = scenario.gpus
    if size * engines != world:
        raise ValueError(
            f"{scenario.name}: {engines} engines x {size} ranks != {world} trainer ranks"
        )
    model_targets = spec.targets(scenario.infer.parallel)
    per_engine_rank = [spec.for_rank(model_targets, i) for i in range(size)]
    sources = describe_sources(spec, model_targets, scenario.train)
    node_of = {g: g // scenario.gpus_per_node for g in range(world)}
    topology = Topology(device_of={g: g for g in range(world)}, node_of=node_of)
    mode = scenario.mode
    if mode == "auto":
        mode = (
            "engine"
            if all(
                engine_covers(sources, e * size, (e + 1) * size) for e in range(engines)
            )
            else "trainer"
        )
    # The engine publishes this (trainer side) or keys its plan cache with its fingerprint (engine side).
    manifest = EngineManifest.of_ranks(
        scenario.infer.parallel,
        per_engine_rank,
        model_targets.aliases,
        model_targets.tensor_shapes(),
    )
    describe_seconds = time.perf_counter() - t0

    # Planned as the runtime plans: without a topology (the runtime is not told which
    # ranks share a node); the topology only sorts the moved bytes into link classes.
    timed: Dict[int, Tuple[float, float]] = {}
    extra: Dict[str, float] = {}
    if mode == "engine":
        plans, whole = [], []
        for e in range(engines):
            lo = e * size
            srcs = sources if engines == 1 else _restrict(sources, lo, lo + size)
            needs = {lo + i: per_engine_rank[i] for i in range(size)}
            forget_indexes(
                srcs
            )  # each engine from a cold start, as its first update pays
            wall, cpu = time.perf_counter(), time.process_time()
            PlanCache().get(
                srcs,
                needs,
                bucket_bytes=bucket_bytes,
                aliases=model_targets.aliases,
                targets_digest=manifest.fingerprint,
                local_ranks=(lo,),
            )
            timed[lo] = (time.perf_counter() - wall, time.process_time() - cpu)
            # The same plan with every rank's local copies listed, for the figures; timed
            # with global_baseline as every engine rank planned before (its cache key hashed
            # every rank's targets on each update).
            forget_indexes(srcs)
            wall, cpu = time.perf_counter(), time.process_time()
            plans.append(
                PlanCache().get(
                    srcs,
                    needs,
                    bucket_bytes=bucket_bytes,
                    aliases=model_targets.aliases,
                )
            )
            whole.append((time.perf_counter() - wall, time.process_time() - cpu))
        if global_baseline:
            extra["global_plan_seconds"], extra["global_plan_cpu_seconds"] = max(whole)
        dist = distributed_metrics(plans, topology)
        measured: object = "all"
        timed_how = (
            "each engine rank plans its whole engine, listing its own local copies (its plan cache's "
            "first update, as engine rank 0 runs it); the slowest engine"
        )
    elif mode == "trainer":
        groups = [tuple(range(e * size, (e + 1) * size)) for e in range(engines)]
        parts = chunks(manifest, list(sources), bucket_bytes)
        measured = list(ranks) if ranks is not None else sample_ranks(world)
        by_rank = {}
        for r in measured:
            forget_indexes(
                sources
            )  # each rank from a cold start (new plans too), as the first update pays
            plans = TrainerPlans()
            wall, cpu = time.perf_counter(), time.process_time()
            by_rank[r] = [
                plan_to_engines(
                    plans, sources, manifest, groups, bucket_bytes, part, r
                )[0]
                for part in parts
            ]
            timed[r] = (time.perf_counter() - wall, time.process_time() - cpu)
        forget_indexes(sources)
        if global_baseline:
            wall, cpu = time.perf_counter(), time.process_time()
            every = [list(targets) for targets in manifest.ranks]
            digest = TrainerPlans().inputs_digest(
                sources, manifest, groups, bucket_bytes
            )
            for part in parts:
                wanted = set(part)
                # fingerprinted as the rank-local path fingerprints a chunk (the inputs' digest)
                plan(
                    sources,
                    {
                        g: [t for t in every[g % size] if t.name in wanted]
                        for g in range(world)
                    },
                    bucket_bytes=bucket_bytes,
                    aliases=model_targets.aliases,
                    fingerprint=chunk_digest(digest, part),
                )
            extra["global_plan_seconds"] = time.perf_counter() - wall
            extra["global_plan_cpu_seconds"] = time.process_time() - cpu
        dist = rank_metrics(by_rank, topology)
        if measured == list(range(world)):
            measured = "all"
        timed_how = "trainer_reshard.plan_to_engines, every chunk, each timed rank from a cold start"
    else:
        raise ValueError(f"unknown mode {mode!r}")

    needed_rank = [_needed_bytes(t) for t in per_engine_rank]
    needed = {g: needed_rank[g % size] for g in range(world)}
    base = baseline_metrics(sources, needed, node_of, bucket_bytes)
    common = {
        "scenario": scenario.name,
        "model": scenario.model,
        "ranks": size if mode == "engine" else world,
        "gpus": world,
        "engines": engines,
        "mode": mode,
        "train": scenario.train.label(),
        "infer": scenario.infer.label(),
        "bucket_bytes": bucket_bytes,
        "full_model_bytes": base["full_model_bytes"],
        "needed_bytes_max": max(needed_rank),
        "lower_bound_bytes_max": dist["lower_bound_bytes_max"],
        "describe_seconds": describe_seconds,
    }
    slowest = max(timed.values())
    rows = [
        dict(
            common,
            design="distributed",
            plan_seconds=slowest[0],
            plan_seconds_per_rank=slowest[0],
            plan_cpu_seconds=max(c for _, c in timed.values()),
            plan_seconds_by_rank={str(r): w for r, (w, _) in timed.items()},
            plan_timing=timed_how,
            metrics_ranks=measured,
            **extra,
            **dist,
        )
    ]
    for design in ("full_tensor", "rank0_funnel"):
        rows.append(
            dict(
                common,
                design=design,
                plan_seconds=None,
                plan_seconds_per_rank=None,
                plan_cpu_seconds=None,
                staging_bytes_max=None,
                rounds=None,
                moves=None,
                **base[design],
            )
        )
    keys = list(dict.fromkeys(k for r in rows for k in r))  # one schema for every row
    return [{k: r.get(k) for k in keys} for r in rows]


# ------------------------------------------------------------------------- output

_GB = 1e9


def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    return f"{n / _GB:,.3f}"


def _fmt_s(s: Optional[float]) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"


def format_table(rows: Sequence[Dict], scenarios: Sequence[Scenario]) -> str:
    out = [
        "Weight-sync simulator (metadata only). Sizes in GB (1e9 B); peak in MiB.",
        f"Time model: bandwidth only, per rank max(local/{HBM_COPY_BYTES_PER_S / 1e12:g} TB/s HBM, "
        f"same-node in|out/{NVLINK_BYTES_PER_S / 1e9:g} GB/s NVLink, cross-node in|out/"
        f"{NETWORK_BYTES_PER_S / 1e9:g} GB/s NIC), max over ranks; {GPUS_PER_NODE} GPUs/node.",
        "recv = bytes received per rank (max); LB = needed - held (max); net = bytes through a GPU's NIC (max;",
        "full_tensor: hierarchical all-gather, node's missing bytes / GPUs per node; --json adds the flat variant);",
        "peak = distributed: bytes a rank moves in one round (max; staging in brackets); baselines: largest batch of full tensors.",
        "",
    ]
    by_name = {s.name: s for s in scenarios}
    header = f"{'design':<13} {'recv GB':>10} {'LB GB':>10} {'net GB':>10} {'peak MiB':>16} {'plan/rank':>10} {'modelled':>10}"
    for name in dict.fromkeys(r["scenario"] for r in rows):
        group = [r for r in rows if r["scenario"] == name]
        first = group[0]
        sc = by_name.get(name)
        out.append(
            f"== {name}: {first['model']}, {first['gpus']} GPUs, plan {first['mode']}-side over {first['ranks']} ranks"
        )
        out.append(f"   train: {first['train']}; infer: {first['infer']}")
        if sc and sc.why:
            out.append(f"   why: {sc.why}")
        out.append(
            f"   full model {first['full_model_bytes'] / _GB:,.1f} GB (trainer dtype); engine rank needs <= "
            f"{first['needed_bytes_max'] / _GB:,.3f} GB; describe {first['describe_seconds']:.2f} s"
        )
        out.append("   " + header)
        for r in group:
            peak = f"{r['peak_bytes_max'] / 2**20:,.0f}"
            if r.get("staging_bytes_max") is not None:
                peak += f" [{r['staging_bytes_max'] / 2**20:,.0f}]"
            out.append(
                "   "
                + f"{r['design']:<13} {_fmt_bytes(r['bytes_received_max']):>10} {_fmt_bytes(r['lower_bound_bytes_max']):>10} "
                f"{_fmt_bytes(r['network_bytes_received_max']):>10} {peak:>16} {_fmt_s(r['plan_seconds']):>10} "
                f"{_fmt_s(r['modelled_seconds']):>10}"
            )
        dist = group[0]
        by_rank = ", ".join(
            f"rank {r} {w:.2f} s" for r, w in dist["plan_seconds_by_rank"].items()
        )
        if dist["mode"] == "trainer":
            out.append(
                f"   distributed (figures of ranks {dist['metrics_ranks']}): up to {dist['moves']} moves in "
                f"{dist['rounds']} rounds per rank; plan per rank ({dist['plan_timing']}): {by_rank}; "
                f"CPU at most {dist['plan_cpu_seconds']:.2f} s"
            )
            if dist.get("global_plan_seconds") is not None:
                out.append(
                    f"   before (whole-world planner.plan on every rank): wall {dist['global_plan_seconds']:.2f} s, "
                    f"CPU {dist['global_plan_cpu_seconds']:.2f} s"
                )
        else:
            out.append(
                f"   distributed: {dist['moves']} moves in {dist['rounds']} rounds; plan per rank "
                f"({dist['plan_timing']}): wall {dist['plan_seconds']:.2f} s, CPU {dist['plan_cpu_seconds']:.2f} s"
            )
            if dist.get("global_plan_seconds") is not None:
                out.append(
                    f"   before (every rank's local copies listed, every rank's targets hashed for the cache "
                    f"key): wall {dist['global_plan_seconds']:.2f} s, CPU {dist['global_plan_cpu_seconds']:.2f} s"
                )
        out.append("")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario", action="append", help="run only this scenario (repeatable)"
    )
    parser.add_argument(
        "--list", action="store_true", help="list the scenarios and exit"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON list instead of a table"
    )
    parser.add_argument(
        "--global-baseline",
        action="append",
        default=[],
        metavar="SCENARIO",
        help="also time the plan every rank used to compute, for this scenario (repeatable): "
        "trainer side the whole world's (it took 538 s for dsv3-fsdp256-to-8x32), engine side "
        "the whole engine's with every rank's local copies and targets hashed for its cache key",
    )
    parser.add_argument(
        "--bucket-mib",
        type=int,
        default=DEFAULT_BUCKET_BYTES >> 20,
        help="bucket cap per rank per round",
    )
    args = parser.parse_args(argv)
    if args.list:
        for s in SCENARIOS + EXTRA_SCENARIOS:
            extra = "  (not in the default run)" if s in EXTRA_SCENARIOS else ""
            print(
                f"{s.name:<32} {s.model:<18} {s.gpus:>4} GPUs  train {s.train.label()}; infer {s.infer.label()}{extra}"
            )
        return 0
    scenarios = (
        [get_scenario(n) for n in args.scenario] if args.scenario else list(SCENARIOS)
    )
    rows: List[Dict] = []
    for s in scenarios:
        rows.extend(
            run_scenario(
                s,
                bucket_bytes=args.bucket_mib << 20,
                global_baseline=s.name in args.global_baseline,
            )
        )
        if not args.json:
            print(f"... {s.name} done", file=sys.stderr)
    if args.json:
        print(json.dumps(rows))
    else:
        print(format_table(rows, scenarios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
