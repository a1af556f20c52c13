"""Each engine TP rank derives only its own targets, the ranks exchange them, and the cache key says when a derivation is stale.

A worker process (SGLang's default platform, ``sglang_fakes``) publishes a TP 2 layout for a
tiny DeepSeek-V3-shaped model (MLA, MoE, shared expert) and runs ``derive.target_cache`` as the
engine does (with ``derive.disk_cache``), with the ranks' exchange played in-process (each rank's bytes, in rank order).
The per-rank records must equal the generic derivation (``derive_engine_rank``), the
assembled targets must be every rank's, a restart must read the disk entries without
deriving, a rank whose derivation fails must still join the exchange with its error, and the
cache key must change with the model config, the server args that shape loading, the
parallel layout, the device (GPU name, compute capability) and the kernel packages' versions,
but not with ports, log settings or unrelated packages.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import sglang_fakes  # test/support: on sys.path (test/conftest.py) and, as a worker, on PYTHONPATH

TINY = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    hidden_size=64,
    num_hidden_layers=2,
    vocab_size=500,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_group=2,
    topk_group=1,
    moe_layer_freq=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    tie_word_embeddings=False,
)


def _worker(workdir: Path) -> dict:
    """Run every scenario as engine ranks of TP 2; return the facts the tests check."""
    import logging
    import os

    sglang_fakes._provide_vllm_rotary_import()
    import transformers

    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp
    from sglang.srt.weight_sync.derive import disk_cache, target_cache
    from sglang.srt.weight_sync.derive.derived_targets import (
        RankTargets,
        checkpoint_layout,
        derive_engine_rank,
    )
    from sglang.srt.weight_sync.sglang_compat import original_hf_config

    def save(name, **changes):
        kwargs = {**TINY, **changes}
        transformers.AutoConfig.for_model(
            kwargs.pop("model_type"), **kwargs
        ).save_pretrained(workdir / name)
        return ModelConfig(model_path=str(workdir / name))

    def key_with(model_config, tp_size=2, ep_size=1, **server_args):
        with sglang_fakes.published_layout(tp_size, ep_size, server_args):
            return disk_cache.cache_key(model_config)

    facts = {}
    os.environ[disk_cache.CACHE_DIR_ENV] = str(workdir / "cache")
    warnings = []
    logging.getLogger(disk_cache.__name__).addHandler(
        type(
            "H",
            (logging.Handler,),
            {"emit": lambda self, r: warnings.append(r.getMessage())},
        )(logging.WARNING)
    )
    model_config = save("model")
    with sglang_fakes.published_layout(2, 1, {}):
        checkpoint = checkpoint_layout(original_hf_config(model_config))
        generic = [derive_engine_rank(model_config, checkpoint, r) for r in range(2)]
        records = [target_cache.own_rank_record(model_config, r) for r in range(2)]
        facts["records_equal_generic"] = [
            RankTargets.from_builtins(records[r]["derived"]) == generic[r]
            for r in range(2)
        ]
        facts["disk_entries"] = sorted(
            p.name for p in (workdir / "cache").rglob("*.json")
        )
        sent = []

        def exchange(own):
            sent.append(json.loads(own)["rank"])
            return [own, json.dumps(records[1]).encode()]

        memo = {}  # what the engine's weight sync keeps
        targets = target_cache.engine_derived_targets(model_config, 0, exchange, memo)
        facts["assembled_equal_generic"] = [
            targets.per_rank[r] == generic[r].targets for r in range(2)
        ]
        facts["shapes_equal_checkpoint"] = targets.shapes == checkpoint.shapes()
        facts["post_load"] = sorted(targets.post_load)
        facts["pieces"] = sum(len(t.pieces) for ts in targets.per_rank for t in ts)
        facts["exchange_calls"] = list(sent)
        facts["memory_hit_same"] = (
            target_cache.engine_derived_targets(model_config, 0, exchange, memo)
            is targets
        )
        facts["exchange_calls_after_hit"] = list(sent)

        def refuse(*args, **kwargs):
            raise RuntimeError("derivation must not run: the disk entry is valid")

        derive, target_cache.derive_engine_rank = (
            target_cache.derive_engine_rank,
            refuse,
        )
        try:
            restarted = target_cache.engine_derived_targets(
                model_config, 1, lambda own: [json.dumps(records[0]).encode(), own]
            )
            facts["restart_equal"] = (
                restarted.per_rank == targets.per_rank
                and restarted.shapes == targets.shapes
            )

            os.environ[disk_cache.CACHE_DIR_ENV] = str(workdir / "empty-cache")
            failing, memo = [], {}
            try:
                target_cache.engine_derived_targets(
                    model_config,
                    1,
                    lambda own: (
                        failing.append(json.loads(own))
                        or [json.dumps(records[0]).encode(), own]
                    ),
                    memo,
                )
                facts["failure"] = "no error"
            except ValueError as e:
                facts["failure"] = str(e)
            facts["failing_rank_sent"] = failing
            facts["failure_cached"] = bool(memo)
        finally:
            target_cache.derive_engine_rank = derive
            os.environ[disk_cache.CACHE_DIR_ENV] = str(workdir / "cache")

        entry = workdir / "cache" / disk_cache.cache_key(model_config) / "tp0.json"
        entry.write_text('{"format": 2, "derived": ')  # a torn write
        rederived = target_cache.own_rank_record(model_config, 0)
        facts["torn_entry_rederived"] = (
            RankTargets.from_builtins(rederived["derived"]) == generic[0]
        )
        facts["torn_entry_warned"] = any(
            "unreadable target cache" in w for w in warnings
        )

        # a CPU engine pads heads that do not divide T in ModelConfig's HF config, in place (on 0.5.12
        # that object is the one SGLang's get_config caches): the checkpoint still has the original shapes
        transformers.AutoConfig.for_model(
            "llama",
            architectures=["LlamaForCausalLM"],
            hidden_size=64,
            num_hidden_layers=1,
            vocab_size=500,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=128,
        ).save_pretrained(workdir / "padded")
        padded = ModelConfig(
            model_path=str(workdir / "padded"), trust_remote_code=False
        )  # as the engine's args
        key_before = disk_cache.cache_key(padded)
        adjust_config_with_unaligned_cpu_tp(padded, LoadConfig(), 4)
        facts["padding"] = dict(
            engine=padded.hf_config.num_attention_heads,
            original=original_hf_config(padded).num_attention_heads,
            key_changes=disk_cache.cache_key(padded) != key_before,
        )

    base = key_with(model_config)
    facts["keys"] = {
        "same": key_with(model_config) == base,
        "port and log level": key_with(model_config, port=31234, log_level="debug")
        == base,
        "config": key_with(save("deeper", num_hidden_layers=3)) == base,
        "loading server arg": key_with(model_config, disable_shared_experts_fusion=True)
        == base,
        "tp size": key_with(model_config, tp_size=4) == base,
        "ep size": key_with(model_config, ep_size=2) == base,
    }
    facts["device_keys"], facts["kernel_keys"] = _device_and_kernel_keys(
        lambda: key_with(model_config), base
    )
    return facts


def _device_and_kernel_keys(key, base):
    """The cache key with the device lookups (torch.cuda) and the kernel packages' versions
    (importlib.metadata) patched: it must follow each, and nothing else."""
    import importlib.metadata

    import torch

    from sglang.srt.weight_sync.derive import disk_cache

    real_version = importlib.metadata.version
    cuda_names = (
        "is_available",
        "current_device",
        "get_device_capability",
        "get_device_name",
    )
    real_cuda = {n: getattr(torch.cuda, n) for n in cuda_names}

    def patched(cuda=None, versions=None):
        try:
            if cuda is not None:
                name, capability = cuda
                torch.cuda.is_available = lambda: True
                torch.cuda.current_device = lambda: 0
                torch.cuda.get_device_capability = lambda index=None: capability
                torch.cuda.get_device_name = lambda index=None: name
            if versions is not None:

                def version(dist):
                    if dist not in versions:
                        return real_version(dist)
                    if versions[dist] is None:
                        raise importlib.metadata.PackageNotFoundError(dist)
                    return versions[dist]

                importlib.metadata.version = version
            return key()
        finally:
            importlib.metadata.version = real_version
            for n, f in real_cuda.items():
                setattr(torch.cuda, n, f)

    h100 = ("NVIDIA H100 80GB HBM3", (9, 0))
    device = {
        "same GPU twice": patched(cuda=h100) == patched(cuda=h100),
        "GPU vs none": patched(cuda=h100) == base,
        "capability": patched(cuda=(h100[0], (10, 0))) == patched(cuda=h100),
        "device name": patched(cuda=("NVIDIA H200", (9, 0))) == patched(cuda=h100),
        "lookups restored": key() == base,
    }
    kernels = {"unrelated package": patched(versions={"numpy": "0.0"}) == base}
    for dist in disk_cache.KERNEL_PACKAGES:
        one = patched(versions={dist: "9.9.9"})
        kernels[dist] = dict(
            same_twice=one == patched(versions={dist: "9.9.9"}),
            installed_vs_before=one == base,
            version=one == patched(versions={dist: "9.9.10"}),
            absent=one == patched(versions={dist: None}),
        )
    return device, kernels


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("target_cache")
    sglang_fakes.run_worker([__file__, workdir], "default", timeout=600)
    return json.loads((workdir / "facts.json").read_text())


def test_each_rank_derives_its_own_and_the_exchange_assembles_every_rank(facts):
    assert facts["records_equal_generic"] == [True, True]
    assert facts["disk_entries"] == [
        "tp0.json",
        "tp1.json",
    ]  # one entry per rank, under one key
    assert facts["assembled_equal_generic"] == [True, True]
    assert facts["shapes_equal_checkpoint"]
    assert facts["post_load"] and all(
        n.endswith(("w_kc", "w_vc")) for n in facts["post_load"]
    )
    assert facts["pieces"] > 0
    assert facts["exchange_calls"] == [0]


def test_later_updates_use_memory_and_restarts_use_disk(facts):
    assert facts["memory_hit_same"] and facts["exchange_calls_after_hit"] == [
        0
    ]  # no exchange, no derivation
    assert facts["restart_equal"]  # derivation refused to run: the disk entries served


def test_a_failing_rank_joins_the_exchange_and_every_rank_refuses(facts):
    assert facts["failing_rank_sent"] == [
        {
            "error": "engine rank 1: deriving its targets failed: RuntimeError: "
            "derivation must not run: the disk entry is valid"
        }
    ]
    assert facts["failure"].startswith(
        "engine rank 1: deriving its targets failed: RuntimeError"
    )
    assert not facts["failure_cached"]  # the next update derives again


def test_a_torn_disk_entry_is_derived_again(facts):
    assert facts["torn_entry_warned"] and facts["torn_entry_rederived"]


def test_the_checkpoint_layout_comes_from_the_config_on_disk_after_cpu_padding(facts):
    """SGLang's CPU engine pads 8 heads to 16 at TP 4 in place; the derivation still describes the
    checkpoint's 8 (the key changes only because the engine's adjusted config is part of it)."""
    assert facts["padding"] == {"engine": 16, "original": 8, "key_changes": True}


def test_cache_key_follows_what_derivation_depends_on(facts):
    assert facts["keys"] == {
        "same": True,
        "port and log level": True,
        "config": False,
        "loading server arg": False,
        "tp size": False,
        "ep size": False,
    }


def test_cache_key_follows_the_device_and_the_kernel_packages(facts):
    """A GPU's name and compute capability, and each kernel package's version (or absence),
    are part of the key; the same lookups give the same key, unrelated packages none."""
    assert facts["device_keys"] == {
        "same GPU twice": True,
        "GPU vs none": False,
        "capability": False,
        "device name": False,
        "lookups restored": True,
    }
    kernels = facts["kernel_keys"]
    assert kernels.pop("unrelated package") is True
    assert kernels == {
        dist: dict(
            same_twice=True, installed_vs_before=False, version=False, absent=False
        )
        for dist in ("sgl-kernel", "flashinfer-python", "deep-gemm", "triton")
    }


if __name__ == "__main__":
    out = Path(sys.argv[1])
    (out / "facts.json").write_text(json.dumps(_worker(out)))
