"""Build real SGLang 0.5.23 models on one CPU process as if they were engine TP rank r of T.

Nothing here runs a forward pass or touches torch.distributed. A model is
constructed from a tiny HF checkpoint and fed its full HF tensors through their own ``load_weights`` (then the loader's post-load
processing, as ``DefaultModelLoader`` runs it), so every parameter ends up sliced by
SGLang's own weight loaders. The result is SGLang's ground truth for the per-rank
layout, which ``test_hand_rules.py`` compares with the simulator's hand rules and
``test_derived_targets.py`` with the derived targets. Any architecture SGLang's registry
knows is built the way ``DefaultModelLoader`` builds it (``_initialize_model``). With ``"derive": true`` in a job, the worker also derives the
rank's targets on meta (``weight_sync.derive.derived_targets``) in the same faked rank.

How TP is faked (the same way SGLang's own tests do it, see
``sglang/test/parallel_groups.py``):

* ``get_context().override_server_args(tp_size=T, ep_size=EP)`` publishes a dummy
  config, so the derived widths (attn_tp_size, moe_ep_size, moe_tp_size) are
  SGLang's own.
* ``get_parallel().override(...)`` sets every rank (tp, attn_tp, moe_ep, moe_tp,
  pp, ...) with the launcher's formulas (``derive_spawn_ranks``:
  moe_tp_rank = r % (T/EP), moe_ep_rank = r // (T/EP)) and installs fake group
  objects (``derive.derived_targets.PlacementGroup``) carrying ``rank_in_group``/``world_size``,
  which is all that layers read (``get_group_rank_size``). Such a group raises on anything else, so a
  construction path that would need a real collective is reported, not hidden.

Three platform modes, each run in its own subprocess because SGLang reads
``SGLANG_USE_CPU_ENGINE`` (and ``is_cuda()``) once, at import:

* ``default``: no CPU engine. The loaders take their generic (CUDA) branches:
  plain ``narrow``; FusedMoE without padded loading, default runner (triton
  layout). Only ``RotaryEmbedding.__init__`` imports ``vllm._custom_ops`` on such a
  platform; a module with that name is provided (its function is never called). SGLang
  0.5.10.post1's model modules import ``sgl_kernel`` on every platform: the import-only
  stand-in below serves here too.
* ``cpu``: ``SGLANG_USE_CPU_ENGINE=1`` with the pure-torch ``sgl_kernel`` stand-in
  (``test/support/sgl_kernel``). Loaders take their CPU branches (``narrow_padded_param_and_loaded_weight``,
  FusedMoE ``use_padded_loading``), and the HF config is first passed through
  ``adjust_config_with_unaligned_cpu_tp`` exactly as ``ModelRunner`` does when
  ``device == "cpu"``.
* ``cuda``: on a GPU machine (the GPU tier): SGLang's ``is_cuda()`` is true, so the loaders,
  post-load processing and the derivation on meta take the CUDA branches; the real load
  builds the model on the GPU, as ``DefaultModelLoader`` does there.

Usage as a worker: ``python sglang_fakes.py JOB.json OUT.pt`` (see ``run_job``).
The light helpers (index encoding, decoding) import nothing from SGLang.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Sequence, Tuple

import torch

HERE = Path(__file__).resolve().parent
STUBS = HERE  # test/support: holds the sgl_kernel stand-in package
SENTINEL = (
    -1.0
)  # written into every parameter before loading: "SGLang never wrote this element"

# Config keys whose CPU-engine adjustment we report.
ADJUSTED_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "head_dim",
)


# ----------------------------------------------------------------------------------------------
# Index encoding: every element of every HF tensor gets a distinct positive value.


def index_encoded(
    shapes: Sequence[Tuple[str, Sequence[int]]],
) -> Dict[str, torch.Tensor]:
    """Full HF tensors whose elements are 1, 2, 3, ... in (sorted name, row-major) order.

    float32 holds every integer below 2**24 exactly, so values survive any copy
    bit-exactly and 0 (padding) and ``SENTINEL`` never collide with data.
    """
    out, offset = {}, 1
    for name, shape in sorted((n, tuple(s)) for n, s in shapes):
        numel = math.prod(shape)
        out[name] = (
            (torch.arange(numel, dtype=torch.float64) + offset)
            .to(torch.float32)
            .reshape(shape)
        )
        offset += numel
    if offset >= 2**24:
        raise ValueError(
            f"{offset} elements do not fit float32 exactly; use a smaller config"
        )
    return out


# pr: here
def describe_value(value: float, full: Dict[str, torch.Tensor]) -> str:
    """Which HF element an index-encoded value came from (for failure messages)."""
    if value == 0:
        return "0 (zero fill)"
    if value == SENTINEL:
        return "never written by SGLang"
    offset = 1
    for name in sorted(full):
        numel = full[name].numel()
        if offset <= value < offset + numel:
            flat, index = int(value) - offset, []
            for size in reversed(full[name].shape):
                index.append(flat % size)
                flat //= size
            return f"{name}{list(reversed(index))}"
        offset += numel
    return f"{value!r} (not an HF element)"


# pr: here end
def describe_layout(
    param: torch.Tensor, full: Dict[str, torch.Tensor], max_runs: int = 24
) -> str:
    """Where each block of ``param`` came from, as runs of HF rows and columns.

    E.g. ``[0][0:32, 0:64] <- experts.4.gate_proj.weight[0:32, 0:64]; [0][32:64, 0:64] <- zero``:
    the precise layout of a parameter whose shape the rules do not predict.
    """
    names = sorted(full)
    starts, offset = [], 1
    for name in names:
        starts.append(offset)
        offset += full[name].numel()
    starts_t = torch.tensor(starts, dtype=torch.int64)
    p = param.reshape(1, -1) if param.dim() == 1 else param
    lead = tuple(p.shape[:-2])
    nrows, ncols = p.shape[-2], p.shape[-1]
    rows = p.reshape(-1, ncols)

    v = rows.to(torch.float64)
    ids = torch.searchsorted(starts_t, v.clamp(min=1).to(torch.int64), right=True) - 1
    ids = torch.where(v == 0, -1, torch.where(v == SENTINEL, -2, ids))
    vi = v.to(torch.int64)
    # a new segment starts where the source tensor changes or the HF elements stop being consecutive
    breaks = (ids[:, 1:] != ids[:, :-1]) | (
        (ids[:, 1:] >= 0) & (vi[:, 1:] != vi[:, :-1] + 1)
    )
    ids_l, vi_l, breaks_l = ids.tolist(), vi.tolist(), breaks.tolist()

    def segments(i):
        cuts = [0] + [j + 1 for j, b in enumerate(breaks_l[i]) if b] + [ncols]
        return [(ids_l[i][a], vi_l[i][a], a, b) for a, b in zip(cuts, cuts[1:])]

    def hf_index(tid, value):
        flat, index = value - starts[tid], []
        for size in reversed(full[names[tid]].shape):
            index.append(flat % size)
            flat //= size
        return list(reversed(index))

    runs = []  # [outer, row_a, row_b, segs]
    for i in range(rows.shape[0]):
        outer, r = divmod(i, nrows)
        segs = segments(i)
        prev = runs[-1] if runs else None
        if (
            prev
            and prev[0] == outer
            and len(prev[3]) == len(segs)
            and all(
                (a[0], a[2], a[3]) == (b[0], b[2], b[3])
                and (
                    a[0] < 0
                    or b[1] == a[1] + (r - prev[1]) * full[names[a[0]]].shape[-1]
                )
                for a, b in zip(prev[3], segs)
            )
        ):
            prev[2] = r + 1
        else:
            runs.append([outer, r, r + 1, segs])
    parts = []
    for outer, a, b, segs in runs:
        for tid, value, c0, c1 in segs:
            where = (f"[{outer}]" if lead else "") + (
                f"[{a}:{b}, {c0}:{c1}]" if param.dim() > 1 else f"[{c0}:{c1}]"
            )
            if tid == -1:
                parts.append(f"{where} <- zero")
            elif tid == -2:
                parts.append(f"{where} <- never written")
            else:
                idx = hf_index(tid, value)
                if len(idx) == 1:
                    src = f"{idx[0]}:{idx[0] + c1 - c0}"
                else:
                    src = ", ".join(map(str, idx[:-2])) + (", " if len(idx) > 2 else "")
                    src += f"{idx[-2]}:{idx[-2] + b - a}, {idx[-1]}:{idx[-1] + c1 - c0}"
                parts.append(f"{where} <- {names[tid]}[{src}]")
    more = f"; ... ({len(parts) - max_runs} more)" if len(parts) > max_runs else ""
    return "; ".join(parts[:max_runs]) + more


# ----------------------------------------------------------------------------------------------
# Faked TP rank (SGLang imports are deferred: the env var must be set before the first one).


@contextmanager
def fake_engine_rank(tp_size: int, rank: int, moe_ep_size: int = 1, **server_args):
    """Publish a dummy SGLang config for TP ``tp_size`` / EP ``moe_ep_size`` (plus any other
    ``server_args`` fields) and act as ``rank`` with placement-only groups (the same
    ``as_engine_rank`` the engine uses to derive its targets)."""
    from sglang.srt.weight_sync.derive.derived_targets import as_engine_rank
    from sglang.srt.weight_sync.sglang_compat import parallel_widths, tp_state

    with published_layout(tp_size, moe_ep_size, server_args):
        assert parallel_widths() == (tp_size, tp_size, moe_ep_size, 1, 1, 1), (
            parallel_widths()
        )
        with as_engine_rank(rank):
            assert tp_state().rank == rank
            yield


@contextmanager
def published_layout(tp_size: int, moe_ep_size: int, server_args: dict):
    """What a launched engine has published before it builds its model, as a dummy: 0.5.23's
    ``override_server_args`` (SGLang's own test helper); on older releases (0.5.15.post1: in its
    runtime context, with the flags it resolves from them), server args with
    their defaults (no ``__post_init__``, which inspects a real model) and placement-only
    groups of these widths in the ``parallel_state`` and ``dp_attention`` globals."""
    try:
        from sglang.srt.runtime_context import get_context
    except ImportError:
        context = None
    else:
        context = get_context()
    if hasattr(context, "override_server_args"):
        installed = context.override_server_args(
            tp_size=tp_size, ep_size=moe_ep_size, **server_args
        )
        installed.install()
        try:
            yield
        finally:
            installed.restore()
        return
    import dataclasses

    from sglang.srt import server_args as server_args_module
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention
    from sglang.srt.weight_sync.derive.derived_targets import PlacementGroup
    from sglang.srt.weight_sync.sglang_compat import module_globals

    args = object.__new__(server_args_module.ServerArgs)
    for f in dataclasses.fields(args):
        default = (
            f.default_factory()
            if f.default_factory is not dataclasses.MISSING
            else f.default
        )
        setattr(args, f.name, None if default is dataclasses.MISSING else default)
    for name, value in dict(server_args, tp_size=tp_size, ep_size=moe_ep_size).items():
        setattr(args, name, value)
    published = {
        # 0.5.15.post1 keeps them in its runtime context (its flags resolved from them)
        **(
            {context: dict(_server_args=args, flags=_resolved_flags(context, args))}
            if context is not None
            else {server_args_module: dict(_global_server_args=args)}
        ),
        parallel_state: dict(
            _TP=PlacementGroup(0, tp_size),
            _ATTN_TP=PlacementGroup(0, tp_size),
            _ATTN_CP=PlacementGroup(0, 1),
            _MOE_DP=PlacementGroup(0, 1),
            _MOE_EP=PlacementGroup(0, moe_ep_size),
            _MOE_TP=PlacementGroup(0, tp_size // moe_ep_size),
            _PP=PlacementGroup(0, 1),
        ),
        dp_attention: dict(
            _ATTN_DP_SIZE=1,
            _LOCAL_ATTN_DP_SIZE=1,
            _ATTN_DP_RANK=0,
            _LOCAL_ATTN_DP_RANK=0,
            _ENABLE_DP_ATTENTION_FLAG=False,
        ),
    }
    with module_globals(published):
        yield


def _resolved_flags(context, args):
    """The flags 0.5.15.post1's runtime context resolves from ``args`` when they are published,
    leaving the context's own as they were."""
    saved = (context._server_args, context.flags)
    try:
        context.set_server_args(args)
        return context.flags
    finally:
        context._server_args, context.flags = saved


def _provide_vllm_rotary_import() -> None:
    """On a platform that is neither CUDA nor CPU, ``RotaryEmbedding.__init__`` runs
    ``from vllm._custom_ops import rotary_embedding``; give that import something to find."""
    import types

    if "vllm._custom_ops" in sys.modules:
        return
    vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*args, **kwargs):
        raise NotImplementedError("forward is never run in these tests")

    ops.rotary_embedding = rotary_embedding
    vllm._custom_ops = ops
    sys.modules.setdefault("vllm", vllm)
    sys.modules["vllm._custom_ops"] = ops


# ----------------------------------------------------------------------------------------------
# The worker: HF checkpoint -> SGLang model on rank r -> its parameters.


def _save_checkpoint(spec: dict, directory: Path) -> dict:
    """Write the tiny HF model with ``save_pretrained``; return its config.json and tensor list.

    ``save_pretrained`` gives the on-disk names that SGLang's loaders expect (per-expert
    ``experts.{e}.gate_proj.weight`` rather than transformers 5's fused in-memory
    ``experts.gate_up_proj``; no ``lm_head.weight`` when tied).
    """
    import transformers
    from safetensors import safe_open

    kwargs = dict(spec)
    config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    if type(config) not in auto._model_mapping:  # vision-language models (Qwen2.5-VL)
        auto = transformers.AutoModelForImageTextToText
    model = auto.from_config(config)
    model.save_pretrained(directory)
    shapes = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            shapes += [(name, list(f.get_slice(name).get_shape())) for name in f.keys()]
    return {
        "dir": str(directory),
        "config": json.loads((directory / "config.json").read_text()),
        "tensors": sorted(shapes),
    }


def sglang_model_config(directory: Path, mode: str, tp_size: int):
    """SGLang's own ModelConfig for the checkpoint, adjusted as ModelRunner does on CPU; and the
    config keys that adjustment changed."""
    from sglang.srt.configs import model_config as model_config_module
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig

    # as a freshly launched engine: SGLang caches get_config's result, and on 0.5.12 that object is
    # ModelConfig's hf_config, which the CPU adjustment below pads in place for the next case to see
    model_config_module.get_config.cache_clear()
    model_config = ModelConfig(model_path=str(directory))
    changes = {}
    if mode == "cpu":
        from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp

        before = {k: getattr(model_config.hf_config, k, None) for k in ADJUSTED_KEYS}
        model_config = adjust_config_with_unaligned_cpu_tp(
            model_config, LoadConfig(), tp_size
        )
        after = {k: getattr(model_config.hf_config, k, None) for k in ADJUSTED_KEYS}
        changes = {
            k: (before[k], after[k]) for k in ADJUSTED_KEYS if before[k] != after[k]
        }
    return model_config, changes


def _build(model_config, dtype: torch.dtype = torch.float32, device=None):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    # as DefaultModelLoader builds it (on its device: the "cuda" mode's GPU)
    with set_default_torch_dtype(dtype), torch.device(device or "cpu"):
        return _initialize_model(model_config, LoadConfig(), None)


def _computed(model) -> Dict[str, torch.Tensor]:
    """Buffers and plain tensor attributes with a storage of their own (a view of a parameter
    follows it)."""
    owned = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = {}
    for mname, module in model.named_modules():
        tensors = list(module.named_buffers(recurse=False))
        tensors += [
            (a, v) for a, v in vars(module).items() if isinstance(v, torch.Tensor)
        ]
        for attr, val in tensors:
            if val.numel() and val.untyped_storage().data_ptr() not in owned:
                out[f"{mname}.{attr}" if mname else attr] = val
    return out


def _load(model, full) -> None:
    from sglang.srt.weight_sync.sglang_compat import after_load

    model.load_weights(iter(full.items()))
    # What DefaultModelLoader.load_model does next: each quant method's post-load processing
    # (repacking would change the in-memory layout that weight updates write into).
    after_load(model)


def load_rank(
    model_config,
    full: Dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device=None,
):
    """SGLang's parameters on the current (faked) engine rank after ``load_weights`` of the full
    tensors, and the tensors loading computes from them (MLA's w_kc/w_vc, Gemma's weight + 1);
    built on ``device`` (None: CPU), returned on CPU."""
    model = _build(model_config, dtype, device)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)
    before = {n: t.clone() for n, t in _computed(model).items()}
    _load(model, full)
    computed = {
        n: t.detach().cpu().clone()
        for n, t in _computed(model).items()
        if n not in before or not torch.equal(before[n], t)
    }
    return (
        model,
        {name: p.detach().cpu().clone() for name, p in model.named_parameters()},
        computed,
    )


def refresh_check(
    model, model_config, full: Dict[str, torch.Tensor], device=None
) -> Dict[str, str]:
    """Write the parameters SGLang loads from other weights (``2 * full``) in place, as an update
    does, then run SGLang's refresh (``apply.refresh_derived``, then what follows
    an update on this release, ``sglang_compat.after_update``): each computed tensor must equal
    a fresh load's and keep its storage. Returns the problems by tensor name."""
    from sglang.srt.weight_sync.apply import refresh_derived
    from sglang.srt.weight_sync.sglang_compat import after_update

    fresh = _build(model_config, device=device)
    _load(fresh, {n: 2 * t for n, t in full.items()})
    storages = {n: t.untyped_storage().data_ptr() for n, t in _computed(model).items()}
    with torch.no_grad():
        new = dict(fresh.named_parameters())
        for name, p in model.named_parameters():
            p.data.copy_(new[name])
        refresh_derived(model)
        after_update(model)
    expected, problems = _computed(fresh), {}
    for name, t in _computed(model).items():
        if name in storages and t.untyped_storage().data_ptr() != storages[name]:
            problems[name] = "storage replaced by the refresh"
        elif name in expected and not torch.equal(t, expected[name]):
            problems[name] = "stale after the refresh"
    return problems


def run_job(job: dict, out_path: str) -> None:
    """``job``: {"mode", "workdir", "configs": {id: hf kwargs or None (saved already)}, "cases":
    [[case_id, cfg_id, T, r, ep, {server args}?]], "derive": bool, "checksums": bool}.

    With "checksums", each case is SGLang's own load of the saved checkpoint in its dtype, as
    ``{"checksums": {param: tensor_hash}}`` (what SGLang's weight checker reports).

    Writes ``torch.save({"checkpoints": {cfg_id: {"dir", "config": <config.json>, "tensors":
    [(name, shape)]}}, "results": {case_id: {"params": {...}, "config_changes": {...}, "derived":
    RankTargets (the engine's derivation), "every_layer": RankTargets
    (every layer loaded), "layout", "refresh_problems" (when job["derive"])} | {"error": str}},
    "platform": {...}})``.
    """
    mode = job["mode"]
    if mode == "default":
        _provide_vllm_rotary_import()
    import sglang.srt.utils as sgl_utils
    from sglang.srt.weight_sync.derive.derived_targets import (
        build_meta_model,
        checkpoint_layout,
        derive_rank,
    )

    # isort: split
    # pr: scale
    from sglang.srt.weight_sync.derive.repeated_layers import (
        derive_sampled,
        sample_layers,
    )

    # pr: scale end

    platform = {
        "is_cpu": bool(sgl_utils.is_cpu()),
        "is_cuda": bool(sgl_utils.is_cuda()),
    }
    if platform["is_cpu"] != (mode == "cpu") or (
        mode == "cuda" and not platform["is_cuda"]
    ):
        raise RuntimeError(f"mode {mode!r} but SGLang sees {platform}")
    device = "cuda" if mode == "cuda" else None

    checkpoints, results = {}, {}
    workdir = Path(job["workdir"])
    for cfg_id, spec in job["configs"].items():
        if spec is not None:  # None: a checkpoint already saved in workdir / cfg_id
            checkpoints[cfg_id] = _save_checkpoint(spec, workdir / cfg_id)
    for case_id, cfg_id, tp_size, rank, ep, *extra in job["cases"]:
        try:
            with fake_engine_rank(tp_size, rank, ep, **(extra[0] if extra else {})):
                model_config, changes = sglang_model_config(
                    workdir / cfg_id, mode, tp_size
                )
                if job.get(
                    "checksums"
                ):  # SGLang's own load of the saved checkpoint, in its dtype
                    from safetensors.torch import load_file

                    from sglang.srt.managers.mm_utils import tensor_hash

                    full = load_file(str(workdir / cfg_id / "model.safetensors"))
                    _, params, _ = load_rank(model_config, full, model_config.dtype)
                    results[case_id] = {
                        "checksums": {
                            n: f"{tensor_hash(p):016x}" for n, p in params.items()
                        }
                    }
                    continue
                full = index_encoded(checkpoints[cfg_id]["tensors"])
                model, params, computed = load_rank(model_config, full, device=device)
                results[case_id] = {
                    "params": params,
                    "computed": computed,
                    "config_changes": changes,
                }
                if job.get("derive"):
                    import transformers

                    layout = checkpoint_layout(
                        transformers.AutoConfig.from_pretrained(workdir / cfg_id)
                    )
                    results[case_id]["layout"] = layout
                    # the engine's derivation and every layer derived
                    every_layer = derive_rank(build_meta_model(model_config), layout)
                    results[case_id]["derived"] = every_layer
                    # pr: scale
                    # repeated layers loaded once, without the fallback to every layer
                    sampling = sample_layers(layout.tensors)
                    if sampling:
                        results[case_id]["derived"] = derive_sampled(
                            build_meta_model(model_config), layout, sampling
                        )
                    # pr: scale end
                    results[case_id]["every_layer"] = every_layer
                    if computed:
                        results[case_id]["refresh_problems"] = refresh_check(
                            model, model_config, full, device
                        )
        except Exception:  # reported per case by the test
            results[case_id] = {"error": traceback.format_exc()}
    torch.save(
        {"checkpoints": checkpoints, "results": results, "platform": platform}, out_path
    )


def worker_env(mode: str) -> Dict[str, str]:
    """Environment for a worker subprocess of ``mode`` ("default", "cpu" or "cuda")."""
    env = dict(os.environ)
    # Start from a neutral platform even when the pytest process was set up for the CPU
    # engine (test/conftest.py sets SGLANG_USE_CPU_ENGINE=1 and puts STUBS on PYTHONPATH).
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    path = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != STUBS
    ]
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TRANSFORMERS_VERBOSITY"] = "error"
    if mode == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    # the sgl_kernel stand-in on both platforms: SGLang 0.5.10.post1's model modules import
    # sgl_kernel at module level on every platform (it only lets imports succeed; the platform
    # is SGLANG_USE_CPU_ENGINE's)
    env["PYTHONPATH"] = os.pathsep.join([str(STUBS)] + path)
    return env


def run_worker(args: Sequence, mode: str, timeout: float = 900) -> None:
    """``python *args`` in a subprocess with ``worker_env(mode)``; raises with the end of its
    stderr if it fails."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, *map(str, args)],
        env=worker_env(mode),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{mode} worker failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
        )


def run_job_in_worker(job: dict, base: Path, name: str, timeout: float = 900) -> dict:
    """``run_job(job)`` in a worker subprocess of ``job["mode"]``: what it wrote (the file,
    tens of MB, is removed once loaded)."""
    job_path, out_path = base / f"job-{name}.json", base / f"out-{name}.pt"
    job_path.write_text(json.dumps(job))
    run_worker([__file__, job_path, out_path], job["mode"], timeout)
    result = torch.load(out_path, weights_only=False)
    out_path.unlink()
    return result


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run_job(json.load(f), sys.argv[2])
