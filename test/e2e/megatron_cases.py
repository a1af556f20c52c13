"""What each trainer rank does in the Megatron-core end-to-end test.

Every rank of a gloo world builds a real megatron-core ``GPTModel`` (local,
non-TE spec, CPU) at TP x PP, loads a tiny HF Qwen2 checkpoint's "trained"
weights into its local parameters from the pieces ``megatron_layout`` gives it
(padded vocab rows zero), checks that its forward gives HF's logits, then
updates a real SGLang CPU engine beside it (``hosted_engine.HostedEngine``) with
``megatron_flow`` (what ``VerlEngine.update_weights_from_megatron`` drives), each control
request served by the engine's ``update_weights_distributed`` so that its reply's figures
are kept: no
gather of any kind (the forbidden-call recorder is live), the engine's parameters,
generation and the bytes each rank received are checked by the test.

megatron-core's forward on CPU needs four shims, all about device placement, RNG
or a missing library, none about the math: RoPE moves ``inv_freq`` to
``torch.cuda.current_device()`` (answered "cpu"), the default causal mask is built on
CUDA (an explicit mask is passed), attention dropout forks the CUDA RNG tracker (a
no-op fork; dropout is 0), and 0.16.1's MoE router reads ``te_general_gemm``, which is
left undefined without TransformerEngine (set to None: its own ``torch.mm`` path).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def build_gpt(
    hf_config, tp: int, pp: int, padded_vocab: int, ep: int = 1, layer_spec=None
):
    """A megatron-core GPTModel (local spec, or ``layer_spec``) shaped like the tiny HF Qwen2
    or Qwen3-MoE."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    c = hf_config
    moe = getattr(c, "num_experts", None)
    extra = (
        dict(add_qkv_bias=True)
        if not moe
        else dict(
            qk_layernorm=True,
            num_moe_experts=moe,
            moe_ffn_hidden_size=c.moe_intermediate_size,
            moe_router_topk=c.num_experts_per_tok,
            expert_model_parallel_size=ep,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
    )
    config = TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=getattr(c, "head_dim", None)
        or c.hidden_size // c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **extra,
    )
    spec = layer_spec or get_gpt_layer_local_spec(
        num_experts=moe,
        moe_grouped_gemm=False,
        qk_layernorm=bool(moe),
        normalization="RMSNorm",
    )
    return GPTModel(
        config,
        spec,
        vocab_size=padded_vocab,
        max_sequence_length=c.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=c.rope_parameters["rope_theta"],
        share_embeddings_and_output_weights=c.tie_word_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )


def load_hf_weights(model, weights, hf_vocab: int) -> None:
    """Write HF tensors into this rank's local parameters through its pieces (padding zero)."""
    from sglang.srt.weight_sync.megatron_flow import this_rank
    from sglang.srt.weight_sync.megatron_layout import (
        describe_model_chunks,
        rank_params,
    )

    desc, buffers = describe_model_chunks([model], hf_vocab, this_rank())
    with torch.no_grad():
        for param in rank_params(desc, this_rank()):
            local = buffers[param.buffer]
            local.zero_()
            for piece in param.pieces:
                delta = [o - b for o, b in zip(piece.offsets, piece.box.offsets)]
                local[piece.box.translate(delta).slices()] = weights[piece.tensor][
                    piece.box.slices()
                ].to(local.dtype)


def forward_matches_hf(model, model_dir, weights, hf_vocab: int):
    """Max |mcore logits - HF logits| over this rank's real vocab columns (fp32), on the last
    stage; None elsewhere. Stages pass hidden states by plain point-to-point (the test's
    stand-in for a pipeline schedule; the layers, TP collectives and logits are megatron-core's)."""
    from engine import load_hf_model
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: (
        "cpu"
    )  # RoPE's inv_freq placement (see module docstring)
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *a, **k: (
        contextlib.nullcontext()
    )
    moe_utils.__dict__.setdefault(
        "te_general_gemm", None
    )  # the router's torch.mm path (see module docstring)
    ids = torch.tensor([[3, 17, 101, 7, 250, 42]])
    s = ids.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(s, 1, model.config.hidden_size)  # [s, b, h]
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(
            ids, torch.arange(s).view(1, -1), attention_mask=mask
        )  # hidden [s, b, h] or logits [b, s, V/T]
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None
        ref = load_hf_model(model_dir, weights).float()(ids).logits
    per, t = out.shape[-1], ps.get_tensor_model_parallel_rank()
    lo, hi = t * per, min((t + 1) * per, hf_vocab)
    return float((out[..., : hi - lo] - ref[..., lo:hi]).abs().max())


def one_hop_bound(model, hf_config, groups) -> int:
    """Bytes this rank's engine rank lacks from the trainer ranks' own parameters: the
    planner's lower bound from megatron-core's pieces straight to the engine's targets."""
    from benchmark.weight_sync.hand_rules import model_targets_from_config
    from sglang.srt.weight_sync.megatron_flow import all_coords, this_rank
    from sglang.srt.weight_sync.megatron_layout import (
        describe_model_chunks,
        megatron_sources,
    )
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.target_layout import EngineParallel
    from sglang.srt.weight_sync.trainer_flow import TrainerSync

    desc, _ = describe_model_chunks([model], hf_config.vocab_size, this_rank())
    sources = megatron_sources(desc, all_coords(TrainerSync(), this_rank()))
    targets = model_targets_from_config(
        hf_config, EngineParallel(len(groups[0])), torch.bfloat16
    )
    needed = {g[r]: targets.for_rank(r) for g in groups for r in range(len(g))}
    return plan(sources, needed, aliases=targets.aliases).lower_bound_bytes(
        dist.get_rank()
    )


def megatron_job(rank: int, world: int, job: dict) -> dict:
    import tiny_models
    from engine import WORKER_ENGINE_ARGS, omp_bind, weight_update_session
    from hosted_engine import HostedEngine
    from torch.distributed.device_mesh import init_device_mesh
    from update_cases import _forbidden_calls, _generate, checksums, new_weights

    from sglang.srt.weight_sync.megatron_flow import megatron_flow
    from sglang.srt.weight_sync.trainer_flow import as_reply, drive

    tp, pp, ep, engine_tp = job["tp"], job["pp"], job.get("ep", 1), job["engine_tp"]
    os.environ["SGLANG_TEST_FORBIDDEN_LOG"] = job["forbidden_log"]
    if engine_tp > 1:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(engine_tp)
    hf_config = tiny_models.tiny_config(job.get("kind", "qwen2"))
    vocab = hf_config.vocab_size
    model = build_gpt(hf_config, tp, pp, job["padded_vocab"], ep)
    weights = new_weights(job["model_dir"], job["seed"])
    load_hf_weights(model, weights, vocab)
    record = {
        "forward_max_diff": forward_matches_hf(model, job["model_dir"], weights, vocab)
    }
    engines = init_device_mesh(
        "cpu",
        (world // engine_tp, engine_tp, 1),
        mesh_dim_names=("dp", "infer_tp", "infer_pp"),
    )
    mesh = engines["infer_tp"]
    group, ranks = mesh.get_group(), [int(r) for r in mesh.mesh.tolist()]
    host = HostedEngine(mesh, model_path=str(job["model_dir"]), **WORKER_ENGINE_ARGS)
    try:
        groups = engines.mesh.reshape(-1, engine_tp).tolist()
        record["one_hop_bound"] = one_hop_bound(model, hf_config, groups)
        replies = []

        def serve(request):
            with weight_update_session(host.engine):
                reply = host.engine.update_weights_distributed(
                    request.update_id,
                    request.channel,
                    flush_cache=request.final,
                    timeout_s=120,
                )
            replies.append(dict(reply, describe=request.describe))
            return as_reply(reply)

        before = _forbidden_calls(job["forbidden_log"])
        report = drive(
            megatron_flow(host.sync, [model], vocab, ranks, group),
            ranks,
            group,
            serve,
            timeout_s=120,
        )
        record.update(
            success=report.success,
            message=report.message,
            mode=report.mode,
            trainer_received=report.bytes_received,
            trainer_bound=report.lower_bound_bytes,
            engine_replies=replies,
        )
        record["forbidden_calls"] = _forbidden_calls(job["forbidden_log"]) - before
        record["generation"] = _generate(host, job["prompts"])
        if rank == ranks[0]:
            record["checksums"] = checksums(host.engine)
        record["leader"] = rank == ranks[0]
    finally:
        dist.barrier()
        host.shutdown()
    return record
