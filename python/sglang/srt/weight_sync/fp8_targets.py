"""Describe: block-FP8 parameters as a transform of the trainer's BF16/FP32 tensors.

A block-FP8 engine (checkpoint ``quantization_config`` ``quant_method: fp8`` with
``weight_block_size``) keeps each quantized linear as ``P.weight`` (``float8_e4m3fn``) and
``P.weight_scale_inv`` (float32, one value per block). Neither is a copy of what a trainer
holds: both are computed, block by block, from the HF tensors' ``X.weight``. The pieces of
``P.weight`` are still the pieces of the unquantized model (same loaders, same shapes), so
the plan routes them as it routes any piece, into a staging buffer of the engine rank in
the unquantized dtype; once every element of a block has met there, ``apply.write_quantized``
quantizes it into ``P.weight`` and ``P.weight_scale_inv`` in place with the reference
quantizer (``fp8_quant``; ``apply.write_quantized``). Quantizing a block needs all of it, and only it: so every piece
must carry whole blocks of its HF tensor to whole blocks of ``P.weight``. A TP split (or a
fused layout) that cuts a block is refused by name (``BlockProblem``), as SGLang refuses it
when it builds the layer.

Blocks that lie whole on one trainer rank are quantized there instead (``fp8_sender``, run
by ``fp8_wire`` on every path: remote engines, the trainer-side one hop, colocated
engine-side resharding); every other block meets on the engine rank.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.fp8_quant import BLOCK, FP8_DTYPE, block_grid
from sglang.srt.weight_sync.target_layout import ParamTarget

__all__ = (
    "BlockFp8Targets",
    "BlockProblem",
    "BlockSites",
    "EngineBlockFp8",
    "QuantizedParam",
    "SCALE_SUFFIX",
    "block_fp8_targets",
    "block_sites",
    "derivation_config",
    "engine_block_fp8",
    "is_block_fp8",
    "staging_buffers",
)

SCALE_SUFFIX = "_scale_inv"  # P.weight -> P.weight_scale_inv, as SGLang names it

Live = Mapping[str, Tuple[Tuple[int, ...], torch.dtype]]


@dataclass(frozen=True, slots=True)
class QuantizedParam:
    """One block-FP8 parameter of one engine rank: ``weight`` (e4m3, ``shape``) and its
    ``scale`` (float32 block grid), computed from ``staged`` in ``staged_dtype``."""

    weight: str
    scale: str
    shape: Tuple[int, ...]
    block: Tuple[int, int]
    staged_dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class BlockProblem:
    """Why a block cannot be quantized where its elements meet: ``tensor``'s ``block``
    (block-grid coordinates of the HF tensor's last two dims) and the reason."""

    tensor: str
    block: Tuple[int, ...]
    param: str
    reason: str

    def __str__(self) -> str:
        return f"tensor {self.tensor!r} block {self.block} (in {self.param}): {self.reason}"


@dataclass(frozen=True)
class BlockFp8Targets:
    """One engine rank's targets for the plan (block-FP8 weights staged in their unquantized
    dtype, every other target as it was, scales dropped: they are computed) and the
    parameters ``apply.write_quantized`` computes after the plan ran."""

    targets: Tuple[ParamTarget, ...]
    quantized: Tuple[QuantizedParam, ...]
    problems: Tuple[BlockProblem, ...] = ()


def block_fp8_targets(
    targets: Sequence[ParamTarget],
    live: Live,
    shapes: Mapping[str, Tuple[int, ...]],
    block: Tuple[int, int] = BLOCK,
    staged_dtype: torch.dtype = torch.bfloat16,
) -> BlockFp8Targets:
    """The transform of one engine rank's ``targets`` (derived as for the unquantized model:
    the pieces of each ``P.weight``) given the rank's live parameters (``live``: name ->
    (shape, dtype)) and the HF tensors' ``shapes``. A target whose live parameter is
    ``float8_e4m3fn`` and has a live float32 ``P.weight_scale_inv`` of its block grid becomes
    a staged target in ``staged_dtype`` (the dtype verl quantizes from). Problems are
    collected, not raised: the caller refuses the update before any write."""
    out: List[ParamTarget] = []
    quantized: List[QuantizedParam] = []
    problems: List[BlockProblem] = []
    names = {t.name for t in targets}
    for t in targets:
        shape, dtype = live.get(t.name, (t.shape, t.dtype))
        if dtype != FP8_DTYPE:
            if t.name.endswith(SCALE_SUFFIX) and t.name[: -len(SCALE_SUFFIX)] in names:
                continue  # a scale the loader would copy from a checkpoint scale: computed here
            out.append(t)
            continue
        scale = t.name + SCALE_SUFFIX
        found = _scale_problem(t.name, tuple(shape), live.get(scale), block)
        if found:
            problems.append(BlockProblem(t.name, (), t.name, found))
            continue
        problems += _piece_problems(t, tuple(shape), shapes, block)
        out.append(ParamTarget(t.name, tuple(shape), staged_dtype, t.pieces, t.zeros))
        quantized.append(
            QuantizedParam(t.name, scale, tuple(shape), block, staged_dtype)
        )
    return BlockFp8Targets(tuple(out), tuple(quantized), tuple(problems))


def _scale_problem(name: str, shape, scale, block) -> str:
    if len(shape) < 2:
        return f"an e4m3 parameter of shape {shape} has no 2-D blocks"
    if scale is None:
        return f"no float32 {name}{SCALE_SUFFIX} beside it: not a block-FP8 parameter"
    want = tuple(shape[:-2]) + block_grid(tuple(shape[-2:]), block)
    if tuple(scale[0]) != want or scale[1] != torch.float32:
        return (
            f"{name}{SCALE_SUFFIX} is {tuple(scale[0])} {scale[1]}, expected float32 "
            f"{want} for {list(block)} blocks"
        )
    return ""


def _piece_problems(
    t: ParamTarget, shape, shapes: Mapping[str, Tuple[int, ...]], block
) -> List[BlockProblem]:
    """Every piece must carry whole blocks of its HF tensor to whole blocks of ``t``: offsets
    on block boundaries in both, sizes of whole blocks except where the piece ends at the
    end of both the HF tensor and the parameter (a ragged last block, as verl pads it)."""
    problems = []
    covered = 0
    for p in t.pieces:
        covered += p.box.numel
        if p.perm is not None:
            problems.append(
                BlockProblem(
                    p.tensor,
                    (),
                    t.name,
                    f"lands permuted {p.perm}: its blocks are not the parameter's",
                )
            )
            continue
        full = shapes.get(p.tensor, p.box.ends)
        for d in (-2, -1):
            b = block[d]
            src_o, dst_o, size = p.box.offsets[d], p.offsets[d], p.box.sizes[d]
            whole = size % b == 0 or (
                src_o + size == full[d] and dst_o + size == shape[d]
            )
            if src_o % b == 0 and dst_o % b == 0 and whole:
                continue
            if src_o % b:
                where = f"starts at {src_o}, inside one of its {b}-blocks"
            elif dst_o % b:
                where = (
                    f"lands at {dst_o} of the parameter, inside one of its {b}-blocks"
                )
            else:
                where = (
                    f"ends at {src_o + size} (of {full[d]}), inside a {b}-block that the "
                    f"parameter fills further (at {dst_o + size} of {shape[d]})"
                )
            cut = [o // bb for o, bb in zip(p.box.offsets[-2:], block)]
            if not src_o % b and not dst_o % b:  # the piece's last block along d
                cut[d] = (src_o + size - 1) // b
            problems.append(
                BlockProblem(
                    p.tensor,
                    tuple(cut),
                    t.name,
                    f"its piece {src_o}:{src_o + size} of dim {len(full) + d} {where}: "
                    "a TP split or fused layout that cuts a quantization block "
                    "(SGLang refuses to build such a layer too)",
                )
            )
            break
    zeros = sum(z.numel for z in t.zeros)
    if not problems and covered + zeros != prod(shape):
        problems.append(
            BlockProblem(
                t.name,
                (),
                t.name,
                f"pieces cover {covered + zeros} of {prod(shape)} elements: a block would mix staged and stale data",
            )
        )
    return problems


def staging_buffers(
    quantized: Sequence[QuantizedParam], device: torch.device
) -> Dict[str, torch.Tensor]:
    """The staging buffer of each quantized parameter (the plan's destination for its
    pieces), in its staged dtype on ``device``."""
    return {
        q.weight: torch.empty(q.shape, dtype=q.staged_dtype, device=device)
        for q in quantized
    }


# ------------------------------------------------------------------ the engine's view


def is_block_fp8(model_config) -> bool:
    """Whether the engine serves a block-FP8 checkpoint (``quant_method: fp8`` with a
    ``weight_block_size``); ``--quantization fp8`` on a BF16 checkpoint is not block FP8."""
    if getattr(model_config, "quantization", None) != "fp8":
        return False
    config = getattr(
        getattr(model_config, "hf_config", None), "quantization_config", None
    )
    if config is not None and not isinstance(config, Mapping):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    return bool(config and config.get("weight_block_size"))


def derivation_config(model_config):
    """The model config the engine derives its targets from. For a block-FP8 engine, a shallow
    copy without quantization: the unquantized model, whose loaders place each
    ``P.weight``'s pieces as the FP8 model's do (the same layer classes and weight loaders;
    the provenance check compares them with the live FP8 loaders), and whose post-load step
    runs on meta. Any other engine: ``model_config`` itself."""
    if not is_block_fp8(model_config):
        return model_config
    twin = copy.copy(model_config)
    twin.quantization = None
    return twin


@dataclass(frozen=True)
class EngineBlockFp8:
    """A block-FP8 engine's targets for the plan (every rank's, FP8 weights staged) and this
    rank's transform (what ``apply.write_quantized`` computes after the plan ran)."""

    targets: object  # DerivedTargets (not imported: derived_targets imports apply)
    own: BlockFp8Targets


def engine_block_fp8(
    derived, live: Mapping[str, torch.Tensor], rank: int, staged_dtype=torch.bfloat16
) -> Optional[EngineBlockFp8]:
    """The transform of every rank's derived targets, given this rank's live tensors: None
    when no live parameter is e4m3. Every rank's FP8 parameters have the same names (SGLang
    builds the same layers on every rank), their scales the block grid of their shard; this
    rank's are checked against its live scales."""
    fp8 = {n for n, t in live.items() if t.dtype == FP8_DTYPE}
    if not fp8:
        return None
    shapes = derived.tensor_shapes()
    per_rank, own = [], None
    for r in range(derived.parallel.tp_size):
        targets = derived.per_rank[r]
        if r == rank:
            view = {n: (tuple(t.shape), t.dtype) for n, t in live.items()}
        else:
            view = {t.name: (t.shape, t.dtype) for t in targets}
            for t in targets:
                if t.name in fp8 and len(t.shape) >= 2:
                    view[t.name] = (t.shape, FP8_DTYPE)
                    grid = tuple(t.shape[:-2]) + block_grid(t.shape[-2:])
                    view[t.name + SCALE_SUFFIX] = (grid, torch.float32)
        transformed = block_fp8_targets(
            targets, view, shapes, staged_dtype=staged_dtype
        )
        per_rank.append(transformed.targets)
        if r == rank:
            own = transformed
    dtype_of = dict(derived.dtype_of)
    dtype_of.update((q.weight, q.staged_dtype) for q in own.quantized)
    staged = dataclasses.replace(derived, per_rank=tuple(per_rank), dtype_of=dtype_of)
    return EngineBlockFp8(staged, own)


@dataclass(frozen=True, slots=True)
class BlockSites:
    """Where the blocks of one rank's FP8 weights can meet: ``at_sender`` blocks lie whole in
    one source box (a trainer rank holding them could quantize them, and then the wire
    carries e4m3 and scales; ``local`` of those on the receiving rank itself), the others
    (``at_receiver``) meet only in the receiving rank's staging."""

    at_sender: int
    local: int
    at_receiver: int


def block_sites(
    sources, mine: BlockFp8Targets, targets, rank: int, block=BLOCK
) -> BlockSites:
    """Count where the blocks of ``rank``'s FP8 weights (``mine``, its staged ``targets``)
    can meet, from the source layout (``SourceLayout``: name -> holders): a block lies whole in
    a holder's box or it does not. Per piece and distinct holder box, by interval arithmetic
    (no loop over blocks). The blocks ``fp8_sender`` cuts for their sender (remote engines:
    ``fp8_wire``), less any a round boundary cuts; the colocated paths quantize all of them on
    the receiving rank."""
    quantized = {q.weight for q in mine.quantized}
    at_sender = local = total = 0
    for t in targets:
        if t.name not in quantized:
            continue
        for p in t.pieces:
            lo = [o // b for o, b in zip(p.box.offsets[-2:], block)]
            hi = [-(-e // b) for e, b in zip(p.box.ends[-2:], block)]
            full = (hi[0] - lo[0]) * (hi[1] - lo[1])
            total += full
            holders = sources[p.tensor].holders
            whole = {}
            for h in holders:
                if any(
                    o > po or o + s < po + ps
                    for o, s, po, ps in zip(
                        h.box.offsets[:-2],
                        h.box.sizes[:-2],
                        p.box.offsets[:-2],
                        p.box.sizes[:-2],
                    )
                ):
                    continue  # leading dims (experts) not all held: counted per expert piece
                n = 1
                for d in range(2):
                    e = p.box.offsets[-2 + d] + p.box.sizes[-2 + d]
                    start = max(h.box.offsets[-2 + d], p.box.offsets[-2 + d])
                    end = min(h.box.ends[-2 + d], e)
                    first = -(-start // block[d])
                    last = end // block[d] if end < e else hi[d]
                    n *= max(0, last - first)
                key = (h.box.offsets, h.box.sizes)  # DP replicas hold the same box
                held = whole.get(key, (n, False))
                whole[key] = (n, held[1] or h.rank == rank)
            at_sender += sum(n for n, _ in whole.values())
            local += max((n for n, here in whole.values() if here), default=0)
    return BlockSites(at_sender, local, total - at_sender)
