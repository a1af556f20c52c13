"""VerlEngine: an SGLang engine driven SPMD-style from every rank of a trainer's TP mesh.

It returns with the contract it had in SGLang 0.4.7 (removed upstream in 0.4.8):
build it on every rank of ``device_mesh_cpu`` (a 1-D CPU/gloo mesh of the
trainer ranks that form one inference TP group); the first rank of each node
hosts the engine. What changed is ``update_weights_from_tensor``: each rank
keeps its DTensor's local shard (never ``full_tensor()``), delivers it to the
engine rank beside it, and nothing is gathered (no ``gather_object``); the
engine reshards on the device (``UpdateWeightsDistributedReqInput``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Literal, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from sglang.srt.weight_sync.control_plane import ControlGroup
from sglang.srt.weight_sync.protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    check_timeout,
)
from sglang.srt.weight_sync.reshard_delta import ReshardDelta
from sglang.srt.weight_sync.trainer_flow import (
    ControlRequest,
    Mode,
    TrainerSync,
    UpdateReport,
    as_reply,
    drive,
    update_flow,
)

__all__ = ["VerlEngine"]

# What torchrun (torch elastic) sets in its workers: every ``tcp://`` rendezvous then uses the
# agent's store, so torch's ``_create_c10d_store`` makes a client on every rank.
_AGENT_STORE_FLAG = "TORCHELASTIC_USE_AGENT_STORE"


@contextlib.contextmanager
def _engine_process_env():
    """Start the hosted engine's processes without torchrun's agent-store flag (this rank
    keeps it). They rendezvous on SGLang's own port, where with the flag no rank would
    start the store's server, and even a TP-1 engine would hang at startup."""
    flag = os.environ.pop(_AGENT_STORE_FLAG, None)
    try:
        yield
    finally:
        if flag is not None:
            os.environ[_AGENT_STORE_FLAG] = flag


class VerlEngine:
    def __init__(
        self,
        device_mesh_cpu: DeviceMesh,
        nnodes: int = 1,
        backend: Literal["engine", "server"] = "engine",
        weight_sync_mode: Mode = "auto",
        weight_sync_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        weight_sync_timeout_s: float = DEFAULT_TIMEOUT_S,
        weight_sync_delta: bool = False,
        **kwargs,
    ):
        """``kwargs`` are ``Engine`` (or ``HttpServerEngineAdapter``) arguments;
        ``weight_sync_mode`` overrides where resharding runs ("engine" or "trainer");
        ``weight_sync_bucket_bytes`` caps the trainer side's staging and buffers;
        ``weight_sync_timeout_s`` bounds every wait of an update (a dead peer is
        reported, on every surviving rank, within about twice that);
        ``weight_sync_delta``: trainer-side updates send the other trainer ranks only what
        changed since the last update (worth it where the trainer spans hosts; the
        engine still receives whole buffers). Every rank passes the same."""
        self._device_mesh_cpu = device_mesh_cpu
        self._group = device_mesh_cpu.get_group()
        self._ranks = [int(r) for r in device_mesh_cpu.mesh.tolist()]
        self._tp_rank = device_mesh_cpu.get_local_rank()
        self._tp_size = device_mesh_cpu.size()
        self._weight_sync_mode = weight_sync_mode
        self._weight_sync_bucket_bytes = weight_sync_bucket_bytes
        self._timeout_s = check_timeout(weight_sync_timeout_s)
        self._control = ControlGroup(self._group, "verl-engine")
        self._sync = TrainerSync()
        if weight_sync_delta:
            self._sync.delta = ReshardDelta()
        tp_size_per_node = self._tp_size // nnodes
        node_rank = self._tp_rank // tp_size_per_node
        first_rank_in_node = self._tp_rank % tp_size_per_node == 0
        engine_kwargs = dict(
            **kwargs, tp_size=self._tp_size, node_rank=node_rank, nnodes=nnodes
        )

        self._engine = None
        if backend == "engine" and first_rank_in_node:
            from sglang.srt.entrypoints.engine import Engine

            os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
            with _engine_process_env():
                self._engine = Engine(**engine_kwargs)
        elif backend == "server" and self._tp_rank == 0:
            from sglang.srt.entrypoints.http_server_engine import (
                HttpServerEngineAdapter,
            )

            with _engine_process_env():
                self._engine = HttpServerEngineAdapter(**engine_kwargs)
        self._barrier("starting the engine")

    def generate(
        self,
        prompt: Optional[Union[List[str], str]] = None,
        sampling_params: Optional[Union[List[Dict], Dict]] = None,
        input_ids: Optional[Union[List[List[int]], List[int]]] = None,
        image_data: Optional[Union[List[str], str]] = None,
        return_logprob: Optional[Union[List[bool], bool]] = False,
        logprob_start_len: Optional[Union[List[int], int]] = None,
        top_logprobs_num: Optional[Union[List[int], int]] = None,
        token_ids_logprob: Optional[Union[List[List[int]], List[int]]] = None,
        lora_path: Optional[List[Optional[str]]] = None,
        custom_logit_processor: Optional[Union[List[str], str]] = None,
    ) -> Dict:
        """Arguments as ``GenerateReqInput``; every rank gets the output."""
        output = None
        if self._tp_rank == 0:
            output = self._engine.generate(
                prompt=prompt,
                sampling_params=sampling_params,
                input_ids=input_ids,
                image_data=image_data,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                token_ids_logprob=token_ids_logprob,
                lora_path=lora_path,
                custom_logit_processor=custom_logit_processor,
            )
        return self._from_rank0(output)

    def update_weights_from_tensor(
        self,
        named_tensors: List[Tuple[str, torch.Tensor]],
        load_format: Optional[str] = None,
    ) -> UpdateReport:
        """Update the engine's weights; call on every rank of the mesh with the same names.

        DTensors are delivered as their local shards; plain tensors are taken to
        be full on every rank. Returns this rank's report (where resharding ran,
        bytes received and their lower bound). Raises on every rank if the engine
        refused the update (its old weights are then still serving).
        """
        if load_format is not None:
            raise ValueError(
                f"load_format={load_format!r}: VerlEngine delivers HF-named shards and reshards them in the engine; "
                "only load_format=None is supported"
            )
        flow = update_flow(
            self._sync,
            named_tensors,
            self._ranks,
            self._group,
            self._weight_sync_mode,
            self._weight_sync_bucket_bytes,
            self._timeout_s,
        )
        return self._drive(flow)

    def update_weights_from_megatron(
        self, model_chunks, hf_vocab: int, shared_expert_hf: str = "shared_experts"
    ) -> UpdateReport:
        """Update from Megatron-core ``model_chunks`` (this rank's, VPP order) without a
        gather; see ``weight_sync.megatron_flow``. Call on every trainer rank."""
        from sglang.srt.weight_sync.megatron_flow import megatron_flow

        return self._drive(
            megatron_flow(
                self._sync,
                model_chunks,
                hf_vocab,
                self._ranks,
                self._group,
                self._weight_sync_mode,
                self._weight_sync_bucket_bytes,
                shared_expert_hf,
                self._timeout_s,
            )
        )

    def _drive(self, flow) -> UpdateReport:
        report = drive(
            flow, self._ranks, self._group, self._serve, timeout_s=self._timeout_s
        )
        if not report.success:
            raise RuntimeError(
                f"weight update {report.update_id} failed: {report.message}"
            )
        return report

    def _serve(self, request: ControlRequest) -> Tuple[bool, str]:
        """One control request, on the first rank (the engine's or the HTTP adapter's reply).
        No explicit begin/end session: the scheduler runs the update in a one-shot session
        (``weight_sync.sessions``), so this rank waits on one request, which the engine
        answers within ``control_plane.answer_bound_s`` (``answer_guard``) even if a scheduler hangs."""
        result = self._engine.update_weights_distributed(
            request.update_id,
            request.channel,
            flush_cache=request.final,
            timeout_s=self._timeout_s,
        )
        return as_reply(result, request)

    def release_memory_occupation(self) -> None:
        if self._tp_rank == 0:
            self._engine.release_memory_occupation()
        self._barrier("release_memory_occupation")

    def resume_memory_occupation(self) -> None:
        if self._tp_rank == 0:
            self._engine.resume_memory_occupation()
        self._barrier("resume_memory_occupation")

    def flush_cache(self) -> None:
        if self._tp_rank == 0:
            self._engine.flush_cache()
        self._barrier("flush_cache")

    def shutdown(self) -> None:
        self._sync.close()
        if self._engine is not None:
            self._engine.shutdown()

    def _from_rank0(self, value):
        """Rank 0's (small) result on every rank of the mesh."""
        return self._control.broadcast_object(
            value,
            self._ranks[0],
            None,
            f"trainer rank {dist.get_rank()}: hearing rank {self._ranks[0]}'s result",
        )

    def _barrier(self, what: str) -> None:
        """Wait for the first rank's engine call (starting the engine, generating, memory):
        work of unknown length, so bounded by the mesh group's own timeout, as upstream's."""
        self._control.barrier(
            None,
            f"trainer rank {dist.get_rank()}: waiting for rank "
            f"{self._ranks[0]} ({what})",
        )
