"""The upstream series as data: which pull request adds each module, hook patch, test and doc
(``scripts/pr_series.toml``), and what in the code still refers to a later one.

Read by ``scripts/make_pr.py`` (which writes the series) and ``test/unit/test_pr_series.py``
(which holds the allocation and the list of open references to the code). A reference is read
from the source: a module's imports of the package's modules (at any depth of the module, so a
lazy import counts), a hook patch's added lines that name a module, a test file's imports of
the package, of other test files, of ``benchmark`` and of ``VerlEngine``.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, List, Mapping, Optional, Set, Tuple

__all__ = [
    "HERE",
    "OpenReference",
    "PullRequest",
    "Series",
    "load_series",
]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_PREFIX = "sglang.srt.weight_sync"
PACKAGE = ROOT / "python" / "sglang" / "srt" / "weight_sync"
TESTS = ROOT / "test"
HOOKS = ROOT / "patches" / "0.5.23"
# What a test may name outside the package and other test files.
BENCHMARK = "benchmark"
VERL_ENGINE = "verl_engine"
HERE = "here"


@dataclass(frozen=True)
class PullRequest:
    """One pull request of the series: what it adds (names as in ``pr_series.toml``)."""

    number: int  # 1-based; ``HERE`` items have none
    key: str
    title: str
    hooks: Tuple[str, ...]
    modules: Tuple[str, ...]
    tests: Tuple[str, ...]
    docs: Tuple[str, ...]


@dataclass(frozen=True)
class OpenReference:
    """``source`` (a module, ``hook:<patch>`` or ``test:<file>``) refers to ``target``, which
    a later pull request adds or which stays here; ``seam`` says what removes the reference."""

    source: str
    target: str
    seam: str


@dataclass(frozen=True)
class Series:
    prs: Tuple[PullRequest, ...]
    here: PullRequest
    open: Tuple[OpenReference, ...]

    def items(self) -> List[Tuple[str, PullRequest]]:
        """Every listed item (``module:``, ``hook:``, ``test:``, ``doc:`` + name), in order."""
        return [
            (f"{kind}:{name}", pr)
            for pr in (*self.prs, self.here)
            for kind, names in (
                ("module", pr.modules),
                ("hook", pr.hooks),
                ("test", pr.tests),
                ("doc", pr.docs),
            )
            for name in names
        ]

    def owner(self) -> Dict[str, PullRequest]:
        """Every listed item -> the pull request that adds it (or ``here``)."""
        return dict(reversed(self.items()))

    def duplicates(self) -> List[str]:
        seen: Set[str] = set()
        twice = []
        for item, _ in self.items():
            if item in seen:
                twice.append(item)
            seen.add(item)
        return twice

    def rank(self, item: str) -> int:
        """The number of the PR that adds ``item``; stays-here items rank after every PR."""
        pr = self.owner()[item]
        return pr.number if pr is not self.here else len(self.prs) + 1


def load_series(path: Path = ROOT / "scripts" / "pr_series.toml") -> Series:
    data = tomllib.loads(path.read_text())

    def pr_of(number: int, entry: Mapping) -> PullRequest:
        return PullRequest(
            number,
            entry.get("key", HERE),
            entry.get("title", ""),
            tuple(entry.get("hooks", ())),
            tuple(entry.get("modules", ())),
            tuple(entry.get("tests", ())),
            tuple(entry.get("docs", ())),
        )

    prs = tuple(pr_of(i + 1, e) for i, e in enumerate(data["pr"]))
    opened = tuple(
        OpenReference(source, entry["target"], entry["seam"])
        for entry in data.get("open", ())
        for source in entry["from"]
    )
    return Series(prs, pr_of(0, data["here"]), opened)


# ---------------------------------------------------------------------------- what exists


def package_modules() -> Dict[str, Path]:
    """``engine_update``, ``derive.target_cache``, ``remote`` -> file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts == ("__init__",):
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def hook_patches() -> List[str]:
    series = (HOOKS / "series").read_text().splitlines()
    return [line.split("#")[0].strip() for line in series if line.split("#")[0].strip()]


def test_files() -> Dict[str, Path]:
    """Test files by their path under ``test/`` (``unit/test_house.py``)."""
    return {
        p.relative_to(TESTS).as_posix(): p
        for p in sorted(TESTS.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


# ---------------------------------------------------------------------------- references


def _module_imports(
    tree: ast.AST, modules: Set[str], current: Optional[str]
) -> Set[str]:
    found: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            name = node.module
            if node.level and current is not None:
                base = current.split(".")[: -node.level] if node.level else []
                name = ".".join([*base, node.module])
            elif name == PACKAGE_PREFIX:
                found |= {a.name for a in node.names if a.name in modules}
                continue
            elif name.startswith(PACKAGE_PREFIX + "."):
                name = name[len(PACKAGE_PREFIX) + 1 :]
            else:
                continue
            subs = {f"{name}.{a.name}" for a in node.names} & modules
            found |= subs or ({name} & modules)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE_PREFIX + "."):
                    name = a.name[len(PACKAGE_PREFIX) + 1 :]
                    while name and name not in modules:
                        name = name.rpartition(".")[0]
                    if name:
                        found.add(name)
    return found


def module_references() -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (``module:`` items)."""
    modules = package_modules()
    names = set(modules)
    return {
        f"module:{name}": {
            f"module:{m}"
            for m in _module_imports(ast.parse(path.read_text()), names, name)
            if m != name
        }
        for name, path in modules.items()
    }


_NAMED = re.compile(r"sglang\.srt\.weight_sync\.([a-z_][a-z_0-9.]*[a-z_0-9])")


def hook_references() -> Dict[str, Set[str]]:
    """Hook patch -> the package's modules its added lines name."""
    names = set(package_modules())
    found = {}
    for patch in hook_patches():
        refs = set()
        for line in (HOOKS / patch).read_text().splitlines():
            if not line.startswith("+") or line.startswith("+++"):
                continue
            for dotted in _NAMED.findall(line):
                while dotted and dotted not in names:
                    dotted = dotted.rpartition(".")[0]
                if dotted:
                    refs.add(f"module:{dotted}")
        found[f"hook:{patch}"] = refs
    return found


def test_references() -> Dict[str, Set[str]]:
    """Test file -> the package's modules, test files, ``benchmark`` and ``VerlEngine`` it
    imports. A test file imports another by its bare name (``test/conftest.py`` puts the
    helper folders on ``sys.path``), so a name resolves to the one file of that stem."""
    names = set(package_modules())
    files = test_files()
    by_stem: Dict[str, str] = {}
    for rel in files:
        stem = Path(rel).stem
        if stem not in ("conftest", "__init__"):
            by_stem.setdefault(stem, rel)
    by_stem["sgl_kernel"] = "support/sgl_kernel/__init__.py"
    found = {}
    for rel, path in files.items():
        tree = ast.parse(path.read_text())
        refs = {f"module:{m}" for m in _module_imports(tree, names, None)}
        for node in ast.walk(tree):
            heads = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                heads = [node.module]
            elif isinstance(node, ast.Import):
                heads = [a.name for a in node.names]
            for head in heads:
                top = head.split(".")[0]
                if top == BENCHMARK:
                    refs.add(f"{BENCHMARK}:{head}")
                elif head == "sglang.srt.entrypoints.verl_engine":
                    refs.add(f"{VERL_ENGINE}:{head}")
                elif top in by_stem and by_stem[top] != rel:
                    refs.add(f"test:{by_stem[top]}")
        found[f"test:{rel}"] = refs
    return found


def actual_open(series: Series) -> FrozenSet[Tuple[str, str]]:
    """(source, target) for every reference from an item of a PR to one of a later PR, to one
    that stays here, to ``benchmark`` or to ``VerlEngine`` (both stay here)."""
    owner = series.owner()
    rank = {item: series.rank(item) for item in owner}
    later = len(series.prs) + 1
    out = set()
    refs = {**module_references(), **hook_references(), **test_references()}
    for source, targets in refs.items():
        if source not in owner or owner[source] is series.here:
            continue
        for target in targets:
            if target.split(":")[0] in (BENCHMARK, VERL_ENGINE):
                out.add((source, target))
            elif rank.get(target, later) > rank[source]:
                out.add((source, target))
    return frozenset(out)
