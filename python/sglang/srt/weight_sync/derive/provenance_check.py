"""Describe, checked on the live engine: SGLang's real weight loaders place checkpoint data
where the derived targets say, element by element, before the first write with them.

The derived targets come from SGLang's loaders run on the meta device; the engine checks
them against its live parameters by shape only. A loader branch the meta run did not take
(one that tests a tensor's device, a kernel only the GPU has) could permute a parameter
without changing its shape, and an update would then corrupt it silently. So, once per
derived-targets object (``ProvenanceCheck``, kept by the engine's weight sync), for one
representative of each parameter kind (name with layer numbers blanked, and shape: one
layer of each kind of repeated layer), the model's own ``load_weights`` runs on the live
device and dtype with that parameter's slot holding a scratch tensor (``torch.empty_like``,
never the live one), fed seeded pseudo-random checkpoint tensors (random finite bit
patterns). The scratch is compared bitwise with what the pieces and zero boxes place from
the same tensors; any difference refuses the update, naming parameter, checkpoint tensor
and the first differing element (what the targets place there, what the loader did).

What it checks is the placement by ``load_weights``: quant methods' post-load processing
(``process_weights_after_loading``) is never run on live modules. The derived targets
describe the parameters after it; where it rewrites a parameter in place with copies the
recorder followed, the two differ and the update is refused (conservative: never a silent
permutation). Post-processing inside a model's ``load_weights`` (DeepSeek's ``w_kc``/``w_vc``)
runs, but every write it makes into a live tensor is dropped (``_LiveWriteGuard``) and every
module attribute it rebinds is restored. Cost: one load per parameter kind; memory: one
parameter's scratch and one checkpoint tensor at a time.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang.srt.weight_sync.derive.derived_targets import DerivedTargets
from sglang.srt.weight_sync.derive.repeated_layers import layer_pattern
from sglang.srt.weight_sync.sglang_compat import load_synchronously
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

__all__ = (
    "ProvenanceCheck",
    "ProvenanceMismatch",
    "check_provenance",
    "representatives",
)

logger = logging.getLogger(__name__)

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNWRITTEN = -1  # the scratch's bit pattern before loading (all ones: NaN for floats)
_MEMO = 4  # derived-targets objects remembered (one per model runner)
_RUN = 4  # elements that identify where a written value came from
# elements with a written value's bits examined per checkpoint tensor
_CANDIDATES = 4096


class ProvenanceMismatch(ValueError):
    """SGLang's loader places a checkpoint tensor elsewhere than the derived targets say."""


def representatives(targets: Sequence[ParamTarget]) -> List[ParamTarget]:
    """The first target of each parameter kind: its name with layer numbers blanked
    (``derive.repeated_layers.layer_pattern``) and its shape."""
    first: Dict[Tuple[str, Tuple[int, ...]], ParamTarget] = {}
    for t in targets:
        first.setdefault((layer_pattern(t.name), t.shape), t)
    return list(first.values())


def check_provenance(
    model: torch.nn.Module,
    targets: Sequence[ParamTarget],
    shapes: Mapping[str, Tuple[int, ...]],
    rank: int,
    seed: int = 0,
) -> int:
    """Check one representative of each parameter kind of ``targets`` (this rank's) against
    SGLang's loader on ``model``; raise ``ProvenanceMismatch`` on the first difference.
    ``shapes``: the checkpoint tensors' full shapes. Returns the number of parameters checked;
    the live tensors are never written."""
    live = _Live(model)
    checked = 0
    for target in representatives(targets):
        tensor = live.tensors.get(target.name)
        if tensor is None or tuple(tensor.shape) != target.shape:
            continue  # EngineLayout.live refuses it, naming the difference
        if tensor.element_size() not in _BITS or tensor.is_complex():
            continue
        _check_one(model, live, target, tensor, shapes, rank, seed)
        checked += 1
    return checked


class ProvenanceCheck:
    """The check's outcome per derived-targets object, kept by the engine's weight sync: the
    check runs once per object (the first update with it), and its outcome, passed or a
    mismatch (which the same loaders would give again), is reused after. A check that
    could not run (the loader raised) refuses the update and runs again next time."""

    def __init__(self) -> None:
        self._done: Dict[int, Tuple[DerivedTargets, Tuple[str, ...]]] = {}
        self.runs = 0

    def problems(
        self, model: torch.nn.Module, derived: DerivedTargets, rank: int
    ) -> List[str]:
        """Why ``derived`` must not be written on this rank (empty when the check passed)."""
        hit = self._done.get(id(derived))
        if hit is not None and hit[0] is derived:
            return list(hit[1])
        self.runs += 1
        try:
            n = check_provenance(model, derived.for_rank(rank), derived.shapes, rank)
            logger.info(
                "weight sync: engine rank %d checked the derived targets of %d parameter "
                "kinds against SGLang's loaders on the live device",
                rank,
                n,
            )
            found: Tuple[str, ...] = ()
        except ProvenanceMismatch as e:
            found = (f"engine rank {rank}: {e}",)
        except Exception as e:  # noqa: BLE001 - an unchecked layout is refused, never written
            logger.exception(
                "engine rank %d: the provenance check of the derived targets failed",
                rank,
            )
            # not kept: the next update checks again (the cause may pass, memory say)
            return [
                f"engine rank {rank}: the derived targets could not be checked against "
                f"SGLang's loaders: {type(e).__name__}: {e}"
            ]
        if len(self._done) >= _MEMO:
            self._done.pop(next(iter(self._done)))
        self._done[id(derived)] = (derived, found)
        return list(found)


# ------------------------------------------------------------------ one parameter


def _check_one(
    model: torch.nn.Module,
    live: _Live,
    target: ParamTarget,
    tensor: torch.Tensor,
    shapes: Mapping[str, Tuple[int, ...]],
    rank: int,
    seed: int,
) -> None:
    bits = _BITS[tensor.element_size()]
    scratch = _scratch_like(tensor)
    scratch.data.view(bits).fill_(_UNWRITTEN)
    by_tensor: Dict[str, List[Piece]] = defaultdict(list)
    for p in sorted(target.pieces, key=lambda p: (p.index, p.offsets)):
        by_tensor[p.tensor].append(p)
    names = sorted(by_tensor)

    def make(name: str) -> torch.Tensor:
        return _random(name, shapes[name], tensor.dtype, tensor.device, seed)

    def feed() -> Iterator[Tuple[str, torch.Tensor]]:
        for name in names:
            yield name, load_synchronously(make(name))

    phase = f"engine rank {rank}: provenance check of parameter {target.name!r}"
    with torch.no_grad(), live.restored(phase), live.swapped(tensor, scratch):
        with _LiveWriteGuard(live.storages):
            model.load_weights(feed())
    found = scratch.detach().view(bits)

    def fail(where: Tuple[int, ...], expected: str, source: Optional[str]) -> None:
        fed = (
            f"checkpoint tensor {source!r}" if source else f"checkpoint tensors {names}"
        )
        raise ProvenanceMismatch(
            f"parameter {target.name!r} ({fed}): SGLang's weight loader on {tensor.device} "
            f"places data elsewhere than the derived targets: at {list(where)} the targets "
            f"place {expected}, the loader placed "
            f"{_provenance_of(found, where, names, make, bits)}; the update is refused "
            "before any write"
        )

    for name in names:
        full = make(name).view(bits)
        for piece in by_tensor[name]:
            dest = found[piece.index][piece.dest_box().slices()]
            bad = dest != piece.region(full)
            if bool(bad.any()):
                local = tuple(int(i) for i in bad.nonzero()[0])
                fail(
                    piece.index + tuple(o + i for o, i in zip(piece.offsets, local)),
                    f"{name}{_source_index(piece, local)}",
                    name,
                )
            dest.fill_(_UNWRITTEN)  # checked: the rest must be zero boxes or untouched
        del full
    for box in target.zeros:
        dest = found[box.slices()]
        bad = dest != 0
        if bool(bad.any()):
            local = tuple(int(i) for i in bad.nonzero()[0])
            fail(tuple(o + i for o, i in zip(box.offsets, local)), "a zero fill", None)
        dest.fill_(_UNWRITTEN)
    stray = found != _UNWRITTEN
    if bool(stray.any()):
        where = tuple(int(i) for i in stray.nonzero()[0])
        fail(where, "nothing (no piece, no zero fill)", None)


def _source_index(piece: Piece, local: Tuple[int, ...]) -> List[int]:
    """The checkpoint element a piece places at ``local`` (an index inside its destination box)."""
    src = list(piece.box.offsets)
    perm = piece.perm or tuple(range(len(local)))
    for d, i in enumerate(local):
        src[perm[d]] += i
    return src


def _provenance_of(
    found: torch.Tensor, where: Tuple[int, ...], names: Sequence[str], make, bits
) -> str:
    """What the loader wrote at ``where``: nothing, zero, or the checkpoint element it came
    from, found by the run of up to ``_RUN`` elements from there along the last dim (one 16-bit
    value alone is ambiguous), else by its bits alone."""
    value = int(found[where])
    if value == _UNWRITTEN:
        return "nothing (the element was never written)"
    if value == 0:
        return "zero"
    row = found[where[:-1]] if where else found.reshape(1)
    run = row[where[-1] if where else 0 :][:_RUN]
    same_bits = None
    for name in names:
        full = make(name).view(bits)
        flat = full.reshape(-1, full.shape[-1] if full.dim() else 1)
        hits = (flat == value).nonzero()[:_CANDIDATES].tolist()
        for r, c in hits:
            if torch.equal(flat[r, c : c + len(run)], run):
                return f"{name}{_unravel(r * flat.shape[1] + c, full.shape)}"
        if hits and same_bits is None:
            r, c = hits[0]
            same_bits = f"{name}{_unravel(r * flat.shape[1] + c, full.shape)}"
    if same_bits is not None:
        return f"an element with the bits of {same_bits}"
    return (
        f"bits {value & 0xFFFFFFFFFFFFFFFF:#x}, of no checkpoint tensor fed (computed)"
    )


def _unravel(flat: int, shape: Sequence[int]) -> List[int]:
    index = []
    for size in reversed(tuple(shape)):
        index.append(flat % size)
        flat //= size
    return index[::-1]


def _random(
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> torch.Tensor:
    """A pseudo-random checkpoint tensor, the same for the same name and seed: for 16- and
    32-bit floats random bit patterns with the lowest exponent bit cleared (never inf or
    NaN; made in place, no temporary), so a permutation of distinct elements shows bitwise."""
    g = torch.Generator(device=device)
    g.manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
    shape = tuple(shape)
    if dtype.is_floating_point and torch.finfo(dtype).bits in (16, 32):
        width = torch.finfo(dtype).bits
        mantissa = round(-math.log2(torch.finfo(dtype).eps))
        ints = torch.empty(shape, dtype=_BITS[width // 8], device=device)
        ints.random_(-(2 ** (width - 1)), 2 ** (width - 1), generator=g)
        return ints.bitwise_and_(~(1 << mantissa)).view(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, device=device).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, device=device).bool()
    return torch.randint(0, 127, shape, generator=g, dtype=dtype, device=device)


def _scratch_like(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``tensor`` on its device and dtype, of its class (an SGLang
    parameter class) and with its attributes (``weight_loader``, ``output_dim``, ...)."""
    data = torch.empty_like(tensor.data)
    if isinstance(tensor, torch.nn.Parameter):
        scratch = torch.Tensor._make_subclass(type(tensor), data, False)
        scratch.__dict__.update(tensor.__dict__)
        return scratch
    return data


# ------------------------------------------------------------------ the live model, untouched


@dataclass(frozen=True)
class _Slot:
    module: torch.nn.Module
    table: str  # "_parameters" or "_buffers"
    attr: str


class _Live:
    """The live model's tensors by name, the storages they own, and their module slots."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.tensors: Dict[str, torch.Tensor] = dict(model.named_parameters())
        for n, b in model.named_buffers():
            self.tensors.setdefault(n, b)
        self.storages = set()
        for module in model.modules():
            held = list(module._parameters.values()) + list(module._buffers.values())
            held += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
            self.storages |= {_storage(t) for t in held if t is not None}
        self.storages -= {None, 0}  # empty tensors own no memory

    @contextmanager
    def swapped(self, tensor: torch.Tensor, scratch: torch.Tensor) -> Iterator[None]:
        """Every module slot holding ``tensor`` holds ``scratch`` for the block."""
        slots = [
            _Slot(m, table, attr)
            for m in self.model.modules()
            for table in ("_parameters", "_buffers")
            for attr, v in getattr(m, table).items()
            if v is tensor
        ]
        for s in slots:
            getattr(s.module, s.table)[s.attr] = scratch
        try:
            yield
        finally:
            for s in slots:
                getattr(s.module, s.table)[s.attr] = tensor

    @contextmanager
    def restored(self, phase: str) -> Iterator[None]:
        """Every module's attributes, parameter and buffer slots and every parameter's data as
        before the block (a loader's post-processing may rebind them); fails loudly, naming the
        tensor, if a live tensor's storage changed anyway."""
        modules = list(self.model.modules())
        saved = [
            (m, dict(vars(m)), dict(m._parameters), dict(m._buffers)) for m in modules
        ]
        data = [(p, p.data) for p in self.model.parameters()]
        ptrs = {n: _storage(t) for n, t in self.tensors.items()}
        try:
            yield
        finally:
            for m, attrs, params, buffers in saved:
                for k in set(vars(m)) - set(attrs):
                    delattr(m, k)
                m.__dict__.update(attrs)
                m._parameters.clear()
                m._parameters.update(params)
                m._buffers.clear()
                m._buffers.update(buffers)
            for p, d in data:
                if _storage(p) != _storage(d):
                    p.data = d
            moved = [n for n, t in self.tensors.items() if _storage(t) != ptrs[n]]
            if moved:
                raise RuntimeError(
                    f"{phase}: the live tensor {moved[0]!r} changed storage during the check"
                )


def _storage(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _written(func, args, kwargs) -> List[torch.Tensor]:
    """The tensors an ATen op writes into (its schema's mutable arguments)."""
    out: List[torch.Tensor] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        vs = v if isinstance(v, (list, tuple)) else [v]
        out += [t for t in vs if isinstance(t, torch.Tensor)]
    return out


class _LiveWriteGuard(TorchDispatchMode):
    """Drops every op that would write into a live tensor's storage (those writes belong to a
    loader's own post-processing, which the check must not run on live modules); every other
    op runs. It sees the thread it is entered in: ``load_synchronously`` keeps loaders there."""

    def __init__(self, storages) -> None:
        super().__init__()
        self.storages = storages
        self.dropped: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        if any(_storage(t) in self.storages for t in written):
            self.dropped.append(str(func))
            returns = func._schema.returns
            if not returns:
                return None
            return written[0] if len(returns) == 1 else tuple(written)
        return func(*args, **kwargs)
