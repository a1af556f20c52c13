"""Any model SGLang can load: real CPU engines updated from trainer shards through targets
derived from SGLang's own loaders (``weight_sync.derive.derived_targets``).

Each model runs a TP-2 engine beside two trainer ranks (gathers forbidden) and takes an
FSDP2 and a Megatron-style update. After each, every engine rank's parameters must equal,
bit for bit, SGLang's own load of the new weights (the model loaded by SGLang's loaders as
that rank, in one process, from a checkpoint holding the new weights), and greedy
generation must equal HF transformers' with the new weights: that also proves tensors
SGLang computes from parameters (Gemma's norm weight + 1) were refreshed. DeepSeek-V3-shaped
and gpt-oss models are checked on their parameters only: SGLang's CPU engine loads them but
cannot run them (see each test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
from engine import hf_greedy
from update_cases import MAX_NEW, new_weights
from update_checks import run

STEPS = [("verl", "fsdp", 1), ("utils", "tp", 2)]


def sglang_load_checksums(model_dir, weights_by_seed, tp: int, workdir: Path, ep=1):
    """Per-seed, per-rank checksums of SGLang's own load of each seed's weights on its CPU
    engine (faked ranks), all in one worker process."""
    import sglang_fakes

    workdir.mkdir(parents=True, exist_ok=True)
    for seed, weights in weights_by_seed.items():
        tiny_models.write_modified_checkpoint(model_dir, workdir / f"s{seed}", weights)
    job = {
        "mode": "cpu",
        "workdir": str(workdir),
        "checksums": True,
        "configs": {f"s{seed}": None for seed in weights_by_seed},
        "cases": [
            [f"s{seed}r{r}", f"s{seed}", tp, r, ep]
            for seed in weights_by_seed
            for r in range(tp)
        ],
    }
    results = sglang_fakes.run_job_in_worker(job, workdir, "load", timeout=600)[
        "results"
    ]
    out = {}
    for seed in weights_by_seed:
        for r in range(tp):
            case = results[f"s{seed}r{r}"]
            assert "error" not in case, case["error"]
            out.setdefault(seed, {})[r] = case["checksums"]
    return out


def check_models_update(kind: str, tmp_path, generate: bool = True, **engine_kwargs):
    model_dir, _, prompts, (records,) = run(
        kind, 2, 2, STEPS, tmp_path, generate=generate, **engine_kwargs
    )
    weights = {r["step"][2]: new_weights(model_dir, r["step"][2]) for r in records[1:]}
    expected_by_seed = sglang_load_checksums(
        model_dir, weights, 2, tmp_path / "load", engine_kwargs.get("ep_size", 1)
    )
    for record in records[1:]:
        assert record.get("success", True), record.get("message")
        seed = record["step"][2]
        expected = expected_by_seed[seed]
        for r in range(2):
            wrong = sorted(
                n
                for n in expected[r]
                if record["checksums"][r].get(n) != expected[r][n]
            )
            assert not wrong, (
                f"{kind} {record['step']}: rank {r} differs from SGLang's own load: {wrong[:5]}"
            )
        if generate:
            reference = hf_greedy(
                model_dir, prompts[seed], MAX_NEW, weights=weights[seed]
            )
            assert record["generation"] == reference, (
                f"{kind} {record['step']}: generation differs from HF"
            )


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "phi3"])
def test_derived_targets_update_new_architectures(kind, tmp_path):
    check_models_update(kind, tmp_path)


def test_deepseek_v3_shaped_update_parameters(tmp_path):
    """MLA + MoE + shared expert, parameters only: SGLang's CPU engine (torch_native) cannot
    run DeepSeek's MHA prefill (it reads the latent KV cache as keys and values), so no
    generation. The MLA w_kc/w_vc refresh is proved by test_derived_targets.py."""
    check_models_update("deepseek_v3", tmp_path, generate=False)


def test_gpt_oss_update_parameters(tmp_path):
    """gpt-oss, parameters only: its experts arrive as the checkpoint's fused [E, H, 2I]
    gate_up and [E, I, H] down and land transposed (permuted pieces). SGLang's CPU engine
    loads gpt-oss when asked for its CPU attention backend (``intel_amx``, which falls back to
    torch_native on a machine without AMX, as here) but cannot run it (torch_native has no
    attention sinks), so no generation: every rank's parameters must equal SGLang's own load."""
    check_models_update(
        "gpt_oss", tmp_path, generate=False, attention_backend="intel_amx"
    )


def test_cpu_padded_heads_update(tmp_path):
    """One kv head at TP 2: SGLang's CPU engine pads the heads (zero heads past the HF ones);
    the derived targets describe that layout, so the update writes it as SGLang's loader does."""
    check_models_update("llama_kv1", tmp_path)


def test_qwen3_30b_a3b_tensor_count_update_parameters(tmp_path):
    """Qwen3-30B-A3B's tensor count (48 layers of 128 experts: 18,432 expert tensors, at
    metadata-like sizes) through a TP-2 engine, verl's and ``utils.update_weights``' entry
    points: each trainer rank's payload header is above the old fixed 1 MiB bound, which
    refused it after the whole timeout. Parameters only: HF's reference generation loops
    over every expert of 48 layers per token."""
    check_models_update("qwen3_30b_a3b_count", tmp_path, generate=False)
