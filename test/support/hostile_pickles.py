"""Pickles a hostile client pushes into an engine's socket (issue 24, item 5)."""

from __future__ import annotations

import socket


class SocketFromSender:
    """Only classes SGLang's safe unpickler allows (``DupFd`` rebuilt by ``_rebuild_socket``):
    unpickling it connects to the sender's unix socket ``address`` and waits there."""

    def __init__(self, address: str) -> None:
        self.address = address

    def __reduce__(self):
        from multiprocessing import reduction, resource_sharer

        dup = object.__new__(resource_sharer.DupFd)
        dup._id = (self.address, 1)
        return (reduction._rebuild_socket, (dup, socket.AF_UNIX, socket.SOCK_STREAM, 0))
