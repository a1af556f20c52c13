"""The upstream series (``scripts/pr_series.toml``, written by ``make pr``) covers the change and
is ordered:

* every module of the package, hook patch of the primary base, test file and doc belongs to
  exactly one pull request, or stays in this repository; nothing listed is missing;
* an item refers only to what its own or an earlier pull request adds, except the references
  listed as open (each with the seam that removes it), and that list is exactly what the code
  does: a reference cut leaves the list, a new one fails here.
"""

import ast
from pathlib import Path

import pytest
from series_script import load_pr_series

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def series_module():
    return load_pr_series()


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
    helpers = [h for pr in series.prs for h in pr.helpers]
    assert all((ROOT / h).is_file() for h in helpers), helpers
    existing |= {f"benchmark:{series_module.helper_module(h)}" for h in helpers}
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
    # a lazy import inside a function counts, and each carries its region (tensor_path
    # imports engine_update at the top in a region of this repository's, trainer_flow
    # imports protocol inside update_weights_distributed as well)
    assert ("module:engine_update", "here") in refs["module:tensor_path"]
    assert ("module:protocol", None) in refs["module:tensor_path"]
    assert ("module:protocol", None) in refs["module:trainer_flow"]
    hooks = series_module.hook_references()
    assert ("module:trainer_flow", None) in hooks[
        "hook:0005-weight-sync-update-weights-distributed.patch"
    ]
    tests = series_module.test_references()
    assert ("test:support/tiny_models.py", None) in tests["test:e2e/conftest.py"]


# the markers spelled "@" here, so that this file has no region of its own
SAMPLE = """import a
@ pr: fp8
import b
@ pr: fp8 end
def f():
    @ pr: scale
    return 2
    @ pr: scale end
    return 1
""".replace("@", "#")


def test_regions_are_kept_from_their_pull_request_on(series_module):
    regions = series_module.regions(SAMPLE)
    assert [(r.key, r.first, r.last) for r in regions] == [
        ("fp8", 2, 4),
        ("scale", 6, 8),
    ]
    strip = series_module.strip_regions
    assert strip(SAMPLE, set()) == "import a\ndef f():\n    return 1\n"
    assert strip(SAMPLE, {"fp8"}) == "import a\nimport b\ndef f():\n    return 1\n"
    assert strip(SAMPLE, {"fp8", "scale"}) == (
        "import a\nimport b\ndef f():\n    return 2\n    return 1\n"
    )
    page = "# Page\n<!-- pr: fp8 -->\nFP8 engines.\n<!-- pr: fp8 end -->\nEnd.\n"
    assert [(r.key, r.first, r.last) for r in series_module.regions(page)] == [
        ("fp8", 2, 4)
    ]
    assert strip(page, set()) == "# Page\nEnd.\n"
    assert strip(page, {"fp8"}) == "# Page\nFP8 engines.\nEnd.\n"
    for broken, why in (
        ("@ pr: fp8\n@ pr: scale\n@ pr: scale end\n@ pr: fp8 end\n", "do not nest"),
        ("@ pr: fp8\nx = 1\n", "never ends"),
        ("x = 1\n@ pr: fp8 end\n", "closes no region"),
    ):
        with pytest.raises(ValueError, match=why):
            series_module.regions(broken.replace("@", "#"), "sample.py")


def test_every_file_parses_as_of_every_pull_request(series_module, series):
    assert not series_module.region_problems(series)
    keys = [pr.key for pr in series.prs]
    files = list(series_module.package_modules().values()) + list(
        series_module.test_files().values()
    )
    for path in files:
        text = path.read_text()
        if not series_module.regions(text, str(path)):
            continue
        for n in range(len(keys) + 1):
            stripped = series_module.strip_regions(text, set(keys[:n]), str(path))
            ast.parse(stripped, f"{path} as of pull request {n}")
