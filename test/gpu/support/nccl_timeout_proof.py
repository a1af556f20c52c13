"""One GPU's proof that a data-plane wait running out on NCCL leaves the process alive.

Run as a child process by ``test/gpu/test_nccl_timeout.py`` (its survival is what is
checked, so it cannot be the test's own process)::

    python test/gpu/support/nccl_timeout_proof.py OUT.json [--old]

A one-rank world (``cpu:gloo,cuda:nccl``, bound to GPU 0, as SGLang's and a trainer's
groups are) stands for serving; its first collective makes its communicator and, with it,
NCCL's watchdog and heartbeat monitor. Then a data group's collective is made to hang:
``torch.cuda._sleep`` is queued on the current stream ahead of it, and NCCL's stream waits for
the current one, so the work cannot complete within the bound.

* default: the data plane's own group (``DataGroup.over_ranks_of``, made under
  ``nccl_watchdog.DATA_PLANE_ENV``) and its polled wait (``DataGroup.wait``): the wait raises
  ``PeerLost`` within the bound, the group is aborted and destroyed; the process then outlives
  the watchdog's dump delay (4 x ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``) and the heartbeat
  monitor's timeout (``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``), both shortened by the caller,
  the serving group still reduces, and a renewed data group's collective succeeds;
* ``--old``: what the data plane did before, for contrast: a plain ``new_group`` and
  ``work.wait(timeout=...)``; the process is expected to end (the watchdog's teardown).

Each step's result is written to OUT.json as soon as it is known (a process that ends keeps
what it wrote).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta

BOUND_S = 2.0  # the data plane's bound on the hung collective
SLEEP_S = 8.0  # how long the queued sleep holds the collective back


def _write(path: str, result: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def _cycles_per_second(torch) -> float:
    """The GPU's ``_sleep`` cycles per second, measured."""
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000.0)


def _outlive_the_watchdog() -> float:
    """Seconds past the failure after which the watchdog's teardown would have come."""
    dump_s = int(os.environ.get("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "15000")) / 1000
    heartbeat_s = int(os.environ.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "480"))
    return max(4 * dump_s, heartbeat_s) + 5.0


def main(out: str, old: bool) -> int:
    import torch
    import torch.distributed as dist

    from sglang.srt.weight_sync.control_plane import PeerLost
    from sglang.srt.weight_sync.executor import DataGroup
    from sglang.srt.weight_sync.protocol import DATA_GROUP_TIMEOUT_S

    result = {"mode": "old" if old else "polled", "torch": torch.__version__}
    _write(out, result)
    torch.cuda.set_device(0)
    with socket.socket() as probe:  # a port for this one-rank group's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    serving = torch.ones(1, device="cuda")
    dist.all_reduce(serving)
    torch.cuda.synchronize()
    rate = _cycles_per_second(torch)
    if old:
        group = dist.new_group([0], backend="nccl")
        data = None
    else:
        data = DataGroup.over_ranks_of(
            None, DATA_GROUP_TIMEOUT_S, DataGroup.number_proposal(None, 0), 60.0
        )
        group = data.group
        data.warm_up(60.0, "proof: warming up")
    torch.cuda.synchronize()
    torch.cuda._sleep(
        int(rate * SLEEP_S)
    )  # ahead of the collective, on the current stream
    flag = torch.ones(4, device="cuda")
    work = dist.all_reduce(flag, group=group, async_op=True)
    started = time.monotonic()
    try:
        if old:
            work.wait(timeout=timedelta(seconds=BOUND_S))
        else:
            data.wait(work, BOUND_S, "proof: the held-back collective")
        result["first"] = "completed"
    except (PeerLost, RuntimeError) as e:
        result["first"] = f"{type(e).__name__}: {e}"
    result["raised_after_s"] = time.monotonic() - started
    if data is not None:
        result["abandoned"] = data.abandoned
        result["destroyed"] = group not in dist.distributed_c10d._world.pg_map
    _write(out, result)
    wait_s = _outlive_the_watchdog()
    time.sleep(wait_s)
    result["alive_after_s"] = time.monotonic() - started
    _write(out, result)
    torch.cuda.synchronize()
    serving = torch.ones(1, device="cuda")
    dist.all_reduce(serving)
    torch.cuda.synchronize()
    result["serving"] = serving.item() == 1.0
    _write(out, result)
    if not old:
        renewed = DataGroup.over_ranks_of(
            None, DATA_GROUP_TIMEOUT_S, DataGroup.number_proposal(None, 0), 60.0
        )
        x = torch.full((1024,), 3.0, device="cuda")
        renewed.wait(
            dist.all_reduce(x, group=renewed.group, async_op=True),
            60.0,
            "proof: the renewed group",
        )
        torch.cuda.synchronize()
        result["renewed"] = bool((x == 3.0).all().item()) and not renewed.abandoned
        renewed.abandon()
    result["done"] = True
    _write(out, result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--old" in sys.argv[2:]))
