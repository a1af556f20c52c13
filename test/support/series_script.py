"""``scripts/pr_series.py`` as a module, for the tests that read the series or the package's
import graph through it (``test_pr_series.py``, ``test_house.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_pr_series"]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pr_series.py"


def load_pr_series() -> ModuleType:
    """Import ``scripts/pr_series.py`` (once per process) as ``pr_series``."""
    if "pr_series" in sys.modules:
        return sys.modules["pr_series"]
    spec = importlib.util.spec_from_file_location("pr_series", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module
