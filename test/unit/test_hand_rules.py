"""The simulator's hand rules (``benchmark.weight_sync.hand_rules``) agree with SGLang 0.5.23's weight loaders.

For each tiny model (Llama tied + attention bias, Qwen2 GQA + qkv bias, Qwen3 tied with
q/k norm and explicit head_dim, Qwen3-MoE with 8 experts), each engine TP size T, each
MoE EP size and each rank r, a worker builds the real SGLang model class as rank r of T
(``sglang_fakes.py``), fills every parameter with a sentinel, runs the model's own
``load_weights`` on the full HF checkpoint tensors (every element index-encoded, so any
misplaced element is caught and named) and returns the parameters. Each one must equal,
bit for bit, ``reference_param`` of the matching ``ParamTarget``, and the parameter names
must be exactly the target names.

Two platforms, each in its own worker process (SGLang reads the platform at import):
* default (the CUDA code paths of the loaders, triton MoE layout), the layout the rules
  describe;
* SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``), with the config adjusted exactly as
  its ModelRunner does on CPU. Where that adjustment pads the model (heads not divisible
  by T, intermediate sizes not multiples of 32*T) the CPU layout differs from the rules;
  those cases pin the padding (see CPU_UNALIGNED_CASES) so engines refuse such configs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Tuple

import pytest
import sglang_fakes  # noqa: E402
import torch
import transformers

from benchmark.weight_sync.hand_rules import (  # noqa: E402
    model_targets_from_config,
    reference_param,
)
from sglang.srt.weight_sync.target_layout import EngineParallel  # noqa: E402

DTYPE = torch.float32
DETAILED_PROBLEMS = 4  # parameters per failing case whose full layout is spelled out

# ----------------------------------------------------------------------------------------------
# Tiny configs (HF kwargs). 8 q heads / 2 kv heads: T=4 and T=8 replicate kv heads.

_COMMON = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2
)
CONFIGS: Dict[str, dict] = {
    # vocab 500 -> padded 512: zero rows on the last rank(s) and at T=1.
    "llama": dict(
        model_type="llama",
        vocab_size=500,
        intermediate_size=128,
        tie_word_embeddings=True,
        attention_bias=True,
        **_COMMON,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=1000,
        intermediate_size=128,
        tie_word_embeddings=False,
        **_COMMON,
    ),
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=500,
        intermediate_size=128,
        head_dim=16,
        tie_word_embeddings=True,
        **_COMMON,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        vocab_size=500,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        tie_word_embeddings=False,
        **_COMMON,
    ),
    # T in {3, 6}: SGLang pads the vocab to a multiple of 64*T (1000 -> 1152), kv heads 3 replicated at T=6.
    "qwen2_t36": dict(
        model_type="qwen2",
        vocab_size=1000,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
        tie_word_embeddings=False,
    ),
    # Qwen3-MoE with a dense first layer (HF honours mlp_only_layers).
    "qwen3_moe_dense0": dict(
        model_type="qwen3_moe",
        vocab_size=500,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        tie_word_embeddings=False,
        mlp_only_layers=[0],
        **_COMMON,
    ),
}
# The same four families sized so that SGLang's CPU engine leaves them unpadded for T <= 8:
# heads divisible by 8, intermediate sizes multiples of 32*8.
_CPU_COMMON = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8
)
CPU_CONFIGS: Dict[str, dict] = {
    "llama_cpu": dict(
        model_type="llama",
        vocab_size=500,
        intermediate_size=256,
        tie_word_embeddings=True,
        attention_bias=True,
        **_CPU_COMMON,
    ),
    "qwen2_cpu": dict(
        model_type="qwen2",
        vocab_size=1000,
        intermediate_size=256,
        tie_word_embeddings=False,
        **_CPU_COMMON,
    ),
    "qwen3_cpu": dict(
        model_type="qwen3",
        vocab_size=500,
        intermediate_size=256,
        head_dim=16,
        tie_word_embeddings=True,
        **_CPU_COMMON,
    ),
    "qwen3_moe_cpu": dict(
        model_type="qwen3_moe",
        vocab_size=500,
        intermediate_size=256,
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        tie_word_embeddings=False,
        **_CPU_COMMON,
    ),
    # dense intermediate 80: not a multiple of 32, so the CPU engine pads it even at T=1.
    "llama_f80": dict(
        model_type="llama",
        vocab_size=500,
        intermediate_size=80,
        tie_word_embeddings=True,
        **_COMMON,
    ),
}

Case = Tuple[str, str, int, int, int]  # (id, config, T, rank, moe_ep)


def _matrix(cfg: str, tps=(1, 2, 4, 8)) -> List[Case]:
    eps = (
        (1, 2, 4)
        if CONFIGS.get(cfg, CPU_CONFIGS.get(cfg))["model_type"] == "qwen3_moe"
        else (1,)
    )
    return [
        (f"{cfg}-tp{t}-ep{ep}-r{r}", cfg, t, r, ep)
        for t in tps
        for ep in eps
        if t % ep == 0
        for r in range(t)
    ]


DEFAULT_CASES: List[Case] = [
    c for cfg in ("llama", "qwen2", "qwen3", "qwen3_moe") for c in _matrix(cfg)
]
DEFAULT_CASES += _matrix("qwen2_t36", tps=(3, 6))
# Known discrepancy: SGLang 0.5.23 makes every Qwen3-MoE layer sparse (see _hints).
DENSE0_CASES: List[Case] = [
    c for c in _matrix("qwen3_moe_dense0", tps=(1, 2)) if c[4] == 1
]

CPU_CASES: List[Case] = [
    c
    for cfg in ("llama_cpu", "qwen2_cpu", "qwen3_cpu", "qwen3_moe_cpu")
    for c in _matrix(cfg)
]
# Known discrepancy: configs the CPU engine pads (one per kind of padding).
CPU_UNALIGNED_CASES: List[Case] = [
    (
        "cpu-unaligned-kv-heads-qwen2-tp4-r3",
        "qwen2",
        4,
        3,
        1,
    ),  # 8/2 heads -> 16/4, no kv replication
    (
        "cpu-unaligned-intermediate-llama_f80-tp1-r0",
        "llama_f80",
        1,
        0,
        1,
    ),  # F 80 -> 96 even at T=1
    ("cpu-unaligned-moe-qwen3_moe-tp2-ep1-r1", "qwen3_moe", 2, 1, 1),  # Im 32 -> 64
    (
        "cpu-unaligned-moe-qwen3_moe-tp2-ep2-r1",
        "qwen3_moe",
        2,
        1,
        2,
    ),  # Im 32 -> 64 although moe_tp = 1
]


def _job(mode: str, cases: List[Case], workdir) -> dict:
    specs = {**CONFIGS, **CPU_CONFIGS}
    used = sorted({c[1] for c in cases})
    return {
        "mode": mode,
        "workdir": str(workdir),
        "configs": {k: specs[k] for k in used},
        "cases": [list(c) for c in cases],
    }


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """SGLang's loaded parameters for every case, from one worker process per platform (run in parallel)."""
    base = tmp_path_factory.mktemp("sglang_oracle")
    jobs = {
        "default": _job("default", DEFAULT_CASES + DENSE0_CASES, base / "default"),
        "cpu": _job("cpu", CPU_CASES + CPU_UNALIGNED_CASES, base / "cpu"),
    }

    def run(mode):
        return sglang_fakes.run_job_in_worker(jobs[mode], base, mode)

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(jobs, pool.map(run, jobs)))
    assert results["default"]["platform"] == {"is_cpu": False, "is_cuda": False}
    assert results["cpu"]["platform"]["is_cpu"] is True
    return results


# ----------------------------------------------------------------------------------------------
# Comparison


_HF_CONFIGS: Dict[str, object] = {}


def hf_config(saved: dict):
    """The checkpoint's config as transformers loads it (what SGLang's ModelConfig.hf_config is)."""
    if saved["dir"] not in _HF_CONFIGS:
        _HF_CONFIGS[saved["dir"]] = transformers.AutoConfig.from_pretrained(
            saved["dir"]
        )
    return _HF_CONFIGS[saved["dir"]]


def _hints(cfg_json: dict, config_changes: dict) -> List[str]:
    hints = []
    if config_changes:
        changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in config_changes.items())
        hints.append(
            "SGLang's CPU engine pads this model: ModelRunner (device='cpu') runs "
            f"adjust_config_with_unaligned_cpu_tp(tp_size=T), which changed {changed}. Heads are padded to a "
            "multiple of T (no kv-head replication; extra heads are zero), intermediate sizes to a multiple of "
            "32*T (the per-rank slice of rank r starts at r*padded/T; rows past the HF size are zero). "
            "The rules describe the unpadded HF layout."
        )
    if cfg_json.get("model_type") == "qwen3_moe" and (
        cfg_json.get("mlp_only_layers")
        or (cfg_json.get("decoder_sparse_step") or 1) != 1
    ):
        hints.append(
            "SGLang 0.5.23 Qwen3MoeDecoderLayer.stage_facts makes every layer sparse and ignores "
            f"mlp_only_layers={cfg_json.get('mlp_only_layers')} / decoder_sparse_step="
            f"{cfg_json.get('decoder_sparse_step')}; the rules make those layers dense (gate_up_proj/down_proj). "
            "SGLang then skips the checkpoint's dense mlp tensors silently and leaves those experts unloaded."
        )
    return hints


def _tiling_problems(target) -> List[str]:
    """Pieces and zero boxes must tile the parameter exactly (reference_param zero-fills the rest silently)."""
    boxes = [p.dest_box() for p in target.pieces] + list(target.zeros)
    covered = torch.zeros(target.shape, dtype=torch.int32)
    for piece in target.pieces:
        covered[piece.index][piece.dest_box().slices()] += 1
    for box in target.zeros:
        covered[box.slices()] += 1
    if not bool((covered == 1).all()):
        return [
            f"{target.name}: pieces + zeros cover {int((covered > 0).sum())} of {covered.numel()} elements "
            f"with max multiplicity {int(covered.max())} ({len(boxes)} boxes)"
        ]
    return []


def _value_problems(
    name: str, actual: torch.Tensor, expected: torch.Tensor, full, detail: bool = True
) -> List[str]:
    same_kind = (
        tuple(actual.shape) == tuple(expected.shape) and actual.dtype == expected.dtype
    )
    if same_kind and torch.equal(actual, expected):
        return []
    if not detail:
        return [
            f"{name}: differs too (SGLang shape {tuple(actual.shape)}, target shape {tuple(expected.shape)})"
        ]
    sglang_layout = (
        f"    SGLang's layout: {sglang_fakes.describe_layout(actual, full, 12)}"
    )
    if tuple(actual.shape) != tuple(expected.shape):
        return [
            f"{name}: SGLang shape {tuple(actual.shape)} != target shape {tuple(expected.shape)}\n{sglang_layout}"
        ]
    if actual.dtype != expected.dtype:
        return [f"{name}: SGLang dtype {actual.dtype} != target dtype {expected.dtype}"]
    diff = (actual != expected).nonzero()
    lines = [
        f"{name} {tuple(actual.shape)}: {len(diff)} of {actual.numel()} elements differ, e.g."
    ]
    for idx in diff[:4].tolist():
        i = tuple(idx)
        lines.append(
            f"    [{', '.join(map(str, i))}]: SGLang holds "
            f"{sglang_fakes.describe_value(actual[i].item(), full)}, target says "
            f"{sglang_fakes.describe_value(expected[i].item(), full)}"
        )
    lines += [
        sglang_layout,
        f"    target layout:   {sglang_fakes.describe_layout(expected, full, 12)}",
    ]
    return ["\n".join(lines)]


def check_case(result_set: dict, case: Case) -> None:
    case_id, cfg, tp, rank, ep = case
    result = result_set["results"][case_id]
    if "error" in result:
        pytest.fail(f"SGLang could not build/load {case_id}:\n{result['error']}")
    checkpoint = result_set["checkpoints"][cfg]
    cfg_json = checkpoint["config"]
    full = sglang_fakes.index_encoded(checkpoint["tensors"])
    targets = {
        t.name: t
        for t in model_targets_from_config(
            hf_config(checkpoint), EngineParallel(tp, moe_ep_size=ep), DTYPE
        ).for_rank(rank)
    }
    params: Dict[str, torch.Tensor] = result["params"]

    problems = []
    if set(params) != set(targets):
        problems.append(
            f"parameter names differ: only in SGLang {sorted(set(params) - set(targets))}, "
            f"only in targets {sorted(set(targets) - set(params))}"
        )
    for name in sorted(set(params) & set(targets)):
        target = targets[name]
        problems += _tiling_problems(target)
        problems += _value_problems(
            name,
            params[name],
            reference_param(target, full),
            full,
            detail=len(problems) < DETAILED_PROBLEMS,
        )
    if problems:
        header = f"{case_id}: targets disagree with SGLang's loaders (T={tp}, rank={rank}, moe_ep={ep})"
        pytest.fail(
            "\n".join([header] + _hints(cfg_json, result["config_changes"]) + problems),
            pytrace=False,
        )


def _ids(cases):
    return [c[0] for c in cases]


# ----------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("cfg", sorted(set(c[1] for c in DEFAULT_CASES)))
def test_rules_name_the_checkpoint_tensors(oracle, cfg):
    """The HF tensors the rules read are exactly the tensors ``save_pretrained`` writes."""
    saved = oracle["default"]["checkpoints"][cfg]
    checkpoint = dict((n, tuple(s)) for n, s in saved["tensors"])
    targets = model_targets_from_config(hf_config(saved), EngineParallel(1), DTYPE)
    assert targets.tensor_shapes() == checkpoint
    tied = CONFIGS[cfg].get("tie_word_embeddings", False)
    assert ("lm_head.weight" in checkpoint) == (not tied)
    assert dict(targets.aliases) == (
        {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
    )


@pytest.mark.parametrize("cfg", sorted(set(c[1] for c in DEFAULT_CASES)))
def test_config_json_dict_gives_the_same_targets(oracle, cfg):
    """model_targets_from_config accepts a Mapping: config.json as written by save_pretrained
    (transformers 5.19) must give the same rules as the loaded config object."""
    saved = oracle["default"]["checkpoints"][cfg]
    from_dict = model_targets_from_config(saved["config"], EngineParallel(8), DTYPE)
    from_object = model_targets_from_config(hf_config(saved), EngineParallel(8), DTYPE)
    if from_dict.rules != from_object.rules:
        only_dict = sorted(
            {r.param for r in from_dict.rules} - {r.param for r in from_object.rules}
        )
        only_obj = sorted(
            {r.param for r in from_object.rules} - {r.param for r in from_dict.rules}
        )
        keys = {
            k: saved["config"].get(k, "<absent>")
            for k in ("num_experts", "num_local_experts")
        }
        pytest.fail(
            f"{cfg}: rules from config.json differ from rules from the config object: params only from "
            f"the dict {only_dict[:6]}..., only from the object {only_obj[:6]}...; config.json has {keys} "
            "(transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the object maps "
            "num_experts to it, a plain dict does not)",
            pytrace=False,
        )


def test_sentinel_and_encoding_catch_misplacement(oracle):
    """The harness can fail: a one-row shift of a rank's q block is reported with the HF element it holds."""
    case = next(c for c in DEFAULT_CASES if c[0] == "qwen2-tp4-ep1-r1")
    result_set = oracle["default"]
    saved = result_set["checkpoints"]["qwen2"]
    full = sglang_fakes.index_encoded(saved["tensors"])
    target = next(
        t
        for t in model_targets_from_config(
            hf_config(saved), EngineParallel(4), DTYPE
        ).for_rank(1)
        if t.name == "model.layers.0.self_attn.qkv_proj.weight"
    )
    actual = result_set["results"][case[0]]["params"][target.name]
    assert torch.equal(actual, reference_param(target, full))
    shifted = actual.roll(1, dims=0)
    problems = _value_problems(
        target.name, shifted, reference_param(target, full), full
    )
    assert problems and "model.layers.0.self_attn.q_proj.weight[" in problems[0]
    assert (
        sglang_fakes.describe_value(sglang_fakes.SENTINEL, full)
        == "never written by SGLang"
    )


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=_ids(DEFAULT_CASES))
def test_default_layout_matches_sglang_loaders(oracle, case):
    check_case(oracle["default"], case)


@pytest.mark.parametrize("case", DENSE0_CASES, ids=_ids(DENSE0_CASES))
def test_qwen3_moe_mlp_only_layers_are_refused(oracle, case):
    """HF Qwen3-MoE honours mlp_only_layers but SGLang 0.5.23 builds every layer sparse and never
    loads the dense layer's weights, so no update can be right: the rules refuse such configs."""
    case_id, cfg, tp, rank, ep = case
    params = oracle["default"]["results"][case_id]["params"]
    assert (
        "model.layers.0.mlp.experts.w13_weight" in params
    )  # SGLang's layer 0 is sparse
    assert "model.layers.0.mlp.gate_up_proj.weight" not in params
    saved = oracle["default"]["checkpoints"][cfg]
    with pytest.raises(ValueError, match="mlp_only_layers or decoder_sparse_step"):
        model_targets_from_config(
            hf_config(saved), EngineParallel(tp, moe_ep_size=ep), DTYPE
        )


@pytest.mark.parametrize("case", CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_engine_layout_matches_sglang_loaders(oracle, case):
    """Same check under SGLANG_USE_CPU_ENGINE=1 (CPU loader branches, padded MoE loading) for configs the
    CPU engine does not pad; the config adjustment itself must be a no-op."""
    assert oracle["cpu"]["results"][case[0]].get("config_changes", {}) == {}
    check_case(oracle["cpu"], case)


@pytest.mark.parametrize("case", CPU_UNALIGNED_CASES, ids=_ids(CPU_UNALIGNED_CASES))
def test_cpu_engine_pads_unaligned_configs(oracle, case):
    """SGLang's CPU engine pads models whose heads or intermediate sizes do not divide T
    (adjust_config_with_unaligned_cpu_tp): a layout the rules do not describe. The fact is
    pinned here so that code building targets from a live engine refuses padded configs
    (it sees ``original_*`` attributes) rather than writing the HF layout into them."""
    result = oracle["cpu"]["results"][case[0]]
    assert result["config_changes"], (
        f"{case[0]}: SGLang's CPU engine no longer pads this config"
    )
    targets = {
        t.name: t
        for t in model_targets_from_config(
            hf_config(oracle["cpu"]["checkpoints"][case[1]]),
            EngineParallel(case[2], moe_ep_size=case[4]),
            DTYPE,
        ).for_rank(case[3])
    }
    assert any(
        tuple(p.shape) != targets[n].shape
        for n, p in result["params"].items()
        if n in targets
    )
