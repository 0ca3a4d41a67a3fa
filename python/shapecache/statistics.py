"""What ``sc.stats`` returns: one typed definition of every key.

The figures are read from the C++ cache (``csrc/cache/shape_cache.cpp`` and
``shape_dispatcher.cpp``) when ``stats`` is called; a test checks that these definitions and
the dicts it returns have the same keys.
"""

from __future__ import annotations

from typing import TypedDict

__all__ = ["CacheStats", "DeviceStats", "EntryStats", "PipelineStats", "PrewarmRecord"]


class EntryStats(TypedDict):
    """One compiled entry: one bucket of one cached function on one device. The keys, in this
    order and with what each is, are defined in ``csrc/cache/cache_figures.h``
    (``_C.ENTRY_FIGURES``); a test checks that the two lists agree."""

    id: int
    bucket: str
    device: str
    backend: str
    bytes: int
    hits: int
    build_seconds: float
    last_use: float
    pinned: bool


class DeviceStats(TypedDict):
    """A cache's figures on one device: its budget, then the figures defined, in this order and
    with what each is, in ``csrc/cache/cache_figures.h`` (``_C.DEVICE_FIGURES``); a test
    checks that the two lists agree."""

    budget: int | None  # bytes; None: no byte limit
    bytes: int
    entry_bytes: int
    pool_bytes: int
    workspace_bytes: int
    peak_bytes: int
    entry_count: int
    evictions: int
    rejections: int
    pool_rebuilds: int


class CacheStats(TypedDict):
    """``sc.stats`` of a cached function or module: the function's counters (``calls`` to
    ``upgrades_not_kept``, defined in ``csrc/cache/function_counters.h``), then the device figures
    summed over devices (``bytes`` to ``pool_rebuilds``, ``csrc/cache/cache_figures.h``). A
    test checks that these lists agree with the C++ ones."""

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
    upgrades: int
    upgrades_not_kept: int
    pending_builds: int  # background builds of this function waiting or running now
    bytes: int
    entry_bytes: int
    pool_bytes: int
    workspace_bytes: int
    peak_bytes: int
    evictions: int
    rejections: int
    pool_rebuilds: int
    budget: int | None  # bytes on the device used first; None before the first call
    max_entries: int | None
    backend: str  # the backend asked for ("auto", "eager", ...); each entry says what built it
    # Resident memory of this process's compiler process, where background builds of frozen
    # graphs compile (one per serving process, shared by every cache; docs/budgets.md); 0
    # while none runs.
    compiler_bytes: int
    devices: dict[str, DeviceStats]
    entries: list[EntryStats]  # most recently used first


class PrewarmRecord(TypedDict):
    size: tuple[int, int]  # (height, width) in pixels
    batch: int
    seconds: float
    bytes: int  # what the cache held more after the size was built
    # inductor's on-disk FX graph cache for what the size compiled: "warm" (read from it),
    # "cold" (compiled and written), "not cached" (graphs holding prepacked weights, as
    # freezing makes them, are not); "compiled in the compiler's process" (its FX graph
    # cache is its own); "shared package" (loaded from the shared directory's
    # packages, nothing compiled); "shared package, not traced" (found through the call
    # index: nothing traced either); None (nothing compiled or loaded)
    inductor_cache: str | None


class PipelineStats(CacheStats):
    """``sc.stats`` of a pipeline wrapped by ``sc.wrap``: the shared cache's totals (the
    counters summed over components), each component's own stats, and device memory."""

    components: dict[str, CacheStats]  # "denoiser", "vae_decoder"
    prewarmed: list[PrewarmRecord]  # in build order
    memory: dict[str, dict[str, int]]  # per CUDA device: memory_allocated, max_memory_allocated, memory_reserved
