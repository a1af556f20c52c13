"""One GPU: a data-plane wait that runs out on NCCL leaves the process alive and serving.

The scenario runs in a child process (``test/gpu/support/nccl_timeout_proof.py``, whose
docstring says what it does), since what is checked is that the process survives NCCL's
watchdog: its dump delay and its heartbeat monitor's timeout are shortened through their
environment variables so that both have passed within about half a minute, with the
watchdog's default error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` unset: 3, teardown)
for every group the data plane does not make. Pass or fail is decided after both delays.

The contrast, the wait the data plane used before (``work.wait(timeout=...)`` on a plain
group), is expected to end its process: if it does not on this torch, the premise of the
design (docs/gpu.md) is wrong there and the test says so.

Run by ``scripts/gpu_lease.sh`` ahead of the benchmark; on a machine without a GPU it is
skipped with the reason (the polled path itself is shown on CPU by
``test/distributed/test_polled_wait.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROOF = Path(__file__).resolve().parent / "support" / "nccl_timeout_proof.py"
WATCHDOG_ENV = {
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "2000",  # the watchdog's dump delay: 4 x 2 s
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "10",  # the heartbeat monitor's timeout
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # the job's groups signal dumps, as by default
}


def _run(tmp_path, *flags: str):
    out = tmp_path / f"proof{''.join(flags).replace('-', '_')}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NCCL_")}
    env.update(WATCHDOG_ENV)
    proc = subprocess.run(
        [sys.executable, str(PROOF), str(out), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    result = json.loads(out.read_text()) if out.exists() else {}
    return proc, result


def test_a_timed_out_nccl_wait_leaves_the_process_alive_and_the_next_update_works(
    tmp_path,
):
    proc, r = _run(tmp_path)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, (proc.returncode, r, tail)
    assert r["first"].startswith("PeerLost: proof: the held-back collective"), r
    assert "within 2s" in r["first"], r
    # the abort may wait for the held-back kernels (freeing a communicator's device memory
    # can synchronize the device): at most the sleep's length more
    assert 2.0 <= r["raised_after_s"] < 2.0 + 8.0 + 5.0, r
    assert r["abandoned"] and r["destroyed"], r
    assert r["alive_after_s"] >= 15.0, "past the dump delay and the heartbeat timeout"
    assert r["serving"] and r["renewed"] and r["done"], r


def test_the_wait_used_before_ends_the_process(tmp_path):
    """The contrast: ``work.wait(timeout=...)`` on a group made with the job's settings."""
    proc, r = _run(tmp_path, "--old")
    tail = (proc.stdout + proc.stderr)[-4000:]
    if proc.returncode == 0:
        pytest.fail(
            "the old wait did not end the process on this torch: the teardown the data "
            f"plane avoids did not happen here ({r}); {tail}"
        )
    assert not r.get("done"), r
