"""Any model SGLang can load: real CPU engines updated from trainer shards through targets
derived from SGLang's own loaders (``weight_sync.derived_targets``).

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

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models
import torch
from engine import hf_greedy
from test_distributed_update import run
from update_cases import MAX_NEW, new_weights

STEPS = [("verl", "fsdp", 1), ("utils", "tp", 2)]


def sglang_load_checksums(model_dir, weights, tp: int, workdir: Path, ep: int = 1):
    """Per-rank checksums of SGLang's own load of ``weights`` on its CPU engine (faked ranks)."""
    import sglang_fakes

    tiny_models.write_modified_checkpoint(model_dir, workdir / "new", weights)
    job = {
        "mode": "cpu",
        "workdir": str(workdir),
        "checksums": True,
        "configs": {"new": None},
        "cases": [[f"r{r}", "new", tp, r, ep] for r in range(tp)],
    }
    (workdir / "job.json").write_text(json.dumps(job))
    proc = subprocess.run(
        [
            sys.executable,
            sglang_fakes.__file__,
            str(workdir / "job.json"),
            str(workdir / "out.pt"),
        ],
        env=sglang_fakes.worker_env("cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = torch.load(workdir / "out.pt", weights_only=False)["results"]
    for r in range(tp):
        assert "error" not in results[f"r{r}"], results[f"r{r}"]["error"]
    return {r: results[f"r{r}"]["checksums"] for r in range(tp)}


def check_models_update(kind: str, tmp_path, generate: bool = True, **engine_kwargs):
    model_dir, _, prompts, (records,) = run(
        kind, 2, 2, STEPS, tmp_path, generate=generate, **engine_kwargs
    )
    for record in records[1:]:
        assert record.get("success", True), record.get("message")
        seed = record["step"][2]
        weights = new_weights(model_dir, seed)
        expected = sglang_load_checksums(
            model_dir,
            weights,
            2,
            tmp_path / f"load-{seed}",
            engine_kwargs.get("ep_size", 1),
        )
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
            reference = hf_greedy(model_dir, prompts[seed], MAX_NEW, weights=weights)
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
