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
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.delivery import DeliveryError, Payload, ShardReceiver
from sglang.srt.weight_sync.executor import ExecutionError, agree_on_plan, check_inputs, execute
from sglang.srt.weight_sync.manifest import EngineManifest, write_manifest
from sglang.srt.weight_sync.planner import DEFAULT_BUCKET_BYTES, CoverageError, PlanCache
from sglang.srt.weight_sync.source_layout import LayoutError
from sglang.srt.weight_sync.target_layout import EngineParallel, ModelTargets, model_targets_from_config
from sglang.srt.weight_sync.trainer_side import check_buffers, copy_buffers, restrict

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
    """Validate, agree, plan and execute on this rank; every TP rank calls it together.

    A "params" payload (trainer-side resharding) is only copied in place; a
    "describe" payload publishes this engine's manifest into the channel.
    """
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    rank, cpu_group, device_group = par.tp_rank, par.tp_group.cpu_group, par.tp_group.device_group
    problems: List[str] = []
    the_plan, params, shards, local_step = None, {}, {}, None
    if received.error:
        problems.append(received.error)
    else:
        try:
            parallel = EngineParallel(par.tp_size, par.attn_tp_size, par.moe_ep_size)
            targets, params = engine_targets(model, model_config.hf_config, parallel, rank)
            if received.payload.kind != "shards":
                local_step = _published_layout_step(received.payload, targets, params, rank, recv_req.channel)
                problems += local_step.problems
            else:
                sources, shards = _sources(received.payload, targets, rank)
                needed = {r: restrict(targets.for_rank(r), sources, targets.aliases) for r in range(par.tp_size)}
                the_plan = _plans.get(sources, needed, bucket_bytes=recv_req.bucket_bytes or DEFAULT_BUCKET_BYTES,
                                      aliases=targets.aliases)
                problems += check_inputs(the_plan, rank, shards, params)
        except (LayoutError, CoverageError, ValueError, KeyError) as e:
            problems.append(f"engine rank {rank}: {e}")
    everyone = _share_problems(problems, rank, par.tp_size, cpu_group)
    if everyone:
        return False, "distributed weight update refused, no parameter changed: " + "; ".join(everyone)
    if local_step is not None:
        return True, local_step.run()
    try:
        agree_on_plan(the_plan, cpu_group)
    except ExecutionError as e:
        return False, f"distributed weight update refused, no parameter changed: {e}"
    stats = execute(the_plan, rank, shards, params, group=device_group)
    return True, (
        f"Success (engine-side resharding): rank {rank} received {stats.bytes_received} bytes "
        f"(lower bound {the_plan.lower_bound_bytes(rank)}), staged at most {stats.peak_staging_bytes}"
    )


@dataclass
class _LocalStep:
    """A trainer-side update's local work on this rank, run once every rank agreed."""

    problems: List[str]
    run: Callable[[], str]


def _published_layout_step(payload: Payload, targets: ModelTargets, params, rank: int, channel: str) -> _LocalStep:
    """"describe": publish the manifest. "params": check the buffers the trainer
    planned against this engine's manifest, then copy them in place."""
    manifest = EngineManifest.of(targets)
    if payload.kind == "describe":
        def publish() -> str:
            path = write_manifest(channel, rank, manifest)
            return f"Success: published the engine layout ({manifest.fingerprint[:12]}) at {path}"

        return _LocalStep([], publish)
    if payload.fingerprint != manifest.fingerprint:
        return _LocalStep([
            f"engine rank {rank}: the trainer planned against engine layout {payload.fingerprint[:12]!r}, "
            f"the engine's is now {manifest.fingerprint[:12]!r} (the trainer re-reads it on the next update)"
        ], lambda: "")
    wanted = [t for t in restrict(targets.for_rank(rank), payload.names, targets.aliases) if t.name in payload.tensors]
    unknown = sorted(set(payload.tensors) - {t.name for t in wanted})
    problems = [f"engine rank {rank}: buffers {unknown[:3]} are not parameters this update fills"] if unknown else []

    def copy() -> str:
        copied = copy_buffers(params, wanted, payload.tensors)
        return f"Success (trainer-side resharding): rank {rank} received 0 bytes, copied {copied} bytes locally"

    return _LocalStep(problems + check_buffers(params, wanted, payload.tensors, rank), copy)


def engine_targets(
    model: torch.nn.Module, hf_config, parallel: EngineParallel, rank: int
) -> Tuple[ModelTargets, Dict[str, torch.Tensor]]:
    """Target rules for this engine, checked against the live parameters of ``rank``.

    Returns the rules (with each parameter's live dtype) and this rank's
    parameters by name. A live parameter that differs from what the rules
    describe means the layout is not one this package knows: refuse.
    """
    heads = getattr(hf_config, "num_attention_heads", None)
    original = getattr(hf_config, "original_num_attention_heads", heads)
    if original != heads:
        raise ValueError(
            f"SGLang padded this model's heads for TP {parallel.tp_size} ({original} -> {heads}; its CPU engine "
            "does this when heads do not divide TP); distributed updates need an unpadded layout"
        )
    targets = model_targets_from_config(hf_config, parallel, next(model.parameters()).dtype)
    live = dict(model.named_parameters())
    params: Dict[str, torch.Tensor] = {}
    for target in targets.for_rank(rank):
        param = live.get(target.name)
        if param is None:
            raise ValueError(f"the model has no parameter {target.name!r} that the layout rules describe")
        if tuple(param.shape) != target.shape:
            raise ValueError(
                f"parameter {target.name!r} has shape {tuple(param.shape)} on rank {rank}, "
                f"the layout rules expect {target.shape}"
            )
        params[target.name] = param.data  # written in place: CUDA graphs hold this storage
    return dataclasses.replace(targets, dtype_of={n: p.dtype for n, p in params.items()}), params


def _sources(payload: Payload, targets: ModelTargets, rank: int):
    """Source layout from the payload's specs; refuses names and shapes the model does not have."""
    expected = targets.tensor_shapes()
    sources, shards = {}, {}
    for name, spec in payload.specs.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        canonical = targets.aliases.get(name, name)
        if canonical not in expected:
            raise KeyError(f"unknown tensor {name!r}: not a weight of this model")
        if spec.shape != expected[canonical]:
            raise ValueError(f"tensor {name!r}: global shape {spec.shape}, the model expects {expected[canonical]}")
        if not spec.dtype.is_floating_point:
            raise ValueError(f"tensor {name!r}: dtype {spec.dtype} cannot be cast to the model's floating dtype")
        sources[name] = spec.describe(name, payload.rank_map)
        shards[name] = payload.tensors[name]
    return sources, shards


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
