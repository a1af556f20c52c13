"""The delta codec's speed on this machine: encoding and decoding one bf16 region at each
density, with each kind forced, against its bytes.

``python -m benchmark.weight_sync.delta_codec_speed [--json]``: a region of ``NUMEL`` bf16
elements (one large projection's shard), ``REPEATS`` runs each (median). Reported per
density and kind: payload bytes (% of the region), encode and decode seconds, and the
kind the codec picks. What it shows: where indices stop beating a bitmask in
time as well as in bytes, and how the codec's cost compares with the wire it saves.

``--moe [--json]``: a MoE model's count instead: ``MOE_REGIONS`` bf16 regions of
``MOE_NUMEL`` elements (Qwen3-30B-A3B's 18,867 tensors at the sizes of
``qwen3_30b_a3b_count``'s experts), encoded in one ``encode_many`` and decoded in one
``decode_many`` against one region at a time (``encode``, ``decode_into``) in the same run,
at each of ``MOE_DENSITIES``: the per-region cost a delta update pays at that count.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

NUMEL = 16 << 20
REPEATS = 5
DENSITIES = (0.0, 0.001, 0.01, 0.02, 1 / 32, 0.05, 0.1, 0.3, 1.0)
MOE_REGIONS = 18867
MOE_NUMEL = 64 * 64
MOE_DENSITIES = (0.001, 0.01)


def _time(fn) -> float:
    seconds = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def run() -> dict:
    from sglang.srt.weight_sync.delta_codec import (
        Kind,
        bits_of,
        decode_into,
        encode,
    )

    torch.manual_seed(0)
    old = torch.randn(NUMEL).to(torch.bfloat16)
    rows = []
    for density in DENSITIES:
        new = old.clone()
        pick = torch.rand(NUMEL) < density
        bits_of(new)[pick] ^= 1  # one ulp-sized change
        changed = int(pick.sum())
        chosen = encode(old, new).kind.name
        for kind in (Kind.GAPS, Kind.INDICES, Kind.BITMASK, Kind.FULL):
            if changed == 0 and kind != Kind.FULL:
                continue
            enc = encode(old, new, kind)
            dest = old.clone()
            encode_s = _time(lambda: encode(old, new, kind))
            decode_s = _time(lambda: decode_into(enc, dest.copy_(old)))
            rows.append(
                dict(
                    density=density,
                    kind=kind.name,
                    chosen=chosen,
                    bytes=enc.nbytes,
                    fraction=enc.nbytes / (2 * NUMEL),
                    encode_s=encode_s,
                    decode_s=decode_s,
                )
            )
    return {
        "numel": NUMEL,
        "dtype": "bfloat16",
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def run_moe() -> dict:
    from sglang.srt.weight_sync.delta_codec import (
        bits_of,
        decode_into,
        decode_many,
        encode,
        encode_many,
    )

    g = torch.Generator().manual_seed(0)
    olds = [
        torch.randn(MOE_NUMEL, generator=g).to(torch.bfloat16)
        for _ in range(MOE_REGIONS)
    ]
    rows = []
    for density in MOE_DENSITIES:
        news = []
        for old in olds:
            new = old.clone()
            bits_of(new)[torch.rand(MOE_NUMEL, generator=g) < density] ^= 1
            news.append(new)
        pairs = list(zip(olds, news))
        t0 = time.perf_counter()
        batch = encode_many(pairs)
        together_encode = time.perf_counter() - t0
        t0 = time.perf_counter()
        got, errors = decode_many(batch, olds)
        together_decode = time.perf_counter() - t0
        t0 = time.perf_counter()
        alone = [encode(old, new) for old, new in pairs]
        alone_encode = time.perf_counter() - t0
        t0 = time.perf_counter()
        for enc, old in zip(alone, olds):
            decode_into(enc, old.clone())
        alone_decode = time.perf_counter() - t0
        assert not any(errors) and all(
            torch.equal(bits_of(a), bits_of(b)) for a, b in zip(got, news)
        )
        assert all(torch.equal(a.payload, b.payload) for a, b in zip(batch, alone))
        rows.append(
            dict(
                density=density,
                wire_bytes=sum(e.nbytes for e in batch),
                together_encode_s=together_encode,
                together_decode_s=together_decode,
                alone_encode_s=alone_encode,
                alone_decode_s=alone_decode,
            )
        )
    return {
        "regions": MOE_REGIONS,
        "numel": MOE_NUMEL,
        "dtype": "bfloat16",
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--moe" in argv:
        out = run_moe()
        if "--json" in argv:
            sys.stdout.write(json.dumps(out, indent=1) + "\n")
            return 0
        print(
            f"{out['regions']} bf16 regions of {out['numel']} elements, "
            f"{out['threads']} threads\n| density | bytes | encode_many s | one by one s "
            "| decode_many s | one by one s |\n|---|---|---|---|---|---|"
        )
        for r in out["rows"]:
            print(
                f"| {r['density']:.4f} | {r['wire_bytes']} | {r['together_encode_s']:.3f} "
                f"| {r['alone_encode_s']:.3f} | {r['together_decode_s']:.3f} "
                f"| {r['alone_decode_s']:.3f} |"
            )
        return 0
    out = run()
    if argv == ["--json"]:
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
        return 0
    result = out
    print(
        f"one bf16 region of {result['numel']} elements, {result['threads']} threads\n"
        "| density | kind (chosen) | bytes (% of region) | encode s | decode s |\n|---|---|---|---|---|"
    )
    for r in result["rows"]:
        mark = " (chosen)" if r["kind"] == r["chosen"] else ""
        print(
            f"| {r['density']:.4f} | {r['kind']}{mark} | {r['bytes']} ({100 * r['fraction']:.2f}%) | "
            f"{r['encode_s']:.4f} | {r['decode_s']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
