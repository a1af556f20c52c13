"""The tokenizer manager's answer guard on fakes, shared by the guard's and the outcome's tests.

``guarded`` wraps a fake manager's communicators with ``answer_guard.bound_answers``, its bound
shortened; ``generation_served`` says whether the guard lets generation through.
"""

from __future__ import annotations

import asyncio

from sglang.srt.weight_sync import answer_guard
from sglang.srt.weight_sync.answer_guard import (
    bound_answers,
    refuse_generation_if_unsafe,
)

__all__ = ["BOUND_S", "FakeCommunicator", "FakeManager", "generation_served", "guarded"]

BOUND_S = 0.3


class FakeCommunicator:
    """Upstream's communicator as the wrapper sees it: answers when ``answer`` is set."""

    def __init__(self):
        self.calls, self.answer = [], None

    async def __call__(self, obj):
        self.calls.append(obj)
        self.answer = asyncio.get_running_loop().create_future()
        return await self.answer

    def handle_recv(self, obj):
        return ("handled", obj)


class FakeManager:
    def __init__(self):
        for name in (*answer_guard.UPDATES, *answer_guard.SESSIONS):
            setattr(self, f"{name}_communicator", FakeCommunicator())
        self.inner = {
            name: getattr(self, f"{name}_communicator")
            for name in (*answer_guard.UPDATES, *answer_guard.SESSIONS)
        }


def guarded(monkeypatch, bound_s: float = BOUND_S) -> FakeManager:
    """A fake manager whose communicators the guard wraps, its bound shortened to ``bound_s``."""
    monkeypatch.setattr(answer_guard, "answer_bound_s", lambda timeout_s: bound_s)
    m = FakeManager()
    bound_answers(m)
    return m


def generation_served(manager) -> bool:
    try:
        refuse_generation_if_unsafe(manager)
        return True
    except ValueError:
        return False
