"""The GPU tier: real SGLang engines on one CUDA device, run by ``scripts/gpu_run.sh``.

Every test here needs a CUDA device and the environment ``scripts/gpu_run.sh`` sets:
``SGLANG_TEST_GPU=1`` (so ``test/conftest.py`` leaves the CPU engine environment unset and
SGLang takes its CUDA branches), the pure-torch ``sgl_kernel`` stand-in
(``test/support/sgl_kernel``) and the import-only ``flashinfer`` one (``test/gpu/support``) on
``PYTHONPATH``, SGLang's sgl-kernel version check and flashinfer detection off. On
any other machine each test is skipped with the reason printed (``make test-gpu`` on CPU).
Tests that need two or more GPUs say so and carry the ``torchrun`` line that runs them.

A lent GPU machine's command can be stopped at its time limit, before pytest's summary: each
failure's report is written to stderr as soon as the test fails.
"""

import sys
from pathlib import Path

import pytest
from gpu_engines import ON_CPU, gpu_skip_reason


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if Path(str(item.fspath)).resolve().parent != here:
            continue
        if ON_CPU and item.get_closest_marker("cpu_rehearsal"):
            continue  # rehearsed on CPU ranks (test/e2e/test_multi_gpu_rehearsal.py)
        needs = item.get_closest_marker("gpus")
        reason = gpu_skip_reason(needs.args[0] if needs else 1)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report):
    if report.failed:
        sys.stderr.write(
            f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext}\n"
        )
        sys.stderr.flush()
