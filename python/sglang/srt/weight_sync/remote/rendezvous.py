"""Where the ranks of a weight-sync group meet: the TCP store the trainer's first rank hosts,
a port to host it on, and a bounded arrival of every member before any process group is
made in it (a process group's own rendezvous would wait for its whole, long timeout).
The groups themselves are made by ``control_plane.join_group``.
"""

from __future__ import annotations

import random
import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from sglang.srt.weight_sync.control_plane import PeerLost, forget_keys

__all__ = ("forget_before", "free_port", "meet", "open_store", "prefixed_store")


def free_port(low: int = 10000, high: Optional[int] = None, tries: int = 400) -> int:
    """A TCP port in [``low``, ``high``) that is free now, for a store bound later.

    ``high`` defaults to the start of the kernel's ephemeral range (32768 unless
    ``/proc/sys/net/ipv4/ip_local_port_range`` says otherwise): every outgoing connection and
    every ``bind(0)`` takes its port from that range, so a port chosen there can be gone by the
    time the store binds it. AReaL and SGLang 0.5.23 pick their rendezvous ports below it too.
    """
    if high is None:
        high = _ephemeral_low()
    candidates = range(low, max(low, high))
    for port in random.sample(candidates, min(tries, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in [{low}, {high}) after {tries} tries")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def open_store(address: str, port: int, host: bool, timeout_s: float) -> dist.Store:
    """The TCP store the ranks of a weight-sync group meet in (``join_group``): hosted by the
    trainer's first rank (``host``), a client elsewhere. Its waits are bounded by
    ``timeout_s``; a client that cannot reach the host within it raises."""
    return dist.TCPStore(
        address,
        port,
        is_master=host,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def prefixed_store(store: dist.Store, prefix: str) -> dist.Store:
    """``store`` with every key under ``prefix`` (one epoch's keys apart from another's)."""
    return dist.PrefixStore(prefix, store)


def meet(
    store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float, phase: str
) -> None:
    """Wait at most ``timeout_s`` until all ``size`` ranks arrived under ``prefix`` in
    ``store``; ``PeerLost`` names the ranks that did not. Run before a group is made: a
    process group's own rendezvous waits for its whole (long) timeout."""
    store.set(f"{prefix}/arrived/{rank}", "1")
    keys = [f"{prefix}/arrived/{r}" for r in range(size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError) as e:
        absent = [r for r, k in enumerate(keys) if not store.check([k])]
        raise PeerLost(
            f"{phase}: ranks {absent} of {size} did not arrive within {timeout_s:g}s ({e})"
        ) from None


def forget_before(store: dist.Store, stem: str, number: int) -> int:
    """Delete the keys of every ``{stem}{n}/`` with ``n`` below ``number`` (the epochs of a
    weight-sync group before the one every member just met in: each member left its
    earlier epochs before it came, so none reads their keys again); how many it deleted.
    A store that cannot list its keys is left as it is (``control_plane.forget_keys``)."""
    try:
        keys = store.list_keys()
    except (AttributeError, NotImplementedError, RuntimeError):
        return 0
    earlier = {
        int(n)
        for n in (k[len(stem) :].split("/", 1)[0] for k in keys if k.startswith(stem))
        if n.isdigit() and int(n) < number
    }
    return sum(forget_keys(store, f"{stem}{n}") for n in sorted(earlier))
