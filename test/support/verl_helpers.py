"""verl 0.9.1 as the tests run it, and the check of a server it updated; shared by the verl and
AReaL e2e tests and the verl checkpoint-engine cases (``test_verl_release`` says why each
stand-in is needed).

* ``ServerActor``: stand-in for verl's SGLang server Ray actor.
* ``verl_sources``, ``patched_copy``: verl's installed ``transformer_impl.py`` stock and with the
  companion patch (``PATCH``) applied with ``--fuzz=0``; any framework file and patch alike.
* ``verl_producer``: the (name, tensor) pairs ``FSDPEngine.get_per_tensor_param`` makes.
* ``give_tokenizer``: a tokenizer for a tiny checkpoint, which verl's ``HFModelConfig`` loads.
* ``wait_healthy``, ``params_at_tp1``, ``check_server``: a server up, its parameters read back
  at TP 1, and after an update bit-exact with generation equal to HF's.
* ``llama_with_prompts``: the tiny Llama those servers run, and prompts stable under each
  seed's new weights.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import tiny_models
import torch
from engine import hf_greedy
from update_cases import MAX_NEW, checksum, new_weights
from update_checks import expected_checksums

__all__ = [
    "PATCH",
    "ServerActor",
    "check_server",
    "give_tokenizer",
    "llama_with_prompts",
    "params_at_tp1",
    "patched_copy",
    "verl_producer",
    "verl_sources",
    "wait_healthy",
]

PATCH = (
    Path(__file__).resolve().parents[2]
    / "integrations"
    / "verl"
    / "0001-fsdp-rollout-local-shards.patch"
)


class _Remote:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        async def call():
            return self._fn(*args)

        return call()


class ServerActor:
    """Stand-in for verl's SGLang server Ray actor."""

    def __init__(self, port: int):
        self.steps = []
        self.get_server_address = _Remote(lambda: ("127.0.0.1", port))
        self.set_global_steps = _Remote(self.steps.append)


def verl_sources(tmp_path: Path) -> dict:
    """verl 0.9.1's installed ``transformer_impl.py``, as released ("stock") and with the companion
    patch applied with ``--fuzz=0`` ("patched")."""
    import verl

    assert verl.__version__ == "0.9.1", verl.__version__
    src = (
        Path(verl.__file__).parent
        / "workers"
        / "engine"
        / "fsdp"
        / "transformer_impl.py"
    )
    return {
        "stock": src.read_text(),
        "patched": patched_copy(
            src, "verl/workers/engine/fsdp", tmp_path, PATCH, "verl 0.9.1"
        ),
    }


def patched_copy(
    src: Path, package_dir: str, tmp_path: Path, patch: Path, what: str
) -> str:
    """``src`` (a framework's installed file, at ``package_dir`` in its tree) with ``patch``
    applied to a copy with ``--fuzz=0``; fails when it does not apply."""
    copy = tmp_path / package_dir
    copy.mkdir(parents=True)
    shutil.copy(src, copy)
    applied = subprocess.run(
        ["patch", "-d", str(tmp_path), "-p1", "--fuzz=0", "-i", str(patch)],
        capture_output=True,
        text=True,
    )
    assert applied.returncode == 0, (
        f"{patch.name} does not apply to {what}:\n{applied.stdout}{applied.stderr}"
    )
    return (copy / src.name).read_text()


def verl_producer(source: str, params: dict, model_type: str):
    """(name, tensor) pairs as ``FSDPEngine.get_per_tensor_param`` of ``source`` makes them for a
    plain (non-LoRA) model: the statements of that branch, compiled from verl's file and run here."""
    import ast
    import importlib.util
    from types import SimpleNamespace

    import verl
    from torch.distributed.tensor import DTensor

    engine = next(
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.ClassDef) and n.name == "FSDPEngine"
    )
    method = next(
        n
        for n in engine.body
        if isinstance(n, ast.FunctionDef) and n.name == "get_per_tensor_param"
    )
    branch = next(
        n.orelse
        for n in ast.walk(method)
        if isinstance(n, ast.If)
        and any(
            isinstance(s, ast.Assign)
            and getattr(s.targets[0], "id", None) == "per_tensor_param"
            for s in n.orelse
        )
    )
    code = compile(
        ast.Module(body=branch, type_ignores=[]),
        "verl/workers/engine/fsdp/transformer_impl.py",
        "exec",
    )
    utils = Path(verl.__file__).parent / "workers" / "engine" / "fsdp" / "utils.py"
    spec = importlib.util.spec_from_file_location("verl_fsdp_engine_utils", utils)
    fsdp_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(
        fsdp_utils
    )  # the file alone: its package __init__ is the heavy import
    scope = dict(
        os=os,
        DTensor=DTensor,
        params=params,
        get_device_id=lambda: "cpu",
        unfuse_moe_params=fsdp_utils.unfuse_moe_params,
        self=SimpleNamespace(
            _qat_enabled=False,
            model_config=SimpleNamespace(
                hf_config=SimpleNamespace(model_type=model_type)
            ),
        ),
    )
    exec(code, scope)
    return scope["per_tensor_param"]


def wait_healthy(port: int, timeout: float = 900) -> None:
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if (
                requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
                == 200
            ):
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"no SGLang server on port {port} after {timeout} s")


def params_at_tp1(port: int, names) -> dict:
    """Every HF tensor of a TP-1 server, read back with SGLang's ``/get_weights_by_name`` (its
    parameter, or its region of a fused one, in fp32: exact for bf16), as tensor hashes."""
    import requests

    out = {}
    for name in names:
        reply = requests.post(
            f"http://127.0.0.1:{port}/get_weights_by_name",
            json={"name": name, "truncate_size": 1 << 30},
            timeout=60,
        )
        assert reply.status_code == 200, (
            f"/get_weights_by_name {name}: {reply.status_code} {reply.text[:200]}"
        )
        out[name] = checksum(torch.tensor(reply.json(), dtype=torch.float32))
    return {0: out}


def check_server(
    record: dict, model_dir, config, tp: int, prompts: dict, what: str
) -> None:
    """A server after the update of ``record["seed"]``'s weights: every rank's parameters
    (``record["params"]``: ``checksums`` at TP > 1, ``params_at_tp1`` at TP 1) equal
    SGLang's slicing bit for bit, and greedy generation equals HF transformers'."""
    weights = new_weights(model_dir, record["seed"])
    if tp > 1:
        expected = expected_checksums(config, weights, tp, 1)
    else:
        expected = {
            0: {n: checksum(t.to(torch.bfloat16).float()) for n, t in weights.items()}
        }
    for r in range(tp):
        wrong = sorted(
            n for n in expected[r] if record["params"][r][n] != expected[r][n]
        )
        assert not wrong, (
            f"{what}: rank {r} parameters differ from SGLang's slicing: {wrong[:5]}"
        )
    assert record["generation"] == hf_greedy(
        model_dir, prompts[record["seed"]], MAX_NEW, weights=weights
    ), f"{what}: generation differs from HF transformers"


def llama_with_prompts(directory: Path, seeds) -> tuple:
    """A tiny Llama in ``directory`` and, per seed, prompts whose greedy continuation is stable
    under that seed's new weights: (model_dir, config, {seed: prompts})."""
    from engine import stable_prompts

    model_dir, config = tiny_models.make_tiny_model("llama", directory)
    prompts = {
        seed: stable_prompts([(model_dir, new_weights(model_dir, seed))], 3, MAX_NEW)
        for seed in seeds
    }
    return model_dir, config, prompts


def give_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    """verl's ``HFModelConfig`` loads a tokenizer, which the tiny checkpoints lack (the servers take
    token ids): save the one ``transformers`` builds for a tiny Qwen2 directory (for a tiny Llama
    it builds none); nothing here uses it."""
    from transformers import AutoTokenizer

    qwen2_dir, _ = tiny_models.make_tiny_model(
        "qwen2", tmp_path / "tokenizer", vocab_size=2048
    )
    AutoTokenizer.from_pretrained(qwen2_dir).save_pretrained(model_dir)
