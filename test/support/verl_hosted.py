"""``VerlEngine`` behind ``hosted_engine.HostedEngine``'s interface.

The end-to-end cases (``update_cases.engine_job``) take what hosts the engine as the job's
``host``; they default to ``HostedEngine``, which drives the series' own entry points. This
hands them ``VerlEngine`` (verl 0.4.7's contract, which stays in this repository) instead,
so that ``test_verl_engine.py`` runs the same steps and checks through it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from sglang.srt.entrypoints.verl_engine import VerlEngine
from sglang.srt.weight_sync.trainer_flow import TrainerSync, UpdateReport

__all__ = ["VerlHost"]


class VerlHost:
    """A ``VerlEngine`` over ``mesh``; each ``HostedEngine`` method calls its counterpart."""

    def __init__(self, mesh: DeviceMesh, **kwargs: Any) -> None:
        self._verl = VerlEngine(mesh, **kwargs)

    @property
    def engine(self) -> Optional[Any]:
        """The engine (or HTTP adapter) this rank's ``VerlEngine`` hosts; None elsewhere."""
        return self._verl._engine

    @property
    def sync(self) -> TrainerSync:
        """The channels ``VerlEngine``'s own updates use."""
        return self._verl._sync

    def update(self, named_tensors: List[Tuple[str, torch.Tensor]]) -> UpdateReport:
        """``VerlEngine.update_weights_from_tensor``."""
        return self._verl.update_weights_from_tensor(named_tensors)

    def generate(self, **request: Any) -> Any:
        """``VerlEngine.generate``: every rank gets the first rank's output."""
        return self._verl.generate(**request)

    def call(self, method: str, **kwargs: Any) -> Any:
        """``VerlEngine``'s own ``method`` (``flush_cache``, ``release_memory_occupation``...)."""
        return getattr(self._verl, method)(**kwargs)

    def shutdown(self) -> None:
        self._verl.shutdown()
