"""Record where every element of every storage comes from while SGLang loads weights.

Used by ``derive.derived_targets`` to learn, from SGLang's own loaders, which checkpoint
elements land where in each parameter of an engine rank.

``LoadRecorder`` is a ``TorchDispatchMode``. Checkpoint tensors are meta tensors
registered as *leaves*; the model is built on the meta device, so nothing is
allocated. Each storage (identified by its StorageImpl) carries a write log
(``derive.provenance.StorageLog``) of ``Entry``s: a box in the storage's canonical
coordinates (``derive.view_geometry``) plus its source: a ``Leaf`` (an affine map into a
checkpoint tensor), a ``Const`` or an ``Opaque`` (computed; names the leaves read).

View ops need no handling at all: the meta tensors' offsets and strides are the
truth and are read only when something is written. What each writing op records
is in ``derive.recorded_ops``; every write ends in ``transfer``: a view of one storage
written from a view of another (or with one value), worked out by ``derive.transfers``.

Notation: a *geometry* is a view as PyTorch has it, ``(offset, sizes, strides)``
for a destination, ``(offset, strides)`` for a source iterating the same sizes;
``sides`` are views as ``derive.view_geometry.refine`` takes them (``derive.transfers``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.derive.provenance import (
    Const,
    Entry,
    Fill,
    Leaf,
    LeafElement,
    LeafRead,
    Opaque,
    StorageKind,
    StorageLog,
    Vec,
    identity,
)
from sglang.srt.weight_sync.derive.recorded_ops import (
    Geometry,
    OpFacts,
    broadcast_strides,
    computed_in_place,
    tensors_in,
)
from sglang.srt.weight_sync.derive.transfers import Side, Transfers
from sglang.srt.weight_sync.derive.view_geometry import NotAffine, cstrides, unravel

# The provenance types are re-exported: they are what ``describe`` answers in.
__all__ = ("Const", "Entry", "Leaf", "LoadRecorder", "Opaque")

aten = torch.ops.aten

# Scalars handed out by ``.item()`` on tracked tensors: distinct negative integers
# (exact in float64) that a later ``fill_`` maps back to their source element.
_SENTINEL_BASE = -(2**50)


def _physical_canon(t: torch.Tensor) -> Vec:
    """The contiguous shape of a freshly allocated tensor's storage (dims ordered by stride)."""
    n_storage = t.untyped_storage().nbytes() // max(t.element_size(), 1)
    if t.storage_offset() == 0 and t.numel() == n_storage:
        dims = sorted(range(t.dim()), key=lambda d: -t.stride(d))
        shape = [t.shape[d] for d in dims]
        strides = [t.stride(d) for d in dims]
        expect, s = [], 1
        for n in reversed(shape):
            expect.append(s)
            s *= n
        expect.reverse()
        if all(a == b or n == 1 for a, b, n in zip(strides, expect, shape)):
            return tuple(shape) if shape else (1,)
    return (max(n_storage, 1),)


def _mixes_meta(tensors: Sequence[torch.Tensor]) -> bool:
    """Floating-point meta and non-meta tensors in one op."""
    meta = other = False
    for t in tensors:
        if t.is_floating_point():
            if t.is_meta:
                meta = True
            else:
                other = True
    return meta and other


class LoadRecorder(TorchDispatchMode):
    """See the module docstring. Use as ``with LoadRecorder() as rec: model.load_weights(...)``.

    Lives as long as one derivation: its memo tables (op facts per overload here, copy
    geometries in ``derive.transfers``) go with it. ``max_enumeration`` bounds how many pieces one
    transfer that is no affine map may be cut into before it is recorded as computed."""

    def __init__(self, max_enumeration: int = 1 << 16):
        super().__init__()
        self.storages: Dict[int, StorageLog] = {}
        self.leaves: Dict[str, torch.Tensor] = {}
        self.sentinels: Dict[float, Fill] = {}
        self.opaque_ops: Counter = Counter()
        self.not_affine: List[str] = []
        self.transfers = Transfers(max_enumeration)
        self._ops: Dict[Any, OpFacts] = {}

    # ------------------------------------------------------------------ registry
    @staticmethod
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def register(
        self, t: torch.Tensor, kind: StorageKind, canon: Optional[Sequence[int]] = None
    ) -> StorageLog:
        log = StorageLog(canon or _physical_canon(t), t.element_size(), t, kind)
        self.storages[self.key(t)] = log
        return log

    def prov(self, t: torch.Tensor) -> StorageLog:
        """The write log of ``t``'s storage; a storage allocated outside the recording (a CPU
        index, a buffer) is registered on first sight as computed from nothing known."""
        log = self.storages.get(self.key(t))
        if log is None:
            log = self.register(
                t,
                StorageKind.UNTRACKED,
                (max(t.untyped_storage().nbytes() // max(t.element_size(), 1), 1),),
            )
            log.add(Entry(Box.full(log.canon), Opaque("untracked", frozenset())))
        return log

    def add_leaf(self, name: str, t: torch.Tensor) -> None:
        log = self.register(t, StorageKind.LEAF, tuple(t.shape) if t.dim() else (1,))
        # a 0-d leaf is stored as shape (1,): its single coordinate maps to nothing
        log.add(
            Entry(
                Box((0,) * len(log.canon), log.canon),
                Leaf(name, (0,) * t.dim(), identity(t.dim())),
            )
        )
        self.leaves[name] = t

    def register_module_tensors(self, model: torch.nn.Module) -> None:
        for _, t in list(model.named_parameters()) + list(model.named_buffers()):
            if self.key(t) not in self.storages:
                self.register(t, StorageKind.PARAM)

    def deps(self, t: torch.Tensor) -> FrozenSet[str]:
        """The leaves anything in ``t``'s storage was read from."""
        out = set()
        for entry in self.prov(t).entries:
            if isinstance(entry.src, Leaf):
                out.add(entry.src.name)
            elif isinstance(entry.src, Opaque):
                out |= entry.src.deps
        return frozenset(out)

    # ------------------------------------------------------------------ writing
    @staticmethod
    def geom(t: torch.Tensor) -> Geometry:
        return t.storage_offset(), tuple(t.shape), tuple(t.stride())

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` written from ``src`` broadcast to its shape."""
        self.transfer(
            self.geom(dst),
            self.prov(dst),
            src,
            (src.storage_offset(), broadcast_strides(src, dst.shape)),
        )

    def fill(self, dst: torch.Tensor, value: Fill) -> None:
        """``dst`` written with one value."""
        self.transfer(self.geom(dst), self.prov(dst), fixed=value)

    def scalar_source(self, value: Any) -> Fill:
        """What a Python scalar argument is: an ``.item()`` handed out earlier, else a constant."""
        if isinstance(value, (int, float)) and float(value) in self.sentinels:
            return self.sentinels[float(value)]
        return Const(float(value))

    def mark_computed(self, dst_log: StorageLog, dst: Geometry, src: Opaque) -> None:
        """The view ``dst`` of ``dst_log`` now holds computed values (the whole storage where the
        view is no affine map)."""
        _, sizes, _ = dst
        if any(n == 0 for n in sizes):
            return
        try:
            self.transfers.write(
                dst_log, None, sizes, [(dst[0], tuple(dst[2]), dst_log.canon)], src
            )
        except NotAffine:  # give up on the whole storage
            dst_log.add(Entry(Box.full(dst_log.canon), src))

    def transfer(
        self,
        dst: Geometry,
        dst_log: StorageLog,
        src: Optional[torch.Tensor] = None,
        src_geom: Optional[Tuple[int, Vec]] = None,
        fixed: Optional[Fill] = None,
    ) -> None:
        """Write into the view ``dst`` = (offset, sizes, strides) of ``dst_log``: from the view
        ``src_geom`` = (offset, strides) of ``src`` (iterating ``sizes``), or the value ``fixed``.
        Sizes and strides are tuples (the box fast path memoises by them)."""
        d_off, sizes, d_str = dst
        if any(n == 0 for n in sizes):
            return
        src_log = None
        if src is not None:
            src_log = self.prov(src)
            if src_log.itemsize != src.element_size():
                self.not_affine.append("dtype view of a tracked storage")
                self.mark_computed(dst_log, dst, Opaque("dtype-view", self.deps(src)))
                return
        if self.transfers.box(dst_log, d_off, sizes, d_str, src_log, src_geom, fixed):
            return
        sides: List[Side] = [(d_off, tuple(d_str), dst_log.canon)]
        if src_log is not None:
            sides.append((src_geom[0], tuple(src_geom[1]), src_log.canon))
        try:
            self.transfers.write(dst_log, src_log, sizes, sides, fixed)
        except NotAffine as e:
            self.not_affine.append(str(e))
            self.mark_computed(
                dst_log,
                dst,
                Opaque(
                    "not-affine", self.deps(src) if src is not None else frozenset()
                ),
            )

    # ------------------------------------------------------------------ the mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        facts = self._ops.get(func)
        if facts is None:
            facts = self._ops[func] = OpFacts.of(func)
        if facts.pure_view:
            return func(
                *args, **kwargs
            )  # one input, so no device mix; offset and strides say everything
        if func is aten._local_scalar_dense.default:
            return self._item(args[0])
        if func is not aten.copy_.default and _mixes_meta(tensors_in((args, kwargs))):
            args, kwargs = (
                self._on_meta(args),
                {k: self._on_meta(v) for k, v in kwargs.items()},
            )
        out = func(*args, **kwargs)
        try:
            self._track(func, facts, args, kwargs, out)
        except NotAffine as e:
            self.not_affine.append(f"{func}: {e}")
        return out

    def _track(self, func, facts: OpFacts, args, kwargs, out) -> None:
        """Record what ``func`` wrote, by its handler in ``derive.recorded_ops``."""
        if facts.in_place is not None:
            facts.in_place(self, args)
            return
        written = []
        for position, name in facts.mutated:
            written.extend(
                tensors_in(args[position] if position < len(args) else kwargs.get(name))
            )
        inputs = tensors_in((args, kwargs))
        for t in inputs:
            self.prov(t)  # so that views of untracked storages are seen as views
        if written:
            computed_in_place(self, func, inputs, written)
            return
        outs = [t for t in tensors_in(out) if self.key(t) not in self.storages]
        if not outs:
            return  # views (or no tensor output): the strides already say everything
        for t in outs:
            self.register(t, StorageKind.DERIVED)
        facts.allocating(self, func, args, kwargs, outs)

    def _on_meta(self, x):
        """Meta twins (same provenance) of the real float tensors an op mixes with meta ones:
        a loader's padding made on an explicit device, concatenated with a checkpoint tensor."""
        if (
            isinstance(x, torch.Tensor)
            and x.device.type != "meta"
            and x.is_floating_point()
        ):
            twin = x.to("meta")  # inside the mode's dispatch: not recorded
            self.register(twin, StorageKind.DERIVED)
            self.copy(twin, x)
            return twin
        if isinstance(x, (list, tuple)):
            return type(x)(self._on_meta(y) for y in x)
        return x

    def _item(self, t: torch.Tensor):
        """``.item()``: a constant's value, else a sentinel that ``scalar_source`` maps back."""
        log = self.prov(t)
        parts = self.transfers.read(
            log, (), (), unravel(t.storage_offset(), log.canon), []
        )
        src = parts[-1].src if parts else Opaque("uninitialised", frozenset())
        if isinstance(src, Const):
            value = src.value
        else:
            value = float(_SENTINEL_BASE - len(self.sentinels))
            self.sentinels[value] = (
                LeafElement(src.name, src.l0) if isinstance(src, LeafRead) else src
            )
        if t.dtype == torch.bool:
            return bool(value)
        if not t.dtype.is_floating_point and not t.dtype.is_complex:
            return int(value)
        return value

    # ------------------------------------------------------------------ results
    def describe(self, t: torch.Tensor) -> List[Entry]:
        """What ``t`` holds, as disjoint entries in ``t``'s own coordinates."""
        shape = tuple(t.shape) if t.dim() else (1,)
        strides = tuple(t.stride()) if t.dim() else (1,)
        src_log = self.prov(t)
        if (
            src_log.canon == shape
            and t.storage_offset() == 0
            and strides == cstrides(shape)
        ):
            return (
                src_log.resolved()
            )  # the tensor is its storage, as laid out at allocation
        tmp = StorageLog(shape, t.element_size(), None, StorageKind.VIEW)
        sides: List[Side] = [
            (0, cstrides(shape), shape),
            (t.storage_offset(), strides, src_log.canon),
        ]
        try:
            self.transfers.write(tmp, src_log, shape, sides, None)
        except NotAffine as e:
            tmp.add(Entry(Box.full(shape), Opaque(f"not-affine: {e}", self.deps(t))))
        return tmp.resolved()
