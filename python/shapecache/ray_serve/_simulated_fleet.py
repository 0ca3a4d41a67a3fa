"""A simulated fleet: replicas with LRU caches under byte budgets, build times, one model
call at a time each, routing-stats periods, a Zipf stream of sizes sent by a few clients (each
sends its next request when its last is answered) and a replica killed half-way, routed by the
size-affinity policy (``Placement``, as ``SizeAffinityRouter`` calls it) or by Ray's default
policy (power of two choices). It imports neither Ray nor torch, runs a stream of thousands of
requests in a fraction of a second, and reports hit rate and queueing.

What it models of Ray Serve (2.60) and of a replica:
- Ray's router sends a request to the first rank with a replica under
  ``max_ongoing_requests`` (the one with the shortest queue within the rank), else retries
  after `backoff_s`; the default policy takes the shorter queue of two replicas drawn at
  random. A killed replica's requests are retried at once; Serve starts a replacement
  `restart_s` later, with an empty cache, which pre-warms where `prewarm_s` is set: the sizes
  in ``prewarm_order`` (what is requested and no live replica holds first, then the most
  requested, as the replicas' last publications say, read again before each size, starting
  once the replicas that missed a publication are decided: ``decided_at``), one at a time,
  `prewarm_s` each (a package's load from the shared directory, or a build), while the next
  fits its budget; a size being pre-warmed is published as building, as ``CachedReplica``
  does.
- A replica runs its admitted requests one model call at a time (a CPU replica's calls share
  its cores; a GPU replica's share its device). A size it holds is a hit (`hit_s`); one it
  does not is built inline in the call (`build_s` more) or, with ``build="background"``,
  served uncached (`uncached_s`) while its compiler builds it, one build at a time. Where
  `publish_s` is set, a size's package is in the shared directory that long after its first
  build ends, and a replica that lacks the size from then on loads it (`load_s`) in place of
  the build; a load is a miss, as a build is. An entry is kept while its bytes fit the budget
  beside what is held, the least recently used going first.
- A replica publishes what ``CachedReplica.record_routing_stats`` does every `stats_period_s`
  (each at its own phase): the sizes held or being served, bytes, builds in flight, the
  bytes of each size, the requests of each and its period.

What it does not model: the GIL and queue-length probes answered late (``spill_after_s``),
memory other than the cache's, several routers, what a pre-warm costs the replica's own calls
(its thread shares the replica's cores) and a pre-warm before the replica is ready
(``prewarm="inline"``, the default on CUDA, during which Serve routes nothing to it), and
``prewarm_limit`` (each replacement pre-warms while sizes fit).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field, replace

from shapecache.ray_serve._placement import Placement, ReplicaState
from shapecache.ray_serve._prewarm_order import decided_at, live, prewarm_order

__all__ = ["FleetReport", "SimulatedFleet", "SizeCost", "simulate_fleet"]

Size = tuple[int, ...]


@dataclass(frozen=True)
class SizeCost:
    """What one size costs a replica: its entry's bytes, its build's seconds, and the seconds a
    load of its package from the shared directory takes, once one is there."""

    bytes: int
    build_s: float
    load_s: float = 0.5


@dataclass(frozen=True)
class SimulatedFleet:
    """The fleet and its stream. Times are seconds of simulated time."""

    sizes: dict  # size -> SizeCost
    replicas: int = 3
    budget: int = 0  # bytes per replica
    max_ongoing_requests: int = 4
    build: str = "inline"  # or "background"
    hit_s: float = 0.2
    uncached_s: float = 0.6
    stats_period_s: float = 2.0
    backoff_s: float = 0.1
    requests: int = 3000
    clients: int = 3  # each sends the stream's next request when its last is answered
    zipf_s: float = 1.1
    warm_up_fraction: float = 0.2  # requests before this fraction of the stream are not counted
    kill_at_fraction: float | None = 0.5  # a replica is killed when this fraction has arrived
    restart_s: float = 60.0
    prewarm_s: float | None = None  # seconds a replacement takes to pre-warm a size; None: it pre-warms none
    # seconds from the end of a size's first build to its package in the shared directory,
    # after which a replica that lacks the size loads it (SizeCost.load_s) instead of building
    # it; None: never (a graph that is not shared, or a publication the stream outlasts)
    publish_s: float | None = None
    seed: int = 0

    def stream(self) -> list[Size]:
        """`requests` sizes drawn with Zipf weights, the first size the most requested."""
        rng = random.Random(self.seed)
        sizes = list(self.sizes)
        weights = [1 / (rank + 1) ** self.zipf_s for rank in range(len(sizes))]
        return rng.choices(sizes, weights, k=self.requests)


@dataclass
class _Replica:
    rid: str
    budget: int
    entries: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # size -> bytes, LRU first
    admitted: collections.deque = field(default_factory=collections.deque)  # requests waiting for the model
    running: object = None
    building: collections.Counter = field(default_factory=collections.Counter)  # sizes not held when admitted
    builds_ready_at: float = 0.0  # when its compiler is free (background)
    pending: set = field(default_factory=set)  # sizes building in the background
    published: ReplicaState | None = None
    alive: bool = True
    evicted: collections.Counter = field(default_factory=collections.Counter)  # size -> times evicted
    requests: collections.Counter = field(default_factory=collections.Counter)  # size -> requests admitted

    def queue(self) -> int:
        return len(self.admitted) + (self.running is not None)

    def keep(self, size: Size, nbytes: int) -> int:
        """Caches `size`, evicting the least recently used; returns how many were evicted."""
        if size in self.entries:  # (a request built it while the pre-warm did, or the other way)
            self.entries.move_to_end(size)
            return 0
        if nbytes > self.budget:
            return 0
        evicted = 0
        while sum(self.entries.values()) + nbytes > self.budget:
            self.evicted[self.entries.popitem(last=False)[0]] += 1
            evicted += 1
        self.entries[size] = nbytes
        return evicted

    def publish(self, now: float) -> None:
        serving = {r.size for r in self.admitted} | ({self.running.size} if self.running else set())
        held = sum(self.entries.values())
        listed = frozenset(self.entries) | frozenset(serving) | frozenset(self.pending)  # held, served, building
        self.published = ReplicaState(
            self.rid, listed, held, self.budget, len(self.entries), len(self.pending), now,
            building=max(0, len(self.building) - len(self.pending)), size_bytes=dict(self.entries),
            evicted=dict(self.evicted), requests=dict(self.requests),
            period_s=None if self.published is None else now - self.published.published_at)


@dataclass
class _Request:
    size: Size
    arrived: float
    index: int
    started: float = math.nan
    finished: float = math.nan
    hit: bool = False
    builds: bool = False  # its size was not held when its replica admitted it


@dataclass
class FleetReport:
    """What a run measured. Hit rate, latencies and waits count the requests after warm-up."""

    router: str
    hit_rate: float
    p50_s: float
    p99_s: float
    mean_wait_s: float  # from arrival to the model call's start: routing and the replica's queue
    evictions: int
    builds: int  # builds that compiled (loads of a published package are `loads`)
    # the killed replica's sizes -> seconds from their first request after the kill to their first hit
    rehomed_s: dict
    # what the replacement pre-warmed, in order, and how many of those no live replica's
    # publication listed when the pre-warm chose them
    prewarmed: tuple = ()
    prewarmed_held_nowhere: int = 0
    loads: int = 0
    # the index of the first request from the kill's on that the replacement served
    # (hit_rate_bound's replaced_at); None without a kill, or where it served none
    replaced_at: int | None = None


def simulate_fleet(fleet: SimulatedFleet, router: str, stream: list[Size] | None = None,
                   placement: Placement | None = None) -> FleetReport:
    """Runs `stream` (default: ``fleet.stream()``) through the fleet, routed by "affinity"
    (`placement`, default a new ``Placement``) or "default" (power of two choices)."""
    if router not in ("affinity", "default"):
        raise ValueError(f"router={router!r}: expected 'affinity' or 'default'")
    if fleet.prewarm_s is not None and not fleet.prewarm_s > 0:
        raise ValueError(f"prewarm_s={fleet.prewarm_s!r}: expected a positive number of seconds a size, or None")
    if fleet.publish_s is not None and not 0 <= fleet.publish_s < math.inf:
        raise ValueError(f"publish_s={fleet.publish_s!r}: expected the seconds from a size's first build to its "
                         "package in the shared directory (0 or more), or None")
    stream = fleet.stream() if stream is None else stream
    rng = random.Random(fleet.seed + 1)
    placement = Placement() if placement is None else placement
    replicas: list[_Replica] = []
    events: list = []
    order = itertools.count()  # ties in time go in the order scheduled

    def at(when: float, what: str, *args) -> None:
        heapq.heappush(events, (when, next(order), what, args))

    def start_replica(now: float) -> None:
        replica = _Replica(f"r{len(replicas)}", fleet.budget)
        replicas.append(replica)
        at(now + rng.uniform(0, fleet.stats_period_s), "publish", replica)

    for _ in range(fleet.replicas):
        start_replica(0.0)
    first_ids = {r.rid for r in replicas}  # any other replica is a replacement
    unsent = iter(enumerate(stream))

    def send(now: float) -> None:
        sent = next(unsent, None)
        if sent is not None:
            at(now, "route", _Request(sent[1], now, sent[0]))

    for _ in range(fleet.clients):
        send(0.0)
    kill_index = None if fleet.kill_at_fraction is None else int(fleet.kill_at_fraction * len(stream))
    killed_at, killed_sizes = None, set()
    first_request: dict = {}
    first_hit: dict = {}
    done: list[_Request] = []
    evictions = builds = loads = 0
    built: collections.Counter = collections.Counter()  # size -> builds on request: the sizes record
    package_at: dict = {}  # size -> when its package is in the shared directory
    prewarmed: list = []
    prewarmed_held_nowhere = 0
    replaced_at = None

    def publications() -> list[ReplicaState]:
        """Each replica's last publication, the dead ones' included (their files stay)."""
        return [r.published for r in replicas if r.published is not None]

    def admit(replica: _Replica, request: _Request, now: float) -> None:
        replica.requests[request.size] += 1
        request.builds = request.size not in replica.entries
        if request.builds:
            replica.building[request.size] += 1
        replica.admitted.append(request)
        if replica.running is None:
            run_next(replica, now)

    def build_s(size: Size, now: float) -> float:
        """What the build of `size` that starts `now` takes: a load where its package is there."""
        nonlocal builds, loads
        built[size] += 1
        if package_at.get(size, math.inf) <= now:
            loads += 1
            return fleet.sizes[size].load_s
        builds += 1
        return fleet.sizes[size].build_s

    def compiled(size: Size, now: float) -> None:
        """A build of `size` ended `now`: its package is published, where it is the first."""
        if fleet.publish_s is not None and size not in package_at:
            package_at[size] = now + fleet.publish_s

    def run_next(replica: _Replica, now: float) -> None:
        if not replica.admitted:
            replica.running = None
            return
        request = replica.running = replica.admitted.popleft()
        request.started = now
        if request.size in replica.entries:
            request.hit = True
            replica.entries.move_to_end(request.size)
            seconds = fleet.hit_s
        elif fleet.build == "inline":
            seconds = build_s(request.size, now) + fleet.hit_s
        else:
            seconds = fleet.uncached_s
            if request.size not in replica.pending:
                replica.pending.add(request.size)
                start = max(now, replica.builds_ready_at)
                replica.builds_ready_at = start + build_s(request.size, start)
                at(replica.builds_ready_at, "built", replica, request.size)
        at(now + seconds, "finish", replica, request)

    def route(request: _Request, now: float) -> None:
        alive = [r for r in replicas if r.alive]
        ranks = None
        if router == "affinity":
            states = []
            for r in alive:
                states.append(replace(r.published or ReplicaState(r.rid),
                                     full=r.queue() >= fleet.max_ongoing_requests))
            ranks = placement.rank(request.size, states, now, waited_s=now - request.arrived)
            if ranks is not None:
                placement.routed(request.size, ranks[0][0], now)
        if ranks is None:
            ranks = [[r.rid for r in rng.sample(alive, k=min(2, len(alive)))]]
        by_id = {r.rid: r for r in alive}
        for rank in ranks:
            open_ = [by_id[rid] for rid in rank if by_id[rid].queue() < fleet.max_ongoing_requests]
            if open_:
                chosen = min(open_, key=lambda r: r.queue())
                placement.routed(request.size, chosen.rid, now)
                placement.requested(request.size, now)
                admit(chosen, request, now)
                return
        at(now + fleet.backoff_s, "route", request)

    while len(done) < len(stream):  # (replicas publish for ever)
        now, _, what, args = heapq.heappop(events)
        if what == "route":
            request = args[0]
            if kill_index is not None and killed_at is None and request.index >= kill_index:
                victim = max((r for r in replicas if r.alive), key=lambda r: len(r.entries))
                victim.alive, killed_at, killed_sizes = False, now, set(victim.entries)
                retried = [victim.running, *victim.admitted] if victim.running else list(victim.admitted)
                victim.admitted.clear()
                victim.running = None
                placement.keep_only(r.rid for r in replicas if r.alive)
                for lost in retried:
                    at(now, "route", lost)
                at(now + fleet.restart_s, "restart")
            if killed_at is not None and request.size in killed_sizes:
                first_request.setdefault(request.size, now)
            route(request, now)
        elif what == "restart":
            start_replica(now)
            if fleet.prewarm_s is not None:  # once the replicas that missed a publication are decided
                at(decided_at(publications(), now), "prewarm", replicas[-1], set())
        elif what == "prewarm":  # the replica's pre-warm chooses its next size, while one fits
            replica, tried = args
            published = publications()
            size = next((s for s in prewarm_order(built, published, now) if s not in tried), None)
            if replica.alive and size is not None:
                tried.add(size)
                if size in replica.entries or size in replica.pending:
                    at(now, "prewarm", replica, tried)
                elif sum(replica.entries.values()) + fleet.sizes[size].bytes <= replica.budget:
                    replica.building[size] += 1
                    lacking = not any(size in p.sizes for p in published if live(p, now))
                    at(now + fleet.prewarm_s, "prewarmed", replica, tried, size, lacking)
        elif what == "prewarmed":
            replica, tried, size, lacking = args
            replica.building[size] -= 1
            if not replica.building[size]:
                del replica.building[size]
            if replica.alive:
                evictions += replica.keep(size, fleet.sizes[size].bytes)
                prewarmed.append(size)
                prewarmed_held_nowhere += lacking
                at(now, "prewarm", replica, tried)
        elif what == "publish":
            replica = args[0]
            if replica.alive:
                replica.publish(now)
                at(now + fleet.stats_period_s, "publish", replica)
        elif what == "built":
            replica, size = args
            replica.pending.discard(size)
            if replica.alive:
                compiled(size, now)
                evictions += replica.keep(size, fleet.sizes[size].bytes)
        elif what == "finish":
            replica, request = args
            if not replica.alive or replica.running is not request:
                continue  # killed meanwhile: retried elsewhere
            if request.builds:
                replica.building[request.size] -= 1
                if not replica.building[request.size]:
                    del replica.building[request.size]
            if not request.hit and fleet.build == "inline":
                compiled(request.size, now)
                evictions += replica.keep(request.size, fleet.sizes[request.size].bytes)
            request.finished = now
            done.append(request)
            if replica.rid not in first_ids and request.index >= kill_index:
                replaced_at = request.index if replaced_at is None else min(replaced_at, request.index)
            if request.hit and request.size in first_request:
                first_hit.setdefault(request.size, now - first_request[request.size])
            run_next(replica, now)
            send(now)

    counted = [r for r in done if r.index >= fleet.warm_up_fraction * len(stream)] or done
    latencies = sorted(r.finished - r.arrived for r in counted)
    return FleetReport(
        router=router,
        hit_rate=sum(r.hit for r in counted) / len(counted),
        p50_s=latencies[len(latencies) // 2],
        p99_s=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        mean_wait_s=sum(r.started - r.arrived for r in counted) / len(counted),
        evictions=evictions,
        builds=builds,
        rehomed_s={size: first_hit.get(size, math.inf) for size in sorted(first_request)},
        prewarmed=tuple(prewarmed),
        prewarmed_held_nowhere=prewarmed_held_nowhere,
        loads=loads,
        replaced_at=replaced_at,
    )
