"""A remote engine rank gives up a receive (``RemoteEngineSync.abort``): the data group is
abandoned after a failure, kept after a refusal the whole group agreed on before any byte
moved (the epoch goes on), on every TP rank alike."""

import threading
import time
from types import SimpleNamespace

from sglang.srt.weight_sync.protocol import REFUSED
from sglang.srt.weight_sync.remote.engine import RemoteEngineSync
from sglang.srt.weight_sync.remote.protocol import ReceiveState


class _Receive:
    """A receive whose thread ends after ``ends_in`` seconds (never when None), raising the
    group's refusal then when ``refuses``."""

    def __init__(self, ends_in, refuses: bool) -> None:
        self.refused = self.group_refused = False
        self.error = None
        self.abandoned = []
        self.group = SimpleNamespace(
            data=SimpleNamespace(abandon=lambda: self.abandoned.append(True))
        )
        self._stop = threading.Event()

        def run():
            if ends_in is None:
                self._stop.wait()
                return
            time.sleep(ends_in)
            if refuses:
                self.refused, self.error = True, "engine rank 1: a member refused"

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    @property
    def state(self) -> ReceiveState:
        return ReceiveState.FAILED if self.error else ReceiveState.RECEIVING

    def stop(self) -> None:
        self._stop.set()


def _rank(mine: _Receive, others_refused: bool):
    """``RemoteEngineSync``'s state for TP rank 1 of 2, whose peer's thread has failed
    (refused by the group, or not)."""
    done = []
    control = SimpleNamespace(
        share_figures=lambda figures, bound, phase: [
            [int(ReceiveState.FAILED), figures[0]],
            [int(others_refused), figures[1]],
        ],
        share_problems=lambda why, bound, phase: ["engine rank 0: why"] + list(why),
    )
    return SimpleNamespace(
        rank=1,
        control=control,
        receive_of=lambda req: mine,
        _mark_stale=lambda name, m, why: None,
        _done=done.append,
        done=done,
    )


def test_a_refusal_heard_from_a_peer_rank_keeps_the_data_group():
    """TP rank 0's thread raised the group's refusal; rank 1's is past the agreement but
    has yet to raise it. The status step tells rank 1, whose abort then waits for its
    thread to end and keeps the data group."""
    mine = _Receive(ends_in=0.3, refuses=True)
    rank = _rank(mine, others_refused=True)
    req = SimpleNamespace(group_name="g", timeout_s=5.0)
    state, message = RemoteEngineSync.status(rank, req)
    assert state == ReceiveState.FAILED and message.startswith(REFUSED), message
    assert mine.group_refused and not mine.refused
    RemoteEngineSync.abort(rank, req)
    assert not mine.thread.is_alive() and mine.refused
    assert mine.abandoned == [] and rank.done == [mine]


def test_a_failure_abandons_the_data_group_at_once():
    """No rank refused (a peer was lost in the rounds): the abort abandons the data group
    without waiting for the thread, which still waits in its round."""
    mine = _Receive(ends_in=None, refuses=False)
    rank = _rank(mine, others_refused=False)
    req = SimpleNamespace(group_name="g", timeout_s=5.0)
    state, message = RemoteEngineSync.status(rank, req)
    assert state == ReceiveState.FAILED and not message.startswith(REFUSED), message
    started = time.monotonic()
    RemoteEngineSync.abort(rank, req)
    assert time.monotonic() - started < 1.0
    assert mine.abandoned == [True] and rank.done == []
    mine.stop()
