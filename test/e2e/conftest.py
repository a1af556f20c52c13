"""End-to-end tests against a real ``sglang.Engine`` on CPU.

Importing this conftest configures the CPU engine environment for the whole pytest
process (``configure_cpu_env``: ``SGLANG_USE_CPU_ENGINE=1``, ``test/support`` with the
``sgl_kernel`` stand-in first on ``sys.path`` and ``PYTHONPATH``). Pytest imports it while
collecting ``test/e2e``, before any e2e test module, so test modules may
``import sglang`` at the top. It stays set for the rest of the run; the other test
folders are fine with that (see ``test/support/engine.py`` and the notes there).

Helpers live in ``test/support`` and are imported as top-level modules::

    from engine import engine_greedy, hf_greedy, stable_prompts
    import tiny_models
"""

import time

import pytest
import tiny_models
from engine import _shm_entries, cleanup_shm


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(kind, seed=0, **overrides) -> (path, config)``, each built once per session."""
    cache = {}

    def make(kind: str, seed: int = 0, **overrides):
        key = (kind, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"{kind}_s{seed}")
            cache[key] = tiny_models.make_tiny_model(kind, directory, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session", autouse=True)
def _dev_shm_hygiene():
    """After the e2e tests, remove the /dev/shm files that appeared meanwhile and that no live
    process uses: engines that do not clean up after themselves (those started inside
    trainer-rank processes, say) leave ``sglang_loads_*``/``sem.mp-*`` files behind. The
    semaphores of this process's own queues stay: its exit removes them."""
    before, started = _shm_entries(), time.time()
    yield
    cleanup_shm(before, started, mine_in_use=True)


# pr: remote
@pytest.fixture(scope="session")
def remote_tp2_servers(tmp_path_factory):
    """Two bf16 SGLang HTTP servers of TP 2 of the tiny Qwen2, each in a process tree of its
    own, started once for the remote-engine tests (``test_remote_engines``,
    ``test_verl_checkpoint_engine``): ``([a, b], model_dir, config, directory)``. Each test
    sets the weights it checks and joins a group of its own name. The servers take token
    ids (no tokenizer)."""
    from servers import launch_side_by_side

    directory = tmp_path_factory.mktemp("remote")
    model_dir, config = tiny_models.make_tiny_model("qwen2", directory / "qwen2")
    servers = launch_side_by_side(model_dir, 2, [None, None], log_dir=str(directory))
    try:
        yield servers, model_dir, config, directory
    finally:
        for server in servers:
            server.kill()


# pr: remote end
