"""Test-only: in every Python process started with ``test/support`` on PYTHONPATH (the
engine's scheduler processes too), record calls that a weight update must never make.

Active only when ``SGLANG_TEST_FORBIDDEN_LOG`` names a directory: each call of
``DTensor.full_tensor``, ``gather_object`` or ``all_gather_object`` appends a line to
``<dir>/<pid>.log``. The end-to-end tests read those files around every update.
(Outside updates SGLang's own weight checker uses ``all_gather_object``, so the calls
are recorded rather than refused.)
"""

import os

_LOG_DIR = os.environ.get("SGLANG_TEST_FORBIDDEN_LOG")

if _LOG_DIR:
    import torch.distributed as _dist
    import torch.distributed.distributed_c10d as _c10d
    from torch.distributed.tensor import DTensor as _DTensor

    def _recording(name, fn):
        def call(*args, **kwargs):
            with open(os.path.join(_LOG_DIR, f"{os.getpid()}.log"), "a") as log:
                log.write(name + "\n")
            return fn(*args, **kwargs)

        return call

    _DTensor.full_tensor = _recording("full_tensor", _DTensor.full_tensor)
    for _name in ("gather_object", "all_gather_object"):
        _wrapped = _recording(_name, getattr(_c10d, _name))
        setattr(_dist, _name, _wrapped)
        setattr(_c10d, _name, _wrapped)

if os.environ.get("SGLANG_USE_CPU_ENGINE"):
    import torch as _torch

    if _torch.version.cuda is not None and not _torch.cuda.is_available():
        # The CUDA torch build that SGLang 0.5.10/0.5.12 pin, on a machine without GPU: SGLang 0.5.12's
        # weight checker calls torch.cuda.synchronize(), which has nothing to wait for here.
        _torch.cuda.synchronize = lambda device=None: None
