"""The sglang under test is our built wheel (0.5.23+dwu1), installed into site-packages -- not upstream, not the repo."""

import base64
import hashlib
import importlib.metadata
import sysconfig
from pathlib import Path

VERSION = "0.5.23+dwu1"
REPO_PYTHON = Path(__file__).resolve().parents[2] / "python"


def _site_dirs():
    paths = sysconfig.get_paths()
    return {Path(paths[k]).resolve() for k in ("purelib", "platlib")}


def test_version_attribute_has_local_label():
    import sglang
    import sglang.version

    assert sglang.__version__ == VERSION
    assert sglang.version.__version__ == VERSION
    assert sglang.version.__version_tuple__ == (0, 5, 23, "dwu1")


def test_distribution_metadata():
    assert importlib.metadata.version("sglang") == VERSION
    dists = [
        d for d in importlib.metadata.distributions() if d.metadata["Name"] == "sglang"
    ]
    assert len(dists) == 1, (
        f"several sglang distributions installed: {[d.version for d in dists]}"
    )


def test_weight_sync_imported_from_site_packages():
    import sglang.srt.weight_sync.planner as planner

    path = Path(planner.__file__)
    assert not path.is_symlink(), (
        f"{path} is a symlink (dev hack), not an installed file"
    )
    resolved = path.resolve()
    assert not resolved.is_relative_to(REPO_PYTHON), (
        f"{resolved} comes from the repo, not the wheel"
    )
    assert any(resolved.is_relative_to(d) for d in _site_dirs()), (
        f"{resolved} is not in site-packages"
    )


def test_record_lists_our_files():
    dist = importlib.metadata.distribution("sglang")
    files = {str(f): f for f in dist.files or ()}
    entry = files.get("sglang/srt/weight_sync/planner.py")
    assert entry is not None, "RECORD does not list sglang/srt/weight_sync/planner.py"
    assert entry.hash is not None and entry.hash.mode == "sha256"
    data = Path(entry.locate()).read_bytes()
    digest = (
        base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    )
    assert digest == entry.hash.value and len(data) == entry.size


def test_an_engine_process_does_not_load_the_trainer_end():
    """What the scheduler's and tokenizer manager's hooks import of ``remote/`` loads none
    of the trainer's modules (the package's exports resolve on first use), and the trainer's
    public names still resolve through the package."""
    import subprocess
    import sys

    from house_ends import TRAINER_END

    probe = (
        "import sys\n"
        "import sglang.srt.weight_sync.remote.engine, sglang.srt.weight_sync.remote.requests\n"
        "print(sorted(m for m in sys.modules if m.startswith('sglang.srt.weight_sync')))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    assert "sglang.srt.weight_sync.remote.engine" in loaded
    assert not [m for m in TRAINER_END if f"'sglang.srt.weight_sync.{m}'" in loaded], (
        loaded
    )

    from sglang.srt.weight_sync import remote
    from sglang.srt.weight_sync.remote.trainer import RemoteSync

    assert remote.RemoteSync is RemoteSync
