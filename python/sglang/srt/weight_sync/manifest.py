"""The engine's published layout: what every TP rank of one engine needs, for the trainer.

Trainer-side resharding plans straight to the engine's own parameters, so the
trainer must know, per engine TP rank, the ``ParamTarget`` pieces, dtypes and
the parallel layout, without ever reading the model config. The engine writes
them once per channel (on a "describe" request) as a small JSON file,
builtins only (no pickle), versioned, written atomically, with a fingerprint of
its content. Every later trainer-side update carries that fingerprint and the
engine refuses it if its own layout no longer matches, so a stale manifest can
never write the wrong bytes.

Encoding is generic over the allow-listed dataclasses (``ParamTarget``,
``Piece``, ``Box``), so new fields on them travel without a format change.
Version 2 adds ``block_fp8``: the engine's block-FP8 weights (the same names on every TP
rank, each staged in its target's dtype) and their block size, so that a sender can quantize
the blocks it holds whole (``fp8_sender``); absent from an engine without one, whose
fingerprint is then what version 1 gave.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.phase_timing import collector_paused
from sglang.srt.weight_sync.target_layout import (
    EngineParallel,
    ModelTargets,
    ParamTarget,
    Piece,
)

__all__ = (
    "EngineManifest",
    "MANIFEST_VERSION",
    "ManifestError",
    "fingerprint_int",
    "manifest_path",
    "read_manifest",
    "targets_by_trainer_rank",
    "write_manifest",
)

MANIFEST_VERSION = 2
MAX_BLOCK = 1 << 16  # the largest block side a manifest may name
_TYPES = {cls.__name__: cls for cls in (ParamTarget, Piece, Box)}


class ManifestError(ValueError):
    """A manifest that is missing, of another version, or does not match its fingerprint."""


@dataclass(frozen=True)
class EngineManifest:
    """One engine's whole target description: ``ranks[r]`` is what TP rank r needs."""

    parallel: EngineParallel
    ranks: Tuple[Tuple[ParamTarget, ...], ...]
    aliases: Mapping[str, str]
    tensor_shapes: Mapping[str, Tuple[int, ...]]
    fingerprint: str = ""
    # block-FP8 weight -> its (rows, columns) block: staged in the targets' dtype, quantized
    # into e4m3 and float32 ``weight_scale_inv`` where each block's elements meet
    block_fp8: Mapping[str, Tuple[int, int]] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(
        targets: ModelTargets,
        block_fp8: Optional[Mapping[str, Tuple[int, int]]] = None,
    ) -> EngineManifest:
        ranks = [targets.for_rank(r) for r in range(targets.parallel.tp_size)]
        return EngineManifest.of_ranks(
            targets.parallel, ranks, targets.aliases, targets.tensor_shapes(), block_fp8
        )

    @staticmethod
    def of_ranks(
        parallel: EngineParallel,
        ranks,
        aliases: Mapping[str, str],
        tensor_shapes: Mapping[str, Tuple[int, ...]],
        block_fp8: Optional[Mapping[str, Tuple[int, int]]] = None,
    ) -> EngineManifest:
        """From every TP rank's targets as the engine holds them (dtype overrides applied)."""
        m = EngineManifest(
            parallel,
            tuple(tuple(r) for r in ranks),
            dict(aliases),
            dict(tensor_shapes),
            block_fp8={n: tuple(b) for n, b in (block_fp8 or {}).items()},
        )
        with collector_paused():
            return dataclasses.replace(m, fingerprint=_digest(m._body()))

    def _body(self) -> dict:
        p = self.parallel
        body = {
            "parallel": [p.tp_size, p.attn_tp_size, p.moe_ep_size],
            "ranks": [[_encode(t) for t in rank] for rank in self.ranks],
            "aliases": dict(sorted(self.aliases.items())),
            "tensor_shapes": {
                n: list(s) for n, s in sorted(self.tensor_shapes.items())
            },
        }
        if self.block_fp8:
            body["block_fp8"] = {n: list(b) for n, b in sorted(self.block_fp8.items())}
        return body

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": MANIFEST_VERSION,
                "fingerprint": self.fingerprint,
                **self._body(),
            }
        )

    @staticmethod
    def from_json(text: str) -> EngineManifest:
        with collector_paused():
            return EngineManifest._from_json(text)

    @staticmethod
    def _from_json(text: str) -> EngineManifest:
        data = json.loads(text)
        if data.get("version") != MANIFEST_VERSION:
            raise ManifestError(
                f"manifest version {data.get('version')!r}, this trainer reads {MANIFEST_VERSION}"
            )
        body = {k: data[k] for k in ("parallel", "ranks", "aliases", "tensor_shapes")}
        if "block_fp8" in data:
            body["block_fp8"] = data["block_fp8"]
        if _digest(body) != data["fingerprint"]:
            raise ManifestError(
                "manifest content does not match its fingerprint (partial or corrupted file)"
            )
        tp, attn, ep = body["parallel"]
        return EngineManifest(
            EngineParallel(tp, attn, ep),
            tuple(tuple(_decode(t) for t in rank) for rank in body["ranks"]),
            dict(body["aliases"]),
            {n: tuple(s) for n, s in body["tensor_shapes"].items()},
            data["fingerprint"],
            _blocks(body.get("block_fp8", {})),
        )


def _blocks(raw) -> Dict[str, Tuple[int, int]]:
    """The ``block_fp8`` entry read back: weight name -> two block sides in 1..MAX_BLOCK."""
    if not isinstance(raw, dict):
        raise ManifestError(f"block_fp8 is a {type(raw).__name__}, expected a mapping")
    out = {}
    for name, block in raw.items():
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(type(b) is int and 0 < b <= MAX_BLOCK for b in block)
        ):
            raise ManifestError(
                f"block_fp8 {name!r}: block {block!r}, expected two sides in 1..{MAX_BLOCK}"
            )
        out[name] = (block[0], block[1])
    return out


def manifest_path(channel: str, engine_rank: int) -> str:
    return os.path.join(channel, f"tp{engine_rank}.manifest.json")


def write_manifest(channel: str, engine_rank: int, manifest: EngineManifest) -> str:
    """Write atomically (temporary file, then rename): a reader sees all of it or nothing."""
    path = manifest_path(channel, engine_rank)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
    os.replace(tmp, path)
    return path


def read_manifest(channel: str, engine_rank: int) -> EngineManifest:
    path = manifest_path(channel, engine_rank)
    try:
        with open(path) as f:
            return EngineManifest.from_json(f.read())
    except FileNotFoundError:
        raise ManifestError(
            f"engine rank {engine_rank} published no manifest at {path}"
        ) from None


def fingerprint_int(fingerprint: str) -> int:
    """The fingerprint as a positive int64, for a tiny all-reduce that checks agreement."""
    return int(fingerprint[:15], 16) if fingerprint else 0


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _encode(value):
    """Builtins for the allow-listed dataclasses, tuples and scalars (by exact type first:
    a TP-256 engine's manifest holds millions of values)."""
    cls = type(value)
    if cls is int or cls is str or value is None:
        return value
    if cls is tuple or cls is list:
        return [v if type(v) is int else _encode(v) for v in value]
    names = _field_names(cls)
    if names:
        return {"type": cls.__name__, **{n: _encode(getattr(value, n)) for n in names}}
    if isinstance(value, torch.dtype):
        return {"torch_dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, (int, str, float, bool)):
        return value
    raise TypeError(f"cannot put {cls.__name__} in a manifest")


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> Tuple[str, ...]:
    return (
        tuple(f.name for f in dataclasses.fields(cls))
        if dataclasses.is_dataclass(cls)
        else ()
    )


def _decode(value):
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    if isinstance(value, dict):
        if "torch_dtype" in value:
            dt = getattr(torch, value["torch_dtype"], None)
            if not isinstance(dt, torch.dtype):
                raise ManifestError(
                    f"unknown dtype {value['torch_dtype']!r} in manifest"
                )
            return dt
        cls = _TYPES.get(value.get("type"))
        if cls is None:
            raise ManifestError(f"unknown type {value.get('type')!r} in manifest")
        return cls(**{k: _decode(v) for k, v in value.items() if k != "type"})
    return value


def targets_by_trainer_rank(
    manifest: EngineManifest, engine_groups
) -> Dict[int, List[ParamTarget]]:
    """Trainer rank -> the targets of the engine rank beside it (every engine has this layout)."""
    out: Dict[int, List[ParamTarget]] = {}
    for group in engine_groups:
        if len(group) != manifest.parallel.tp_size:
            raise ManifestError(
                f"an engine group of {len(group)} trainer ranks, but the engine publishes TP {manifest.parallel.tp_size}"
            )
        for engine_rank, trainer_rank in enumerate(group):
            out[trainer_rank] = list(manifest.ranks[engine_rank])
    return out
