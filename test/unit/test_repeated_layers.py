"""Repeated layers loaded once (``derive.repeated_layers``): what the engine derives equals loading every layer.

A toy model's ``load_weights`` does what SGLang's do to a layer, as TP rank 1 of 2: two
checkpoint tensors stacked into one parameter, each narrowed to the rank's half (the
second one landing transposed), a norm copied, and a tensor computed from a parameter
after loading and recomputed in place after an update (MLA's ``w_kc``). The engine's
derivation (``derive_once_per_layer_kind``) must load only the first and last layer of a
kind and give exactly ``derive_rank`` of the whole checkpoint; where a loader treats a
layer of the kind differently, or refuses a checkpoint without the other layers, or the
engine's layers differ, it must notice and derive every layer, with the same result.
(The same equality on SGLang's own models, 17 architectures: ``test_derived_targets.py``.)
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.weight_sync.derive.derived_targets import (
    CheckpointLayout,
    RankTargets,
    derive_rank,
)
from sglang.srt.weight_sync.derive.repeated_layers import (
    LayerKind,
    LayersDiffer,
    derive_once_per_layer_kind,
    derive_sampled,
    layer_of,
    sample_layers,
)

H, N = 4, 5  # hidden size, layers


def _param(*shape) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


class Layer(torch.nn.Module):
    def __init__(self, extra: bool = False):
        super().__init__()
        self.ab = _param(2 * H // 2, H)  # a's and b's halves of rank 1, stacked
        self.norm = _param(H)
        if extra:
            self.extra = _param(H)


class Toy(torch.nn.Module):
    """``ckpt``: the checkpoint's layer prefix. ``odd``: a layer the loader narrows as rank 0.
    ``strict``: the loader refuses a checkpoint without every layer. ``extra``: a layer with
    one more (unloaded) parameter. ``cross``: each layer's norm is read from the next layer's."""

    def __init__(
        self, ckpt="model.layers", odd=None, strict=False, extra=None, cross=False
    ):
        super().__init__()
        self.ckpt, self.odd, self.strict, self.cross = ckpt, odd, strict, cross
        self.embed = _param(10, H)
        self.layers = torch.nn.ModuleList(Layer(extra=i == extra) for i in range(N))
        self.seen = set()

    def load_weights(self, weights):
        for name, w in weights:
            if name == "embed.weight":
                self.embed.copy_(w)
                continue
            i, rest = name[len(self.ckpt) + 1 :].split(".", 1)
            i = int(i)
            self.seen.add(i)
            half = 0 if i == self.odd else 1
            if rest == "a.weight":
                self.layers[i].ab[: H // 2].copy_(w.narrow(0, half * H // 2, H // 2))
            elif rest == "b.weight":  # stored [H, H] transposed
                self.layers[i].ab[H // 2 :].copy_(
                    w.narrow(1, half * H // 2, H // 2).t()
                )
            elif rest == "norm.weight":
                j = i - 1 if self.cross else i
                if j >= 0:
                    self.layers[j].norm.copy_(w)
        if self.strict and self.seen != set(range(N)):
            raise KeyError(
                f"layers {sorted(set(range(N)) - self.seen)} missing from the checkpoint"
            )
        self.post_load_weights()

    def post_load_weights(self):
        for layer in self.layers:
            kc = layer.ab[: H // 2] * 2
            if hasattr(layer, "w_kc"):
                layer.w_kc.copy_(kc)
            else:
                layer.w_kc = kc


def checkpoint(prefix="model.layers") -> CheckpointLayout:
    tensors = [("embed.weight", (10, H), torch.float32)]
    for i in range(N):
        tensors += [
            (f"{prefix}.{i}.{n}", (H, H) if n != "norm.weight" else (H,), torch.float32)
            for n in ("a.weight", "b.weight", "norm.weight")
        ]
    return CheckpointLayout(tuple(sorted(tensors)))


def _every_layer(**toy) -> RankTargets:
    with torch.device("meta"):
        return derive_rank(Toy(**toy), checkpoint(toy.get("ckpt", "model.layers")))


def _engine_way(**toy):
    """The engine's derivation, and the layers its first model's loader saw."""
    built = []

    def build():
        with torch.device("meta"):
            built.append(Toy(**toy))
        return built[-1]

    return derive_once_per_layer_kind(
        build, checkpoint(toy.get("ckpt", "model.layers"))
    ), [m.seen for m in built]


def test_kinds_and_what_is_loaded():
    sampling = sample_layers(checkpoint().tensors)
    assert sampling.kinds == (LayerKind("model.layers", tuple(range(N))),)
    assert sampling.kinds[0].renamed == (1, 2, 3)
    assert sorted({layer_of(n) for n, _, _ in sampling.tensors} - {None}) == [
        ("model.layers", 0),
        ("model.layers", 4),
    ]
    # a layer holding other tensors is its own kind; fewer than 3 alike save nothing
    odd = [t for t in checkpoint().tensors if t[0] != "model.layers.2.norm.weight"]
    assert sample_layers(odd).kinds == (LayerKind("model.layers", (0, 1, 3, 4)),)
    assert (
        sample_layers(
            t
            for t in checkpoint().tensors
            if layer_of(t[0]) in (None, ("model.layers", 0))
        )
        is None
    )
    assert layer_of("model.visual.merger.mlp.0.weight") == (
        "model.visual.merger.mlp",
        0,
    )
    assert layer_of("lm_head.weight") is None


def test_loaded_once_equals_every_layer_loaded():
    derived, seen = _engine_way()
    assert seen == [{0, 4}]  # one model built, the middle layers never loaded
    full = _every_layer()
    assert derived == full
    assert len(derived.targets) == 1 + 2 * N  # embed; each layer's ab and norm
    assert set(derived.post_load) == {f"layers.{i}.w_kc" for i in range(N)}
    assert derived.post_load["layers.2.w_kc"] == (
        "model.layers.2.a.weight",
        "model.layers.2.b.weight",
    )
    ab2 = next(t for t in derived.targets if t.name == "layers.2.ab")
    assert {p.tensor for p in ab2.pieces} == {
        "model.layers.2.a.weight",
        "model.layers.2.b.weight",
    }
    assert any(p.perm == (1, 0) for p in ab2.pieces)


def test_checkpoint_and_engine_prefixes_may_differ():
    """A VL checkpoint's ``model.language_model.layers.<i>`` load into SGLang's ``layers.<i>``."""
    derived, seen = _engine_way(ckpt="model.language_model.layers")
    assert seen == [{0, 4}]
    assert derived == _every_layer(ckpt="model.language_model.layers")
    assert (
        derived.post_load["layers.3.w_kc"][0]
        == "model.language_model.layers.3.a.weight"
    )


@pytest.mark.parametrize(
    "toy, why",
    [
        (dict(odd=N - 1), "model.layers.4 is not loaded like model.layers.0"),
        (dict(extra=2), "SGLang's layers.2 holds other tensors than layers.0"),
        (dict(cross=True), "is fed from model.layers.4 but is not numbered 4"),
    ],
    ids=[
        "last-layer-loaded-otherwise",
        "engine-layer-differs",
        "layer-fed-from-another",
    ],
)
def test_layers_not_loaded_alike_are_all_derived(toy, why):
    ck = checkpoint()
    with torch.device("meta"):
        model = Toy(**toy)
    with pytest.raises(LayersDiffer, match=why):
        derive_sampled(model, ck, sample_layers(ck.tensors))
    derived, seen = _engine_way(**toy)
    assert seen == [{0, 4}, set(range(N))]  # tried once, then every layer
    assert derived == _every_layer(**toy)


def test_a_loader_refusing_a_partial_checkpoint_gets_every_layer():
    derived, seen = _engine_way(strict=True)
    assert seen == [{0, 4}, set(range(N))]
    assert derived == _every_layer(strict=True)
