"""Faults and hostile input against a real SGLang engine on CPU.

Like ``test/e2e``, importing this conftest configures the CPU engine environment for
the pytest process; helpers come from ``test/support`` (and the e2e update cases).
Each module shares one TP-2 engine across its tests (``engine`` fixture below).
"""

import sys
from pathlib import Path

import pytest

TEST = Path(__file__).resolve().parents[1]
for folder in (TEST / "support", TEST / "e2e"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from engine import configure_cpu_env  # noqa: E402

configure_cpu_env()

from faults import running_engine  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A running TP-2 tiny-Qwen2 engine: ``(engine, model_dir, config)``."""
    with running_engine(tmp_path_factory.mktemp("model")) as ctx:
        yield ctx
