"""Deriving DeepSeek-V3-671B's targets from SGLang's own loaders, metadata only.

``python -m benchmark.weight_sync.derive_dsv3 [--tp 8] [--ep 1] [--json]`` publishes an
engine layout (TP, MoE EP) the way SGLang's test helpers do, then runs the engine's own
code (``derive.target_cache``) in this process, phase by phase:

* ``first, rank r``: what engine rank r pays on the first update with an empty disk cache:
  ``own_rank_record`` (checkpoint names/shapes from the HF model on meta, the rank's model
  built on meta and loaded by SGLang's loaders under the recorder, each kind of repeated
  layer once (``derive.repeated_layers``), its disk entry written).
  In an engine every TP rank does this at the same time for its own rank; here the ranks
  run one after another, each measured alone (time, peak RSS of the process, growth of RSS);
* ``first, assemble``: every rank's record decoded into the engine's targets (what follows
  the ranks' exchange; the gloo transfer of the records is not in this figure);
* ``restart``: ``engine_derived_targets`` in a process that finds the disk entries (memory
  cache dropped): the cache key, this rank's entry read, the other ranks' records (what the
  exchange brings: read from their entries here) assembled; ``key`` is the key alone;
* ``cached``: ``engine_derived_targets`` again: what every later update pays.

``--concurrent`` instead starts one process per rank, as an engine's TP ranks are, and
once every process has imported SGLang and built its engine context (an engine has done
that long before its first update) lets all of them derive their own rank at the same
time on this machine's cores: the wall time from that common start until the last rank's
record is written, then the assembly in the parent (``first, assemble``).

``--floor`` measures what one rank's derivation is made of against what SGLang's own code
costs with nothing recorded, in CPU seconds (best of ``--repeat``, the phases interleaved, so
that this machine's drifting speed hits all alike): the checkpoint layout, the model built
on meta as the rank, SGLang's ``load_weights`` of every layer on meta with no dispatch mode,
the same under a ``TorchDispatchMode`` that records nothing (what any recording mode pays
before it records anything), ``derive_rank`` (every layer loaded under ``LoadRecorder``,
post-load processing, describe), and the engine's derivation (``derive_once_per_layer_kind``:
the model built, each kind of repeated layer loaded once, the others renamed). From these it
prints the least time T ranks loading every layer can take on this machine's cores, and what
the engine's derivation takes, each as T x (CPU s per rank) / cores; then checks that the
engine's derivation equals ``derive_rank`` of every layer (exits non-zero if not).

The full config is used except its yarn rope scaling (SGLang's yarn rotary asks for an
accelerator at construction; rotary embeddings hold no checkpoint weights). Runs on
SGLang's default platform (the loaders' CUDA branches) with the test helpers'
``vllm._custom_ops`` stand-in.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

FULL = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    num_experts_per_tok=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    n_group=8,
    topk_group=4,
    moe_layer_freq=1,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def _status_gib(field: str) -> float:
    """VmHWM (peak RSS) or VmRSS of this process, GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise KeyError(field)


def _reset_peak() -> None:
    """Start a new peak-RSS window (Linux: 5 > /proc/self/clear_refs resets VmHWM)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")


def _measured(fn):
    _reset_peak()
    before = _status_gib("VmRSS")
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    return out, seconds, _status_gib("VmHWM"), _status_gib("VmHWM") - before


def _engine_context(model_dir: Path, cache: Path, tp: int, ep: int):
    """This process as an engine of the given layout sees it (default platform, disk cache at
    ``cache``): returns (the installed server args, the model config)."""
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "support"))
    import sglang_fakes  # the vllm._custom_ops stand-in for the default platform on a CPU-only machine

    sglang_fakes._provide_vllm_rotary_import()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.runtime_context import get_context
    from sglang.srt.weight_sync.derive import disk_cache

    os.environ[disk_cache.CACHE_DIR_ENV] = str(cache)
    installed = get_context().override_server_args(tp_size=tp, ep_size=ep)
    installed.install()
    model_config = ModelConfig(model_path=str(model_dir))
    get_model_architecture(
        model_config
    )  # SGLang's model registry, imported when the engine built its model
    return installed, model_config


def _concurrent_rank(
    rank: int, args, model_dir: Path, cache: Path, start, done
) -> None:
    _, model_config = _engine_context(model_dir, cache, args.tp, args.ep)
    from sglang.srt.weight_sync.derive import target_cache

    start.wait()
    record = target_cache.own_rank_record(model_config, rank)
    done.put((rank, time.time(), json.dumps(record)))


def _concurrent(args, work: Path, parallel) -> None:
    """Every rank in its own process, deriving at the same time (see the module's text)."""
    import multiprocessing as mp

    from sglang.srt.weight_sync.derive import target_cache

    ctx = mp.get_context("spawn")
    start, done = ctx.Barrier(args.tp + 1), ctx.Queue()
    procs = [
        ctx.Process(
            target=_concurrent_rank,
            args=(r, args, work / "model", work / "cache", start, done),
        )
        for r in range(args.tp)
    ]
    for p in procs:
        p.start()
    start.wait()
    t0 = time.time()
    finished = sorted((done.get() for _ in procs), key=lambda x: x[0])
    for p in procs:
        p.join()
    ends = [end - t0 for _, end, _ in finished]
    load = os.getloadavg()[0]
    t1 = time.perf_counter()
    targets = target_cache.assemble(
        parallel, [json.loads(blob) for _, _, blob in finished]
    )
    assemble_s = time.perf_counter() - t1
    print(
        f"DeepSeek-V3-671B, TP {args.tp}, MoE EP {args.ep}: {args.tp} ranks deriving their own targets at the "
        f"same time on {os.cpu_count()} cores (load average {load:.1f} when the last finished)"
    )
    print(
        f"ranks done after {min(ends):.1f} .. {max(ends):.1f} s; assemble {assemble_s:.2f} s "
        f"({sum(map(len, targets.per_rank))} targets); every rank's targets ready after "
        f"{max(ends) + assemble_s:.1f} s"
    )
    if args.json:
        print(
            json.dumps(
                dict(
                    tp=args.tp,
                    ep=args.ep,
                    cores=os.cpu_count(),
                    rank_done_s=[round(e, 2) for e in ends],
                    assemble_s=round(assemble_s, 3),
                    ready_s=round(max(ends) + assemble_s, 2),
                )
            )
        )


def _floor(args, model_config) -> None:
    """One rank's derivation against SGLang's own cost with nothing recorded (see the module's text)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from sglang.srt.weight_sync.derive import derived_targets, repeated_layers
    from sglang.srt.weight_sync.phase_timing import collector_paused
    from sglang.srt.weight_sync.sglang_compat import original_hf_config

    class RecordsNothing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    rank = min(1, args.tp - 1)
    hf_config = original_hf_config(model_config)
    checkpoint = derived_targets.checkpoint_layout(hf_config)

    def cpu(fn) -> float:
        gc.collect()  # the models of earlier phases, outside the timer
        with collector_paused():
            start = time.process_time()
            fn()
            return time.process_time() - start

    def load(mode):
        with derived_targets.as_engine_rank(rank):
            model = derived_targets.build_meta_model(model_config)
            leaves = [
                (n, torch.empty(s, dtype=d, device="meta"))
                for n, s, d in checkpoint.tensors
            ]
            with torch.no_grad(), mode or contextlib.nullcontext():
                return cpu(lambda: model.load_weights(iter(leaves)))

    def derive():
        with derived_targets.as_engine_rank(rank):
            model = derived_targets.build_meta_model(model_config)
            return cpu(lambda: derived_targets.derive_rank(model, checkpoint))

    engine_derived = []

    def engine_derive():
        with derived_targets.as_engine_rank(rank):
            return cpu(
                lambda: engine_derived.append(
                    repeated_layers.derive_once_per_layer_kind(
                        lambda: derived_targets.build_meta_model(model_config),
                        checkpoint,
                    )
                )
            )

    def build():
        with derived_targets.as_engine_rank(rank):
            return cpu(lambda: derived_targets.build_meta_model(model_config))

    phases = {
        "checkpoint layout (the HF model on meta)": lambda: cpu(
            lambda: derived_targets.checkpoint_layout(hf_config)
        ),
        "model built on meta as the rank": build,
        "SGLang's load_weights on meta, no dispatch mode": lambda: load(None),
        "the same under a TorchDispatchMode that records nothing": lambda: load(
            RecordsNothing()
        ),
        "derive_rank: the same under LoadRecorder, post-load, describe": derive,
        "the engine's derivation: model built, each kind of repeated layer loaded once, the rest renamed": engine_derive,
    }
    seconds = {name: [] for name in phases}
    for _ in range(args.repeat):
        for name, phase in phases.items():
            seconds[name].append(phase())
    best = {name: min(s) for name, s in seconds.items()}
    names = list(phases)
    unrecorded = best[names[0]] + best[names[1]] + best[names[3]]
    every_layer, engine = (
        best[names[0]] + best[names[1]] + best[names[4]],
        best[names[0]] + best[names[5]],
    )
    cores = len(os.sched_getaffinity(0))
    with derived_targets.as_engine_rank(rank):
        every = derived_targets.derive_rank(
            derived_targets.build_meta_model(model_config), checkpoint
        )
    equal = all(d == every for d in engine_derived)
    print(
        f"DeepSeek-V3-671B, TP {args.tp}, MoE EP {args.ep}, engine rank {rank}: CPU seconds, best of "
        f"{args.repeat}, phases interleaved"
    )
    print("| phase | CPU s | all runs |")
    print("|---|---|---|")
    for name in names:
        print(
            f"| {name} | {best[name]:.2f} | {', '.join(f'{x:.2f}' for x in seconds[name])} |"
        )
    print(
        f"{args.tp} ranks on {cores} cores, every layer loaded: with nothing recorded at least {args.tp} x "
        f"{unrecorded:.2f} / {cores} = {args.tp * unrecorded / cores:.1f} s, under the recorder {args.tp} x "
        f"{every_layer:.2f} / {cores} = {args.tp * every_layer / cores:.1f} s; the engine's derivation "
        f"{args.tp} x {engine:.2f} / {cores} = {args.tp * engine / cores:.1f} s (layout included)"
    )
    print(f"the engine's derivation equals derive_rank of every layer: {equal}")
    if args.json:
        print(
            json.dumps(
                dict(
                    tp=args.tp,
                    ep=args.ep,
                    rank=rank,
                    cores=cores,
                    repeat=args.repeat,
                    best_cpu_s={n: round(v, 3) for n, v in best.items()},
                    all_ranks_unrecorded_floor_s=round(args.tp * unrecorded / cores, 2),
                    all_ranks_engine_derivation_s=round(args.tp * engine / cores, 2),
                    engine_equals_every_layer=equal,
                )
            )
        )
    if not equal:
        raise SystemExit(
            "the engine's derivation differs from derive_rank of every layer"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="one process per rank, all deriving at once",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="one rank's phases against SGLang's unrecorded cost",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="with --floor: runs of each phase"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import transformers

    work = Path(tempfile.mkdtemp(prefix="derive_dsv3-"))
    kwargs = dict(FULL)
    transformers.AutoConfig.for_model(
        kwargs.pop("model_type"), **kwargs
    ).save_pretrained(work / "model")
    installed, model_config = _engine_context(
        work / "model", work / "cache", args.tp, args.ep
    )
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.weight_sync.derive import disk_cache, target_cache
    from sglang.srt.weight_sync.target_layout import EngineParallel

    par = get_parallel()
    parallel = EngineParallel(par.tp_size, par.attn_tp_size, par.moe_ep_size)
    if args.concurrent or args.floor:
        try:
            (
                _concurrent(args, work, parallel)
                if args.concurrent
                else _floor(args, model_config)
            )
        finally:
            installed.restore()
        return
    rows = []

    def row(phase, seconds, peak, growth, targets=None):
        counts = {}
        if targets is not None:
            counts = dict(
                targets=sum(map(len, targets.per_rank)),
                pieces=sum(len(t.pieces) for ts in targets.per_rank for t in ts),
                post_load=len(targets.post_load),
                not_copied=len(targets.not_copied),
            )
        rows.append(
            dict(
                phase=phase,
                tp=args.tp,
                ep=args.ep,
                seconds=round(seconds, 4),
                peak_rss_gib=round(peak, 2),
                rss_growth_gib=round(growth, 2),
                **counts,
            )
        )

    try:
        records = []
        for r in range(args.tp):
            record, seconds, peak, growth = _measured(
                lambda: target_cache.own_rank_record(model_config, r)
            )
            records.append(record)
            row(f"first, rank {r}", seconds, peak, growth)
        blobs = [json.dumps(rec).encode() for rec in records]  # what each rank sends
        del records
        targets, seconds, peak, growth = _measured(
            lambda: target_cache.assemble(parallel, [json.loads(b) for b in blobs])
        )
        row("first, assemble", seconds, peak, growth, targets)
        del targets
        _, seconds, peak, growth = _measured(lambda: disk_cache.cache_key(model_config))
        row("restart, key", seconds, peak, growth)
        disk_cache._versions.cache_clear()
        memo = {}  # the engine's weight sync keeps one per engine
        targets, seconds, peak, growth = _measured(
            lambda: target_cache.engine_derived_targets(
                model_config, 0, lambda own: [own] + blobs[1:], memo
            )
        )
        row("restart", seconds, peak, growth, targets)
        targets, seconds, peak, growth = _measured(
            lambda: target_cache.engine_derived_targets(
                model_config, 0, lambda own: [own] + blobs[1:], memo
            )
        )
        row("cached", seconds, peak, growth, targets)
    finally:
        installed.restore()

    firsts = [r for r in rows if r["phase"].startswith("first, rank")]
    assemble = next(r for r in rows if r["phase"] == "first, assemble")
    summary = dict(
        first_one_rank_max_s=max(r["seconds"] for r in firsts),
        first_engine_wall_s=round(
            max(r["seconds"] for r in firsts) + assemble["seconds"], 4
        ),
        first_all_ranks_one_process_s=round(
            sum(r["seconds"] for r in firsts) + assemble["seconds"], 4
        ),
        first_one_rank_peak_rss_gib=max(r["peak_rss_gib"] for r in firsts),
        first_one_rank_rss_growth_gib=max(r["rss_growth_gib"] for r in firsts),
    )
    print(
        f"DeepSeek-V3-671B, TP {args.tp}, MoE EP {args.ep}: targets from SGLang's loaders on meta, "
        "each rank deriving its own"
    )
    print(
        "| phase | s | peak RSS GiB | RSS growth GiB | targets (all ranks) | pieces | post-load tensors | not copies |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['phase']} | {r['seconds']} | {r['peak_rss_gib']} | {r['rss_growth_gib']} | {r.get('targets', '')} | "
            f"{r.get('pieces', '')} | {r.get('post_load', '')} | {r.get('not_copied', '')} |"
        )
    print(
        f"first update, every rank deriving its own in parallel: {summary['first_engine_wall_s']} s "
        f"(slowest rank {summary['first_one_rank_max_s']} s + assemble); all {args.tp} ranks one after another "
        f"in one process: {summary['first_all_ranks_one_process_s']} s"
    )
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}))


if __name__ == "__main__":
    main()
