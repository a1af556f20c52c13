"""What the data plane's buffers may take of an engine rank's GPU memory, and how buffers
that cross CUDA streams are kept alive.

SGLang sizes its static memory (weights and the KV cache pool) as ``mem_fraction_static``
of the GPU when the engine starts; the rest is left to what serving allocates as it runs
(activations, CUDA graphs' pools, NCCL's buffers). Staging that a remote update holds while
the engine keeps serving comes out of that rest: ``staging_cap`` gives it at most
``STAGING_SHARE_OF_FREE`` of the memory free when the receive starts, so that serving
keeps the other part; what does not fit streams in during the pause (``remote.engine``).
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

__all__ = (
    "STAGING_SHARE_OF_FREE",
    "keep_for_stream",
    "staging_cap",
)

STAGING_SHARE_OF_FREE = 0.5


def staging_cap(
    requested: int, device: torch.device, free_bytes: Optional[int] = None
) -> Tuple[int, Optional[str]]:
    """The staging an engine rank may hold on ``device``: ``requested``, cut to
    ``STAGING_SHARE_OF_FREE`` of the free memory (``free_bytes``, else the device's own
    count), and why it was cut (None: not cut). The CPU's staging is not cut."""
    if device.type != "cuda":
        return requested, None
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    room = int(free_bytes * STAGING_SHARE_OF_FREE)
    if requested <= room:
        return requested, None
    return room, (
        f"staging cut from {requested} to {room} bytes: {STAGING_SHARE_OF_FREE:g} of the "
        f"{free_bytes} bytes free on {device} outside SGLang's static memory "
        "(mem_fraction_static); the rest of this rank's share streams in during the pause"
    )


def keep_for_stream(buffers: Iterable[torch.Tensor]) -> None:
    """Mark CUDA ``buffers`` used by the current stream (``record_stream``): a buffer
    allocated on another stream (the receiving thread's) and read here is then not handed
    out again, once freed, before this stream's reads of it ran. Nothing on the CPU."""
    for buf in buffers:
        if buf.is_cuda:
            buf.record_stream(torch.cuda.current_stream(buf.device))
