"""Resharding scenarios run on every rank by the distributed tests.

A scenario names a model config, how the trainer holds each tensor, and the
engine's TP layout. Every rank builds the same full HF tensors from a seed
(the test's reference only), derives its own shard the way the trainer would
(Megatron slicing, DTensor, FSDP2), runs the plan and the executor, and checks
its parameters bit-exactly against SGLang's slicing rules.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from benchmark.weight_sync.hand_rules import model_targets_from_config, reference_param
from sglang.srt.weight_sync.control_plane import ControlGroup, PlanDisagreement
from sglang.srt.weight_sync.executor import execute
from sglang.srt.weight_sync.planner import plan
from sglang.srt.weight_sync.source_layout import MeshSpec
from sglang.srt.weight_sync.target_layout import EngineParallel

SENTINEL = 1234.5  # what parameters hold before the update: any miss shows up


def qwen2(**overrides):
    cfg = dict(
        model_type="qwen2",
        hidden_size=128,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=1000,
        num_hidden_layers=2,
        intermediate_size=256,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    return cfg


def llama_tied(**overrides):
    cfg = dict(
        model_type="llama",
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=500,
        num_hidden_layers=2,
        intermediate_size=128,
        tie_word_embeddings=True,
    )
    cfg.update(overrides)
    return cfg


def qwen3_moe(**overrides):
    cfg = dict(
        model_type="qwen3_moe",
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        num_hidden_layers=2,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    return cfg


@dataclass(frozen=True)
class Scenario:
    """``train`` is "megatron" (explicit TP shards), "dtensor0"/"dtensor1" (DTensor Shard(0)/Shard(1)
    over the TP mesh), "fsdp" (FSDP2 fully_shard over all ranks), "hsdp" (FSDP2 on a 2-d mesh) or
    "fsdp_tp" (FSDP2 over the "dp" dim of a (dp, tp) mesh whose "tp" dim holds Megatron-style
    TP DTensors: column-parallel tensors end as ``(_StridedShard(0, sf=tp), Shard(0))``)."""

    config: dict
    train: str
    train_tp: int
    infer_tp: int
    moe_ep: int = 1
    train_dtype: torch.dtype = torch.float32
    engine_dtype: torch.dtype = torch.float32
    bucket_bytes: int = 1 << 16
    world: Optional[int] = None
    hsdp_shape: Tuple[int, int] = (1, 1)

    @property
    def ranks(self) -> int:
        return self.world or max(self.train_tp, self.infer_tp)

    def __str__(self) -> str:
        return (
            f"{self.config['model_type']}-{self.train}{self.train_tp}-tp{self.infer_tp}-ep{self.moe_ep}-"
            f"{str(self.train_dtype)[6:]}to{str(self.engine_dtype)[6:]}"
        )


def full_tensors(
    shapes: Dict[str, Tuple[int, ...]], dtype: torch.dtype
) -> Dict[str, torch.Tensor]:
    """The same random full tensors on every rank (seeded by name)."""
    out = {}
    for name, shape in sorted(shapes.items()):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = torch.randn(shape, generator=g).to(dtype)
    return out


def megatron_dim(name: str) -> Optional[int]:
    """Megatron's TP split: row-parallel (o_proj, down_proj) on dim 1, norms and the router
    replicated, everything else (q/k/v, gate/up, embeddings, lm_head, biases) on dim 0."""
    if "norm" in name or name.endswith("mlp.gate.weight"):
        return None
    if "o_proj.weight" in name or "down_proj" in name:
        return 1
    return 0


def _train_shards(s: Scenario, rank: int, full: Dict[str, torch.Tensor]):
    """This rank's local shards and every rank's layout, built the way the trainer holds them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world, t = s.ranks, s.train_tp
    replicas = [list(range(i, i + t)) for i in range(0, world, t)]
    layout, local = {}, {}
    if s.train == "megatron":
        for name, tensor in full.items():
            dim = megatron_dim(name)
            if dim is None:
                layout[name] = MeshSpec.sharded(
                    tensor.shape, tensor.dtype, 0, [[r] for r in range(world)]
                ).describe(name)
            else:
                layout[name] = MeshSpec.sharded(
                    tensor.shape, tensor.dtype, dim, replicas
                ).describe(name)
            box = layout[name].box_of(rank)
            local[name] = tensor[box.slices()].clone()
        return layout, local
    if s.train in ("dtensor0", "dtensor1"):
        mesh = init_device_mesh("cpu", (world // t, t), mesh_dim_names=("dp", "tp"))
        placements = (Replicate(), Shard(int(s.train[-1])))
        for name, tensor in full.items():
            p = (
                placements
                if tensor.ndim > int(s.train[-1])
                else (Replicate(), Replicate())
            )
            dt = distribute_tensor(tensor, mesh, p, src_data_rank=None)
            layout[name], local[name] = (
                MeshSpec.of_dtensor(dt).describe(name),
                dt.to_local(),
            )
        return layout, local
    if s.train == "fsdp_tp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world // t, t), mesh_dim_names=("dp", "tp"))
        names = sorted(full)
        module = torch.nn.Module()
        for i, name in enumerate(names):
            dim = megatron_dim(name)
            place = Replicate() if dim is None or dim >= full[name].ndim else Shard(dim)
            tp_param = distribute_tensor(
                full[name].clone(), mesh["tp"], (place,), src_data_rank=None
            )
            module.register_parameter(f"p{i}", torch.nn.Parameter(tp_param))
        fully_shard(module, mesh=mesh["dp"])
        for i, name in enumerate(names):
            dt = getattr(module, f"p{i}")
            layout[name], local[name] = (
                MeshSpec.of_dtensor(dt).describe(name),
                dt.to_local(),
            )
        strided = [
            n
            for i, n in enumerate(names)
            if "_StridedShard" in type(getattr(module, f"p{i}").placements[0]).__name__
        ]
        assert strided, (
            "FSDP2 over TP gave no _StridedShard placement: the case tests nothing new"
        )
        return layout, local
    if s.train in ("fsdp", "hsdp"):
        from fsdp_shards import fully_sharded

        if s.train == "fsdp":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        else:
            mesh = init_device_mesh(
                "cpu", s.hsdp_shape, mesh_dim_names=("replicate", "shard")
            )
        return fully_sharded(full, mesh)
    raise ValueError(s.train)


def run(rank: int, world: int, s: Scenario) -> dict:
    targets_all = model_targets_from_config(
        s.config, EngineParallel(s.infer_tp, moe_ep_size=s.moe_ep), s.engine_dtype
    )
    full = full_tensors(targets_all.tensor_shapes(), s.train_dtype)
    if (
        targets_all.aliases
    ):  # tied: the trainer sends lm_head.weight, the engine needs the embedding
        full = {
            ("lm_head.weight" if n == "model.embed_tokens.weight" else n): v
            for n, v in full.items()
        }
    layout, local = _train_shards(s, rank, full)
    # Engine-side when the engine spans the trainer's groups; otherwise trainer-side: rank k ends
    # with what engine rank k % infer_tp needs.
    targets = {k: targets_all.for_rank(k % s.infer_tp) for k in range(world)}
    p = plan(layout, targets, bucket_bytes=s.bucket_bytes, aliases=targets_all.aliases)
    mine = targets[rank]
    params = {t.name: torch.full(t.shape, SENTINEL, dtype=t.dtype) for t in mine}
    ControlGroup(None, "test").agree_on_plan(p.fingerprint, None, f"rank {rank}")
    stats = execute(p, rank, local, params)
    reference = {n: v for n, v in full.items()}
    for alias, name in targets_all.aliases.items():
        reference[name] = reference.pop(alias)
    for t in mine:
        expected = reference_param(t, reference)
        if not torch.equal(params[t.name], expected):
            bad = (params[t.name] != expected).nonzero()[:3].tolist()
            raise AssertionError(
                f"{s} rank {rank}: {t.name} differs from SGLang's slicing at {bad}"
            )
    dist.barrier()
    return dict(
        received=stats.bytes_received,
        lower_bound=p.lower_bound_bytes(rank),
        planned=p.received_bytes(rank),
        peak=stats.peak_staging_bytes,
        largest_round=stats.largest_round_bytes,
        bucket=s.bucket_bytes,
        fingerprint=p.fingerprint,
        broadcasts=stats.broadcasts,
        p2p=stats.p2p_ops,
    )


def run_all(rank: int, world: int, scenarios) -> list:
    """Several scenarios in one set of processes (they must all span ``world`` ranks)."""
    assert all(s.ranks == world for s in scenarios)
    return [run(rank, world, s) for s in scenarios]


def disagreeing_plans(rank: int, world: int) -> str:
    """Rank 1 believes in a different bucket size: every rank must refuse before moving data."""
    s = Scenario(qwen2(), "megatron", 2, 2)
    targets = model_targets_from_config(s.config, EngineParallel(2), torch.float32)
    full = full_tensors(targets.tensor_shapes(), torch.float32)
    layout, _ = _train_shards(s, rank, full)
    p = plan(layout, targets.by_rank(), bucket_bytes=(1 << 20) if rank == 0 else 256)
    try:
        ControlGroup(None, "test").agree_on_plan(p.fingerprint, None, f"rank {rank}")
    except PlanDisagreement as e:
        return str(e)
    return "agreed"
