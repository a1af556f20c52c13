"""Faults and hostile input against a real SGLang engine on CPU.

Helpers come from ``test/support`` and the e2e update cases (on ``sys.path``, with the CPU
engine environment, from ``test/conftest.py``). All tests share one TP-2 engine
(``engine`` fixture below, session scope: this conftest only serves this folder); each
test first sets the weights it checks against.
"""

import pytest
from faults import running_engine


@pytest.fixture(scope="session")
def fault_dir(tmp_path_factory):
    """Where a test asks the engine's ranks to fail after their writes (``test_mixed_weights.py``)."""
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="session")
def engine(tmp_path_factory, fault_dir):
    """A running TP-2 tiny-Qwen2 engine: ``(engine, model_dir, config)``."""
    with running_engine(tmp_path_factory.mktemp("model"), fault_dir) as ctx:
        yield ctx
