"""Deriving DeepSeek-V3-671B's targets from SGLang's own loaders, metadata only.

``python -m benchmark.weight_sync.derive_dsv3 [--tp 8] [--ep 1] [--json]`` publishes an
engine layout (TP, MoE EP) the way SGLang's test helpers do, then calls the engine's
own entry point, ``target_cache.engine_derived_targets``, three times:

* ``first``: empty disk cache: checkpoint names/shapes from the HF model on meta, then
  every TP rank's model built on meta and loaded by SGLang's loaders under the recorder;
* ``restart``: a new process would find the disk entry (memory cache dropped);
* ``cached``: what every later update pays (memory cache, then the live-shape check is
  the caller's).

Reported: seconds, peak RSS of the process, targets and pieces. The full config is used
except its yarn rope scaling (SGLang's yarn rotary asks for an accelerator at
construction; rotary embeddings hold no checkpoint weights). Runs on SGLang's default
platform (the loaders' CUDA branches) with the test helpers' ``vllm._custom_ops`` stand-in.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

FULL = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid", n_group=8, topk_group=4,
    moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False, torch_dtype="bfloat16",
)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "unit"))
    import sglang_fakes  # the vllm._custom_ops stand-in for the default platform on a CPU-only machine

    sglang_fakes._provide_vllm_rotary_import()
    import transformers

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_context
    from sglang.srt.weight_sync import target_cache

    work = Path(tempfile.mkdtemp(prefix="derive_dsv3-"))
    kwargs = dict(FULL)
    transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs).save_pretrained(work / "model")
    os.environ[target_cache.CACHE_DIR_ENV] = str(work / "cache")

    installed = get_context().override_server_args(tp_size=args.tp, ep_size=args.ep)
    installed.install()
    rows = []
    try:
        model_config = ModelConfig(model_path=str(work / "model"))
        for phase in ("first", "restart", "cached"):
            if phase == "restart":
                target_cache._memory.clear()
            start = time.perf_counter()
            targets = target_cache.engine_derived_targets(model_config)
            seconds = time.perf_counter() - start
            rows.append(dict(phase=phase, tp=args.tp, ep=args.ep, seconds=round(seconds, 4),
                             peak_rss_gib=round(peak_rss_gib(), 2), targets=sum(map(len, targets.per_rank)),
                             pieces=sum(len(t.pieces) for ts in targets.per_rank for t in ts),
                             post_load=len(targets.post_load), not_copied=len(targets.not_copied)))
    finally:
        installed.restore()

    print(f"DeepSeek-V3-671B, TP {args.tp}, MoE EP {args.ep}: every rank's targets from SGLang's loaders on meta")
    print("| phase | s | peak RSS GiB | targets (all ranks) | pieces | post-load tensors | not copies |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['phase']} | {r['seconds']} | {r['peak_rss_gib']} | {r['targets']} | {r['pieces']} | "
              f"{r['post_load']} | {r['not_copied']} |")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
