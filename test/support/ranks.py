"""Run a function on N gloo ranks in fresh processes and return what each rank returned.

Every worker first makes the functions this project must never call raise
(``DTensor.full_tensor``, ``gather_object``, ``all_gather_object``), so a test
fails loudly if any code path funnels or materialises payloads.
"""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Sequence

import torch.multiprocessing as mp

# pr: here
import zygote

# pr: here end

FORBIDDEN = ("full_tensor", "gather_object", "all_gather_object")


class ForbiddenCall(AssertionError):
    pass


_ORIGINALS: dict = {}


# pr: remote
@contextlib.contextmanager
def gathers_allowed():
    """The real functions back for a block: for a test that runs a framework's own gathering
    code on purpose (e.g. stock verl's ``full_tensor()`` producer) to compare with ours."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.tensor import DTensor

    refusing = {
        name: getattr(dist, name) for name in ("gather_object", "all_gather_object")
    }
    refusing["full_tensor"] = DTensor.full_tensor
    DTensor.full_tensor = _ORIGINALS["full_tensor"]
    for name in ("gather_object", "all_gather_object"):
        setattr(dist, name, _ORIGINALS[name])
        setattr(c10d, name, _ORIGINALS[name])
    try:
        yield
    finally:
        DTensor.full_tensor = refusing.pop("full_tensor")
        for name, fn in refusing.items():
            setattr(dist, name, fn)
            setattr(c10d, name, fn)


# pr: remote end
def forbid_gathers() -> None:
    """Replace the forbidden functions in this process with ones that raise."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.tensor import DTensor

    _ORIGINALS.setdefault("full_tensor", DTensor.full_tensor)
    for name in ("gather_object", "all_gather_object"):
        _ORIGINALS.setdefault(name, getattr(c10d, name))

    def refuse(name):
        def call(*args, **kwargs):
            raise ForbiddenCall(f"{name} was called")

        return call

    DTensor.full_tensor = refuse("DTensor.full_tensor")
    for name in ("gather_object", "all_gather_object"):
        setattr(dist, name, refuse(name))
        setattr(c10d, name, refuse(name))


def _worker(rank: int, world: int, store_path: str, fn, args, results) -> None:
    # pr: here
    zygote.start()  # first, while this process has one thread
    zygote.install()
    # pr: here end

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        forbid_gathers()
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# What the fork server imports once: the data plane for the distributed tests, and SGLang's
# Engine for the end-to-end ranks that start one (each rank then starts in milliseconds
# instead of importing SGLang for seconds), and its scheduler and detokenizer, which a rank's
# engine starts from the rank's zygote (``zygote``, first: it records what imports read).
PRELOAD = [
    # pr: here
    "zygote",
    # pr: here end
    "torch.distributed.tensor",
    "sglang.srt.weight_sync.executor",
    "sglang.srt.entrypoints.engine",
    # pr: here
    *zygote.PRELOAD,
    # pr: here end
]


@contextlib.contextmanager
def one_rank_world(timeout_s: float = 60.0):
    """A gloo world of this process alone (what DTensors and groups need in a unit test),
    destroyed at the end of the block."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(tmp, 'store')}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def _context(start_method: str):
    """By default a fork server that imported torch and sglang once (``PRELOAD``): every
    process it starts has this process's environment as the server started with it (the
    CPU engine's, ``test/conftest.py``), so a rank sets what differs in its own
    ``os.environ``. "spawn" for fresh interpreters."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(
    world: int,
    fn: Callable,
    *args: Any,
    timeout: float = 300,
    start_method: str = "forkserver",
    may_die: Sequence[int] = (),
) -> List[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; raises with every failing rank's traceback.

    After the first failure the others get a few seconds to report, then are killed,
    so one broken rank does not leave its peers hanging in a collective. Ranks in
    ``may_die`` (a test kills them) may give no answer: their result is then None.
    """
    ctx = _context(start_method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world, store, fn, args, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out, failures = {}, []
        living = set(range(world)) - set(may_die)
        try:
            for _ in range(world):
                wait = 10 if failures else timeout
                if living <= set(out):  # only ranks that may have died are left
                    wait = 2
                try:
                    rank, ok, value = results.get(timeout=wait)
                except queue.Empty:  # the rest are stuck behind a failure or a hang
                    missing = set(range(world)) - set(out)
                    if not missing <= set(may_die):
                        failures.append(f"ranks {sorted(missing)} gave no answer")
                    break
                if ok:
                    out[rank] = value
                else:
                    failures.append(f"rank {rank}:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        if failures:
            raise AssertionError("\n".join(failures))
        return [out.get(r) for r in range(world)]
