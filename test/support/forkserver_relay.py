"""Test-only: a fork server of ``preloaded_spawn`` passes SIGQUIT on to the process that
started it. Imported by the server (``PRELOAD``), or ``install()`` called in it.

SGLang's scheduler and detokenizer report a fatal error by sending SIGQUIT to their parent,
which for a process started from the fork server is the server. A process forked from the
server keeps this handler until it sets its own (``preloaded_spawn`` resets it for SGLang's);
there the signal takes its default action, as it would have without the handler.
"""

import os
import signal

__all__ = ["install"]

_server = None


def _relay(signum, frame):
    if os.getpid() != _server:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    os.kill(os.getppid(), signum)


def install() -> None:
    """Make this process the server whose SIGQUIT goes to its parent."""
    global _server
    _server = os.getpid()
    signal.signal(signal.SIGQUIT, _relay)


install()
