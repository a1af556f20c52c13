"""Real run on CPU: the trainer-side hop with delta updates against full ones, in one run.

``python -m benchmark.weight_sync.reshard_delta_run [--json]`` makes the Qwen2-shaped
checkpoint of ``delta_run`` (``MODEL``); four FSDP2 fp32 trainer ranks (gloo) train it
(AdamW on a next-token loss over random token ids, ``STEPS`` steps at each learning rate of
``LRS``) and after every step fill, as trainer-side mode does, the parameter-shaped bf16
buffers of two engines of TP 2 beside them (ranks 0-1 and 2-3) twice: in full, and as a
delta (``reshard_delta.ReshardDelta``), each through the trainer's agreement. No engine
runs: what an engine does with the buffers (copy them) is the same for both. Reported per
step: the density of the change after the bf16 cast, the bytes a trainer rank received
from the others and its seconds (the largest over the ranks) for each, the delta's
encoding and decoding, and whether the delta's buffers equal the full update's bit for bit
(they must). Beside them, **modelled**: the link between trainer hosts below which the
delta is faster than the full update (the bytes it saves over its measured encoding and
decoding: ``break_even_gbps``). The machine is shared (four ranks on its cores): only what
one run measures side by side compares.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

# its preamble: the tests' helpers on the path, the CPU engine's environment
import benchmark.weight_sync.remote_run  # noqa: F401
from benchmark.weight_sync.delta_run import LRS, MODEL, STEPS


def run() -> dict:
    import tiny_models
    from delta_cases import reshard_delta_bench_job
    from ranks import run_ranks

    with tempfile.TemporaryDirectory(prefix="reshard_delta_run_") as tmp:
        model_dir, _ = tiny_models.make_tiny_model(
            "qwen2", Path(tmp) / "model", **MODEL
        )
        job = dict(
            model_dir=str(model_dir), lrs=list(LRS), steps=STEPS, bucket=64 << 20
        )
        rows = run_ranks(4, reshard_delta_bench_job, job, timeout=3600)[0]
    for row in rows:
        assert not row["differ"], (
            f"the delta's buffers differ from the full update's: {row}"
        )
        saved = row["full_bytes"] - row["delta_bytes"]
        work = row["encode_seconds"] + row["decode_seconds"]
        row["break_even_gbps"] = 8 * saved / work / 1e9 if work else 0.0
    summary = {}
    for lr in LRS:
        mine = [r for r in rows if r["lr"] == lr]
        summary[str(lr)] = {
            key: statistics.median(f(r) for r in mine)
            for key, f in (
                ("density_median", lambda r: r["density"]),
                ("bytes_fraction_median", lambda r: r["delta_bytes"] / r["full_bytes"]),
                ("full_seconds_median", lambda r: r["full_seconds"]),
                ("delta_seconds_median", lambda r: r["delta_seconds"]),
                ("encode_seconds_median", lambda r: r["encode_seconds"]),
                ("decode_seconds_median", lambda r: r["decode_seconds"]),
                ("break_even_gbps_median", lambda r: r["break_even_gbps"]),
            )
        }
    return {
        "model": MODEL,
        "trainer_ranks": 4,
        "engines": "2 x TP2 (bf16), beside the trainer ranks; buffers only",
        "rows": rows,
        "summary": summary,
    }


def main() -> int:
    result = run()
    if "--json" in sys.argv:
        json.dump(result, sys.stdout, indent=1)
        return 0
    print(
        f"Qwen2-shaped {MODEL}, 4 FSDP2 fp32 trainer ranks (AdamW) -> "
        f"{result['engines']}\n"
        "| lr | step | mode | density | full: bytes, s | delta: bytes (% of full), s | "
        "encode s | decode s | break-even link, Gb/s (modelled) |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    for r in result["rows"]:
        print(
            f"| {r['lr']} | {r['step']} | {r['mode']} | {r['density']:.4f} | "
            f"{r['full_bytes']:.0f}, {r['full_seconds']:.3f} | {r['delta_bytes']:.0f} "
            f"({100 * r['delta_bytes'] / r['full_bytes']:.2f}%), {r['delta_seconds']:.3f} | "
            f"{r['encode_seconds']:.4f} | {r['decode_seconds']:.4f} | "
            f"{r['break_even_gbps']:.2f} |"
        )
    for lr, s in result["summary"].items():
        print(f"lr {lr}: " + ", ".join(f"{k} {v:.4g}" for k, v in s.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
