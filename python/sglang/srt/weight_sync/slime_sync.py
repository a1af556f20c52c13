"""Glue between slime's Megatron weight updaters and this package (``integrations/slime``).

* ``SlimeColocatedSync``: slime's colocated updater (``UpdateWeightFromTensor``) without its
  TP gather: the trainer ranks of one engine (slime's IPC gather group, colocated with the
  engine's TP ranks) hand their Megatron-core model chunks to ``megatron_flow``; the group's
  first rank serves its control requests over HTTP (``/update_weights_distributed``), and each
  engine rank receives its own bytes over a local channel. No ``all_gather_param``, no HF
  conversion, no full tensor on any rank.
* ``remote.frameworks.slime_remote_sync``: slime's distributed updater (``UpdateWeightFromDistributed``) without
  the rank-0 funnel: every trainer rank joins a weight-sync group with the engines' TP ranks
  (``RemoteSync``), and ``RemoteSync.update_megatron`` sends each rank's own regions.

State lives on the objects slime's updater keeps between updates, never in this module.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch.distributed as dist

from sglang.srt.weight_sync.protocol import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S
from sglang.srt.weight_sync.trainer_flow import (
    ControlRequest,
    Mode,
    TrainerSync,
    UpdateReport,
    as_reply,
    drive,
)

__all__ = ("SlimeColocatedSync",)


class SlimeColocatedSync:
    """One engine's trainer ranks (``group_ranks``, ``group``: slime's IPC gather group, whose
    first rank is the engine's gather source) updating it from Megatron-core local
    parameters. Every rank of the group makes it and calls ``update`` together; only the first
    rank talks to the engine (``url``, slime's ``SGLangEngine.get_url()``)."""

    def __init__(
        self,
        url: Optional[str],
        group_ranks: Sequence[int],
        group,
        mode: Mode = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.url = url.rstrip("/") if url else None
        self.group_ranks, self.group = [int(r) for r in group_ranks], group
        self.mode, self.bucket_bytes, self.timeout_s = mode, bucket_bytes, timeout_s
        self.sync = TrainerSync()
        self.weight_version: Optional[str] = None
        if dist.get_rank() == self.group_ranks[0] and not self.url:
            raise ValueError(
                f"trainer rank {dist.get_rank()}: the first rank of an engine's group needs the "
                "engine's URL (SGLangEngine.get_url())"
            )

    def update(
        self,
        model_chunks: Sequence,
        hf_vocab: int,
        weight_version: Optional[str] = None,
        shared_expert_hf: str = "shared_experts",
    ) -> UpdateReport:
        """Send this rank's local parameters; raises on every rank of the group if the engine
        refused the update (its old weights then still serve)."""
        from sglang.srt.weight_sync.megatron_flow import megatron_flow

        self.weight_version = weight_version
        flow = megatron_flow(
            self.sync,
            model_chunks,
            hf_vocab,
            self.group_ranks,
            self.group,
            self.mode,
            self.bucket_bytes,
            shared_expert_hf,
            self.timeout_s,
        )
        report = drive(
            flow, self.group_ranks, self.group, self._serve, timeout_s=self.timeout_s
        )
        if not report.success:
            raise RuntimeError(
                f"trainer rank {dist.get_rank()}: weight update {report.update_id} of "
                f"{self.url or 'the engine'} failed: {report.message}"
            )
        return report

    def _serve(self, request: ControlRequest) -> Tuple[bool, str]:
        """One control request, on the group's first rank: ``/update_weights_distributed``."""
        import requests

        body = {
            "update_id": request.update_id,
            "channel": request.channel,
            "timeout_s": self.timeout_s,
            "flush_cache": request.final,
            "weight_version": self.weight_version if request.final else None,
        }
        reply = requests.post(
            f"{self.url}/update_weights_distributed", json=body, timeout=None
        )
        if reply.status_code == 404:
            return False, (
                f"{self.url} has no /update_weights_distributed: the engine needs this "
                "wheel (sglang==<slime's pin>+dwu1)"
            )
        if reply.status_code not in (200, 400):
            reply.raise_for_status()
        return as_reply(reply.json(), request)

    def close(self) -> None:
        self.sync.close()
