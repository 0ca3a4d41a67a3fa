"""The hit-rate bound (shapecache/ray_serve/_hit_rate_bound.py): worked by hand on short
streams, and never beaten by the simulated fleet's routers."""

from __future__ import annotations

import pytest

from shapecache.ray_serve import SimulatedFleet, SizeCost, hit_rate_bound, simulate_fleet

A, B, C = (64, 64), (96, 96), (128, 128)
MiB = 1 << 20


def test_it_keeps_what_is_requested_again_soonest_and_may_not_keep_what_it_built():
    # Two entries, three sizes in turn: LRU hits nothing; the bound keeps A and B and does not
    # keep C (requested again last), so A and B hit on their second round.
    assert hit_rate_bound([A, B, C, A, B, C], entries=2) == pytest.approx(2 / 6)
    assert hit_rate_bound([A, B, C, A, B, C], entries=2, counted_from=3) == pytest.approx(2 / 3)
    assert hit_rate_bound([A, B, C, A, B, C], entries=3) == pytest.approx(3 / 6)


def test_what_the_warm_up_kept_is_chosen_for_the_requests_counted():
    # One entry; only the last request counts. Kept by Belady's rule through the warm-up, B
    # would be held at the end; but the warm-up's hits are free to give up, and A, requested
    # in it, could be the one held: the best is 1 of 1.
    assert hit_rate_bound([A, B, B, A], entries=1, counted_from=3) == pytest.approx(1.0)
    assert hit_rate_bound([A, B, B, A], entries=1, counted_from=2) == pytest.approx(1 / 2)  # B at 2, or A at 3
    assert hit_rate_bound([A, B, C, C], entries=1, counted_from=3) == pytest.approx(1.0)


def test_a_kill_loses_the_entries_needed_last_and_the_fleet_holds_fewer_after_it():
    # Both held when the kill comes before request 4; the replica left holds one: B, needed
    # last, is the one lost.
    assert hit_rate_bound([A, A, B, B, A, B], entries=2, kill_at=4, lost=1) == pytest.approx(3 / 6)
    # Four entries, two held: the replica left holds both, and they hit after the kill.
    assert hit_rate_bound([A, B, A, B], entries=4, kill_at=2, lost=2) == pytest.approx(2 / 4)
    # One entry from request 2 on: A hits at 2 and 4, B never again.
    assert hit_rate_bound([A, B, A, B, A, B], entries=2, kill_at=2, entries_after_kill=1) == pytest.approx(2 / 6)
    assert hit_rate_bound([A, B, A, B, A, B], entries=2, kill_at=2) == pytest.approx(4 / 6)


def test_a_replacement_adds_its_room_from_the_first_request_it_serves():
    # A kept at the kill (needed sooner), B lost. Replaced before request 3: B is built again
    # there and kept, and both hit after. Replaced only before request 4: B was built at 3
    # with room for one and not kept (A is needed sooner), so it misses at 5 too.
    stream = [A, B, A, B, A, B]
    assert hit_rate_bound(stream, entries=2, kill_at=2, lost=1) == pytest.approx(3 / 6)
    assert hit_rate_bound(stream, entries=2, kill_at=2, lost=1, replaced_at=2) == pytest.approx(3 / 6)
    assert hit_rate_bound(stream, entries=2, kill_at=2, lost=1, replaced_at=3) == pytest.approx(3 / 6)
    assert hit_rate_bound(stream, entries=2, kill_at=2, lost=1, replaced_at=4) == pytest.approx(2 / 6)
    # Never within the stream: as a fleet that is not replaced.
    assert hit_rate_bound(stream, entries=2, kill_at=2, lost=1, replaced_at=6) == pytest.approx(
        hit_rate_bound(stream, entries=2, kill_at=2, lost=1, entries_after_kill=1))


@pytest.mark.parametrize("arguments, named", [
    ({"stream": [], "entries": 2}, "stream=[]"),
    ({"stream": [A], "entries": 0}, "entries=0"),
    ({"stream": [A, B], "entries": 1, "lost": 1}, "without kill_at"),
    ({"stream": [A, B], "entries": 2, "kill_at": 1, "lost": 2}, "lost=2: expected fewer"),
    ({"stream": [A, B], "entries": 1, "counted_from": 2}, "counted_from=2"),
    ({"stream": [A, B], "entries": 1, "kill_at": -1}, "kill_at=-1"),
    ({"stream": [A, B], "entries": 1, "kill_at": 5}, "kill_at=5"),
    ({"stream": [A, B], "entries": 1, "kill_at": 1, "entries_after_kill": 0}, "entries_after_kill=0"),
    ({"stream": [A, B], "entries": 1, "replaced_at": 1}, "replaced_at=1 without kill_at"),
    ({"stream": [A, B, A], "entries": 2, "kill_at": 2, "lost": 1, "replaced_at": 1}, "replaced_at=1: expected a "
                                                                                      "request index from kill_at=2"),
    ({"stream": [A, B, A], "entries": 2, "kill_at": 1, "lost": 1, "replaced_at": 4}, "replaced_at=4: expected"),
])
def test_bad_arguments_are_named(arguments, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        hit_rate_bound(**arguments)


@pytest.mark.parametrize("arguments, named", [
    ({"stream": [A], "entries": 2.5}, "entries=2.5: expected an int"),
    ({"stream": [A, B], "entries": 1, "kill_at": 1, "lost": True}, "lost=True: expected an int"),
    ({"stream": [A, B], "entries": 2, "kill_at": 1, "lost": 1, "replaced_at": 1.5}, "replaced_at=1.5: expected an int"),
])
def test_arguments_of_another_type_are_named(arguments, named):
    with pytest.raises(TypeError, match=named):
        hit_rate_bound(**arguments)


@pytest.mark.parametrize("kill, restart_s", [(None, 5.0), (0.5, 5.0), (0.5, 20.0)])
@pytest.mark.parametrize("sides, replicas, per_replica", [
    # benchmarks/fleet_policy.py's res-convnet fleet: two entries a replica, six in all
    ([(256, 256), (256, 192), (192, 256), (192, 192), (128, 256), (256, 128)], 3, 2),
    # more room than sizes: the replica left holds every size when one is killed
    ([(256, 256), (256, 192), (192, 256)], 2, 3),
])
def test_no_router_of_the_simulated_fleet_beats_it(kill, restart_s, sides, replicas, per_replica):
    sizes = {side: SizeCost(54 * MiB, 7.0) for side in sides}
    for seed in range(12):
        fleet = SimulatedFleet(sizes, replicas=replicas, budget=int((per_replica + 0.5) * 54 * MiB), requests=120,
                               clients=2, restart_s=restart_s, kill_at_fraction=kill, seed=seed)
        stream = fleet.stream()
        kill_at = None if kill is None else int(kill * len(stream))
        bound = hit_rate_bound(stream, entries=replicas * per_replica,
                               counted_from=int(fleet.warm_up_fraction * len(stream)), kill_at=kill_at,
                               lost=0 if kill is None else per_replica)
        for router in ("affinity", "default"):
            report = simulate_fleet(fleet, router)
            assert report.hit_rate <= bound + 1e-9, (seed, router)
            if kill is not None:  # the replacement's room only from the first request it served
                as_run = hit_rate_bound(stream, entries=replicas * per_replica,
                                        counted_from=int(fleet.warm_up_fraction * len(stream)), kill_at=kill_at,
                                        lost=per_replica,
                                        replaced_at=len(stream) if report.replaced_at is None else report.replaced_at)
                assert report.hit_rate <= as_run + 1e-9 <= bound + 2e-9, (seed, router)
