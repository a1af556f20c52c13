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

``--moe`` runs the same comparison at a MoE model's tensor count instead
(``MOE_UPDATES`` updates): the ``qwen3_30b_a3b_count`` checkpoint (Qwen3-30B-A3B's 18,867
tensors, 18,432 of them experts, at metadata-like sizes), two FSDP2 fp32 trainer ranks, one
server of TP 2. The trainer keeps its parameters and changes them in place between updates,
as an optimizer does. Reported besides: the CPU seconds each trainer rank and each engine
scheduler spent per update (``/proc``), and upstream's broadcast path once.
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
MOE_UPDATES = 8


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


def _scheduler_cpu_seconds(pgid: int) -> list:
    """CPU seconds so far of the server's SGLang scheduler processes (of process group
    ``pgid``; a scheduler's title starts ``sglang::scheduler``, of which the kernel keeps
    15 characters)."""
    out = []
    for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith("sglang::sched"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def moe_trainer_job(rank: int, world: int, job: dict) -> dict:
    """Join the server, then ``job["updates"]`` updates of the same FSDP2 parameters, their
    values changed in place before each (two weight sets taking turns); then upstream's
    broadcast path once. Per update: seconds, this rank's CPU seconds, the schedulers'."""
    import time

    import torch
    import torch.distributed as dist
    from ranks import gathers_allowed
    from remote_cases import group_of, upstream_broadcast
    from torch.distributed.device_mesh import init_device_mesh
    from update_cases import as_layout, new_weights

    mesh = init_device_mesh("cpu", (world,))
    weights = [
        as_layout(new_weights(job["model_dir"], seed), "fsdp32", mesh)
        for seed in (1, 2)
    ]
    # the trainer's own parameters, which each update's weights are copied into
    live = as_layout(new_weights(job["model_dir"], 1), "fsdp32", mesh)
    sync = group_of(job)
    sync.join()
    out = {"ours": [], "cpu": [], "engine_cpu": []}
    for i in range(job["updates"]):
        with torch.no_grad():
            for (_, t), (_, u) in zip(live, weights[i % 2]):
                t.to_local().copy_(u.to_local())
        dist.barrier()
        cpu, engines = time.process_time(), _scheduler_cpu_seconds(job["pgid"])
        report = sync.update(live, bucket_bytes=job["bucket"])
        out["cpu"].append(time.process_time() - cpu)
        out["engine_cpu"].append(
            [b - a for a, b in zip(engines, _scheduler_cpu_seconds(job["pgid"]))]
        )
        out["ours"].append(dict(report.__dict__))
    dist.barrier()
    sync.close()
    with gathers_allowed():
        out["broadcast"] = upstream_broadcast(rank, weights[1], job)
    dist.barrier()
    return out


def run_moe() -> dict:
    import tiny_models
    from ports import free_port
    from ranks import run_ranks
    from servers import http_server

    with tempfile.TemporaryDirectory(prefix="remote_run_moe_") as tmp:
        model_dir, _ = tiny_models.make_tiny_model(
            "qwen3_30b_a3b_count", Path(tmp) / "model"
        )
        with http_server(model_dir, TP, log_dir=tmp) as server:
            job = dict(
                group="bench-moe",
                port=free_port(),
                broadcast_port=free_port(),
                urls=[server.url],
                pgid=server.process.pid,
                model_dir=str(model_dir),
                tp=TP,
                updates=MOE_UPDATES,
                bucket=64 << 20,
                timeout=300,
            )
            results = run_ranks(2, moe_trainer_job, job, timeout=1800)
    first = results[0]
    ours = first["ours"]
    for report in ours:
        assert report["success"], report["message"]
        for reply in report["engines"].values():
            assert reply["bytes_received"] == reply["lower_bound_bytes"], reply
    steady = range(1, len(ours))
    replies = [list(ours[i]["engines"].values())[0] for i in steady]
    cast = first["broadcast"]
    median = statistics.median
    return {
        "model": "qwen3_30b_a3b_count (18,867 tensors, 18,432 experts)",
        "trainer_ranks": 2,
        "servers": f"1 x TP{TP} (bf16, CPU)",
        "weight_sync_group": {
            "seconds_median": median(ours[i]["seconds"] for i in steady),
            "seconds_max": max(ours[i]["seconds"] for i in steady),
            "seconds_first_update": ours[0]["seconds"],
            "pause_seconds_median": median(r["pause_seconds"] for r in replies),
            "apply_seconds_median": median(max(r["apply_us"]) / 1e6 for r in replies),
            "receive_seconds_median": median(r["receive_seconds"] for r in replies),
            "trainer_cpu_seconds_median": [
                median(r["cpu"][i] for i in steady) for r in results
            ],
            "engine_cpu_seconds_median": [
                median(first["engine_cpu"][i][k] for i in steady)
                for k in range(len(first["engine_cpu"][0]))
            ],
            "bytes_received_per_engine_rank": replies[-1]["bytes_received"],
            # trainer rank 0's phases of the last update
            "trainer_phases": ours[-1].get("phases", {}),
        },
        "rank0_broadcast": {
            "seconds": cast["gather_s"] + cast["update_s"],
            "gather_seconds": cast["gather_s"],
            "broadcast_seconds": cast["update_s"],
        },
    }


def main_moe() -> int:
    from sglang.srt.weight_sync.phase_timing import describe_phases

    result = run_moe()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=1))
        return 0
    ours, cast = result["weight_sync_group"], result["rank0_broadcast"]
    cpu = ", ".join(f"{c:.3f}" for c in ours["trainer_cpu_seconds_median"])
    ecpu = ", ".join(f"{c:.3f}" for c in ours["engine_cpu_seconds_median"])
    print(
        f"{result['model']}, 2 FSDP2 fp32 trainer ranks -> {result['servers']} (CPU, gloo over loopback)\n"
        f"| design | seconds per update | pause | CPU seconds per update |\n"
        f"|---|---|---|---|\n"
        f"| weight-sync group | {ours['seconds_median']:.3f} median, {ours['seconds_max']:.3f} max "
        f"(first {ours['seconds_first_update']:.3f}) | {ours['pause_seconds_median']:.3f} s (writing "
        f"{ours['apply_seconds_median']:.3f} s; receiving while serving "
        f"{ours['receive_seconds_median']:.3f} s) | trainer ranks {cpu}; engine schedulers {ecpu} |\n"
        f"| rank-0 broadcast | {cast['seconds']:.3f} (gather {cast['gather_seconds']:.3f} + broadcast "
        f"{cast['broadcast_seconds']:.3f}) | the whole broadcast | |\n"
        f"trainer rank 0, last update: {describe_phases(ours['trainer_phases'])}"
    )
    return 0


def main() -> int:
    if "--moe" in sys.argv:
        return main_moe()
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
