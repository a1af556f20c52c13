"""Block-FP8 engines fed from BF16 trainers: the checkpoints, SGLang's own load, the update.

SGLang 0.5.23's CPU engine cannot load a block-FP8 model (docs/usage.md, FP8): its
``Fp8LinearMethod`` post-load step asserts an AMX CPU with sgl-kernel's CPU ops, which no
CPU wheel provides. So the ground truth here is the lowest level that is real: SGLang's own
model classes built on the CPU as engine TP rank r of T (``sglang_fakes.fake_engine_rank``),
with the quantization config SGLang's loader resolves from the checkpoint, loading the
reference-quantized checkpoint through their own ``load_weights`` and the loader's post-load
step, on the platform-neutral branch (no ``SGLANG_USE_CPU_ENGINE``: the branch CUDA takes
when DeepGEMM is not the runner). A worker process does that (``python fp8_cases.py JOB
OUT``) and also derives each rank's targets from the BF16 checkpoint (the pieces of every
``P.weight``, as the unquantized model's loaders place them).

* ``SPECS``: tiny models in block-FP8 shapes (every size a multiple of 128 per rank at
  TP 1 and 2): the Qwen2 (8 q and 8 kv heads of 32, hidden 256, intermediate 512) and a
  Qwen3-MoE (the same attention, 8 experts of intermediate 256, top 2); ``DEEPSEEK``: a
  DeepSeek-V3-shaped model in the same shapes (MLA, a dense first layer, routed experts
  and a shared expert), whose MLA derives ``w_kc``/``w_vc`` from ``kv_b_proj`` after loading.
* ``write_fp8_checkpoint``: the BF16 checkpoint quantized by the reference quantizer
  (``fp8_quant``), with the ``quantization_config`` verl's FP8 rollout gives SGLang.
* ``sglang_fp8_load``: the worker's answer per (T, rank): parameter checksums, live shapes and
  dtypes, derived targets, whether SGLang's post-load step is idempotent there, and what
  SGLang derives after loading (MLA's ``w_kc``/``w_vc``) before and after it runs again on
  weights written in place; ``sglang_fp8_loads`` the same for several sets of server
  arguments in one worker.
* ``update_rank``: one rank of a gloo world: FSDP2 shards of the BF16 weights -> plan ->
  execute into staging -> quantize into the FP8 parameters; checksums and byte counts.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Dict, Sequence, Tuple

import torch

HERE = Path(__file__).resolve().parent

QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

# the tiny Qwen2 of ``tiny_models`` at sizes block FP8 takes at TP 1 and 2
_ATTENTION = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8)
SPECS = {
    "qwen2": dict(intermediate_size=512, **_ATTENTION),
    "qwen3_moe": dict(
        head_dim=32, intermediate_size=512, moe_intermediate_size=256, **_ATTENTION
    ),
}


# DeepSeek-V3-shaped (``tiny_models`` "deepseek_v3": MLA with q_lora, a dense first layer,
# then 8 routed experts and a shared expert) at sizes block FP8 takes at TP 1 and 2: 4 heads
# of 64 nope + 64 rope dims (q_b_proj and kv_b_proj 512 rows, 256 per rank at TP 2), o_proj
# 256 columns; kv_a_proj_with_mqa is kv_lora 128 + rope 64 = 192 rows, a ragged last block
# as DeepSeek-V3's 576, fused after q_a_proj's 128 rows (``fused_qkv_a_proj_with_mqa``).
# Plain rope: off the CPU engine SGLang builds yarn rope only on an accelerator.
DEEPSEEK = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=256,
    moe_intermediate_size=256,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    rope_scaling=None,
)


def quantized_names(tensors: Dict[str, torch.Tensor]) -> Sequence[str]:
    """The HF tensors SGLang's ``Fp8Config`` quantizes: the weights of its linear layers and
    experts (2-D ``.weight`` under ``model.layers``, norms and the MoE router excepted: the
    router is built without a quant config). Embeddings and ``lm_head`` stay unquantized
    (not ``LinearBase``)."""
    return sorted(
        n
        for n, t in tensors.items()
        if n.startswith("model.layers.")
        and n.endswith(".weight")
        and t.dim() == 2
        and "norm" not in n
        and not n.endswith("mlp.gate.weight")
    )


def write_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """``src`` (a BF16 checkpoint) with every quantized weight replaced by the reference
    quantizer's e4m3 weight and float32 ``weight_scale_inv``, and the block-FP8
    ``quantization_config`` in its config.json."""
    import tiny_models
    from safetensors.torch import save_file

    from sglang.srt.weight_sync.fp8_quant import quantize_block_fp8

    tensors = tiny_models.load_checkpoint(src)
    out = dict(tensors)
    for name in quantized_names(tensors):
        out[name], out[name + "_scale_inv"] = quantize_block_fp8(tensors[name])
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name != "config.json"
        ):
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((Path(src) / "config.json").read_text())
    config["quantization_config"] = dict(QUANT_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def checksum(t: torch.Tensor) -> str:
    """A tensor's checksum as SGLang's weight checker reports it (its bytes)."""
    from sglang.srt.managers.mm_utils import tensor_hash

    return f"{tensor_hash(t):016x}"


# ----------------------------------------------------------------------------------------------
# The worker: SGLang's own load of the FP8 checkpoint, per faked engine rank.


def _build_quantized(model_config):
    """The model as ``DefaultModelLoader`` builds it, quantization config included, on CPU."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import (
        _get_quantization_config,
        _initialize_model,
    )
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    quant_config = _get_quantization_config(model_config, LoadConfig())
    with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        return _initialize_model(model_config, LoadConfig(), quant_config)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def computed(model) -> Dict[str, torch.Tensor]:
    """What SGLang derived from the parameters after loading, outside them (MLA's ``w_kc``,
    ``w_vc`` and, off CUDA, ``w_scale``; rope caches), by name (``sglang_fakes._computed``)."""
    import sglang_fakes

    return sglang_fakes._computed(model)


def _post_load_idempotent(model) -> Tuple[bool, Sequence[str], Sequence[str]]:
    """Run what follows an update (``sglang_compat.after_update``: the model's post-load
    fixups, then each quant method's post-load step) once more on a loaded model: whether
    every parameter keeps its bytes and its storage and every derived tensor its bytes; and
    the derived tensors it replaced by new ones (same bytes, another storage)."""
    from sglang.srt.weight_sync.sglang_compat import after_update

    before = {
        n: (p.detach().clone(), p.data_ptr()) for n, p in model.named_parameters()
    }
    # each derived tensor itself too, kept alive so that its storage is not handed on
    derived = {n: (t.clone(), t) for n, t in computed(model).items()}
    with torch.no_grad():
        after_update(model)
    changed = [
        n
        for n, p in model.named_parameters()
        if n not in before
        or p.data_ptr() != before[n][1]
        or p.dtype != before[n][0].dtype
        or not torch.equal(_bytes(p), _bytes(before[n][0]))
    ]
    now = computed(model)
    changed += [
        n
        for n, t in now.items()
        if n not in derived or not torch.equal(_bytes(t), _bytes(derived[n][0]))
    ]
    replaced = sorted(
        n
        for n, t in now.items()
        if n in derived
        and t.untyped_storage().data_ptr() != derived[n][1].untyped_storage().data_ptr()
    )
    same = set(before) == {n for n, _ in model.named_parameters()}
    return not changed and same and set(derived) == set(now), changed, replaced


def _scramble(model, expected_computed) -> Sequence[str]:
    """Every e4m3 weight and float32 scale of ``model`` set to garbage, and SGLang's post-load
    step run on it, so that what it derives is the garbage's too: an update that left derived
    state as it was shows. The derived tensors that now differ from ``expected_computed``."""
    from sglang.srt.weight_sync.sglang_compat import after_update

    with torch.no_grad():
        for p in model.parameters():
            if p.dtype in (torch.float8_e4m3fn, torch.float32) and p.dim():
                p.copy_(torch.randn(p.shape).to(p.dtype))
        after_update(model)
    return _derived_differ(model, expected_computed)


def _derived_differ(model, expected_computed) -> Sequence[str]:
    """The derived tensors of ``model`` whose checksum differs from ``expected_computed``."""
    now = {n: checksum(t) for n, t in computed(model).items()}
    return sorted(
        n
        for n in set(now) | set(expected_computed)
        if now.get(n) != expected_computed.get(n)
    )


def _derived_refresh(model, expected_computed) -> dict:
    """The loaded parameters written back in place over garbage (as an update writes them),
    then what follows an update (``apply.refresh_derived``, ``sglang_compat.after_update``):
    every derived tensor must equal the fresh load's again. Returns the derived tensors stale
    before (``stale``: not empty where the model derives any), those differing after
    (``differ``), and those the refresh gave a new storage (``replaced``)."""
    from sglang.srt.weight_sync.apply import refresh_derived
    from sglang.srt.weight_sync.sglang_compat import after_update

    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the derived tensors themselves, kept alive: a storage freed by a post-load step that
    # assigns a new tensor could be handed to the next one, which would look kept
    before = computed(model)
    stale = _scramble(model, expected_computed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(loaded[n])
        refresh_derived(model)
        after_update(model)
    now = computed(model)
    return {
        "stale": stale,
        "differ": _derived_differ(model, expected_computed),
        "replaced": sorted(
            n
            for n, t in now.items()
            if n not in before
            or t.untyped_storage().data_ptr() != before[n].untyped_storage().data_ptr()
        ),
    }


def run_job(job: dict, out_path: str) -> None:
    """``job``: {"fp8": dir, "bf16": dir, "variants": {name: [server args, [[T, r], ...]]}}.
    Writes ``torch.save({name: {(T, r): {"checksums", "live", "derived", "parallel",
    "post_load_idempotent", "post_load_changed", "post_load_replaced", "computed",
    "refresh"}}})``: each variant's engine ranks built with its server arguments;
    ``computed`` the checksums of what SGLang derived after loading (``computed``),
    ``refresh`` what ``_derived_refresh`` found."""
    import sglang_fakes

    sglang_fakes._provide_vllm_rotary_import()
    import transformers
    from safetensors.torch import load_file

    from sglang.srt.weight_sync.derive.derived_targets import checkpoint_layout

    fp8, bf16 = Path(job["fp8"]), Path(job["bf16"])
    full = load_file(str(fp8 / "model.safetensors"))
    # what the engine derives from: the FP8 checkpoint's HF config (BF16 tensors, as a
    # trainer holds them) and the unquantized twin of its model config
    layout = checkpoint_layout(transformers.AutoConfig.from_pretrained(fp8))
    out = {}
    for name, (server_args, cases) in job["variants"].items():
        out[name] = _load_ranks(cases, server_args, fp8, bf16, full, layout)
    torch.save(out, out_path)


def _load_ranks(cases, server_args: dict, fp8: Path, bf16: Path, full, layout) -> dict:
    """``run_job``'s answer for one variant: SGLang's load at each (T, r) of ``cases``."""
    import sglang_fakes

    from sglang.srt.weight_sync.derive.derived_targets import (
        build_meta_model,
        derive_rank,
    )
    from sglang.srt.weight_sync.fp8_targets import derivation_config
    from sglang.srt.weight_sync.sglang_compat import after_load, parallel_widths

    out = {}
    for tp, rank in cases:
        with sglang_fakes.fake_engine_rank(tp, rank, **server_args):
            model_config, _ = sglang_fakes.sglang_model_config(fp8, "default", tp)
            model = _build_quantized(model_config)
            with torch.no_grad():
                model.load_weights(iter(full.items()))
                after_load(model)
            params = dict(model.named_parameters())
            derived_sums = {n: checksum(t) for n, t in computed(model).items()}
            idempotent, changed, replaced = _post_load_idempotent(model)
            derived = derive_rank(
                build_meta_model(derivation_config(model_config)), layout
            )
            out[(tp, rank)] = {
                "checksums": {n: checksum(p) for n, p in params.items()},
                "live": {n: (tuple(p.shape), p.dtype) for n, p in params.items()},
                "derived": derived,
                # the engine's (TP, attention TP, MoE EP) widths, as it publishes them
                "parallel": parallel_widths()[:3],
                "post_load_idempotent": idempotent,
                "post_load_changed": list(changed),
                "post_load_replaced": replaced,
                "computed": derived_sums,
                "refresh": _derived_refresh(model, derived_sums),
            }
            if tp == 1:
                out[(tp, rank)]["engine"] = _engine_update(
                    model,
                    derived,
                    layout,
                    bf16,
                    out[(tp, rank)]["checksums"],
                    derived_sums,
                )
    return out


def _engine_update(
    model, rank_targets, layout, bf16: Path, expected, expected_computed
) -> dict:
    """The engine end's own steps on SGLang's live FP8 model (TP 1, rank 0): the provenance
    check of the derived targets against the live FP8 loaders, the refusals of derived state,
    ``EngineLayout.live`` with the block-FP8 transform, the plan from the full
    BF16 tensors cut for sender quantization and run as ``engine_update`` runs it
    (``fp8_wire.ColocatedFp8``), then what follows an
    update (``refresh_derived``, SGLang's post-load step). Weights and scales are scrambled
    first, and what SGLang derives from them with them (``_scramble``); every parameter
    must come back to SGLang's load (``expected``), and every derived tensor (MLA's
    ``w_kc``/``w_vc``) to the load's (``expected_computed``)."""
    import tiny_models

    from sglang.srt.weight_sync.apply import refresh_derived
    from sglang.srt.weight_sync.derive.derived_targets import DerivedTargets
    from sglang.srt.weight_sync.derive.provenance_check import ProvenanceCheck
    from sglang.srt.weight_sync.engine_layout import EngineLayout
    from sglang.srt.weight_sync.fp8_wire import ColocatedFp8, cut_for_groups
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.sglang_compat import after_update, update_refusals
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import EngineParallel

    derived = DerivedTargets.of_ranks(
        EngineParallel(1), [rank_targets], layout.shapes(), layout.aliases
    )
    provenance = ProvenanceCheck().problems(model, derived, 0)
    refusals = update_refusals(model)
    layout = EngineLayout(0)
    refused = ""
    try:
        layout.live(model, derived)
    except ValueError as e:
        refused = str(e)
    live_layout = layout.live(model, derived, block_fp8=True)
    targets, params = live_layout.targets, live_layout.params
    fp8 = layout.block_fp8(derived, dict(model.named_parameters()))
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    stale = _scramble(model, expected_computed)
    full = tiny_models.load_checkpoint(bf16)
    sources = {
        n: MeshSpec.full(t.shape, t.dtype, [0]).describe(n) for n, t in full.items()
    }
    live = dict(model.named_parameters())
    fp8_params = {q.weight: live[q.weight].data for q in fp8.own.quantized}
    fp8_params.update((q.scale, live[q.scale].data) for q in fp8.own.quantized)
    p = plan(sources, {0: targets.for_rank(0)}, aliases=targets.aliases)
    # as ``engine_update`` runs it: the plan cut with the live manifest (every block is
    # this rank's own, quantized where it lies), then the blocks left from staging (none)
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    cut = cut_for_groups(p, live_layout.manifest, [(0,)], shapes)
    step = ColocatedFp8.of(
        cut,
        0,
        fp8.own.quantized,
        targets.for_rank(0),
        fp8_params,
        torch.device("cpu"),
    )
    destinations = step.destinations(params)
    assert not step.check(p, 0, full, destinations)
    with torch.no_grad():
        stats = step.run(0, full, destinations, None, 60)
        step.quantize_left()
        refresh_derived(model)
        after_update(model)
    now = dict(model.named_parameters())
    engine_side = sorted(n for n, t in now.items() if checksum(t) != expected[n])
    derived_differ = _derived_differ(model, expected_computed)
    trainer_side = _trainer_side(
        model, derived, layout, full, expected, expected_computed
    )
    now = dict(model.named_parameters())
    return {
        "trainer_side": trainer_side,
        "provenance": provenance,
        "refusals": refusals,
        "refused_elsewhere": refused,
        "quantized": len(fp8.own.quantized),
        "differ": engine_side,
        "derived_stale": stale,
        "derived_differ": derived_differ,
        "moved": sorted(n for n, t in now.items() if t.data_ptr() != ptrs[n]),
        "copied": stats.bytes_copied_locally,
        "staged_bytes": sum(t.numel() * t.element_size() for t in step.staged.values()),
    }


def _trainer_side(model, derived, layout, full, expected, expected_computed) -> dict:
    """The trainer-side path's engine step (``engine_trainer_side.local_step``): the
    trainer planned parameter-shaped buffers against the manifest (block-FP8 weights in bf16,
    their staged dtype) and sends them in two batches, each a fused parameter's half; the
    engine checks and copies them, quantizing the delivered blocks. Weights and scales are
    scrambled first."""
    from sglang.srt.weight_sync.delivery import Payload
    from sglang.srt.weight_sync.engine_trainer_side import local_step
    from sglang.srt.weight_sync.protocol import PayloadKind
    from sglang.srt.weight_sync.sglang_compat import after_update
    from sglang.srt.weight_sync.target_layout import restrict

    live_layout = layout.live(model, derived, block_fp8=True)
    targets, params, manifest = (
        live_layout.targets,
        live_layout.params,
        live_layout.manifest,
    )
    live = dict(model.named_parameters())
    fp8 = layout.block_fp8(derived, live)
    stale = _scramble(model, expected_computed)
    problems = []
    for names in batches_of(full, 2):
        buffers = {}
        for t in restrict(targets.for_rank(0), names, {}):
            buffer = torch.full(t.shape, float("nan"), dtype=t.dtype)
            for piece in t.pieces:
                buffer[piece.index][piece.dest_box().slices()] = piece.region(
                    full[piece.tensor]
                )
            buffers[t.name] = buffer
        payload = Payload(
            "u",
            0,
            {0: 0},
            buffers,
            {},
            PayloadKind.PARAMS,
            tuple(names),
            manifest.fingerprint,
        )
        step = local_step(payload, targets, manifest, params, 0, fp8, live)
        problems += step.problems
        if not step.problems:
            with torch.no_grad():
                step.run()
    with torch.no_grad():
        after_update(model)
    now = dict(model.named_parameters())
    derived_differ = _derived_differ(model, expected_computed)
    regions = _trainer_side_regions(
        model, targets, manifest, params, fp8, full, expected, expected_computed
    )
    return {
        "problems": problems,
        "differ": sorted(n for n, t in now.items() if checksum(t) != expected[n]),
        "derived": {"stale": stale, "differ": derived_differ},
        "regions": regions,
    }


def _trainer_side_regions(
    model, targets, manifest, params, fp8, full, expected, expected_computed
) -> dict:
    """The engine step again, every block-FP8 weight in regions (``Fp8Region``) as the
    trainer-side path hands them when its senders quantize: every other piece quantized
    by the reference quantizer (e4m3 then scales), the rest in bf16, no parameter-shaped
    buffer; weights and scales scrambled first. Then payloads that do not match the plan
    by name, each refused before anything is written (problems by case)."""
    import dataclasses

    from sglang.srt.weight_sync.delivery import Payload
    from sglang.srt.weight_sync.engine_trainer_side import local_step
    from sglang.srt.weight_sync.fp8_sender import quantize_for_wire
    from sglang.srt.weight_sync.protocol import Fp8Region, Fp8RegionKind, PayloadKind
    from sglang.srt.weight_sync.sglang_compat import after_update

    live = dict(model.named_parameters())
    blocks = {q.weight: q.block for q in fp8.own.quantized}
    stale = _scramble(model, expected_computed)
    names = tuple(sorted(full))
    tensors, regions = {}, []
    for t in targets.for_rank(0):
        if t.name not in blocks:
            buffer = torch.empty(t.shape, dtype=t.dtype)
            for piece in t.pieces:
                buffer[piece.index][piece.dest_box().slices()] = piece.region(
                    full[piece.tensor]
                )
            tensors[t.name] = buffer
            continue
        for i, piece in enumerate(t.pieces):
            box, key = piece.dest_box(), f"fp8-region/{len(regions)}"
            data = piece.region(full[piece.tensor]).to(t.dtype)
            kind = Fp8RegionKind.STAGED
            if i % 2 == 0 and piece.perm is None:
                kind, data = (
                    Fp8RegionKind.QUANTIZED,
                    quantize_for_wire(data, blocks[t.name]),
                )
            regions.append(
                Fp8Region(
                    key,
                    kind,
                    t.name,
                    piece.index,
                    box.offsets,
                    box.sizes,
                    blocks[t.name],
                )
            )
            tensors[key] = data.contiguous()

    def step(regions, tensors):
        payload = Payload(
            "u",
            0,
            {0: 0},
            tensors,
            {},
            PayloadKind.PARAMS,
            names,
            manifest.fingerprint,
            fp8_regions=tuple(regions),
        )
        return local_step(payload, targets, manifest, params, 0, fp8, live)

    first = regions[0]
    plain = next(n for n in tensors if not n.startswith("fp8-region/"))
    staged = next(r for r in regions if r.kind == Fp8RegionKind.STAGED)
    refused = {
        "block": [dataclasses.replace(first, block=(64, 64))] + regions[1:],
        "not_fp8": [dataclasses.replace(first, param=plain)] + regions[1:],
        "overlap": regions + [dataclasses.replace(first, key="fp8-region/x")],
        "missing": [r for r in regions if r is not staged],
        "size": [dataclasses.replace(first, sizes=(128,) * len(first.sizes))]
        + regions[1:],
    }
    problems = {}
    for case, wrong in refused.items():
        extra = {"fp8-region/x": tensors[first.key]} if case == "overlap" else {}
        kept = {
            n: b
            for n, b in {**tensors, **extra}.items()
            if not n.startswith("fp8-region/") or n in {r.key for r in wrong}
        }
        problems[case] = step(wrong, kept).problems
    good = step(regions, tensors)
    if not good.problems:
        with torch.no_grad():
            good.run()
            after_update(model)
    now = dict(model.named_parameters())
    return {
        "problems": good.problems,
        "differ": sorted(n for n, t in now.items() if checksum(t) != expected[n]),
        "kinds": sorted({r.kind.value for r in regions}),
        "refused": problems,
        "derived": {
            "stale": stale,
            "differ": _derived_differ(model, expected_computed),
        },
    }


def sglang_fp8_load(fp8: Path, bf16: Path, cases, work: Path) -> dict:
    """``run_job`` in a worker process on the platform-neutral branch: SGLang's load at each
    (T, r) of ``cases``."""
    return sglang_fp8_loads(fp8, bf16, work, {"": ({}, cases)})[""]


def sglang_fp8_loads(
    fp8: Path, bf16: Path, work: Path, variants: Dict[str, Tuple[dict, Sequence]]
) -> Dict[str, dict]:
    """``sglang_fp8_load`` for each of ``variants`` (name: the engine's other server
    arguments, e.g. ``enforce_shared_experts_fusion`` or ``moe_ep_size``, and the (T, r)
    cases), in one worker process."""
    import sglang_fakes

    job = {"fp8": str(fp8), "bf16": str(bf16)}
    job["variants"] = {
        name: [dict(args), [list(c) for c in cases]]
        for name, (args, cases) in variants.items()
    }
    job_path, out_path = work / "fp8-job.json", work / "fp8-out.pt"
    job_path.write_text(json.dumps(job))
    sglang_fakes.run_worker([__file__, job_path, out_path], "default")
    return torch.load(out_path, weights_only=False)


# ----------------------------------------------------------------------------------------------
# One rank of the update.


def fsdp_shards(full: Dict[str, torch.Tensor], world: int):
    """FSDP2 (``fully_shard`` over every rank) shards of ``full``: (layout, local tensors).
    Dim-0 chunks of ceil(rows / world): at 3 ranks every 256-row tensor is cut at rows 86
    and 172, inside 128-blocks."""
    from fsdp_shards import fully_sharded
    from torch.distributed.device_mesh import init_device_mesh

    return fully_sharded(
        full, init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    )


def megatron_shards(bf16: str, full: Dict[str, torch.Tensor], tp: int, pp: int):
    """Megatron-core TP x PP local parameters: a real ``GPTModel`` built on this rank
    (``megatron_cases.build_gpt``, local spec, fp32 parameters), loaded from ``full``
    through its pieces (``load_hf_weights``), described by ``megatron_layout`` over every
    rank's coordinates (one small integer all-gather, as ``megatron_flow.all_coords``):
    (layout, local tensors by buffer key), as ``fsdp_shards`` gives them."""
    import torch.distributed as dist
    import transformers
    from megatron_cases import build_gpt, load_hf_weights

    from sglang.srt.weight_sync.megatron_flow import this_rank
    from sglang.srt.weight_sync.megatron_layout import (
        MegatronRank,
        describe_model_chunks,
        megatron_sources,
    )

    config = transformers.AutoConfig.from_pretrained(bf16)
    vocab = config.vocab_size
    model = build_gpt(config, tp, pp, -(-vocab // tp) * tp)
    load_hf_weights(model, full, vocab)
    me = this_rank()
    desc, buffers = describe_model_chunks([model], vocab, me)
    mine = torch.tensor([me.tp, me.pp, me.ep, me.etp])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    coords = {r: MegatronRank(*map(int, row)) for r, row in enumerate(every)}
    return megatron_sources(desc, coords), {k: t.detach() for k, t in buffers.items()}


def local_of(layout, local: Dict[str, torch.Tensor], names, rank: int):
    """``rank``'s local tensors (by buffer key) that hold pieces of the HF tensors ``names``."""
    return {
        h.buffer: local[h.buffer]
        for n in names
        for h in layout[n].holders
        if h.rank == rank
    }


def batches_of(names, count: int):
    """The HF tensors in ``count`` batches, as a trainer that sends its weights bucket by
    bucket does: with 2, the q and gate projections (and every expert's gate) come first, so
    that a fused parameter (``qkv_proj``, ``gate_up_proj``, ``w13``) is filled by two updates."""
    names = sorted(names)
    if count == 1:
        return [names]
    first = [n for n in names if "q_proj" in n or "gate_proj" in n]
    return [first, [n for n in names if n not in first]]


def update_rank(
    rank: int,
    world: int,
    tp: int,
    bf16: str,
    loads: dict,
    bucket: int,
    batches: int = 1,
    megatron_pp: int = 0,
) -> dict:
    """Rank ``rank`` of ``world`` FSDP2 trainer ranks holding the BF16 checkpoint's tensors
    (with ``megatron_pp``: Megatron-core ranks at TP ``world / megatron_pp`` x PP
    ``megatron_pp``, ``megatron_shards``); rank k also acts as engine rank k % ``tp``
    (engine-side when ``world == tp``, the engine's own step ``fp8_wire.ColocatedFp8``; every
    rank receives what its engine rank needs). Its FP8 parameters start as garbage; after the update
    (in ``batches`` of tensors: ``batches_of``) every parameter's checksum must equal
    SGLang's own load (``loads[(tp, k % tp)]``)."""
    if world != tp:  # the trainer-side one-hop path, as the runtime runs it
        from fp8_sender_cases import trainer_side_rank

        return trainer_side_rank(
            rank, world, tp, bf16, loads, bucket, batches, megatron_pp
        )
    import tiny_models
    import torch.distributed as dist
    from fp8_sender_cases import RANK_FIGURES, quantized_lower_bound

    from sglang.srt.weight_sync.fp8_sender import sender_quantized
    from sglang.srt.weight_sync.fp8_targets import block_fp8_targets
    from sglang.srt.weight_sync.fp8_wire import ColocatedFp8
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.target_layout import restrict

    full = tiny_models.load_checkpoint(bf16)
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    if megatron_pp:  # Megatron-core TP world x PP 1: the ranks beside hold every layer
        layout, local = megatron_shards(bf16, full, world, megatron_pp)
    else:
        layout, local = fsdp_shards(full, world)
    del full  # the reference lives in ``loads``: no rank keeps a full tensor past here
    transformed = {}
    for k in range(world):
        load = loads[(tp, k % tp)]
        t = block_fp8_targets(load["derived"].targets, load["live"], shapes)
        assert not t.problems, [str(p) for p in t.problems]
        transformed[k] = t
    mine = transformed[rank]
    live = loads[(tp, rank % tp)]["live"]
    written = {t.name for t in mine.targets} | {q.scale for q in mine.quantized}
    params = {}
    for name in sorted(written):
        shape, dtype = live[name]
        garbage = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
        params[name] = garbage.to(dtype)
    fp8_params = {q.weight: params[q.weight] for q in mine.quantized}
    fp8_params.update((q.scale, params[q.scale]) for q in mine.quantized)
    element_bytes = {t.name: t.dtype.itemsize for t in mine.targets}
    figures = dict.fromkeys(
        RANK_FIGURES
        + ("counted", "blocks_received_quantized", "blocks_quantized_here"),
        0,
    )
    staging_bytes = 0
    for names in batches_of(layout, batches):
        # the engine's own step (``engine_update``): a plan for this rank, cut for sender
        # quantization, the blocks left staged fresh per update (NaN: a block read from
        # staging that this update did not deliver shows)
        wanted = {k: restrict(t.targets, names, {}) for k, t in transformed.items()}
        sources = {n: layout[n] for n in names}
        p = plan(sources, wanted, bucket_bytes=bucket, local_ranks=(rank,))
        cut = sender_quantized(
            p, {k: t.quantized for k, t in transformed.items()}, shapes
        )
        step = ColocatedFp8.of(
            cut, rank, mine.quantized, wanted[rank], fp8_params, torch.device("cpu")
        )
        for buffer in step.staged.values():
            buffer.fill_(float("nan"))
        destinations = step.destinations(params)
        shards = local_of(layout, local, names, rank)
        problems = step.check(p, rank, shards, destinations)
        assert not problems, problems
        stats = step.run(rank, shards, destinations, None, 60)
        step.quantize_left()
        figures["received"] += stats.bytes_received
        figures["lower_bound"] += cut.lower_bound_bytes(rank)
        figures["planned"] += cut.received_bytes(rank)
        figures["bf16_lower_bound"] += p.lower_bound_bytes(rank)
        figures["counted"] += quantized_lower_bound(
            sources, wanted[rank], mine.quantized, element_bytes, rank
        )
        figures["peak"] = max(figures["peak"], stats.peak_staging_bytes)
        figures["blocks_received_quantized"] += sum(
            q.blocks
            for rnd in cut.quantized
            for q in rnd
            if rank in {d.rank for d in q.move.dests}
        )
        figures["blocks_quantized_here"] += sum(
            math.prod(-(-n // 128) for n in piece.box.sizes[-2:])
            * math.prod(piece.box.sizes[:-2])
            for t in step.left
            for piece in t.pieces
        )
        staging_bytes = max(
            staging_bytes,
            sum(s.numel() * s.element_size() for s in step.staged.values()),
        )
        del step, destinations
    dist.barrier()
    expected = loads[(tp, rank % tp)]["checksums"]
    return {
        "differ": sorted(n for n, t in params.items() if checksum(t) != expected[n]),
        "compared": len(params),
        "not_written": sorted(set(live) - written),
        "quantized": len(mine.quantized),
        "fp8_live": sum(1 for _, d in live.values() if d == torch.float8_e4m3fn),
        **figures,
        "fp8_staging_bytes": staging_bytes,
        "largest_local": max(t.numel() * t.element_size() for t in local.values()),
    }


def engine_sync_rank(
    rank: int, world: int, bf16: str, loads: dict, channel: str, poison: str = ""
) -> dict:
    """Engine rank ``rank`` of a TP-``world`` block-FP8 engine, its update run by
    ``engine_update.EngineWeightSync`` itself (``_validate``, ``_agree``, then ``_write``: the plan, its
    cut for sender quantization, ``fp8_wire.ColocatedFp8``, the figures shared over the
    engine's own control group) from the ``Shard(0)`` chunk of the trainer rank beside it,
    on gloo; the parameters start as garbage in a module with the live FP8 model's names,
    shapes and dtypes. ``poison``: a tensor whose chunk on rank 1 gets a NaN (the update
    must be refused by ``_validate``, before any write)."""
    from types import SimpleNamespace

    import tiny_models
    import torch.distributed as dist
    from fp8_remote import module_of

    from sglang.srt.weight_sync import engine_update
    from sglang.srt.weight_sync.delivery import Payload
    from sglang.srt.weight_sync.derive.derived_targets import DerivedTargets
    from sglang.srt.weight_sync.executor import DataGroup
    from sglang.srt.weight_sync.sglang_compat import TpState
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import EngineParallel

    engine_update.tp_state = lambda: TpState(
        rank, world, world, 1, dist.group.WORLD, None
    )
    full = tiny_models.load_checkpoint(bf16)
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    ranks = list(range(world))
    specs = {n: MeshSpec.sharded(t.shape, t.dtype, 0, ranks) for n, t in full.items()}
    local = {
        n: full[n][specs[n].describe(n).box_of(rank).slices()].clone() for n in full
    }
    del full  # no rank keeps a full tensor past here
    if poison and rank == 1:
        local[poison].view(-1)[0] = float("nan")
    derived = DerivedTargets.of_ranks(
        EngineParallel(world),
        [loads[(world, r)]["derived"] for r in ranks],
        shapes,
        {},
    )
    live = loads[(world, rank)]["live"]
    garbage = torch.Generator().manual_seed(rank)
    model = module_of(
        {
            n: torch.randn(s, generator=garbage).to(d)
            for n, (s, d) in sorted(live.items())
        }
    )
    before = {n: checksum(p) for n, p in model.named_parameters()}
    sync = engine_update.EngineWeightSync(rank)
    payload = Payload("u", rank, {r: r for r in ranks}, local, specs, layout_memo={})
    received = engine_update.ReceivedShards(sync, payload)
    request = SimpleNamespace(
        channel=channel, update_id="u", bucket_bytes=1 << 30, timeout_s=60.0
    )
    found = sync._validate(model, derived, received, request)
    # every rank's problems on every rank (the engine's one agreement round trip)
    refusal, _ = sync._agree(found.problems, found.plan, 60.0, payload)
    out = {"problems": found.problems, "refusal": refusal}
    if refusal is None:
        with torch.no_grad():
            figures = sync._write(
                model, received, found, request, 60.0, DataGroup(None), 0
            )
        out["figures"] = {
            k: figures[i][rank] for i, k in enumerate(("received", "lower_bound"))
        }
        out["staged"] = sorted(found.fp8.staged)
        out["cut_cached"] = (
            sync._cut(
                found.plan, sync.layout.live(model, derived, True).manifest, {}, derived
            )
            is found.fp8.sender
        )
    dist.barrier()
    expected = loads[(world, rank)]["checksums"]
    now = {n: checksum(p) for n, p in model.named_parameters()}
    out["differ"] = sorted(
        n
        for n in now
        if now[n] != expected[n] and not n.endswith(("k_scale", "v_scale"))
    )
    out["changed"] = sorted(n for n in now if now[n] != before[n])
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    run_job(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
