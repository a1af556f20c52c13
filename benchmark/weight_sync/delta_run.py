"""Real run on CPU: delta updates against full ones, after real AdamW steps, in one run.

``python -m benchmark.weight_sync.delta_run [--json]`` makes a Qwen2-shaped checkpoint
(``MODEL``), starts one bf16 SGLang HTTP server of TP 2 on CPU (a process tree of its own)
and four FSDP2 fp32 trainer ranks (gloo), which train it (AdamW on a next-token loss over
random token ids, ``STEPS`` steps at each learning rate of ``LRS``) and after every step
update the server twice through two weight-sync groups: a full update
(``RemoteSync(delta=False)``) and a delta update (``RemoteSync(delta=True)``); both write
the same values. Reported per step: the density of the change after the bf16 cast, bytes
on the wire of each, seconds of each (trainer rank 0's wall time), the trainer's encoding
and the engine's decoding. The machine is shared: only what one run measures side by side
compares.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

# its preamble: the tests' helpers on the path, the CPU engine's environment
import benchmark.weight_sync.remote_run  # noqa: F401

MODEL = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_hidden_layers=4,
    vocab_size=8000,
)
LRS = (1e-6, 1e-5)
STEPS = 20
TP = 2


def run() -> dict:
    import tiny_models
    from delta_cases import delta_bench_job
    from ports import free_port
    from ranks import run_ranks
    from servers import http_server

    with tempfile.TemporaryDirectory(prefix="delta_run_") as tmp:
        model_dir, _ = tiny_models.make_tiny_model(
            "qwen2", Path(tmp) / "model", **MODEL
        )
        with http_server(model_dir, TP, log_dir=tmp) as server:
            job = dict(
                urls=[server.url],
                ports=[free_port(), free_port()],
                model_dir=str(model_dir),
                lrs=list(LRS),
                steps=STEPS,
                bucket=64 << 20,
                timeout=300,
                digest_every=8,
            )
            rows = run_ranks(4, delta_bench_job, job, timeout=3600)[0]
    for row in rows:
        for mode in ("full", "delta"):
            assert row[mode]["success"], row[mode]["message"]
    summary = {}
    for lr in LRS:
        mine = [r for r in rows if r["lr"] == lr]
        summary[str(lr)] = {
            "density_median": statistics.median(
                r["delta"]["delta"]["density"] for r in mine
            ),
            "wire_fraction_median": statistics.median(
                r["delta"]["bytes_sent"] / r["full"]["bytes_sent"] for r in mine
            ),
            "full_seconds_median": statistics.median(
                r["full"]["seconds"] for r in mine
            ),
            "delta_seconds_median": statistics.median(
                r["delta"]["seconds"] for r in mine
            ),
            "encode_seconds_median": statistics.median(
                max(r["delta"]["delta"]["encode_seconds"]) for r in mine
            ),
            "decode_seconds_median": statistics.median(
                r["delta"]["decode_seconds"] for r in mine
            ),
        }
    return {
        "model": MODEL,
        "trainer_ranks": 4,
        "server": f"1 x TP{TP} (bf16, CPU)",
        "rows": rows,
        "summary": summary,
    }


def main() -> int:
    result = run()
    if "--json" in sys.argv:
        json.dump(result, sys.stdout, indent=1)
        return 0
    print(
        f"Qwen2-shaped {MODEL}, 4 FSDP2 fp32 trainer ranks (AdamW) -> {result['server']}\n"
        "| lr | step | density | full: bytes, s | delta: bytes (% of full), s | encode s | decode s |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in result["rows"]:
        full, delta = r["full"], r["delta"]
        print(
            f"| {r['lr']:g} | {r['step']} | {delta['delta']['density']:.4f} | "
            f"{full['bytes_sent']}, {full['seconds']:.3f} | {delta['bytes_sent']} "
            f"({100 * delta['bytes_sent'] / full['bytes_sent']:.2f}%), {delta['seconds']:.3f} | "
            f"{max(delta['delta']['encode_seconds']):.4f} | {delta['decode_seconds']:.4f} |"
        )
    for lr, s in result["summary"].items():
        print(f"lr {lr}: " + ", ".join(f"{k} {v:.4g}" for k, v in s.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
