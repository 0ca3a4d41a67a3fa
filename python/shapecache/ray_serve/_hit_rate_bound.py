"""The highest hit rate any router could get on a stream of sizes: the yardstick for a
fleet's hit rate. It imports neither Ray nor torch.

The bound pools the fleet: one cache holding as many entries as all the replicas' budgets
together, which no placement over replicas beats (whatever the replicas hold at a moment,
one cache of their summed entries could hold too). It sees the whole stream ahead and keeps,
of the sizes held and the one just built, those requested again soonest, dropping the one
requested furthest ahead (Belady's rule, with the choice not to keep what was built; optimal
for one cache whose entries are built by requests of their size). An entry is built by a
request of its size, never ahead of it (a pre-warm is not in the bound), as a replica builds
the sizes it is asked for. The warm-up's hits (before `counted_from`) do not count, so the
bound starts the counted requests with any of the sizes the warm-up requested, the soonest
requested again. A replica killed loses its entries: the bound keeps what the
replicas left can hold and loses the rest, the ones it needs last. Where entries differ in
bytes, a caller counts each replica's entries as its budget over the smallest: the bound
stays a bound, and says less the more the sizes differ. A replacement that starts serving some
requests after the kill (its process starts first) adds its room from the first it serves.
What a real fleet loses on top of the bound is placement, the stats' lag and LRU's ignorance
of the future.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

__all__ = ["hit_rate_bound"]


def _count(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: expected an int of at least {least}")
    if value < least:
        raise ValueError(f"{name}={value!r}: expected an int of at least {least}")
    return value


def hit_rate_bound(stream: Sequence[Hashable], entries: int, counted_from: int = 0, kill_at: int | None = None,
                   lost: int = 0, entries_after_kill: int | None = None, replaced_at: int | None = None) -> float:
    """The best hit rate over `stream[counted_from:]` of a fleet whose budgets hold `entries`
    entries in all. With `kill_at`, a replica whose budget holds `lost` entries dies before
    request `kill_at`: of what the fleet held, what the others can hold (``entries - lost``)
    stays, and the fleet holds `entries_after_kill` from request `replaced_at` on (default
    `kill_at`: its replacement serving at once; `entries_after_kill` defaults to `entries`,
    and ``entries - lost`` is a fleet never replaced), ``entries - lost`` before it."""
    stream = list(stream)
    if not stream:
        raise ValueError("stream=[]: expected at least one request")
    entries = _count("entries", entries, 1)
    counted_from = _count("counted_from", counted_from, 0)
    if counted_from >= len(stream):
        raise ValueError(f"counted_from={counted_from}: expected less than the stream's {len(stream)} requests")
    if kill_at is not None:
        kill_at = _count("kill_at", kill_at, 0)
        if kill_at >= len(stream):
            raise ValueError(f"kill_at={kill_at}: expected less than the stream's {len(stream)} requests")
    elif lost or entries_after_kill is not None or replaced_at is not None:
        raise ValueError(f"lost={lost!r}, entries_after_kill={entries_after_kill!r}, replaced_at={replaced_at!r} "
                         "without kill_at: expected kill_at, the request before which a replica dies")
    lost = _count("lost", lost, 0)
    if lost >= entries:
        raise ValueError(f"lost={lost}: expected fewer than the fleet's {entries} entries (a replica is left)")
    after = entries if entries_after_kill is None else _count("entries_after_kill", entries_after_kill, 1)
    if replaced_at is not None:
        if isinstance(replaced_at, bool) or not isinstance(replaced_at, int):
            raise TypeError(f"replaced_at={replaced_at!r}: expected an int, a request index at or after kill_at")
        if not kill_at <= replaced_at <= len(stream):
            raise ValueError(f"replaced_at={replaced_at}: expected a request index from kill_at={kill_at} to the "
                             f"stream's length, {len(stream)} (never replaced within it)")
    else:
        replaced_at = kill_at

    # next_use[i]: the index of the next request of stream[i]'s size after i (inf: none)
    next_use, seen = [math.inf] * len(stream), {}
    for index in range(len(stream) - 1, -1, -1):
        next_use[index] = seen.get(stream[index], math.inf)
        seen[stream[index]] = index
    held: dict = {}  # size -> the index of its next request
    last_before: dict = {}  # size -> the index of its last request before counted_from
    hits = 0
    for index, size in enumerate(stream):
        capacity = entries if kill_at is None or index < kill_at else after if index >= replaced_at else entries - lost
        room = min(entries - lost, capacity) if index == kill_at else capacity
        if index == counted_from:  # what the warm-up kept is free to choose: its hits do not count, so any of
            # the sizes requested in it could be held now; the soonest requested again are the best
            held = {s: next_use[i] for s, i in last_before.items()}
        if index in (kill_at, counted_from):  # at a kill, the replicas left keep what they can hold
            while len(held) > room:
                del held[max(held, key=held.get)]
        if index < counted_from:
            last_before[size] = index
        if size in held:
            hits += index >= counted_from
        held[size] = next_use[index]
        while len(held) > capacity:  # (the size just built may be the one to go)
            del held[max(held, key=held.get)]
    return hits / (len(stream) - counted_from)
