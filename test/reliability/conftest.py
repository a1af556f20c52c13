"""Faults and hostile input against a real SGLang engine on CPU.

Like ``test/e2e``, importing this conftest configures the CPU engine environment for
the pytest process; helpers come from ``test/support`` (and the e2e update cases).
All tests share one TP-2 engine (``engine`` fixture below, session scope: this
conftest only serves this folder); each test first sets the weights it checks against.
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


@pytest.fixture(scope="session")
def fault_dir(tmp_path_factory):
    """Where a test asks the engine's ranks to fail after their writes (``test_mixed_weights.py``)."""
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="session")
def engine(tmp_path_factory, fault_dir):
    """A running TP-2 tiny-Qwen2 engine: ``(engine, model_dir, config)``."""
    with running_engine(tmp_path_factory.mktemp("model"), fault_dir) as ctx:
        yield ctx
