"""A remote engine rank's staging checks each round's regions for NaN/inf as they land, in
the receiving thread while the engine serves, so that the pause holds only the writes
(``remote.engine.Staging``); the apply step refuses what it flagged before any write. The
receiving thread works on the engine rank's GPU (``remote.engine.Receive``)."""

import threading
from types import SimpleNamespace

import torch

from sglang.srt.weight_sync.executor import Landing
from sglang.srt.weight_sync.remote.engine import Receive, Staging


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

        def run_update(self, part, timeout_s, check, params, staging):
            calls.append(("run_update", threading.current_thread().name, part))
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
            ("run_update", thread, None)
        ], calls
        assert thread != threading.current_thread().name
