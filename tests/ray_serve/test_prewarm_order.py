"""What a replica started after others builds first (shapecache/ray_serve/_prewarm_order.py):
a plain function of the sizes record and the replicas' last publications."""

from __future__ import annotations

from shapecache.ray_serve._placement import ReplicaState
from shapecache.ray_serve._prewarm_order import FIRST_SILENCE_S, LIVE_PERIODS, live, prewarm_order

NOW = 1_000_000.0


def replica(rid: str, sizes=(), requests=None, silent_s: float = 0.0, period_s: float | None = 2.0) -> ReplicaState:
    return ReplicaState(rid, sizes=frozenset(sizes), published_at=NOW - silent_s, requests=requests or {},
                        period_s=period_s)


def test_a_replica_is_gone_once_it_has_missed_its_periods():
    assert live(replica("a", silent_s=LIVE_PERIODS * 2.0), NOW)
    assert not live(replica("a", silent_s=LIVE_PERIODS * 2.0 + 0.1), NOW)
    assert live(replica("a", silent_s=LIVE_PERIODS * 10.0, period_s=10.0), NOW)  # its own period, not another's
    # one that published once says no period: gone after FIRST_SILENCE_S
    assert live(replica("a", silent_s=FIRST_SILENCE_S - 1, period_s=None), NOW)
    assert not live(replica("a", silent_s=FIRST_SILENCE_S + 1, period_s=None), NOW)
    assert not live(ReplicaState("a"), NOW)  # nothing valid published


def test_sizes_no_live_replica_holds_come_first_then_the_most_requested_then_the_most_built():
    built = {(64, 64): 1, (96, 64): 5, (128, 128): 1, (64, 96): 1, (32, 32): 2}
    fleet = [
        replica("survivor", sizes={(64, 64), (32, 32)}, requests={(64, 64): 90, (96, 64): 2}),
        replica("dead", sizes={(128, 128), (64, 96)}, requests={(128, 128): 30, (64, 96): 40}, silent_s=60),
    ]
    # the dead replica's sizes, the most requested first; then the one that kept being evicted
    # (built most, requested least); then what the survivor holds
    assert prewarm_order(built, fleet, NOW) == [(64, 96), (128, 128), (96, 64), (64, 64), (32, 32)]
    # while its silence is within its periods the dead replica counts as holding its sizes: the
    # size no one holds first, then the most requested
    assert prewarm_order(built, fleet, NOW - 59) == [(96, 64), (64, 64), (64, 96), (128, 128), (32, 32)]
    # without publications: the most built first, then the larger
    assert prewarm_order(built, [], NOW) == [(96, 64), (32, 32), (128, 128), (64, 96), (64, 64)]


def test_published_counts_order_only_the_recorded_sizes_and_only_where_positive():
    built = {(64, 64): 1, (96, 64): 1}
    fleet = [replica("foreign", requests={(640, 640): 10**9, (64, 64): -10**9, (96, 64): 0})]
    assert prewarm_order(built, fleet, NOW) == [(96, 64), (64, 64)]  # equal: the larger first
