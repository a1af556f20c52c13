"""The upstream series as data: which pull request adds each module, hook patch, test and doc
(``scripts/pr_series.toml``), and what in the code still refers to a later one.

Read by ``scripts/make_pr.py`` (which writes the series) and ``test/unit/test_pr_series.py``
(which holds the allocation and the list of open references to the code). A reference is read
from the source: a module's imports of the package's modules (at any depth of the module, so a
lazy import counts), a hook patch's added lines that name a module, a test file's imports of
the package, of other test files, of ``benchmark`` and of ``VerlEngine``.

A file of one pull request may carry lines that a later one adds: a region between
``# pr: <key>`` and ``# pr: <key> end`` (whole lines, never nested; in Markdown
``<!-- pr: <key> -->`` and ``<!-- pr: <key> end -->``) belongs to pull request
``<key>``; a region ``here`` is lines only this repository has (its test scaffolding), in
no pull request. ``strip_regions`` writes the file as of a pull request (the marker lines
always dropped), and a reference inside a region counts as the region's pull request's.
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
    "Region",
    "Series",
    "load_series",
    "module_imports",
    "regions",
    "strip_regions",
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

    number: int  # 1-based; what stays here numbers after every pull request
    key: str
    title: str
    hooks: Tuple[str, ...]
    modules: Tuple[str, ...]
    tests: Tuple[str, ...]
    docs: Tuple[str, ...]
    # benchmark modules its tests use as helpers (repo-relative); they go in with the tests
    helpers: Tuple[str, ...] = ()


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
                (BENCHMARK, tuple(helper_module(h) for h in pr.helpers)),
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

    def numbers(self) -> Dict[str, int]:
        """Pull request key (and ``here``) -> its number."""
        return {pr.key: pr.number for pr in (*self.prs, self.here)}


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
            tuple(entry.get("helpers", ())),
        )

    prs = tuple(pr_of(i + 1, e) for i, e in enumerate(data["pr"]))
    opened = tuple(
        OpenReference(source, entry["target"], entry["seam"])
        for entry in data.get("open", ())
        for source in entry["from"]
    )
    return Series(prs, pr_of(len(prs) + 1, data["here"]), opened)


# ---------------------------------------------------------------------------- what exists


def helper_module(path: str) -> str:
    """``benchmark/weight_sync/hand_rules.py`` -> ``benchmark.weight_sync.hand_rules``."""
    return str(Path(path).with_suffix("")).replace("/", ".")


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


@dataclass(frozen=True)
class Region:
    """Lines ``first``..``last`` (1-based, marker lines included) that pull request ``key`` adds."""

    key: str
    first: int
    last: int


# a marker line: ``# pr: <key>`` / ``# pr: <key> end`` in Python, ``<!-- pr: <key> -->`` /
# ``<!-- pr: <key> end -->`` in Markdown
_BEGIN = re.compile(r"^\s*(?:# pr: ([a-z0-9_]+)|<!-- pr: ([a-z0-9_]+) -->)$")
_END = re.compile(r"^\s*(?:# pr: ([a-z0-9_]+) end|<!-- pr: ([a-z0-9_]+) end -->)$")


def _key(match: Optional[re.Match]) -> Optional[str]:
    return None if match is None else match.group(1) or match.group(2)


def regions(text: str, where: str = "") -> List[Region]:
    """The marked regions of ``text``; unbalanced or nested markers raise naming the line."""
    found, open_at = [], None
    for number, line in enumerate(text.splitlines(), 1):
        begin, end = _key(_BEGIN.match(line)), _key(_END.match(line))
        if begin:
            if open_at is not None:
                raise ValueError(
                    f"{where}:{number}: 'pr: {begin}' inside the region of "
                    f"line {open_at[1]} (regions do not nest)"
                )
            open_at = (begin, number)
        elif end:
            if open_at is None or open_at[0] != end:
                raise ValueError(
                    f"{where}:{number}: 'pr: {end} end' closes no region of that key"
                )
            found.append(Region(open_at[0], open_at[1], number))
            open_at = None
    if open_at is not None:
        raise ValueError(f"{where}:{open_at[1]}: region '{open_at[0]}' never ends")
    return found


def strip_regions(text: str, keep: Set[str], where: str = "") -> str:
    """``text`` as of the pull requests ``keep`` (keys): regions of other keys removed, every
    marker line removed. An ``# isort: split`` right before a region (which keeps isort from
    moving imports across its markers) goes with the markers."""
    drop: Set[int] = set()
    lines = text.splitlines(keepends=True)
    for region in regions(text, where):
        drop |= {region.first, region.last}
        if region.first > 1 and lines[region.first - 2].strip() == "# isort: split":
            drop.add(region.first - 1)
        if region.key not in keep:
            drop |= set(range(region.first, region.last + 1))
    return "".join(line for i, line in enumerate(lines, 1) if i not in drop)


def _region_of(line: int, marked: List[Region]) -> Optional[str]:
    return next((r.key for r in marked if r.first <= line <= r.last), None)


def _known(dotted: str, modules: Set[str]) -> str:
    """The longest prefix of ``dotted`` that is one of ``modules`` ("" when none is):
    ``engine_update.EngineWeightSync`` is ``engine_update``."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted


def module_imports(tree: ast.AST, modules: Set[str]) -> Set[Tuple[str, int]]:
    """(module, line) for each import of the package's ``modules`` in ``tree``: ``from
    ...weight_sync.remote import engine`` imports ``remote.engine`` and, as Python runs it
    first, ``remote`` (test_house.py reads the import graph through this too)."""
    found: Set[Tuple[str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            name = node.module
            if name == PACKAGE_PREFIX:
                found |= {
                    (a.name, node.lineno) for a in node.names if a.name in modules
                }
                continue
            if not name.startswith(PACKAGE_PREFIX + "."):
                continue
            name = name[len(PACKAGE_PREFIX) + 1 :]
            subs = {f"{name}.{a.name}" for a in node.names} & modules
            found |= {(m, node.lineno) for m in subs | ({name} & modules)}
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE_PREFIX + "."):
                    name = _known(a.name[len(PACKAGE_PREFIX) + 1 :], modules)
                    if name:
                        found.add((name, node.lineno))
    return found


Reference = Tuple[str, Optional[str]]  # (target item, the region's key or None)


def module_references() -> Dict[str, Set[Reference]]:
    """Module -> the package's modules it imports (``module:`` items), each with the key of
    the region it sits in."""
    modules = package_modules()
    names = set(modules)
    out = {}
    for name, path in modules.items():
        text = path.read_text()
        marked = regions(text, str(path))
        out[f"module:{name}"] = {
            (f"module:{m}", _region_of(line, marked))
            for m, line in module_imports(ast.parse(text), names)
            if m != name
        }
    return out


_NAMED = re.compile(r"sglang\.srt\.weight_sync\.([a-z_][a-z_0-9.]*[a-z_0-9])")


def hook_references() -> Dict[str, Set[Reference]]:
    """Hook patch -> the package's modules its added lines name."""
    names = set(package_modules())
    found = {}
    for patch in hook_patches():
        refs = set()
        for line in (HOOKS / patch).read_text().splitlines():
            if not line.startswith("+") or line.startswith("+++"):
                continue
            for dotted in _NAMED.findall(line):
                name = _known(dotted, names)
                if name:
                    refs.add((f"module:{name}", None))
        found[f"hook:{patch}"] = refs
    return found


def test_references() -> Dict[str, Set[Reference]]:
    """Test file -> the package's modules, test files, ``benchmark`` and ``VerlEngine`` it
    imports, each with the key of the region it sits in. A test file imports another by its
    bare name (``test/conftest.py`` puts the helper folders on ``sys.path``), so a name
    resolves to the one file of that stem."""
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
        text = path.read_text()
        marked = regions(text, str(path))
        tree = ast.parse(text)
        refs = {
            (f"module:{m}", _region_of(line, marked))
            for m, line in module_imports(tree, names)
        }
        for node in ast.walk(tree):
            heads = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                heads = [node.module]
            elif isinstance(node, ast.Import):
                heads = [a.name for a in node.names]
            key = _region_of(getattr(node, "lineno", 0), marked)
            for head in heads:
                top = head.split(".")[0]
                if top == BENCHMARK:
                    refs.add((f"{BENCHMARK}:{head}", key))
                elif head == "sglang.srt.entrypoints.verl_engine":
                    refs.add((f"{VERL_ENGINE}:{head}", key))
                elif top in by_stem and by_stem[top] != rel:
                    refs.add((f"test:{by_stem[top]}", key))
        found[f"test:{rel}"] = refs
    return found


def actual_open(series: Series) -> FrozenSet[Tuple[str, str]]:
    """(source, target) for every reference from an item of a pull request (or from a region
    of a later one in it) to what a later pull request adds, or to what stays here
    (``benchmark`` and ``VerlEngine`` too)."""
    owner, number = series.owner(), series.numbers()
    out = set()
    refs = {**module_references(), **hook_references(), **test_references()}
    for source, targets in refs.items():
        if source not in owner or owner[source] is series.here:
            continue
        for target, key in targets:
            at = number[key] if key is not None else owner[source].number
            if owner.get(target, series.here).number > at:
                out.add((source, target))
    return frozenset(out)


def region_problems(series: Series) -> List[str]:
    """Regions that name no pull request of the series, or one not after their file's own."""
    owner, number = series.owner(), series.numbers()
    files = {f"module:{m}": p for m, p in package_modules().items()}
    files.update({f"test:{t}": p for t, p in test_files().items()})
    files.update({f"doc:{d}": ROOT / d for pr in series.prs for d in pr.docs})
    problems = []
    for item, path in files.items():
        if item not in owner:
            continue
        for region in regions(path.read_text(), str(path)):
            if region.key == HERE:
                continue
            if region.key not in number:
                problems.append(
                    f"{path}:{region.first}: no pull request {region.key!r}"
                )
            elif number[region.key] <= owner[item].number:
                problems.append(
                    f"{path}:{region.first}: region {region.key!r} in a file that pull "
                    f"request {owner[item].number} already adds whole"
                )
    return problems
