"""What each ATen op writes, for ``LoadRecorder``: op -> handler tables.

View ops need no handler: the meta tensors' offsets and strides are the truth and are
read only when something is written. Handlers exist for the ops that write:

* ``IN_PLACE``: ``copy_`` (the op every loader ends in), ``fill_``, ``zero_``;
* ``ALLOCATING``: the ops whose fresh output is a copy or a constant: ``clone`` and
  ``_to_copy`` (dtype casts), ``cat``, ``stack``, ``constant_pad_nd``, ``index_select``
  with a concrete index, and the factories (``zeros``, ``ones``, ``full``, ``empty``).

Any other op is recorded, conservatively, as computing what it writes (``Opaque``):
``computed_in_place`` for an op that writes its arguments, ``computed`` otherwise.
In-place handlers take the recorder and the op's arguments; allocating ones also the
op and the tensors of its output the recorder had not seen (the storages it allocated).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import (
    Any,
    Callable,
    Counter,
    Dict,
    FrozenSet,
    List,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Tuple,
)

import torch

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.derive.provenance import (
    Const,
    Entry,
    Fill,
    Opaque,
    StorageLog,
    Vec,
)

__all__ = (
    "ALLOCATING",
    "IN_PLACE",
    "OpFacts",
    "Recorder",
    "broadcast_strides",
    "computed",
    "computed_in_place",
    "tensors_in",
)

aten = torch.ops.aten

Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]
Geometry = Tuple[int, Vec, Vec]  # a view: storage offset, sizes, strides


class Recorder(Protocol):
    """What the handlers use of ``LoadRecorder`` (a protocol, so that this module need not
    import it)."""

    opaque_ops: Counter[str]

    def prov(self, t: torch.Tensor) -> StorageLog: ...

    def deps(self, t: torch.Tensor) -> FrozenSet[str]: ...

    def geom(self, t: torch.Tensor) -> Geometry: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def fill(self, dst: torch.Tensor, value: Fill) -> None: ...

    def scalar_source(self, value: Any) -> Fill: ...

    def transfer(
        self,
        dst: Geometry,
        dst_log: StorageLog,
        src: Optional[torch.Tensor] = None,
        src_geom: Optional[Tuple[int, Vec]] = None,
        fixed: Optional[Fill] = None,
    ) -> None: ...

    def mark_computed(
        self, dst_log: StorageLog, dst: Geometry, src: Opaque
    ) -> None: ...


InPlaceHandler = Callable[[Recorder, Args], None]
AllocatingHandler = Callable[[Recorder, Any, Args, Kwargs, List[torch.Tensor]], None]


def tensors_in(x: Any) -> List[torch.Tensor]:
    """The tensors in (nested lists, tuples, dicts of) ``x``, in order."""
    out: List[torch.Tensor] = []
    _collect(x, out)
    return out


def _collect(x: Any, out: List[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _collect(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _collect(y, out)


def broadcast_strides(src: torch.Tensor, shape: Sequence[int]) -> Tuple[int, ...]:
    """Strides of ``src`` broadcast to ``shape`` (0 on broadcast dims)."""
    if src.shape == shape:
        return tuple(src.stride())
    nd, sd = len(shape), src.dim()
    out = []
    for k in range(nd):
        j = k - (nd - sd)
        if j < 0 or (src.shape[j] == 1 and shape[k] != 1):
            out.append(0)
        else:
            out.append(src.stride(j))
    return tuple(out)


def _deps(rec: Recorder, tensors: Sequence[torch.Tensor]) -> frozenset:
    """The leaves ``tensors`` are made of."""
    return (
        frozenset().union(*(rec.deps(t) for t in tensors)) if tensors else frozenset()
    )


# ---------------------------------------------------------------------- in place


def _copy_(rec: Recorder, args: Args) -> None:
    """``dst.copy_(src)``: the copy every loader ends in."""
    rec.copy(args[0], args[1])


def _fill_(rec: Recorder, args: Args) -> None:
    """``fill_`` with a tensor (copied, broadcast) or a scalar (maybe an ``.item()`` of a leaf)."""
    if isinstance(args[1], torch.Tensor):
        rec.copy(args[0], args[1])
    else:
        rec.fill(args[0], rec.scalar_source(args[1]))


def _zero_(rec: Recorder, args: Args) -> None:
    """``zero_``: zeros."""
    rec.fill(args[0], Const(0.0))


def computed_in_place(
    rec: Recorder,
    func: Any,
    inputs: Sequence[torch.Tensor],
    written: Sequence[torch.Tensor],
) -> None:
    """Any other op writing (some of) its inputs: what it writes is computed from all of them."""
    deps = _deps(rec, inputs)
    rec.opaque_ops[func.__name__] += 1
    for t in written:
        rec.mark_computed(rec.prov(t), rec.geom(t), Opaque(func.__name__, deps))


IN_PLACE: Mapping[Any, InPlaceHandler] = MappingProxyType(
    {
        aten.copy_.default: _copy_,
        aten.fill_.Scalar: _fill_,
        aten.fill_.Tensor: _fill_,
        aten.zero_.default: _zero_,
    }
)

# ---------------------------------------------------------------------- allocating


def _clone(
    rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
) -> None:
    """A copy of the input (``_to_copy``: maybe in another dtype)."""
    rec.copy(outs[0], args[0])


def _copy(
    rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
) -> None:
    """Out-of-place ``copy(self, src)``: ``src`` broadcast to ``self``'s shape."""
    rec.copy(outs[0], args[1])


def _dim(args: Args, kwargs: Kwargs, ndim: int) -> int:
    """The ``dim`` argument of ``cat``/``stack``, made non-negative."""
    return (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % ndim


def _cat(
    rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
) -> None:
    """``cat``: each input copied into its slab along ``dim``."""
    out = outs[0]
    dim = _dim(args, kwargs, out.dim())
    at = 0
    for t in args[0]:
        if t.dim() == 1 and t.numel() == 0 and out.dim() != 1:
            continue  # legacy: cat skips empty 1-D tensors
        sizes = list(out.shape)
        sizes[dim] = t.shape[dim]
        rec.transfer(
            (
                out.storage_offset() + at * out.stride(dim),
                tuple(sizes),
                tuple(out.stride()),
            ),
            rec.prov(out),
            t,
            (t.storage_offset(), broadcast_strides(t, sizes)),
        )
        at += t.shape[dim]


def _stack(
    rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
) -> None:
    """``stack``: input ``m`` copied into index ``m`` of ``dim``."""
    out = outs[0]
    dim = _dim(args, kwargs, out.dim())
    sizes = [n for d, n in enumerate(out.shape) if d != dim]
    strides = [s for d, s in enumerate(out.stride()) if d != dim]
    for m, t in enumerate(args[0]):
        rec.transfer(
            (out.storage_offset() + m * out.stride(dim), tuple(sizes), tuple(strides)),
            rec.prov(out),
            t,
            (t.storage_offset(), broadcast_strides(t, sizes)),
        )


def _constant_pad_nd(
    rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
) -> None:
    """``constant_pad_nd`` (``F.pad``): the value everywhere, then the input (cropped where a
    pad is negative) inside."""
    out, x, pad = outs[0], args[0], list(args[1])
    rec.fill(
        out, rec.scalar_source(args[2] if len(args) > 2 else kwargs.get("value", 0))
    )
    dst_off, src_off = out.storage_offset(), x.storage_offset()
    sizes = list(x.shape)
    for q in range(len(pad) // 2):
        d = x.dim() - 1 - q
        before, after = pad[2 * q], pad[2 * q + 1]
        if before >= 0:
            dst_off += before * out.stride(d)
        else:
            src_off += -before * x.stride(d)
            sizes[d] += before
        if after < 0:
            sizes[d] += after
    rec.transfer(
        (dst_off, tuple(sizes), tuple(out.stride())),
        rec.prov(out),
        x,
        (src_off, tuple(x.stride())),
    )


def _index_select(
    rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
) -> None:
    """``index_select`` with a concrete index: one slab copied per index; computed otherwise."""
    x, dim, index = args
    if index.device.type == "meta":
        computed(rec, func, args, kwargs, outs)
        return
    out = outs[0]
    dim = dim % x.dim()
    sizes = [n for d, n in enumerate(out.shape) if d != dim]
    dst_strides = [s for d, s in enumerate(out.stride()) if d != dim]
    src_strides = [s for d, s in enumerate(x.stride()) if d != dim]
    for m, j in enumerate(index.tolist()):
        rec.transfer(
            (
                out.storage_offset() + m * out.stride(dim),
                tuple(sizes),
                tuple(dst_strides),
            ),
            rec.prov(out),
            x,
            (x.storage_offset() + j * x.stride(dim), tuple(src_strides)),
        )


def _zeros(
    rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
) -> None:
    """``zeros``, ``zeros_like``, ``new_zeros``: zeros."""
    for t in outs:
        rec.fill(t, Const(0.0))


def _ones(
    rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
) -> None:
    """``ones``, ``ones_like``, ``new_ones``: ones."""
    for t in outs:
        rec.fill(t, Const(1.0))


def _filled(value_at: int) -> AllocatingHandler:
    """A factory whose fill value is argument ``value_at``."""

    def filled(
        rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
    ) -> None:
        """``full`` and kin: the fill value (maybe an ``.item()`` of a leaf) everywhere."""
        for t in outs:
            rec.fill(t, rec.scalar_source(args[value_at]))

    return filled


def _uninitialised(
    rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
) -> None:
    """``empty`` and kin: nothing written."""


def computed(
    rec: Recorder, func: Any, args: Args, kwargs: Kwargs, outs: List[torch.Tensor]
) -> None:
    """Any other op: its outputs are computed from all its inputs."""
    deps = _deps(rec, tensors_in((args, kwargs)))
    rec.opaque_ops[func.__name__] += 1
    for t in outs:
        rec.prov(t).add(Entry(Box.full(rec.prov(t).canon), Opaque(func.__name__, deps)))


def _table(
    *rows: Tuple[Sequence[Any], AllocatingHandler],
) -> Mapping[Any, AllocatingHandler]:
    """A read-only op -> handler table from rows of (ops, their handler)."""
    return MappingProxyType(
        {func: handler for funcs, handler in rows for func in funcs}
    )


ALLOCATING: Mapping[Any, AllocatingHandler] = _table(
    (
        (
            aten.clone.default,
            aten._to_copy.default,
            aten.lift_fresh_copy.default,
            aten.alias_copy.default,
            aten.detach_copy.default,
        ),
        _clone,
    ),
    ((aten.copy.default,), _copy),
    ((aten.cat.default,), _cat),
    ((aten.stack.default,), _stack),
    ((aten.constant_pad_nd.default,), _constant_pad_nd),
    ((aten.index_select.default,), _index_select),
    ((aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default), _zeros),
    ((aten.ones.default, aten.ones_like.default, aten.new_ones.default), _ones),
    (
        (aten.full.default, aten.full_like.default),
        _filled(1),
    ),  # (size | self, fill_value)
    ((aten.new_full.default,), _filled(2)),  # (self, size, fill_value)
    ((aten.scalar_tensor.default,), _filled(0)),  # (s)
    (
        (
            aten.empty.memory_format,
            aten.empty_like.default,
            aten.new_empty.default,
            aten.empty_strided.default,
            aten.new_empty_strided.default,
        ),
        _uninitialised,
    ),
)


# ---------------------------------------------------------------------- per op


@dataclass(frozen=True, slots=True)
class OpFacts:
    """What the recorder needs to know of one op overload: from its schema, whether it is a
    view that writes nothing and which arguments it writes; from the tables, its handler."""

    pure_view: bool
    mutated: Tuple[Tuple[int, str], ...]  # (position, name) of the arguments it writes
    in_place: Optional[InPlaceHandler]
    allocating: AllocatingHandler

    @staticmethod
    def of(func: Any) -> OpFacts:
        mutated = tuple(
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        return OpFacts(
            bool(func.is_view) and not mutated,
            mutated,
            IN_PLACE.get(func),
            ALLOCATING.get(func, computed),
        )
