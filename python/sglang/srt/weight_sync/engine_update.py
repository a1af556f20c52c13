"""The engine side of a distributed weight update, called by thin hooks in SGLang.

Per TP rank: receive the shards the trainer rank beside it delivered
(``receive_shards``), then for each model runner (``apply_shards``): derive
the source layout from the payload and the target layout from the live model,
validate everything, agree with every TP rank that nothing is wrong, and only
then plan and execute, writing parameters in place. A problem on any rank
(no payload, stale update, unknown name, wrong global shape, uncastable dtype,
a tensor the delivered shards do not cover) fails the whole update on every
rank before a single parameter changes, with messages naming tensor and rank.

The engine never dies of an update: every exception in receive, validate, plan
or apply becomes ``success=False`` with a message, and every wait is bounded by
the request's ``timeout_s`` (``control_plane``), so the schedulers keep serving.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from sglang.srt.weight_sync.answer_guard import MIXED
from sglang.srt.weight_sync.delivery import (
    DEFAULT_TIMEOUT_S,
    DeliveryError,
    Payload,
    ShardReceiver,
    check_timeout,
    resolve_channel,
)
from sglang.srt.weight_sync.executor import ExecutionError, agree_on_plan, check_inputs, execute
from sglang.srt.weight_sync.manifest import EngineManifest, write_manifest
from sglang.srt.weight_sync.planner import DEFAULT_BUCKET_BYTES, CoverageError, PlanCache
from sglang.srt.weight_sync.sglang_compat import after_update, field_names, subclass_with_field, tp_state
from sglang.srt.weight_sync.source_layout import LayoutError
from sglang.srt.weight_sync.derived_targets import DerivedTargets, refresh_after_update
from sglang.srt.weight_sync.target_cache import engine_derived_targets
from sglang.srt.weight_sync.target_layout import ParamTarget
from sglang.srt.weight_sync.trainer_reshard import check_buffers, copy_buffers, nonfinite_buffers, restrict
from sglang.srt.weight_sync.control_plane import GRACE_S, PeerLost, barrier, wait

logger = logging.getLogger(__name__)

# Reserved load_format that routes the existing tensor path (and so existing callers such as
# verl's HTTP client) to the distributed update; the per-rank payload is then a small dict.
DISTRIBUTED_LOAD_FORMAT = "distributed_shards"
# Checkpoint names SGLang's own loaders skip; trainers may send them.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
MESSAGE_BYTES = 2048  # per rank, in the all-reduce that shares problems
MIN_BUCKET_BYTES = 1 << 20  # smaller buckets only multiply rounds (a 1-byte bucket took minutes)
MAX_UPDATE_ID_CHARS = 256
REFUSED = "distributed weight update refused, no parameter changed: "
# Flags a tensor-path request and a distributed request share, where the release has them.
CARRIED_FIELDS = ("flush_cache", "abort_all_requests", "weight_version", "selector", "torch_empty_cache")

_receiver: Optional[ShardReceiver] = None
_plans = PlanCache()
# (derived targets, live dtypes, the targets with them, their manifest): see _with_live_dtypes
_layout_memo: Optional[Tuple[DerivedTargets, tuple, DerivedTargets, EngineManifest]] = None


# Our figures, one list entry per engine TP rank, in separate reply fields: the message keeps upstream's text.
FIGURES = ("bytes_received", "lower_bound_bytes", "peak_staging_bytes")


@dataclass
class ReceivedShards:
    """This rank's payload, or why there is none; after the update, every TP rank's figures
    (``FIGURES``, summed over the runners the update wrote)."""

    payload: Optional[Payload]
    error: Optional[str] = None
    figures: Dict[str, List[int]] = dataclasses.field(default_factory=dict)

    def reply(self, output_cls, success: bool, message: str):
        """The scheduler's reply: upstream's fields, plus the figures where ``output_cls`` has them
        (``UpdateWeightsDistributedReqOutput``; the tensor path keeps upstream's struct)."""
        extra = {k: v for k, v in self.figures.items() if k in getattr(output_cls, "__struct_fields__", ())}
        return output_cls(success=success, message=message, **extra)


def reply_body(success: bool, message: str, outputs) -> dict:
    """What ``Engine.update_weights_distributed`` and the HTTP route return: upstream's
    ``success``/``message`` and the figures of the (single data-parallel) scheduler's reply."""
    first = outputs[0] if outputs else None
    return {"success": success, "message": message, **{k: list(getattr(first, k, [])) for k in FIGURES}}


def request_problems(req) -> List[str]:
    """What is wrong with a request's own fields (empty when nothing): checked by the
    tokenizer manager before any scheduler sees the request, and again by each rank."""
    problems = []
    update_id, bucket = getattr(req, "update_id", None), getattr(req, "bucket_bytes", None)
    if not isinstance(update_id, str) or not 0 < len(update_id) <= MAX_UPDATE_ID_CHARS:
        problems.append(f"update_id={update_id!r}: must be a non-empty string of at most {MAX_UPDATE_ID_CHARS} "
                        "characters")
    try:
        check_timeout(getattr(req, "timeout_s", None))
        resolve_channel(getattr(req, "channel", None))
    except DeliveryError as e:
        problems.append(str(e))
    if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < MIN_BUCKET_BYTES):
        problems.append(f"bucket_bytes={bucket!r}: must be None (default {DEFAULT_BUCKET_BYTES}) or an integer "
                        f">= {MIN_BUCKET_BYTES} (1 MiB)")
    return problems


def receive_shards(recv_req) -> ReceivedShards:
    """Take this TP rank's payload for ``recv_req.update_id`` from its channel socket.
    Never raises: whatever goes wrong is this rank's refusal, shared in ``apply_shards``."""
    global _receiver
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    rank = tp_state().rank
    try:
        problems = [recv_req.problem] if isinstance(recv_req, _unreadable_request()) else request_problems(recv_req)
        if problems:
            return ReceivedShards(None, f"engine rank {rank}: " + "; ".join(problems))
        monkey_patch_torch_reductions()  # CUDA IPC handles name GPUs by UUID (no effect on CPU tensors)
        if _receiver is None:
            _receiver = ShardReceiver(rank)
        return ReceivedShards(_receiver.receive(recv_req.channel, recv_req.update_id, recv_req.timeout_s))
    except DeliveryError as e:  # its message names the engine rank
        return ReceivedShards(None, str(e))
    except Exception as e:  # noqa: BLE001 - the engine never dies of an update
        logger.exception("engine rank %d: receiving a distributed weight update failed", rank)
        return ReceivedShards(None, f"engine rank {rank}: receiving the payload failed: {type(e).__name__}: {e}")


@functools.lru_cache(maxsize=None)
def _unreadable_request():
    """The request type for a reserved-format payload that could not be read; carries why."""
    from sglang.srt.managers.io_struct import UpdateWeightsDistributedReqInput

    return subclass_with_field(UpdateWeightsDistributedReqInput, "UnreadableDistributedRequest", "problem", str, "")


def _carried(src, dst_cls) -> dict:
    """The flags of request ``src`` that request type ``dst_cls`` also has on this release."""
    accepted = field_names(dst_cls)
    return {f: getattr(src, f) for f in CARRIED_FIELDS if f in accepted and hasattr(src, f)}


def as_distributed_request(recv_req, deserialize_own_rank):
    """The distributed request behind a tensor-path request with the reserved load_format."""
    from sglang.srt.managers.io_struct import UpdateWeightsDistributedReqInput

    common = _carried(recv_req, UpdateWeightsDistributedReqInput)
    return _control_request(lambda: deserialize_own_rank(recv_req.serialized_named_tensors), common)


def as_tensor_request(obj, tp_size: int):
    """The tensor-path request carrying distributed update ``obj`` to ``tp_size`` engine ranks:
    each rank's payload is the update's control dict, marked by the reserved load_format."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer

    control = {"update_id": obj.update_id, "channel": obj.channel, "timeout_s": obj.timeout_s,
               "bucket_bytes": obj.bucket_bytes}
    return UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize(control) for _ in range(tp_size)],
        load_format=DISTRIBUTED_LOAD_FORMAT,
        **_carried(obj, UpdateWeightsFromTensorReqInput),
    )


def update_from_payload(model: torch.nn.Module, model_config, own_payload) -> Tuple[bool, str]:
    """The whole engine side on releases whose model runner is the only hook (0.5.10, 0.5.12):
    it hands over this rank's control payload; the scheduler flushes the cache as for any update.
    These releases have no weight-update session whose end would run the model's post-load
    fixups (MLA's w_kc/w_vc from kv_b_proj), so an update that wrote parameters runs them here,
    as the derived targets saw them run (``sglang_compat.after_update``)."""
    recv_req = _control_request(lambda: own_payload, {})
    received = receive_shards(recv_req)
    success, message = apply_shards(model, model_config, received, recv_req)
    if not success or received.payload.kind == "describe":
        return success, message
    try:
        with torch.no_grad():
            after_update(model)
    except Exception as e:  # noqa: BLE001 - every parameter is new, what is computed from them may not be
        logger.exception("engine rank %d: the post-load fixups after a distributed weight update failed",
                         tp_state().rank)
        return False, (f"distributed weight update FAILED after writes on engine rank {tp_state().rank}: the "
                       f"model's post-load fixups raised {type(e).__name__}: {e}: {MIXED} (parameters new, "
                       "tensors computed from them old); generation is refused until a distributed weight "
                       "update succeeds")
    return success, message


def _control_request(read_control, common: dict):
    """The distributed request from a control payload (``read_control()``) and the flags ``common``.
    A payload that cannot be read gives a request that every rank refuses together."""
    from sglang.srt.managers.io_struct import UpdateWeightsDistributedReqInput

    try:
        own = read_control()
        if not isinstance(own, dict):
            raise TypeError(f"the control payload is a {type(own).__name__}, not a dict")
        missing = [k for k in ("update_id", "channel") if k not in own]
        if missing:
            raise KeyError(f"the control payload lacks {missing}")
        return UpdateWeightsDistributedReqInput(
            update_id=own["update_id"], channel=own["channel"], timeout_s=own.get("timeout_s", DEFAULT_TIMEOUT_S),
            bucket_bytes=own.get("bucket_bytes"), **common,
        )
    except Exception as e:  # noqa: BLE001 - garbage, a blocked pickle, missing fields: refuse, never die
        problem = f"unreadable {DISTRIBUTED_LOAD_FORMAT!r} control payload: {type(e).__name__}: {e}"
        logger.error(problem)
        return _unreadable_request()(update_id="", channel="", problem=problem, **common)


def apply_shards(model: torch.nn.Module, model_config, received: ReceivedShards, recv_req) -> Tuple[bool, str]:
    """Validate, agree, plan and execute on this rank; every TP rank calls it together.

    A "params" payload (trainer-side resharding) is only checked and copied in
    place; a "describe" payload publishes this engine's manifest into the channel.
    """
    par = tp_state()
    rank, cpu_group, device_group = par.rank, par.cpu_group, par.device_group
    # every rank waited at most timeout_s for its payload before these collectives
    bound = _timeout(recv_req) + GRACE_S
    problems: List[str] = []
    the_plan, params, shards, local_step = None, {}, {}, None
    try:  # on every rank, even one without a payload: the first call is collective (target_cache)
        derived = engine_derived_targets(model_config, rank, functools.partial(
            _share_bytes, rank=rank, world=par.size, group=cpu_group, timeout_s=bound))
    except (ValueError, PeerLost) as e:
        derived = None
        problems.append(f"engine rank {rank}: {e}")
    except Exception as e:  # noqa: BLE001 - refuses the update, never kills the scheduler
        derived = None
        logger.exception("engine rank %d: the derived targets could not be assembled", rank)
        problems.append(f"engine rank {rank}: the derived targets could not be assembled: {type(e).__name__}: {e}")
    if received.error:
        problems.append(received.error)
    elif derived is not None:
        try:
            targets, params, manifest = engine_targets(model, derived, rank)
            if received.payload.kind != "shards":
                local_step = _published_layout_step(received.payload, targets, manifest, params, rank,
                                                    recv_req.channel)
                problems += local_step.problems
            else:
                sources, shards = _sources(received.payload, targets, rank)
                needed = {r: restrict(targets.for_rank(r), sources, targets.aliases) for r in range(par.size)}
                # needed follows from the manifest and the sources' names: its fingerprint stands for it
                the_plan = _plans.get(sources, needed, bucket_bytes=recv_req.bucket_bytes or DEFAULT_BUCKET_BYTES,
                                      aliases=targets.aliases, targets_digest=manifest.fingerprint,
                                      local_ranks=(rank,))
                problems += check_inputs(the_plan, rank, shards, params)
        except (LayoutError, CoverageError, ValueError, KeyError) as e:
            problems.append(f"engine rank {rank}: {e}")
        except Exception as e:  # noqa: BLE001 - any other fault refuses the update, never kills the scheduler
            logger.exception("engine rank %d: validating a distributed weight update failed", rank)
            problems.append(f"engine rank {rank}: validating the update failed: {type(e).__name__}: {e}")
    try:
        everyone = _share_problems(problems, rank, par.size, cpu_group, bound)
        if everyone:
            return False, REFUSED + "; ".join(everyone)
        if local_step is None:
            agree_on_plan(the_plan, cpu_group, bound, rank)
    except ExecutionError as e:
        return False, f"{REFUSED}{e}"
    except PeerLost as e:
        return False, f"{REFUSED}engine rank {rank}: {e}"
    try:
        if local_step is not None:
            mine = local_step.run()
        else:
            stats = execute(the_plan, rank, shards, params, group=device_group, timeout_s=bound)
            mine = (stats.bytes_received, the_plan.lower_bound_bytes(rank), stats.peak_staging_bytes)
            logger.info("distributed weight update %s, engine rank %d: received %d bytes (lower bound %d), "
                        "staged at most %d", recv_req.update_id, rank, *mine)
        if received.payload.kind != "describe":
            # Tensors computed from parameters in weight loaders (Gemma norms) are refreshed here, those
            # computed by post-load processing (MLA's w_kc/w_vc) by end_weight_update(); both in place.
            refresh_after_update(model)
        shared = _share_figures(mine, rank, par.size, cpu_group, bound)
    except Exception as e:  # noqa: BLE001 - a peer died or a copy failed after writes began
        logger.exception("engine rank %d: a distributed weight update failed while writing", rank)
        return False, (
            f"distributed weight update FAILED after writes began on engine rank {rank} "
            f"({type(e).__name__}: {e}): {MIXED} (some parameters new, some old); "
            "generation is refused until a distributed weight update succeeds"
        )
    for key, values in zip(FIGURES, shared):
        previous = received.figures.get(key, [0] * par.size)
        received.figures[key] = [a + b for a, b in zip(previous, values)]
    return True, "Success"  # upstream's text: callers test for it


def end_of_update(recv_req, success: bool, message: str) -> Tuple[bool, str]:
    """The scheduler's last step of an update on every TP rank: upstream's barrier, bounded by
    the update's bound, so a rank never waits for a TP peer that died or hangs; a peer that
    never comes fails the update here, named (every write had ended if it succeeded so far)."""
    par = tp_state()
    try:
        barrier(par.cpu_group, _timeout(recv_req) + GRACE_S, f"engine rank {par.rank}: at the end of the update")
    except PeerLost as e:
        logger.error("distributed weight update %s: %s", recv_req.update_id, e)
        return False, f"{message}; {e}" if not success else f"distributed weight update failed: {e}"
    return success, message


@dataclass
class _LocalStep:
    """A trainer-side update's local work on this rank, run once every rank agreed;
    ``run`` returns this rank's ``FIGURES`` (the engine itself receives nothing)."""

    problems: List[str]
    run: Callable[[], Tuple[int, int, int]]


def _published_layout_step(payload: Payload, targets: DerivedTargets, manifest: EngineManifest, params, rank: int,
                           channel: str) -> _LocalStep:
    """"describe": publish the manifest (nothing is written to the model). "params": check
    the buffers the trainer planned against this engine's manifest, then copy them in place."""
    if payload.kind == "describe":
        path = write_manifest(resolve_channel(channel, rank), rank, manifest)
        logger.info("engine rank %d: published the engine layout %s at %s", rank, manifest.fingerprint[:12], path)
        return _LocalStep([], lambda: (0, 0, 0))
    if payload.fingerprint != manifest.fingerprint:
        return _LocalStep([
            f"engine rank {rank}: the trainer planned against engine layout {payload.fingerprint[:12]!r}, "
            f"the engine's is now {manifest.fingerprint[:12]!r} (the trainer re-reads it on the next update)"
        ], lambda: (0, 0, 0))
    not_copied = sorted(n for n in payload.names if targets.aliases.get(n, n) in targets.not_copied)
    if not_copied:
        name = not_copied[0]
        return _LocalStep([f"engine rank {rank}: tensor {name!r} is not a copy in SGLang's loader: "
                           f"{targets.not_copied[targets.aliases.get(name, name)]}"], lambda: (0, 0, 0))
    wanted = [t for t in restrict(targets.for_rank(rank), payload.names, targets.aliases) if t.name in payload.tensors]
    unknown = sorted(set(payload.tensors) - {t.name for t in wanted})
    problems = [f"engine rank {rank}: buffers {unknown[:3]} are not parameters this update fills"] if unknown else []

    def copy() -> Tuple[int, int, int]:
        copied = copy_buffers(params, wanted, payload.tensors)
        logger.info("engine rank %d: trainer-side update, copied %d bytes locally", rank, copied)
        return 0, 0, 0

    problems += check_buffers(params, wanted, payload.tensors, rank)
    if not problems:
        problems += [f"engine rank {rank}: tensor {name!r}: the buffer from trainer rank {payload.trainer_rank} holds "
                     "NaN or inf values (refused: see docs/usage.md)" for name in nonfinite_buffers(wanted, payload.tensors)]
    return _LocalStep(problems, copy)


def engine_targets(model: torch.nn.Module, targets: DerivedTargets,
                   rank: int) -> Tuple[DerivedTargets, Dict[str, torch.Tensor], EngineManifest]:
    """This engine's targets, derived from SGLang's own loaders (``target_cache``), checked
    against the live tensors of ``rank``.

    Returns the targets (with each parameter's live dtype), this rank's tensors by
    name, and the engine's manifest of those targets. A live tensor that differs from its
    derived shape means the engine was not built the way the derivation rebuilt it: refuse.
    """
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
    live_targets, manifest = _with_live_dtypes(targets, {n: p.dtype for n, p in params.items()})
    return live_targets, params, manifest


def _with_live_dtypes(derived: DerivedTargets,
                      dtype_of: Dict[str, torch.dtype]) -> Tuple[DerivedTargets, EngineManifest]:
    """``derived`` with the live dtypes, and its manifest: remembered while both stay the
    same (every update of a run), as making the manifest encodes and hashes every rank's
    targets (~2.9 s for a TP-256 DeepSeek-V3 engine)."""
    global _layout_memo
    dtypes = tuple(sorted((n, str(d)) for n, d in dtype_of.items()))
    if _layout_memo is None or _layout_memo[0] is not derived or _layout_memo[1] != dtypes:
        targets = dataclasses.replace(derived, dtype_of=dtype_of)
        _layout_memo = (derived, dtypes, targets, EngineManifest.of(targets))
    return _layout_memo[2], _layout_memo[3]


def _sources(payload: Payload, targets: DerivedTargets, rank: int):
    """Source layout from the payload's specs, and the local buffers it reads (by key);
    refuses names and shapes the model does not have, and tensors SGLang's loader does not
    copy (quantised, computed: an update cannot write them)."""
    expected = targets.tensor_shapes()
    sources = {}
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
    _check_finite(payload)
    return sources, payload.tensors


def _check_finite(payload: Payload) -> None:
    for key, local in payload.tensors.items():
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            raise ValueError(f"tensor {key!r}: the shard from trainer rank {payload.trainer_rank} holds NaN or inf "
                             "values (refused: see docs/usage.md)")


def _timeout(recv_req) -> float:
    try:
        return check_timeout(recv_req.timeout_s)
    except DeliveryError:  # already refused by request_problems; still bound the collectives
        return DEFAULT_TIMEOUT_S


def _share_figures(mine: Tuple[int, ...], rank: int, world: int, group, timeout_s: float) -> List[List[int]]:
    """Each figure of every TP rank, on every rank (one small all-reduce): rank 0 replies for all."""
    table = torch.zeros(len(mine), world, dtype=torch.int64)
    table[:, rank] = torch.tensor(mine, dtype=torch.int64)
    wait(dist.all_reduce(table, group=group, async_op=True), timeout_s,
         f"sharing the update's figures with the other TP ranks ({world} ranks)")
    return table.tolist()


def _share_bytes(mine: bytes, rank: int, world: int, group, timeout_s: float) -> List[bytes]:
    """Every TP rank's bytes, in rank order, on every rank: lengths through one all-reduce, then
    one all-gather of byte tensors (no object gather, no pickle)."""
    if world == 1:
        return [mine]
    lengths = torch.zeros(world, dtype=torch.int64)
    lengths[rank] = len(mine)
    phase = f"exchanging derived targets with the other TP ranks ({world} ranks)"
    wait(dist.all_reduce(lengths, group=group, async_op=True), timeout_s, phase)
    width = int(lengths.max())
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    gathered = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    wait(dist.all_gather(gathered, padded, group=group, async_op=True), timeout_s, phase)
    return [t[:n].numpy().tobytes() for t, n in zip(gathered, lengths.tolist())]


def _share_problems(problems: List[str], rank: int, world: int, group, timeout_s: float) -> List[str]:
    """Every rank's problems, on every rank, through one small all-reduce (no object gather)."""
    if problems:
        logger.error("distributed weight update, rank %d: %s", rank, "; ".join(problems))
    text = "; ".join(problems).encode()[:MESSAGE_BYTES]
    table = torch.zeros(world, MESSAGE_BYTES, dtype=torch.uint8)
    if text:
        table[rank, : len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    wait(dist.all_reduce(table, group=group, async_op=True), timeout_s,
         f"sharing problems with the other TP ranks (one is dead or stuck; {world} ranks)")
    return [bytes(row[row.nonzero().flatten()].tolist()).decode(errors="replace") for row in table if row.any()]
