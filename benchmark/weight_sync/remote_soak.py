"""Soak of the remote path: many updates through one weight-sync group, resources sampled.

``python -m benchmark.weight_sync.remote_soak [--updates 1000] [--every 100] [--moe]
[--out remote_soak.json]`` starts one SGLang HTTP server of TP 2 on CPU and two FSDP2 fp32
trainer ranks that join it as a weight-sync group (``RemoteSync``) and update it
``--updates`` times, their parameters changed in place between updates as an optimizer
does. Every ``--every`` updates one more update carries a NaN in one tensor, which the
group must refuse before any byte moves, and the next must succeed. At each sample every
trainer rank records its RSS, open file descriptors, threads and the shared-memory files
(``/dev/shm``, memfds) it holds open or mapped, trainer rank 0 the same of the server (its
processes together) and the keys in the group's TCP store. ``--moe``: Qwen3-30B-A3B's tensor count (``qwen3_30b_a3b_count``, 18,867
tensors) instead of a tiny Qwen2.

After the last update every server rank's parameters must equal SGLang's own slicing of
the last weights (checksums). The run is *flat* when, from the sample after the first
``--every`` updates on, no count of descriptors, threads, shared-memory files or store
keys grew, and no process's last RSS is above the highest of the run's first half by more
than ``RSS_SLACK_MIB``; it exits 1 otherwise. Prints a table and writes JSON.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("PYTHONWARNINGS", "ignore")
warnings.simplefilter("ignore")
TEST = Path(__file__).resolve().parents[2] / "test"
sys.path[:0] = [str(TEST / "support"), str(TEST / "e2e")]

from engine import configure_cpu_env  # noqa: E402

configure_cpu_env()

TP = 2
# What a process's RSS may grow by between the first sample and the last without a leak
# being called: allocator arenas and caches settle within a few hundred updates.
RSS_SLACK_MIB = 64
COUNTS = ("fds", "threads", "shared")


def _shared(pid: int) -> set:
    """The shared-memory files and memfds process ``pid`` holds open or mapped."""
    held = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(("/dev/shm/", "/memfd:")):
                held.add(target)
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith(("/dev/shm/", "/memfd:")):
                    held.add(path[0].strip())
    except OSError:
        pass
    return held


def _usage(procs) -> dict:
    """RSS (MiB), descriptors, threads and shared-memory files of ``procs`` together."""
    import psutil

    rss = fds = threads = 0
    shared = set()
    for p in procs:
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
            threads += p.num_threads()
            shared |= _shared(p.pid)
        except psutil.Error:
            pass
    return dict(
        rss_mib=round(rss / 2**20, 1), fds=fds, threads=threads, shared=len(shared)
    )


def _sample(step: int, sync, server_pid: int) -> dict:
    """This trainer rank's usage; on rank 0 also the server's and the store's keys."""
    import psutil
    import torch.distributed as dist

    out = dict(update=step, trainer=_usage([psutil.Process()]))
    if dist.get_rank() == 0:
        server = psutil.Process(server_pid)
        out["server"] = _usage([server, *server.children(recursive=True)])
        out["store_keys"] = sync.store.num_keys()
    return out


def soak_trainer_job(rank: int, world: int, job: dict) -> dict:
    """Join the server, then the job's updates of the same FSDP2 parameters (changed in
    place before each, two weight sets taking turns), one refused update (a NaN) and its
    recovery every ``every``; samples at the start and every ``every`` updates."""
    import torch
    import torch.distributed as dist
    from remote_cases import group_of
    from torch.distributed.device_mesh import init_device_mesh
    from update_cases import as_layout, new_weights

    mesh = init_device_mesh("cpu", (world,))
    weights = [
        as_layout(new_weights(job["model_dir"], seed), "fsdp32", mesh)
        for seed in job["seeds"]
    ]
    # the trainer's own parameters, which each update's weights are copied into
    live = as_layout(new_weights(job["model_dir"], job["seeds"][0]), "fsdp32", mesh)
    sync = group_of(job)
    sync.join()
    samples, seconds, phases, refused = [], [], [], []

    def update(i: int) -> None:
        with torch.no_grad():
            for (_, t), (_, u) in zip(live, weights[i % 2]):
                t.to_local().copy_(u.to_local())
        start = time.perf_counter()
        report = sync.update(live, bucket_bytes=job["bucket"])
        seconds.append(time.perf_counter() - start)
        phases.append(report.phases)
        assert report.success, f"update {i}: {report.message}"

    update(0)
    samples.append(_sample(0, sync, job["server_pid"]))
    for i in range(1, job["updates"] + 1):
        update(i)
        if i % job["every"] == 0:
            poisoned = live[0][1].to_local().view(-1)
            kept = poisoned[0].item()
            if rank == 0:
                with torch.no_grad():
                    poisoned[0] = float("nan")
            report = sync.update(live, bucket_bytes=job["bucket"])
            with torch.no_grad():
                poisoned[0] = kept
            assert not report.success and "NaN" in report.message, report.message
            refused.append(report.message)
            update(i)  # the same weights again: the refusal left the old ones serving
            samples.append(_sample(i, sync, job["server_pid"]))
    dist.barrier()
    sync.close()
    return dict(samples=samples, seconds=seconds, phases=phases, refused=len(refused))


def _grew(samples) -> list:
    """What grew from the warm sample (the one after the first ``every`` updates: plans
    made, caches settled) on: any count, at any later sample; the RSS, when the last
    sample's is above the highest of the first half after warm-up by more than
    ``RSS_SLACK_MIB`` (a rank's RSS swings with its staging from sample to sample; a leak
    climbs through the run)."""
    warm, out = samples[min(1, len(samples) - 1)], []
    first_half = samples[1 : 2 + (len(samples) - 2) // 2]
    for s in samples[2:]:
        for who in ("trainer", "server"):
            if who in warm:
                out += [
                    f"{who} {k} {warm[who][k]} -> {s[who][k]} at {s['update']}"
                    for k in COUNTS
                    if s[who][k] > warm[who][k]
                ]
        if "store_keys" in warm and s["store_keys"] > warm["store_keys"]:
            out.append(f"store keys {warm['store_keys']} -> {s['store_keys']}")
    last = samples[-1]
    for who in ("trainer", "server"):
        if who in warm and len(samples) > 2:
            high = max(s[who]["rss_mib"] for s in first_half)
            if last[who]["rss_mib"] - high > RSS_SLACK_MIB:
                out.append(
                    f"{who} RSS {high} MiB (highest of the first half) -> "
                    f"{last[who]['rss_mib']} MiB at {last['update']}"
                )
    return out


def run(updates: int, every: int, moe: bool) -> dict:
    import statistics

    import tiny_models
    from ports import free_port
    from ranks import run_ranks
    from remote_cases import server_state
    from servers import http_server
    from update_cases import new_weights
    from update_checks import expected_checksums

    kind = "qwen3_30b_a3b_count" if moe else "qwen2"
    seeds = (1, 2)
    with tempfile.TemporaryDirectory(prefix="remote_soak_") as tmp:
        model_dir, config = tiny_models.make_tiny_model(kind, Path(tmp) / "model")
        with http_server(model_dir, TP, log_dir=tmp) as server:
            job = dict(
                group="soak",
                port=free_port(),
                urls=[server.url],
                server_pid=server.process.pid,
                model_dir=str(model_dir),
                seeds=list(seeds),
                updates=updates,
                every=every,
                bucket=64 << 20,
                timeout=300,
            )
            started = time.monotonic()
            results = run_ranks(2, soak_trainer_job, job, timeout=36000)
            wall = time.monotonic() - started
            (state,) = server_state([server.url], [[1, 2, 3, 4]])
        last = seeds[updates % 2]
        expected = expected_checksums(config, new_weights(model_dir, last), TP, 1)
    wrong = {
        r: sorted(n for n in expected[r] if state["checksums"][r][n] != expected[r][n])
        for r in range(TP)
    }
    samples = [
        dict(
            results[0]["samples"][k],
            trainers=[r["samples"][k]["trainer"] for r in results],
        )
        for k in range(len(results[0]["samples"]))
    ]
    grew = []
    for r, result in enumerate(results):
        grew += [f"trainer rank {r}: {g}" for g in _grew(result["samples"])]
    seconds = results[0]["seconds"]
    return dict(
        model=kind,
        updates=updates,
        refused_updates=results[0]["refused"],
        wall_seconds=round(wall, 1),
        seconds_per_update_median=round(statistics.median(seconds[1:]), 4),
        seconds_per_update_max=round(max(seconds[1:]), 4),
        # which update was the slowest (0: the first, which plans), and every update's
        seconds_max_at=max(range(1, len(seconds)), key=seconds.__getitem__),
        seconds=[round(x, 4) for x in seconds],
        # trainer rank 0's phases of each of those updates (``RemoteReport.phases``)
        phases=results[0]["phases"],
        last_weights_exact=not any(wrong.values()),
        wrong=dict((r, w[:5]) for r, w in wrong.items() if w),
        flat=not grew,
        grew=grew,
        rss_slack_mib=RSS_SLACK_MIB,
        samples=samples,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--out", default="remote_soak.json")
    args = parser.parse_args()
    result = run(args.updates, args.every, args.moe)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        "| update | server RSS MiB | fds | threads | shm | trainer RSS MiB (rank 0, 1) "
        "| fds | threads | shm | store keys |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for s in result["samples"]:
        e, t = s["server"], s["trainers"]
        mine = [", ".join(str(x[k]) for x in t) for k in ("rss_mib", *COUNTS)]
        print(
            f"| {s['update']} | {e['rss_mib']} | {e['fds']} | {e['threads']} | "
            f"{e['shared']} | {' | '.join(mine)} | {s['store_keys']} |"
        )
    shown = {
        k: v for k, v in result.items() if k not in ("samples", "seconds", "phases")
    }
    print(json.dumps(shown, indent=1))
    return 0 if result["flat"] and result["last_weights_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
