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

from sglang.srt.weight_sync.delivery import DEFAULT_TIMEOUT_S
from sglang.srt.weight_sync.megatron_layout import MegatronRank, describe_model_chunks, megatron_sources
from sglang.srt.weight_sync.planner import DEFAULT_BUCKET_BYTES
from sglang.srt.weight_sync.source_layout import HoldersSpec
from sglang.srt.weight_sync.trainer_flow import Flow, Mode, deliver, open_channel, sources_flow

_coords: Dict[MegatronRank, Dict[int, MegatronRank]] = {}


def this_rank() -> MegatronRank:
    """This rank's coordinates, from megatron-core's parallel state."""
    from megatron.core import parallel_state as ps

    return MegatronRank(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                        ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())


def all_coords(me: MegatronRank) -> Dict[int, MegatronRank]:
    """Every trainer rank's coordinates: four integers per rank, all-gathered once."""
    if me not in _coords:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        mine = torch.tensor([me.tp, me.pp, me.ep, me.etp], dtype=torch.int64, device=device)
        every = torch.empty(dist.get_world_size() * 4, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(every, mine)
        _coords[me] = {r: MegatronRank(*row) for r, row in enumerate(every.view(-1, 4).tolist())}
    return _coords[me]


def megatron_flow(
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
    chan = open_channel(group_ranks, group)
    me = this_rank()
    model, buffers = describe_model_chunks(model_chunks, hf_vocab, me, shared_expert_hf)
    buffers = {k: t.detach() for k, t in buffers.items()}
    sources = megatron_sources(model, all_coords(me))

    def deliver_beside() -> str:
        mine = set(chan.group_ranks)
        pieces = {n: HoldersSpec(s.shape, s.dtype, tuple(h for h in s.holders if h.rank in mine))
                  for n, s in sources.items()}
        used = sorted({h.buffer for spec in pieces.values() for h in spec.holders if h.rank == dist.get_rank()})
        return deliver(chan, [(key, buffers[key], None) for key in used], pieces)

    return (yield from sources_flow(chan, sources, buffers, deliver_beside, mode, bucket_bytes, timeout_s))
