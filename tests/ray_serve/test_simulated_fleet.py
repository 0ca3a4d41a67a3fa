"""The size-affinity policy in a simulated fleet (shapecache/ray_serve/_simulated_fleet.py): no
Ray, no torch, a few seconds. The fleet is the one the Ray benchmark runs on 2 cores: three
replicas, six sizes whose entries take 100-306 MiB and 20-61 s to build, a budget of 2.5 mean
entries per replica, three clients, a replica killed half-way and replaced a minute later."""

from __future__ import annotations

import statistics

import pytest

from shapecache.ray_serve import SimulatedFleet, SizeCost, simulate_fleet

MiB = 1 << 20
SIDES = [(512, 512), (640, 640), (768, 768), (512, 768), (768, 512), (896, 896)]
SIZES = {s: SizeCost(int(s[0] * s[1] / 512 / 512 * 100 * MiB), 20 * s[0] * s[1] / 512 / 512) for s in SIDES}
BUDGET = int(2.5 * statistics.mean(c.bytes for c in SIZES.values()))
SEEDS = range(5)


def runs(build: str, router: str, **fleet) -> list:
    return [simulate_fleet(SimulatedFleet(SIZES, budget=BUDGET, build=build, requests=4000, seed=seed, **fleet), router)
            for seed in SEEDS]


def test_one_replica_that_holds_every_size_builds_each_once():
    fleet = SimulatedFleet(SIZES, replicas=1, budget=10 * BUDGET, requests=500, kill_at_fraction=None, warm_up_fraction=0)
    for router in ("affinity", "default"):
        report = simulate_fleet(fleet, router)
        assert report.builds == len(set(fleet.stream())) and report.evictions == 0
        assert report.hit_rate == 1 - report.builds / 500


def test_with_a_replica_killed_affinity_keeps_its_hits_and_its_tail_where_the_default_router_builds_half_its_requests():
    affinity, default = runs("inline", "affinity"), runs("inline", "default")
    assert statistics.mean(r.hit_rate for r in affinity) >= 0.95
    assert statistics.mean(r.hit_rate for r in default) <= 0.6
    assert statistics.median(r.p99_s for r in affinity) <= 0.5 * statistics.median(r.p99_s for r in default)
    # the killed replica's sizes were placed again and served as hits
    assert all(seconds < float("inf") for r in affinity for seconds in r.rehomed_s.values())


def test_a_replacement_that_prewarms_builds_what_no_live_replica_holds_and_keeps_the_goals():
    affinity = runs("inline", "affinity", prewarm_s=0.5)  # each size a package's load
    assert statistics.mean(r.hit_rate for r in affinity) >= 0.95
    assert all(r.prewarmed and len(r.prewarmed) == len(set(r.prewarmed)) for r in affinity)
    # the sizes its predecessor held, or the survivors evicted, that were requested; also where the
    # replacement starts while its predecessor's silence is short of gone (it waits: decided_at)
    assert any(r.prewarmed_held_nowhere for r in affinity)
    assert any(r.prewarmed_held_nowhere for r in runs("inline", "affinity", prewarm_s=0.5, restart_s=5.0))
    with pytest.raises(ValueError, match="prewarm_s=-1"):
        simulate_fleet(SimulatedFleet(SIZES, budget=BUDGET, requests=10, prewarm_s=-1), "affinity")


def test_a_size_whose_package_is_published_is_loaded_not_built_again():
    # The res-convnet fleet of benchmarks/ray_serve.py: six sizes of 54 MiB and 7 s builds, two
    # entries per replica, two clients, a replacement 5 s after the kill
    sizes = {s: SizeCost(54 * MiB, 7.0, load_s=0.5) for s in SIDES}
    fleet = {"budget": 136 * MiB, "clients": 2, "restart_s": 5.0, "requests": 300}
    never = [simulate_fleet(SimulatedFleet(sizes, seed=seed, **fleet), "affinity") for seed in SEEDS]
    at_once = [simulate_fleet(SimulatedFleet(sizes, seed=seed, publish_s=0.0, **fleet), "affinity") for seed in SEEDS]
    assert all(r.loads == 0 for r in never)
    # each size compiles once in the fleet; every later build, after an eviction or the kill, loads
    assert all(r.builds == len(SIDES) and r.loads > 0 for r in at_once)
    # so with the kill no request waits for a compile after warm-up: p99 is a load, not a build
    assert statistics.median(r.p99_s for r in never) >= 7.0
    assert statistics.median(r.p99_s for r in at_once) < 7.0 / 2
    with pytest.raises(ValueError, match="publish_s=-1"):
        simulate_fleet(SimulatedFleet(sizes, publish_s=-1, **fleet), "affinity")


@pytest.mark.parametrize("kill_at_fraction", [None, 0.5])
def test_with_background_builds_no_request_waits_for_a_build(kill_at_fraction):
    # A request waits at most for the requests ahead of it, each served uncached or as a hit.
    for report in runs("background", "affinity", kill_at_fraction=kill_at_fraction):
        assert report.p99_s <= 3 * SimulatedFleet.uncached_s + SimulatedFleet.backoff_s
        assert report.hit_rate >= 0.7


def test_a_simulation_rejects_a_router_it_does_not_know():
    with pytest.raises(ValueError, match="router='random'"):
        simulate_fleet(SimulatedFleet(SIZES, budget=BUDGET, requests=10), "random")
