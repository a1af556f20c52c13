"""The few SGLang APIs that differ between the releases this package is built on (0.5.10.post1,
0.5.12, 0.5.23), adapted here and nowhere else.

Each function tries the newest release's API first and falls back to the older one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Tuple


@dataclass(frozen=True)
class TpState:
    """This process's place in SGLang's tensor-parallel group."""

    rank: int
    size: int
    attn_tp_size: int
    moe_ep_size: int
    cpu_group: Any
    device_group: Any


def tp_state() -> TpState:
    """0.5.23 publishes ranks and groups in ``runtime_context.get_parallel()``; older releases
    through ``parallel_state`` and ``dp_attention`` getters."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        from sglang.srt.distributed.parallel_state import get_moe_expert_parallel_world_size, get_tp_group
        from sglang.srt.layers.dp_attention import get_attention_tp_size

        group = get_tp_group()
        return TpState(group.rank_in_group, group.world_size, get_attention_tp_size(),
                       get_moe_expert_parallel_world_size(), group.cpu_group, group.device_group)
    par = get_parallel()
    return TpState(par.tp_rank, par.tp_size, par.attn_tp_size, par.moe_ep_size,
                   par.tp_group.cpu_group, par.tp_group.device_group)


def field_names(cls) -> Tuple[str, ...]:
    """Fields of an io_struct request: msgspec Structs since 0.5.23, dataclasses before."""
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return tuple(cls.__struct_fields__)


def subclass_with_field(cls, name: str, field: str, type_: type, default: Any):
    """Request type ``cls`` with one more field (``field: type_ = default``), in the struct
    kind this release's io_struct uses: msgspec Struct since 0.5.23, dataclass before."""
    if dataclasses.is_dataclass(cls):
        return dataclasses.make_dataclass(name, [(field, type_, dataclasses.field(default=default))], bases=(cls,))
    return type(name, (cls,), {"__annotations__": {field: type_}, field: default}, kw_only=True)


@contextlib.contextmanager
def weight_update_session(engine) -> Iterator[None]:
    """0.5.23 accepts weight updates only between ``begin_weight_update()`` and
    ``end_weight_update()``; older releases have no session and take them at any time."""
    if not hasattr(engine, "begin_weight_update"):
        yield
        return
    engine.begin_weight_update()
    try:
        yield
    finally:
        engine.end_weight_update()
