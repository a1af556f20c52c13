"""The engine side of a distributed weight update, called by thin hooks in SGLang.

Per TP rank: receive the shards the trainer rank beside it delivered
(``receive_shards``), then for each model runner (``apply_shards``): derive
the source layout from the payload and the target layout from the live model,
validate everything, agree with every TP rank that nothing is wrong, and only
then plan and execute, writing parameters in place. A problem on any rank
(no payload, stale update, unknown name, wrong global shape, uncastable dtype,
a tensor the delivered shards do not cover) fails the whole update on every
rank before a single parameter changes, with messages naming tensor and rank.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.delivery import DeliveryError, Payload, ShardReceiver
from sglang.srt.weight_sync.executor import ExecutionError, agree_on_plan, check_inputs, execute
from sglang.srt.weight_sync.planner import DEFAULT_BUCKET_BYTES, CoverageError, PlanCache
from sglang.srt.weight_sync.source_layout import LayoutError
from sglang.srt.weight_sync.derived_targets import DerivedTargets, refresh_after_update
from sglang.srt.weight_sync.target_cache import engine_derived_targets
from sglang.srt.weight_sync.target_layout import ParamTarget

logger = logging.getLogger(__name__)

# Reserved load_format that routes the existing tensor path (and so existing callers such as
# verl's HTTP client) to the distributed update; the per-rank payload is then a small dict.
DISTRIBUTED_LOAD_FORMAT = "distributed_shards"
# Checkpoint names SGLang's own loaders skip; trainers may send them.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
MESSAGE_BYTES = 2048  # per rank, in the all-reduce that shares problems

_receiver: Optional[ShardReceiver] = None
_plans = PlanCache()


@dataclass
class ReceivedShards:
    """This rank's payload, or why there is none."""

    payload: Optional[Payload]
    error: Optional[str] = None


def receive_shards(recv_req) -> ReceivedShards:
    """Take this TP rank's payload for ``recv_req.update_id`` from its channel socket."""
    global _receiver
    from sglang.srt.runtime_context import get_parallel

    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # CUDA IPC handles name GPUs by UUID (no effect on CPU tensors)
    rank = get_parallel().tp_rank
    if _receiver is None:
        _receiver = ShardReceiver(rank)
    try:
        return ReceivedShards(_receiver.receive(recv_req.channel, recv_req.update_id, recv_req.timeout_s))
    except (DeliveryError, OSError, KeyError, ValueError) as e:
        return ReceivedShards(None, f"engine rank {rank}: {e}")


def as_distributed_request(recv_req, own_payload: dict):
    """The distributed request behind a tensor-path request with the reserved load_format."""
    from sglang.srt.managers.io_struct import UpdateWeightsDistributedReqInput

    return UpdateWeightsDistributedReqInput(
        update_id=own_payload["update_id"],
        channel=own_payload["channel"],
        timeout_s=own_payload.get("timeout_s", 120.0),
        bucket_bytes=own_payload.get("bucket_bytes"),
        flush_cache=recv_req.flush_cache,
        abort_all_requests=recv_req.abort_all_requests,
        weight_version=recv_req.weight_version,
        selector=recv_req.selector,
        torch_empty_cache=recv_req.torch_empty_cache,
    )


def apply_shards(model: torch.nn.Module, model_config, received: ReceivedShards, recv_req) -> Tuple[bool, str]:
    """Validate, agree, plan and execute on this rank; every TP rank calls it together."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    rank, cpu_group, device_group = par.tp_rank, par.tp_group.cpu_group, par.tp_group.device_group
    problems: List[str] = []
    the_plan, params, shards = None, {}, {}
    if received.error:
        problems.append(received.error)
    else:
        try:
            targets, params = engine_targets(model, model_config, rank)
            sources, shards = _sources(received.payload, targets, rank)
            needed = {r: _restrict(targets.for_rank(r), sources, targets) for r in range(par.tp_size)}
            the_plan = _plans.get(sources, needed, bucket_bytes=recv_req.bucket_bytes or DEFAULT_BUCKET_BYTES,
                                  aliases=targets.aliases)
            problems += check_inputs(the_plan, rank, shards, params)
        except (LayoutError, CoverageError, ValueError, KeyError) as e:
            problems.append(f"engine rank {rank}: {e}")
    everyone = _share_problems(problems, rank, par.tp_size, cpu_group)
    if everyone:
        return False, "distributed weight update refused, no parameter changed: " + "; ".join(everyone)
    try:
        agree_on_plan(the_plan, cpu_group)
    except ExecutionError as e:
        return False, f"distributed weight update refused, no parameter changed: {e}"
    stats = execute(the_plan, rank, shards, params, group=device_group)
    # Tensors computed from parameters in weight loaders (Gemma norms) are refreshed here, those
    # computed by post-load processing (MLA's w_kc/w_vc) by end_weight_update(); both in place.
    refresh_after_update(model)
    return True, (
        f"Success: rank {rank} received {stats.bytes_received} bytes "
        f"(lower bound {the_plan.lower_bound_bytes(rank)}), staged at most {stats.peak_staging_bytes}"
    )


def engine_targets(model: torch.nn.Module, model_config, rank: int) -> Tuple[DerivedTargets, Dict[str, torch.Tensor]]:
    """This engine's targets, derived from SGLang's own loaders (``target_cache``), checked
    against the live tensors of ``rank``.

    Returns the targets (with each parameter's live dtype) and this rank's tensors by
    name. A live tensor that differs from its derived shape means the engine was not
    built the way the derivation rebuilt it: refuse.
    """
    targets = engine_derived_targets(model_config)
    live = dict(model.named_parameters())
    live.update((n, b) for n, b in model.named_buffers() if n not in live)
    params: Dict[str, torch.Tensor] = {}
    for target in targets.for_rank(rank):
        param = live.get(target.name)
        if param is None:
            raise ValueError(f"the model has no parameter {target.name!r} that SGLang's loader writes on rank {rank}")
        if tuple(param.shape) != target.shape:
            raise ValueError(
                f"parameter {target.name!r} has shape {tuple(param.shape)} on rank {rank}, "
                f"SGLang's loader (derived on meta) writes {target.shape}"
            )
        params[target.name] = param.data  # written in place: CUDA graphs hold this storage
    return dataclasses.replace(targets, dtype_of={n: p.dtype for n, p in params.items()}), params


def _sources(payload: Payload, targets: DerivedTargets, rank: int):
    """Source layout from the payload's specs; refuses names and shapes the model does not have,
    and tensors SGLang's loader does not copy (quantised, computed: an update cannot write them)."""
    expected = targets.tensor_shapes()
    sources, shards = {}, {}
    for name, spec in payload.specs.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        canonical = targets.aliases.get(name, name)
        if canonical not in expected:
            raise KeyError(f"unknown tensor {name!r}: not a weight of this model")
        if canonical in targets.not_copied:
            raise ValueError(f"tensor {name!r} is not a copy in SGLang's loader: {targets.not_copied[canonical]}")
        if spec.shape != expected[canonical]:
            raise ValueError(f"tensor {name!r}: global shape {spec.shape}, the model expects {expected[canonical]}")
        if not spec.dtype.is_floating_point:
            raise ValueError(f"tensor {name!r}: dtype {spec.dtype} cannot be cast to the model's floating dtype")
        sources[name] = spec.describe(name, payload.rank_map)
        shards[name] = payload.tensors[name]
    return sources, shards


def _restrict(wanted: List[ParamTarget], sources, targets: DerivedTargets) -> List[ParamTarget]:
    """Only the pieces this update delivers: a trainer may send its weights in batches."""
    delivered = {targets.aliases.get(n, n) for n in sources}
    out = []
    for t in wanted:
        pieces = tuple(p for p in t.pieces if p.tensor in delivered)
        if pieces:
            out.append(dataclasses.replace(t, pieces=pieces))
    return out


def _share_problems(problems: List[str], rank: int, world: int, group) -> List[str]:
    """Every rank's problems, on every rank, through one small all-reduce (no object gather)."""
    if problems:
        logger.error("distributed weight update, rank %d: %s", rank, "; ".join(problems))
    text = "; ".join(problems).encode()[:MESSAGE_BYTES]
    table = torch.zeros(world, MESSAGE_BYTES, dtype=torch.uint8)
    if text:
        table[rank, : len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    dist.all_reduce(table, group=group)
    return [bytes(row[row.nonzero().flatten()].tolist()).decode(errors="replace") for row in table if row.any()]
