"""A remote engine rank's staging checks each round's regions for NaN/inf as they land, in
the receiving thread while the engine serves, so that the pause holds only the writes
(``remote.engine.Staging``); the apply step refuses what it flagged before any write. The
receiving thread works on the engine rank's GPU (``remote.engine.Receive``)."""

import gc
import threading
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.executor import Landing, PackLanding, _Pack
from sglang.srt.weight_sync.planner import Dest, Move
from sglang.srt.weight_sync.remote.engine import Receive, RemoteEngineSync, Staging
from sglang.srt.weight_sync.remote.trainer import RemoteSync
from sglang.srt.weight_sync.source_layout import MeshSpec


def _landing(*values) -> Landing:
    return Landing(torch.tensor(values, dtype=torch.bfloat16), None, ())


def test_staging_flags_a_round_holding_nan_or_inf_as_it_lands():
    for bad in (float("nan"), float("inf"), -float("inf")):
        staging = Staging(1 << 20, 5.0, "engine rank 0")
        staging.landed([_landing(1.0, 2.0), _landing(3.0)])
        assert not staging.nonfinite
        staging.landed([_landing(4.0), _landing(5.0, bad)])
        assert staging.nonfinite, bad
        staging.landed([_landing(6.0)])  # a later finite round does not clear it
        assert staging.nonfinite
        assert staging.held == 7 * 2 and len(staging.take(1.0)) == 5
    integer = Staging(1 << 20, 5.0, "engine rank 0")
    integer.landed([Landing(torch.tensor([1, 2]), None, ())])
    assert not integer.nonfinite


def _pack_landing(rows_by_dtype) -> PackLanding:
    """A pack of small moves from rank 0 to rank 1 (one per (dtype, rows)), received into
    one buffer, every region filled with its move's number."""
    moves = []
    for i, (dtype, rows) in enumerate(rows_by_dtype):
        shape = (rows, 3)
        holder = MeshSpec.full(shape, dtype, [0]).describe(f"t{i}").holders[0]
        dest = Dest(1, f"p{i}", (), (0, 0), shape)
        moves.append(Move(f"t{i}", Box((0, 0), shape), holder, dtype, dtype, (dest,)))
    pack = _Pack.of(moves, 1)
    flat, bases = pack.buffer(SimpleNamespace(device=torch.device("cpu")), True)
    for i, view in enumerate(pack.views(bases)):
        view.fill_(i)
    return PackLanding(flat, tuple(bases), pack, None)


def test_a_pack_is_checked_as_a_few_runs_that_cover_its_bytes():
    """A pack lands as one object however many regions it holds; its NaN/inf check reads
    one run per stretch of one dtype, which together cover every byte of the pack, so a
    NaN or inf in any of its regions flags the round."""
    kinds = [(torch.float32, 2), (torch.bfloat16, 1), (torch.float32, 4)]
    kinds += [(torch.float16, 2), (torch.bfloat16, 3)]
    landing = _pack_landing(kinds)
    runs = landing.runs()
    # the pack orders regions by element size: fp32, fp32, then bf16, fp16, bf16
    assert [r.dtype for r in runs] == [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.bfloat16,
    ]
    assert sum(r.numel() * r.element_size() for r in runs) == landing.nbytes
    staging = Staging(1 << 20, 5.0, "engine rank 0")
    staging.landed([landing])
    assert not staging.nonfinite and staging.held == landing.nbytes
    for i in range(len(kinds)):
        for bad in (float("nan"), float("inf")):
            poisoned = _pack_landing(kinds)
            poisoned.pack.views(list(poisoned.bases))[i][-1, -1] = bad
            staging = Staging(1 << 20, 5.0, "engine rank 0")
            staging.landed([_landing(1.0), poisoned])
            assert staging.nonfinite, (i, bad)


def test_the_receiving_thread_makes_the_engine_rank_gpu_current_first(monkeypatch):
    """A new thread's current GPU is GPU 0: without ``set_device`` the group's first
    collective makes a CUDA context there in the scheduler process of every engine rank.
    The thread sets the group's device (the rank's GPU) before it takes part in the update,
    and touches no GPU when the group moves data on the CPU."""
    calls = []

    def set_device(device):
        calls.append(("set_device", threading.current_thread().name, device))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)

    class Group:
        who = "group 'g' rank 3"

        def __init__(self, device):
            self.data = SimpleNamespace(device=torch.device(device))

        def run_update(self, part, timeout_s, check, params, staging, kept=None):
            # the collector paused while it receives, as in the pause
            calls.append(
                ("run_update", threading.current_thread().name, gc.isenabled())
            )
            return "received"

    for device, first in (
        ("cuda:5", [("set_device", torch.device("cuda", 5))]),
        ("cpu", []),
    ):
        calls.clear()
        receive = Receive(Group(device), Staging(1 << 20, 5.0, "r"), None, {}, 5.0)
        receive.thread.join(10.0)
        assert receive.error is None and receive.result == "received", receive.error
        thread = receive.thread.name
        assert calls == [(name, thread, arg) for name, arg in first] + [
            ("run_update", thread, False)
        ], calls
        assert thread != threading.current_thread().name


class _Seen(Exception):
    pass


@pytest.mark.parametrize(
    "step",
    [
        lambda probe: RemoteSync.update(probe, [("w", None)]),
        lambda probe: RemoteSync.update_sources(probe, {}, {}),
        lambda probe: RemoteEngineSync.apply(probe, None, None),
    ],
    ids=["trainer update", "trainer update_sources", "engine pause"],
)
def test_a_remote_update_runs_with_the_cyclic_collector_paused(step):
    """At a MoE model's tens of thousands of tensors an update allocates objects per
    tensor, and a full collection that they bring on takes most of a second (the peers
    wait for it). The trainer's update and the engine's pause run with the collector
    paused, and it runs again after, also when the step raises."""
    seen = []

    class Probe:
        def __getattr__(self, name):
            seen.append(gc.isenabled())
            raise _Seen(name)

    assert gc.isenabled()
    with pytest.raises(_Seen):
        step(Probe())
    assert seen == [False] and gc.isenabled()
