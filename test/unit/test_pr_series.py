"""The upstream series (``scripts/pr_series.toml``, written by ``make pr``) covers the change and
is ordered:

* every module of the package, hook patch of the primary base, test file and doc belongs to
  exactly one pull request, or stays in this repository; nothing listed is missing;
* an item refers only to what its own or an earlier pull request adds, except the references
  listed as open (each with the seam that removes it), and that list is exactly what the code
  does: a reference cut leaves the list, a new one fails here.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def series_module():
    spec = importlib.util.spec_from_file_location(
        "pr_series", ROOT / "scripts" / "pr_series.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def series(series_module):
    return series_module.load_series()


def test_every_item_belongs_to_one_pull_request(series_module, series):
    assert not series.duplicates(), f"listed twice: {series.duplicates()}"
    owner = series.owner()
    existing = (
        {f"module:{m}" for m in series_module.package_modules()}
        | {f"hook:{h}" for h in series_module.hook_patches()}
        | {f"test:{t}" for t in series_module.test_files()}
        | {
            f"doc:{p.relative_to(ROOT).as_posix()}"
            for p in (ROOT / "docs").rglob("*.md")
        }
    )
    assert not existing - set(owner), (
        f"not in scripts/pr_series.toml (a pull request's list, or [here]): "
        f"{sorted(existing - set(owner))}"
    )
    assert not set(owner) - existing, (
        f"listed in scripts/pr_series.toml but missing: {sorted(set(owner) - existing)}"
    )
    assert [pr.number for pr in series.prs] == list(range(1, len(series.prs) + 1))
    assert all(pr.title and pr.key for pr in series.prs)


def test_the_open_references_are_exactly_what_the_code_does(series_module, series):
    actual = series_module.actual_open(series)
    listed = {(o.source, o.target) for o in series.open}
    assert all(o.seam.strip() for o in series.open), "an open reference without a seam"
    assert not actual - listed, (
        "refers to a later pull request, or to what stays here (move it, cut the "
        f"reference, or list it under [[open]] with its seam): {sorted(actual - listed)}"
    )
    assert not listed - actual, (
        f"listed as open but cut (remove from [[open]]): {sorted(listed - actual)}"
    )


def test_the_reference_reader_sees_imports_at_every_depth(series_module):
    refs = series_module.module_references()
    # a lazy import inside a function counts (tensor_path imports engine_update at the top,
    # trainer_flow imports protocol inside update_weights_distributed as well)
    assert "module:engine_update" in refs["module:tensor_path"]
    assert "module:protocol" in refs["module:trainer_flow"]
    hooks = series_module.hook_references()
    assert (
        "module:trainer_flow"
        in hooks["hook:0005-weight-sync-update-weights-distributed.patch"]
    )
    tests = series_module.test_references()
    assert "test:support/tiny_models.py" in tests["test:e2e/conftest.py"]
