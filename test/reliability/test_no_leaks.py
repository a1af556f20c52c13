"""No leaks at shutdown: a whole engine life (updates on several channels, generation,
shutdown) in a fresh interpreter leaves nothing behind.

multiprocessing's resource tracker warns at exit about every name still registered
("There appear to be N leaked shared_memory objects") and then unlinks them, printing
an error for each name that was already gone. Upstream SGLang's schedulers are killed at
shutdown before they unregister their message-queue segments (``sgl_shm_mq_*``) and
semaphores, which were already removed: that is bookkeeping noise, not a leak. A real
leak is a name the tracker still had to remove (a warning count with no "already gone"
line for it). Engine fds per retired channel are checked in ``test_hostile_input.py``;
channel directories of trainer ranks in ``test_trainer_death.py``.
"""

import os
import re
import subprocess
import sys
from pathlib import Path


def test_an_engine_life_leaks_nothing(tmp_path):
    script = Path(__file__).with_name("leak_run.py")
    env = dict(os.environ, PYTHONWARNINGS="default")
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0 and "LEAK-RUN-DONE" in run.stdout, run.stderr[-4000:]
    registered = sum(
        int(n)
        for n in re.findall(
            r"resource_tracker: There appear to be (\d+) leaked", run.stderr
        )
    )
    already_gone = re.findall(r"resource_tracker: '([^']+)': \[Errno 2\]", run.stderr)
    assert registered == len(already_gone), (
        f"the resource tracker had to remove {registered - len(already_gone)} leaked object(s):\n"
        + "\n".join(
            line for line in run.stderr.splitlines() if "resource_tracker" in line
        )
    )
    ours = [n for n in already_gone if not n.startswith(("/sgl_shm_mq_", "/mp-"))]
    assert not ours, f"objects of ours left registered: {ours}"
