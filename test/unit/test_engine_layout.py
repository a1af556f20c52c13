"""The engine's live layout: its targets' digest, made once per layout and live dtypes."""

import tiny_models
import torch

from benchmark.weight_sync.hand_rules import model_targets_from_config
from sglang.srt.weight_sync.derive import DerivedTargets
from sglang.srt.weight_sync.engine_layout import EngineLayout, targets_digest
from sglang.srt.weight_sync.target_layout import EngineParallel

# isort: split
# pr: scale
from sglang.srt.weight_sync.manifest import EngineManifest

# pr: scale end

CONFIG = tiny_models.tiny_config("qwen2")


class _LiveModel:
    """What ``EngineLayout.live`` reads of a model: its named parameters and buffers."""

    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return list(self.params.items())

    def named_buffers(self):
        return []


def _expected_digest(targets) -> str:
    """The digest the engine plans with: its targets' own, or its manifest's fingerprint
    where it makes a manifest (the targets hashed once)."""
    expected = targets_digest(targets, {})
    # pr: scale
    expected = EngineManifest.of(targets).fingerprint
    # pr: scale end
    return expected


def test_engine_digests_its_targets_once_per_layout_and_dtypes():
    """Every update checks the engine's targets against its live tensors; their digest (the
    plan's inputs the TP ranks agree on, the plan caches' key: it hashes every rank's
    targets, ~0.6 s at TP 256) is made again only when the derived targets or a live dtype
    change."""
    rules = model_targets_from_config(CONFIG, EngineParallel(2), torch.float32)
    derived = DerivedTargets(
        rules.parallel,
        tuple(tuple(rules.for_rank(r)) for r in range(2)),
        rules.tensor_shapes(),
        dict(rules.aliases),
    )
    live = {
        t.name: torch.zeros(t.shape, dtype=torch.bfloat16) for t in derived.for_rank(1)
    }
    model = _LiveModel(live)
    layout = EngineLayout(1)  # engine rank 1's, which keeps the digest

    first = layout.live(model, derived)
    targets = first.targets
    assert first.params.keys() == live.keys()
    assert {t.dtype for t in targets.for_rank(1)} == {
        torch.bfloat16
    }  # the live dtype, not the derived one
    assert first.digest == _expected_digest(targets)
    # pr: scale
    manifest = first.manifest  # the manifest the engine makes for the trainer
    assert manifest == EngineManifest.of(targets)
    # pr: scale end
    again = layout.live(model, derived)
    assert again.targets is targets and again.digest == first.digest
    # pr: scale
    assert again.manifest is manifest
    # pr: scale end

    name = next(iter(live))
    live[name] = live[name].float()  # one parameter now fp32
    changed = layout.live(model, derived)
    assert changed.targets.dtype_of[name] == torch.float32
    assert changed.digest != first.digest
    assert changed.digest == _expected_digest(changed.targets)
    # pr: scale
    assert (
        changed.manifest.fingerprint != manifest.fingerprint
        and changed.manifest == EngineManifest.of(changed.targets)
    )
    # pr: scale end
    rederived = DerivedTargets(
        rules.parallel, derived.per_rank, rules.tensor_shapes(), dict(rules.aliases)
    )
    anew = layout.live(model, rederived)
    assert anew.targets is not changed.targets  # another derivation: made anew
    # pr: scale
    assert anew.manifest is not changed.manifest
    # pr: scale end


def test_the_digest_follows_targets_layout_and_blocks():
    """Another dtype, TP size or block-FP8 block gives another digest; the same targets the
    same one."""
    bf16 = model_targets_from_config(CONFIG, EngineParallel(2), torch.bfloat16)
    tp4 = model_targets_from_config(CONFIG, EngineParallel(4), torch.bfloat16)
    fp32 = model_targets_from_config(CONFIG, EngineParallel(2), torch.float32)
    name = "model.layers.0.mlp.down_proj.weight"
    digests = {
        targets_digest(bf16, {}),
        targets_digest(tp4, {}),
        targets_digest(fp32, {}),
        targets_digest(bf16, {name: (128, 128)}),
        targets_digest(bf16, {name: (64, 128)}),
    }
    assert len(digests) == 5
    again = model_targets_from_config(CONFIG, EngineParallel(2), torch.bfloat16)
    assert targets_digest(again, {}) == targets_digest(bf16, {})
