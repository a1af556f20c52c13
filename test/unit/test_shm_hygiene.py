"""The suite's /dev/shm hygiene (``test/support/engine.py``): a file whose creator was killed
is removed even while the creator is a zombie, and a file a live process holds is kept."""

import os
import time
import uuid
from pathlib import Path

import pytest
from engine import SHM_DIR, _pid_alive, _shm_entries, cleanup_shm

pytestmark = pytest.mark.skipif(
    not SHM_DIR.is_dir(), reason="no /dev/shm on this machine"
)


def _zombie() -> int:
    """A child that has exited and that this process has not reaped yet."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            return pid
        time.sleep(0.01)
    raise AssertionError(f"child {pid} did not exit within 10 s")


def test_a_zombie_is_not_alive():
    pid = _zombie()
    try:
        assert os.kill(pid, 0) is None  # the kernel still has it ...
        assert not _pid_alive(pid)  # ... but it holds no file any more
    finally:
        os.waitpid(pid, 0)
    assert not _pid_alive(pid)
    assert _pid_alive(os.getpid())


def test_files_of_a_zombie_creator_are_removed_and_held_ones_kept():
    before, started = _shm_entries(), time.time()
    pid = _zombie()
    tag = uuid.uuid4().hex[:8]
    orphan = SHM_DIR / f"sgl_shm_mq_{pid}_{tag}"
    held = SHM_DIR / f"sgl_shm_mq_{os.getppid()}_{tag}"  # a live creator other than us
    try:
        orphan.write_bytes(b"x")
        held.write_bytes(b"x")
        removed = cleanup_shm(before, started)
        assert orphan.name in removed and not orphan.exists()
        assert held.name not in removed and held.exists()
    finally:
        os.waitpid(pid, 0)
        for path in (orphan, held):
            path.unlink(missing_ok=True)
