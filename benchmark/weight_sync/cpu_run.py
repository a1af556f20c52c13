"""Real run on CPU: our executor against upstream's full_tensor() path, in one run.

``python -m benchmark.weight_sync.cpu_run [--json]`` starts N gloo ranks. Each
rank holds DTensor shards of a Qwen2-shaped model (the trainer) and the
SGLang-layout parameters of its engine TP rank (the engine), then updates the
parameters with both designs, alternating, several times:

* ``distributed``: the shipped trainer-side path (``trainer_reshard``): the
  engines' manifest, chunks under the cap, one plan per chunk over the trainer
  ranks straight to the engine ranks' layouts (first call timed separately, it
  plans), the executor filling parameter-shaped buffers in the engine's dtype,
  and the engine's local copy into its parameters. Each rank receives only the
  bytes it lacks. Each rank plans only its own moves (``rank_plan``), also when one
  engine spans every rank, as in TP 2 -> TP 4.
* ``full_tensor``: what ``weight_sync.utils.update_weights`` does upstream:
  ``DTensor.full_tensor()`` on every rank for every tensor (an all-gather),
  then the engine slices its own part out of the full tensor (SGLang's
  ``load_weights`` narrowing), one tensor at a time.

Both results are checked bit-exactly against each other. Reported per design:
median update seconds (max over ranks), bytes received per rank (max), the
largest transient buffer per rank, and the ratios full_tensor / distributed.
This machine is shared and noisy: only the ratios measured in the same run mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BUCKET_BYTES = 64 << 20

SCENARIOS = {
    # name: (model config, trainer layout, train TP, infer TP, ranks)
    "qwen2-fsdp4-to-tp2": (
        dict(
            hidden_size=1024,
            num_attention_heads=16,
            num_key_value_heads=4,
            num_hidden_layers=4,
            intermediate_size=2816,
            vocab_size=32000,
        ),
        "fsdp",
        4,
        2,
        4,
    ),
    "qwen2-tp2-to-tp4": (
        dict(
            hidden_size=1024,
            num_attention_heads=16,
            num_key_value_heads=4,
            num_hidden_layers=4,
            intermediate_size=2816,
            vocab_size=32000,
        ),
        "tp",
        2,
        4,
        4,
    ),
}


def _dtensors(cfg, layout, train_tp, world, targets):
    """Trainer shards as DTensors (FSDP Shard(0) over all ranks, or TP Shard(d) with DP replicas)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if layout == "fsdp":
        mesh, place = init_device_mesh("cpu", (world,)), lambda name: (Shard(0),)
    else:
        mesh = init_device_mesh(
            "cpu", (world // train_tp, train_tp), mesh_dim_names=("dp", "tp")
        )
        row = lambda name: "o_proj" in name or "down_proj" in name  # noqa: E731
        place = lambda name: (Replicate(), Shard(1 if row(name) else 0))  # noqa: E731
    out = {}
    for i, (name, shape) in enumerate(sorted(targets.tensor_shapes().items())):
        g = torch.Generator().manual_seed(i)
        full = torch.randn(shape, generator=g)
        p = (
            place(name)
            if len(shape) > 1 or layout == "fsdp"
            else (Replicate(), Replicate())
        )
        out[name] = distribute_tensor(full, mesh, p, src_data_rank=None)
    return out


def _rank(rank, world, store, scenario, repeats, out_dir):
    from benchmark.weight_sync.hand_rules import model_targets_from_config
    from sglang.srt.weight_sync.apply import copy_buffers
    from sglang.srt.weight_sync.manifest import EngineManifest
    from sglang.srt.weight_sync.target_layout import EngineParallel
    from sglang.srt.weight_sync.trainer_flow import prepare_shards
    from sglang.srt.weight_sync.trainer_reshard import TrainerPlans, chunks

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    cfg, layout, train_tp, infer_tp, _ = SCENARIOS[scenario]
    model = model_targets_from_config(
        dict(cfg, model_type="qwen2"), EngineParallel(infer_tp), torch.bfloat16
    )
    manifest = EngineManifest.of(model)
    groups = [list(range(e, e + infer_tp)) for e in range(0, world, infer_tp)]
    dtensors = _dtensors(cfg, layout, train_tp, world, model)
    mine = model.for_rank(rank % infer_tp)
    params = {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in mine}
    baseline = {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in mine}
    shards = prepare_shards(sorted(dtensors.items()))
    parts = chunks(manifest, [n for n, _, _ in shards], BUCKET_BYTES)
    sources, local = (
        {n: spec.describe(n) for n, _, spec in shards},
        {n: t for n, t, _ in shards},
    )

    t0 = time.perf_counter()
    trainer_plans = TrainerPlans()
    plans = [
        trainer_plans.plan_to_engines(
            sources, manifest, groups, BUCKET_BYTES, part, rank
        )[0]
        for part in parts
    ]
    plan_s = time.perf_counter() - t0

    def distributed():
        received = peak = 0
        for part in parts:
            result = trainer_plans.reshard_to_engines(
                sources, local, manifest, groups, rank, BUCKET_BYTES, part
            )
            copy_buffers(
                params, [t for t in mine if t.name in result.buffers], result.buffers
            )
            received += result.stats.bytes_received
            peak = max(
                peak,
                result.stats.peak_staging_bytes
                + sum(b.nbytes for b in result.buffers.values()),
            )
        return received, peak

    uses = {}
    for t in mine:
        for piece in t.pieces:
            uses.setdefault(piece.tensor, []).append((t.name, piece))

    def full_tensor():
        received = peak = 0
        for name in sorted(
            dtensors
        ):  # a collective: every rank gathers every tensor, same order
            d = dtensors[name]
            full = (
                d.full_tensor()
            )  # upstream: every rank materialises every full parameter
            received += (full.numel() - d.to_local().numel()) * full.element_size()
            peak = max(peak, full.numel() * full.element_size())
            for param, piece in uses.get(
                name, ()
            ):  # the engine narrows out its own part
                baseline[param][piece.index][piece.dest_box().slices()].copy_(
                    full[piece.box.slices()]
                )
            del full
        return received, peak

    times = {"distributed": [], "full_tensor": []}
    info = {}
    for _ in range(repeats):
        for name, fn in (("distributed", distributed), ("full_tensor", full_tensor)):
            dist.barrier()
            t0 = time.perf_counter()
            info[name] = fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    for t in mine:
        assert torch.equal(params[t.name], baseline[t.name]), (
            f"rank {rank}: {t.name} differs between designs"
        )
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(
            dict(
                times=times,
                info=info,
                plan_s=plan_s,
                lower_bound=sum(p.lower_bound_bytes(rank) for p in plans),
            ),
            f,
        )
    dist.destroy_process_group()


def run(scenario: str, repeats: int = 3) -> list:
    world = SCENARIOS[scenario][4]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _rank,
            args=(world, os.path.join(tmp, "store"), scenario, repeats, tmp),
            nprocs=world,
        )
        ranks = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(world)]
    rows = []
    for design in ("distributed", "full_tensor"):
        per_repeat = [max(r["times"][design][i] for r in ranks) for i in range(repeats)]
        rows.append(
            dict(
                scenario=scenario,
                design=design,
                ranks=world,
                seconds_median=statistics.median(per_repeat),
                bytes_received_max=max(r["info"][design][0] for r in ranks),
                lower_bound_bytes_max=max(r["lower_bound"] for r in ranks),
                transient_bytes_max=max(r["info"][design][1] for r in ranks),
                plan_seconds=max(r["plan_s"] for r in ranks)
                if design == "distributed"
                else None,
            )
        )
    dist_row, full_row = rows
    for key in ("seconds_median", "bytes_received_max", "transient_bytes_max"):
        full_row[f"{key}_ratio_vs_distributed"] = (
            full_row[key] / dist_row[key] if dist_row[key] else None
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [
        row
        for s in (args.scenario or sorted(SCENARIOS))
        for row in run(s, args.repeats)
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"{'scenario':22} {'design':12} {'ranks':>5} {'seconds':>9} {'MiB recv/rank':>14} "
        f"{'lower bound':>12} {'transient MiB':>14} {'plan s':>7}"
    )
    for r in rows:
        print(
            f"{r['scenario']:22} {r['design']:12} {r['ranks']:>5} {r['seconds_median']:>9.3f} "
            f"{r['bytes_received_max'] / 2**20:>14.1f} {r['lower_bound_bytes_max'] / 2**20:>12.1f} "
            f"{r['transient_bytes_max'] / 2**20:>14.1f} "
            f"{'' if r['plan_seconds'] is None else format(r['plan_seconds'], '.3f'):>7}"
        )
        if r["design"] == "full_tensor":
            ratio = lambda key: (
                format(r[f"{key}_ratio_vs_distributed"] or float("inf"), ".2f") + "x"
            )  # noqa: E731
            print(
                f"{'':22} {'full/dist':12} {'':>5} {ratio('seconds_median'):>9} "
                f"{ratio('bytes_received_max'):>14} {'':>12} {ratio('transient_bytes_max'):>14}"
            )


if __name__ == "__main__":
    main()
