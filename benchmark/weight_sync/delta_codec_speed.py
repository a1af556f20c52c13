"""The delta codec's speed on this machine: encoding and decoding one bf16 region at each
density, with each kind forced, against its bytes.

``python -m benchmark.weight_sync.delta_codec_speed [--json]``: a region of ``NUMEL`` bf16
elements (one large projection's shard), ``REPEATS`` runs each (median). Reported per
density and kind: payload bytes (% of the region), encode and decode seconds, and the
kind the codec picks. What it shows: where indices stop beating a bitmask in
time as well as in bytes, and how the codec's cost compares with the wire it saves.
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
