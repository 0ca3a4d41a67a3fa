"""Which of the fleet's sizes a replica started after others builds first: a plain function of
the sizes record and what the replicas published, which imports neither Ray nor torch.
``SharedDir.hot_sizes`` reads both from the shared directory; the simulated fleet calls it for
its replacement replicas.

The order:

1. The sizes the fleet requests that no live replica holds. A replacement's first use is the
   sizes its dead predecessor held and the survivors evicted to serve them: each of those is
   otherwise a miss when next requested, and a build on a replica that holds others (which it
   then evicts). A size a live replica holds is a hit already; built here too it takes room
   those sizes need.
2. The rest: those a live replica holds, and those no publication says were requested (the
   record keeps every size ever built).

Within each, the most requested first (the requests each replica published, summed over the
replicas live or gone: a dead replica's demand is what its replacement must serve), then the
most often built (a size that kept being evicted was built most, so this only breaks ties),
then the larger. Without publications this is the most often built first.

A replica is live while it publishes: it counts as gone once it has been silent for
LIVE_PERIODS of its own publication periods (each publication says how long since the one
before it), but never sooner than LIVE_FLOOR_S (a replica building inline holds the GIL in
long stretches, and answers its stats call late) nor later than LIVE_CEILING_S; after a first
publication, which says no period, FIRST_SILENCE_S. A publication stamped further ahead than
that is a clock gone wrong, and not live. The clocks of the nodes are taken to agree within
a few seconds. A replacement that starts sooner after its predecessor's death sees the dead
replica's sizes as held: ``CachedReplica`` starts its pre-warm once the replicas that missed a
publication are decided (``decided_at``), and reads the order again before each size. A
replica that Serve stops (a rolling update, a scale-down) publishes its last, marked
``stopped``: it is gone at once, with nothing to wait for.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping

from shapecache.ray_serve._placement import ReplicaState

# A replica silent for this many of its periods is gone: one publication missed is a slow stats
# call, more is a replica dead...
LIVE_PERIODS = 2.5
# ...but a replica building inline can answer its stats call seconds late, so never sooner than
# this, and a hostile or broken period cannot keep a dead one live for longer than that.
LIVE_FLOOR_S = 10.0
LIVE_CEILING_S = 60.0
# How long a replica that published once (no period known) counts as live.
FIRST_SILENCE_S = 30.0


def silence_s(state: ReplicaState) -> float:
    """How long the replica of `state` may be silent and still count as live."""
    if state.period_s is None:
        return FIRST_SILENCE_S
    return min(max(LIVE_PERIODS * state.period_s, LIVE_FLOOR_S), LIVE_CEILING_S)


def live(state: ReplicaState, now: float) -> bool:
    """Whether the replica whose last publication is `state` still publishes, as of `now`: one
    that published its last (stopped) does not."""
    return (not state.stopped and state.published_at is not None
            and abs(now - state.published_at) <= silence_s(state))


def decided_at(fleet: Iterable[ReplicaState], now: float) -> float:
    """When each replica of `fleet` that has missed a publication, but is not gone yet, will be
    gone unless it publishes again (at most LIVE_CEILING_S on): `now` where none has. A pre-warm
    that starts then builds a dead predecessor's sizes first rather than after the others."""
    decided = now
    for state in fleet:
        if state.period_s is not None and live(state, now) and now - state.published_at > state.period_s + 1.0:
            # (a moment past the silence: at its very end the replica still counts as live)
            decided = max(decided, state.published_at + silence_s(state) + 0.1)
    return decided


def prewarm_order(built: Mapping, fleet: Iterable[ReplicaState], now: float) -> list[tuple[int, ...]]:
    """The sizes of `built` (size -> times the fleet built it, from the sizes record) in the
    order a new replica builds them (the module's rules), by `fleet`: the last publication of
    each replica, live or gone, as of `now`."""
    requests: collections.Counter = collections.Counter()
    held = set()
    for state in fleet:
        requests.update({size: count for size, count in state.requests.items() if size in built and count > 0})
        if live(state, now):
            held |= state.sizes
    return sorted(built, key=lambda s: (s in held or not requests[s], -requests[s], -built[s], -math.prod(s), s))
