"""The size-affinity policy (shapecache/ray_serve/_placement.py) as a plain function: no Ray,
no torch. Each test states the rule of the module's docstring it checks."""

from __future__ import annotations

from dataclasses import replace

import hypothesis.strategies as st
from hypothesis import given, settings

from shapecache.ray_serve._placement import (
    COUNTS,
    FORMAT_KEY,
    FORMAT_VERSION,
    HOME_GRACE_S,
    MAX_HOMES,
    PLAN_PERIOD_S,
    TRAFFIC_HALF_LIFE_S,
    Placement,
    ReplicaState,
    routing_stats,
)

NOW = 1000.0
MiB = 1 << 20


def replica(rid, sizes=(), bytes=0, budget=100 * MiB, entries=None, pending=0, at=NOW - 1, full=False):
    """A replica that published `sizes`, held in `bytes` shared equally among them."""
    held = {size: bytes // len(sizes) for size in sizes}
    return ReplicaState(rid, frozenset(sizes), bytes, budget, len(sizes) if entries is None else entries, pending, at,
                        full, size_bytes=held)


def test_a_held_size_goes_to_its_holder_first():
    replicas = [replica("a", [(64, 64)], bytes=80 * MiB), replica("b", [(96, 96)], bytes=10 * MiB)]
    assert Placement().rank((64, 64), replicas, NOW) == [["a"]]
    assert Placement().rank((96, 96), replicas, NOW) == [["b"]]


def test_a_size_held_twice_prefers_the_holder_that_is_not_full():
    replicas = [replica("a", [(64, 64)], full=True), replica("b", [(64, 64)]), replica("c")]
    assert Placement().rank((64, 64), replicas, NOW) == [["b", "a"]]


def test_a_size_held_twice_goes_first_to_the_holder_the_plan_places_it_on_and_the_other_after():
    # Rule 2: a and b both hold (64, 64) (a second copy, left by a spill-over or a kill); the
    # plan places it on a, where it was last sent, though b has more room (most room first
    # would send it to b). Sent to a first, b's copy ages out of b's LRU.
    placement = Placement()
    hot(placement, (64, 64), 10)
    placement.routed((64, 64), "a", NOW - 1)
    both = [replica("a", [(64, 64), (32, 32)], bytes=90 * MiB), replica("b", [(64, 64)], bytes=45 * MiB)]
    assert placement.rank((64, 64), both, NOW) == [["a"], ["b"]]
    assert placement.plan[(64, 64)] == "a"
    # an overflow to b (a's probe answered late) does not turn the plan to b
    placement.routed((64, 64), "b", NOW)
    assert placement.rank((64, 64), both, NOW + PLAN_PERIOD_S) == [["a"], ["b"]]
    # a at max_ongoing_requests, or building a size inline: both holders, the one not full
    # (then the most room) first, as without the rule
    assert placement.rank((64, 64), [replace(both[0], full=True), both[1]], NOW + PLAN_PERIOD_S) == [["b", "a"]]
    assert placement.rank((64, 64), [replace(both[0], building=1), both[1]], NOW + PLAN_PERIOD_S) == [["b", "a"]]
    # without traffic enough to be planned, both holders as before
    assert Placement().rank((64, 64), both, NOW) == [["b", "a"]]


def test_a_new_size_goes_to_the_replica_with_the_most_bytes_free_then_fewest_entries():
    replicas = [replica("a", [(8, 8)], bytes=60 * MiB), replica("b", [(16, 16)], bytes=20 * MiB)]
    assert Placement().rank((32, 32), replicas, NOW)[0] == ["b"]
    equal_bytes = [replica("a", [(8, 8), (9, 9)], bytes=20 * MiB), replica("b", [(16, 16)], bytes=20 * MiB)]
    assert Placement().rank((32, 32), equal_bytes, NOW)[0] == ["b"]


def test_a_new_size_then_sticks_to_the_replica_it_was_sent_to():
    placement = Placement()
    replicas = [replica("a", bytes=50 * MiB), replica("b", bytes=10 * MiB)]
    assert placement.rank((32, 32), replicas, NOW)[0] == ["b"]
    placement.routed((32, 32), "b", NOW)
    # b's stats do not list the size yet (they were published before it was sent), and b now
    # has less room than a: the size still goes to b
    replicas = [replica("a", bytes=50 * MiB), replica("b", bytes=99 * MiB)]
    assert placement.rank((32, 32), replicas, NOW + 0.5)[0] == ["b"]


def test_new_sizes_of_one_stats_period_spread_over_replicas():
    placement = Placement()
    replicas = [replica("a", [(1, 1)], bytes=10 * MiB), replica("b", [(2, 2)], bytes=10 * MiB)]
    first = placement.rank((32, 32), replicas, NOW)[0][0]
    placement.routed((32, 32), first, NOW)
    second = placement.rank((48, 48), replicas, NOW)[0][0]
    assert {first, second} == {"a", "b"}


def test_a_size_the_holder_evicted_is_placed_again():
    placement = Placement()
    placement.routed((32, 32), "a", NOW - 100)
    # a published long after the size was sent, without it: a evicted it
    replicas = [replica("a", [(8, 8)], bytes=90 * MiB, at=NOW - 1), replica("b", bytes=0)]
    assert placement.rank((32, 32), replicas, NOW)[0] == ["b"]
    # within HOME_GRACE_S of the choice the size may still wait in the replica (or its clock
    # runs ahead): still its home
    placement.routed((32, 32), "a", NOW - 1 - HOME_GRACE_S + 5)
    assert placement.rank((32, 32), replicas, NOW)[0] == ["a"]


def test_spill_over_when_the_homes_are_full_every_other_replica_is_a_later_rank():
    replicas = [replica("a", [(64, 64)], full=True), replica("b"), replica("c", bytes=200 * MiB)]
    assert Placement().rank((64, 64), replicas, NOW) == [["a"], ["b", "c"]]  # c is over its budget: last
    # a home that is not full (as far as the router knows) is waited for...
    replicas[0] = replica("a", [(64, 64)])
    assert Placement(spill_after_s=1.0).rank((64, 64), replicas, NOW, waited_s=0.5) == [["a"]]
    # ... until the request has waited spill_after_s (its probe was not answered in time)
    assert Placement(spill_after_s=1.0).rank((64, 64), replicas, NOW, waited_s=1.0) == [["a"], ["b", "c"]]


def test_a_replica_over_its_budget_or_with_builds_pending_gets_no_new_size():
    over = [replica("a", bytes=101 * MiB), replica("b", bytes=99 * MiB, budget=100 * MiB)]
    assert Placement().rank((32, 32), over, NOW)[0] == ["b"]
    building = [replica("a", pending=2), replica("b", bytes=90 * MiB)]
    assert Placement(max_pending_builds=2).rank((32, 32), building, NOW)[0] == ["b"]
    # where every replica is over, the new size still goes somewhere
    assert Placement().rank((32, 32), [replica("a", bytes=200 * MiB)], NOW) == [["a"]]


def test_a_new_size_offers_every_replica_at_once_a_held_one_waits_for_its_home():
    replicas = [replica("a", [(64, 64)], bytes=10 * MiB), replica("b", bytes=50 * MiB)]
    assert Placement().rank((32, 32), replicas, NOW) == [["a"], ["b"]]  # new: built wherever it goes
    assert Placement().rank((64, 64), replicas, NOW) == [["a"]]  # held: no second build while a answers


def test_a_replica_building_in_a_request_gets_no_new_size():
    # An inline build holds the replica: its queue waits behind it (rule 3a).
    replicas = [ReplicaState("a", frozenset(), 0, 100 * MiB, 0, 0, NOW - 1, building=1),
                replica("b", [(8, 8)], bytes=90 * MiB)]
    assert Placement().rank((32, 32), replicas, NOW)[0] == ["b"]


def hot(placement, size, requests, at=NOW):
    for _ in range(requests):
        placement.requested(size, at)


def test_a_new_size_where_none_fits_displaces_the_least_requested_sizes():
    # Both replicas are full; a holds a hot size, b a cold one: the new size goes to b (rule 3b),
    # though a has more bytes free.
    placement = Placement()
    hot(placement, (64, 64), 50)
    hot(placement, (96, 96), 2)
    replicas = [replica("a", [(64, 64)], bytes=95 * MiB), replica("b", [(96, 96)], bytes=99 * MiB)]
    assert placement.rank((32, 32), replicas, NOW)[0] == ["b"]
    # a size's bytes, as a replica measured them, decide whether it fits: 4 MiB fits in a's 5 free
    placement.size_bytes[(32, 32)] = 4 * MiB
    assert placement.rank((32, 32), replicas, NOW)[0] == ["a"]  # fits beside the hot size: nothing displaced


def test_a_dead_replicas_hot_sizes_are_spread_by_the_traffic_already_placed():
    placement = Placement()
    for size, requests in (((1, 1), 40), ((2, 2), 30), ((3, 3), 2), ((4, 4), 2)):
        hot(placement, size, requests)
    placement.routed((1, 1), "a", NOW - 100)
    placement.routed((2, 2), "a", NOW - 100)
    placement.keep_only(["b", "c"])  # a died: (1, 1) and (2, 2) have no home
    replicas = [replica("b", [(3, 3)], bytes=30 * MiB, entries=1, at=NOW - 1),
                replica("c", [(4, 4)], bytes=10 * MiB, entries=1, at=NOW - 1)]
    first = placement.rank((1, 1), replicas, NOW)[0][0]
    placement.routed((1, 1), first, NOW)
    second = placement.rank((2, 2), replicas, NOW)[0][0]
    assert {first, second} == {"b", "c"}  # by bytes free alone both would go to one replica


def test_a_home_that_keeps_evicting_a_size_gives_it_up():
    placement = Placement()
    for when in (NOW - 200, NOW - 100):  # sent to a twice, evicted twice
        placement.routed((32, 32), "a", when)
        replicas = [replica("a", [(8, 8)], bytes=99 * MiB, at=when + HOME_GRACE_S + 1), replica("b", bytes=99 * MiB)]
        assert placement.rank((8, 8), replicas, when + HOME_GRACE_S + 2)[0] == ["a"]
        placement.rank((32, 32), replicas, when + HOME_GRACE_S + 2)
    assert placement.evictions == {(32, 32): {"a": 2}}
    # a has more bytes free than b, but evicted the size twice; neither fits it: b takes it (3c)
    replicas = [replica("a", [(8, 8)], bytes=90 * MiB), replica("b", [(9, 9)], bytes=95 * MiB)]
    placement.size_bytes[(32, 32)] = 50 * MiB
    assert placement.rank((32, 32), replicas, NOW)[0] == ["b"]
    placement.keep_only(["b"])
    assert placement.evictions == {}


def test_the_plan_places_the_most_requested_sizes_first_where_they_fit_and_is_made_again_without_a_dead_replica():
    placement = Placement()
    sizes = {(6, 6): (40, 60 * MiB), (5, 5): (30, 50 * MiB), (4, 4): (20, 40 * MiB), (3, 3): (10, 30 * MiB)}
    for size, (requests, nbytes) in sizes.items():
        hot(placement, size, requests)
        placement.size_bytes[size] = nbytes
    replicas = [replica("a"), replica("b")]  # 100 MiB each, empty
    # (6, 6) to a; (5, 5) to b (less traffic placed); (4, 4) to b (30 < 40 placed on a);
    # (3, 3) to a, the only one with room left
    assert placement.rank((4, 4), replicas, NOW)[0] == ["b"]
    assert placement.plan == {(6, 6): "a", (5, 5): "b", (4, 4): "b", (3, 3): "a"}
    # a holds (5, 5) now: the plan keeps it there (a move is a build), and the others fit around it
    replicas = [replica("a", [(5, 5)], bytes=50 * MiB), replica("b")]
    assert placement.rank((3, 3), replicas, NOW + 0.5)[0] == ["a"]  # the plan is not made again within its period
    assert placement.rank((3, 3), replicas, NOW + PLAN_PERIOD_S)[0] == ["b"]
    assert placement.plan == {(6, 6): "b", (5, 5): "a", (4, 4): "a", (3, 3): "b"}
    # b dies: the sizes that fit on a are planned there, the rest go where they displace least
    placement.keep_only(["a"])
    assert placement.rank((6, 6), [replicas[0]], NOW + 2 * PLAN_PERIOD_S)[0] == ["a"]
    assert placement.plan == {(5, 5): "a", (4, 4): "a"}  # (6, 6) fits nowhere beside the held (5, 5)


def test_request_rates_halve_every_half_life():
    placement = Placement()
    hot(placement, (8, 8), 8)
    assert placement.requests_per_half_life((8, 8), NOW + TRAFFIC_HALF_LIFE_S) == 4.0
    placement.requested((8, 8), NOW + TRAFFIC_HALF_LIFE_S)
    assert placement.requests_per_half_life((8, 8), NOW + 2 * TRAFFIC_HALF_LIFE_S) == 2.5
    assert placement.requests_per_half_life((9, 9), NOW) == 0.0


def test_a_full_replica_gets_no_new_size_while_another_is_free():
    replicas = [replica("a", full=True), replica("b", bytes=90 * MiB)]
    assert Placement().rank((32, 32), replicas, NOW)[0] == ["b"]


def test_a_dead_replica_is_forgotten_and_its_sizes_placed_again():
    placement = Placement()
    placement.routed((32, 32), "a", NOW)
    placement.routed((48, 48), "b", NOW)
    placement.keep_only(["b", "c"])
    assert placement.homes == {(48, 48): ("b", NOW)}
    replicas = [replica("b", bytes=90 * MiB, at=NOW - 5), replica("c", bytes=0, at=NOW - 5)]
    assert placement.rank((32, 32), replicas, NOW)[0] == ["c"]


def test_a_router_remembers_the_most_recent_sizes_only():
    placement = Placement()
    for i in range(MAX_HOMES + 10):
        placement.routed((i,), "a", NOW)
    placement.routed((5,), "b", NOW)  # used again: kept
    assert len(placement.homes) == MAX_HOMES
    assert (0,) not in placement.homes and (5,) in placement.homes and (MAX_HOMES + 9,) in placement.homes


def test_no_size_or_no_fresh_stats_is_left_to_the_default_policy():
    replicas = [replica("a", [(64, 64)]), replica("b")]
    assert Placement().rank(None, replicas, NOW) is None
    stale = [replica("a", [(64, 64)], at=NOW - 120), replica("b", at=NOW - 120)]
    assert Placement(stats_max_age_s=60).rank((64, 64), stale, NOW) is None
    missing = [ReplicaState("a"), ReplicaState("b")]
    assert Placement().rank((64, 64), missing, NOW) is None
    # ... but a size this router placed keeps its home while the stats are late
    placement = Placement()
    placement.routed((64, 64), "b", NOW - 1)
    assert placement.rank((64, 64), missing, NOW)[0] == ["b"]


def test_stats_stamped_in_the_future_are_stale_and_a_time_that_is_none_is_no_stats():
    # A replica whose clock runs ahead, or stats another process wrote (published_at=inf), is
    # not trusted for ever; a clock a little ahead (another node's) still counts.
    ahead = [replica("a", [(64, 64)], at=NOW + 3600), replica("b", bytes=50 * MiB)]
    assert Placement(stats_max_age_s=60).rank((64, 64), ahead, NOW)[0] == ["b"]
    assert replica("a", at=NOW + 5).fresh(NOW, 60)
    published = routing_stats([(64, 64)], figures(0, None, 1, 0), NOW)
    for when in (float("inf"), float("-inf"), float("nan"), "inf"):
        published[FORMAT_KEY]["published_at"] = when
        state = ReplicaState.from_routing_stats("a", published)
        assert state.published_at is None and state.sizes == frozenset() and not state.fresh(NOW, 60)


def test_stale_stats_are_not_trusted_for_the_sizes_they_list():
    replicas = [replica("a", [(64, 64)], at=NOW - 120), replica("b", bytes=50 * MiB)]
    assert Placement(stats_max_age_s=60).rank((64, 64), replicas, NOW)[0] == ["b"]


def figures(nbytes, budget, entries, pending):
    return {"bytes": nbytes, "budget": budget, "entries": [{}] * entries, "pending_builds": pending,
            **{name: i for i, name in enumerate(COUNTS)}}


def test_routing_stats_round_trip_and_foreign_stats_count_as_missing():
    stats = routing_stats([(64, 64), (96, 128)], figures(5 * MiB, 100 * MiB, 2, 1), NOW, building=1,
                          size_bytes={(64, 64): 3 * MiB}, requests={(64, 64): 7, (32, 32): 1}, period_s=2.5)
    state = ReplicaState.from_routing_stats("a", stats, full=True)
    assert state == ReplicaState("a", frozenset({(64, 64), (96, 128)}), 5 * MiB, 100 * MiB, 2, 1, NOW, True,
                                 building=1, size_bytes={(64, 64): 3 * MiB},
                                 counts={name: i for i, name in enumerate(COUNTS)}, requests={(64, 64): 7, (32, 32): 1},
                                 period_s=2.5)
    ours = stats[FORMAT_KEY]
    for foreign in ({}, None, {"queue": 3}, {FORMAT_KEY: {"version": 99}}, {FORMAT_KEY: {"version": FORMAT_VERSION, "sizes": "x"}},
                    {FORMAT_KEY: {"version": FORMAT_VERSION}}, {FORMAT_KEY: {**ours, "size_bytes": [[1]]}},
                    {FORMAT_KEY: {**ours, "counts": {}}}, {FORMAT_KEY: {**ours, "version": FORMAT_VERSION - 1}},
                    {FORMAT_KEY: {**ours, "requests": [[[64, 64], "many"]]}},
                    {FORMAT_KEY: {**ours, "period_s": float("nan")}}, {FORMAT_KEY: {**ours, "stopped": "yes"}},
                    {FORMAT_KEY: {**ours, "stopped": 1}}):
        assert ReplicaState.from_routing_stats("a", foreign) == ReplicaState("a")
    # a replica of an earlier release publishes neither requests nor its period; a period not
    # above 0 is none
    earlier = {FORMAT_KEY: {k: v for k, v in ours.items() if k not in ("requests", "period_s", "stopped")}}
    assert ReplicaState.from_routing_stats("a", earlier, full=True) == replace(state, requests={}, period_s=None)
    last = routing_stats([(64, 64)], figures(5 * MiB, 100 * MiB, 1, 0), NOW, stopped=True)  # Serve stopped it
    assert ReplicaState.from_routing_stats("a", last).stopped and not state.stopped
    for period in (0, -2.0):
        assert ReplicaState.from_routing_stats("a", {FORMAT_KEY: {**ours, "period_s": period}}).period_s is None


sizes = st.tuples(st.integers(1, 4), st.integers(1, 4))


@settings(max_examples=300, deadline=None)
@given(
    size=st.one_of(st.none(), sizes),
    published=st.lists(st.tuples(st.frozensets(sizes, max_size=4), st.integers(0, 200), st.booleans(),
                                 st.sampled_from([None, NOW - 1, NOW - 500]), st.integers(0, 3)),
                       min_size=1, max_size=4),
    history=st.lists(st.tuples(sizes, st.integers(0, 3), st.floats(NOW - 100, NOW)), max_size=6),
)
def test_every_replica_is_ranked_once_and_a_fresh_holder_is_first(size, published, history):
    replicas = [ReplicaState(f"r{i}", s, b * MiB, 100 * MiB, len(s), p, at, full)
                for i, (s, b, full, at, p) in enumerate(published)]
    placement = Placement(stats_max_age_s=60)
    for routed_size, index, at in history:
        if index < len(replicas):
            placement.routed(routed_size, f"r{index}", at)
    ranks = placement.rank(size, replicas, NOW)
    if ranks is None:
        return
    flat = [rid for rank in ranks for rid in rank]
    assert len(flat) == len(set(flat)) and set(flat) <= {r.replica_id for r in replicas}
    assert all(ranks)
    # after spill_after_s every replica is a candidate: a request never waits for one replica only
    waited = placement.rank(size, replicas, NOW, waited_s=placement.spill_after_s)
    assert sorted(rid for rank in waited for rid in rank) == sorted(r.replica_id for r in replicas)
    fresh_holders = {r.replica_id for r in replicas if r.fresh(NOW, 60) and size in r.sizes}
    if fresh_holders:
        assert set(ranks[0]) >= fresh_holders
