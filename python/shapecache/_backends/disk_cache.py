"""Inductor's on-disk FX graph cache, as seen from this process: whether a build was read
from it ("warm"), compiled and written to it ("cold"), or not cacheable ("not cached")."""

from __future__ import annotations

import sys


def disk_cache_counts() -> tuple[int, int, int]:
    """Inductor's FX graph cache so far in this process: (hits, misses, bypasses). A build that
    adds a hit was read from the on-disk cache ("warm"); a miss compiled and wrote it ("cold").
    Before anything compiled, torch._dynamo is not loaded, and the counts are zero."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0, 0, 0
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"], inductor["fxgraph_cache_bypass"]


def disk_cache_state(before: tuple[int, int, int]) -> str | None:
    """"warm", "cold" or "not cached" for the builds since `disk_cache_counts()` was `before`;
    None when nothing was compiled meanwhile."""
    hits, misses, bypasses = (now - then for now, then in zip(disk_cache_counts(), before, strict=True))
    if misses:
        return "cold"
    if hits:
        return "warm"
    return "not cached" if bypasses else None
