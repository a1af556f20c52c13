"""The engine's published layout: round trip, integrity, version, and the trainer-side view."""

import json

import pytest
import torch

from benchmark.weight_sync.hand_rules import model_targets_from_config  # noqa: E402
from sglang.srt.weight_sync.manifest import (  # noqa: E402
    EngineManifest,
    ManifestError,
    read_manifest,
    targets_by_trainer_rank,
    write_manifest,
)
from sglang.srt.weight_sync.target_layout import EngineParallel  # noqa: E402

CONFIG = dict(
    model_type="qwen2",
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=96,
    vocab_size=1000,
    tie_word_embeddings=True,
)


def _manifest(tp=2):
    targets = model_targets_from_config(CONFIG, EngineParallel(tp), torch.bfloat16)
    return targets, EngineManifest.of(targets)


def test_round_trip_keeps_every_target_and_fingerprint(tmp_path):
    targets, manifest = _manifest()
    write_manifest(str(tmp_path), 1, manifest)
    back = read_manifest(str(tmp_path), 1)
    assert back == manifest
    assert [list(r) for r in back.ranks] == [targets.for_rank(r) for r in range(2)]
    assert back.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert not list(tmp_path.glob("*.tmp*")), (
        "the temporary file of the atomic write is left behind"
    )


def test_fingerprint_follows_layout_and_dtype():
    _, bf16 = _manifest()
    _, tp4 = _manifest(4)
    fp32 = EngineManifest.of(
        model_targets_from_config(CONFIG, EngineParallel(2), torch.float32)
    )
    assert len({bf16.fingerprint, tp4.fingerprint, fp32.fingerprint}) == 3
    assert _manifest()[1].fingerprint == bf16.fingerprint


def test_tampered_partial_or_other_version_is_refused(tmp_path):
    _, manifest = _manifest()
    path = write_manifest(str(tmp_path), 0, manifest)
    data = json.loads(open(path).read())
    data["ranks"][0][0]["shape"][0] += 1
    open(path, "w").write(json.dumps(data))
    with pytest.raises(ManifestError, match="does not match its fingerprint"):
        read_manifest(str(tmp_path), 0)
    data["version"] = 99
    open(path, "w").write(json.dumps(data))
    with pytest.raises(ManifestError, match="version 99"):
        read_manifest(str(tmp_path), 0)
    with pytest.raises(ManifestError, match="engine rank 3 published no manifest"):
        read_manifest(str(tmp_path), 3)


def test_trainer_ranks_get_the_targets_of_the_engine_rank_beside_them():
    _, manifest = _manifest()
    by_rank = targets_by_trainer_rank(manifest, [(0, 1), (2, 3)])
    assert by_rank[0] == by_rank[2] == list(manifest.ranks[0])
    assert by_rank[1] == by_rank[3] == list(manifest.ranks[1])
    with pytest.raises(ManifestError, match="engine group of 3"):
        targets_by_trainer_rank(manifest, [(0, 1, 2)])


def test_block_fp8_weights_travel_with_their_block_and_are_bounded(tmp_path):
    """Version 2: the engine's block-FP8 weights and their block, so that a sender can
    quantize the blocks it holds whole; a manifest without any keeps version 1's content."""
    from sglang.srt.weight_sync.fp8_wire import quantized_of

    targets, plain = _manifest()
    assert "block_fp8" not in plain.to_json()
    name = "model.layers.0.mlp.down_proj.weight"
    fp8 = EngineManifest.of(targets, {name: (128, 128)})
    assert fp8.fingerprint != plain.fingerprint
    write_manifest(str(tmp_path), 0, fp8)
    back = read_manifest(str(tmp_path), 0)
    assert back.block_fp8 == {name: (128, 128)} and back.fingerprint == fp8.fingerprint
    (q,) = quantized_of(back, 1)
    (t,) = [t for t in targets.for_rank(1) if t.name == name]
    assert (q.weight, q.scale, q.shape, q.block, q.staged_dtype) == (
        name,
        name + "_scale_inv",
        t.shape,
        (128, 128),
        t.dtype,
    )
    bad = EngineManifest.of(targets, {name: (0, 128)})
    with pytest.raises(ManifestError, match="block_fp8 'model.layers.0.mlp.down_proj"):
        EngineManifest.from_json(bad.to_json())
