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

After every update the engine's greedy generation must be the same whichever design pushed
the weights (the upstream design loads them with SGLang's own loader, so this checks the
distributed update against SGLang's own load); the demo exits non-zero otherwise. It is
also compared with HF transformers' on prompts chosen without bf16 near-ties (as the
end-to-end tests do) and the count printed: SGLang's CPU kernels and HF round bf16
differently, so a prompt may differ from HF after both designs alike. Printed: one table with, per
design, the first update (the engine derives its targets from SGLang's loaders and plans, once) and
the steady state (every later update, median) apart: seconds per update, bytes each trainer rank
receives, the memory it holds for the engine, and the generation check; one line under it says what
the numbers mean.
Upstream's import-time warnings (AWQ/GGUF/Triton on CPU, deprecations) are silenced here
and in the processes the demo starts.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

# Before anything imports SGLang: its CPU import warnings are noise here. The environment
# variables reach the trainer ranks and the engine's scheduler processes (fresh interpreters).
os.environ.setdefault("PYTHONWARNINGS", "ignore")
warnings.simplefilter("ignore")

SUPPORT = (
    Path(__file__).resolve().parents[2] / "test" / "support"
)  # CPU engine set-up, tiny models
sys.path.insert(0, str(SUPPORT))

from engine import configure_cpu_env  # noqa: E402

configure_cpu_env()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmark.weight_sync.update_speed import SIZES, start_zygote  # noqa: E402
from benchmark.weight_sync.upstream_path import upstream_update  # noqa: E402

MODEL = SIZES["21m"]
STEPS = 4
# This model's logits reach ~20, where a bf16 ulp is 0.125: the tests' 0.25 margin (tuned for the tiny
# models' ~8-10) is 2 ulps here, and SGLang's CPU kernels and HF round differently. 1.0 is 8 ulps.
MIN_MARGIN = 1.0


def _weights(model_dir, step):
    import tiny_models

    ckpt = tiny_models.load_checkpoint(model_dir)
    return {
        n: (
            t.float() + 0.2 * tiny_models.random_like(t, seed=step * 1000 + i).float()
        ).to(t.dtype)
        for i, (n, t) in enumerate(sorted(ckpt.items()))
    }


def _progress_while(label: str, every: float = 10.0) -> threading.Event:
    """Print ``label`` and the seconds elapsed every ``every`` s until the returned event is set."""
    done, t0 = threading.Event(), time.perf_counter()

    def tick():
        while not done.wait(every):
            print(f"{label} ... {time.perf_counter() - t0:.0f} s", flush=True)
        print(
            f"{label.replace('starting', 'ready')} after {time.perf_counter() - t0:.0f} s",
            flush=True,
        )

    threading.Thread(target=tick, daemon=True).start()
    return done


def _rank(rank, world, store, model_dir, out_dir, prompts):
    start_zygote()
    from engine import omp_bind
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from benchmark.weight_sync.hand_rules import model_targets_from_config
    from sglang.srt.entrypoints.verl_engine import VerlEngine
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import EngineParallel

    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(world)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    started = _progress_while("      engine starting") if rank == 0 else None
    verl = VerlEngine(
        mesh,
        model_path=str(model_dir),
        device="cpu",
        attention_backend="torch_native",
        skip_tokenizer_init=True,
        mem_fraction_static=0.05,
        max_total_tokens=4096,
        disable_cuda_graph=True,
        random_seed=0,
        log_level="error",
    )
    if started is not None:
        started.set()
        print(
            f"[3/4] pushing {STEPS} training steps, each through both designs",
            flush=True,
        )
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    rows = {"distributed": [], "upstream": []}
    for step in range(1, STEPS + 1):
        weights = _weights(model_dir, step)
        dtensors = [
            (n, distribute_tensor(t, mesh, (Shard(0),), src_data_rank=None))
            for n, t in sorted(weights.items())
        ]
        for design in ("distributed", "upstream"):
            dist.barrier()
            t0 = time.perf_counter()
            if design == "distributed":
                report = verl.update_weights_from_tensor(dtensors)
                received, peak = None, report.shared_bytes
            else:
                received, peak = upstream_update(verl._engine, dtensors, rank, 2)
            seconds = time.perf_counter() - t0
            generation = [
                o["output_ids"]
                for o in verl.generate(input_ids=prompts[step], sampling_params=params)
            ]
            rows[design].append(
                dict(
                    step=step,
                    seconds=seconds,
                    received=received,
                    peak=peak,
                    generation=generation,
                )
            )
        if rank == 0:
            print(
                f"      step {step}: distributed {rows['distributed'][-1]['seconds']:.2f} s, "
                f"upstream {rows['upstream'][-1]['seconds']:.2f} s",
                flush=True,
            )
    # Bytes for the distributed design, from the plan the engine ran (tests prove executed = planned).
    config = json.loads((Path(model_dir) / "config.json").read_text())
    targets = model_targets_from_config(config, EngineParallel(world), torch.bfloat16)
    sources = {n: MeshSpec.of_dtensor(d).describe(n) for n, d in dtensors}
    the_plan = plan(sources, targets.by_rank())
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(
            dict(
                rows=rows,
                planned=the_plan.received_bytes(rank),
                lower_bound=the_plan.lower_bound_bytes(rank),
                staging_cap=the_plan.bucket_bytes,
            ),
            f,
        )
    dist.barrier()
    verl.shutdown()


def main() -> None:
    import tiny_models
    import torch.multiprocessing as mp
    from engine import hf_greedy, stable_prompts

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir, _ = tiny_models.make_tiny_model(
            "qwen2", Path(tmp) / "qwen2", **MODEL
        )
        n_params = sum(
            t.numel() for t in tiny_models.load_checkpoint(model_dir).values()
        )
        print(
            f"model: Qwen2-shaped, {n_params / 1e6:.1f} M params (bf16); SGLang engine TP 2 on CPU; "
            f"trainer: 2 ranks holding FSDP2 Shard(0) DTensors",
            flush=True,
        )
        print(
            f"[1/4] choosing prompts whose greedy path has no bf16 near-tie (top-2 logit gap >= {MIN_MARGIN} "
            "at every step, HF transformers)",
            flush=True,
        )
        prompts = {
            s: stable_prompts(
                [(model_dir, _weights(model_dir, s))],
                2,
                8,
                min_margin=MIN_MARGIN,
                vocab_size=MODEL["vocab_size"],
            )
            for s in range(1, STEPS + 1)
        }
        print(
            "[2/4] starting 2 trainer ranks (gloo) and the SGLang engine (about a minute on CPU)",
            flush=True,
        )
        mp.spawn(
            _rank,
            args=(2, os.path.join(tmp, "store"), model_dir, tmp, prompts),
            nprocs=2,
        )
        ranks = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(2)]
        print(
            "[4/4] comparing the engine's greedy generation with HF transformers after every update",
            flush=True,
        )
        expected = {
            s: hf_greedy(model_dir, prompts[s], 8, weights=_weights(model_dir, s))
            for s in prompts
        }
        table = []
        for design in ("distributed", "upstream"):
            rows = ranks[0]["rows"][design]
            equal = sum(
                got == want
                for row in rows
                for got, want in zip(row["generation"], expected[row["step"]])
            )
            if design == "distributed":
                received = max(r["planned"] for r in ranks)
                bound = all(r["planned"] == r["lower_bound"] for r in ranks)
            else:
                received = max(r["rows"][design][-1]["received"] for r in ranks)
                bound = all(
                    r["rows"][design][-1]["received"] == r["lower_bound"] for r in ranks
                )
            held = max(row["peak"] for r in ranks for row in r["rows"][design])
            prompts = f"{equal}/{sum(len(expected[row['step']]) for row in rows)}"
            for when, seconds in (
                ("first", rows[0]["seconds"]),
                ("steady", statistics.median(r["seconds"] for r in rows[1:])),
            ):
                table.append((design, when, seconds, received, held, bound, prompts))
        print()
        print(
            f"{'design':<12} {'update':<7} {'seconds':>8} {'MiB received':>13} {'MiB held':>14} "
            f"{'= lower':>8} {'greedy = HF':>12}"
        )
        print(
            f"{'':<12} {'':<7} {'':>8} {'/trainer rank':>13} {'/trainer rank':>14} "
            f"{'bound':>8} {'(prompts)':>12}"
        )
        for design, when, seconds, received, held, bound, prompts in table:
            print(
                f"{design:<12} {when:<7} {seconds:>8.3f} {received / 2**20:>13.2f} {held / 2**20:>14.2f} "
                f"{'yes' if bound else 'no':>8} {prompts if when == 'first' else '':>12}"
            )
        steady = {
            design: seconds for design, when, seconds, *_ in table if when == "steady"
        }
        bytes_ = {design: received for design, when, _, received, *_ in table}
        print(
            "first: the engine derives its targets from SGLang's own loaders and plans (once per "
            f"engine); steady: every later update (median of {STEPS - 1}). MiB held: what a trainer "
            "rank keeps for the engine (ours: its shards in shared memory, in the engine's dtype, "
            "kept between updates; upstream: every full tensor during an update)."
        )
        print(
            f"\nupstream / distributed, steady state: {steady['upstream'] / steady['distributed']:.1f}x "
            f"the time, {bytes_['upstream'] / max(bytes_['distributed'], 1):.1f}x the bytes "
            f"({STEPS} steps x 2 prompts x 8 tokens; {time.perf_counter() - t0:.0f} s in all)"
        )
        differ = [
            (row["step"], i)
            for row, other in zip(
                ranks[0]["rows"]["distributed"], ranks[0]["rows"]["upstream"]
            )
            for i, (got, want) in enumerate(zip(row["generation"], other["generation"]))
            if got != want
        ]
        if differ:
            raise SystemExit(
                f"greedy generation after the distributed update differs from the one after SGLang's "
                f"own load of the same weights (step, prompt): {differ}"
            )
        print(
            "greedy generation after the distributed update = after SGLang's own load, every step and prompt"
        )


if __name__ == "__main__":
    main()
