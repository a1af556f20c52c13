"""SGLang's private APIs that weight sync uses (parallel state, the loader's helpers, the
post-load steps, request structs, the weight version), each behind one function here, so
that a change in SGLang touches this module and no other.
"""

# pr: here
# This repository builds the package on four releases (0.5.10.post1, 0.5.12, 0.5.15.post1,
# 0.5.23): each function takes 0.5.23's API and, in a region like this one, falls back to the
# older one first. 0.5.15.post1 sits between: msgspec requests, a ``runtime_context``
# (parallel state only) and a scheduler weight-updater manager as 0.5.23 has them, but no
# weight-update sessions, no derived spawn ranks and no resolved server args, as the older
# releases; each function probes the API it needs.
# pr: here end

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

# isort: split
# pr: here
import dataclasses

# pr: here end
from typing import Any, Callable, Dict, Iterator, Tuple

__all__ = (
    "TpState",
    "after_load",
    "after_update",
    "as_tp_rank",
    "clear_preprocess_cache",
    "field_names",
    # pr: here
    "has_weight_update_sessions",
    # pr: here end
    "initialize_meta_model",
    "module_globals",
    "original_hf_config",
    "parallel_widths",
    "rebind_parameter_aliases",
    "server_args_dict",
    "subclass_with_field",
    "tp_state",
    "unsplit_groups",
    "update_refusals",
    "weight_version",
    # pr: safety
    "weights_released",
    # pr: safety end
    # pr: scale
    "load_synchronously",
    # pr: scale end
    # pr: remote
    "record_served_weight_version",
    "replace_fields",
    "settle_weight_update",
    # pr: remote end
)


@dataclass(frozen=True)
class TpState:
    """This process's place in SGLang's tensor-parallel group."""

    rank: int
    size: int
    attn_tp_size: int
    moe_ep_size: int
    cpu_group: Any
    device_group: Any


# pr: here
def _has_runtime_context() -> bool:
    """0.5.15.post1 and 0.5.23 publish ranks and groups in ``runtime_context``; older releases
    in ``parallel_state``/``dp_attention`` module globals only."""
    import importlib.util

    return importlib.util.find_spec("sglang.srt.runtime_context") is not None


def _runtime_context_has(name: str) -> bool:
    """Whether ``runtime_context`` has ``name`` (0.5.23's spawn-rank derivation and resolved
    server args; 0.5.15.post1's holds parallel state only)."""
    if not _has_runtime_context():
        return False
    from sglang.srt import runtime_context

    return hasattr(runtime_context, name) or hasattr(
        runtime_context.RuntimeContext, name
    )


# pr: here end


# pr: here
def has_weight_update_sessions() -> bool:
    """Whether updates run inside ``begin_weight_update`` ... ``end_weight_update`` sessions,
    whose end runs the model's post-load fixups (0.5.23); older releases have none."""
    from sglang.srt.managers import io_struct

    return hasattr(io_struct, "BeginWeightUpdateReqInput")


# pr: here end
def tp_state() -> TpState:
    """This rank's place, as SGLang publishes ranks and groups in
    ``runtime_context.get_parallel()``."""
    # pr: here
    # older releases: through parallel_state and dp_attention getters
    if not _has_runtime_context():
        from sglang.srt.distributed.parallel_state import (
            get_moe_expert_parallel_world_size,
            get_tp_group,
        )
        from sglang.srt.layers.dp_attention import get_attention_tp_size

        group = get_tp_group()
        return TpState(
            group.rank_in_group,
            group.world_size,
            get_attention_tp_size(),
            get_moe_expert_parallel_world_size(),
            group.cpu_group,
            group.device_group,
        )
    # pr: here end
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    return TpState(
        par.tp_rank,
        par.tp_size,
        par.attn_tp_size,
        par.moe_ep_size,
        par.tp_group.cpu_group,
        par.tp_group.device_group,
    )


def parallel_widths() -> Tuple[int, int, int, int, int, int]:
    """This engine's (tp, attention tp, MoE ep, pp, attention cp, MoE dp) sizes; read without
    touching a group's communicators, which a test's stand-in groups do not have."""
    # pr: here
    if not _has_runtime_context():  # older releases: parallel_state's groups
        from sglang.srt.distributed import parallel_state as ps

        return (
            ps.get_tp_group().world_size,
            ps.get_attn_tp_group().world_size,
            ps.get_moe_ep_group().world_size,
            ps.get_pp_group().world_size,
            ps.get_attn_cp_group().world_size,
            ps.get_moe_dp_group().world_size,
        )
    # pr: here end
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    return (
        par.tp_size,
        par.attn_tp_size,
        par.moe_ep_size,
        par.pp_size,
        par.attn_cp_size,
        par.moe_dp_size,
    )


@contextlib.contextmanager
def as_tp_rank(rank: int, group: Callable[[int, int], Any]) -> Iterator[None]:
    """This process as TP ``rank`` of its engine's layout while a model is built and loaded on
    meta: every rank SGLang's layers read is ``rank``'s, from SGLang's own formulas, and every
    group is ``group(rank_in_group, world_size)``, a stand-in that carries placement only:
    an override of SGLang's ``runtime_context``. It holds for the whole process, so it runs
    where the scheduler does nothing else (an update)."""
    tp, attn_tp, ep, pp, attn_cp, moe_dp = parallel_widths()
    if (pp, attn_cp, moe_dp) != (1, 1, 1):
        raise ValueError(
            f"derived targets need pp_size, attn_cp_size and moe_dp_size of 1, the engine has "
            f"{pp}, {attn_cp}, {moe_dp}"
        )
    # pr: here
    if not _runtime_context_has("derive_spawn_ranks"):
        with _as_tp_rank_in_globals(rank, group, tp, attn_tp, ep):
            yield
        return
    # pr: here end
    from sglang.srt.runtime_context import (
        derive_attention_ranks,
        derive_spawn_ranks,
        get_parallel,
    )

    ranks = derive_spawn_ranks(
        world_rank=rank,
        tp_size=tp,
        ep_join_rank_offset=0,
        attn_cp_size=1,
        attn_tp_size=attn_tp,
        moe_dp_size=1,
        moe_ep_size=ep,
    )
    attn_tp_rank, attn_dp_rank = derive_attention_ranks(
        tp_rank=rank, attn_tp_size=attn_tp, attn_cp_size=1
    )
    groups = dict(
        tp_group=group(rank, tp),
        attn_tp_group=group(attn_tp_rank, attn_tp),
        moe_ep_group=group(ranks["moe_ep_rank"], ep),
        moe_tp_group=group(ranks["moe_tp_rank"], tp // ep),
        moe_dp_group=group(0, 1),
        attn_cp_group=group(0, 1),
        pp_group=group(0, 1),
    )
    with get_parallel().override(
        **ranks, attn_tp_rank=attn_tp_rank, attn_dp_rank=attn_dp_rank, **groups
    ):
        yield


# pr: here
@contextlib.contextmanager
def _as_tp_rank_in_globals(
    rank: int, group: Callable[[int, int], Any], tp: int, attn_tp: int, ep: int
) -> Iterator[None]:
    """``as_tp_rank`` on releases before 0.5.23 (0.5.15.post1's ``runtime_context`` reads the
    same globals): the ``parallel_state`` and ``dp_attention`` module globals their getters
    read, swapped and restored on exit."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention
    from sglang.srt.server_args import get_global_server_args

    args = get_global_server_args()
    # (rank, size, dp rank), and dp size since 0.5.15.post1
    world = dp_attention.compute_dp_attention_world_info(
        args.enable_dp_attention, rank, tp, args.dp_size
    )
    attn_tp_rank, attn_dp_rank = world[0], world[2]
    _, _, local_attn_dp_rank = dp_attention.compute_dp_attention_local_info(
        args.enable_dp_attention, rank, tp, args.dp_size, args.moe_dense_tp_size
    )
    moe_tp = (
        tp // ep
    )  # initialize_model_parallel: MoE-TP groups are runs of moe_tp ranks, MoE-EP groups strided
    swapped = {
        parallel_state: dict(
            _TP=group(rank, tp),
            _ATTN_TP=group(attn_tp_rank, attn_tp),
            _ATTN_CP=group(0, 1),
            _MOE_DP=group(0, 1),
            _MOE_EP=group(rank // moe_tp, ep),
            _MOE_TP=group(rank % moe_tp, moe_tp),
            _PP=group(0, 1),
        ),
        dp_attention: dict(
            _ATTN_DP_RANK=attn_dp_rank, _LOCAL_ATTN_DP_RANK=local_attn_dp_rank
        ),
    }
    with module_globals(swapped):
        yield


# pr: here end


@contextlib.contextmanager
def module_globals(values: Dict[Any, Dict[str, Any]]) -> Iterator[None]:
    """Module globals set to ``{module: {name: value}}`` for the block, then restored."""
    saved = {
        module: {name: getattr(module, name) for name in names}
        for module, names in values.items()
    }
    try:
        for module, names in values.items():
            for name, value in names.items():
                setattr(module, name, value)
        yield
    finally:
        for module, names in saved.items():
            for name, value in names.items():
                setattr(module, name, value)


@contextlib.contextmanager
def unsplit_groups() -> Iterator[None]:
    """Process groups made in the block get communicators of their own, never split from
    the default group's. Torch 2.9.1, 2.11 and 2.13 alike (``_new_process_group_helper``)
    make a new NCCL group by ``ncclCommSplit`` of the default group's communicator whenever
    the default group has a bound device (``init_process_group(device_id=...)``), asking
    ``_get_split_source`` for the parent: a group of ranks of other worlds (a weight-sync
    group's trainer and engine ranks) would split a communicator that holds none of the
    engines' ranks. In the block that answer is "none". Torch's group creation is not
    thread-safe either (``_world``), so no other thread makes a group meanwhile."""
    from torch.distributed import distributed_c10d

    with module_globals({distributed_c10d: {"_get_split_source": _no_split_source}}):
        yield


def _no_split_source(_pg) -> None:
    return None


def server_args_dict() -> Dict[str, Any]:
    """The engine's server args as resolved at launch, by field name."""
    # pr: here
    if not _runtime_context_has("resolved_server_args_dict"):  # older releases
        from sglang.srt.server_args import get_global_server_args

        args = get_global_server_args()
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    # pr: here end
    from sglang.srt.runtime_context import get_context

    return dict(get_context().resolved_server_args_dict())


def clear_preprocess_cache(tokenizer_manager) -> None:
    """Drop the multimodal processor's cache of preprocessed inputs after a weight update, as
    0.5.23's own updates do; older releases keep no such cache."""
    clear = getattr(
        getattr(tokenizer_manager, "mm_processor", None), "clear_preprocess_cache", None
    )
    if clear is not None:
        clear()


def original_hf_config(model_config):
    """The model's HF config as on disk, by SGLang's own ``get_config`` past its cache: the CPU
    engine pads heads in ``model_config.hf_config`` in place, and on 0.5.12 that object is the
    one ``get_config`` caches, while a trainer's checkpoint has the original shapes.
    ``get_config`` moved in 0.5.12; 0.5.10.post1's takes no ``model_config_parser``."""
    try:
        from sglang.srt.utils.hf_transformers.config import get_config
    except ImportError:
        from sglang.srt.utils.hf_transformers_utils import get_config
    uncached = getattr(get_config, "__wrapped__", get_config)
    kwargs = dict(
        revision=model_config.revision,
        model_override_args=model_config.model_override_args,
    )
    if "model_config_parser" in inspect.signature(uncached).parameters:
        kwargs["model_config_parser"] = model_config.model_config_parser
    return uncached(
        model_config.model_path,
        trust_remote_code=bool(server_args_dict().get("trust_remote_code")),
        **kwargs,
    )


def after_load(model) -> None:
    """What SGLang's default loader runs after ``model.load_weights``: each quant method's
    post-load processing (``DefaultModelLoader.postprocess_weights``)."""
    import torch

    from sglang.srt.model_loader.loader import DefaultModelLoader

    # pr: here
    if not hasattr(DefaultModelLoader, "postprocess_weights"):
        # older releases run the same loop inside ``load_weights_and_postprocess``
        for module in model.modules():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)
        return
    # pr: here end
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))


def after_update(model) -> None:
    """What follows an update that wrote parameters in place, bypassing ``load_weights``:
    what ``end_weight_update`` runs (the model's post-load fixups, then each quant method's
    post-processing)."""
    # pr: here
    if not has_weight_update_sessions():
        # Older releases have no session: their own tensor update goes through
        # ``model.load_weights``, which runs the model's post-load fixups itself (MLA's
        # w_kc/w_vc), so a distributed update runs those (``tensor_path.update_from_payload``)
        # and nothing more.
        if hasattr(model, "post_load_weights"):
            model.post_load_weights()
        return
    # pr: here end
    from sglang.srt.model_loader.loader import post_load_weights

    post_load_weights(model)
    after_load(model)


def initialize_meta_model(model_config, load_config):
    """The model as ``DefaultModelLoader`` builds it (architecture, quantisation, shared-expert
    fusion, default dtype), on the meta device: SGLang's private loader helpers. The
    quantisation config is resolved first, outside the meta device: resolving it imports
    the model classes, and some of them compute tensors at import time."""
    import torch

    from sglang.srt.model_loader.loader import (
        _get_quantization_config,
        _initialize_model,
    )
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    quant_config = _get_quantization_config(model_config, load_config)
    with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
        return _initialize_model(model_config, load_config, quant_config)


def rebind_parameter_aliases(model) -> None:
    """What SGLang's presharded loader runs after writing parameters directly: parameter
    aliases and tensors computed from them (Gemma norms' ``weight + 1``) refreshed in
    place."""
    from sglang.srt.model_loader import loader

    # pr: here
    if not hasattr(loader, "PreshardedModelLoader"):  # older releases: nothing to run
        return
    # pr: here end
    loader.PreshardedModelLoader._rebind_parameter_aliases(model)


# pr: scale
def load_synchronously(tensor):
    """``tensor`` marked so that SGLang's loaders consume it in the calling thread (0.5.23's
    ``should_async_load`` hands host tensors to a thread pool unless they carry the RunAI
    streamer's mark; older releases have no mark and do so for every host tensor)."""
    tensor._sglang_runai_streamer_tensor = True
    return tensor


# pr: scale end
def field_names(cls) -> Tuple[str, ...]:
    """Fields of an io_struct request (a msgspec Struct)."""
    # pr: here
    if dataclasses.is_dataclass(cls):  # before 0.5.23
        return tuple(f.name for f in dataclasses.fields(cls))
    # pr: here end
    return tuple(cls.__struct_fields__)


# pr: remote
def replace_fields(req, **changes):
    """A copy of io_struct request ``req`` (a msgspec Struct) with ``changes``."""
    # pr: remote end
    # pr: here
    if dataclasses.is_dataclass(req):  # before 0.5.23
        return dataclasses.replace(req, **changes)
    # pr: here end
    # pr: remote
    import msgspec

    return msgspec.structs.replace(req, **changes)


# pr: remote end
def subclass_with_field(cls, name: str, field: str, type_: type, default: Any):
    """Request type ``cls`` (a msgspec Struct) with one more field (``field: type_ =
    default``)."""
    # pr: here
    if dataclasses.is_dataclass(cls):  # before 0.5.23
        return dataclasses.make_dataclass(
            name, [(field, type_, dataclasses.field(default=default))], bases=(cls,)
        )
    # pr: here end
    return type(
        name, (cls,), {"__annotations__": {field: type_}, field: default}, kw_only=True
    )


def weight_version(tokenizer_manager):
    """The weight version the last update recorded, as the tokenizer manager reads it."""
    # pr: here
    if not hasattr(tokenizer_manager, "config_value"):  # older releases: in server_args
        return getattr(tokenizer_manager.server_args, "weight_version", None)
    # pr: here end
    return tokenizer_manager.config_value("weight_version")


# pr: safety
def weights_released(holder) -> bool:
    """Whether SGLang's memory saver has released the weights
    (``release_memory_occupation(tags=["weights"])`` with no resume since): SGLang records
    the released tags in ``offload_tags``, on the scheduler's weight-updater manager
    (0.5.23) or on the scheduler (older releases), the same on every TP rank."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_WEIGHTS

    return GPU_MEMORY_TYPE_WEIGHTS in (getattr(holder, "offload_tags", None) or ())


# pr: safety end
# pr: remote
def settle_weight_update(
    holder, recv_req, success: bool, message: str
) -> Tuple[bool, str]:
    """What SGLang's own update handlers do after writing weights, for a scheduler-side hook:
    record the weight version and flush the cache the old weights produced, both steps on
    the scheduler's weight-updater manager (a refused flush fails the call)."""
    # pr: remote end
    # pr: here
    if not hasattr(holder, "record_weight_version_after_update"):
        # older schedulers only flush (the version lives in the tokenizer manager), here
        # with the same refusal instead of their ``assert``
        if recv_req.flush_cache and not holder.flush_cache():
            return False, (
                "Weights were updated, but the cache was not flushed because requests are "
                "still running or queued. Retract or finish them, then call /flush_cache."
            )
        return success, message
    # pr: here end
    # pr: remote
    holder.record_weight_version_after_update(recv_req.weight_version)
    return holder.flush_cache_after_weight_update(recv_req, success, message)


# pr: remote end
# pr: remote
def record_served_weight_version(manager, version: str) -> None:
    """Record in the tokenizer manager the weight version its engine now serves, as SGLang's
    own update handlers do after an update that named one (the private
    ``_update_weight_version_if_provided`` of every base this package is built on)."""
    manager._update_weight_version_if_provided(version)


# pr: remote end
def update_refusals(model) -> list:
    """Why an in-place update of ``model`` must be refused before any write, because what
    SGLang derived from its weights after loading cannot be redone by its post-load step:

    * SGLang's own check, where the release has it (0.5.23's
      ``weight_updater._unsupported_derived_weight_cache_error``: Hopper's BF16 caches of block
      FP8, ``SGLANG_OPT_HOPPER_BLOCK_FP8_BF16``; compensated mHC splits; HPC-Ops GEMMs), the
      text its own update paths refuse with;
    * an FP8 layer whose weight the CPU AMX post-load step packed (``use_intel_amx_backend``:
      ``_amx_process_weight_after_loading`` replaces the weight by a VNNI-packed one, and
      running it again would pack the packed weight);
    * an FP8 layer whose weight ROCm's aiter pre-shuffled in place (``aiter_bpreshuffled``:
      shuffling again permutes the shuffled weight);
    * a block-FP8 layer whose float32 scales DeepGEMM's UE8M0 requantization rewrote and
      marked (``weight_scale_inv.format_ue8m0``, ``fp8_utils.requant_block_scale_ue8m0_for_deepgemm``):
      the post-load step skips marked scales, so new float32 scales would be served as UE8M0.
    """
    found = []
    try:
        from sglang.srt.model_executor.model_runner_components import weight_updater
    except ImportError:
        weight_updater = None
    check = getattr(weight_updater, "_unsupported_derived_weight_cache_error", None)
    if check is not None:
        reason = check(model)
        if reason:
            found.append(reason)
    for name, module in model.named_modules():
        method = type(getattr(module, "quant_method", None)).__name__
        if not method.startswith("Fp8"):
            continue
        if getattr(module, "use_intel_amx_backend", False):
            found.append(
                f"{name}: SGLang's CPU AMX post-load step packed its FP8 weight "
                "(_amx_process_weight_after_loading), which it cannot redo on a packed weight"
            )
        elif getattr(module, "aiter_bpreshuffled", False):
            found.append(
                f"{name}: ROCm aiter pre-shuffled its FP8 weight in place after loading, "
                "which SGLang's post-load step cannot redo on a shuffled weight"
            )
        elif getattr(
            getattr(module, "weight_scale_inv", None), "format_ue8m0", False
        ) and (
            getattr(
                getattr(module.quant_method, "quant_config", None), "scale_fmt", None
            )
            != "ue8m0"
        ):
            found.append(
                f"{name}: SGLang requantized its float32 block scales to UE8M0 for DeepGEMM "
                "after loading and marked them (format_ue8m0), so its post-load step would "
                "not requantize the new scales"
            )
        if len(found) > 3:
            break
    return found
