"""What each trainer rank does in the Megatron-core end-to-end test.

Every rank of a gloo world builds a real megatron-core ``GPTModel`` (local,
non-TE spec, CPU) at TP x PP, loads a tiny HF Qwen2 checkpoint's "trained"
weights into its local parameters from the pieces ``megatron_layout`` gives it
(padded vocab rows zero), checks (PP 1) that its forward gives HF's logits, then
updates a real SGLang CPU engine beside it with
``VerlEngine.update_weights_from_megatron``: no gather of any kind (the
forbidden-call recorder is live), the engine's parameters and generation are
checked by the test.

megatron-core's forward on CPU needs three shims, all about device placement or
RNG, none about the math: RoPE moves ``inv_freq`` to ``torch.cuda.current_device()``
(answered "cpu"), the default causal mask is built on CUDA (an explicit mask is
passed), and attention dropout forks the CUDA RNG tracker (a no-op fork; dropout is 0).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def build_gpt(hf_config, tp: int, pp: int, padded_vocab: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tp, pp)
    c = hf_config
    config = TransformerConfig(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads, kv_channels=c.hidden_size // c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, add_bias_linear=False, add_qkv_bias=True,
        use_cpu_initialization=True, params_dtype=torch.float32, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=padded_vocab,
        max_sequence_length=c.max_position_embeddings, position_embedding_type="rope",
        rotary_base=c.rope_parameters["rope_theta"], share_embeddings_and_output_weights=c.tie_word_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
    )


def load_hf_weights(model, weights, hf_vocab: int) -> None:
    """Write HF tensors into this rank's local parameters through its pieces (padding zero)."""
    from sglang.srt.weight_sync.megatron_layout import describe_model_chunks, rank_params
    from sglang.srt.weight_sync.megatron_update import this_rank

    desc, buffers = describe_model_chunks([model], hf_vocab, this_rank())
    with torch.no_grad():
        for param in rank_params(desc, this_rank()):
            local = buffers[param.buffer]
            local.zero_()
            for piece in param.pieces:
                delta = [o - b for o, b in zip(piece.offsets, piece.box.offsets)]
                local[piece.box.translate(delta).slices()] = weights[piece.tensor][piece.box.slices()].to(local.dtype)


def forward_matches_hf(model, model_dir, weights, tp_rank: int, hf_vocab: int) -> float:
    """Max |mcore logits - HF logits| over this rank's real vocab columns (fp32, PP 1)."""
    from megatron.core import tensor_parallel
    from engine import load_hf_model

    torch.cuda.current_device = lambda: "cpu"  # RoPE's inv_freq placement (see module docstring)
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    ids = torch.tensor([[3, 17, 101, 7, 250, 42]])
    s = ids.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s)
    with torch.no_grad():
        logits = model(ids, torch.arange(s).view(1, -1), attention_mask=mask)  # [b, s, Vpad/T]
        hf = load_hf_model(model_dir, weights).float()
        ref = hf(ids).logits
    per = logits.shape[-1]
    lo, hi = tp_rank * per, min((tp_rank + 1) * per, hf_vocab)
    return float((logits[..., : hi - lo] - ref[..., lo:hi]).abs().max())


def megatron_job(rank: int, world: int, job: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import tiny_models
    from engine import omp_bind
    from sglang.srt.entrypoints.verl_engine import VerlEngine
    from sglang.srt.weight_sync.megatron_update import send_megatron_weights
    from update_cases import _checksums, _forbidden_calls, _generate, _request, new_weights

    tp, pp, engine_tp = job["tp"], job["pp"], job["engine_tp"]
    os.environ["SGLANG_TEST_FORBIDDEN_LOG"] = job["forbidden_log"]
    if engine_tp > 1:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(engine_tp)
    hf_config = tiny_models.tiny_config("qwen2")
    vocab = hf_config.vocab_size
    model = build_gpt(hf_config, tp, pp, job["padded_vocab"])
    weights = new_weights(job["model_dir"], job["seed"])
    load_hf_weights(model, weights, vocab)
    record = {}
    if pp == 1:
        from megatron.core import parallel_state as ps

        record["forward_max_diff"] = forward_matches_hf(model, job["model_dir"], weights,
                                                        ps.get_tensor_model_parallel_rank(), vocab)
    engines = init_device_mesh("cpu", (world // engine_tp, engine_tp, 1), mesh_dim_names=("dp", "infer_tp", "infer_pp"))
    mesh = engines["infer_tp"]
    group, ranks = mesh.get_group(), [int(r) for r in mesh.mesh.tolist()]
    verl = VerlEngine(
        mesh, model_path=str(job["model_dir"]), device="cpu", attention_backend="torch_native",
        skip_tokenizer_init=True, mem_fraction_static=0.05, max_total_tokens=4096, disable_cuda_graph=True,
        random_seed=0, log_level="error",
    )
    try:
        before = _forbidden_calls(job["forbidden_log"])
        chan, update_id = send_megatron_weights([model], vocab, ranks, group)
        record["success"], record["message"] = _request(verl, ranks, group, chan, update_id)
        record["forbidden_calls"] = _forbidden_calls(job["forbidden_log"]) - before
        record["generation"] = _generate(verl, job["prompts"])
        if rank == ranks[0]:
            record["checksums"] = _checksums(verl._engine)
        record["leader"] = rank == ranks[0]
    finally:
        dist.barrier()
        verl.shutdown()
    return record
