"""The size-affinity policy against Ray's default router, in a simulated fleet (no Ray, no
torch: shapecache/ray_serve/_simulated_fleet.py), with and without a replica killed half-way.

    python benchmarks/fleet_policy.py [--fleet diffusion|res-convnet] [--seeds 10] [--requests 4000]
                                      [--replicas 3] [--budget-entries 2.5] [--prewarm-s SECONDS]
                                      [--publish-s SECONDS] [--load-s SECONDS] [--build-factor 1]

`--fleet diffusion` (the default): six sizes from 512x512 to 896x896 whose entries take
100 MiB per 512x512 of area and 20 s per 512x512 to build, three clients, a budget of
`--budget-entries` mean entries per replica, and, with the kill, a replacement replica a
minute later with an empty cache. `--fleet res-convnet`: the fleet of
`benchmarks/ray_serve.py --sizes 6 --replicas 3 --kill --budget-mib 136` as measured there:
six sizes whose frozen entries take 54 MiB and 7 s to build, 136 MiB per replica (two
entries), two clients, a replacement 5 s after the kill. `--prewarm-s S`: the replacement
pre-warms (``prewarm_order``: what no live replica holds first), S seconds a size (a package's
load: under a second; a build: `build_s`); by default it starts empty. `--publish-s S`: a
size's package is in the shared directory S seconds after its first build ends (0: the build's
own package), and a replica that lacks the size then loads it in `--load-s` seconds (default
0.5) instead of building it; by default no package is published. `--build-factor F`: every
build takes F times as long (a build that compiles its package where another compiles a
graph). Each
router runs the same streams (Zipf, s=1.1), one per seed; inline builds (a miss waits for its
build) and background builds (a miss is served uncached while the replica's compiler builds).

Printed per build mode, kill and router: the hit rate after warm-up (mean and worst seed),
p50 and p99 latency (medians over seeds; queueing included), builds and evictions (means),
and the seconds from each of the killed replica's sizes' first request after the kill to its
first hit elsewhere (median, worst). Last, what one routing choice costs the router's loop.
"""

from __future__ import annotations

import argparse
import math
import statistics

from shapecache.ray_serve import SimulatedFleet, SizeCost, hit_rate_bound, simulate_fleet

MiB = 1 << 20
SIDES = [(512, 512), (640, 640), (768, 768), (512, 768), (768, 512), (896, 896)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", choices=("diffusion", "res-convnet"), default="diffusion")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--budget-entries", type=float, default=2.5)
    parser.add_argument("--prewarm-s", type=float, default=None)
    parser.add_argument("--publish-s", type=float, default=None)
    parser.add_argument("--load-s", type=float, default=0.5)
    parser.add_argument("--build-factor", type=float, default=1.0)
    args = parser.parse_args(argv)
    if not (args.load_s > 0 and args.build_factor > 0):
        parser.error(f"--load-s={args.load_s}, --build-factor={args.build_factor}: expected positive numbers")
    if args.fleet == "diffusion":
        sizes = {s: SizeCost(int(s[0] * s[1] / 512 / 512 * 100 * MiB), 20 * s[0] * s[1] / 512 / 512 * args.build_factor,
                             args.load_s) for s in SIDES}
        fleet = {"clients": 3, "restart_s": 60.0}
    else:
        sizes = {s: SizeCost(54 * MiB, 7.0 * args.build_factor, args.load_s) for s in [(256, 256), (256, 192), (192, 256), (192, 192), (128, 256),
                                                      (256, 128)]}
        fleet = {"clients": 2, "restart_s": 5.0}
    budget = int(args.budget_entries * statistics.mean(c.bytes for c in sizes.values()))
    prewarm = "empty" if args.prewarm_s is None else f"pre-warming {args.prewarm_s:g} s a size"
    published = ("no packages" if args.publish_s is None
                 else f"packages published {args.publish_s:g} s after a size's first build, loaded in {args.load_s:g} s")
    print(f"{args.replicas} replicas, budget {budget / MiB:.0f} MiB each, {len(sizes)} sizes, "
          f"{args.requests} requests, {args.seeds} seeds, the replacement {prewarm}, {published}, "
          f"builds x{args.build_factor:g}")
    print(f"{'build':<11}{'kill':<6}{'router':<10}{'hit rate':>9}{'worst':>7}{'p50 s':>8}{'p99 s':>8}"
          f"{'builds':>8}{'loads':>7}{'evicted':>8}{'re-homed s':>12}{'worst':>8}")
    for build in ("inline", "background"):
        for kill in (None, 0.5):
            p99 = {}
            for router in ("default", "affinity"):
                reports = [simulate_fleet(SimulatedFleet(sizes, replicas=args.replicas, budget=budget, build=build,
                                          requests=args.requests, kill_at_fraction=kill, seed=seed,
                                                         prewarm_s=args.prewarm_s, publish_s=args.publish_s,
                                                         **fleet), router)
                           for seed in range(args.seeds)]
                rehomed = [s for r in reports for s in r.rehomed_s.values()] or [math.nan]
                p99[router] = statistics.median(r.p99_s for r in reports)
                print(f"{build:<11}{'yes' if kill else 'no':<6}{router:<10}"
                      f"{statistics.mean(r.hit_rate for r in reports):>9.3f}{min(r.hit_rate for r in reports):>7.3f}"
                      f"{statistics.median(r.p50_s for r in reports):>8.2f}{p99[router]:>8.2f}"
                      f"{statistics.mean(r.builds for r in reports):>8.1f}{statistics.mean(r.loads for r in reports):>7.1f}"
                      f"{statistics.mean(r.evictions for r in reports):>8.1f}"
                      f"{statistics.median(rehomed):>12.1f}{max(rehomed):>8.1f}")
            print(f"{'':<27}p99 affinity / default: {p99['affinity'] / p99['default']:.2f}")
            if build == "inline":
                bounds = [bound(args, sizes, budget, kill, seed) for seed in range(args.seeds)]
                print(f"{'':<27}the bound for any router (hit_rate_bound): {statistics.mean(bounds):.3f}, "
                      f"worst {min(bounds):.3f}")
    held, new = rank_cost()
    print(f"the router's cost per request (Placement.rank; 8 replicas, 4096 sizes remembered, one process): "
          f"held size {held:.2f} ms, new size {new:.2f} ms")
    return 0


def bound(args, sizes: dict, budget: int, kill: float | None, seed: int) -> float:
    """`hit_rate_bound` of a seed's stream: the fleet's entries pooled (as many as each budget
    holds of the smallest), the killed replica's lost at the kill and its replacement's room
    there at once."""
    per_replica = budget // min(c.bytes for c in sizes.values())
    fleet = SimulatedFleet(sizes, requests=args.requests, seed=seed)
    stream = fleet.stream()
    return hit_rate_bound(stream, entries=args.replicas * per_replica,
                          counted_from=int(fleet.warm_up_fraction * len(stream)),
                          kill_at=None if kill is None else int(kill * len(stream)),
                          lost=0 if kill is None else per_replica)


def rank_cost(replica_count: int = 8, remembered: int = 4096, ranks: int = 200) -> tuple:
    """Milliseconds per Placement.rank on the router's loop, with as many sizes remembered as
    it keeps (homes and request rates): for a size a replica was sent, and for a new size."""
    import time

    from shapecache.ray_serve import Placement, ReplicaState

    now = 1000.0
    replicas = [ReplicaState(f"r{i}", sizes=frozenset({(64 * i, 64)}), bytes=10, budget=1000, entries=1,
                             published_at=now - 1, size_bytes={(64 * i, 64): 10}) for i in range(replica_count)]
    placement = Placement()
    for k in range(remembered):
        placement.routed((k, k + 1), f"r{k % replica_count}", now - 0.5)
        placement.requested((k, k + 1), now - 0.5)
    timings = []
    for sizes in ([(k * 20 % remembered, k * 20 % remembered + 1) for k in range(ranks)],
                  [(10**6 + k, 1) for k in range(ranks)]):
        start = time.perf_counter()
        for size in sizes:
            placement.rank(size, replicas, now)
        timings.append((time.perf_counter() - start) / ranks * 1e3)
    return tuple(timings)


if __name__ == "__main__":
    raise SystemExit(main())
