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

import asyncio
import collections
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

import shapecache as sc
from shapecache import _checks
from shapecache._backends import builds_in_background
from shapecache.cache import entries_served, holder_of
from shapecache.ray_serve._placement import ReplicaState, remember, routing_stats
from shapecache.ray_serve._request_size import PIPELINE_SIZE_KEYS, check_size, check_size_keys, request_size
from shapecache.ray_serve._shared_dir import SharedDir

logger = logging.getLogger("shapecache")


# Sizes a replica builds before it reports ready, where its constructor is not told: each is a
# build (seconds to minutes) before the replica serves its first request, and a record of
# the fleet's sizes may hold hundreds.
PREWARM_LIMIT = 8
# Sizes whose evictions, and sizes whose requests, a replica publishes: the most recently
# evicted (requested) kept.
PUBLISHED_SIZES = 256
# How long a size whose call ran uncached (its build queued in the background) is published as
# held without a call of it served by entries: its build ends within the compile's deadline.
AWAITING_S = 600.0
# How long a routing-stats call waits for its fleet-view write (record_routing_stats): a
# shared directory that is slow or hung (a network volume gone away) must not delay the
# router's stats past Serve's timeout for them.
FLEET_WRITE_WAIT_S = 0.5
# How the pre-warm waits for the fleet's publications to be decided (a test replaces it).
_sleep = time.sleep
# The name a replica outside Ray Serve publishes under.
_THIS_PROCESS = f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class Served:
    """What one request got, complete when its ``serving`` block ends."""

    size: tuple
    replica: str | None  # Ray Serve's id of the replica (None outside Serve)
    # "hit": served by entries held; "built": the request built an entry, and waited for it;
    # "uncached": run as the plain call (its build queued in the background, or not cacheable)
    outcome: str = ""
    seconds: float = 0.0  # from the block's start to its end


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

    def __init__(self, cached, *, shared_dir=None, prewarm_limit: int | None = PREWARM_LIMIT,
                 prewarm: str | None = None):
        """`cached`: what ``sc.wrap`` or ``sc.cached`` returned. `shared_dir` (default:
        SHAPECACHE_SHARED_DIR, when set): the directory replicas share; the fleet's hot sizes
        recorded there are built, those the fleet requests and no live replica holds first,
        then the most requested (``SharedDir.hot_sizes``, read again before each size), up to
        `prewarm_limit` sizes (default
        PREWARM_LIMIT; None: every recorded size) and while the next fits the budget beside
        those built (``prewarm_fits``). `prewarm`: "background": the replica is ready at once
        and builds them on a thread of its own, serving meanwhile, each size published as held
        once built (``wait_prewarmed`` waits); "inline": they are built here, and Ray Serve
        routes nothing to the replica until they are. Default: "inline" where the cached
        object is on a CUDA device (a CUDA graph captured beside a request's work on the device
        breaks one or the other), else "background"."""
        check_size_keys(self.size_keys)
        try:
            sc.stats(cached)
        except TypeError as error:
            raise TypeError(f"cached={type(cached).__name__} object: expected what sc.cached or sc.wrap returned "
                            "(a cached function or module, or a wrapped pipeline)") from error
        if prewarm_limit is not None:
            _checks.positive_int("prewarm_limit", prewarm_limit, "or None for every hot size")
        if prewarm is None:
            prewarm = "inline" if _on_cuda(cached) else "background"
        if prewarm not in ("background", "inline"):
            raise ValueError(f"prewarm={prewarm!r}: expected 'background' (the replica is ready at once and builds "
                             "the hot sizes on a thread) or 'inline' (built before it is ready)")
        self.cached = cached
        self.__is_pipeline = "components" in sc.stats(cached)
        build = _build_mode(cached)
        self.__builds_in_background = build == "background"
        if build == "inline":
            logger.info("shapecache: %s builds inline: a request of a size it does not hold waits for the build (the "
                        "router sends it no new size meanwhile); build=\"background\" serves such a request uncached "
                        "while the size builds", type(self).__name__)
        self.__lock = threading.Lock()
        self.__entries_of: dict[tuple, frozenset] = {}  # size -> the entry ids its last call used
        self.__serving: collections.Counter = collections.Counter()  # sizes being served now
        self.__building: collections.Counter = collections.Counter()  # ... of those, not held when their call came
        self.__evicted: dict[tuple, int] = {}  # size -> times its entries went (most recent last)
        self.__requests: dict[tuple, int] = {}  # size -> requests of it started (most recent last)
        self.__published: float | None = None  # time.monotonic() of its last routing stats
        # size -> when a call of it last ran uncached (its build queued in the background): it is
        # published as held until a call of it is served by entries, or for AWAITING_S
        self.__awaiting: dict[tuple, float] = {}
        self.__fleet_written: threading.Event | None = None  # set when the last fleet-view write ended
        self.__stopped = False  # Serve stopped it (__del__): its publications say so, and its pre-warm ends
        self.shared_dir = SharedDir.from_option(shared_dir)
        # The fleet's record of this class's sizes: deployments of other classes sharing the
        # directory keep records of their own.
        self.__sizes_file = self.sizes_file()
        # The pre-warm's thread: what it serves is not a request (not published as being served,
        # nor recorded as the fleet's demand).
        self.__warming = threading.local()
        self.__replica_id: str | None | bool = False  # False: not looked up yet
        self.__prewarmed = threading.Event()
        self.prewarmed: list[tuple] = []
        self.prewarm_seconds = 0.0
        hot = []
        if self.shared_dir is not None:
            self.shared_dir.apply()
            try:
                hot = self.__hot_sizes()
            except OSError as error:  # a replica that cannot read the record serves without a pre-warm
                logger.warning("shapecache: could not read the fleet's hot sizes in %s: %s; no pre-warm",
                               self.shared_dir.path, error)
        if not hot:
            self.__prewarmed.set()
        elif prewarm == "inline":
            self.__prewarm(hot, prewarm_limit)
        else:
            threading.Thread(target=self.__prewarm, args=(hot, prewarm_limit), name="shapecache-prewarm",
                             daemon=True).start()

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
        return self.serve_reported(*args, **kwargs)[0]

    def serve_reported(self, *args, **kwargs) -> tuple[object, Served | None]:
        """``serve``, and what the request got (None for a request without a size): return it
        with the response where callers should see it."""
        size = request_size(kwargs, self.size_keys)
        if size is None:
            return self.cached(*args, **kwargs), None
        with self.serving(size) as served:
            result = self.cached(*args, **kwargs)
        return result, served

    @contextlib.contextmanager
    def serving(self, size: tuple):
        """Marks `size` as being served for the duration; afterwards, notes which entries the
        calls inside used, and records a size whose calls built an entry in the shared
        directory. Yields a ``Served``, complete when the block ends (logged at DEBUG)."""
        size = check_size(size, len(self.size_keys))
        warming = getattr(self.__warming, "on", False)
        served = Served(size, self.replica_id())
        start = time.perf_counter()
        with self.__using(size, serving=not warming) as (built, used, awaited):
            yield served
        served.seconds = time.perf_counter() - start
        served.outcome = "built" if built else "hit" if used else "uncached"
        logger.debug("shapecache: %s", served)
        # Built on request: here, or in the background for an earlier call of the size (its
        # first call served by the entries that build made).
        if (built or awaited) and self.shared_dir is not None and not warming:
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
        """The sizes whose entries this replica holds, those it is serving now, and those
        whose builds it queued in the background."""
        return self.__held()[1]

    def record_routing_stats(self) -> dict:
        """What the router reads (Ray Serve calls this every routing-stats period)."""
        stats, stopped = self.__routing_stats(publishing=True)
        if self.shared_dir is not None:
            self.__write_fleet_view(stats, after_the_last=stopped)
        return stats

    def fleet_stats(self) -> dict:
        """This replica's id and its routing stats as of now (``{"replica": id, "stats": ...}``),
        without publishing them: what ``fleet_view(handle=...)`` asks every replica for."""
        return {"replica": self.replica_id(), "stats": self.__routing_stats(publishing=False)[0]}

    def __routing_stats(self, publishing: bool) -> tuple[dict, bool]:
        """The routing stats as of now, and whether the replica stopped. `publishing`: they are
        this period's publication (the next one's period counts from now)."""
        figures, held, size_bytes, not_held = self.__held()
        # The sizes served without being held build inline, but for those whose builds are
        # queued in the background (served uncached meanwhile): an inline build holds the
        # replica, a background one does not.
        building = max(0, not_held - figures["pending_builds"])
        with self.__lock:
            evicted, requests = dict(self.__evicted), dict(self.__requests)
            # Its period, as a replica started later reads it: how long its silence means it is gone.
            now = time.monotonic()
            period_s = None if self.__published is None else now - self.__published
            if publishing:
                self.__published = now
            stopped = self.__stopped
        stats = routing_stats(held, figures, time.time(), building=building, size_bytes=size_bytes, evicted=evicted,
                              requests=requests, period_s=period_s, stopped=stopped)
        return stats, stopped

    def stop(self) -> None:
        """Publishes this replica's last routing stats, which say it stopped, so that a replica
        started after it treats it as gone at once: its sizes come first in that replica's
        pre-warm, which does not wait for its silence (``_prewarm_order``). A pre-warm under way
        ends before its next size. Ray Serve calls it (through ``__del__``) as it stops the
        replica (a rolling update, a scale-down, a delete), once its requests have drained; a
        second call does nothing."""
        with self.__lock:
            if self.__stopped:
                return
            self.__stopped = True
        if self.shared_dir is not None:
            self.record_routing_stats()

    def __del__(self):
        """Ray Serve's hook as it stops a replica: ``stop``, where this object is the one the
        replica serves (its context's ``servable_object``). The garbage collector calls it
        too, on whatever thread allocates, where taking a lock or starting a thread can
        deadlock: for any other object (outside Serve, or another CachedReplica in a replica's
        process, which shares its id) it does nothing, and the replica Serve serves is
        collected only after Serve's call. A subclass that defines ``__del__`` calls this one."""
        serve = sys.modules.get("ray.serve")  # (no import: nothing that takes the import lock)
        if serve is None or getattr(self, "_CachedReplica__stopped", True):  # (a replica whose __init__ raised)
            return
        try:
            if serve.get_replica_context().servable_object is not self:
                return
        except Exception:  # noqa: BLE001 - not in a replica
            return
        try:
            self.stop()
        except Exception as error:  # noqa: BLE001 - never out of a destructor: the fleet sees it gone once silent
            logger.warning("shapecache: could not publish that the replica stopped: %s", error)

    def __write_fleet_view(self, stats: dict, after_the_last: bool = False) -> None:
        """Writes `stats` to the shared directory for the fleet view, on a thread of its own,
        waiting for it up to FLEET_WRITE_WAIT_S. A write that takes longer (a network volume
        gone away can block one for good) neither delays the router's stats nor holds one of
        Serve's threads each period: while it is under way, later periods write nothing.
        `after_the_last`: a write that must not be lost (the replica's last) first waits up to
        FLEET_WRITE_WAIT_S for one under way. (A daemon thread, not an executor's: those are
        joined at the interpreter's exit.)"""
        written = threading.Event()
        with self.__lock:
            under_way = self.__fleet_written
        if after_the_last and under_way is not None:
            under_way.wait(FLEET_WRITE_WAIT_S)
        with self.__lock:
            if self.__stopped and not after_the_last:  # stats read before the stop: the last is written
                return
            if self.__fleet_written is not None and not self.__fleet_written.is_set():
                log = logger.warning if after_the_last else logger.debug
                log("shapecache: the last write to %s is still under way; %s", self.shared_dir.path,
                    "the replica's last publication (stopped) is not written" if after_the_last else "skipped")
                return
            self.__fleet_written = written
        replica_id = self.replica_id() or f"{_THIS_PROCESS}-{id(self):x}"

        def write():
            try:
                self.shared_dir.publish_replica(self.replicas_dir(), replica_id, stats)
            except OSError as error:  # the router has the stats: the fleet view misses them this period
                logger.debug("shapecache: could not publish to %s: %s", self.shared_dir.path, error)
            finally:
                written.set()

        try:
            threading.Thread(target=write, name="shapecache-fleet-view", daemon=True).start()
        except RuntimeError as error:  # no thread can start (the interpreter is exiting): nothing is written
            written.set()
            logger.debug("shapecache: could not publish to %s: %s", self.shared_dir.path, error)
            return
        if not written.wait(FLEET_WRITE_WAIT_S):
            logger.warning("shapecache: writing what this replica holds to %s takes over %.1f s; the fleet view "
                           "misses it until the write ends", self.shared_dir.path, FLEET_WRITE_WAIT_S)

    @classmethod
    def replicas_dir(cls) -> str:
        """The name, in the shared directory, of the directory where this class's replicas
        publish their routing stats (the fleet view)."""
        return f"replicas.{cls.__name__}"

    @classmethod
    def fleet_view(cls, shared_dir=None, max_age_s: float = 60.0, *, handle=None, timeout_s: float = 10.0) -> list:
        """One ``ReplicaState`` per replica of this class, with its sizes, bytes, budget, builds
        in flight, requests per size and ``counts`` (calls, hits, misses, builds, evictions,
        uncached calls). With `handle` (a ``DeploymentHandle`` of the deployment), asked of every
        running replica at once through Ray Serve (``handle.broadcast``), each answering within
        `timeout_s` (a replica that does not is left out, with a warning; none running: []); no
        shared directory is needed. Each question takes one of the replica's
        ``max_ongoing_requests`` places while it waits and runs: a replica that is full answers
        once a request of its ends; in an event loop, ``fleet_view_async``. Else what every
        replica published within `max_age_s` to the shared directory (default:
        SHAPECACHE_SHARED_DIR), readable from any process that sees it."""
        if handle is not None:
            return _asked_of_every_replica(handle, timeout_s)
        shared = SharedDir.from_option(shared_dir)
        if shared is None:
            raise ValueError("shared_dir=None and SHAPECACHE_SHARED_DIR is not set: expected the directory the "
                             "replicas share")
        return shared.fleet(cls.replicas_dir(), max_age_s)

    @classmethod
    async def fleet_view_async(cls, *, handle, timeout_s: float = 10.0) -> list:
        """``fleet_view(handle=...)``, awaited: for a caller in an event loop (an async
        deployment, a FastAPI ingress), where the blocking form would stop the loop. It runs
        that form on a thread (``asyncio.to_thread``): Ray Serve's own awaited broadcast
        (``results_async``) gives nothing where one replica does not answer in time, where the
        blocking one gives the answers that came."""
        return await asyncio.to_thread(_asked_of_every_replica, handle, timeout_s)

    def __held(self) -> tuple[dict, set, dict, int]:
        """A snapshot of the cache's stats, and from it: the sizes held, being served or
        awaiting a background build, the bytes of each held size's entries, and how many
        sizes calls running now came for without the replica holding them."""
        with self.__lock:  # no call records its entries between the snapshot and what is read of it
            figures = sc.stats(self.cached)
            bytes_of = {entry["id"]: entry["bytes"] for entry in figures["entries"]}
            now = time.monotonic()
            self.__awaiting = {s: at for s, at in self.__awaiting.items() if now - at < AWAITING_S}
            for size in [s for s, ids in self.__entries_of.items() if not ids <= bytes_of.keys()]:
                del self.__entries_of[size]
                remember(self.__evicted, size, self.__evicted.get(size, 0) + 1, PUBLISHED_SIZES)
            size_bytes = {s: sum(bytes_of[i] for i in ids) for s, ids in self.__entries_of.items()}
            held = set(self.__entries_of) | set(self.__serving) | set(self.__awaiting)
            return figures, held, size_bytes, len(self.__building)

    def replica_id(self) -> str | None:
        """Ray Serve's id of this replica; None outside Serve."""
        if self.__replica_id is False:
            self.__replica_id = None
            if "ray" in sys.modules:  # (this module imports nothing of Ray itself)
                from ray import serve

                with contextlib.suppress(Exception):  # not in a replica: no context
                    self.__replica_id = serve.get_replica_context().replica_id.unique_id
        return self.__replica_id

    def wait_prewarmed(self, timeout: float | None = None) -> bool:
        """Waits until the pre-warm has ended; False where `timeout` seconds passed first."""
        return self.__prewarmed.wait(timeout)

    def prewarm_fits(self) -> bool:
        """Whether one more size fits the cache beside what it holds: its byte budget has room
        for the largest entry held (the next size's is not known before it is built), and
        its ``max_entries`` for one more entry."""
        figures = sc.stats(self.cached)
        largest = max((entry["bytes"] for entry in figures["entries"]), default=0)
        roomy = figures["budget"] is None or figures["bytes"] + largest <= figures["budget"]
        limit = figures.get("max_entries")
        return roomy and (limit is None or len(figures["entries"]) < limit)

    @contextlib.contextmanager
    def __using(self, size: tuple, serving: bool = True):
        """Marks `size` as being served (where `serving`); afterwards, records the entries the
        call used. Yields three lists, true afterwards where the calls built an entry, where
        they used one, and where they used the entries of the size's background build that an
        earlier served call queued."""
        with self.__lock:  # first: the size is held from the moment its call starts
            builds = size not in self.__entries_of
            if serving:
                self.__serving[size] += 1
                remember(self.__requests, size, self.__requests.get(size, 0) + 1, PUBLISHED_SIZES)
            if builds:
                self.__building[size] += 1
        built: list = []
        used: list = []
        awaited: list = []
        served = entries_served()  # what the calls on this thread serve: no scan of every entry
        failed = True
        try:
            with served:
                yield built, used, awaited
            failed = False
        finally:
            built.extend(served.built)
            used.extend(served.used)
            used = frozenset(served.used) | frozenset(served.built)
            with self.__lock:
                if serving:
                    self.__serving[size] -= 1
                    if not self.__serving[size]:
                        del self.__serving[size]
                if builds:
                    self.__building[size] -= 1
                    if not self.__building[size]:
                        del self.__building[size]
                if used:
                    self.__entries_of[size] = used
                    if self.__awaiting.pop(size, None) is not None and serving:
                        awaited.append(size)
                elif serving and not failed and self.__builds_in_background:  # ran uncached: its build is queued
                    self.__awaiting[size] = time.monotonic()

    def __hot_sizes(self) -> list[tuple]:
        """The fleet's hot sizes with as many sides as this class's size keys, in the order a new
        replica builds them (``SharedDir.hot_sizes``)."""
        hot = self.shared_dir.hot_sizes(self.__sizes_file, None, self.replicas_dir())
        return [s for s in hot if len(s) == len(self.size_keys)] if len(self.size_keys) > 1 else hot

    def __wait_until_decided(self) -> bool:
        """Waits while a replica that missed a publication is not yet known to be live (it
        publishes again) or gone (``decided_at``), looking again every second; returns whether
        it waited. A predecessor's death shows only so, and then its sizes come first."""
        wait = self.shared_dir.decided_s(self.replicas_dir())
        if wait <= 0:
            return False
        logger.info("shapecache: pre-warming in at most %.1f s, once the replicas that missed a publication are "
                    "known to be live or gone", wait)
        deadline = time.monotonic() + wait
        while wait > 0 and time.monotonic() < deadline and not self.__stopped:
            _sleep(min(wait, 1.0))
            wait = self.shared_dir.decided_s(self.replicas_dir())
        return True

    def __prewarm(self, hot: list[tuple], limit: int | None) -> None:
        """Builds the fleet's hot sizes, `hot` as first read, up to `limit` of them (None: every
        one; sizes held already are passed over, not counted), while the next fits. It starts
        once the replicas that missed a publication are decided (``__wait_until_decided``) and
        reads the order again before each size."""
        start = time.perf_counter()
        self.__warming.on = True
        tried: set = set()  # the sizes chosen, built or not
        attempted = 0  # those it tried to build (what `limit` counts)
        try:
            waited = self.__wait_until_decided()
            while (limit is None or attempted < limit) and not self.__stopped:
                if tried or waited:
                    try:
                        hot = self.__hot_sizes() or hot  # (a record gone meanwhile: the order as last read)
                    except OSError as error:
                        logger.debug("shapecache: could not read the hot sizes again: %s", error)
                size = next((s for s in hot if s not in tried), None)
                if size is None:
                    break
                tried.add(size)
                with self.__lock:
                    if size in self.__entries_of:  # held already (a request built it meanwhile)
                        continue
                attempted += 1
                if not self.prewarm_fits():
                    logger.info("shapecache: the budget is full after pre-warming %d of %d hot sizes",
                                len(self.prewarmed), len(hot))
                    break
                try:
                    with self.__using(size, serving=False) as (built, used, _):  # held, and published, once built
                        self.warm_up(size)
                    if not (built or used):  # its builds were queued in the background: once they end, a
                        # second warm-up is served by its entries, which it notes as the size's
                        if not sc.wait(self.cached, timeout=AWAITING_S):
                            logger.warning("shapecache: pre-warming size %s: its builds did not end within %.0f s; "
                                           "moving on", size, AWAITING_S)
                        with self.__using(size, serving=False):
                            self.warm_up(size)
                except Exception as error:  # noqa: BLE001 - a replica that cannot pre-warm still serves
                    logger.warning("shapecache: pre-warming size %s failed (%s: %s); override warm_up where a "
                                   "request needs more than its size", size, type(error).__name__, error)
                    continue
                self.prewarmed.append(size)
        finally:
            self.__warming.on = False
            self.prewarm_seconds = time.perf_counter() - start
            self.__prewarmed.set()
        logger.info("shapecache: pre-warmed %d hot sizes from %s in %.1f s: %s", len(self.prewarmed),
                    self.shared_dir.path, self.prewarm_seconds, self.prewarmed)


def _build_mode(cached) -> str | None:
    """How `cached` builds a size it does not hold: "background" where its ``build`` option says
    so and its backend lets builds leave the caller's thread on its device (a CUDA graph is
    captured inline, whatever the option: _backends.builds_in_background), else "inline"; None
    where it has no such option."""
    holder = holder_of(cached, "build")
    options = getattr(holder, "options", None) or getattr(getattr(holder, "wrapper", None), "options", None)
    build = getattr(options, "build", None)
    if build == "background":
        device = torch.device("cuda") if _on_cuda(cached) else torch.device("cpu")
        if not builds_in_background(options.backend, device):
            return "inline"
    return build


def _asked_of_every_replica(handle, timeout_s: float) -> list:
    """``fleet_view(handle=...)``: every running replica's ``fleet_stats``, through Ray Serve's
    ``DeploymentHandle.broadcast`` (public, alpha, in Ray 2.60)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
    if not callable(getattr(handle, "broadcast", None)):
        raise TypeError(f"handle={type(handle).__name__} object: expected a Ray Serve DeploymentHandle "
                        "(serve.run's, or serve.get_deployment_handle's)")
    if _in_event_loop():  # (Ray's own error names its response's method, not this one)
        raise RuntimeError("fleet_view(handle=...) waits for the replicas' answers, which would block this event "
                           "loop: inside one, await fleet_view_async(handle=...) instead")
    from ray.serve.exceptions import DeploymentUnavailableError

    try:
        answers = handle.broadcast("fleet_stats").results(timeout_s=timeout_s, return_exceptions=True)
    except (DeploymentUnavailableError, TimeoutError) as error:  # no replica running, or none found in time
        logger.warning("shapecache: no replica gave fleet stats within %s s: %s", timeout_s, error)
        return []
    states, failed = [], []
    for answer in answers:
        if isinstance(answer, BaseException) or not isinstance(answer, dict) or "stats" not in answer:
            failed.append(answer)
            continue
        states.append(ReplicaState.from_routing_stats(str(answer.get("replica")), answer["stats"]))
    if failed:
        logger.warning("shapecache: %d of %d replicas gave no fleet stats within %s s: %s", len(failed), len(answers),
                       timeout_s, "; ".join(repr(f) for f in failed[:3]))
    return states


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _on_cuda(cached) -> bool:
    """Whether `cached` runs on a CUDA device: a module's parameters or buffers, a pipeline's
    execution device; a cached function's device is not known, so any where CUDA is there."""
    if isinstance(cached, torch.nn.Module):
        device = next((t.device for t in (*cached.parameters(), *cached.buffers())), None)
    elif hasattr(cached, "components"):  # a diffusers pipeline (with model offload, its execution device)
        device = getattr(cached, "_execution_device", None) or getattr(cached, "device", None)
    else:
        return torch.cuda.is_available()
    return getattr(device, "type", None) == "cuda"
