"""Each built wheel installs by the pin of the framework that uses its base: pip resolves
``sglang==0.5.12`` (verl 0.9.x), ``sglang==0.5.10.post1`` (AReaL 1.0.x), ``sglang==0.5.15.post1``
(slime) and ``sglang==0.5.23`` to our ``+dwu1`` wheel, also when upstream's wheel of that release
is offered beside it (PEP 440: a local version matches ``==`` of its public version and sorts
after it).

Dry runs of pip into nothing (``--dry-run --report``), against ``dist/`` as ``make wheel`` left it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIST, UPSTREAM = ROOT / "dist", ROOT / "build" / "upstream"
BASES = ("0.5.23", "0.5.15.post1", "0.5.12", "0.5.10.post1")


def resolve(requirement: str, *find_links: Path) -> list:
    """The (name, version) pairs pip would install for ``requirement`` from ``find_links`` only."""
    links = [arg for d in find_links for arg in ("--find-links", str(d))]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            "-",
            "--no-deps",
            "--ignore-installed",
            "--no-index",
            "--isolated",
            *links,
            requirement,
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, f"pip cannot resolve {requirement!r}: {out.stderr}"
    return [
        (i["metadata"]["name"], i["metadata"]["version"])
        for i in json.loads(out.stdout)["install"]
    ]


def test_make_wheel_built_one_wheel_per_base():
    names = sorted(p.name for p in DIST.glob("sglang-*.whl"))
    assert [n.split("-")[1] for n in names] == sorted(f"{b}+dwu1" for b in BASES), names


@pytest.mark.parametrize("base", BASES)
def test_framework_pin_resolves_to_our_wheel(base):
    assert resolve(f"sglang=={base}", DIST) == [("sglang", f"{base}+dwu1")]


@pytest.mark.parametrize("base", BASES)
def test_our_wheel_wins_over_upstream_release(base):
    if not list(UPSTREAM.glob(f"sglang-{base}-*.whl")):
        pytest.fail(
            f"no upstream sglang {base} wheel in {UPSTREAM}: `make wheel` downloads it"
        )
    assert resolve(f"sglang=={base}", UPSTREAM, DIST) == [("sglang", f"{base}+dwu1")]


def test_other_bases_are_not_picked_by_a_pin():
    """``sglang==0.5.12`` must not fall back to another base's wheel, nor ``>=`` to an older one."""
    assert resolve("sglang>=0.5.12,<0.5.15", DIST) == [("sglang", "0.5.12+dwu1")]
    assert resolve("sglang>=0.5.12,<0.5.23", DIST) == [("sglang", "0.5.15.post1+dwu1")]
    assert resolve("sglang>=0.5.15,<0.5.16", DIST) == [("sglang", "0.5.15.post1+dwu1")]
    assert resolve("sglang", DIST) == [("sglang", "0.5.23+dwu1")]
