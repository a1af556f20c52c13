"""Two GPUs: a peer killed in the middle of a data-plane update, over NCCL.

Two processes, one per GPU (spawned by the test, not ``torchrun``: the elastic agent ends
every rank when one dies), each making the data plane's own NCCL group over a gloo world
(``test/support/peer_death.py``). Rank 1 ends its process where it would post its round's
send; rank 0's receive must end within the bound, its group aborted and destroyed at that
moment, its process alive after NCCL's watchdog delays (shortened to 2 s x 4 and 10 s) and
able to make and use a new group. Run with::

    bash scripts/gpu_run.sh test/gpu/test_peer_killed.py

On fewer than two GPUs it is skipped with that reason; the same scenario runs on gloo in the
CPU suite (``test/distributed/test_polled_wait.py``).
"""

import pytest
from peer_death import BOUND_S, killed_mid_round, watchdog_delay_s
from ranks import run_ranks

pytestmark = pytest.mark.gpus(2)


def test_a_peer_killed_mid_round_spares_the_survivor():
    results = run_ranks(2, killed_mid_round, "nccl", may_die=[1], timeout=240)
    r = results[0]
    assert r["first"].startswith("PeerLost: rank 0: executor round 1"), r
    assert r["seconds"] < BOUND_S + 10, r
    assert r["abandoned"] and r["destroyed"], r
    assert r["alive_after_s"] >= watchdog_delay_s(), r
    assert r["alone"], r
