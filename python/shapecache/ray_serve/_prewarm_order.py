"""Which of the fleet's sizes a replica started after others builds first: a plain function of
the sizes record and what the replicas published, which imports neither Ray nor torch.
``SharedDir.hot_sizes`` reads both from the shared directory; the simulated fleet calls it for
its replacement replicas.

The order:

1. The sizes no live replica holds. A replacement's first use is the sizes its dead
   predecessor held and the survivors evicted to serve them: each of those is otherwise a
   miss when next requested, and a build on a replica that holds others (which it then
   evicts). A size a live replica holds is a hit already; built here too it takes room those
   sizes need.
2. The rest.

Within each, the most requested first (the requests each replica published, summed over the
replicas live or gone: a dead replica's demand is what its replacement must serve), then the
most often built (a size that kept being evicted was built most, so this only breaks ties),
then the larger.

A replica is live while it publishes: it counts as gone once it has missed LIVE_PERIODS of
its own publication periods (each publication says how long since the one before it), or,
after a first publication that says no period, once FIRST_SILENCE_S has passed. A replacement
that starts within that time of its predecessor's death sees the dead replica's sizes as held,
and builds them second.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping

from shapecache.ray_serve._placement import ReplicaState

# A replica that has not published for this many of its periods is gone: one publication
# missed is a slow stats call (Serve waits for it up to its timeout), two is a replica dead.
LIVE_PERIODS = 2.5
# How long a replica that published once (no period known) counts as live: Ray's default stats
# period is 10 s.
FIRST_SILENCE_S = 30.0


def live(state: ReplicaState, now: float) -> bool:
    """Whether the replica whose last publication is `state` still publishes, as of `now`."""
    if state.published_at is None:
        return False
    silence = LIVE_PERIODS * state.period_s if state.period_s else FIRST_SILENCE_S
    return now - state.published_at <= silence


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
    return sorted(built, key=lambda s: (s in held, -requests[s], -built[s], -math.prod(s), s))
