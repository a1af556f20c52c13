"""The remote staging's share of an engine rank's free GPU memory, and the buffers kept for
the stream that writes them (``weight_sync.staging_budget``)."""

import torch

from sglang.srt.weight_sync import staging_budget
from sglang.srt.weight_sync.staging_budget import (
    STAGING_SHARE_OF_FREE,
    keep_for_stream,
    staging_cap,
)


def _gpu() -> torch.device:
    return torch.device("cuda", 3)


def test_staging_within_the_free_share_is_not_cut():
    assert staging_cap(1 << 30, _gpu(), free_bytes=4 << 30) == (1 << 30, None)


def test_staging_past_the_free_share_is_cut_and_says_why():
    cap, why = staging_cap(4 << 30, _gpu(), free_bytes=2 << 30)
    assert cap == int((2 << 30) * STAGING_SHARE_OF_FREE) == 1 << 30
    assert why.startswith(f"staging cut from {4 << 30} to {1 << 30} bytes")
    assert "mem_fraction_static" in why and "cuda:3" in why


def test_the_free_memory_is_the_device_s_own_count(monkeypatch):
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 6 << 30, 80 << 30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    cap, why = staging_cap(4 << 30, _gpu())
    assert cap == 3 << 30 and why is not None
    assert asked == [_gpu()]


def test_cpu_staging_is_never_cut():
    assert staging_cap(4 << 30, torch.device("cpu"), free_bytes=0) == (4 << 30, None)


class _CudaBuf:
    is_cuda = True

    def __init__(self):
        self.device, self.streams = _gpu(), []

    def record_stream(self, stream):
        self.streams.append(stream)


def test_cuda_buffers_are_kept_for_the_current_stream_cpu_ones_untouched(monkeypatch):
    monkeypatch.setattr(
        staging_budget.torch.cuda, "current_stream", lambda device: ("stream", device)
    )
    cuda = _CudaBuf()
    keep_for_stream([cuda, torch.zeros(2)])
    assert cuda.streams == [("stream", _gpu())]
