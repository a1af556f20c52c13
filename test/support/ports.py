"""Free TCP ports for the tests' servers and rendezvous, from a range nothing else takes ports from.

A port is checked free here and bound later, by a server or a TCPStore that starts seconds or a
minute afterwards. In that window another process may take it: every outgoing connection and
every ``bind(0)`` gets a port from the kernel's ephemeral range (32768+ by default; SGLang 0.5.10
and 0.5.12 take their ``nccl_port`` that way), and SGLang 0.5.23 picks its ``nccl_port`` at random
from [22000, 30000). So the ports come from [10000, 22000), below both, each checked by binding
it: a server's port plus 10000 (0.5.12's gRPC port) stays below the ephemeral range. A process
never gets the same port twice. Under pytest-xdist (``make test`` runs two workers) each worker
takes its ports from a slice of that range of its own, so two workers never hand out one port.
"""

from __future__ import annotations

import os
import random
import socket
from typing import List, Set, Tuple

__all__ = ["free_port", "free_ports"]

LOW, HIGH = 10000, 22000
_handed_out: Set[int] = set()


def free_port() -> int:
    """A port in [10000, 22000) (this xdist worker's slice of it), free now and not handed
    out before in this process."""
    low, high = _slice()
    for port in random.sample(range(low, high), min(400, high - low)):
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in [{low}, {high}) that was not handed out")


def _slice() -> Tuple[int, int]:
    """[LOW, HIGH), or the n-th of k equal slices of it in xdist worker ``gw<n>`` of k."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return LOW, HIGH
    width = (HIGH - LOW) // count
    start = LOW + int(worker[2:]) % count * width
    return start, start + width


def free_ports(n: int) -> List[int]:
    """``n`` distinct ports, as ``free_port``."""
    return [free_port() for _ in range(n)]


def _bindable(port: int) -> bool:
    """Whether a socket can bind ``port`` on every interface now."""
    probe = socket.socket()
    try:
        probe.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        probe.close()
