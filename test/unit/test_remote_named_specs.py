"""A remote trainer rank's description of its tensors (``remote.trainer.named_specs``):
what it reads from each DTensor, and its memo of the last answer (``KeptShards``)."""

import pytest
import torch
from ranks import one_rank_world
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from sglang.srt.weight_sync.remote.trainer import named_specs
from sglang.srt.weight_sync.source_layout import MeshRanks
from sglang.srt.weight_sync.trainer_flow import KeptShards


def _same(got, want) -> None:
    """Two answers alike: the same names in order, the same local tensors (the objects),
    equal layouts."""
    (got_specs, got_local), (want_specs, want_local) = got, want
    assert list(got_specs) == list(want_specs) == list(got_local) == list(want_local)
    assert got_specs == want_specs
    assert all(got_local[n] is want_local[n] for n in want_local)


def test_a_kept_answer_is_a_fresh_one_whatever_changed():
    """``named_specs`` with ``kept`` answers as it does without, after each change a training
    run may make between updates (a local tensor replaced as FSDP2 does, a DTensor
    redistributed, renamed, dropped, a plain tensor among them); rotary caches stay out, and
    a name given twice is refused also when the other tensors are the kept ones."""
    with one_rank_world():
        mesh = init_device_mesh("cpu", (1,))
        named = [
            (f"w{i}", distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)]))
            for i in range(5)
        ]
        named.append(("model.rotary_emb.inv_freq", torch.randn(2)))
        ranks, kept = MeshRanks(), KeptShards()
        first = named_specs(named, ranks, kept)
        assert "model.rotary_emb.inv_freq" not in first[0]
        _same(first, named_specs(named, MeshRanks()))
        assert kept.get(named[:-1]) is not None  # the same DTensors: kept
        _same(named_specs(named, ranks, kept), first)
        steps = [
            lambda n: setattr(n[1][1], "_local_tensor", torch.randn(4, 2)),
            lambda n: n.__setitem__(
                2, ("w2", distribute_tensor(torch.randn(4, 2), mesh, [Replicate()]))
            ),
            lambda n: n.__setitem__(0, ("renamed", n[0][1])),
            lambda n: n.pop(1),
            lambda n: n.append(("plain", torch.randn(3))),
        ]
        for step in steps:
            step(named)
            before = [n for n in named if not n[0].endswith("inv_freq")]
            assert kept.get(before) is None
            _same(named_specs(named, ranks, kept), named_specs(named, MeshRanks()))
        assert kept.get([n for n in named if not n[0].endswith("inv_freq")]) is None
        twice = [n for n in named if n[0] != "plain"]
        named_specs(twice, ranks, kept)
        assert kept.get([n for n in twice if not n[0].endswith("inv_freq")]) is not None
        with pytest.raises(ValueError, match="'w3' is named twice"):
            named_specs(twice + [("w3", twice[2][1])], ranks, kept)
