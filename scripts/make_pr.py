#!/usr/bin/env python3
"""Write the change as a patch series against SGLang's own source tree: ``make pr``.

The wheel (scripts/build_wheel.py) is upstream + hook patches + our modules; upstream wants the
same change as commits on its repository. This script builds that repository's tree for the
primary base, commits the change on it one concern at a time, formats each commit with SGLang's
pre-commit tools, and writes ``git format-patch`` output to ``dist/pr/``.

Base tree (a fresh git repository under build/pr/ on every run):
  * ``SGLANG_SRC=<path>``: a git checkout of sgl-project/sglang, cloned locally and checked out
    at ``SGLANG_REF`` (default ``v<base>``); its own commit is the base.
  * otherwise the PyPI sdist of ``sglang==<base>`` (its files are the repository's ``python/``
    directory), placed under ``python/``;
  * otherwise, when PyPI has no sdist for the release (0.5.23 has none), the upstream wheel that
    build_wheel.py uses: its ``sglang/`` package is the repository's ``python/sglang/`` (compiled
    ``.so`` files and the dist-info left out). Either way it is committed as the base.

Commits on the base, in order:
  1. each hook patch of ``patches/<base>/series`` (paths ``a/python/sglang/...``, so they apply
     at the root of SGLang's tree), one commit each;
  2. our new modules: the ``sglang.srt.weight_sync`` package, then ``entrypoints/verl_engine.py``;
  3. the benchmark/simulator (``benchmark/weight_sync/``, where SGLang keeps benchmarks);
  4. the tests, under ``test/manual/weight_sync/`` with the ``test/support`` helpers they import
     (``test/registered/`` is for files that register a CI suite; ours run under pytest);
     tests of the wheel product itself (its build, pins, the verl/AReaL release pins) are left out;
  5. the docs, as Mintlify pages under ``docs/docs/advanced_features/``.

Each commit is formatted as SGLang's pre-commit does (trailing whitespace, end of file, isort,
ruff --fix with the selected rules, ruff-format; the versions of scripts/requirements-lint.txt
and the settings of .isort.cfg / ruff.toml, or the checkout's own), so the series passes it.
Codespell and any ruff finding the fixes leave are reported, not hidden.

Finally the series is verified: ``git am`` onto a second base made the same way must give the
same tree. Prints one summary line. Usage: ``python3 scripts/make_pr.py [--lint-venv .venv-lint]``.
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
from build_wheel import read_series, upstream_wheel  # noqa: E402

BASE = "0.5.23"
WORK = ROOT / "build" / "pr"
OUT = ROOT / "dist" / "pr"

# Where our files go in SGLang's tree.
TEST_DEST = "test/manual/weight_sync"
DOCS_DEST = "docs/docs/advanced_features"
# Tests of the wheel product itself, or of framework releases pinned by this repo's requirements.
TESTS_LEFT_OUT = (
    "unit/test_installed_wheel.py",
    "unit/test_wheel_pins.py",
    "e2e/test_verl_release.py",
    "e2e/test_areal_release.py",
)
# Repo-relative paths spelled in code that move with the files (from, to): the benchmarks
# name the test helpers, and a test two folders deeper finds the repository root two levels up.
PATH_REWRITES = (
    (' / "test" / "support"', ' / "test" / "manual" / "weight_sync" / "support"'),
    (' / "test" / "unit"', ' / "test" / "manual" / "weight_sync" / "unit"'),
)
TEST_REWRITES = ((".resolve().parents[2]", ".resolve().parents[4]"),)
DOCS = (
    ("docs/usage.md", "weight_sync.mdx"),
    ("docs/design.md", "weight_sync_design.mdx"),
)

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


def copy(src: Path, dest: Path, rewrites: tuple[tuple[str, str], ...] = ()) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if rewrites and src.suffix == ".py":
        text = src.read_text()
        for old, new in rewrites:
            text = text.replace(old, new)
        dest.write_text(text)
        shutil.copymode(src, dest)
    else:
        shutil.copy2(src, dest)


def our_files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.suffix not in (".pyc", ".pyo")
    )


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


def add_commits(tree: Path, tools: Tools) -> dict[str, list[str]]:
    """Commit the change on ``tree``; return, per commit subject, the findings left."""
    left: dict[str, list[str]] = {}

    def step(subject: str, body: str) -> None:
        files = changed_files(tree)
        if not files:
            die(f"commit {subject!r} would be empty")
        format_commit(tree, tools, files)
        left[subject] = on_added_lines(findings(tree, tools, files), added_lines(tree))
        commit(tree, subject, body)
        log(f"committed {subject} ({len(files)} files)")

    for patch in read_series(ROOT / "patches" / BASE):
        run(["git", "apply", "--whitespace=nowarn", str(patch)], tree)
        stem = re.sub(r"^\d+-", "", patch.stem)
        subject, body = HOOK_MESSAGES.get(
            stem, (f"[RL] {stem.replace('-', ' ')}", f"Hook patch {patch.name}.")
        )
        step(subject, body + f"\n\nHook patch {patch.name} of the weight-sync series.")

    pkg = ROOT / "python" / "sglang"
    for src in our_files(pkg / "srt" / "weight_sync"):
        copy(src, tree / "python" / "sglang" / src.relative_to(pkg))
    step(
        "[RL] sglang.srt.weight_sync: distributed weight updates",
        "Describe -> plan -> execute -> apply: each trainer rank describes its local shards,\n"
        "one planner computes every rank's transfers, the executor moves them rank to rank and\n"
        "apply writes them into the engine's parameters. No full_tensor(), no rank-0 funnel.",
    )
    rest = [p for p in our_files(pkg) if "weight_sync" not in p.relative_to(pkg).parts]
    for src in rest:
        copy(src, tree / "python" / "sglang" / src.relative_to(pkg))
    step(
        "[RL] VerlEngine: keep verl's 0.4.7 contract on the distributed path",
        "entrypoints/verl_engine.py routes update_weights_from_tensor through the distributed\n"
        "update, with the same arguments verl passes.",
    )

    for src in our_files(ROOT / "benchmark" / "weight_sync"):
        copy(
            src,
            tree
            / "benchmark"
            / "weight_sync"
            / src.relative_to(ROOT / "benchmark" / "weight_sync"),
            PATH_REWRITES,
        )
    step(
        "[RL] benchmark/weight_sync: simulator and CPU runs",
        "The simulator plans with the shipped planner and reports bytes moved per rank against\n"
        "upstream's gathered path; the CPU runs drive real engines.",
    )

    for src in our_files(ROOT / "test"):
        rel = src.relative_to(ROOT / "test").as_posix()
        if rel in TESTS_LEFT_OUT:
            continue
        copy(src, tree / TEST_DEST / rel, TEST_REWRITES)
    step(
        "[RL] Tests for distributed weight updates",
        f"Unit, distributed (gloo ranks), end-to-end (real CPU engines) and reliability tiers under\n"
        f"{TEST_DEST}/, with the helpers they import. Run from the repository root:\n"
        f"python -m pytest {TEST_DEST} -q",
    )

    for src, name in DOCS:
        dest = tree / DOCS_DEST / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / src).read_text()
        for other, other_name in DOCS:
            text = text.replace(f"`{other}`", f"`{DOCS_DEST}/{other_name}`")
        dest.write_text(mdx(text))
    step(
        "[RL] Docs: distributed weight updates",
        "How to use the distributed update from each entry point, and its design.",
    )
    return left


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
    args = ap.parse_args()
    bindir = (ROOT / args.lint_venv / "bin").resolve()
    for tool in ("isort", "ruff", "codespell"):
        if not (bindir / tool).exists():
            die(f"{bindir / tool} missing: run `make pr` (it creates {args.lint_venv})")
    select = ",".join(tomllib.loads((ROOT / "ruff.toml").read_text())["lint"]["select"])
    tools = Tools(bindir, select)

    tree = fresh(WORK / "sglang")
    source = upstream_source_tree(tree)
    base = git(tree, "rev-parse", "HEAD").strip()
    log(f"base: {source}")
    left = add_commits(tree, tools)

    fresh(OUT)
    git(
        tree,
        "format-patch",
        "-q",
        "--no-signature",
        "--zero-commit",
        "-o",
        str(OUT),
        f"{base}..HEAD",
    )
    patches = sorted(OUT.glob("*.patch"))

    check = fresh(WORK / "verify")
    upstream_source_tree(check)
    run(["git", "am", "-q", *map(str, patches)], check, env=git_env())
    same = git(check, "rev-parse", "HEAD^{tree}") == git(
        tree, "rev-parse", "HEAD^{tree}"
    )
    if not same:
        die(
            f"the series applied with git am to a fresh base gives another tree ({check})"
        )

    stat = git(tree, "diff", "--shortstat", f"{base}..HEAD").strip()
    remaining = [
        f"{subject}: {line}" for subject, lines in left.items() for line in lines
    ]
    for line in remaining:
        log(f"left for review: {line}")
    lint = (
        "pre-commit's Python checks clean"
        if not remaining
        else f"{len(remaining)} lint findings left (above)"
    )
    print(
        f"dist/pr: {len(patches)} patches on sglang {BASE} ({source}); {stat}; "
        f"git am onto a fresh base gives the same tree; {lint}"
    )


if __name__ == "__main__":
    main()
