"""Disaggregated scenarios for the simulator: engines on other nodes than the trainer.

The trainer's ``N`` GPUs (nodes ``0 .. N/8-1``) and ``E`` engines of TP ``T`` on nodes of
their own form one weight-sync group (``docs/remote.md``): trainer ranks ``0..N-1``,
engine ``e``'s TP rank ``t`` at group rank ``N + e*T + t``. Every move crosses the network
(no engine shares a node with a trainer rank).

Designs compared:

* ``weight-sync group`` (ours): every rank plans only its own moves
  (``rank_plan.plan_for_rank``, as ``remote.group.SyncGroup.plan`` calls it: one receiver
  class per engine TP rank, whose ranks are that TP rank of every engine). Received per
  engine rank = its parameters' bytes (the lower bound: it holds nothing); sent per
  trainer rank from the plans of every engine rank (every move they receive names its
  sender). Modelled seconds: ``max(max sent, max received) / NET`` (every byte crosses
  one NIC out and one NIC in; NICs work in parallel).
* ``rank-0 broadcast`` (upstream's ``init_weights_update_group`` +
  ``update_weights_from_distributed``): the trainer's rank 0 gathers every tensor and
  broadcasts it whole to every engine rank. Modelled seconds: the broadcast alone,
  ``model bytes / NET`` (the root's NIC sends the model at least once, every engine rank's
  NIC receives all of it), which flatters it: the gather before it (rank 0 receives what
  other nodes hold) is ``gather_seconds`` beside it.

Both are bandwidth-only models (``NETWORK_BYTES_PER_S``, 50 GB/s per GPU NIC; NVLink
450 GB/s inside a node, used only by the gather), no latency, no software overhead: they
are labelled *modelled*, next to the published measurements (``ANCHORS``) of systems doing
the same job.

Run from the repository root::

    python -m benchmark.weight_sync.disaggregated           # the table
    python -m benchmark.weight_sync.disaggregated --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from benchmark.weight_sync.models import get_model
from benchmark.weight_sync.simulate import (
    GPUS_PER_NODE,
    NETWORK_BYTES_PER_S,
    NVLINK_BYTES_PER_S,
    InferLayout,
    TrainLayout,
    describe_sources,
    sample_ranks,
)
from sglang.srt.weight_sync.planner import DEFAULT_BUCKET_BYTES, forget_indexes
from sglang.srt.weight_sync.rank_plan import Receivers, plan_for_rank
from sglang.srt.weight_sync.target_layout import EngineParallel
from sglang.srt.weight_sync.trainer_reshard import restrict


@dataclass(frozen=True)
class Disaggregated:
    name: str
    model: str
    train: TrainLayout
    infer: InferLayout
    anchors: str
    why: str = ""


# Published measurements of the same job (other systems, other hardware): for scale only.
ANCHORS = {
    "qwen3-235b": "vLLM sharded P2P: Qwen3-235B 3.2 s (2 x 8 H100); prime-rl: 44 GB/s per GPU",
    "dsv3": "NeMo-RL resharding: DeepSeek-V3 7.7-9.9 s",
    "1t": "Perplexity: Kimi-K2 1.3 s (256 BF16 training GPUs -> 128 FP8 inference GPUs, RDMA, "
    "static schedule); checkpoint-engine: Kimi-K2 16 s (256 x H20)",
}

SCENARIOS: Tuple[Disaggregated, ...] = (
    Disaggregated(
        "qwen3-235b-64-to-8x8-remote",
        "Qwen3-235B-A22B",
        TrainLayout("megatron", 64, tp=4, ep=64),
        InferLayout(EngineParallel(8, moe_ep_size=8), engines=8),
        ANCHORS["qwen3-235b"],
        "8 trainer nodes (Megatron TP4 x DP16, EP64) -> 8 engines of TP8/EP8 on 8 other nodes",
    ),
    Disaggregated(
        "dsv3-256-to-8x32-remote",
        "DeepSeek-V3-671B",
        TrainLayout("megatron", 256, tp=8, ep=256),
        InferLayout(EngineParallel(32, attn_tp_size=8, moe_ep_size=32), engines=8),
        ANCHORS["dsv3"],
        "32 trainer nodes (TP8 x DP32, EP256) -> 8 engines of TP32 (attn_tp 8, EP32) on 32 other nodes",
    ),
    Disaggregated(
        "moe1t-256-to-16x16-remote",
        "Kimi-K2-1T",
        TrainLayout("megatron", 256, tp=8, ep=128),
        InferLayout(EngineParallel(16, moe_ep_size=16), engines=16),
        ANCHORS["1t"],
        "a 1.03e12-parameter MoE (Kimi-K2's shape: 384 experts): 32 trainer nodes (TP8 x DP32, "
        "EP128 x 2 replicas) -> 16 engines of TP16/EP16 on 32 other nodes",
    ),
)


def run(
    scenario: Disaggregated,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    engines_planned: Optional[int] = None,
) -> Dict:
    """One scenario (see the module's text). ``engines_planned``: plan the receivers of
    that many engines (default all) for the senders' bytes; the others' are the same
    pieces, sent by replicas chosen by the same hash (the figures then scale)."""
    spec = get_model(scenario.model)
    parallel, engines = scenario.infer.parallel, scenario.infer.engines
    tp, trainers = parallel.tp_size, scenario.train.world
    targets = spec.targets(parallel)
    sources = describe_sources(spec, targets, scenario.train)
    names = {targets.aliases.get(n, n) for n in sources}
    per_rank = [
        restrict(spec.for_rank(targets, t), names, targets.aliases) for t in range(tp)
    ]
    receivers = Receivers(
        tuple(tuple(r) for r in per_rank),
        tuple(tuple(trainers + e * tp + t for e in range(engines)) for t in range(tp)),
    )
    needed = [
        sum(p.box.numel * x.dtype.itemsize for x in r for p in x.pieces)
        for r in per_rank
    ]
    sent: Dict[int, int] = defaultdict(int)
    received: Dict[int, int] = {}
    planned = engines if engines_planned is None else engines_planned
    started = time.perf_counter()
    for e in range(planned):
        for t in range(tp):
            rank = trainers + e * tp + t
            plan = plan_for_rank(sources, receivers, rank, bucket_bytes=bucket_bytes)
            received[rank] = sum(m.nbytes for rnd in plan.rounds for m in rnd)
            assert received[rank] == plan.lower_bound_bytes(rank) == needed[t], (
                rank,
                t,
            )
            for rnd in plan.rounds:
                for m in rnd:
                    sent[m.src] += m.nbytes * (engines / planned)
    receivers_s = time.perf_counter() - started
    timed = {}
    for r in sample_ranks(
        trainers, 3
    ):  # a trainer rank's own planning, from a cold start
        forget_indexes(sources)
        wall = time.perf_counter()
        plan = plan_for_rank(sources, receivers, r, bucket_bytes=bucket_bytes)
        timed[r] = time.perf_counter() - wall
        own = sum(m.nbytes for rnd in plan.rounds for m in rnd if m.src == r)
        assert abs(own - sent[r]) <= 1e-6 * max(own, 1) or planned < engines, (
            r,
            own,
            sent[r],
        )
    senders = [sent.get(r, 0) for r in range(trainers)]
    holding = [s for s in senders if s > 0]
    model_bytes = sum(
        (torch.Size(shape).numel() * 2) for shape in targets.tensor_shapes().values()
    )
    ours_s = max(max(senders), max(needed)) / NETWORK_BYTES_PER_S
    own_node = min(GPUS_PER_NODE, trainers)
    gather_net = model_bytes * (
        1 - own_node / trainers
    )  # what rank 0's node does not hold
    gather_s = max(
        gather_net / NETWORK_BYTES_PER_S,
        model_bytes / trainers * own_node / NVLINK_BYTES_PER_S,
    )
    return {
        "scenario": scenario.name,
        "model": scenario.model,
        "train": scenario.train.label(),
        "infer": scenario.infer.label() + " (other nodes)",
        "trainer_gpus": trainers,
        "engine_gpus": tp * engines,
        "model_bytes_bf16": model_bytes,
        "received_per_engine_rank_max": max(needed),
        "lower_bound_per_engine_rank_max": max(needed),
        "sent_per_trainer_rank_max": max(senders),
        "sent_per_trainer_rank_mean": sum(senders) / len(senders),
        "sent_spread": max(senders) / (sum(holding) / len(holding)),
        "trainer_ranks_sending": len(holding),
        "modelled_seconds": ours_s,
        "broadcast_modelled_seconds": model_bytes / NETWORK_BYTES_PER_S,
        "broadcast_received_per_engine_rank": model_bytes,
        "broadcast_sent_by_rank0": model_bytes,
        "gather_modelled_seconds": gather_s,
        "plan_seconds_per_trainer_rank": max(timed.values()),
        "plan_seconds_all_receivers": receivers_s,
        "engines_planned": planned,
        "anchors": scenario.anchors,
    }


def format_table(rows: Sequence[Dict]) -> str:
    gb = 1e9
    out = [
        "| scenario | per engine rank received (= lower bound) | per trainer rank sent, max (spread) | "
        "ours, modelled | rank-0 broadcast, modelled (+ gather) | plan per trainer rank | published |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']}, {r['train']} -> {r['infer']} | {r['received_per_engine_rank_max'] / gb:,.1f} GB "
            f"| {r['sent_per_trainer_rank_max'] / gb:,.1f} GB ({r['sent_spread']:.3f}x the mean, "
            f"{r['trainer_ranks_sending']} ranks) | {r['modelled_seconds']:.2f} s "
            f"| {r['broadcast_modelled_seconds']:.2f} s (+ {r['gather_modelled_seconds']:.2f} s) "
            f"| {r['plan_seconds_per_trainer_rank']:.2f} s | {r['anchors']} |"
        )
    return "\n".join(out)


def scenario_args(
    argv: Optional[List[str]], description: str
) -> Tuple[argparse.Namespace, List[Disaggregated]]:
    """The command line of this module and of those that model its scenarios further:
    ``--json``, ``--scenario`` (repeatable; default: all), ``--engines-planned``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--scenario", action="append")
    parser.add_argument(
        "--engines-planned",
        type=int,
        default=None,
        help="plan the receivers of this many engines (default: all)",
    )
    args = parser.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.scenario or s.name in args.scenario]
    return args, chosen


def main(argv: Optional[List[str]] = None) -> int:
    args, chosen = scenario_args(argv, __doc__.split("\n")[0])
    rows = [run(s, engines_planned=args.engines_planned) for s in chosen]
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
