"""One engine TP rank's layout for updates: what its parameters need, in what dtypes.

The colocated path (``EngineWeightSync``) and remote engines (``RemoteEngineSync``) hold
the same ``EngineLayout`` (``EngineLayout.of(owner, rank)``, kept on the tp worker or
model runner): the derived targets are derived once per model config, checked against SGLang's
real loaders once, and published once, whichever path updates the engine. Neither sync
reaches into the other (docs/design.md, "State and lifetimes").
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from sglang.srt.weight_sync.derive import DerivedTargets, engine_derived_targets
from sglang.srt.weight_sync.planner import targets_key
from sglang.srt.weight_sync.sglang_compat import update_refusals

# isort: split
# pr: fp8
from sglang.srt.weight_sync.fp8_targets import EngineBlockFp8, engine_block_fp8

# pr: fp8 end

# isort: split
# pr: scale
from sglang.srt.weight_sync.derive import ProvenanceCheck
from sglang.srt.weight_sync.manifest import EngineManifest
from sglang.srt.weight_sync.protocol import resolve_channel
from sglang.srt.weight_sync.wire_dtypes import engine_dtypes, write_dtypes

# pr: scale end

__all__ = (
    # pr: scale
    "CHANNELS_TOLD",
    # pr: scale end
    "EngineLayout",
    "LiveLayout",
    "live_tensors",
    "targets_digest",
)

logger = logging.getLogger(__name__)

# pr: scale
# channels remembered as told of the engine's dtypes (then told again)
CHANNELS_TOLD = 64
# pr: scale end


@dataclasses.dataclass(frozen=True)
class LiveLayout:
    """The derived targets with each parameter's live dtype, this rank's live tensors by
    name (written in place: CUDA graphs hold their storage), a digest that identifies those
    targets (``digest``: the plan's inputs, agreed by the TP ranks, and the plan caches'
    keys) and every live tensor of the model (``tensors``); for a block-FP8 engine, the
    targets' transform (``fp8``)."""

    targets: DerivedTargets
    params: Dict[str, torch.Tensor]
    digest: str
    tensors: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # pr: fp8
    fp8: Optional[EngineBlockFp8] = None

    @property
    def block_fp8_weights(self) -> int:
        """How many of this rank's weights are block-FP8 (0 for other engines)."""
        return len(self.fp8.own.quantized) if self.fp8 is not None else 0

    # pr: fp8 end
    # pr: scale
    # the manifest of the targets (made by ``EngineLayout.live``, always; its fingerprint
    # is ``digest``)
    manifest: Optional[EngineManifest] = None
    # pr: scale end


class EngineLayout:
    """One engine TP rank's targets (derived, then with live dtypes), their digest, the
    provenance check of each derivation, the block-FP8 transform of the targets
    (``fp8_targets``) and why the model cannot be updated in place at all
    (``sglang_compat.update_refusals``)."""

    # pr: scale
    # Also the dtype each HF tensor is kept in, written into each channel (``kept_dtypes``).
    # pr: scale end

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # model config key -> derived targets (``derive.engine_derived_targets``' memo)
        self._derived: Dict[tuple, DerivedTargets] = {}
        # (derived targets, live dtypes, the targets with them, their digest)
        self._live: Optional[Tuple[DerivedTargets, tuple, DerivedTargets, str]] = None
        # pr: scale
        self._manifest: Optional[EngineManifest] = None  # of the targets in ``_live``
        # (manifest fingerprint, the dtype each HF tensor is kept in, channels told of it)
        self._kept: Optional[Tuple[str, Dict[str, torch.dtype], set]] = None
        self._provenance = ProvenanceCheck()
        # pr: scale end
        # pr: fp8
        # (derived targets, their block-FP8 transform or None): see block_fp8
        self._fp8: Optional[Tuple[DerivedTargets, Optional[EngineBlockFp8]]] = None
        # pr: fp8 end
        # (the model, why an update of it is refused): see refusals
        self._refusals: Optional[Tuple[torch.nn.Module, List[str]]] = None

    @classmethod
    def of(cls, owner, rank: int) -> EngineLayout:
        """The layout kept on ``owner`` (the tp worker, or the model runner on older
        releases), made on first use."""
        layout = getattr(owner, "_weight_sync_layout", None)
        if layout is None:
            layout = owner._weight_sync_layout = cls(rank)
        return layout

    def derived(
        self, model_config, share: Callable[[bytes], List[bytes]]
    ) -> DerivedTargets:
        """Every TP rank's targets from SGLang's own loaders, memoised per model config; the
        first call is collective (``share``: the TP ranks exchange what each derived)."""
        return engine_derived_targets(model_config, self.rank, share, self._derived)

    # pr: scale
    def provenance_problems(self, model, derived: DerivedTargets) -> List[str]:
        """Where SGLang's real loaders, run once per ``derived`` on the live device, place
        something other than the targets say (``ProvenanceCheck``); empty when they agree."""
        return self._provenance.problems(model, derived, self.rank)

    # pr: scale end
    def live(
        self,
        model: torch.nn.Module,
        derived: DerivedTargets,
        # pr: fp8
        block_fp8: bool = False,
        # pr: fp8 end
    ) -> LiveLayout:
        """``derived`` checked against this rank's live tensors: a live tensor whose shape
        differs from its derived one means the engine was not built the way the derivation
        rebuilt it, refused (``ValueError`` naming the parameter)."""
        named = live_tensors(model)
        # block-FP8 weights: the dtype each is staged in, and its blocks
        staged: Dict[str, torch.dtype] = {}
        blocks: Dict[str, Tuple[int, int]] = {}
        # pr: fp8
        # A block-FP8 engine's weights are staged in their unquantized dtype (``fp8_targets``):
        # only a caller that quantizes them after its plan ran or from the buffers it received
        # (``block_fp8``: the colocated updates, engine-side and trainer-side, and remote
        # engines through ``fp8_staging``) may use them; any other is refused, naming a
        # parameter.
        fp8 = self.block_fp8(derived, named)
        if fp8 is not None:
            if not block_fp8:
                raise ValueError(
                    f"block-FP8 parameter {fp8.own.quantized[0].weight!r} (and "
                    f"{len(fp8.own.quantized) - 1} more) on rank {self.rank}: this caller "
                    "does not quantize what it stages (the engine-side, trainer-side and "
                    "remote updates do); nothing written"
                )
            derived = fp8.targets
            staged = {q.weight: q.staged_dtype for q in fp8.own.quantized}
            blocks = {q.weight: q.block for q in fp8.own.quantized}
        # pr: fp8 end
        params: Dict[str, torch.Tensor] = {}
        for target in derived.for_rank(self.rank):
            param = named.get(target.name)
            if param is None:
                raise ValueError(
                    f"the model has no parameter {target.name!r} that SGLang's loader "
                    f"writes on rank {self.rank}"
                )
            if tuple(param.shape) != target.shape:
                raise ValueError(
                    f"parameter {target.name!r} has shape {tuple(param.shape)} on rank "
                    f"{self.rank}, SGLang's loader (derived on meta) writes {target.shape}"
                )
            params[target.name] = param.data
        dtype_of = {n: p.dtype for n, p in params.items()}
        dtype_of.update(staged)
        targets, digest = self._with_live_dtypes(derived, dtype_of, blocks)
        layout = LiveLayout(targets, params, digest, named)
        # pr: fp8
        layout = dataclasses.replace(layout, fp8=fp8)
        # pr: fp8 end
        # pr: scale
        layout = dataclasses.replace(layout, manifest=self._manifest)
        # pr: scale end
        return layout

    # pr: fp8

    def block_fp8(
        self, derived: DerivedTargets, live: Dict[str, torch.Tensor]
    ) -> Optional[EngineBlockFp8]:
        """The block-FP8 transform of ``derived`` on this rank (``fp8_targets``), None when no
        live parameter is e4m3: made once per derived targets, so that the staged targets keep
        their identity (and their digest and cached plans) across updates."""
        if self._fp8 is None or self._fp8[0] is not derived:
            self._fp8 = (derived, engine_block_fp8(derived, live, self.rank))
        return self._fp8[1]

    # pr: fp8 end

    def refusals(self, model: torch.nn.Module) -> List[str]:
        """Why an update of ``model`` must be refused before any write: what SGLang derived
        after loading and its post-load step cannot redo (``sglang_compat.update_refusals``).
        Decided at startup (SGLang's own rule for these caches), so walked once per model."""
        if self._refusals is None or self._refusals[0] is not model:
            found = [
                f"engine rank {self.rank}: {why}; refused before any write"
                for why in update_refusals(model)
            ]
            self._refusals = (model, found)
        return list(self._refusals[1])

    def _with_live_dtypes(
        self,
        derived: DerivedTargets,
        dtype_of: Dict[str, torch.dtype],
        blocks: Dict[str, Tuple[int, int]],
    ) -> Tuple[DerivedTargets, str]:
        """``derived`` with the live dtypes, and its digest (with the block-FP8 weights'
        ``blocks``, fixed by ``derived``): kept while both stay the same (every update of a
        run), as the digest hashes every rank's targets."""
        dtypes = tuple(sorted((n, str(d)) for n, d in dtype_of.items()))
        if (
            self._live is None
            or self._live[0] is not derived
            or self._live[1] != dtypes
        ):
            targets = dataclasses.replace(derived, dtype_of=dtype_of)
            digest = ""
            # pr: scale
            # with the manifest (made here, for the trainer), its fingerprint is the digest:
            # the targets are hashed once
            self._manifest = EngineManifest.of(targets, blocks)
            digest = self._manifest.fingerprint
            # pr: scale end
            self._live = (
                derived,
                dtypes,
                targets,
                digest or targets_digest(targets, blocks),
            )
        return self._live[2], self._live[3]

    # pr: scale
    def kept_dtypes(
        self, manifest: EngineManifest, channel: str
    ) -> Dict[str, torch.dtype]:
        """The dtype this engine keeps each HF tensor in (``wire_dtypes``): made once per
        layout, and written once into each channel for the trainer rank beside this one,
        which then casts while it copies its shards (a failed write only costs that)."""
        if self._kept is None or self._kept[0] != manifest.fingerprint:
            kept = engine_dtypes(manifest.ranks, manifest.aliases)
            self._kept = (manifest.fingerprint, kept, set())
        fingerprint, kept, told = self._kept
        if channel not in told:
            try:
                write_dtypes(
                    resolve_channel(channel, self.rank), self.rank, fingerprint, kept
                )
                if len(told) >= CHANNELS_TOLD:
                    told.clear()
                told.add(channel)
            except OSError as e:
                logger.warning(
                    "engine rank %d: could not write its dtypes into channel %s: %s",
                    self.rank,
                    channel,
                    e,
                )
        return kept

    # pr: scale end


def targets_digest(
    targets: DerivedTargets, blocks: Mapping[str, Tuple[int, int]]
) -> str:
    """A digest of every TP rank's ``targets`` and the block-FP8 weights' ``blocks``: what a
    plan and its cut for block-FP8 weights depend on (``planner.targets_key``), for the plan
    agreement and the plan caches, so that these hash the targets once per layout."""
    h = hashlib.sha256()
    p = targets.parallel
    h.update(repr((p.tp_size, p.attn_tp_size, p.moe_ep_size)).encode())
    for rank in range(p.tp_size):
        h.update(repr((rank, targets_key(targets.for_rank(rank)))).encode())
    h.update(
        repr(
            (
                sorted(targets.aliases.items()),
                sorted((n, tuple(s)) for n, s in targets.tensor_shapes().items()),
                sorted((n, tuple(b)) for n, b in blocks.items()),
            )
        ).encode()
    )
    return h.hexdigest()


def live_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The model's parameters and buffers by name (a parameter wins a shared name)."""
    live = dict(model.named_parameters())
    live.update((n, b) for n, b in model.named_buffers() if n not in live)
    return live
