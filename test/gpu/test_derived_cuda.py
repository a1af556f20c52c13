"""Derived targets on SGLang's CUDA branch equal its real load on the GPU (every architecture
of ``test/support/derived_cases.py``).

The same cases and checks as ``test/unit/test_derived_targets.py`` (which runs the generic
and CPU branches on this machine's CPU; both take them from ``test/support/derived_cases.py``),
in a third platform mode, ``cuda`` (``test/support/sglang_fakes.py``): SGLang's ``is_cuda()``
is true in the worker, the real load builds each model on the GPU and runs the loaders' and
post-load processing's CUDA branches, and the derivation runs on meta under the same branches.
Every parameter SGLang loads must equal what the derived targets place, element by element
(index-encoded checkpoints: each element names its source), not only in shape.
"""

from __future__ import annotations

import derived_cases as derived
import pytest
import sglang_fakes

MODE = "cuda"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    base = tmp_path_factory.mktemp("derived_cuda")
    job = {
        "mode": MODE,
        "workdir": str(base / MODE),
        "derive": True,
        "configs": {a: derived.ARCHS[a][0] for a in derived.ARCHS},
        "cases": [list(c) for c in derived.CASES],
    }
    result = sglang_fakes.run_job_in_worker(job, base, MODE)
    assert result["platform"]["is_cuda"], result["platform"]
    return {MODE: result}


@pytest.mark.parametrize("case", derived.CASES, ids=[c[0] for c in derived.CASES])
def test_derived_targets_equal_sglang_cuda_load(loaded, case):
    result = loaded[MODE]["results"][case[0]]
    if "error" in result:
        pytest.fail(
            f"{case[0]} (cuda): SGLang could not build, load or derive:\n{result['error']}"
        )
    full = sglang_fakes.index_encoded(loaded[MODE]["checkpoints"][case[1]]["tensors"])
    problems = derived.load_problems(result, full, derived.REFUSED.get(case[1], ""))
    if problems:
        pytest.fail(
            f"{case[0]} (cuda, config changes {result['config_changes']}):\n"
            + "\n".join(problems[:8]),
            pytrace=False,
        )
