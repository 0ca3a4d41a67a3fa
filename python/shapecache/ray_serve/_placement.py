"""Where a request of a given size goes: the size-affinity policy, a plain function of the
request's size, what each replica published and this router's own recent choices. It imports
neither Ray nor torch; ``_router.py`` adapts it to Ray Serve's ``RequestRouter``.

The rules, in the order they are applied:

1. A request without a size, or one routed while no replica has published fresh stats and
   this router has no home for the size, is left to Ray's default policy (``rank`` returns
   None).
2. A size's homes are the replicas whose fresh stats list it, and the replica this router
   last sent it to (stats lag by up to one period, so the router's own choices fill the
   gap; a choice is remembered from the moment it is offered to Ray, so a burst of new sizes
   spreads). A home whose publication omits the size more than HOME_GRACE_S after it was
   sent there evicted it: the router counts the eviction against that replica and forgets
   the home. Held sizes go to their homes, the one not full and with the most room first,
   and a size several hold to the one rule 3's plan places it on (among holders, the one it
   placed it on before) while that one holds its entries, is not full and builds nothing, the
   other holders in the next rank (a second copy, left by a kill or a spill-over, then ages
   out and makes room); but
   where no home holds the size's entries or builds them (a home that lists a size it
   evicted before counts as not building it) and rule 3's plan places it on another replica
   that takes new sizes, it goes there: a home that keeps evicting a size gives it up to the
   replica the plan made room on.
3. A size without a home is new (or evicted, or its home died). It goes to its place in the
   plan, where that replica takes new sizes (3a). The plan places the sizes requested in the
   last few TRAFFIC_HALF_LIFE_S, those some replica holds first (each move is a build), the
   most requested first among them, each on a replica where it fits beside the sizes placed
   before it: the replica that holds it (of several, the one it was planned on before), else
   the one this router last sent it to (it may
   be building it), else the one with the least traffic placed, then the most room. Only replicas with fresh stats are
   planned for, and the plan is made again every PLAN_PERIOD_S: a replica that died leaves
   it, a new one joins it, and the sizes that fit nowhere with one replica fewer are placed
   on the replacement. A size the plan has no place for (it fits nowhere beside hotter
   sizes) goes where it costs the fleet least, by these keys in order:
   a. not full (at ``max_ongoing_requests``) and taking new sizes: fresh stats, not over its
      budget, no build running in a request (an inline build holds the replica) and fewer
      than `max_pending_builds` background builds;
   b. the traffic it would displace: zero where the size's bytes fit in the replica's room,
      else the request rate of the least-requested sizes it holds whose bytes would have
      to go (LRU evicts the least recently used, which under a steady stream are these).
      A size's bytes are what a replica measured and published for it (the largest seen),
      else the fleet's mean entry; a replica's room is its budget minus what it holds minus
      the sizes it is serving without holding them yet and those this router sent it since
      it last published;
   c. fewer evictions of this size on that replica (as it published them, or this router
      saw them): a home that keeps evicting a size gives it up to a replica where it fits,
      or else to one that evicted it less;
   d. the least traffic already placed there (the request rate of the sizes it holds),
      then the most room, the fewest entries, and the replica id.
   Request rates are this router's own counts of routed requests per size, halved every
   TRAFFIC_HALF_LIFE_S.
4. A second rank holds the replicas left, in rule 3's order, which Ray's router tries when
   the first rank takes nothing (spill-over): at once for a new size (it is built wherever it
   goes) and for a held size whose homes are all at `max_ongoing_requests` (as the router
   last heard: a size whose traffic one replica cannot carry gets a second home, which then
   lists it); for a held size whose homes did not answer Ray's queue-length probe in time,
   after the request has waited `spill_after_s` (sending it elsewhere builds the size a
   second time). Ray backs off between its tries.
5. A replica that dies or leaves the deployment is forgotten (``keep_only``): its sizes have
   no home and are placed again by rule 3, the most requested first as their requests come.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

Size = tuple[int, ...]

# The routing stats a replica publishes (``record_routing_stats``) carry this format tag and
# version under FORMAT_KEY; stats without it (another deployment's, or none yet) are missing.
FORMAT_KEY = "shapecache"
# The sizes a router remembers placing, most recent kept: a stream of ever-new sizes must not
# grow it without end (a size forgotten is placed again as new).
MAX_HOMES = 4096
# How long a request waits for its size's homes before any replica may take it. Ray's router
# drops a replica whose queue-length probe is not answered in time (0.1 s, backing off to 1 s),
# and a replica that builds inline holds the GIL in long stretches, answering late: sending
# the request elsewhere then costs a second build of the size (tens of seconds on the CPU,
# minutes on a GPU), so it waits for a while first. A home at max_ongoing_requests is passed
# over at once.
SPILL_AFTER_S = 10.0
# A home is dropped when the replica publishes without the size at least this long after the
# size was sent to it: until then the size may still wait in the replica (queued behind other
# requests, or before the call that serves it), and the replica's clock may be ahead of the
# router's (another host).
HOME_GRACE_S = 30.0
# A size's request rate, as the router counts it, halves in this many seconds without
# requests: a size that was hot an hour ago weighs nothing in placing another.
TRAFFIC_HALF_LIFE_S = 120.0
# How often the plan of rule 3 is made again (it reads every size's traffic).
PLAN_PERIOD_S = 1.0
# Sizes whose request rate (requests per half-life) is below this are left out of the plan:
# they reserve no room.
PLANNED_RATE = 0.5
FORMAT_VERSION = 2
# What a replica's publication counts, as sc.stats names them.
COUNTS = ("calls", "hits", "misses", "builds", "evictions", "uncached_calls")


def remember(memory: dict, key, value, limit: int = MAX_HOMES) -> None:
    """Sets `memory[key] = value` as its most recent item; past `limit` items, the least
    recently set goes (the dict is in order of use)."""
    memory.pop(key, None)
    memory[key] = value
    if len(memory) > limit:
        del memory[next(iter(memory))]


class _SentTo:
    """`homes` by replica: replica id -> [(size, unix seconds sent)], read once per rank, when
    first asked (not once per replica)."""

    def __init__(self, homes: Mapping):
        self._homes, self._by_replica = homes, None

    def __getitem__(self, replica_id: str) -> list:
        if self._by_replica is None:
            self._by_replica = collections.defaultdict(list)
            for size, (rid, at) in self._homes.items():
                self._by_replica[rid].append((size, at))
        return self._by_replica.get(replica_id, [])


def _mean_entry(replicas: Iterable[ReplicaState]) -> float:
    """The mean bytes of an entry over `replicas` (0 where they hold none)."""
    replicas = list(replicas)
    entries = sum(r.entries for r in replicas)
    return sum(r.bytes for r in replicas) / entries if entries else 0.0


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{value} is not a time")
    return value


def _period(value: object) -> float | None:
    """A publication's period: None where it says none, or one that is no period (not above 0)."""
    if value is None:
        return None
    period = _finite(float(value))
    return period if period > 0 else None


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


def _by_size(value: object) -> dict:
    """{size: number} from a publication's [[size, number], ...]."""
    return {tuple(int(d) for d in size): int(number) for size, number in value}


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the router sees it: its id, what it last published and whether it can
    take a request now."""

    replica_id: str
    sizes: frozenset = frozenset()  # sizes it holds compiled entries for, or is serving now
    bytes: int = 0  # bytes its cache holds
    budget: int | None = None  # its cache's byte budget; None: no byte limit
    entries: int = 0
    pending_builds: int = 0  # background builds waiting or running
    published_at: float | None = None  # unix seconds; None: nothing (valid) published
    full: bool = False  # at max_ongoing_requests, as far as the router knows
    building: int = 0  # requests running now whose size it did not hold when they came (they build)
    size_bytes: Mapping = field(default_factory=dict)  # size -> bytes of the entries its calls used
    counts: Mapping = field(default_factory=dict)  # COUNTS, as its cache counted them
    evicted: Mapping = field(default_factory=dict)  # size -> times its entries were evicted here
    requests: Mapping = field(default_factory=dict)  # size -> requests of it started here since the replica started
    period_s: float | None = None  # seconds since its publication before this one; None: its first, or not said
    stopped: bool = False  # it published its last: Serve stopped it (a rolling update, a scale-down, a delete)

    @classmethod
    def from_routing_stats(cls, replica_id: str, stats: object, full: bool = False) -> ReplicaState:
        """The state of a replica from its published routing stats. Stats of another format,
        or malformed, count as missing: the replica is routed to, never trusted for sizes."""
        try:
            ours = stats.get(FORMAT_KEY) if isinstance(stats, Mapping) else None
            if not isinstance(ours, Mapping) or ours.get("version") != FORMAT_VERSION:
                return cls(replica_id, full=full)
            budget = ours.get("budget")
            counts = ours["counts"]
            return cls(
                replica_id,
                sizes=frozenset(tuple(int(d) for d in size) for size in ours["sizes"]),
                bytes=int(ours["bytes"]),
                budget=None if budget is None else int(budget),
                entries=int(ours["entries"]),
                pending_builds=int(ours["pending_builds"]),
                published_at=_finite(float(ours["published_at"])),
                full=full,
                building=int(ours["building"]),
                size_bytes=_by_size(ours["size_bytes"]),
                counts={name: int(counts[name]) for name in COUNTS},
                evicted=_by_size(ours["evicted"]),
                # (read as none where missing: a replica of an earlier release, in a rolling upgrade)
                requests=_by_size(ours.get("requests", ())),
                period_s=_period(ours.get("period_s")),
                stopped=_flag(ours.get("stopped", False)),
            )
        except (KeyError, TypeError, ValueError, OverflowError):
            return cls(replica_id, full=full)

    def fresh(self, now: float, max_age_s: float) -> bool:
        """Whether it published within `max_age_s` of `now`, before or after (the clocks of two
        nodes differ): stats stamped further ahead are a clock gone wrong, and stale."""
        return self.published_at is not None and abs(now - self.published_at) <= max_age_s

    def bytes_free(self) -> float:
        return math.inf if self.budget is None else self.budget - self.bytes


def routing_stats(sizes: Iterable[Size], figures: Mapping, published_at: float, building: int = 0,
                  size_bytes: Mapping | None = None, evicted: Mapping | None = None,
                  requests: Mapping | None = None, period_s: float | None = None, stopped: bool = False) -> dict:
    """What a replica publishes: the sizes it holds, its cache's figures (``sc.stats``:
    bytes, budget, entries, pending_builds and COUNTS), the requests building now, the
    bytes of each size held, how often each size was evicted and how many requests of each
    it started, the seconds since its last publication (None: this is its first) and whether
    it was stopped (this is its last), in the format ``ReplicaState`` reads."""
    return {
        FORMAT_KEY: {
            "version": FORMAT_VERSION,
            "sizes": sorted(list(size) for size in sizes),
            "bytes": int(figures["bytes"]),
            "budget": figures["budget"],
            "entries": len(figures["entries"]),
            "pending_builds": int(figures["pending_builds"]),
            "building": int(building),
            "size_bytes": sorted([list(size), int(nbytes)] for size, nbytes in (size_bytes or {}).items()),
            "counts": {name: int(figures[name]) for name in COUNTS},
            "evicted": sorted([list(size), int(times)] for size, times in (evicted or {}).items()),
            "requests": sorted([list(size), int(count)] for size, count in (requests or {}).items()),
            "published_at": published_at,
            "period_s": period_s,
            "stopped": bool(stopped),
        }
    }


@dataclass
class Placement:
    """This router's memory of where it sent each size, how often each size is requested and
    where each was evicted, and the policy that ranks replicas."""

    max_pending_builds: int = 2
    stats_max_age_s: float = 60.0
    spill_after_s: float = SPILL_AFTER_S
    # size -> (replica id, unix seconds): where this router last sent the size
    homes: dict = field(default_factory=dict)
    # size -> (requests, unix seconds): its request count, halved every TRAFFIC_HALF_LIFE_S, as of then
    traffic: dict = field(default_factory=dict)
    # size -> the bytes its entries took, the most any replica published
    size_bytes: dict = field(default_factory=dict)
    # size -> {replica id: times that replica evicted it}
    evictions: dict = field(default_factory=dict)
    # rule 3's plan: size -> replica id, and when it was made (unix seconds)
    plan: dict = field(default_factory=dict)
    planned_at: float = -math.inf

    def rank(self, size: Size | None, replicas: Sequence[ReplicaState], now: float,
             waited_s: float = 0.0) -> list[list[str]] | None:
        """Replica ids in ranks, most preferred first; None: route by Ray's default policy.
        `waited_s`: how long the request has waited to be routed."""
        if size is None or not replicas:
            return None
        fresh = {r.replica_id: r.fresh(now, self.stats_max_age_s) for r in replicas}
        self._learn_sizes(r for r in replicas if fresh[r.replica_id])
        holders = [r for r in replicas if self._holds(r, size, fresh[r.replica_id])]
        if not holders and not any(fresh.values()):
            return None
        sent = _SentTo(self.homes)
        order = self._new_size_order(size, replicas, fresh, now, sent)
        planned = None
        # The plan may move a size that no home holds or builds now; one a home lists without
        # holding it is building there, unless that home evicted it before (it keeps evicting it).
        if not any(fresh[r.replica_id] and size in r.sizes and (size in r.size_bytes or not r.evicted.get(size))
                   for r in holders):
            planned = self._planned(size, replicas, fresh, now)
            if planned is not None and order(planned)[:2] != (False, False):
                planned = None  # (it takes no new size now)
        behind = []  # holders ranked after the first: where a size held twice goes to one of them
        if holders and (planned is None or planned.replica_id in {r.replica_id for r in holders}):
            first = holders if len(holders) == 1 else \
                sorted(holders, key=lambda r: (r.full, self._crowding(r, sent[r.replica_id])))
            if len(first) > 1:
                # Sent to every holder, each keeps its copy hot, and the sizes beside the copies
                # take turns evicting each other; sent to one, the other copies age out of their
                # replicas' LRU and make room. The others follow in the next rank, which Ray
                # tries when the planned one takes nothing (full, or its probe answered late).
                sole = self._planned(size, replicas, fresh, now)
                if (sole is not None and any(r is sole for r in first) and not sole.full and sole.building == 0
                        and fresh[sole.replica_id] and size in sole.size_bytes):
                    first, behind = [sole], [r for r in first if r is not sole]
        elif planned is not None:
            first, holders = [planned], []
        else:
            first = [min(replicas, key=order)]
        ranks = [[r.replica_id for r in first]] + ([[r.replica_id for r in behind]] if behind else [])
        # A new size is built wherever it goes: the others follow at once. A held size waits
        # for its homes unless they are full or have not taken it in spill_after_s.
        if not holders or all(r.full for r in first + behind) or waited_s >= self.spill_after_s:
            chosen = {rid for rank in ranks for rid in rank}
            rest = sorted((r for r in replicas if r.replica_id not in chosen), key=order)
            if rest:
                ranks.append([r.replica_id for r in rest])
        return ranks

    def routed(self, size: Size | None, replica_id: str, now: float) -> None:
        """Remember that `size` went to `replica_id`: it will hold the size once served."""
        if size is not None:
            remember(self.homes, size, (replica_id, now))

    def requested(self, size: Size | None, now: float) -> None:
        """Count one request of `size` (once per request, when it is routed)."""
        if size is not None:
            remember(self.traffic, size, (self.requests_per_half_life(size, now) + 1.0, now))

    def requests_per_half_life(self, size: Size, now: float) -> float:
        """`size`'s request count, each request weighing half as much every TRAFFIC_HALF_LIFE_S."""
        count, at = self.traffic.get(size, (0.0, now))
        return count * 0.5 ** (max(0.0, now - at) / TRAFFIC_HALF_LIFE_S)

    def keep_only(self, replica_ids: Iterable[str]) -> None:
        """Forget the replicas not in `replica_ids` (dead or removed), and their sizes."""
        alive = set(replica_ids)
        self.homes = {size: home for size, home in self.homes.items() if home[0] in alive}
        self.evictions = {size: kept for size, where in self.evictions.items()
                          if (kept := {rid: n for rid, n in where.items() if rid in alive})}

    def _planned(self, size: Size, replicas: Sequence[ReplicaState], fresh: Mapping, now: float):
        """The replica rule 3's plan places `size` on, or None."""
        if now - self.planned_at >= PLAN_PERIOD_S or not 0 <= now - self.planned_at:
            self.plan = self._make_plan([r for r in replicas if fresh[r.replica_id]], now)
            self.planned_at = now
        planned = self.plan.get(size)
        return next((r for r in replicas if r.replica_id == planned), None)

    def _make_plan(self, replicas: Sequence[ReplicaState], now: float) -> dict:
        """Rule 3's plan: each size requested at PLANNED_RATE or more, on a replica where it
        fits beside the sizes placed before it: first the sizes some replica holds, then the
        others, the most requested first in each."""
        mean_entry = _mean_entry(replicas)
        room = {r.replica_id: r.budget if r.budget is not None else math.inf for r in replicas}
        load = dict.fromkeys(room, 0.0)
        rates = {s: self.requests_per_half_life(s, now) for s in self.traffic}
        plan, before = {}, self.plan
        held = {s for r in replicas for s in r.size_bytes}
        # Held sizes first, where they are (each move is a build), then the rest.
        for size in sorted((s for s, rate in rates.items() if rate >= PLANNED_RATE),
                           key=lambda s: (s not in held, -rates[s])):
            needed = self.size_bytes.get(size, mean_entry)
            fits = [r for r in replicas if room[r.replica_id] >= needed]
            if fits:
                sent_to = self.homes.get(size, ("",))[0]  # where it may be building
                # (of two holders, the one planned before: a request that overflowed to the other
                # would otherwise make it the last sent to, and the planned one, in turn)
                home = min(fits, key=lambda r: (size not in r.size_bytes,
                                                size in r.size_bytes and r.replica_id != before.get(size),
                                                r.replica_id != sent_to, load[r.replica_id], -room[r.replica_id],
                                                r.replica_id))
                plan[size] = home.replica_id
                room[home.replica_id] -= needed
                load[home.replica_id] += rates[size]
        return plan

    def _learn_sizes(self, replicas: Iterable[ReplicaState]) -> None:
        for replica in replicas:
            for size, nbytes in replica.size_bytes.items():
                if nbytes > self.size_bytes.get(size, -1):
                    remember(self.size_bytes, size, nbytes)

    def _holds(self, replica: ReplicaState, size: Size, fresh: bool) -> bool:
        """Rule 2. A replica's sizes include those it is serving now, so a size sent to it is
        listed from its first publication after its request starts; a publication more than
        HOME_GRACE_S after this router's choice that does not list the size means the replica
        evicted it since: counted, and the home forgotten."""
        if fresh and size in replica.sizes:
            return True
        home = self.homes.get(size)
        if home is None or home[0] != replica.replica_id:
            return False
        if replica.published_at is None or replica.published_at <= home[1] + HOME_GRACE_S:
            return True
        del self.homes[size]
        where = self.evictions.get(size, {})
        remember(self.evictions, size, {**where, replica.replica_id: where.get(replica.replica_id, 0) + 1})
        return False

    def _new_size_order(self, size: Size, replicas: Sequence[ReplicaState], fresh: Mapping, now: float,
                        sent: Mapping):
        """Rule 3: a sort key over replicas, ascending, for placing `size`. `sent`: replica id ->
        the (size, unix seconds) this router sent it (`homes` by replica)."""
        mean_entry = _mean_entry(r for r in replicas if fresh[r.replica_id])
        needed = self.size_bytes.get(size, mean_entry)
        evicted = self.evictions.get(size, {})
        rates = functools.cache(lambda s: self.requests_per_half_life(s, now))  # a size's, once per rank
        keys = {}  # replica id -> its key: a rank sorts the replicas more than once

        def key(replica: ReplicaState) -> tuple:
            found = keys.get(replica.replica_id)
            if found is not None:
                return found
            takes_new_sizes = (fresh[replica.replica_id] and replica.bytes_free() > 0 and replica.building == 0
                               and replica.pending_builds < self.max_pending_builds)
            sizes = self._sizes_on(replica, fresh[replica.replica_id], size, sent[replica.replica_id])
            coming = sum(self._bytes_of(s, replica, mean_entry) for s in sizes if s not in replica.size_bytes)
            displaced = self._displaced(replica, sizes, needed - (replica.bytes_free() - coming), mean_entry, rates)
            load = sum(rates(s) for s in sizes)
            evictions = max(evicted.get(replica.replica_id, 0), replica.evicted.get(size, 0))
            found = keys[replica.replica_id] = (replica.full, not takes_new_sizes, displaced, evictions, load,
                                                *self._crowding(replica, sent[replica.replica_id]))
            return found

        return key

    def _sizes_on(self, replica: ReplicaState, fresh: bool, other_than: Size, sent_here: Sequence) -> set:
        """The sizes `replica` lists, and those this router sent it (`sent_here`: (size, unix
        seconds)) that its publication may not show yet (rule 2's grace), but `other_than`."""
        listed = replica.sizes if fresh else frozenset()
        sent = {s for s, at in sent_here if replica.published_at is None or replica.published_at <= at + HOME_GRACE_S}
        return (listed | sent) - {other_than}

    def _bytes_of(self, size: Size, replica: ReplicaState, mean_entry: float) -> float:
        return replica.size_bytes.get(size, self.size_bytes.get(size, mean_entry))

    def _displaced(self, replica: ReplicaState, sizes: set, short: float, mean_entry: float, rates) -> float:
        """Rule 3b: the request rate (`rates(size)`) of the least-requested `sizes` whose bytes
        make up `short` bytes (0 where nothing is short)."""
        if short <= 0:
            return 0.0
        displaced = 0.0
        for s in sorted(sizes, key=rates):
            displaced += rates(s)
            short -= self._bytes_of(s, replica, mean_entry)
            if short <= 0:
                break
        return displaced

    def _crowding(self, replica: ReplicaState, sent_here: Sequence) -> tuple:
        """Ascending: most room first. Sizes this router sent to the replica since it last
        published count as entries of the replica's mean entry size: its stats do not show
        them yet, and without them every new size of a stats period would go to one replica."""
        since = replica.published_at if replica.published_at is not None else -math.inf
        placed = sum(1 for size, at in sent_here if at > since and size not in replica.sizes)
        mean_entry_bytes = replica.bytes / replica.entries if replica.entries else 0.0
        return (-(replica.bytes_free() - placed * mean_entry_bytes), replica.entries + placed, replica.replica_id)
