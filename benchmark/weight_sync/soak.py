"""Soak: many distributed weight updates in a row, then updates under generation load.

``python -m benchmark.weight_sync.soak [--updates 1000] [--loaded 100] [--every 100]
[--moe]`` starts a real TP-2 SGLang engine on CPU (tiny Qwen2; ``--moe``: Qwen3-30B-A3B's
tensor count, ``qwen3_30b_a3b_count``) and, acting as both trainer ranks,
delivers full shards to each engine rank and asks for the update, ``--updates`` times
in a row; every ``--every`` updates it records the engine processes' RSS and open file
descriptors, this process's, the files in ``/dev/shm``, and the payload segments
(memfd descriptors and mappings, ``shared_segment``) any of these processes still holds. Then ``--loaded`` updates
run while generation requests (``--concurrency`` at a time) are in flight; each
generation must finish and, after the last update, greedy output must equal a fresh
generation of the final weights. Prints a table and writes JSON (``--out``). Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[2] / "test" / "support"
sys.path.insert(0, str(SUPPORT))
sys.path.insert(0, str(SUPPORT.parent / "reliability"))
sys.path.insert(0, str(SUPPORT.parent / "e2e"))

from engine import configure_cpu_env  # noqa: E402

configure_cpu_env()


def _segments(pid: int) -> int:
    """Payload segments (``shared_segment``'s memfds) process ``pid`` still holds: its
    descriptors of one and its mappings of one."""
    held = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                held += SEGMENT_NAME in os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                pass
        with open(f"/proc/{pid}/maps") as maps:
            held += sum(SEGMENT_NAME in line for line in maps)
    except OSError:
        pass
    return held


# how /proc names a segment's descriptor and mapping
SEGMENT_NAME = "memfd:sglang-weights"


def _sample(step: int) -> dict:
    import psutil

    procs = psutil.Process().children(recursive=True)
    rss = fds = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
        except psutil.Error:
            pass
    me = psutil.Process()
    return dict(
        update=step,
        engine_rss_mib=round(rss / 2**20, 1),
        engine_fds=fds,
        own_rss_mib=round(me.memory_info().rss / 2**20, 1),
        own_fds=me.num_fds(),
        dev_shm_files=len(os.listdir("/dev/shm")),
        segments=sum(_segments(p.pid) for p in [me, *procs]),
    )


async def _loaded(eng, channel, shards_of, updates, concurrency, prompts, max_new):
    """``updates`` updates while ``concurrency`` generations are always in flight."""
    from faults import generate_async, update_async

    tm = eng.tokenizer_manager
    stop, done, failed = False, 0, []

    async def load(i):
        nonlocal done
        while not stop:
            out = await generate_async(tm, prompts[i % len(prompts)], max_new)
            if out is None or len(out["output_ids"]) != max_new:
                failed.append(out)
            done += 1

    workers = [asyncio.create_task(load(i)) for i in range(concurrency)]
    times = []
    for u in range(updates):
        start = time.monotonic()
        success, message = await update_async(
            eng, channel, f"loaded-{u}", shards_of(u), timeout_s=60
        )
        times.append(time.monotonic() - start)
        assert success, message
    stop = True
    await asyncio.gather(*workers)
    return dict(
        updates=updates,
        generations=done,
        bad_generations=len(failed),
        update_s_median=round(sorted(times)[len(times) // 2], 4),
        update_s_max=round(max(times), 4),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--loaded", type=int, default=100)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--out", default="soak.json")
    args = parser.parse_args()

    import tiny_models
    from engine import cpu_engine
    from faults import TP, full_shards, generate_async, update_async
    from update_cases import new_weights

    from sglang.srt.weight_sync.protocol import make_channel

    kind = "qwen3_30b_a3b_count" if args.moe else "qwen2"
    model_dir, _ = tiny_models.make_tiny_model(kind, Path(tempfile.mkdtemp()) / kind)
    weight_sets = [full_shards(new_weights(model_dir, seed)) for seed in (1, 2)]
    prompts = [[5, 17, 42, 7], [300, 2, 9, 11], [77, 1, 3, 120]]
    samples, result = [], {"model": kind}
    with cpu_engine(model_dir, tp_size=TP) as eng:
        channel = make_channel()
        samples.append(_sample(0))
        start = time.monotonic()
        for u in range(1, args.updates + 1):
            success, message = eng.loop.run_until_complete(
                update_async(
                    eng, channel, f"soak-{u}", [weight_sets[u % 2]] * TP, timeout_s=60
                )
            )
            assert success, f"update {u}: {message}"
            if u % args.every == 0:
                samples.append(_sample(u))
                Path(args.out).write_text(
                    json.dumps(dict(result, samples=samples), indent=1)
                )  # partial
                print(f"{u} updates, {time.monotonic() - start:.0f}s", file=sys.stderr)
        result["sequential_s_per_update"] = round(
            (time.monotonic() - start) / max(args.updates, 1), 4
        )
        loaded = eng.loop.run_until_complete(
            _loaded(
                eng,
                channel,
                lambda u: [weight_sets[u % 2]] * TP,
                args.loaded,
                args.concurrency,
                prompts,
                8,
            )
        )
        final = weight_sets[(args.loaded - 1) % 2]
        after = [
            eng.loop.run_until_complete(generate_async(eng.tokenizer_manager, p, 8))[
                "output_ids"
            ]
            for p in prompts
        ]
        # the same weights again, through a fresh update with nothing in flight: output must not change
        assert eng.loop.run_until_complete(
            update_async(eng, channel, "final", [final] * TP, timeout_s=60)
        )[0]
        again = [
            eng.loop.run_until_complete(generate_async(eng.tokenizer_manager, p, 8))[
                "output_ids"
            ]
            for p in prompts
        ]
        loaded["output_after_equals_final_model"] = after == again
        result["loaded"] = loaded
        samples.append(_sample(args.updates + args.loaded + 1))
    result["samples"] = samples
    print(
        f"{'update':>7} {'engine RSS MiB':>15} {'engine fds':>11} {'own RSS MiB':>12} {'own fds':>8} "
        f"{'/dev/shm':>9} {'segments':>9}"
    )
    for s in samples:
        print(
            f"{s['update']:>7} {s['engine_rss_mib']:>15} {s['engine_fds']:>11} {s['own_rss_mib']:>12} "
            f"{s['own_fds']:>8} {s['dev_shm_files']:>9} {s['segments']:>9}"
        )
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
