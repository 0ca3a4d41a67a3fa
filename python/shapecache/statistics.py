"""What ``sc.stats`` returns: one typed definition of every key.

The figures are read from the C++ cache (``csrc/cache/shape_cache.cpp`` and
``shape_dispatcher.cpp``) when ``stats`` is called; a test checks that these definitions and
the dicts it returns have the same keys.
"""

from __future__ import annotations

from typing import TypedDict


class EntryStats(TypedDict):
    """One compiled entry: one bucket of one cached function on one device."""

    id: int  # unique in the process
    bucket: str  # the key, readable: argument shapes, dtypes, devices, values
    device: str
    backend: str  # what built it: "eager", "compile", "cuda_graph", "compile+cuda_graph"
    bytes: int  # device memory the entry holds, charged to the budget
    hits: int  # calls served after the build
    build_seconds: float  # wall time of the build, its first call included
    last_use: float  # unix time of the last call
    pinned: bool  # running now: never evicted while so


class DeviceStats(TypedDict):
    """A cache's figures on one device."""

    budget: int | None  # bytes; None: no byte limit
    bytes: int  # entry_bytes + pool_bytes + workspace_bytes
    entry_bytes: int
    pool_bytes: int  # the device's CUDA graph pool
    workspace_bytes: int  # the tuned convolutions' workspace arena
    peak_bytes: int  # the highest `bytes` ever accounted
    entries: int
    evictions: int
    rejections: int  # entries that could not fit and were not kept
    pool_rebuilds: int  # times every graph of the device was captured again, largest first


class CacheStats(TypedDict):
    """``sc.stats`` of a cached function or module. The counters (``calls`` to ``busy_misses``)
    are defined, with what each counts, in ``csrc/cache/function_counters.h``
    (``_C.FUNCTION_COUNTERS``); a test checks that the two lists agree."""

    calls: int
    hits: int
    misses: int
    builds: int
    background_builds: int
    fallbacks: int
    uncached_calls: int
    oom_retries: int
    invalidations: int
    busy_misses: int
    pending_builds: int  # background builds of this function waiting or running now
    evictions: int
    rejections: int
    pool_rebuilds: int
    bytes: int  # entry_bytes + pool_bytes + workspace_bytes, over every device
    entry_bytes: int
    pool_bytes: int
    workspace_bytes: int
    peak_bytes: int
    budget: int | None  # bytes on the device used first; None before the first call
    max_entries: int | None
    backend: str  # the backend asked for ("auto", "eager", ...); each entry says what built it
    devices: dict[str, DeviceStats]
    entries: list[EntryStats]  # most recently used first


class PrewarmRecord(TypedDict):
    size: tuple[int, int]  # (height, width) in pixels
    batch: int
    seconds: float
    bytes: int  # what the cache held more after the size was built
    # inductor's on-disk FX graph cache for what the size compiled: "warm" (read from it),
    # "cold" (compiled and written), "not cached" (graphs holding prepacked weights, as
    # freezing makes them, are not), None (nothing compiled)
    inductor_cache: str | None


class PipelineStats(CacheStats):
    """``sc.stats`` of a pipeline wrapped by ``sc.wrap``: the shared cache's totals (the
    counters summed over components), each component's own stats, and device memory."""

    components: dict[str, CacheStats]  # "denoiser", "vae_decoder"
    prewarmed: list[PrewarmRecord]  # in build order
    memory: dict[str, dict[str, int]]  # per CUDA device: memory_allocated, max_memory_allocated, memory_reserved
