"""The trainer side of a distributed weight update from Megatron-core, on every rank
(``VerlEngine.update_weights_from_megatron`` drives ``megatron_flow``).

Each rank describes its own local parameters as pieces of HF tensors
(``megatron_layout``: from the model chunks, the config and its parallel
coordinates; no data touched) and learns every other rank's coordinates with one
small integer all-gather (made once). Tensors the trainer ranks beside an engine
hold between them (TP, DP replicas) go as they are: the fused local buffers plus
``HoldersSpec``s, resharded by the engine into its own layout. When they do not hold
everything (other PP stages, other EP ranks), the update runs on the trainer side in
one hop straight to the engine's published layout (``trainer_flow.sources_flow``,
the same path as DTensor sources), each rank receiving exactly the bytes its engine
rank lacks, in the engine's dtype. Nothing is gathered; delivery, validation and
refusals are those of ``trainer_flow`` and ``engine_update``.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.megatron_layout import (
    MegatronRank,
    describe_model_chunks,
    megatron_sources,
)
from sglang.srt.weight_sync.protocol import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S
from sglang.srt.weight_sync.source_layout import HoldersSpec
from sglang.srt.weight_sync.trainer_flow import (
    Flow,
    Mode,
    TrainerSync,
    deliver,
    sources_flow,
)

__all__ = ("all_coords", "megatron_flow", "this_rank")


def this_rank() -> MegatronRank:
    """This rank's coordinates, from megatron-core's parallel state."""
    from megatron.core import parallel_state as ps

    return MegatronRank(
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_tensor_parallel_rank(),
    )


def all_coords(
    sync: TrainerSync, me: MegatronRank, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Dict[int, MegatronRank]:
    """Every trainer rank's coordinates: four integers per rank, all-gathered once per
    ``sync`` (they do not change while the trainer runs)."""
    if me not in sync.megatron_coords:
        every = sync.world.all_gather_ints(
            [me.tp, me.pp, me.ep, me.etp],
            timeout_s,
            f"trainer rank {dist.get_rank()}: learning every rank's Megatron coordinates",
        )
        sync.megatron_coords[me] = {
            r: MegatronRank(*row) for r, row in enumerate(every)
        }
    return sync.megatron_coords[me]


def megatron_flow(
    sync: TrainerSync,
    model_chunks: Sequence[torch.nn.Module],
    hf_vocab: int,
    group_ranks: Sequence[int],
    group: Optional[dist.ProcessGroup],
    mode: Mode = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    shared_expert_hf: str = "shared_experts",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Flow:
    """One update from this rank's Megatron-core ``model_chunks``, as the control requests
    the engine must serve (``trainer_flow.drive``); every trainer rank runs it together.
    Engine-side, this rank's fused buffers go as they are with ``HoldersSpec``s for the
    ranks beside its engine; trainer-side (PP, EP, an engine wider than the ranks beside
    it), one hop straight to the engine's published layout."""
    chan = sync.channel(group_ranks, group, timeout_s)
    me = this_rank()
    model, buffers = describe_model_chunks(model_chunks, hf_vocab, me, shared_expert_hf)
    buffers = {k: t.detach() for k, t in buffers.items()}
    sources = megatron_sources(model, all_coords(sync, me, timeout_s))

    def deliver_beside() -> str:
        mine = set(chan.group_ranks)
        pieces = {
            n: HoldersSpec(
                s.shape, s.dtype, tuple(h for h in s.holders if h.rank in mine)
            )
            for n, s in sources.items()
        }
        used = sorted(
            {
                h.buffer
                for spec in pieces.values()
                for h in spec.holders
                if h.rank == dist.get_rank()
            }
        )
        return deliver(chan, [(key, buffers[key], None) for key in used], pieces)

    return (
        yield from sources_flow(
            sync, chan, sources, buffers, deliver_beside, mode, bucket_bytes, timeout_s
        )
    )
