#!/usr/bin/env python3
"""Build the drop-in sglang wheels: for each SGLang base release, upstream <base> + patches/<base>/series +
python/sglang/ + local version label, e.g. sglang-0.5.12+dwu1 (pip's ``sglang==0.5.12`` pin selects it).

Stdlib only; never imports sglang. Upstream wheels may be platform specific (cpXY-cpXY-manylinux_2_34_<arch>),
so they are fetched for the interpreter running this script: run it with the Python of the target environment.

Steps per base:
  1. fetch sglang==<base> into build/upstream/ (reused when a wheel for this interpreter is already there);
  2. unpack it into build/wheel-<base>/ (wiped first);
  3. apply patches/<base>/series in order with `patch -p2 --forward --batch --fuzz=0` (paths a/python/sglang/...);
  4. copy python/sglang/** to sglang/** -- new files only, an upstream file changes only through a patch;
  5. set the version to <base>+<label> (sglang/_version.py, dist-info dir name, METADATA);
  6. regenerate RECORD and write dist/sglang-<base>+<label>-<upstream tags>.whl deterministically.
"""

from __future__ import annotations

import argparse
import ast
import base64
import csv
import glob
import hashlib
import io
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# The primary base (the upstream PR's) first; the others are the releases RL frameworks pin.
BASES = ("0.5.23", "0.5.15.post1", "0.5.12", "0.5.10.post1")
ROOT = Path(__file__).resolve().parent.parent
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed timestamp for a reproducible zip


def die(msg: str) -> None:
    sys.exit(f"build_wheel: error: {msg}")


def log(msg: str) -> None:
    print(f"build_wheel: {msg}", file=sys.stderr, flush=True)


def upstream_wheel(cache: Path, base: str) -> Path:
    """Return the cached upstream wheel of ``base`` for this interpreter, downloading it if needed."""
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    pattern = str(cache / f"sglang-{base}-*.whl")

    def find() -> list[Path]:
        found = []
        for p in sorted(glob.glob(pattern)):
            tags = Path(p).name[: -len(".whl")].split("-")[2:]
            pytag, _abi, plat = tags[-3:]
            if pytag in (py, "py3") and (
                plat == "any" or plat.endswith(platform.machine())
            ):
                found.append(Path(p))
        return found

    if not find():
        cache.mkdir(parents=True, exist_ok=True)
        log(f"downloading sglang=={base} into {cache}")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            f"sglang=={base}",
            "-d",
            str(cache),
        ]
        if subprocess.run(cmd).returncode != 0:
            die("pip download of the upstream wheel failed: " + " ".join(cmd))
    found = find()
    if len(found) != 1:
        die(
            f"expected exactly one upstream wheel for {py}/{platform.machine()} in {cache}, found {found}"
        )
    return found[0]


def read_series(patches: Path) -> list[Path]:
    series = patches / "series"
    if not series.exists():
        return []
    names = []
    for line in series.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    out = []
    for name in names:
        p = patches / name
        if not p.is_file():
            die(f"{series.relative_to(ROOT)} lists {name!r} but {p} does not exist")
        out.append(p)
    return out


def apply_patches(tree: Path, series: list[Path], base: str) -> None:
    if series and shutil.which("patch") is None:
        die("GNU patch is required to apply patches/series")
    for p in series:
        base = [
            "patch",
            "-p2",
            "--forward",
            "--batch",
            "--fuzz=0",
            "--no-backup-if-mismatch",
            "--reject-file=-",
            "-i",
            str(p),
        ]
        # Dry run first so a failing patch leaves the tree untouched and the message is clear.
        for extra in (["--dry-run"], []):
            r = subprocess.run(base + extra, cwd=tree, capture_output=True, text=True)
            if r.returncode != 0:
                die(
                    f"patch {p.relative_to(ROOT)} does not apply cleanly to sglang {base}:\n"
                    f"{r.stdout}{r.stderr}"
                )
        log(f"applied {p.relative_to(ROOT)}")


def copy_sources(src: Path, tree: Path) -> list[str]:
    """Copy our files into the unpacked wheel; they must all be new (upstream changes go through patches)."""
    added = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(filenames):
            if fn.endswith((".pyc", ".pyo")):
                continue
            s = Path(dirpath, fn)
            rel = "sglang/" + s.relative_to(src).as_posix()
            d = tree / rel
            if d.exists() or d.is_symlink():
                die(
                    f"{s.relative_to(ROOT)} would overwrite {rel} which exists in the upstream wheel "
                    f"(or is created by a patch); change upstream files only through patches/"
                )
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(s, d)  # follows symlinks: the wheel gets the content
            added.append(rel)
    return added


def set_version(tree: Path, old_info: str, version: str, label: str) -> str:
    # sglang/version.py re-exports sglang/_version.py (setuptools-scm output); only the latter holds the string.
    vfile = tree / "sglang/_version.py"
    text = vfile.read_text()
    old_tuple = re.search(
        r"^__version_tuple__ = version_tuple = (.*)$", text, flags=re.M
    )
    if old_tuple is None:
        die(f"no version tuple in {vfile.relative_to(tree)}")
    new_tuple = (
        *ast.literal_eval(old_tuple.group(1)),
        label,
    )  # e.g. (0, 5, 10, 'post1', 'dwu1')
    new, n1 = re.subn(
        r"^__version__ = version = .*$",
        f"__version__ = version = {version!r}",
        text,
        flags=re.M,
    )
    new, n2 = re.subn(
        r"^__version_tuple__ = version_tuple = .*$",
        f"__version_tuple__ = version_tuple = {new_tuple!r}",
        new,
        flags=re.M,
    )
    if (n1, n2) != (1, 1):
        die(f"unexpected layout of {vfile.relative_to(tree)}; cannot set the version")
    vfile.write_text(new)

    new_info = f"sglang-{version}.dist-info"
    (tree / old_info).rename(tree / new_info)
    meta = tree / new_info / "METADATA"
    head, sep, body = meta.read_text().partition(
        "\n\n"
    )  # headers end at the first blank line
    head, n = re.subn(
        r"^Version: .*$", f"Version: {version}", head, count=1, flags=re.M
    )
    if n != 1:
        die("no Version: header in METADATA")
    meta.write_text(head + sep + body)
    return new_info


def wheel_tags(tree: Path, info: str) -> str:
    tags = [
        ln.split(":", 1)[1].strip()
        for ln in (tree / info / "WHEEL").read_text().splitlines()
        if ln.startswith("Tag:")
    ]
    if len(tags) != 1:
        die(f"expected one Tag: in WHEEL, found {tags}")
    return tags[0]


def record_hash(data: bytes) -> str:
    return (
        "sha256="
        + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    )


def write_wheel(tree: Path, info: str, out: Path, modes: dict[str, int]) -> None:
    files = sorted(
        p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()
    )
    record = f"{info}/RECORD"
    files = [f for f in files if f != record]
    # Package files first, dist-info last, RECORD at the very end (as wheel builders do).
    files.sort(key=lambda f: (f.startswith(info + "/"), f))
    rows = []
    tmp = out.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:

        def add(name: str, data: bytes) -> None:
            zi = zipfile.ZipInfo(name, ZIP_DATE)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = (0o100000 | modes.get(name, 0o644)) << 16
            z.writestr(zi, data)

        for f in files:
            data = (tree / f).read_bytes()
            rows.append((f, record_hash(data), str(len(data))))
            add(f, data)
        rows.append((record, "", ""))
        buf = (
            io.StringIO()
        )  # RECORD is CSV: some upstream file names contain commas and must be quoted
        csv.writer(buf, lineterminator="\n").writerows(rows)
        add(record, buf.getvalue().encode())
    tmp.replace(out)


def build(base: str, label: str, build_dir: Path, dist_dir: Path) -> Path:
    """Build dist/sglang-<base>+<label>-<tags>.whl; returns its path."""
    version = f"{base}+{label}"
    series = read_series(ROOT / "patches" / base)
    if not series:
        die(f"patches/{base}/series lists no patches")
    src_whl = upstream_wheel(build_dir / "upstream", base)
    tree = build_dir / f"wheel-{base}"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    with zipfile.ZipFile(src_whl) as z:
        z.extractall(tree)
        modes = {
            i.filename: (i.external_attr >> 16) & 0o777
            for i in z.infolist()
            if not i.is_dir()
        }
    old_info = f"sglang-{base}.dist-info"
    if not (tree / old_info).is_dir():
        die(f"{src_whl.name} has no {old_info}")
    log(f"unpacked {src_whl.name}")

    apply_patches(tree, series, base)
    added = copy_sources(ROOT / "python" / "sglang", tree)
    log(f"added {len(added)} files from python/sglang/")
    info = set_version(tree, old_info, version, label)
    modes = {
        (info + k[len(old_info) :] if k.startswith(old_info + "/") else k): v
        for k, v in modes.items()
    }

    dist_dir.mkdir(parents=True, exist_ok=True)
    # one wheel per base in dist/, so `pip install dist/sglang-<base>+*.whl` is unambiguous
    for old in dist_dir.glob(f"sglang-{base}+*.whl"):
        old.unlink()
    out = dist_dir / f"sglang-{version}-{wheel_tags(tree, info)}.whl"
    write_wheel(tree, info, out, modes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--label", default="dwu1", help="local version label (default: dwu1)"
    )
    ap.add_argument(
        "--base",
        action="append",
        choices=BASES,
        help="SGLang release to build on (repeatable; default: all of "
        + ", ".join(BASES)
        + ")",
    )
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build")
    ap.add_argument("--dist-dir", type=Path, default=ROOT / "dist")
    args = ap.parse_args()
    if not re.fullmatch(r"[a-z0-9]+(\.[a-z0-9]+)*", args.label):
        die(
            f"invalid local version label {args.label!r} (lower-case alphanumerics and dots)"
        )
    for base in args.base or BASES:
        print(build(base, args.label, args.build_dir, args.dist_dir))


if __name__ == "__main__":
    main()
