"""How NCCL's watchdog treats the groups this package makes for itself, and why it never ends
the process over a wait that ran out.

``ProcessGroupNCCL`` reads its watchdog's settings from the environment when a group is made
(its constructor), one group at a time:

* ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: what the watchdog does with an error it finds itself (a
  work past the group's timeout, a communicator error): 3 (the default) and 1 rethrow in the
  watchdog's thread, ``std::terminate``; 2 aborts the group's communicators and returns;
* ``TORCH_NCCL_DUMP_ON_TIMEOUT``: on such an error the watchdog writes a dump signal into the
  job's store, waits ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` for its dump, and every other
  process's heartbeat monitor that reads the signal dumps and may end its process
  (``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` bounds how long a monitor lets a stuck watchdog be);
* ``TORCH_NCCL_ENABLE_MONITORING``: whether the group runs a heartbeat monitor of its own.

The data plane never lets a wait reach the watchdog: it polls its works against the update's
bound and aborts the group itself first (``control_plane.poll``), and the group's timeout is
above every bound (``control_plane.check_group_timeout``). Its groups are made under
``DATA_PLANE_ENV`` as well (``data_plane_env``): an error the watchdog still finds on its own
(a peer's communicator torn down under a pending receive, a race with the abort) aborts the
group's communicators and nothing else, writes no dump signal that would end the job's other
processes, and starts no monitor. SGLang's and the trainer's own groups keep their settings.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

__all__ = (
    "DATA_PLANE_ENV",
    "WatchdogSettings",
    "data_plane_env",
    "watchdog_settings",
)

# what a data-plane group is made with (see the module's docstring)
DATA_PLANE_ENV: Mapping[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort the communicators, no teardown
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",  # no dump signal into the job's store
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # no heartbeat monitor of the group's own
}
TEAR_DOWN_MODES = (1, 3)  # TearDown, SkipCleanUp: the watchdog rethrows, std::terminate


@dataclass(frozen=True)
class WatchdogSettings:
    """The watchdog's settings a NCCL group made now would read (torch's defaults where unset)."""

    async_error_handling: int
    dump_on_timeout: bool
    monitoring: bool
    wait_timeout_dump_ms: int
    heartbeat_timeout_s: int

    @property
    def tears_down(self) -> bool:
        """Whether an error the watchdog finds ends the process."""
        return self.async_error_handling in TEAR_DOWN_MODES


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on", "y")


def watchdog_settings() -> WatchdogSettings:
    """The settings in this process's environment now (torch 2.8's defaults where unset)."""
    env = os.environ
    return WatchdogSettings(
        async_error_handling=int(env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")),
        dump_on_timeout=_flag(env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")),
        monitoring=_flag(env.get("TORCH_NCCL_ENABLE_MONITORING", "1")),
        wait_timeout_dump_ms=int(
            env.get("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "15000")
        ),
        heartbeat_timeout_s=int(env.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "480")),
    )


@contextlib.contextmanager
def data_plane_env(backend: str) -> Iterator[Optional[WatchdogSettings]]:
    """``DATA_PLANE_ENV`` in the environment while a group with ``backend`` is made (NCCL
    only: a gloo group reads none of it), restored after; yields the settings the group
    reads (None: not NCCL, no watchdog). Another thread reading the environment meanwhile sees them too: groups are made
    by the thread that runs updates, outside serving's own group making."""
    if "nccl" not in backend.lower():
        yield None
        return
    saved = {k: os.environ.get(k) for k in DATA_PLANE_ENV}
    os.environ.update(DATA_PLANE_ENV)
    try:
        yield watchdog_settings()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
