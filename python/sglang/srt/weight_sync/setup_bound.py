"""NCCL's set-up that blocks the host, run within a bound: a call that posts a data group's
first works, on a thread of its own, waited for at most the update's bound.

A NCCL group makes its communicator lazily, inside its first collective (the data plane's
warm-up all-reduce), and connects a pair of ranks inside the first batch that pairs them
(``executor.DataGroup.connect``). Both block the calling thread before any ``Work`` exists:
the rank that is not rank 0 reads NCCL's unique id from the group's store (for the store's
timeout), then ``ncclCommInitRank`` waits in NCCL's bootstrap until every rank arrived
(without any bound: an engine that cannot reach the bootstrap root, a wrong
``NCCL_SOCKET_IFNAME`` across hosts, fails on its own side while the root and every other
rank wait for ever), and the first P2P batch waits in ``ncclGroupEnd`` for the peer's side.
A polled wait (``control_plane.poll``) cannot bound any of that: it starts only once the call
returned its work.

``issue_within`` therefore runs the call on a daemon thread (the caller's GPU and stream
set there, as NCCL keys its communicator by the tensor's device and orders the work after
the calling thread's current stream) and waits for it at most the bound. When the bound
runs out the caller gets ``SetUpStranded`` and goes on (its owner reports the failure and
drops the group, ``executor.DataGroup``); the thread stays inside NCCL until the call
returns, which a peer that gave up its own side in time makes happen, and then runs
``late`` (the owner aborts the group: ``ProcessGroupNCCL::abort``). Nothing aborts or
destroys the group while the thread is still inside the call: in blocking mode (the
default, used here) a communicator still initialising is in none of the group's maps that
``abort`` walks, and a P2P connection stuck in ``ncclGroupEnd`` would have its communicator
freed under it. Torch's non-blocking communicators (``ProcessGroupNCCL.Options().config
.blocking = 0``) are not used: their wait for readiness (``NCCLComm::waitReady``, inside the
first collective) still blocks the host, for ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (30 min by
default, read once per process), and whether it holds the communicator's lock meanwhile (so
that an ``abort`` from another thread would wait for it) cannot be read from torch's Python
side. On gloo (the CPU tests) the call does not block, and the thread costs only its start.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import torch

__all__ = ("SetUpStranded", "issue_within")


class SetUpStranded(RuntimeError):
    """The call did not return within the bound: its thread is still inside NCCL's set-up."""


class _Issue:
    """One call on its thread: its result or error, and whether the caller gave up on it."""

    def __init__(self, call: Callable[[], Any], late: Callable[[], None]) -> None:
        self.call, self.late = call, late
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.given_up = False
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def run(self, device: Optional[torch.device], stream) -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
                with torch.cuda.stream(stream):
                    self.result = self.call()
            else:
                self.result = self.call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, or dropped once it gave up
            self.error = e
        with self.lock:
            self.done.set()
            late = self.given_up
        if late:
            self.late()

    def give_up(self) -> bool:
        """Whether the caller gave up (the call had not returned); else it returned just now."""
        with self.lock:
            self.given_up = not self.done.is_set()
            return self.given_up


def issue_within(
    call: Callable[[], Any],
    timeout_s: float,
    device: Optional[torch.device],
    late: Callable[[], None],
    name: str = "weight-sync set-up",
) -> Any:
    """``call()``'s result (or its error, raised here), from a thread of its own waited for at
    most ``timeout_s``; ``SetUpStranded`` when it did not return by then, ``late`` then run
    on that thread once it does. ``device``: the GPU (and this thread's current stream on
    it) the call runs with."""
    stream = (
        torch.cuda.current_stream(device)
        if device is not None and device.type == "cuda"
        else None
    )
    issue = _Issue(call, late)
    started = time.monotonic()
    threading.Thread(
        target=issue.run, args=(device, stream), name=name, daemon=True
    ).start()
    if not issue.done.wait(max(timeout_s, 0.0)) and issue.give_up():
        raise SetUpStranded(
            f"the call did not return within {timeout_s:g}s (waited "
            f"{time.monotonic() - started:.3g}s): a peer never reached NCCL's set-up"
        )
    if issue.error is not None:
        raise issue.error
    return issue.result
