"""One update's block-FP8 staging on an engine rank that receives now and writes later.

A remote engine (``remote.engine``) receives its regions while it serves and writes them in
a short pause. For its block-FP8 weights (``fp8_targets``) the plan's destinations are
buffers in the unquantized dtype, not the e4m3 parameters: ``Fp8Staging`` holds them for
the pause only (the regions wait in the engine's own staging while it serves; the plan is
checked against the live weights, whose shapes the staged buffers have), says what refuses
the update before any byte moves (a piece that cuts a 128-block), and after the pause wrote
every region, quantizes the delivered blocks into the e4m3 weights and float32 scales in
place through ``apply.write_quantized`` (the one apply step the colocated paths use too),
then lets the buffers go. Blocks a trainer rank quantized (``fp8_wire``) are written
straight into the e4m3 weights and scales (``land``) and left out of that step.

The buffers live for one pause only. A delta update (``delta_rounds``) takes the delta of
the blocks a trainer rank quantized after quantization, against the live e4m3 weights and
scales (``live``, which the receiving reads); for the pieces quantized here the engine
keeps a copy of what the pause wrote into these buffers, only those pieces and only while
its group runs delta updates (``delta_rounds.KeptStaging``, host memory), so a buffer made
afresh each pause still gets every piece of every block it quantizes.
"""

from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)

import torch

from sglang.srt.weight_sync.apply import write_quantized
from sglang.srt.weight_sync.fp8_sender import SenderFp8Plan
from sglang.srt.weight_sync.fp8_targets import (
    EngineBlockFp8,
    QuantizedParam,
    staging_buffers,
)
from sglang.srt.weight_sync.target_layout import ParamTarget, restrict

if TYPE_CHECKING:  # fp8_wire imports the executor, which the staging never runs
    from sglang.srt.weight_sync.fp8_wire import QuantizedLanding

__all__ = ("Fp8Staging",)


class Fp8Staging:
    """One engine rank's block-FP8 weights during one update: the staged buffers (the
    plan's destinations for their pieces, made for the pause), the live e4m3 weights and
    float32 scales they are quantized into, and the HF tensors the update delivers (heard
    with its header)."""

    def __init__(
        self,
        fp8: EngineBlockFp8,
        targets: Iterable[ParamTarget],
        aliases: Mapping[str, str],
        live: Mapping[str, torch.Tensor],
        device: torch.device,
        who: str,
    ) -> None:
        self.fp8, self.who = fp8, who
        self.quantized: Tuple[QuantizedParam, ...] = fp8.own.quantized
        names = {q.weight for q in self.quantized}
        self.targets = tuple(t for t in targets if t.name in names)
        self.aliases = dict(aliases)
        self.device = device
        self.staged: Dict[str, torch.Tensor] = {}
        self.live: Dict[str, torch.Tensor] = {}
        for q in self.quantized:
            self.live[q.weight] = live[q.weight].data
            self.live[q.scale] = live[q.scale].data
        self.delivered: Optional[Tuple[str, ...]] = None

    @classmethod
    def of(
        cls, layout, rank: int, device: torch.device, who: str
    ) -> Optional[Fp8Staging]:
        """The staging of ``layout`` (an ``engine_layout.LiveLayout``) on TP rank ``rank``;
        None when the engine has no block-FP8 weight."""
        if layout.fp8 is None:
            return None
        return cls(
            layout.fp8,
            layout.targets.for_rank(rank),
            layout.targets.aliases,
            layout.tensors,
            device,
            who,
        )

    def check(self, names: Iterable[str]) -> List[str]:
        """What refuses this update before any byte moves; records the HF tensors it
        delivers (``names``), whose blocks ``quantize`` writes (a delta update's too)."""
        self.delivered = tuple(sorted(names))
        return [f"{self.who}: {p}" for p in self.fp8.own.problems]

    def params(self, params: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``params`` with the staged buffers (made on first use: in the pause) in place of
        the e4m3 weights: where the pause writes their pieces."""
        if not self.staged:
            self.staged = staging_buffers(self.quantized, self.device)
        return {**params, **self.staged}

    def land(self, landings: Sequence[QuantizedLanding]) -> int:
        """Write blocks their senders quantized (``fp8_wire``) straight into the live e4m3
        weights and scales, in the pause; the bytes they held."""
        return sum(x.land(self.live) for x in landings)

    def quantize(
        self, sender: Optional[SenderFp8Plan] = None, rank: Optional[int] = None
    ) -> int:
        """Quantize every delivered block from staging into the live weights and scales, in
        place (``apply.write_quantized``), but those ``sender`` sent quantized to ``rank``
        (its group rank; ``land`` wrote them); the e4m3 bytes written. Called once every
        region of the update was written into the staging."""
        if self.delivered is None:
            raise RuntimeError(
                f"{self.who}: block-FP8 staging quantized before the update was heard"
            )
        delivered = restrict(self.targets, self.delivered, self.aliases)
        if sender is not None:
            delivered = sender.engine_targets(delivered, rank)
        written = write_quantized(self.quantized, delivered, self.staged, self.live)
        self.staged = {}  # the caller's params still hold them until its pause ends
        return written
