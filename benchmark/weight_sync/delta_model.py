"""The disaggregated scenarios with delta updates: modelled, at measured densities.

``python -m benchmark.weight_sync.delta_model [--json] [--engines-planned N]`` plans the
remote scenarios of ``disaggregated`` (every engine rank receives its parameters' bytes;
the busiest trainer rank's bytes from the senders the plans name) and models a delta
update of each at the densities of ``DENSITIES``: the fraction of a full update's bytes
that crosses the wire is what ``delta_codec`` encodes for a bf16 region of
``REGION_ELEMENTS`` elements whose changed positions are spread at random (record headers
not counted: a few bytes per region), and the modelled seconds are the full update's
bandwidth-only model (``max(sent, received) / NETWORK_BYTES_PER_S``) on those bytes.
Encoding and decoding are not modelled (on GPUs they read the snapshot and the new values
at memory speed; the snapshot in host memory, the default, adds a PCIe read of the
trainer rank's shard). Every figure is *modelled*, none measured; the published figures of
other systems (``PUBLISHED``) are quoted beside them for scale.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from benchmark.weight_sync.disaggregated import SCENARIOS, run, scenario_args
from benchmark.weight_sync.simulate import NETWORK_BYTES_PER_S
from sglang.srt.weight_sync.delta_codec import bits_of, encode

REGION_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Density:
    label: str
    density: float  # the fraction of elements whose bf16 bits change in one update


# the densities modelled: the medians measured by ``delta_run`` (docs/results.md, "Delta
# updates"), and the top of the range slime #1806 reports for GLM-4.7-355B
DENSITIES = (
    Density("lr 1e-6, measured (delta_run median)", 0.00077),
    Density("lr 1e-5, measured (delta_run median)", 0.0054),
    Density("3%, slime #1806's published range (2-3%)", 0.03),
)

# published per-update figures of delta updates elsewhere (other models and systems)
PUBLISHED = (
    "PULSE (arXiv 2602.03839): 14 GB -> ~108 MB per step (0.77%)",
    "slime #1806: GLM-4.7-355B to 64 rollout H100s, ~170 GB -> ~5.9 GB per update (3.5%)",
    "Fireworks: >98% bit-equal, 94% less traffic across clusters",
)


def wire_fraction(density: float, numel: int = REGION_ELEMENTS, seed: int = 0) -> float:
    """The bytes ``delta_codec`` encodes for a bf16 region of ``numel`` elements, a random
    ``density`` of them changed, as a fraction of the region's bytes."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(numel, generator=g).to(torch.bfloat16)
    new = old.clone()
    bits_of(new)[torch.rand(numel, generator=g) < density] ^= 1
    enc = encode(old, new)
    return enc.nbytes / enc.full_bytes


def model_rows(
    scenarios=SCENARIOS, engines_planned: Optional[int] = None
) -> List[Dict]:
    """Every scenario's full update (``disaggregated.run``) and its delta at each density."""
    fractions = {d.label: wire_fraction(d.density) for d in DENSITIES}
    rows = []
    for scenario in scenarios:
        full = run(scenario, engines_planned=engines_planned)
        busiest = max(
            full["sent_per_trainer_rank_max"], full["received_per_engine_rank_max"]
        )
        deltas = [
            {
                "label": d.label,
                "density": d.density,
                "wire_fraction": fractions[d.label],
                "received_per_engine_rank": full["received_per_engine_rank_max"]
                * fractions[d.label],
                "sent_per_trainer_rank_max": full["sent_per_trainer_rank_max"]
                * fractions[d.label],
                "modelled_seconds": busiest * fractions[d.label] / NETWORK_BYTES_PER_S,
            }
            for d in DENSITIES
        ]
        rows.append(dict(full, deltas=deltas))
    return rows


def format_table(rows: Sequence[Dict]) -> str:
    gb = 1e9
    out = [
        "| scenario | full update: per engine rank, modelled s | density (where from) | "
        "wire, % of full (codec, modelled) | delta: per engine rank, per trainer rank max | "
        "delta, modelled s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = (
            f"{r['model']}, {r['train']} -> {r['infer']}",
            f"{r['received_per_engine_rank_max'] / gb:,.1f} GB, {r['modelled_seconds']:.2f} s",
        )
        for i, d in enumerate(r["deltas"]):
            first = head if i == 0 else ("", "")
            out.append(
                f"| {first[0]} | {first[1]} | {d['density']:.3%} ({d['label']}) "
                f"| {d['wire_fraction']:.2%} | {d['received_per_engine_rank'] / gb:,.2f} GB, "
                f"{d['sent_per_trainer_rank_max'] / gb:,.2f} GB | {d['modelled_seconds']:.3f} s |"
            )
    return (
        "\n".join(out) + "\n\nPublished (measured elsewhere): " + "; ".join(PUBLISHED)
    )


def main(argv: Optional[List[str]] = None) -> int:
    args, chosen = scenario_args(argv, __doc__.split("\n")[0])
    rows = model_rows(chosen, args.engines_planned)
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
