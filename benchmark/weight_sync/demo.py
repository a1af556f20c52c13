"""Demo: a real SGLang engine (TP 2, CPU) updated by a simulated FSDP trainer, both ways.

``make demo`` (or ``python -m benchmark.weight_sync.demo``) builds a small Qwen2, starts
two trainer ranks (gloo) that hold it as FSDP2-style ``Shard(0)`` DTensors (a different
layout from the engine's TP 2), and rank 0 hosts the engine through ``VerlEngine``. Then,
alternating, each "training step" is pushed with

* ``distributed``: ``VerlEngine.update_weights_from_tensor``: local shards only, resharded
  in the engine;
* ``upstream``: what SGLang 0.5.23 does (``weight_sync.utils.update_weights`` /
  0.4.7's VerlEngine): ``full_tensor()`` on every rank, ``gather_object`` of the
  handles to rank 0, ``Engine.update_weights_from_tensor`` and the model's loader.

After every update the engine's greedy generation must be the same whichever path
loaded the weights; agreement with HF transformers is reported (the end-to-end tests
assert it exactly, on prompts without bf16 near-ties). Printed: seconds per update (median), bytes each trainer rank receives and
the largest transient buffer it holds, for both designs measured in this one run.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[2] / "test" / "support"  # CPU engine set-up, tiny models
sys.path.insert(0, str(SUPPORT))

from engine import configure_cpu_env  # noqa: E402

configure_cpu_env()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODEL = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
             num_hidden_layers=4, vocab_size=8192)
STEPS = 3


def _weights(model_dir, step):
    import tiny_models

    ckpt = tiny_models.load_checkpoint(model_dir)
    return {n: (t.float() + 0.2 * tiny_models.random_like(t, seed=step * 1000 + i).float()).to(t.dtype)
            for i, (n, t) in enumerate(sorted(ckpt.items()))}


def _upstream_update(verl, dtensors, rank):
    """SGLang 0.5.23's gathered path, as weight_sync.utils.update_weights does it."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    from sglang.srt.utils import MultiprocessingSerializer

    received = peak = 0
    handles = []
    fulls = []  # upstream keeps each full tensor alive until the engine has loaded it
    for name, d in dtensors:
        full = d.full_tensor()
        received += (full.numel() - d.to_local().numel()) * full.element_size()
        fulls.append(full)
        peak += full.numel() * full.element_size()
        handles.append((name, MultiprocessingSerializer.serialize(full)))
    gathered = [None, None] if rank == 0 else None
    dist.gather_object(handles, gathered, dst=0)
    if rank == 0:
        named = [(group[0][0], LocalSerializedTensor(values=[h for _, h in group])) for group in zip(*gathered)]
        engine = verl._engine
        engine.begin_weight_update()
        ok, message = engine.update_weights_from_tensor(named, flush_cache=True)
        engine.end_weight_update()
        assert ok, message
    dist.barrier()
    return received, peak


def _rank(rank, world, store, model_dir, out_dir, prompts):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from engine import omp_bind
    from sglang.srt.entrypoints.verl_engine import VerlEngine
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.source_layout import describe_dtensor
    from sglang.srt.weight_sync.target_layout import EngineParallel, model_targets_from_config

    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(world)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    verl = VerlEngine(mesh, model_path=str(model_dir), device="cpu", attention_backend="torch_native",
                      skip_tokenizer_init=True, mem_fraction_static=0.05, max_total_tokens=4096,
                      disable_cuda_graph=True, random_seed=0, log_level="error")
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    rows = {"distributed": [], "upstream": []}
    for step in range(1, STEPS + 1):
        weights = _weights(model_dir, step)
        dtensors = [(n, distribute_tensor(t, mesh, (Shard(0),), src_data_rank=None)) for n, t in sorted(weights.items())]
        for design in ("distributed", "upstream"):
            dist.barrier()
            t0 = time.perf_counter()
            if design == "distributed":
                verl.update_weights_from_tensor(dtensors)
                received = peak = None
            else:
                received, peak = _upstream_update(verl, dtensors, rank)
            seconds = time.perf_counter() - t0
            generation = [o["output_ids"] for o in verl.generate(input_ids=prompts[step], sampling_params=params)]
            rows[design].append(dict(step=step, seconds=seconds, received=received, peak=peak, generation=generation))
    # Bytes for the distributed design, from the plan the engine ran (tests prove executed = planned).
    config = json.loads((Path(model_dir) / "config.json").read_text())
    targets = model_targets_from_config(config, EngineParallel(world), torch.bfloat16)
    sources = {n: describe_dtensor(n, d) for n, d in dtensors}
    the_plan = plan(sources, targets.by_rank())
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(dict(rows=rows, planned=the_plan.received_bytes(rank), lower_bound=the_plan.lower_bound_bytes(rank),
                       staging_cap=the_plan.bucket_bytes), f)
    dist.barrier()
    verl.shutdown()


def main() -> None:
    import torch.multiprocessing as mp

    import tiny_models
    from engine import hf_greedy, stable_prompts

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir, _ = tiny_models.make_tiny_model("qwen2", Path(tmp) / "qwen2", **MODEL)
        n_params = sum(t.numel() for t in tiny_models.load_checkpoint(model_dir).values())
        print(f"model: Qwen2-shaped, {n_params / 1e6:.1f} M params (bf16), engine TP 2 on CPU; "
              f"trainer: 2 ranks, FSDP2 Shard(0) DTensors")
        # prompts with no bf16 near-tie on their greedy path, so exact comparison with HF is meaningful
        prompts = {s: stable_prompts([(model_dir, _weights(model_dir, s))], 2, 8, vocab_size=MODEL["vocab_size"])
                   for s in range(1, STEPS + 1)}
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), model_dir, tmp, prompts), nprocs=2)
        ranks = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(2)]
        # Both designs must leave the engine serving the same model: identical greedy outputs.
        same = all(a["generation"] == b["generation"]
                   for a, b in zip(ranks[0]["rows"]["distributed"], ranks[0]["rows"]["upstream"]))
        agree = total = 0  # and how close SGLang-on-CPU is to HF transformers (bf16 kernels differ)
        for row in ranks[0]["rows"]["distributed"]:
            expected = hf_greedy(model_dir, prompts[row["step"]], 8, weights=_weights(model_dir, row["step"]))
            agree += sum(x == y for got, want in zip(row["generation"], expected) for x, y in zip(got, want))
            total += sum(len(want) for want in expected)
        print(f"{'design':12} {'s/update':>9} {'MiB received/rank':>18} {'transient MiB/rank':>19}")
        summary = {}
        for design in ("distributed", "upstream"):
            seconds = statistics.median(r["seconds"] for r in ranks[0]["rows"][design])
            if design == "distributed":
                received = max(r["planned"] for r in ranks)
                transient = 0  # the trainer keeps its shards; the engine stages at most the bucket cap
            else:
                received = max(r["rows"][design][-1]["received"] for r in ranks)
                transient = max(r["rows"][design][-1]["peak"] for r in ranks)
            summary[design] = (seconds, received, transient)
            print(f"{design:12} {seconds:>9.3f} {received / 2**20:>18.2f} {transient / 2**20:>19.2f}")
        d, u = summary["distributed"], summary["upstream"]
        print(f"upstream / distributed: time {u[0] / d[0]:.2f}x, bytes received {u[1] / max(d[1], 1):.2f}x; "
              f"distributed bytes = lower bound: {all(r['planned'] == r['lower_bound'] for r in ranks)}")
        print(f"engine generation identical after both designs at every step: {same}; "
              f"tokens equal to HF transformers' greedy: {agree}/{total}  ({time.perf_counter() - t0:.0f} s)")
        if not same:
            raise SystemExit("the two update paths left different models serving")


if __name__ == "__main__":
    main()
