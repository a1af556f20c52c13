"""Apply: every write into SGLang's parameters, and the refresh of what SGLang derives from them.

Writes are in place (``copy_`` into the parameter's storage, never a new ``param.data``:
CUDA graphs hold that storage), cast to the parameter's dtype on the fly. The executor
lands what it receives through ``write_regions``/``write_zeros``. After the writes,
``refresh_derived`` refreshes the tensors SGLang's loaders compute from parameters (Gemma
norms, parameter aliases) and ``run_post_load`` runs the model's post-load fixups where
the release has no weight-update session to run them (MLA's ``w_kc``/``w_vc``). Nothing
here reads a peer or decides what to write: the plan did.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

import torch
from torch._utils import _flatten_dense_tensors

from sglang.srt.weight_sync.sglang_compat import after_update, rebind_parameter_aliases

# isort: split
# pr: fp8
from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.fp8_quant import quantize_blocks_into
from sglang.srt.weight_sync.fp8_targets import QuantizedParam
from sglang.srt.weight_sync.target_layout import ParamTarget

# pr: fp8 end
# isort: split
# pr: scale
from typing import Optional

# pr: scale end

__all__ = (
    # pr: scale
    "check_buffers",
    "copy_buffers",
    "nonfinite_buffers",
    # pr: scale end
    "nonfinite_tensors",
    "refresh_derived",
    "release_cached_memory",
    "run_post_load",
    "synchronize",
    # pr: fp8
    "quantize_region",
    "write_quantized",
    # pr: fp8 end
    "write_regions",
    "write_zeros",
)


def write_regions(views: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Write each ``srcs[i]`` into the parameter region ``views[i]`` in place (cast to its
    dtype; nothing for a region received straight into it), in one call (torch's
    multi-tensor copy): a MoE layer's experts are hundreds of small regions, each of which
    would otherwise cost a dispatch of its own, far more than its bytes."""
    todo = [
        (view, src)
        for view, src in zip(views, srcs)
        if view.data_ptr() != src.data_ptr()
        or view.shape != src.shape
        or view.stride() != src.stride()
    ]
    if todo:
        torch._foreach_copy_([v for v, _ in todo], [s for _, s in todo])


# pr: fp8
def write_quantized(
    quantized: Sequence[QuantizedParam],
    targets: Sequence[ParamTarget],
    staged: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
) -> int:
    """Quantize what this update delivered of each block-FP8 parameter (the pieces of
    ``targets``, every one whole blocks: ``fp8_targets``) from its staged buffer into the
    e4m3 weight and float32 scale, in place; regions of a parameter this update did not
    deliver (a fused parameter whose other tensors come in another batch) keep their
    blocks and scales. Returns the e4m3 bytes written."""
    by_name = {q.weight: q for q in quantized}
    written = 0
    for t in targets:
        q = by_name.get(t.name)
        if q is None:
            continue
        source, weight, scale = staged[t.name], params[q.weight], params[q.scale]
        for p in t.pieces:
            box = p.dest_box()
            src = source[tuple(p.index) + box.slices()]
            written += quantize_region(src, weight, scale, p.index, box, q.block)
    return written


def quantize_region(
    src: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    index: Tuple[int, ...],
    box: Box,
    block: Tuple[int, int],
) -> int:
    """Quantize ``src`` (the whole blocks ``box`` of ``weight[index]``, in the staged dtype)
    into the e4m3 ``weight`` and its float32 block ``scale``, in place; the e4m3 bytes
    written."""
    bn, bk = block
    (r0, c0), (r1, c1) = box.offsets[-2:], box.ends[-2:]
    lead = tuple(index) + tuple(
        slice(o, e) for o, e in zip(box.offsets[:-2], box.ends[:-2])
    )
    region = lead + (slice(r0, r1), slice(c0, c1))
    grid = lead + (slice(r0 // bn, -(-r1 // bn)), slice(c0 // bk, -(-c1 // bk)))
    written = 0
    for s, dst, sc in zip(
        _matrices(src), _matrices(weight[region]), _matrices(scale[grid])
    ):
        quantize_blocks_into(s, dst, sc, block)
        written += dst.numel()
    return written


def _matrices(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """The 2-D views of ``t`` along its leading dims (experts), each a view of ``t``."""
    if t.dim() == 2:
        yield t
        return
    for i in range(t.shape[0]):
        yield from _matrices(t[i])


# pr: fp8 end


def write_zeros(view: torch.Tensor) -> None:
    """Zero a parameter region that no checkpoint tensor fills (vocab padding)."""
    view.zero_()


def synchronize(tensors) -> None:
    """Wait for the copies into ``tensors`` on their device: the trainer may reuse the memory
    the engine read from once the engine replies."""
    if any(t.is_cuda for t in tensors):
        torch.cuda.current_stream().synchronize()


def release_cached_memory(tensors) -> None:
    """Return the caching allocator's free blocks (the update's staging) to the device
    where ``tensors`` live on a GPU; nothing on the CPU."""
    if any(t.is_cuda for t in tensors):
        torch.cuda.empty_cache()


def _runs(regions: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """``regions`` as few runs as they allow: contiguous regions of one dtype that lie
    back to back in one storage become one 1-d view, read in one operation; any other
    region (alone in its storage, or not contiguous) stays as it is."""
    groups: Dict[tuple, List[torch.Tensor]] = {}
    runs: List[torch.Tensor] = []
    for r in regions:
        if r.numel() == 0:
            continue
        if not r.is_contiguous():
            runs.append(r)
            continue
        key = (r.device, r.dtype, r.untyped_storage().data_ptr())
        groups.setdefault(key, []).append(r)
    for rs in groups.values():
        if len(rs) == 1:  # alone in its storage: read as it is
            runs.append(rs[0])
            continue
        rs.sort(key=torch.Tensor.data_ptr)
        first, count = rs[0], rs[0].numel()
        for r in rs[1:]:
            if r.data_ptr() == first.data_ptr() + count * first.element_size():
                count += r.numel()
                continue
            runs.append(first.as_strided((count,), (1,), first.storage_offset()))
            first, count = r, r.numel()
        runs.append(first.as_strided((count,), (1,), first.storage_offset()))
    return runs


# On the host, runs of fewer elements than this are read together: joined (in C++) into
# chunks of ``_CHUNK`` elements and each chunk reduced once, where a reduction each would
# cost more in dispatch than in elements (a MoE model's small expert shards, norms and
# biases, each in a storage of its own). On a GPU every run is read by one multi-tensor
# reduction: one kernel for many tensors instead of three launches per tensor.
_SMALL_RUN = 8192
_CHUNK = 1 << 20


def _finite_sum(run: torch.Tensor) -> torch.Tensor:
    """A float64 scalar that is finite exactly when ``run`` is, unless its finite values
    add up past the dtype's range: its sum in its own dtype (NaN and inf propagate), or
    for float16, whose sums overflow early, its minimum and maximum."""
    if run.dtype == torch.float16:
        return torch.stack(torch.aminmax(run)).to(torch.float64).sum()
    return run.sum().to(torch.float64)


def _all_finite(regions: Iterable[torch.Tensor]) -> bool:
    """Whether every region holds only finite values, reading each element once: per run
    of regions (``_runs``) one reduction that is finite exactly when the run is
    (``_finite_sum``; small host runs a chunk of them at a time, ``_SMALL_RUN``; on a GPU
    the largest magnitude of each, from one ``torch._foreach_norm`` over many), unless
    finite values add up past the dtype's range (then each region is tested on its own).
    The results gather on each device and the host reads one value per device (one host
    sync per update on a GPU, not one per tensor)."""
    regions = list(regions)
    totals: Dict[torch.device, torch.Tensor] = {}
    together: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    small: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}

    def add(device: torch.device, s: torch.Tensor) -> None:
        seen = totals.get(device)
        totals[device] = s if seen is None else seen + s

    for run in _runs(regions):
        if run.is_cuda:
            together.setdefault((run.device, run.dtype), []).append(run)
        elif run.numel() < _SMALL_RUN and run.is_contiguous():
            small.setdefault((run.device, run.dtype), []).append(run)
        else:
            add(run.device, _finite_sum(run))
    for (device, _), runs in small.items():
        start, count = 0, 0
        for i, run in enumerate(runs):
            count += run.numel()
            if count >= _CHUNK or i == len(runs) - 1:
                joined = _flatten_dense_tensors(runs[start : i + 1])
                add(device, _finite_sum(joined))
                start, count = i + 1, 0
    for (device, _), runs in together.items():
        # the largest |x| of each run: NaN or inf where the run holds one, never an overflow
        norms = torch._foreach_norm(runs, float("inf"))
        add(device, torch.stack(norms).to(torch.float64).sum())
    if all(bool(torch.isfinite(t)) for t in totals.values()):
        return True
    return all(bool(torch.isfinite(r).all()) for r in regions)


def nonfinite_tensors(
    tensors: Mapping[str, torch.Tensor],
    # pr: scale
    runs: Optional[Sequence[torch.Tensor]] = None,
    # pr: scale end
) -> List[str]:
    """Keys of the floating tensors holding NaN or inf (refused before any write): one
    check of all of them (``_all_finite``), and the tensors are looked at by name only
    when it fails."""
    # pr: scale
    # ``runs``: 1-d views that cover exactly the bytes of ``tensors`` (a payload's
    # shared-memory segment, ``Payload.runs``), checked instead when all are finite there
    if runs is not None and _all_finite(r for r in runs if r.is_floating_point()):
        return []
    # pr: scale end
    floating = {k: t for k, t in tensors.items() if t.is_floating_point()}
    if _all_finite(floating.values()):
        return []
    return [k for k, t in floating.items() if not _all_finite([t])]


def refresh_derived(model: torch.nn.Module) -> None:
    """Refresh, in place, what SGLang's loaders compute from parameters they write directly
    (its presharded loader's aliases; Gemma norms' ``weight + 1``)."""
    rebind_parameter_aliases(model)


def run_post_load(model: torch.nn.Module) -> None:
    """The model's post-load fixups after an update that wrote parameters in place, on
    releases whose update has no session to run them (``sglang_compat.after_update``)."""
    with torch.no_grad():
        after_update(model)


# pr: scale
# A trainer-side update's parameter-shaped buffers (``engine_trainer_side``) are checked and
# copied here.
def check_buffers(
    params: Mapping[str, torch.Tensor],
    targets: Sequence[ParamTarget],
    buffers: Mapping[str, torch.Tensor],
    rank: int,
) -> List[str]:
    """Problems with delivered buffers against this engine rank's parameters (empty when fine)."""
    problems = []
    for t in targets:
        buf, param = buffers.get(t.name), params.get(t.name)
        if buf is None:
            problems.append(
                f"engine rank {rank}: no buffer for parameter {t.name!r} from the trainer side"
            )
        elif param is None:
            problems.append(f"engine rank {rank}: no parameter {t.name!r}")
        elif tuple(buf.shape) != tuple(param.shape) or buf.dtype != param.dtype:
            problems.append(
                f"engine rank {rank}: parameter {t.name!r} buffer is {tuple(buf.shape)} {buf.dtype}, "
                f"the parameter is {tuple(param.shape)} {param.dtype}"
            )
    return problems


def _filled_regions(target: ParamTarget) -> List[Tuple[Tuple[int, ...], Box]]:
    """Where a buffer holds delivered data: its pieces of this chunk. A parameter whose HF
    tensors arrive in several chunks (a fused ``gate_up_proj`` split by the trainer's
    batches) has a buffer of its full shape, the rest of it never written."""
    return [(p.index, p.dest_box()) for p in target.pieces]


def nonfinite_buffers(
    targets: Sequence[ParamTarget], buffers: Mapping[str, torch.Tensor]
) -> List[str]:
    """Parameters whose delivered regions hold NaN or inf (only those regions are read):
    one device flag for all of them, parameter by parameter only when it is down."""

    def regions(t: ParamTarget) -> List[torch.Tensor]:
        buf = buffers[t.name]
        if not buf.is_floating_point():
            return []
        return [buf[index][box.slices()] for index, box in _filled_regions(t)]

    if _all_finite(r for t in targets for r in regions(t)):
        return []
    return [t.name for t in targets if not _all_finite(regions(t))]


def copy_buffers(
    params: Mapping[str, torch.Tensor],
    targets: Sequence[ParamTarget],
    buffers: Mapping[str, torch.Tensor],
) -> int:
    """Copy the delivered regions into the parameters in place; returns bytes copied.

    A parameter the update fills whole is copied in one ``copy_``; otherwise only
    its delivered pieces (and zero fills) are.
    """
    copied = 0
    for t in targets:
        param, buf = params[t.name], buffers[t.name]
        regions = _filled_regions(t) + [((), z) for z in t.zeros]
        if sum(box.numel for _, box in regions) == param.numel():
            param.copy_(buf)
            copied += param.numel() * param.element_size()
            continue
        for index, box in regions:
            view = param[index][box.slices()]
            view.copy_(buf[index][box.slices()])
            copied += view.numel() * view.element_size()
    synchronize(params.values())
    return copied


# pr: scale end
