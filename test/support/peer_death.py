"""A peer killed in the middle of a data-plane round, as one scenario for gloo ranks on CPU
(``test/distributed/test_polled_wait.py``) and NCCL ranks on two GPUs
(``test/gpu/test_peer_killed.py``): the same code, the backend and device its argument."""

import os
import time
from typing import Mapping

import torch
from plan_samples import whole_tensor_plan

# the watchdog's delays, shortened so that the survivor outlives them within seconds
WATCHDOG_ENV = {
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "2000",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "10",
}
ROWS = 1 << 12  # a 16 MiB fp32 tensor
BOUND_S = 3.0


def watchdog_delay_s(env: Mapping[str, str] = WATCHDOG_ENV) -> float:
    """How long after a failure NCCL's watchdog (4 x its dump delay) or heartbeat monitor
    would have acted, with ``env``'s settings (torch's defaults where unset: 15 s, 480 s),
    plus 5 s. By default ``WATCHDOG_ENV``, what ``killed_mid_round`` sets on every rank."""
    dump = int(env.get("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "15000")) / 1000
    return max(4 * dump, int(env.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "480"))) + 5


def killed_mid_round(rank: int, world: int, backend: str) -> dict:
    """Rank 1 sends rank 0 a 16 MiB tensor once (the pair connected), then, in the next
    update, ends its process where it would post its round's send (``os._exit``: no
    cleanup, as a killed process; its connections close), while rank 0 waits in the round. Rank 0's receive ends within ``BOUND_S`` (``PeerLost``, or gloo's
    closed connection), its data group abandoned and destroyed at that moment; on NCCL it
    then outlives the watchdog's delays; a new data group of its own reduces."""
    import torch.distributed as dist

    from sglang.srt.weight_sync.control_plane import fresh_group
    from sglang.srt.weight_sync.executor import DataGroup, execute
    from sglang.srt.weight_sync.protocol import DATA_GROUP_TIMEOUT_S

    os.environ.update(WATCHDOG_ENV)
    nccl = "nccl" in backend
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    data = DataGroup(
        fresh_group(list(range(world)), backend, DATA_GROUP_TIMEOUT_S, 0, 60.0),
        own=True,
    )
    the_plan = whole_tensor_plan(1, {0}, world, (ROWS, 1024))
    full = torch.arange(ROWS * 1024, dtype=torch.float32, device=device).view(
        ROWS, 1024
    )
    shards = {"w": full} if rank == 1 else {}

    def params():
        return {"p": torch.zeros(ROWS, 1024, device=device)} if rank == 0 else {}

    execute(the_plan, rank, shards, params(), data, 60.0)
    dist.barrier()
    if rank == 1:

        def die(ops):  # the round's send, never posted: the process ends here
            os._exit(17)

        dist.batch_isend_irecv = die
        execute(the_plan, 1, shards, {}, data, 60.0)
        return {}  # never reached
    out = {}
    started = time.monotonic()
    try:
        execute(the_plan, 0, {}, params(), data, BOUND_S)
        out["first"] = "landed"
    except RuntimeError as e:  # PeerLost, or gloo's closed connection
        out["first"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - started
    out["abandoned"] = data.abandoned
    out["destroyed"] = data.group not in dist.distributed_c10d._world.pg_map
    time.sleep(watchdog_delay_s() if nccl else 0)
    out["alive_after_s"] = time.monotonic() - started
    alone = DataGroup(
        fresh_group([0], backend, DATA_GROUP_TIMEOUT_S, 0, 60.0), own=True
    )
    x = torch.full((8,), 2.0, device=device)
    alone.wait(
        dist.all_reduce(x, group=alone.group, async_op=True), 60.0, "rank 0 alone"
    )
    out["alone"] = bool((x == 2.0).all().item())
    alone.abandon()
    return out
