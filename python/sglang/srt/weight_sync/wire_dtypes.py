"""The dtype an engine keeps each checkpoint tensor in, so that a trainer casts once, early.

An fp32 trainer updating a bf16 engine casts every element once. The cheapest place is the
trainer's one copy of its shards into the payload's shared memory (``shared_segment``):
the payload is then half the bytes for the engine to map, check, move and copy. So each
engine rank writes, once per channel and layout, the dtype its parameters keep each HF
tensor in (only tensors whose every piece lands in one dtype, on every TP rank) as a small
JSON file in the private channel (``tp<r>.dtypes.json``, atomically), and the trainer rank
beside it reads it whenever it changes and casts while it copies a CPU shard to a smaller
dtype. A payload still names the dtype the trainer holds (its layout), so the engine sees
every cast and refuses one its parameters do not keep (``cast_problems``: a file left by an
engine before a restart, say): a cast never loses precision silently. CUDA payloads travel
as they are (CUDA IPC maps the trainer's own memory; casting would copy it on the GPU).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.target_layout import ParamTarget

__all__ = (
    "DtypeFile",
    "cast_problems",
    "dtypes_path",
    "engine_dtypes",
    "write_dtypes",
)

_MAX_FILE_BYTES = 64 << 20  # far above a real file (a name and a dtype per tensor)
_FLOATING = {
    str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
}


def dtypes_path(channel: str, engine_rank: int) -> str:
    return os.path.join(channel, f"tp{engine_rank}.dtypes.json")


def engine_dtypes(
    ranks: Sequence[Sequence[ParamTarget]], aliases: Mapping[str, str]
) -> Dict[str, torch.dtype]:
    """Per HF tensor (and each alias of one), the floating dtype every parameter it lands
    in keeps, over every TP rank's targets; a tensor that lands in several dtypes (or a
    non-floating one) is left out: the trainer sends it as it holds it."""
    seen: Dict[str, set] = {}
    for targets in ranks:
        for t in targets:
            for p in t.pieces:
                seen.setdefault(p.tensor, set()).add(t.dtype)
    out = {
        name: next(iter(dtypes))
        for name, dtypes in seen.items()
        if len(dtypes) == 1 and str(next(iter(dtypes))) in _FLOATING
    }
    out.update((a, out[n]) for a, n in aliases.items() if n in out)
    return out


def write_dtypes(
    channel: str, engine_rank: int, layout: str, dtypes: Mapping[str, torch.dtype]
) -> str:
    """Write the file atomically (temporary file, then rename): a reader sees all or nothing."""
    path = dtypes_path(channel, engine_rank)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(
            {
                "layout": layout,
                "dtypes": {n: str(d) for n, d in sorted(dtypes.items())},
            },
            f,
        )
    os.replace(tmp, path)
    return path


class DtypeFile:
    """The trainer side: the engine rank's file, read again only when it changed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: Optional[Tuple[int, int, int]] = None
        self._dtypes: Dict[str, torch.dtype] = {}

    def get(self) -> Dict[str, torch.dtype]:
        """Per HF tensor, the dtype to send it in; empty while the engine wrote none (or
        wrote what cannot be read: the trainer then sends what it holds)."""
        try:
            st = os.stat(self.path)
        except OSError:
            if self._stamp is not None:  # the same (empty) dict while there is no file
                self._stamp, self._dtypes = None, {}
            return self._dtypes
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._stamp, self._dtypes = stamp, self._read(st.st_size)
        return self._dtypes

    def forget(self) -> None:
        """Read the file again next time (after a refused update)."""
        self._stamp, self._dtypes = None, {}

    def _read(self, size: int) -> Dict[str, torch.dtype]:
        if size > _MAX_FILE_BYTES:
            return {}
        try:
            with open(self.path) as f:
                body = json.load(f)
            return {
                str(n): _FLOATING[d]
                for n, d in body["dtypes"].items()
                if isinstance(d, str) and d in _FLOATING
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}


def cast_problems(
    tensors: Mapping[str, torch.Tensor],
    held: Mapping[str, torch.dtype],
    kept: Mapping[str, torch.dtype],
    trainer_rank: int,
) -> List[str]:
    """A delivered tensor whose dtype differs from the one its trainer rank holds (``held``,
    from the payload's layouts) was cast by the trainer: refused unless the engine keeps
    it in exactly that dtype (``kept``, as ``engine_dtypes`` gives it)."""
    problems = []
    for name, t in tensors.items():
        dtype = held.get(name)
        if dtype is None or t.dtype == dtype:
            continue
        if kept.get(name) != t.dtype:
            problems.append(
                f"tensor {name!r}: trainer rank {trainer_rank} holds it in {dtype} and sent it "
                f"cast to {t.dtype}, but the engine keeps it in "
                f"{kept.get(name, 'several dtypes or none')} (refused: the trainer reads the "
                "engine's dtypes again for the next update)"
            )
    return problems
