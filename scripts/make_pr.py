#!/usr/bin/env python3
"""Write the change as a series of pull requests against SGLang's own source tree: ``make pr``.

The wheel (scripts/build_wheel.py) is upstream + hook patches + our modules; upstream wants the
same change as pull requests it can review one after another. ``scripts/pr_series.toml`` says
which pull request adds each hook patch, module, test and doc, and what stays in this
repository (release compatibility, VerlEngine, framework glue, test scaffolding, the
simulator). This script builds SGLang's tree for the primary base, commits each pull request
on it (its hook patches one commit each, then its modules, its tests, its docs), formats each
commit with SGLang's pre-commit tools, and writes ``git format-patch`` output per pull request
to ``dist/pr/<nn>-<key>/`` with its ``description.md`` (its section of docs/upstream-pr.md and
its line counts).

Base tree (a fresh git repository under build/pr/ on every run):
  * ``SGLANG_SRC=<path>``: a git checkout of sgl-project/sglang, cloned locally and checked out
    at ``SGLANG_REF`` (default ``v<base>``); its own commit is the base.
  * otherwise the PyPI sdist of ``sglang==<base>`` (its files are the repository's ``python/``
    directory), placed under ``python/``;
  * otherwise, when PyPI has no sdist for the release (0.5.23 has none), the upstream wheel that
    build_wheel.py uses: its ``sglang/`` package is the repository's ``python/sglang/`` (compiled
    ``.so`` files and the dist-info left out). Either way it is committed as the base.

Tests go under ``test/manual/weight_sync/`` (``test/registered/`` is for files that register a
CI suite; ours run under pytest), docs as Mintlify pages under ``docs/docs/advanced_features/``.
Each commit is formatted as SGLang's pre-commit does (trailing whitespace, end of file, isort,
ruff --fix with the selected rules, ruff-format; the versions of scripts/requirements-lint.txt
and the settings of .isort.cfg / ruff.toml, or the checkout's own). Codespell and any ruff
finding the fixes leave are reported, not hidden.

Verified: each pull request's patches, applied with ``git am`` onto a second base after the
previous ones, give the same tree; with ``--python`` (the repo's venv), every module of the
pull requests so far is imported from that tree alone. Prints a table, one row per pull
request. Usage: ``python3 scripts/make_pr.py [--lint-venv .venv-lint] [--python .venv/bin/python]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from build_wheel import upstream_wheel  # noqa: E402
from pr_series import (  # noqa: E402
    HOOKS,
    Series,
    helper_module,
    hook_patches,
    load_series,
    package_modules,
    strip_regions,
)

BASE = "0.5.23"
WORK = ROOT / "build" / "pr"
OUT = ROOT / "dist" / "pr"

# Where our files go in SGLang's tree.
TEST_DEST = "test/manual/weight_sync"
# Each test of a pull request's tiers is bounded as in `make test`.
TEST_TIMEOUT_S = 600
DOCS_DEST = "docs/docs/advanced_features"
# Docs the pages link to each other by (their series names: ``doc_name``).
DOC_NAMES = ("docs/usage.md", "docs/design.md", "docs/megatron.md", "docs/remote.md")
# A test two folders deeper finds the repository root two levels up.
TEST_REWRITES = ((".resolve().parents[2]", ".resolve().parents[4]"),)

# The ruff hook's file filter in SGLang's pre-commit (it also skips __init__.py).
RUFF_FILES = re.compile(
    r"^(benchmark/|docs/|examples/|python/sglang/|sgl-model-gateway/py_|test/)"
)

# Subject and body of each hook patch's commit; a patch not listed gets a generic message.
HOOK_MESSAGES = {
    "io-struct-update-weights-distributed": (
        "[RL] io_struct: UpdateWeightsDistributedReqInput/Output",
        "The request of a distributed weight update: each engine TP rank receives its own\n"
        "payload over a local channel instead of one gathered state dict from rank 0.",
    ),
    "engine-update-weights-distributed": (
        "[RL] Engine.update_weights_distributed and its tokenizer-manager hop",
        "The Engine entry point and the tokenizer manager's communicator for the new request,\n"
        "alongside update_weights_from_tensor.",
    ),
    "scheduler-update-weights-distributed": (
        "[RL] Scheduler, TP worker and model runner: apply a distributed update",
        "Dispatch the request to the weight updater, and from the TP worker to the model\n"
        "runner, which hands it to sglang.srt.weight_sync.engine_update.",
    ),
    "http-update-weights-distributed": (
        "[RL] HTTP: /update_weights_distributed",
        "The same request over HTTP, and the HTTP engine client's method for it.",
    ),
    "weight-sync-update-weights-distributed": (
        "[RL] weight_sync.utils.update_weights: deliver local shards",
        "Same contract as before; each trainer rank sends only its local shards. The gathered\n"
        "path stays as the fallback for what the distributed path cannot serve.",
    ),
    "enginebase-optional-weight-update-session": (
        "[RL] EngineBase: begin_weight_update optional for clients",
        "An update sent without an open session runs in a one-shot session.",
    ),
    "scheduler-implicit-weight-update-session": (
        "[RL] Scheduler: one-shot session for an update sent outside one",
        "Older clients (VerlEngine's 0.4.7 contract, weight_sync.utils) never open a session;\n"
        "their updates still run under the session rules.",
    ),
    "tokenizer-refuse-generation-on-mixed-weights": (
        "[RL] Tokenizer manager: refuse generation on mixed weights",
        "While a failed distributed update has left the weights mixed or unknown, generation\n"
        "requests are refused instead of answered from half-updated weights.",
    ),
    "tokenizer-bound-distributed-update-answers": (
        "[RL] Tokenizer manager: a distributed update's answer awaited at most its bound",
        "A scheduler that hangs or dies mid-update no longer leaves the caller waiting: the\n"
        "answer is awaited at most the update's own bound, and the update's one outcome is\n"
        "recorded (weight_sync.answer_guard).",
    ),
    "weight-sync-group-remote-engines": (
        "[RL] Weight-sync groups: join, update and leave for remote engines",
        "Requests, routes and dispatch for engines on other GPUs and hosts;\n"
        "weight_sync.utils.update_weights hands a group's request to the group.",
    ),
    "http-framework-routes": (
        "[RL] HTTP: the weight version, and the routes slime's build adds",
        "/weight_version answers the recorded version; /post_process_weights and /pull_weights\n"
        "answer slime's released client (nothing to do on an unquantized model; a refusal\n"
        "that names update_weights_from_disk).",
    ),
}


@dataclass(frozen=True)
class Tools:
    """The lint tools (from the lint venv) and the settings they run with in the SGLang tree."""

    bindir: Path
    ruff_select: str

    def run(
        self, tree: Path, tool: str, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess:
        return run([str(self.bindir / tool), *args], cwd=tree, check=check)


def log(msg: str) -> None:
    print(f"make_pr: {msg}", file=sys.stderr, flush=True)


def die(msg: str) -> None:
    sys.exit(f"make_pr: error: {msg}")


def run(
    cmd: list[str], cwd: Path, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if check and r.returncode != 0:
        die(f"{' '.join(cmd)} (in {cwd}) failed:\n{r.stdout}{r.stderr}")
    return r


def git_env() -> dict:
    """Author, committer and dates fixed to this repo's HEAD, so the series is reproducible."""

    def conf(key: str, default: str) -> str:
        r = run(["git", "config", key], ROOT, check=False)
        return r.stdout.strip() or default

    date = (
        run(["git", "log", "-1", "--format=%cI"], ROOT, check=False).stdout.strip()
        or "2026-01-01T00:00:00Z"
    )
    name, email = (
        conf("user.name", "weight-sync"),
        conf("user.email", "weight-sync@localhost"),
    )
    env = dict(os.environ)
    env.update(
        GIT_AUTHOR_NAME=name,
        GIT_AUTHOR_EMAIL=email,
        GIT_COMMITTER_NAME=name,
        GIT_COMMITTER_EMAIL=email,
        GIT_AUTHOR_DATE=date,
        GIT_COMMITTER_DATE=date,
    )
    return env


def git(tree: Path, *args: str, check: bool = True) -> str:
    return run(["git", *args], tree, check=check, env=git_env()).stdout


def commit(tree: Path, subject: str, body: str) -> None:
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "--no-verify", "-m", subject, "-m", body)


# ---------------------------------------------------------------------------- the base tree


def upstream_source_tree(dest: Path) -> str:
    """Fill ``dest`` with SGLang's tree at the base release; return where it came from."""
    src = os.environ.get("SGLANG_SRC")
    if src:
        ref = os.environ.get("SGLANG_REF", f"v{BASE}")
        run(["git", "clone", "-q", "--no-checkout", src, str(dest)], ROOT)
        git(dest, "checkout", "-q", "--detach", ref)
        return f"checkout {src} at {ref} ({git(dest, 'rev-parse', '--short', 'HEAD').strip()})"
    dest.mkdir(parents=True)
    python = dest / "python"
    sdist = sdist_of_base()
    if sdist is not None:
        with tarfile.open(sdist) as tar:
            tar.extractall(WORK / "sdist", filter="data")
        shutil.copytree(WORK / "sdist" / f"sglang-{BASE}", python)
        shutil.rmtree(WORK / "sdist")
        source = f"sdist {sdist.name}"
    else:
        wheel = upstream_wheel(ROOT / "build" / "upstream", BASE)
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                name = info.filename
                if (
                    not name.startswith("sglang/")
                    or name.endswith((".so", "/"))
                    or "__pycache__" in name
                ):
                    continue
                target = python / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(info))
        source = f"wheel {wheel.name} (PyPI has no sdist of sglang {BASE})"
    run(["git", "init", "-q", "-b", "main"], dest)
    commit(dest, f"SGLang {BASE}", f"Base tree: {source}.")
    return source


def sdist_of_base() -> Path | None:
    cache = ROOT / "build" / "upstream"
    found = sorted(cache.glob(f"sglang-{BASE}.tar.gz"))
    if not found:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"sglang=={BASE}",
            "-d",
            str(cache),
        ]
        if run(cmd, ROOT, check=False).returncode != 0:
            return None
        found = sorted(cache.glob(f"sglang-{BASE}.tar.gz"))
    return found[0] if found else None


# ---------------------------------------------------------------------------- formatting


def changed_files(tree: Path) -> list[str]:
    git(tree, "add", "-A")
    out = git(tree, "diff", "--cached", "--name-only", "--diff-filter=ACMR")
    return [p for p in out.splitlines() if p]


def format_commit(tree: Path, tools: Tools, files: list[str]) -> None:
    """What SGLang's pre-commit fixes on these files, in its order."""
    for rel in files:
        path = tree / rel
        data = path.read_bytes()
        if b"\0" in data:
            continue
        text = data.decode()
        lines = [line.rstrip() for line in text.splitlines()]
        fixed = "\n".join(lines).rstrip("\n") + "\n" if text.strip() else text
        if fixed != text:
            path.write_text(fixed)
        if fixed.startswith("#!"):
            path.chmod(0o755)
    py = [f for f in files if f.endswith(".py")]
    if not py:
        return
    tools.run(tree, "isort", *isort_settings(tree), *py)
    lint = [f for f in py if RUFF_FILES.match(f) and not f.endswith("__init__.py")]
    if lint:
        tools.run(
            tree,
            "ruff",
            "check",
            *ruff_config(tree),
            f"--select={tools.ruff_select}",
            "--fix",
            "--exit-zero",
            *lint,
        )
    tools.run(tree, "ruff", "format", *ruff_config(tree), *py)


def isort_settings(tree: Path) -> list[str]:
    return [] if (tree / ".isort.cfg").exists() else ["--settings-path", str(ROOT)]


def ruff_config(tree: Path) -> list[str]:
    return (
        [] if (tree / "ruff.toml").exists() else ["--config", str(ROOT / "ruff.toml")]
    )


def added_lines(tree: Path) -> dict[str, set[int]]:
    """Per file, the line numbers the staged change adds (what this commit is answerable for)."""
    added: dict[str, set[int]] = {}
    path = None
    git(tree, "add", "-A")
    for line in git(tree, "diff", "--cached", "-U0").splitlines():
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else None
        elif line.startswith("@@") and path:
            m = re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", line)
            start, count = int(m.group(1)), int(m.group(2) or 1)
            added.setdefault(path, set()).update(range(start, start + count))
    return added


def on_added_lines(found: list[str], added: dict[str, set[int]]) -> list[str]:
    """Findings that point at a line keep only those on added lines: an upstream file a hook
    patch touches already passes upstream's own checks (and its own codespell word list)."""
    kept = []
    for item in found:
        m = re.match(r"^[\w-]+: (\S+?):(\d+):", item)
        if m is None or int(m.group(2)) in added.get(m.group(1), set()):
            kept.append(item)
    return kept


def findings(tree: Path, tools: Tools, files: list[str]) -> list[str]:
    """What SGLang's pre-commit would still report on these files."""
    out = []
    py = [f for f in files if f.endswith(".py") and (tree / f).exists()]
    if py:
        r = tools.run(
            tree, "isort", "--check-only", *isort_settings(tree), *py, check=False
        )
        out += [
            f"isort: {line}"
            for line in (r.stdout + r.stderr).splitlines()
            if "ERROR" in line
        ]
        r = tools.run(
            tree, "ruff", "format", "--check", *ruff_config(tree), *py, check=False
        )
        out += [
            f"ruff-format: {line}"
            for line in r.stdout.splitlines()
            if line.startswith("Would reformat")
        ]
        lint = [f for f in py if RUFF_FILES.match(f) and not f.endswith("__init__.py")]
        if lint:
            r = tools.run(
                tree,
                "ruff",
                "check",
                *ruff_config(tree),
                f"--select={tools.ruff_select}",
                "--output-format=concise",
                *lint,
                check=False,
            )
            out += [
                f"ruff: {line}"
                for line in r.stdout.splitlines()
                if re.match(r"^\S+:\d+:\d+:", line)
            ]
    text = [f for f in files if (tree / f).exists()]
    if text:
        config = (
            []
            if (tree / ".codespellrc").exists()
            else ["--config", str(ROOT / ".codespellrc")]
        )
        r = tools.run(tree, "codespell", *config, *text, check=False)
        out += [f"codespell: {line}" for line in r.stdout.splitlines() if line.strip()]
    return out


# ---------------------------------------------------------------------------- our commits


def copy(
    src: Path,
    dest: Path,
    keep: set[str],
    rewrites: tuple[tuple[str, str], ...] = (),
) -> None:
    """``src`` as of the pull requests ``keep`` (``strip_regions``), with ``rewrites``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.suffix != ".py":
        shutil.copy2(src, dest)
        return
    text = strip_regions(src.read_text(), keep, str(src))
    for old, new in rewrites:
        text = text.replace(old, new)
    dest.write_text(text)
    shutil.copymode(src, dest)


def mdx(markdown: str) -> str:
    """A Markdown page as a Mintlify page: title into front matter; ``{``, ``}`` and ``<``
    outside code escaped, since MDX reads them as expressions and tags."""
    lines = markdown.splitlines()
    title = "Distributed weight updates"
    if lines and lines[0].startswith("# "):
        title, lines = lines[0][2:].strip(), lines[1:]
    out, fenced = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            parts = line.split("`")
            for i in range(0, len(parts), 2):
                parts[i] = re.sub(r"([{}<])", r"\\\1", parts[i])
            line = "`".join(parts)
        out.append(line)
    return f'---\ntitle: "{title}"\n---\n' + "\n".join(out).strip("\n") + "\n"


def add_series(tree: Path, tools: Tools, series: Series) -> tuple[dict, list]:
    """Commit each pull request of ``series`` on ``tree``, in order; return the findings left
    per commit subject and, per pull request, (pr, first commit's parent, its last commit)."""
    left: dict[str, list[str]] = {}
    ranges = []

    def step(subject: str, body: str) -> None:
        files = changed_files(tree)
        if not files:
            die(f"commit {subject!r} would be empty")
        format_commit(tree, tools, files)
        left[subject] = on_added_lines(findings(tree, tools, files), added_lines(tree))
        commit(tree, subject, body)
        log(f"committed {subject} ({len(files)} files)")

    order, module_files = hook_patches(), package_modules()
    pkg = ROOT / "python" / "sglang"
    keys: set[str] = set()
    modules: list[str] = []
    tests: list[str] = []
    helpers: list[str] = []
    docs: list[str] = []
    for pr in series.prs:
        start = git(tree, "rev-parse", "HEAD").strip()
        tag = f"[RL {pr.number}/{len(series.prs)}]"
        keys.add(pr.key)
        for patch in sorted(pr.hooks, key=order.index):
            run(["git", "apply", "--whitespace=nowarn", str(HOOKS / patch)], tree)
            stem = re.sub(r"^\d+-", "", Path(patch).stem)
            subject, body = HOOK_MESSAGES.get(
                stem, (f"[RL] {stem.replace('-', ' ')}", f"Hook patch {patch}.")
            )
            subject = subject.replace("[RL]", tag)
            step(subject, body + f"\n\nHook patch {patch} of the weight-sync series.")
        # the earlier pull requests' files are written again: a region this one adds shows
        # as its change to them
        modules += pr.modules
        for name in modules:
            src = module_files[name]
            copy(src, tree / "python" / "sglang" / src.relative_to(pkg), keys)
        if changed_files(tree):
            step(
                f"{tag} sglang.srt.weight_sync: {pr.key}",
                f"{pr.title}\n\nModules: "
                + (", ".join(pr.modules) or "none new")
                + ".",
            )
        tests += [t for t in pr.tests if (ROOT / "test" / t).exists()]
        helpers += pr.helpers
        # a benchmark module the tests use as a helper goes beside their helpers
        rewrites = TEST_REWRITES + tuple(
            (helper_module(h), Path(h).stem) for h in helpers
        )
        for rel in tests:
            copy(ROOT / "test" / rel, tree / TEST_DEST / rel, keys, rewrites)
        for helper in helpers:
            dest = tree / TEST_DEST / "support" / Path(helper).name
            copy(ROOT / helper, dest, keys, rewrites)
        if changed_files(tree):
            step(
                f"{tag} Tests: {pr.key}",
                f"Tests of this pull request under {TEST_DEST}/. Run from the repository "
                f"root:\npython -m pytest {TEST_DEST} -q",
            )
        # every page so far, as of this pull request: its regions of earlier pages show as
        # its change to them
        docs += pr.docs
        for src in docs:
            dest = tree / DOCS_DEST / doc_name(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            text = strip_regions((ROOT / src).read_text(), keys, src)
            for other in DOC_NAMES:
                text = text.replace(f"`{other}`", f"`{DOCS_DEST}/{doc_name(other)}`")
            dest.write_text(mdx(text))
        if changed_files(tree):
            step(
                f"{tag} Docs: {pr.key}",
                "Pages: " + (", ".join(pr.docs) or "none new") + ".",
            )
        ranges.append((pr, start, git(tree, "rev-parse", "HEAD").strip()))
        git(tree, "tag", "-f", f"pr-{pr.number}-{pr.key}")
    return left, ranges


def doc_name(src: str) -> str:
    """``docs/usage.md`` -> ``weight_sync.mdx``, ``docs/remote.md`` -> ``weight_sync_remote.mdx``."""
    stem = Path(src).stem
    return "weight_sync.mdx" if stem == "usage" else f"weight_sync_{stem}.mdx"


def descriptions() -> dict[str, str]:
    """Each pull request's description: its section of docs/upstream-pr.md (``### <key>: ...``
    under "## The series"), after the page's opening (title and summary)."""
    text = (ROOT / "docs" / "upstream-pr.md").read_text()
    opening = text.split("\n## ", 1)[0].rstrip() + "\n"
    found = {}
    for part in text.split("\n### ")[1:]:
        key, _, _ = part.partition(":")
        body = part.split("\n## ", 1)[0]
        found[key.strip()] = opening + "\n## This pull request: " + body.rstrip() + "\n"
    return found


def line_counts(tree: Path, start: str, end: str) -> dict[str, int]:
    """Lines added by ``start..end``: code (python/), tests, docs, total."""
    counts = {"code": 0, "tests": 0, "docs": 0}
    for line in git(tree, "diff", "--numstat", f"{start}..{end}").splitlines():
        added, _, path = line.split("\t", 2)
        kind = (
            "tests"
            if path.startswith("test/")
            else "docs"
            if path.startswith("docs/")
            else "code"
        )
        counts[kind] += int(added) if added.isdigit() else 0
    counts["total"] = sum(counts.values())
    return counts


def stands_alone(
    tree: Path, tag: str, modules: list[str], python: str, scaffold: Path
) -> list[str]:
    """Import every module of ``modules`` from the tree at ``tag`` (extracted under
    build/pr/at/, with the ``scaffold`` folder on the path); return what fails, one line
    per module."""
    at = fresh(WORK / "at" / tag)
    at.mkdir()
    archive = subprocess.run(
        ["git", "archive", tag, "python", "test"],
        cwd=tree,
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(at)], input=archive, check=True)
    script = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module('sglang.srt.weight_sync.' + name)\n"
        "    except Exception as e:\n"
        "        print(f'{name}: {type(e).__name__}: {e}')\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(at / "python"), str(scaffold)])
    r = subprocess.run(
        [python, "-c", script, *modules],
        capture_output=True,
        text=True,
        env=env,
        cwd=at,
    )
    return [line for line in r.stdout.splitlines() if line] + (
        [f"exit {r.returncode}: {r.stderr[-400:]}"] if r.returncode else []
    )


# The CPU test scaffolding that stays in this repository (test/support): what the series'
# tests need on the path to run here, on CPU, against a tree of the series.
SCAFFOLDING = ("sitecustomize.py", "zygote.py", "sgl_kernel")


def scaffolding() -> Path:
    """A folder with only this repository's CPU scaffolding (``SCAFFOLDING``), for the path."""
    scaffold = fresh(WORK / "scaffold")
    scaffold.mkdir()
    for name in SCAFFOLDING:
        src = ROOT / "test" / "support" / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, scaffold / name)
    return scaffold


def its_tests(
    tag: str, tiers: list[str], python: str, scaffold: Path
) -> tuple[str, bool]:
    """Run the tests of ``tiers`` that the tree at ``tag`` holds, from that tree, with the
    ``scaffold`` folder on the path (``stands_alone`` extracted the tree). Returns pytest's
    summary line (the whole output: build/pr/<tag>-tests.log) and whether they passed. Each
    test is bounded as in ``make test`` (``--timeout``), so one hang fails that test, not the
    command."""
    at = WORK / "at" / tag
    folders = [at / TEST_DEST / t for t in tiers if (at / TEST_DEST / t).is_dir()]
    if not folders:
        return "no tests of these tiers", True
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(at / "python"), str(scaffold)])
    # The scaffold's sitecustomize sends the engines' schedulers to a zygote, which only this
    # repository's ranks start early (a ``here`` region of ranks.py). Without it a TP-2
    # engine's schedulers were seen to sit idle at start until the ranks' 120 s ran out; in a
    # series' tree they spawn, as SGLang starts them.
    env["SGLANG_TEST_FRESH_SPAWN"] = "1"
    r = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--timeout={TEST_TIMEOUT_S}",
            *map(str, folders),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=at,
    )
    (WORK / f"{tag}-tests.log").write_text(r.stdout + r.stderr)
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    return (lines[-1] if lines else r.stderr[-300:]), r.returncode == 0


# ---------------------------------------------------------------------------- main


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--lint-venv",
        default=".venv-lint",
        help="venv with scripts/requirements-lint.txt",
    )
    ap.add_argument(
        "--python",
        default=None,
        help="a Python with torch and SGLang's dependencies (the repo's .venv): import each "
        "pull request's modules from its own tree",
    )
    ap.add_argument(
        "--test",
        default="",
        help="comma-separated test tiers (unit,distributed,e2e,reliability) to run from each "
        "pull request's own tree, with --python (slow: the tiers of every pull request so far)",
    )
    args = ap.parse_args()
    bindir = (ROOT / args.lint_venv / "bin").resolve()
    for tool in ("isort", "ruff", "codespell"):
        if not (bindir / tool).exists():
            die(f"{bindir / tool} missing: run `make pr` (it creates {args.lint_venv})")
    select = ",".join(tomllib.loads((ROOT / "ruff.toml").read_text())["lint"]["select"])
    tools = Tools(bindir, select)
    series = load_series()
    texts = descriptions()
    missing = [pr.key for pr in series.prs if pr.key not in texts]
    if missing:
        die(f"docs/upstream-pr.md has no '### <key>:' section for {missing}")

    tree = fresh(WORK / "sglang")
    source = upstream_source_tree(tree)
    log(f"base: {source}")
    left, ranges = add_series(tree, tools, series)

    fresh(OUT)
    check = fresh(WORK / "verify")
    upstream_source_tree(check)
    rows, done, failed = [], [], []
    owner = series.owner()
    python = os.path.abspath(ROOT / args.python) if args.python else None
    scaffold = scaffolding() if python else None
    for pr, start, end in ranges:
        folder = OUT / f"{pr.number:02d}-{pr.key}"
        git(
            tree,
            "format-patch",
            "-q",
            "--no-signature",
            "--zero-commit",
            "-o",
            str(folder),
            f"{start}..{end}",
        )
        patches = sorted(folder.glob("*.patch"))
        run(["git", "am", "-q", *map(str, patches)], check, env=git_env())
        if git(check, "rev-parse", "HEAD^{tree}") != git(
            tree, "rev-parse", f"{end}^{{tree}}"
        ):
            die(
                f"pull request {pr.number} applied with git am gives another tree ({check})"
            )
        done += pr.modules
        counts = line_counts(tree, start, end)
        opened = sorted(
            {
                f"{o.source} -> {o.target}"
                for o in series.open
                if owner.get(o.source) is pr
            }
        )
        tag = f"pr-{pr.number}-{pr.key}"
        alone = stands_alone(tree, tag, done, python, scaffold) if python else None
        tested, passed = (
            its_tests(tag, args.test.split(","), python, scaffold)
            if python and args.test
            else (None, True)
        )
        if alone or not passed:
            failed.append(pr.key)
        (folder / "description.md").write_text(
            texts[pr.key]
            + f"\n---\n*Written by `make pr`:* {len(patches)} commits; lines added: "
            + ", ".join(f"{k} {v:,}" for k, v in counts.items())
            + ".\n"
            + (
                "\nStill refers to later pull requests or to this repository (each with "
                "its seam in scripts/pr_series.toml):\n\n"
                + "".join(f"* `{o}`\n" for o in opened)
                if opened
                else ""
            )
        )
        rows.append((pr, len(patches), counts, opened, alone, tested))

    remaining = [
        f"{subject}: {line}" for subject, lines in left.items() for line in lines
    ]
    for line in remaining:
        log(f"left for review: {line}")
    print(
        f"dist/pr: {len(ranges)} pull requests on sglang {BASE} ({source}); each applies "
        f"with git am on the previous"
    )
    print(
        "| # | pull request | commits | code | tests | docs | total | open references | "
        "imports alone | its tests, from its tree |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pr, n, counts, opened, alone, tested in rows:
        alone_text = (
            "not checked"
            if alone is None
            else ("yes" if not alone else f"no: {len(alone)}")
        )
        print(
            f"| {pr.number} | {pr.key} | {n} | {counts['code']:,} | {counts['tests']:,} | "
            f"{counts['docs']:,} | {counts['total']:,} | {len(opened)} | {alone_text} | "
            + ("not run" if tested is None else tested)
            + " |"
        )
        causes: dict[str, list[str]] = {}
        for line in alone or ():
            name, _, why = line.partition(": ")
            causes.setdefault(why, []).append(name)
        for why, names in causes.items():
            log(
                f"pull request {pr.number} ({pr.key}): {why} (importing {', '.join(names)})"
            )
    print(
        "pre-commit's Python checks clean"
        if not remaining
        else f"{len(remaining)} lint findings left (above)"
    )
    if failed:
        die(
            f"pull requests {failed}: a module does not import from its own tree, or its "
            f"tests failed there (build/pr/*-tests.log)"
        )


if __name__ == "__main__":
    main()
