"""The planner's property-test oracle, shared by the global planner's and the rank plans' tests.

``scenarios`` draws random shapes, meshes, placements and target boxes (pieces landing plain
or permuted); ``check_plan`` replays a plan symbolically on index-encoded tensors
(``replay``): every destination element written exactly once, with the right source element,
from a rank that really holds it, and each rank receiving exactly (needed - held) bytes, with
``held`` computed here independently; ``covers`` says by brute force whether the sources hold
every target element.
"""

import torch
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.source_layout import describe_mesh
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

__all__ = ["check_plan", "covers", "replay", "scenarios"]


@st.composite
def scenarios(draw):
    world = draw(st.integers(1, 6))
    ntensors = draw(st.integers(1, 3))
    sources, fulls = {}, {}
    for t in range(ntensors):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
        # A mesh over a random subset/permutation of ranks; every rank of the world is in it
        # at most once. Random Shard/Replicate placements, uneven shards included.
        mesh_ranks = draw(st.permutations(range(world)))
        mesh_ndim = draw(st.integers(1, 2))
        if mesh_ndim == 2 and world % 2 == 0 and world > 1:
            mesh = [list(mesh_ranks[: world // 2]), list(mesh_ranks[world // 2 :])]
        else:
            mesh_ndim, mesh = 1, list(mesh_ranks)
        placements = tuple(
            draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(ndim)]))
            for _ in range(mesh_ndim)
        )
        name = f"t{t}"
        sources[name] = describe_mesh(name, shape, torch.float32, mesh, placements)
        fulls[name] = (
            torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float64).reshape(
                shape
            )
            + 1000 * t
        )
    # Targets: each rank wants a few random boxes, stacked along dim 0 of one parameter per tensor.
    targets = {}
    for rank in range(world):
        params = []
        for name, src in sources.items():
            if not draw(st.booleans()):
                continue
            pieces, row = [], 0
            for _ in range(draw(st.integers(1, 3))):
                lo = [draw(st.integers(0, s - 1)) for s in src.shape]
                sz = [draw(st.integers(1, s - o)) for s, o in zip(src.shape, lo)]
                box = Box(tuple(lo), tuple(sz))
                perm = (
                    tuple(draw(st.permutations(range(len(sz)))))
                    if draw(st.booleans())
                    else None
                )
                piece = Piece(
                    name, box, (), (row,) + (0,) * (len(sz) - 1), perm
                )  # perm: lands transposed
                pieces.append(piece)
                row += piece.dest_box().sizes[0]
            shape = (row,) + tuple(
                max(p.dest_box().sizes[d] for p in pieces)
                for d in range(1, len(src.shape))
            )
            params.append(
                ParamTarget(f"{name}@{rank}", shape, torch.float32, tuple(pieces))
            )
        targets[rank] = params
    bucket = draw(st.sampled_from([16, 64, 1 << 20]))
    return sources, fulls, targets, bucket


def replay(p, sources, fulls, targets):
    """Apply every move of the plan to index-encoded tensors; count writes per element."""
    out = {
        (r, t.name): torch.zeros(t.shape, dtype=torch.float64)
        for r, ts in targets.items()
        for t in ts
    }
    writes = {k: torch.zeros(v.shape, dtype=torch.int64) for k, v in out.items()}
    moves = list(p.local) + [m for rnd in p.rounds for m in rnd]
    for m in moves:
        held = sources[m.tensor].box_of(m.src)
        assert held == m.src_shard and held.contains(m.region), (
            f"rank {m.src} does not hold {m.region} of {m.tensor}"
        )
        for d in m.dests:
            key = (d.rank, d.param)
            data = fulls[m.tensor][m.region.slices()]
            out[key][d.index][d.box(m.region).slices()] = (
                data if d.perm is None else data.permute(d.perm)
            )
            writes[key][d.index][d.box(m.region).slices()] += 1
    return out, writes


def check_plan(p, sources, fulls, targets):
    out, writes = replay(p, sources, fulls, targets)
    for rank, ts in targets.items():
        needed = held = 0
        for t in ts:
            covered = torch.zeros(t.shape, dtype=torch.int64)
            expect = torch.zeros(t.shape, dtype=torch.float64)
            for piece in t.pieces:
                covered[piece.dest_box().slices()] += 1
                expect[piece.dest_box().slices()] = piece.region(fulls[piece.tensor])
                needed += piece.box.numel * 4
                mine = sources[piece.tensor].box_of(rank)
                overlap = (
                    mine.intersect(piece.box)
                    if mine is not None and not mine.is_empty()
                    else None
                )
                held += overlap.numel * 4 if overlap else 0
            assert torch.equal(writes[(rank, t.name)], covered), (
                f"rank {rank} {t.name}: not written exactly once"
            )
            assert torch.equal(out[(rank, t.name)], expect), (
                f"rank {rank} {t.name}: wrong data"
            )
        assert p.received_bytes(rank) == needed - held == p.lower_bound_bytes(rank)


def covers(sources, targets):
    """Whether every target element is held somewhere (computed by brute force)."""
    for ts in targets.values():
        for t in ts:
            for piece in t.pieces:
                mask = torch.zeros(sources[piece.tensor].shape, dtype=torch.bool)
                for h in sources[piece.tensor].holders:
                    if not h.box.is_empty():
                        mask[h.box.slices()] = True
                if not mask[piece.box.slices()].all():
                    return False
    return True
