"""CachedReplica: the replica side of size-affinity routing. A replica serves one object that
shapecache caches, publishes the sizes it holds (``record_routing_stats``, which Ray Serve
calls every routing-stats period), records the sizes it built in the shared directory, and
builds the fleet's hot sizes before it reports ready.

Which sizes a replica holds: a size's calls used some entries (those whose hit count moved or
that appeared during the call); the size is held while all of them are still cached, and while
a call of that size runs. With ``max_ongoing_requests=1`` (one image at a time, as a GPU replica
runs) this is exact; with more, a size's entries can include those of a size served beside it,
so a size may be reported gone when that other size's entries are evicted (the router then
places it again, and the replica's cache still serves it).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import threading
import time
from typing import ClassVar

import shapecache as sc
from shapecache import _checks
from shapecache.cache import entries_served
from shapecache.ray_serve._placement import routing_stats
from shapecache.ray_serve._request_size import PIPELINE_SIZE_KEYS, check_size, check_size_keys, request_size
from shapecache.ray_serve._shared_dir import SharedDir

logger = logging.getLogger("shapecache")


# Sizes a replica builds before it reports ready, where its constructor is not told: each is a
# build (seconds to minutes) before the replica serves its first request, and a record of
# the fleet's sizes may hold hundreds.
PREWARM_LIMIT = 8
# Sizes whose evictions a replica publishes, the most recently evicted kept.
EVICTED_SIZES = 256


class CachedReplica:
    """Base class of a Ray Serve deployment that serves one cached object::

        class Painter(CachedReplica):
            def __init__(self):
                pipe = StableDiffusionPipeline.from_pretrained(...).to("cuda")
                super().__init__(sc.wrap(pipe, budget="20GiB"))

            def __call__(self, prompt: str, height: int, width: int):
                return self.serve(prompt, height=height, width=width).images[0]

        class Upscaler(CachedReplica):
            size_keys = ("size",)
            ...
            def __call__(self, image, size: tuple[int, int]):
                with self.serving(size):
                    return self.model(image)

        app = shapecache.ray_serve.deployment(Painter, num_replicas=2).bind()

    ``size_keys`` names the keyword arguments that make a request's size: ``("height",
    "width")`` (a pipeline's) unless a subclass sets another, such as ``("size",)`` for a
    call ``model(size=(768, 512))``. The router reads the same keywords.
    """

    size_keys: ClassVar[tuple[str, ...]] = PIPELINE_SIZE_KEYS

    def __init__(self, cached, *, shared_dir=None, prewarm_limit: int | None = PREWARM_LIMIT):
        """`cached`: what ``sc.wrap`` or ``sc.cached`` returned. `shared_dir` (default:
        SHAPECACHE_SHARED_DIR, when set): the directory replicas share; the fleet's hot sizes
        recorded there are built now, most built first, up to `prewarm_limit` sizes (default
        PREWARM_LIMIT; None: every recorded size), stopping at the first eviction (the budget
        is full). Ray Serve routes nothing to the replica until they are built."""
        check_size_keys(self.size_keys)
        try:
            sc.stats(cached)
        except TypeError as error:
            raise TypeError(f"cached={type(cached).__name__} object: expected what sc.cached or sc.wrap returned "
                            "(a cached function or module, or a wrapped pipeline)") from error
        if prewarm_limit is not None:
            _checks.positive_int("prewarm_limit", prewarm_limit, "or None for every hot size")
        self.cached = cached
        self.__is_pipeline = "components" in sc.stats(cached)
        self.__lock = threading.Lock()
        self.__entries_of: dict[tuple, frozenset] = {}  # size -> the entry ids its last call used
        self.__serving: collections.Counter = collections.Counter()  # sizes being served now
        self.__building: collections.Counter = collections.Counter()  # ... of those, not held when their call came
        self.__evicted: dict[tuple, int] = {}  # size -> times its entries went (most recent last)
        self.shared_dir = SharedDir.from_option(shared_dir)
        # The fleet's record of this class's sizes: deployments of other classes sharing the
        # directory keep records of their own.
        self.__sizes_file = self.sizes_file()
        self.__warming = False  # sizes built while pre-warming are not recorded as the fleet's demand
        self.prewarmed: list[tuple] = []
        self.prewarm_seconds = 0.0
        if self.shared_dir is not None:
            self.shared_dir.apply()
            self.__prewarm(self.shared_dir.hot_sizes(self.__sizes_file, prewarm_limit))

    @classmethod
    def sizes_file(cls) -> str:
        """The name, in the shared directory, of the record of the sizes this class's replicas
        built on request."""
        return f"sizes.{cls.__name__}.jsonl"  # (not __qualname__: a class made in a function is named so too)

    def __call__(self, *args, **kwargs):
        return self.serve(*args, **kwargs)

    def serve(self, *args, **kwargs):
        """Calls the cached object with the request's arguments; its size is read from them
        (``size_keys``). Where the cached object is not called with the size keywords, a
        request runs ``with self.serving(size): ...`` instead."""
        size = request_size(kwargs, self.size_keys)
        if size is None:
            return self.cached(*args, **kwargs)
        with self.serving(size):
            return self.cached(*args, **kwargs)

    @contextlib.contextmanager
    def serving(self, size: tuple):
        """Marks `size` as being served for the duration; afterwards, notes which entries the
        calls inside used, and records a size whose calls built an entry in the shared
        directory."""
        size = check_size(size, len(self.size_keys))
        with self.__using(size) as built:
            yield
        if built and self.shared_dir is not None and not self.__warming:
            try:
                self.shared_dir.record_sizes([size], self.__sizes_file)
            except OSError as error:  # the request was served: a record it could not write costs a warning
                logger.warning("shapecache: could not record size %s in %s: %s", size, self.shared_dir.path, error)

    def warm_up(self, size: tuple) -> None:
        """Builds the entries of `size` as a request of that size would. Pipelines are warmed
        with ``sc.prewarm``; other replicas with a call that passes only the size keywords,
        ``self(**dict(zip(size_keys, size)))`` (or ``size=...`` for one key): override this
        where a request needs more."""
        if self.__is_pipeline:
            sc.prewarm(self.cached, [size], progress=False)
        else:
            self(**dict(zip(self.size_keys, size if len(self.size_keys) > 1 else (size,), strict=True)))

    def sizes_held(self) -> set[tuple]:
        """The sizes whose entries this replica holds, and those it is serving now."""
        return self.__held(sc.stats(self.cached))[0]

    def record_routing_stats(self) -> dict:
        """What the router reads (Ray Serve calls this every routing-stats period)."""
        figures = sc.stats(self.cached)
        held, size_bytes, not_held = self.__held(figures)
        # The sizes served without being held build inline, but for those whose builds are
        # queued in the background (served uncached meanwhile): an inline build holds the
        # replica, a background one does not.
        building = max(0, not_held - figures["pending_builds"])
        with self.__lock:
            evicted = dict(self.__evicted)
        return routing_stats(held, figures, time.time(), building=building, size_bytes=size_bytes, evicted=evicted)

    def __held(self, figures: dict) -> tuple[set, dict, int]:
        """From one snapshot of the cache's stats: the sizes held or being served, the bytes of
        each held size's entries, and how many sizes requests running now came for without
        the replica holding them."""
        bytes_of = {entry["id"]: entry["bytes"] for entry in figures["entries"]}
        with self.__lock:  # a call ending meanwhile records its entries before or after this snapshot
            for size in [s for s, ids in self.__entries_of.items() if not ids <= bytes_of.keys()]:
                del self.__entries_of[size]
                self.__evicted.pop(size, None)  # re-inserted last: the oldest is dropped first
                self.__evicted[size] = self.__evicted.get(size, 0) + 1
                if len(self.__evicted) > EVICTED_SIZES:
                    del self.__evicted[next(iter(self.__evicted))]
            size_bytes = {s: sum(bytes_of[i] for i in ids) for s, ids in self.__entries_of.items()}
            return set(self.__entries_of) | set(self.__serving), size_bytes, len(self.__building)

    @contextlib.contextmanager
    def __using(self, size: tuple):
        """Marks `size` as being served; afterwards, records the entries the call used. Yields
        a list that is true afterwards when the call built an entry."""
        with self.__lock:  # first: the size is held from the moment its call starts
            self.__serving[size] += 1
            builds = size not in self.__entries_of
            if builds:
                self.__building[size] += 1
        built: list = []
        served = entries_served()  # what the calls on this thread serve: no scan of every entry
        try:
            with served:
                yield built
        finally:
            built.extend(served.built)
            used = frozenset(served.used) | frozenset(served.built)
            with self.__lock:
                self.__serving[size] -= 1
                if not self.__serving[size]:
                    del self.__serving[size]
                if builds:
                    self.__building[size] -= 1
                    if not self.__building[size]:
                        del self.__building[size]
                if used:
                    self.__entries_of[size] = used

    def __prewarm(self, sizes: list[tuple]) -> None:
        """Builds `sizes`, largest first (a pool sized by the first build fits the rest)."""
        if len(self.size_keys) > 1:
            sizes = [s for s in sizes if len(s) == len(self.size_keys)]
        start = time.perf_counter()
        evictions = sc.stats(self.cached)["evictions"]
        self.__warming = True
        try:
            for size in sorted(sizes, key=lambda s: -math.prod(s)):
                try:
                    with self.__using(size):
                        self.warm_up(size)
                except Exception as error:  # noqa: BLE001 - a replica that cannot pre-warm still serves
                    logger.warning("shapecache: pre-warming size %s failed (%s: %s); override warm_up where a "
                                   "request needs more than its size", size, type(error).__name__, error)
                    continue
                self.prewarmed.append(size)
                if sc.stats(self.cached)["evictions"] > evictions:
                    logger.info("shapecache: the budget is full after pre-warming %d of %d hot sizes",
                                len(self.prewarmed), len(sizes))
                    break
        finally:
            self.__warming = False
        self.prewarm_seconds = time.perf_counter() - start
        if sizes:
            logger.info("shapecache: pre-warmed %d hot sizes from %s in %.1f s", len(self.prewarmed),
                        self.shared_dir.path, self.prewarm_seconds)

