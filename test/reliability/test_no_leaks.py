"""No leaks at shutdown: a whole engine life (updates on several channels, generation,
shutdown) in a fresh interpreter ends without multiprocessing's resource-tracker
warnings (``leaked shared_memory``, measured on every run before this suite).

Engine fds per retired channel are checked in ``test_hostile_input.py``; channel
directories of trainer ranks that lived or died in ``test_trainer_death.py``.
"""

import os
import subprocess
import sys
from pathlib import Path


def test_an_engine_life_leaks_nothing(tmp_path):
    script = Path(__file__).with_name("leak_run.py")
    env = dict(os.environ, PYTHONWARNINGS="default")
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                         timeout=400, env=env, cwd=tmp_path)
    assert run.returncode == 0 and "LEAK-RUN-DONE" in run.stdout, run.stderr[-4000:]
    leaks = [line for line in run.stderr.splitlines() if "resource_tracker" in line or "leaked" in line]
    assert not leaks, "\n".join(leaks)
