"""How fast an update is, against upstream's path and against a memory copy, in one run.

``python -m benchmark.weight_sync.update_speed [--size 254m] [--updates 10] [--upstream 3]
[--sweep] [--moe] [--json out.json]`` starts a real SGLang engine (TP 2, CPU, bf16) for a
Qwen2-shaped model (or an MoE model: ``MOE``) and two trainer ranks (gloo) holding it as
FSDP2 ``Shard(0)`` fp32 DTensors; rank 0 hosts the engine through ``VerlEngine``. Then,
side by side in one run:

* ``ours``: ``VerlEngine.update_weights_from_tensor`` (each rank delivers its local shards;
  the engine reshards), ``--updates`` times in a row, each with new weights;
* ``upstream``: SGLang 0.5.23's own path (``upstream_path``: ``full_tensor()`` on every
  rank, ``gather_object`` to rank 0, ``update_weights_from_tensor``), ``--upstream`` times;
* ``memcpy``: a copy of one engine rank's bf16 parameter bytes into memory already touched,
  one thread (the engine ranks run one thread each), the floor an update is measured
  against.

Printed: every update's seconds, the first (which derives targets and plans) apart from
the rest, the ratios to memcpy and upstream, and the phase breakdown each side reports
(``phase_timing``). ``--sweep`` repeats it over model sizes, one engine per size; ``--moe``
over the MoE models (one upstream update each: upstream resolves every expert tensor's
name against the whole expert mapping, minutes per update), with seconds per tensor. Both
paths must leave the engine generating the same greedy tokens from the same weights
(checked after each size; the run fails otherwise). This machine is shared: only ratios
measured in one run mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import List

os.environ.setdefault("PYTHONWARNINGS", "ignore")
warnings.simplefilter("ignore")

SUPPORT = Path(__file__).resolve().parents[2] / "test" / "support"
sys.path.insert(0, str(SUPPORT))

from engine import configure_cpu_env  # noqa: E402

configure_cpu_env()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WORLD = 2


def _qwen2(hidden: int, intermediate: int, heads: int, layers: int, vocab: int) -> dict:
    """A Qwen2 config: 4 KV heads and sizes that keep SGLang's CPU engine from padding at TP 2."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=4,
        num_hidden_layers=layers,
        vocab_size=vocab,
    )


# Qwen2-shaped models by name (parameters, untied embeddings)
SIZES = {
    "21m": _qwen2(512, 1536, 8, 4, 8192),  # the demo's
    "64m": _qwen2(768, 2048, 12, 6, 16384),
    "254m": _qwen2(1024, 2816, 16, 16, 35840),
    "520m": _qwen2(1536, 4096, 16, 16, 35840),
    "1b": _qwen2(2048, 5632, 16, 20, 35840),
}


def _moe(kind: str, experts: int, layers: int, moe_intermediate: int, **more) -> tuple:
    """An MoE model at this machine's scale: the tensor count of its kind, hidden sizes
    scaled down (hidden 128, heads 8 x 16, 4 KV heads), unpadded by SGLang's CPU engine at
    TP 2. (tiny_models kind, config overrides, whether SGLang's CPU engine generates with it)."""
    key = "num_experts" if kind == "qwen3_moe" else "n_routed_experts"
    config = dict(
        hidden_size=128,
        num_hidden_layers=layers,
        moe_intermediate_size=moe_intermediate,
        num_experts_per_tok=8,
        **{key: experts},
        **more,
    )
    return kind, config, kind != "deepseek_v3"


# MoE models by name: Qwen3-30B-A3B's tensor count (48 layers of 128 experts, top 8); a
# DeepSeek-V3-shaped one (256 experts, MLA, a dense first layer, a shared expert; 8 layers);
# and 8 Qwen3-MoE layers whose experts hold the same bytes at every expert count (experts x
# moe_intermediate fixed), to see how time grows with the number of tensors alone.
MOE = {
    "qwen3-30b-a3b": _moe("qwen3_moe", 128, 48, 128),
    "dsv3": _moe("deepseek_v3", 256, 8, 128, n_group=1, topk_group=1),
    **{f"e{e}": _moe("qwen3_moe", e, 8, 16384 // e) for e in (32, 64, 128, 256)},
}
ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
PROMPTS = [[5, 17, 42, 7, 300, 2], [77, 1, 3, 120, 9, 11]]
SAME = {
    True: "yes",
    False: "NO",
    None: "-",
}  # generation after ours vs after upstream's


def _config(size: str):
    from tiny_models import tiny_config

    kind, overrides = ("qwen2", SIZES[size]) if size in SIZES else MOE[size][:2]
    config = tiny_config(kind, **overrides)
    config.architectures = [ARCHITECTURES[kind]]
    return config


def _generates(size: str) -> bool:
    return size in SIZES or MOE[size][2]


def _shapes(size: str):
    """HF tensor name -> shape of the model's checkpoint (built on meta)."""
    from real_moe_configs import saved_shapes

    return saved_shapes(_config(size))


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Median seconds of one thread copying ``nbytes`` into memory already touched."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
        dst = torch.zeros_like(src)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def _local_shards(shapes, mesh, rank: int, step: int):
    """FSDP2-style ``Shard(0)`` fp32 DTensors, each rank making only its own rows, in the
    order the model's checkpoint lists them (``shapes``' order: a layer's experts in
    number order), as a trainer hands its state dict over."""
    from torch.distributed.tensor import DTensor, Shard

    out = []
    for i, (name, shape) in enumerate(shapes.items()):
        rows = -(-shape[0] // WORLD)
        lo, hi = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
        g = torch.Generator().manual_seed(step * 100003 + i * 17 + rank)
        local = torch.randn((hi - lo, *shape[1:]), generator=g) * 0.05
        if len(shape) == 1 and "norm" in name:
            local += 1.0
        out.append(
            (
                name,
                DTensor.from_local(
                    local,
                    mesh,
                    (Shard(0),),
                    shape=torch.Size(shape),
                    stride=torch.empty(shape, device="meta").stride(),
                    run_check=False,
                ),
            )
        )
    return out


def _bump(dtensors) -> None:
    """New weights in place (as a training step leaves them), outside the timed region."""
    with torch.no_grad():
        for _, d in dtensors:
            d.to_local().mul_(-1.0)


def start_zygote() -> None:
    """A spawned rank's first step, while it has one thread, as the tests' ranks take it
    (``test/support/zygote.py``): the engine it hosts forks its schedulers from this warm
    copy. Forked later, after the rank's gloo group exists, they hang making their own."""
    import zygote

    zygote.start()
    zygote.install()


def _rank(rank, store, model_dir, size, updates, upstream, out_dir):
    start_zygote()
    from engine import omp_bind
    from torch.distributed.device_mesh import init_device_mesh

    from benchmark.weight_sync.upstream_path import upstream_update
    from sglang.srt.entrypoints.verl_engine import VerlEngine

    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(WORLD)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD
    )
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    verl = VerlEngine(
        mesh,
        model_path=str(model_dir),
        load_format="dummy",
        device="cpu",
        attention_backend="torch_native",
        skip_tokenizer_init=True,
        mem_fraction_static=0.5,  # of the memory the CPU platform finds free; the KV cache is capped below
        max_total_tokens=4096,
        disable_cuda_graph=True,
        random_seed=0,
        log_level="warning",
        sleep_on_idle=True,
    )
    shapes = _shapes(size)
    dtensors = _local_shards(shapes, mesh, rank, 1)
    engine_bytes = sum(
        torch.Size(s).numel() for s in shapes.values()
    )  # bf16: 2 bytes, half per TP rank
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    result = dict(ours=[], upstream=[], memcpy=[])

    def floor() -> None:  # rank 0 copies alone: the other rank waits
        dist.barrier()
        if rank == 0:
            result["memcpy"].append(memcpy_seconds(engine_bytes))
        dist.barrier()

    floor()
    for i in range(updates):
        _bump(dtensors)
        dist.barrier()
        t0 = time.perf_counter()
        report = verl.update_weights_from_tensor(dtensors)
        seconds = time.perf_counter() - t0
        result["ours"].append(
            dict(seconds=seconds, phases=report.phases, engine=report.engine_phases)
        )
        if rank == 0:
            print(f"      ours {i + 1}: {seconds:.3f} s", flush=True)
    generate = _generates(size)
    ours_tokens = (
        verl.generate(input_ids=PROMPTS, sampling_params=params) if generate else None
    )
    floor()
    for i in range(upstream):
        if i:
            _bump(dtensors)
            _bump(dtensors)  # back to the weights ours wrote last, after the first
        dist.barrier()
        t0 = time.perf_counter()
        upstream_update(verl._engine, dtensors, rank, WORLD)
        seconds = time.perf_counter() - t0
        result["upstream"].append(dict(seconds=seconds))
        if rank == 0:
            print(f"      upstream {i + 1}: {seconds:.3f} s", flush=True)
    upstream_tokens = (
        verl.generate(input_ids=PROMPTS, sampling_params=params) if generate else None
    )
    floor()
    # None without upstream updates (``--upstream 0``: nothing to compare)
    result["same_generation"] = (
        [o["output_ids"] for o in ours_tokens]
        == [o["output_ids"] for o in upstream_tokens]
        if upstream and generate
        else None
    )
    result["engine_rank_bytes"] = engine_bytes
    result["tensors"] = len(shapes)
    result["expert_tensors"] = sum(".experts." in n for n in shapes)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    verl.shutdown()


def run_size(size: str, updates: int, upstream: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        _config(size).save_pretrained(model_dir)
        shapes = _shapes(size)
        n = sum(torch.Size(s).numel() for s in shapes.values())
        kind = "Qwen2" if size in SIZES else MOE[size][0]
        print(
            f"{size}: {kind}-shaped, {n / 1e6:.0f} M params in {len(shapes)} tensors; "
            "engine TP 2 bf16 (CPU), trainer 2 ranks FSDP2 Shard(0) fp32",
            flush=True,
        )
        mp.spawn(
            _rank,
            args=(
                os.path.join(tmp, "store"),
                model_dir,
                size,
                updates,
                upstream,
                tmp,
            ),
            nprocs=WORLD,
        )
        ranks = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(WORLD)]
    r0 = ranks[0]
    return dict(size=size, params=n, **r0)


# The breakdown's columns: (trainer or engine, phase, heading). The engine's are engine rank
# 0's (its answer's); "transit" is the trainer's wait for the answer less that rank's total:
# the request's way to the scheduler and back, the cache flush and the closing barrier.
COLUMNS = (
    ("trainer", "describe", "describe"),
    ("trainer", "deliver", "deliver"),
    ("trainer", "control", "control"),
    ("engine", "deliver", "e:receive"),
    ("engine", "describe", "e:describe"),
    ("engine", "validate", "e:validate"),
    ("engine", "agree", "e:agree"),
    ("engine", "plan", "e:plan"),
    ("engine", "execute", "e:execute"),
    ("engine", "apply", "e:apply"),
    ("engine", "refresh", "e:refresh"),
    ("engine", "control", "e:control"),
    ("transit", "", "transit"),
    ("other", "", "other"),
)


def breakdown(update: dict) -> List[float]:
    """One update of ours as ``COLUMNS``: they add up to its measured seconds."""
    t, e = update["phases"], update["engine"]
    engine_total = e["total_us"][0] / 1e6 if e else 0.0
    out = []
    for side, phase, _ in COLUMNS:
        if side == "trainer":
            out.append(t[phase])
        elif side == "engine":
            out.append(e[phase][0] if e else 0.0)
        elif side == "transit":
            out.append(max(0.0, t["engine"] - engine_total))
        else:  # what neither side's phases cover: the trainer's and engine rank 0's other
            out.append(
                update["seconds"]
                - sum(t[p] for p in NAMED)
                + (e["other"][0] if e else 0.0)
            )
    return out


NAMED = (
    "describe",
    "deliver",
    "plan",
    "execute",
    "apply",
    "control",
    "engine",
    "agree",
)


def summary(r: dict) -> dict:
    """The figures a size's run is judged by (the first update apart)."""
    memcpy = statistics.median(r["memcpy"])
    ours = [u["seconds"] for u in r["ours"]]
    later = ours[1:]
    up = [u["seconds"] for u in r["upstream"]]
    up_later = up[1:] or up
    rows = [breakdown(u) for u in r["ours"]]
    steady = [statistics.median(col) for col in zip(*rows[1:])] if rows[1:] else []
    steady_s = statistics.median(later) if later else None
    return dict(
        size=r["size"],
        params=r["params"],
        tensors=r["tensors"],
        expert_tensors=r["expert_tensors"],
        us_per_tensor_steady=steady_s / r["tensors"] * 1e6 if later else None,
        engine_rank_bytes=r["engine_rank_bytes"],
        memcpy_s=memcpy,
        ours_first_s=ours[0],
        ours_second_s=later[0] if later else None,
        ours_steady_s=statistics.median(later) if later else None,
        ours_worst_later_s=max(later) if later else None,
        ours_last_s=ours[-1],
        upstream_first_s=up[0] if up else None,
        upstream_steady_s=statistics.median(up_later) if up else None,
        x_memcpy_steady=statistics.median(later) / memcpy if later else None,
        x_memcpy_worst=max(later) / memcpy if later else None,
        faster_than_upstream=(
            statistics.median(up_later) / statistics.median(later)
            if up and later
            else None
        ),
        second_over_last=later[0] / ours[-1] if later else None,
        breakdown_first=dict(zip((c[2] for c in COLUMNS), rows[0])),
        breakdown_second=(
            dict(zip((c[2] for c in COLUMNS), rows[1])) if rows[1:] else {}
        ),
        breakdown_steady=dict(zip((c[2] for c in COLUMNS), steady)),
        covered=[
            1 - row[-1] / u["seconds"] for row, u in zip(rows, r["ours"])
        ],  # the phases' share of each measured update
        same_generation=r["same_generation"],
    )


def print_table(summaries: List[dict]) -> None:
    print()
    print(
        f"{'model':>6} {'MiB/engine':>10} {'memcpy':>7} | {'ours: 1st':>9} {'2nd':>6} "
        f"{'steady':>7} {'worst':>6} {'x memcpy':>8} | {'upstream: 1st':>13} {'steady':>7} "
        f"{'/ ours':>7} | {'same':>4}"
    )
    print(
        f"{'':>6} {'rank (bf16)':>10} {'s':>7} | {'s':>9} {'s':>6} {'s':>7} {'s':>6} {'steady':>8} | {'s':>13} {'s':>7} {'steady':>7} | {'gen':>4}"
    )
    for s in summaries:

        def f(v, w, d=3):
            return f"{v:>{w}.{d}f}" if v is not None else f"{'-':>{w}}"

        print(
            f"{s['size']:>6} {s['engine_rank_bytes'] / 2**20:>10.0f} {f(s['memcpy_s'], 7, 4)} | "
            f"{f(s['ours_first_s'], 9)} {f(s['ours_second_s'], 6)} {f(s['ours_steady_s'], 7)} "
            f"{f(s['ours_worst_later_s'], 6)} {f(s['x_memcpy_steady'], 8, 1)} | "
            f"{f(s['upstream_first_s'], 13)} {f(s['upstream_steady_s'], 7)} "
            f"{f(s['faster_than_upstream'], 7, 1)} | {SAME[s['same_generation']]:>4}"
        )
    print(
        "steady: the median of every update after the first; worst: the slowest of them; "
        "x memcpy: steady / a one-thread copy of one engine rank's bf16 parameter bytes."
    )
    for s in summaries:
        if s["expert_tensors"]:
            up = s["upstream_steady_s"]
            print(
                f"{s['size']:>6}: {s['tensors']} tensors ({s['expert_tensors']} experts'): "
                f"ours {s['us_per_tensor_steady']:.0f} us per tensor"
                + (f", upstream {up / s['tensors'] * 1e6:.0f}" if up else "")
            )
    heads = [c[2] for c in COLUMNS]
    print()
    print(
        "where ours spends its seconds (trainer rank 0, engine rank 0; e: the engine):"
    )
    print(
        f"{'model':>6} {'update':>7} "
        + " ".join(f"{h:>{max(7, len(h))}}" for h in heads)
        + f" {'covered':>8}"
    )
    for s in summaries:
        for when in ("first", "second", "steady"):
            row = s[f"breakdown_{when}"]
            if not row:
                continue
            cover = (
                s["covered"][0]
                if when == "first"
                else s["covered"][1]
                if when == "second"
                else statistics.median(s["covered"][1:])
            )
            print(
                f"{s['size']:>6} {when:>7} "
                + " ".join(f"{row[h]:>{max(7, len(h))}.4f}" for h in heads)
                + f" {cover * 100:>7.1f}%"
            )
    print(
        "covered: the share of the measured seconds that named phases account for (the rest "
        "is 'other'); transit: the request's way to the engine's schedulers and back."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="254m", choices=sorted(SIZES) + sorted(MOE))
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument(
        "--upstream",
        type=int,
        default=3,
        help="upstream updates (0: none, where its full tensors on every rank do not fit)",
    )
    parser.add_argument(
        "--sweep",
        nargs="?",
        const=",".join(SIZES),
        default=None,
        help="sizes to run one after another (default: all)",
    )
    parser.add_argument(
        "--moe",
        nargs="?",
        const=",".join(MOE),
        default=None,
        help="MoE models to run one after another (default: all), one upstream update each",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = (
        args.moe.split(",")
        if args.moe
        else args.sweep.split(",")
        if args.sweep
        else [args.size]
    )
    if args.moe:
        args.upstream = min(args.upstream, 1)
    results, summaries = [], []
    for size in sizes:
        results.append(run_size(size, args.updates, args.upstream))
        summaries.append(summary(results[-1]))
        print_table(summaries[-1:])
        if args.json:  # kept as it grows: a long sweep leaves what it measured
            Path(args.json).write_text(
                json.dumps(dict(summaries=summaries, runs=results), indent=1)
            )
    if len(summaries) > 1:
        print_table(summaries)
    print(
        json.dumps([{k: v for k, v in s.items() if k != "covered"} for s in summaries])
    )
    if any(s["same_generation"] is False for s in summaries):
        raise SystemExit(
            "the engine generates differently after ours and after upstream's update of the "
            "same weights"
        )


if __name__ == "__main__":
    main()
