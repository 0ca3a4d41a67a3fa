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
   sent there evicted it. Held sizes go to their homes, the one not full and with the most
   room first.
3. A size without a home is new: it goes to the replica with the most room, bytes free first
   (budget minus bytes held; no budget counts as unlimited), then the fewest entries; sizes
   this router placed on a replica since it last published count against its room.
   Replicas over their budget, with `max_pending_builds` or more builds pending, or with
   stale stats get no new sizes while another replica can take them.
4. A second rank holds the replicas left, best first, which Ray's router tries when the
   first rank takes nothing (spill-over): at once for a new size (it is built wherever it
   goes) and for a held size whose homes are all at `max_ongoing_requests` (as the router
   last heard); for a held size whose homes did not answer Ray's queue-length probe in time,
   after the request has waited `spill_after_s` (sending it elsewhere builds the size a
   second time). Ray backs off between its tries.
5. A replica that dies or leaves the deployment is forgotten (``keep_only``): its sizes have
   no home and are placed again by rule 3.
"""

from __future__ import annotations

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
FORMAT_VERSION = 1


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{value} is not a time")
    return value


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the router sees it: its id, what it last published and whether it can
    take a request now."""

    replica_id: str
    sizes: frozenset = frozenset()  # sizes it holds compiled entries for
    bytes: int = 0  # bytes its cache holds
    budget: int | None = None  # its cache's byte budget; None: no byte limit
    entries: int = 0
    pending_builds: int = 0
    published_at: float | None = None  # unix seconds; None: nothing (valid) published
    full: bool = False  # at max_ongoing_requests, as far as the router knows

    @classmethod
    def from_routing_stats(cls, replica_id: str, stats: object, full: bool = False) -> ReplicaState:
        """The state of a replica from its published routing stats. Stats of another format,
        or malformed, count as missing: the replica is routed to, never trusted for sizes."""
        try:
            ours = stats.get(FORMAT_KEY) if isinstance(stats, Mapping) else None
            if not isinstance(ours, Mapping) or ours.get("version") != FORMAT_VERSION:
                return cls(replica_id, full=full)
            budget = ours.get("budget")
            return cls(
                replica_id,
                sizes=frozenset(tuple(int(d) for d in size) for size in ours["sizes"]),
                bytes=int(ours["bytes"]),
                budget=None if budget is None else int(budget),
                entries=int(ours["entries"]),
                pending_builds=int(ours["pending_builds"]),
                published_at=_finite(float(ours["published_at"])),
                full=full,
            )
        except (KeyError, TypeError, ValueError, OverflowError):
            return cls(replica_id, full=full)

    def fresh(self, now: float, max_age_s: float) -> bool:
        """Whether it published within `max_age_s` of `now`, before or after (the clocks of two
        nodes differ): stats stamped further ahead are a clock gone wrong, and stale."""
        return self.published_at is not None and abs(now - self.published_at) <= max_age_s

    def bytes_free(self) -> float:
        return math.inf if self.budget is None else self.budget - self.bytes


def routing_stats(sizes: Iterable[Size], figures: Mapping, published_at: float) -> dict:
    """What a replica publishes: the sizes it holds and its cache's figures (``sc.stats``:
    bytes, budget, entries, pending_builds), in the format ``ReplicaState`` reads."""
    return {
        FORMAT_KEY: {
            "version": FORMAT_VERSION,
            "sizes": sorted(list(size) for size in sizes),
            "bytes": int(figures["bytes"]),
            "budget": figures["budget"],
            "entries": len(figures["entries"]),
            "pending_builds": int(figures["pending_builds"]),
            "published_at": published_at,
        }
    }


@dataclass
class Placement:
    """This router's memory of where it sent each size, and the policy that ranks replicas."""

    max_pending_builds: int = 2
    stats_max_age_s: float = 60.0
    spill_after_s: float = SPILL_AFTER_S
    # size -> (replica id, unix seconds): where this router last sent the size
    homes: dict = field(default_factory=dict)

    def rank(self, size: Size | None, replicas: Sequence[ReplicaState], now: float,
             waited_s: float = 0.0) -> list[list[str]] | None:
        """Replica ids in ranks, most preferred first; None: route by Ray's default policy.
        `waited_s`: how long the request has waited to be routed."""
        if size is None or not replicas:
            return None
        fresh = {r.replica_id: r.fresh(now, self.stats_max_age_s) for r in replicas}
        holders = [r for r in replicas if self._holds(r, size, fresh[r.replica_id])]
        if not holders and not any(fresh.values()):
            return None
        if holders:
            first = sorted(holders, key=lambda r: (r.full, self._crowding(r)))
        else:
            first = [min(replicas, key=lambda r: self._new_size_order(r, fresh[r.replica_id]))]
        ranks = [[r.replica_id for r in first]]
        # A new size is built wherever it goes: the others follow at once. A held size waits
        # for its homes unless they are full or have not taken it in spill_after_s.
        if not holders or all(r.full for r in first) or waited_s >= self.spill_after_s:
            chosen = set(ranks[0])
            rest = sorted((r for r in replicas if r.replica_id not in chosen),
                          key=lambda r: self._new_size_order(r, fresh[r.replica_id]))
            if rest:
                ranks.append([r.replica_id for r in rest])
        return ranks

    def routed(self, size: Size | None, replica_id: str, now: float) -> None:
        """Remember that `size` went to `replica_id`: it will hold the size once served."""
        if size is not None:
            self.homes.pop(size, None)  # re-inserted last: the dict is in order of use
            self.homes[size] = (replica_id, now)
            if len(self.homes) > MAX_HOMES:
                del self.homes[next(iter(self.homes))]

    def keep_only(self, replica_ids: Iterable[str]) -> None:
        """Forget the replicas not in `replica_ids` (dead or removed), and their sizes."""
        alive = set(replica_ids)
        self.homes = {size: home for size, home in self.homes.items() if home[0] in alive}

    def _holds(self, replica: ReplicaState, size: Size, fresh: bool) -> bool:
        """Rule 2. A replica's sizes include those it is serving now, so a size sent to it is
        listed from its first publication after its request starts; a publication more than
        HOME_GRACE_S after this router's choice that does not list the size means the replica
        evicted it since."""
        if fresh and size in replica.sizes:
            return True
        home = self.homes.get(size)
        if home is None or home[0] != replica.replica_id:
            return False
        return replica.published_at is None or replica.published_at <= home[1] + HOME_GRACE_S

    def _new_size_order(self, replica: ReplicaState, fresh: bool) -> tuple:
        """Rule 3, ascending: not full, then able to take new sizes, then most room."""
        takes_new_sizes = fresh and replica.bytes_free() > 0 and replica.pending_builds < self.max_pending_builds
        return (replica.full, not takes_new_sizes, self._crowding(replica))

    def _crowding(self, replica: ReplicaState) -> tuple:
        """Ascending: most room first. Sizes this router sent to the replica since it last
        published count as entries of the replica's mean entry size: its stats do not show
        them yet, and without them every new size of a stats period would go to one replica."""
        since = replica.published_at if replica.published_at is not None else -math.inf
        placed = sum(1 for rid, at in self.homes.values() if rid == replica.replica_id and at > since)
        mean_entry_bytes = replica.bytes / replica.entries if replica.entries else 0.0
        return (-(replica.bytes_free() - placed * mean_entry_bytes), replica.entries + placed, replica.replica_id)
