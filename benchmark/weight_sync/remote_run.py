"""Real run on CPU: trainer ranks update remote SGLang servers through the weight-sync group,
against upstream's broadcast path on the same servers, in one run.

``python -m benchmark.weight_sync.remote_run [--json]`` makes a Qwen2-shaped checkpoint
(``MODEL``), starts two bf16 SGLang HTTP servers of TP 2 on CPU, each in a process tree of
its own (``test/support/servers.py``), and four FSDP2 fp32 trainer ranks (gloo), which:

* ``weight-sync group``: join once, then ``UPDATES`` updates (``remote.trainer.RemoteSync``:
  every trainer rank sends its own regions, cast to bf16, straight to the engine ranks; the
  servers receive while serving and write in a pause). The first update also hears the
  trainer's layout and plans; it is reported apart.
* ``rank-0 broadcast`` (upstream: ``init_weights_update_group`` +
  ``update_weights_from_distributed``, ``BROADCASTS`` times): every trainer rank takes part
  in ``full_tensor()`` of every tensor, rank 0 broadcasts each one, cast to bf16, to every
  engine rank, which receives it whole; the servers hold the writer lock for all of it.

Reported: seconds per update (median, and the first), bytes sent per trainer rank, bytes
received per engine rank (and the lower bound), the pause (the time the server's writer
lock was held or waited for) and the time spent receiving while serving. Every engine
rank's received bytes must equal its lower bound. The machine is shared: only what one run
measures side by side compares.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("PYTHONWARNINGS", "ignore")
warnings.simplefilter("ignore")
TEST = Path(__file__).resolve().parents[2] / "test"
sys.path[:0] = [str(TEST / "support"), str(TEST / "e2e")]

from engine import configure_cpu_env  # noqa: E402

configure_cpu_env()

MODEL = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=4,
    num_hidden_layers=4,
    vocab_size=32000,
)
UPDATES = 4
BROADCASTS = 2
TP = 2


def run() -> dict:
    import tiny_models
    from ports import free_port
    from ranks import run_ranks
    from remote_cases import fsdp_trainer_job
    from servers import http_server

    with tempfile.TemporaryDirectory(prefix="remote_run_") as tmp:
        model_dir, _ = tiny_models.make_tiny_model(
            "qwen2", Path(tmp) / "model", **MODEL
        )
        with (
            http_server(model_dir, TP, log_dir=tmp) as a,
            http_server(model_dir, TP, log_dir=tmp) as b,
        ):
            job = dict(
                group="bench",
                port=free_port(),
                urls=[a.url, b.url],
                model_dir=str(model_dir),
                tp=TP,
                seeds=list(range(1, UPDATES + 1)),
                broadcast_seeds=list(range(100, 100 + BROADCASTS)),
                broadcast_ports=[free_port() for _ in range(BROADCASTS)],
                bucket=64 << 20,
                timeout=300,
                prompts=[[1, 2, 3, 4]],
            )
            first = run_ranks(4, fsdp_trainer_job, job, timeout=1800)[0]
    ours = first["ours"]
    for report in ours:
        assert report["success"], report["message"]
        for reply in report["engines"].values():
            assert reply["bytes_received"] == reply["lower_bound_bytes"], reply
    steady = ours[1:]
    engines = [list(r["engines"].values()) for r in steady]
    casts = first["broadcasts"]
    return {
        "model": MODEL,
        "trainer_ranks": 4,
        "servers": f"2 x TP{TP} (bf16, CPU)",
        "weight_sync_group": {
            "seconds_median": statistics.median(r["seconds"] for r in steady),
            "seconds_first_update": ours[0]["seconds"],
            "join_seconds": first["join_s"],
            "bytes_sent_per_trainer_rank": ours[-1]["bytes_sent"],
            "bytes_received_per_engine_rank": [
                e["bytes_received"] for e in ours[-1]["engines"].values()
            ],
            "lower_bound_per_engine_rank": [
                e["lower_bound_bytes"] for e in ours[-1]["engines"].values()
            ],
            "pause_seconds_median": statistics.median(
                e["pause_seconds"] for es in engines for e in es
            ),
            # the schedulers' own writing in the pause (slowest TP rank): the rest of the
            # pause is the lock, the steps' round trips and the refresh
            "apply_seconds_median": statistics.median(
                max(e["apply_us"]) / 1e6 for es in engines for e in es
            ),
            "receive_seconds_median": statistics.median(
                e["receive_seconds"] for es in engines for e in es
            ),
        },
        "rank0_broadcast": {
            "seconds_median": statistics.median(
                c["gather_s"] + c["update_s"] for c in casts
            ),
            "gather_seconds_median": statistics.median(c["gather_s"] for c in casts),
            "broadcast_seconds_median": statistics.median(c["update_s"] for c in casts),
            "bytes_sent_by_rank0_at_least": casts[-1]["sent_by_rank0"],
            "bytes_received_per_engine_rank": casts[-1]["received_per_engine_rank"],
            "pause_seconds": "the whole update_weights_from_distributed (writer lock held)",
        },
    }


def main() -> int:
    result = run()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=1))
        return 0
    ours, cast = result["weight_sync_group"], result["rank0_broadcast"]
    print(
        f"Qwen2-shaped {MODEL}, 4 FSDP2 fp32 trainer ranks -> {result['servers']} (CPU, gloo over loopback)\n"
        f"| design | seconds per update (median) | bytes sent per trainer rank | bytes received per engine rank | pause |\n"
        f"|---|---|---|---|---|\n"
        f"| weight-sync group | {ours['seconds_median']:.3f} (first {ours['seconds_first_update']:.3f}, join "
        f"{ours['join_seconds']:.2f}) | {ours['bytes_sent_per_trainer_rank']} | "
        f"{ours['bytes_received_per_engine_rank']} (= lower bound) | {ours['pause_seconds_median']:.3f} s "
        f"(writing {ours['apply_seconds_median']:.3f} s; receiving while serving {ours['receive_seconds_median']:.3f} s) |\n"
        f"| rank-0 broadcast | {cast['seconds_median']:.3f} (gather {cast['gather_seconds_median']:.3f} + "
        f"broadcast {cast['broadcast_seconds_median']:.3f}) | rank 0: >= {cast['bytes_sent_by_rank0_at_least']}, "
        f"others 0 (after the gather) | {cast['bytes_received_per_engine_rank']} each | the whole broadcast |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
