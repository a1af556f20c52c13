"""Paths, the CPU engine environment and the test tiers, for every test under ``test/``.

* ``test/support`` (helpers, fakes and the ``sgl_kernel`` stand-in), ``test/e2e`` (the update
  cases the reliability tests reuse) and the repository root (``benchmark``) go on
  ``sys.path``, so test modules import helpers as top-level modules::

      from engine import engine_greedy, hf_greedy, stable_prompts
      import tiny_models, sglang_fakes

  What several test modules share (runners, oracles, fakes, strategies) lives there too: no
  module imports a test module (``test_*.py``), and importing a test module runs nothing
  (``test/unit/test_house.py`` holds both).

* ``configure_cpu_env()`` runs at import, before any test module imports ``sglang``:
  ``SGLANG_USE_CPU_ENGINE=1`` and ``test/support`` on ``PYTHONPATH`` for the engine's
  spawned processes (see ``test/support/engine.py``); not when ``SGLANG_TEST_GPU=1``
  (``scripts/gpu_run.sh``, the GPU tier), where SGLang must take its CUDA branches.
* Every test gets the marker of its folder (``unit``, ``distributed``, ``e2e``,
  ``reliability``, ``gpu``; registered in ``pytest.ini``): ``pytest test -m unit`` runs one tier,
  ``make test TIER=unit`` the same.
"""

import os
import sys
from pathlib import Path

import pytest

TEST = Path(__file__).resolve().parent
ROOT = TEST.parent
for folder in (TEST / "e2e", TEST / "support"):  # support ends first
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

# pr: here
import zygote  # noqa: E402 - before anything imports torch: it records what imports read

# pr: here end

# The fault tests wait out bounds on purpose (``timeout_s`` plus the grace): a 15 s grace
# instead of the default 30 s shortens each such wait. Set before anything imports
# ``weight_sync.protocol``, which reads it once; every process of the suite inherits it.
os.environ.setdefault("SGLANG_WEIGHT_SYNC_GRACE_S", "15")

from engine import configure_cpu_env  # noqa: E402

if os.environ.get("SGLANG_TEST_GPU") != "1":
    configure_cpu_env()
    # pr: here
    zygote.start()  # the engines' schedulers and detokenizers from a warm child
    zygote.install()
    # pr: here end

TIERS = ("unit", "distributed", "e2e", "reliability", "gpu")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's tier (``test/<tier>/...``)."""
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TEST).parts
        if len(parts) > 1 and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
