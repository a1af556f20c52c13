"""The provenance check (``weight_sync.derive.provenance_check``) runs SGLang's real loaders on the live
model into scratch tensors and refuses derived targets that place data elsewhere.

A worker process per platform (SGLang's CPU engine, and the default platform's generic
loader branches; ``sglang_fakes``) acts as an engine rank (mostly rank 1 of TP 2), builds the real model of
each tiny architecture the end-to-end tests use (bf16 parameters filled with seeded random
values), derives the rank's targets on meta as the engine does, and runs the check:

* on every architecture the check passes, checking each parameter kind once, and leaves
  every live tensor bitwise as it was (DeepSeek's ``load_weights`` recomputes ``w_kc``/``w_vc``
  from ``kv_b_proj``: those writes must be dropped);
* a planted shape-preserving permutation in a live parameter's ``weight_loader`` (gate and
  up halves of ``gate_up_proj`` swapped; ``down_proj``'s rows reversed), or a loader that
  writes nothing (``embed_tokens``), is refused with a
  message naming the parameter, the checkpoint tensor and the first differing element, and
  the live parameters are unchanged;
* the check runs once per derived-targets object: the same object again runs no loader, a
  new object runs it again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import sglang_fakes  # test/support: on sys.path (test/conftest.py) and, as a worker, on PYTHONPATH

# (case, tiny model, TP, EP, rank, config overrides). A vocabulary of 500 is padded (to 512 at
# TP 2): the loader zeroes the padding rows, zero boxes of the targets. At TP 4 the CPU engine
# pads llama's 8 query heads with 2 KV heads to 16.
CASES = (
    ("qwen2-tp2-ep1", "qwen2", 2, 1, 1, {}),
    ("llama-tp2-ep1", "llama", 2, 1, 1, {}),
    ("llama-kv2-tp4-ep1", "llama", 4, 1, 3, {"num_key_value_heads": 2}),
    ("qwen2-vocab500-tp2-ep1", "qwen2", 2, 1, 1, {"vocab_size": 500}),
    ("qwen3-tp2-ep1", "qwen3", 2, 1, 1, {}),
    ("qwen3_moe-tp2-ep1", "qwen3_moe", 2, 1, 1, {}),
    ("qwen3_moe-tp2-ep2", "qwen3_moe", 2, 2, 1, {}),
    ("deepseek_v3-tp2-ep1", "deepseek_v3", 2, 1, 1, {}),
)
RANK = 1  # of the planted cases (qwen2, deepseek_v3)
MODES = ("cpu", "default")


def _worker(mode: str, workdir: Path) -> dict:
    """Every case on this platform; the facts the tests check."""
    import dataclasses

    import tiny_models
    import torch
    import transformers

    if mode == "default":
        sglang_fakes._provide_vllm_rotary_import()
    from sglang.srt.weight_sync.derive.derived_targets import (
        DerivedTargets,
        build_meta_model,
        checkpoint_layout,
    )
    from sglang.srt.weight_sync.derive.provenance_check import (
        ProvenanceCheck,
        check_provenance,
        representatives,
    )
    from sglang.srt.weight_sync.derive.repeated_layers import (
        derive_once_per_layer_kind,
    )
    from sglang.srt.weight_sync.sglang_compat import original_hf_config
    from sglang.srt.weight_sync.target_layout import EngineParallel

    def live_state(model):
        state = {n: t.detach().clone() for n, t in model.state_dict().items()}
        state.update(
            (f"computed:{n}", t.detach().clone())
            for n, t in sglang_fakes._computed(model).items()
        )
        return state

    def unchanged(model, before) -> list:
        after = live_state(model)
        return sorted(
            n
            for n in set(before) | set(after)
            if n not in before
            or n not in after
            or not torch.equal(
                before[n].view(torch.uint8) if before[n].numel() else before[n],
                after[n].view(torch.uint8) if after[n].numel() else after[n],
            )
        )

    def plant(model, suffix, wrap):
        """Replace the weight_loader of every live parameter named ``*suffix``."""
        planted = 0
        for name, p in model.named_parameters():
            if name.endswith(suffix):
                attr = (
                    "weight_loader" if "weight_loader" in vars(p) else "_weight_loader"
                )
                setattr(p, attr, wrap(getattr(p, attr)))
                planted += 1
        return planted

    facts = {}
    for case, arch, tp, ep, rank, overrides in CASES:
        directory = workdir / case
        # off the CPU engine, SGLang builds yarn rope only on an accelerator: plain rope there
        plain_rope = mode == "default" and arch == "deepseek_v3"
        config = tiny_models.tiny_config(
            arch, **overrides, **({"rope_scaling": None} if plain_rope else {})
        )
        config.architectures = [
            transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__
        ]
        config.save_pretrained(directory)
        with sglang_fakes.fake_engine_rank(tp, rank, ep):
            model_config, _ = sglang_fakes.sglang_model_config(directory, mode, tp)
            # the live model first, as an engine has it before its first update derives
            model = sglang_fakes._build(model_config, model_config.dtype)
            checkpoint = checkpoint_layout(original_hf_config(model_config))
            derived = derive_once_per_layer_kind(
                lambda: build_meta_model(model_config), checkpoint
            )
            targets = DerivedTargets(
                EngineParallel(tp, moe_ep_size=ep),
                tuple(derived.targets if r == rank else () for r in range(tp)),
                checkpoint.shapes(),
                checkpoint.aliases,
            )
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
            before = live_state(model)
            loads = []
            load_weights = model.load_weights

            def counted(weights, *args, **kwargs):
                loads.append(1)
                return load_weights(weights, *args, **kwargs)

            model.load_weights = counted
            check = ProvenanceCheck()
            fact = {
                "dtype": str(next(model.parameters()).dtype),
                "kinds": len(representatives(targets.for_rank(rank))),
                "targets": len(targets.for_rank(rank)),
                "zero_boxes": sum(len(t.zeros) for t in targets.for_rank(rank)),
                "problems": check.problems(model, targets, rank),
                "loads_first": len(loads),
                "problems_again": check.problems(model, targets, rank),
                "loads_again": len(loads),
            }
            fact["problems_new_object"] = check.problems(
                model, dataclasses.replace(targets), rank
            )
            fact["loads_new_object"] = len(loads)
            fact["runs"] = check.runs
            fact["changed"] = unchanged(model, before)
            fact["checked"] = check_provenance(
                model, targets.for_rank(rank), targets.shapes, rank
            )
            if arch in ("qwen2", "deepseek_v3"):

                def swap_gate_up(loader):
                    return lambda param, w, shard_id=None, *a, **k: loader(
                        param, w, 1 - shard_id, *a, **k
                    )

                def reverse_rows(loader):
                    return lambda param, w, *a, **k: loader(param, w.flip(0), *a, **k)

                def write_nothing(loader):
                    return lambda param, w, *a, **k: None

                for plant_id, suffix, wrap in (
                    ("gate_up_swapped", "gate_up_proj.weight", swap_gate_up),
                    ("down_rows_reversed", "down_proj.weight", reverse_rows),
                    ("embedding_skipped", "embed_tokens.weight", write_nothing),
                ):
                    originals = {n: dict(vars(p)) for n, p in model.named_parameters()}
                    planted = plant(model, suffix, wrap)
                    fact[plant_id] = {
                        "planted": planted,
                        "problems": ProvenanceCheck().problems(model, targets, rank),
                        "changed": unchanged(model, before),
                    }
                    for n, p in model.named_parameters():
                        p.__dict__.clear()
                        p.__dict__.update(originals[n])
                fact["after_plants"] = ProvenanceCheck().problems(model, targets, rank)

                def raising(loader):
                    def load(param, w, *a, **k):
                        raise MemoryError("planted: no memory for the check")

                    return load

                originals = {n: dict(vars(p)) for n, p in model.named_parameters()}
                plant(model, "down_proj.weight", raising)
                check = ProvenanceCheck()
                failed = check.problems(model, targets, rank)
                for n, p in model.named_parameters():
                    p.__dict__.clear()
                    p.__dict__.update(originals[n])
                fact["raising"] = {
                    "problems": failed,
                    "retried": check.problems(model, targets, rank),
                    "runs": check.runs,
                    "changed": unchanged(model, before),
                }
        facts[case] = fact
    return facts


@pytest.fixture(scope="module", params=MODES)
def facts(request, tmp_path_factory):
    mode = request.param
    workdir = tmp_path_factory.mktemp(f"provenance-{mode}")
    sglang_fakes.run_worker([__file__, mode, workdir], mode)
    return json.loads((workdir / "facts.json").read_text())


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_sglang_loaders_place_what_the_derived_targets_say(facts, case):
    fact = facts[case]
    if "vocab500" in case:
        assert fact["zero_boxes"] > 0  # the padding is checked too
    assert fact["dtype"] == "torch.bfloat16"
    assert fact["problems"] == []
    # one representative per kind: fewer than the targets (layers repeat), every kind checked
    assert 0 < fact["kinds"] < fact["targets"]
    assert fact["checked"] == fact["kinds"]
    assert fact["changed"] == []  # no live tensor written, none rebound


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_the_check_runs_once_per_targets_object(facts, case):
    fact = facts[case]
    assert fact["loads_first"] == fact["kinds"]  # one load_weights per parameter kind
    assert fact["problems_again"] == [] and fact["loads_again"] == fact["loads_first"]
    assert fact["problems_new_object"] == []
    assert fact["loads_new_object"] == 2 * fact["loads_first"]
    assert fact["runs"] == 2


@pytest.mark.parametrize("case", ["qwen2-tp2-ep1", "deepseek_v3-tp2-ep1"])
@pytest.mark.parametrize(
    "plant, param, tensor, expected, found",
    [
        # rank 1 of TP 2 holds rows 128:256 of gate, then of up; the loader put up's rows first
        (
            "gate_up_swapped",
            "model.layers.0.mlp.gate_up_proj.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.gate_proj.weight[128, 0]",
            "model.layers.0.mlp.up_proj.weight[128, 0]",
        ),
        # down_proj is split by columns (128:256 on rank 1); its first row came from the last
        (
            "down_rows_reversed",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.mlp.down_proj.weight[0, 128]",
            "model.layers.0.mlp.down_proj.weight[127, 128]",
        ),
        # rank 1 holds vocabulary rows 256:512; the loader wrote none of them
        (
            "embedding_skipped",
            "model.embed_tokens.weight",
            "model.embed_tokens.weight",
            "model.embed_tokens.weight[256, 0]",
            "nothing (the element was never written)",
        ),
    ],
)
def test_a_planted_permutation_is_refused_before_any_write(
    facts, case, plant, param, tensor, expected, found
):
    fact = facts[case][plant]
    assert fact["planted"] >= 1
    assert len(fact["problems"]) == 1, fact["problems"]
    message = fact["problems"][0]
    assert message.startswith(
        f"engine rank {RANK}: parameter {param!r} (checkpoint tensor {tensor!r}): "
    )
    # the first differing element: where, what the targets place, what the loader placed
    assert (
        f"at [0, 0] the targets place {expected}, the loader placed {found};" in message
    )
    assert "refused before any write" in message
    assert fact["changed"] == []  # the live parameters are as they were
    assert facts[case]["after_plants"] == []  # the loaders restored, the check passes


@pytest.mark.parametrize("case", ["qwen2-tp2-ep1", "deepseek_v3-tp2-ep1"])
def test_a_check_that_could_not_run_refuses_and_runs_again(facts, case):
    """A loader that raises (memory, say) refuses the update; the outcome is not kept, so the
    next update checks again and passes."""
    fact = facts[case]["raising"]
    assert fact["problems"] == [
        f"engine rank {RANK}: the derived targets could not be checked against SGLang's "
        "loaders: MemoryError: planted: no memory for the check"
    ]
    assert fact["retried"] == [] and fact["runs"] == 2
    assert fact["changed"] == []


if __name__ == "__main__":
    out = Path(sys.argv[2])
    (out / "facts.json").write_text(json.dumps(_worker(sys.argv[1], out)))
