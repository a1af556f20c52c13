"""Delta updates of the trainer-side hop (``reshard_delta``) over four gloo ranks.

Four trainer ranks train the same fp32 weights with AdamW (identical steps on every rank;
each sends from its FSDP2 ``Shard(0)`` rows only) and fill the buffers of two bf16 engines
of TP 2 on ranks (0, 1) and (2, 3) as trainer-side mode does: ``agree_on_inputs`` (the real
agreement, which decides delta or full) then ``TrainerPlans.reshard_to_engines`` per chunk
with the rank's ``ReshardDelta``. After every update each rank's buffers must be SGLang's
slicing of the current weights cast to bf16, bit for bit (what a full update writes); the
bytes a rank received from the others are compared with a full update's.
"""

import torch
import torch.distributed as dist
from ranks import run_ranks

CONFIG = dict(
    model_type="qwen2",
    hidden_size=128,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=1024,
    num_hidden_layers=3,
    intermediate_size=320,
    tie_word_embeddings=False,
)
GROUPS = ((0, 1), (2, 3))  # two engines of TP 2 beside the four trainer ranks
BIG_CAP = 1 << 30
SMALL_CAP = 160 << 10  # above the largest parameter (lm_head, 128 KiB per rank)


def _weights() -> dict:
    from benchmark.weight_sync.hand_rules import model_targets_from_config
    from sglang.srt.weight_sync.target_layout import EngineParallel

    targets = model_targets_from_config(CONFIG, EngineParallel(2), torch.bfloat16)
    return {
        n: torch.randn(s, generator=torch.Generator().manual_seed(i))
        for i, (n, s) in enumerate(sorted(targets.tensor_shapes().items()))
    }


class _Trainer:
    """fp32 weights trained by AdamW on seeded random gradients (the same on every rank),
    this rank's ``Shard(0)`` rows as its sources, and the engines' manifest."""

    def __init__(self, world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from benchmark.weight_sync.hand_rules import model_targets_from_config
        from sglang.srt.weight_sync.manifest import EngineManifest
        from sglang.srt.weight_sync.target_layout import EngineParallel

        targets = model_targets_from_config(CONFIG, EngineParallel(2), torch.bfloat16)
        self.manifest = EngineManifest.of(targets)
        self.mesh = init_device_mesh("cpu", (world,))
        self.params = {n: torch.nn.Parameter(t) for n, t in sorted(_weights().items())}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=1e-6)
        self.steps = 0

    def step(self, lr: float) -> None:
        self.steps += 1
        g = torch.Generator().manual_seed(10_000 + self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=g)
        self.optimizer.step()

    def sources(self):
        from torch.distributed.tensor import Shard, distribute_tensor

        from sglang.srt.weight_sync.trainer_flow import prepare_shards

        shards = prepare_shards(
            [
                (
                    n,
                    distribute_tensor(
                        p.detach(), self.mesh, (Shard(0),), src_data_rank=None
                    ),
                )
                for n, p in self.params.items()
            ]
        )
        return (
            {n: spec.describe(n) for n, _, spec in shards},
            {n: t for n, t, _ in shards},
        )


def _update(sync, trainer: _Trainer, rank: int, cap: int, fail: bool = False) -> dict:
    """One trainer-side update through the agreement; the buffers checked against SGLang's
    slicing of the current weights; the delta kept (or dropped when this rank fails)."""
    from benchmark.weight_sync.hand_rules import reference_param
    from sglang.srt.weight_sync.delta_rounds import DeltaRefusal
    from sglang.srt.weight_sync.phase_timing import PhaseClock
    from sglang.srt.weight_sync.trainer_flow import agree_on_inputs

    sources, local = trainer.sources()
    full = {n: p.detach() for n, p in trainer.params.items()}
    delta = sync.delta
    parts = agree_on_inputs(
        sync, sources, local, trainer.manifest, GROUPS, cap, 30, PhaseClock(), delta
    )
    out = dict(wrong=[], refused="", received=0, lower_bound=0)
    try:
        for part in parts:
            result = sync.plans.reshard_to_engines(
                sources,
                local,
                trainer.manifest,
                GROUPS,
                rank,
                cap,
                part,
                30,
                sync.data,
                checked=True,
                delta=delta,
            )
            out["received"] += result.stats.bytes_received
            out["lower_bound"] += result.lower_bound_bytes(rank)
            for name, buf in result.buffers.items():
                want = next(
                    t for t in trainer.manifest.ranks[rank % 2] if t.name == name
                )
                if not torch.equal(buf, reference_param(want, full)):
                    out["wrong"].append(name)
    except DeltaRefusal as e:
        out["refused"] = str(e)
    out["summary"] = delta.summary() if delta is not None else {}
    if delta is not None:
        if out["refused"] or fail:
            delta.drop(out["refused"] or "this rank failed (test)")
        else:
            delta.commit()
    dist.barrier()
    return out


def _rl_steps(rank: int, world: int, cap: int, lrs: list) -> list:
    """A full update, then one delta update after an AdamW step at each of ``lrs`` (0: no
    step, nothing changed)."""
    from sglang.srt.weight_sync.reshard_delta import ReshardDelta
    from sglang.srt.weight_sync.trainer_flow import TrainerSync

    trainer, sync = _Trainer(world), TrainerSync()
    sync.delta = ReshardDelta(digest=True)
    rows = [dict(lr=None, **_update(sync, trainer, rank, cap))]
    for lr in lrs:
        if lr:
            trainer.step(lr)
        rows.append(dict(lr=lr, **_update(sync, trainer, rank, cap)))
    return rows


def test_twenty_delta_updates_after_adamw_steps_are_exact_and_small():
    """Every update leaves every rank's buffers exactly a full update's; the first is full
    (at the lower bound), every later one a delta; a delta at a density of at most 3 %
    receives at most 5 % of a full update's bytes, and none more than a full update's plus
    1 %; unchanged weights cross as headers only. Whole: 20 steps at lr 1e-6 (10) and 1e-5
    (10), one without a step, one at lr 1e-2 (half the values change); streamed in chunks
    under a small cap: three of those."""
    runs = (
        (BIG_CAP, [1e-6] * 10 + [1e-5] * 10 + [0.0, 1e-2]),
        (SMALL_CAP, [1e-5, 0.0, 1e-2]),
    )
    for cap, lrs in runs:
        every = run_ranks(4, _rl_steps, cap, lrs)
        for rank, rows in enumerate(every):
            for i, row in enumerate(rows):
                what = f"cap {cap}, rank {rank}, update {i} (lr {row['lr']})"
                assert not row["wrong"], f"{what}: buffers differ: {row['wrong'][:4]}"
                assert not row["refused"], f"{what}: {row['refused']}"
                s = row["summary"]
                assert s["full_bytes_received"] == row["lower_bound"] > 0, (what, s)
                if i == 0:
                    assert s["mode"] == "full", (what, s)
                    assert s["why_full"] == "no update delivered yet", (what, s)
                    assert row["received"] == row["lower_bound"], (what, s)
                    continue
                assert s["mode"] == "delta" and s["digest_checked"], (what, s)
                full = s["full_bytes_received"]
                assert s["bytes_received"] <= full * 1.01, (what, s)
                if s["density"] <= 0.03:
                    assert s["bytes_received"] <= 0.05 * full, (what, s)
                if row["lr"] == 0.0:
                    assert s["density"] == 0 and s["regions"]["delta"] == 0, (what, s)
                    assert s["regions"]["full"] == 0, (what, s)
            densities = [r["summary"]["density"] for r in rows[1:-2]]
            assert 0 < min(densities) and max(densities) <= 0.03, (rank, densities)
            assert rows[-1]["summary"]["density"] > 0.5, rows[-1]["summary"]


def _faults(rank: int, world: int) -> list:
    """Deltas, then: rank 1 fails an update (its bases dropped, the others kept); rank 2's
    copy of a received region changed behind its back (the digest round refuses it
    there); rank 3 restarted (new bases); after each, one update that must be full and
    exact on every rank, then a delta again."""
    from sglang.srt.weight_sync.reshard_delta import ReshardDelta
    from sglang.srt.weight_sync.trainer_flow import TrainerSync

    trainer, sync = _Trainer(world), TrainerSync()
    sync.delta = ReshardDelta(digest=True)
    rows = []

    def update(tag: str, **kw):
        trainer.step(1e-5)
        rows.append(dict(tag=tag, **_update(sync, trainer, rank, BIG_CAP, **kw)))

    update("first")
    update("delta")
    update("rank 1 fails", fail=rank == 1)
    update("after rank 1 failed")
    update("delta again")
    if rank == 2:  # one bit of one kept base flipped
        chunk = next(iter(sync.delta._chunks.values()))
        base = next(t for t in chunk.received.regions.values() if t.numel() > 1)
        base.view(torch.int16).view(-1)[0] ^= 1
    update("rank 2's base changed")
    update("after rank 2's base changed")
    if rank == 3:
        sync.delta = ReshardDelta(digest=True)
    update("rank 3 restarted")
    update("delta at last")
    return rows


def test_a_failed_rank_a_changed_base_or_a_restart_makes_the_next_update_full():
    every = run_ranks(4, _faults)
    expect = {
        "first": "full",
        "delta": "delta",
        "rank 1 fails": "delta",
        "after rank 1 failed": "full",
        "delta again": "delta",
        "rank 2's base changed": "delta",
        "after rank 2's base changed": "full",
        "rank 3 restarted": "full",
        "delta at last": "delta",
    }
    for rank, rows in enumerate(every):
        for row in rows:
            what = f"rank {rank}, {row['tag']}"
            s = row["summary"]
            assert s["mode"] == expect[row["tag"]], (what, s)
            if row["tag"] == "rank 2's base changed" and rank == 2:
                assert "digest mismatch" in row["refused"], (what, row["refused"])
                continue
            assert not row["refused"], (what, row["refused"])
            assert not row["wrong"], (what, row["wrong"][:4])
            if s["mode"] == "full" and row["tag"] != "first":
                assert "different updates" in s["why_full"], (what, s)
                assert row["received"] == row["lower_bound"], (what, s)


def _some_ask(rank: int, world: int) -> str:
    from sglang.srt.weight_sync.phase_timing import PhaseClock
    from sglang.srt.weight_sync.reshard_delta import ReshardDelta
    from sglang.srt.weight_sync.trainer_flow import TrainerSync, agree_on_inputs

    trainer, sync = _Trainer(world), TrainerSync()
    sources, local = trainer.sources()
    delta = ReshardDelta() if rank % 2 else None
    try:
        agree_on_inputs(
            sync,
            sources,
            local,
            trainer.manifest,
            GROUPS,
            BIG_CAP,
            30,
            PhaseClock(),
            delta,
        )
    except ValueError as e:
        return str(e)
    return "agreed"


def test_delta_on_some_ranks_only_is_refused_on_every_rank():
    for rank, message in enumerate(run_ranks(4, _some_ask)):
        assert "some trainer ranks ask for delta updates and some do not" in message, (
            rank,
            message,
        )
        assert (
            f"trainer rank {rank}" in message and f"delta={bool(rank % 2)}" in message
        )
