"""What a replica started after others builds first (shapecache/ray_serve/_prewarm_order.py):
a plain function of the sizes record and the replicas' last publications."""

from __future__ import annotations

import pytest

from shapecache.ray_serve._placement import ReplicaState
from shapecache.ray_serve._prewarm_order import (
    FIRST_SILENCE_S,
    LIVE_CEILING_S,
    LIVE_FLOOR_S,
    LIVE_PERIODS,
    decided_at,
    live,
    prewarm_order,
)

NOW = 1_000_000.0


def replica(rid: str, sizes=(), requests=None, silent_s: float = 0.0, period_s: float | None = 8.0) -> ReplicaState:
    return ReplicaState(rid, sizes=frozenset(sizes), published_at=NOW - silent_s, requests=requests or {},
                        period_s=period_s)


@pytest.mark.parametrize(("period_s", "silence_s"), [
    (8.0, LIVE_PERIODS * 8.0),  # its own periods...
    (1.0, LIVE_FLOOR_S),  # ...but never sooner than the floor (a late stats call)...
    (1e-6, LIVE_FLOOR_S),
    (1e300, LIVE_CEILING_S),  # ...nor later than the ceiling
    (None, FIRST_SILENCE_S),  # it published once: no period known
])
def test_a_replica_is_gone_once_silent_for_its_periods_within_bounds(period_s, silence_s):
    assert live(replica("a", silent_s=silence_s - 0.5, period_s=period_s), NOW)
    assert not live(replica("a", silent_s=silence_s + 0.5, period_s=period_s), NOW)
    # a stamp ahead of this clock by more than that is a clock gone wrong, or a forgery
    assert live(replica("a", silent_s=-(silence_s - 0.5), period_s=period_s), NOW)
    assert not live(replica("a", silent_s=-(silence_s + 0.5), period_s=period_s), NOW)


def test_a_pre_warm_waits_until_a_replica_that_missed_a_publication_is_live_again_or_gone():
    on_time = replica("a", silent_s=7.0)  # within its period of 8 s
    assert decided_at([on_time], NOW) == NOW
    late = replica("b", silent_s=12.0)  # missed one: dead, or a stats call answered late
    decided = decided_at([on_time, late], NOW)
    assert NOW - 12.0 + LIVE_PERIODS * 8.0 < decided <= NOW - 12.0 + LIVE_PERIODS * 8.0 + 1.0
    assert live(late, decided - 1.0) and not live(late, decided)  # gone by then, unless it published again
    gone = replica("c", silent_s=60.0)
    first = replica("d", silent_s=25.0, period_s=None)  # no period: nothing missed that it can tell
    assert decided_at([gone, first], NOW) == NOW
    forged = replica("e", silent_s=-10**6, period_s=1e300)  # far ahead: not live, so not waited for
    assert decided_at([forged], NOW) == NOW


def test_nothing_published_is_not_live():
    assert not live(ReplicaState("a"), NOW)


def test_requested_sizes_no_live_replica_holds_come_first_then_the_most_requested_then_the_most_built():
    built = {(64, 64): 1, (96, 64): 5, (128, 128): 1, (64, 96): 1, (32, 32): 2, (16, 16): 9}
    fleet = [
        replica("survivor", sizes={(64, 64), (32, 32)}, requests={(64, 64): 90, (96, 64): 2}),
        replica("dead", sizes={(128, 128), (64, 96)}, requests={(128, 128): 30, (64, 96): 40}, silent_s=60),
    ]
    # the dead replica's sizes, the most requested first; then the one that kept being evicted
    # (built most, requested least); then, with what the survivor holds, (16, 16), which no
    # publication says was requested (the record keeps every size ever built)
    assert prewarm_order(built, fleet, NOW) == [(64, 96), (128, 128), (96, 64), (64, 64), (16, 16), (32, 32)]
    # while its silence is within its periods the dead replica counts as holding its sizes: the
    # requested size no one holds first, then the most requested
    live_yet = [fleet[0], replica("dead", sizes={(128, 128), (64, 96)}, requests={(128, 128): 30, (64, 96): 40},
                                  silent_s=LIVE_PERIODS * 8.0 - 1)]
    assert prewarm_order(built, live_yet, NOW) == [(96, 64), (64, 64), (64, 96), (128, 128), (16, 16), (32, 32)]
    # without publications: the most built first, then the larger
    assert prewarm_order(built, [], NOW) == [(16, 16), (96, 64), (32, 32), (128, 128), (64, 96), (64, 64)]


def test_published_counts_order_only_the_recorded_sizes_and_only_where_positive():
    built = {(64, 64): 1, (96, 64): 1}
    fleet = [replica("foreign", requests={(640, 640): 10**9, (96, 64): -10**9, (64, 64): 0})]
    assert prewarm_order(built, fleet, NOW) == [(96, 64), (64, 64)]  # no count: the larger first
    fleet = [replica("other", requests={(64, 64): 1})]
    assert prewarm_order(built, fleet, NOW) == [(64, 64), (96, 64)]


def test_a_stopped_replica_is_gone_at_once_its_sizes_first_and_nothing_waits_for_it():
    # Serve stopped it (a rolling update): its last publication says so, a moment ago
    built = {(64, 64): 1, (96, 64): 1, (128, 128): 1}
    survivor = replica("survivor", sizes={(64, 64)}, requests={(64, 64): 90})
    stopped = ReplicaState("old", sizes=frozenset({(96, 64), (128, 128)}), published_at=NOW - 0.5,
                           requests={(96, 64): 10, (128, 128): 20}, period_s=8.0, stopped=True)
    assert not live(stopped, NOW)
    assert prewarm_order(built, [survivor, stopped], NOW) == [(128, 128), (96, 64), (64, 64)]
    # silent past a period after its last publication: not a replica that missed one
    quiet = ReplicaState("old", published_at=NOW - 12.0, period_s=8.0, stopped=True)
    assert decided_at([survivor, quiet], NOW) == NOW
    assert decided_at([survivor, replica("old", silent_s=12.0)], NOW) > NOW  # (unstopped: waited for)
