"""CachedReplica without Ray: the sizes a replica says it holds, the routing stats it
publishes, the shared directory's records and the pre-warm of a replica started after others.
The replica class imports nothing of Ray; Ray Serve only calls its methods."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import shapecache as sc
from shapecache.ray_serve import CachedReplica, SharedDir
from shapecache.ray_serve._placement import COUNTS, FORMAT_KEY, ReplicaState, routing_stats
from shapecache.ray_serve._replica import PREWARM_LIMIT
from shapecache.testing.models import SmallConvNet


class NetReplica(CachedReplica):
    size_keys = ("size",)

    def __init__(self, shared_dir=None, max_entries=2, **options):
        torch.manual_seed(0)
        self.net = SmallConvNet().eval()
        super().__init__(sc.cached(self.net, backend="eager", max_entries=max_entries), shared_dir=shared_dir, **options)

    def __call__(self, size):
        with torch.inference_mode(), self.serving(size):
            return self.cached(torch.ones(1, 3, *size))


def test_a_subclass_keeps_its_own_attributes_and_a_class_made_in_a_function_its_sizes_record(tmp_path):
    # A subclass with a lock of its own named _lock, held around serving(): the base class's
    # state is its own (name-mangled), so the first request does not wait on itself.
    def make():
        class Locked(NetReplica):
            def __init__(self, **options):
                self._lock = threading.Lock()
                self._serving = "the subclass's"
                super().__init__(**options)

            def __call__(self, size):
                with self._lock:
                    return super().__call__(size)

        return Locked

    locked_class = make()
    replica = locked_class(shared_dir=tmp_path)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (replica(size=(8, 8)), done.set()))
    worker.start()
    worker.join(30)
    assert done.is_set() and replica._serving == "the subclass's"
    assert held(replica) == {(8, 8)}
    # The record's name is the class's name, which a replica unpickling the class agrees on
    # (its qualified name holds "make.<locals>", a driver's and a replica's may differ).
    assert locked_class.sizes_file() == "sizes.Locked.jsonl"
    assert (tmp_path / "sizes.Locked.jsonl").is_file()


def held(replica) -> set:
    return ReplicaState.from_routing_stats("r", replica.record_routing_stats()).sizes


def test_a_replica_holds_the_sizes_whose_entries_are_cached():
    replica = NetReplica(max_entries=2)
    replica(size=(8, 8))
    replica(size=(8, 12))
    assert held(replica) == {(8, 8), (8, 12)}
    replica(size=(12, 8))  # evicts (8, 8), the least recently used
    assert held(replica) == {(8, 12), (12, 8)}
    state = ReplicaState.from_routing_stats("r", replica.record_routing_stats())
    assert state.entries == 2 and state.pending_builds == 0 and state.published_at is not None
    # what the router weighs: each held size's bytes, the sizes evicted, the cache's counts
    assert state.size_bytes.keys() == {(8, 12), (12, 8)} and state.evicted == {(8, 8): 1}
    assert state.counts["evictions"] == 1 and state.counts["builds"] == 3 and state.building == 0
    assert NetReplica().record_routing_stats()["shapecache"]["period_s"] is None  # a first publication
    replica(size=(8, 12))
    # the requests of each size it served, which a replica started later pre-warms by, and the
    # time since its last publication, which tells one started later whether it is gone
    again = ReplicaState.from_routing_stats("r", replica.record_routing_stats())
    assert again.requests == {(8, 8): 1, (8, 12): 2, (12, 8): 1}
    assert 0 < again.period_s < 60


def test_each_request_can_say_what_it_got():
    class Plain(NetReplica):
        def __call__(self, size):
            with torch.inference_mode():
                return self.serve_reported(torch.ones(1, 3, *size), size=size)

        def serve_reported(self, x, size):  # the cached module takes the image; the size is the request's
            with self.serving(size) as served:
                result = self.cached(x)
            return result, served

    replica = Plain()
    outcomes = [replica(size=s)[1] for s in [(8, 8), (8, 8), (8, 12)]]
    assert [(s.size, s.outcome, s.replica) for s in outcomes] == [((8, 8), "built", None), ((8, 8), "hit", None),
                                                                  ((8, 12), "built", None)]
    assert all(s.seconds > 0 for s in outcomes)
    # a size whose build is queued in the background is served uncached meanwhile
    background = Plain()
    background.cached = sc.cached(SmallConvNet().eval(), backend="eager", build="background")
    try:
        first = background(size=(8, 8))[1]
        assert sc.wait(background.cached, timeout=60)
        assert (first.outcome, background(size=(8, 8))[1].outcome) == ("uncached", "hit")
    finally:
        sc.uncached(background.cached)


def test_serve_reports_what_a_request_with_size_keywords_got():
    class Sized(CachedReplica):
        size_keys = ("height", "width")

        def __init__(self):
            super().__init__(sc.cached(lambda height, width: torch.ones(height, width).sum(), backend="eager"))

    replica = Sized()
    result, served = replica.serve_reported(height=4, width=6)
    assert result == 24 and (served.size, served.outcome) == ((4, 6), "built")
    assert replica.serve_reported(height=4, width=6)[1].outcome == "hit"


def test_the_fleet_view_reads_what_each_replica_published_and_nothing_else(tmp_path, monkeypatch):
    first, second = NetReplica(shared_dir=tmp_path), NetReplica(shared_dir=tmp_path)
    first(size=(8, 8))
    first(size=(8, 8))
    second(size=(8, 12))
    for replica in (first, second):
        replica.record_routing_stats()
    fleet = tmp_path / NetReplica.replicas_dir()
    (fleet / "torn.json").write_bytes(b'{"shapecache": {"version": 2, "sizes": [[8,')
    (fleet / "infinite.json").write_bytes(b'{"shapecache": {"version": 2, "published_at": Infinity}}')
    (fleet / "deep.json").write_bytes(b"[" * 100_000)
    (fleet / "huge.json").write_bytes(b" " * (5 << 20))
    states = sorted(NetReplica.fleet_view(tmp_path), key=lambda state: sorted(state.sizes))
    assert [(s.sizes, s.counts["hits"], s.counts["builds"]) for s in states] == [({(8, 8)}, 1, 1), ({(8, 12)}, 0, 1)]
    assert [s.requests for s in states] == [{(8, 8): 2}, {(8, 12): 1}]
    assert NetReplica.fleet_view(tmp_path, max_age_s=1e-9) == []  # a replica that stopped publishing is gone
    monkeypatch.delenv("SHAPECACHE_SHARED_DIR", raising=False)
    with pytest.raises(ValueError, match="shared_dir=None"):
        NetReplica.fleet_view()


def test_fleet_stats_are_the_routing_stats_without_publishing_them_and_a_bad_handle_is_named(tmp_path):
    replica = NetReplica(shared_dir=tmp_path)
    replica(size=(8, 8))
    answer = replica.fleet_stats()
    assert answer["replica"] is None  # (outside Serve)
    assert ReplicaState.from_routing_stats("r", answer["stats"]).sizes == {(8, 8)}
    assert not (tmp_path / NetReplica.replicas_dir()).exists()  # nothing written: not a publication
    first = replica.record_routing_stats()[FORMAT_KEY]
    assert first["period_s"] is None  # fleet_stats did not count as the replica's last publication
    with pytest.raises(TypeError, match="handle=str object: expected a Ray Serve DeploymentHandle"):
        NetReplica.fleet_view(handle="tiny")
    with pytest.raises(ValueError, match="timeout_s=0: expected a positive number"):
        NetReplica.fleet_view(handle="tiny", timeout_s=0)
    with pytest.raises(TypeError, match="handle=str object: expected a Ray Serve DeploymentHandle"):
        asyncio.run(NetReplica.fleet_view_async(handle="tiny"))
    with pytest.raises(ValueError, match="timeout_s=-1: expected a positive number"):
        asyncio.run(NetReplica.fleet_view_async(handle="tiny", timeout_s=-1))


def test_a_replica_that_builds_inline_says_so_at_start(caplog):
    class Background(CachedReplica):
        size_keys = ("size",)

        def __init__(self):
            super().__init__(sc.cached(SmallConvNet().eval(), backend="eager", build="background"))

    with caplog.at_level(logging.INFO, logger="shapecache"):
        inline = NetReplica()
        background = Background()
    said = [r.getMessage() for r in caplog.records if "builds inline" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("shapecache: NetReplica builds inline")
    sc.uncached(inline.cached)
    sc.uncached(background.cached)


class BackgroundReplica(NetReplica):
    def __init__(self, shared_dir=None, max_entries=2, **options):
        torch.manual_seed(0)
        self.net = SmallConvNet().eval()
        CachedReplica.__init__(self, sc.cached(self.net, backend="eager", max_entries=max_entries, build="background"),
                               shared_dir=shared_dir, **options)


def test_with_background_builds_the_prewarm_waits_for_each_size_and_a_queued_size_is_held(tmp_path):
    # The pre-warm's calls only queue builds: it waits for each, credits its entries to the
    # size, and stops when the next would not fit (no size built to evict another).
    SharedDir(tmp_path).record_sizes([(16, 16), (12, 12), (8, 12), (8, 8)], BackgroundReplica.sizes_file())
    replica = BackgroundReplica(shared_dir=tmp_path)
    try:
        assert replica.wait_prewarmed(120)
        assert replica.prewarmed == [(16, 16), (12, 12)]
        assert sc.stats(replica.cached)["evictions"] == 0 and held(replica) == {(16, 16), (12, 12)}
        # a request of a new size runs uncached while its build is queued: the size is held
        # from then on (the router keeps sending it here), not counted as an eviction
        sc.clear(replica.cached)
        assert replica(size=(8, 8)) is not None and held(replica) == {(8, 8)}
        assert sc.wait(replica.cached, timeout=60)
        state = ReplicaState.from_routing_stats("r", replica.record_routing_stats())
        assert (8, 8) in state.sizes and state.building == 0
    finally:
        sc.uncached(replica.cached)


def test_the_fleet_view_skips_what_is_not_a_regular_file(tmp_path):
    replica = NetReplica(shared_dir=tmp_path)
    replica(size=(8, 8))
    replica.record_routing_stats()
    fleet = tmp_path / NetReplica.replicas_dir()
    os.mkfifo(fleet / "fifo.json")  # opening it for reading would wait for a writer
    (fleet / "zero.json").symlink_to("/dev/zero")
    states = NetReplica.fleet_view(tmp_path)
    assert [s.sizes for s in states] == [{(8, 8)}]


def test_a_hung_shared_directory_delays_no_routing_stats_and_holds_one_thread(tmp_path, monkeypatch, caplog):
    from shapecache.ray_serve import _replica

    replica = NetReplica(shared_dir=tmp_path)
    replica(size=(8, 8))
    volume_back, writes = threading.Event(), []
    write = replica.shared_dir.publish_replica

    def hung(*args):  # a network volume gone away: the write blocks until it is back
        writes.append(args)
        volume_back.wait(60)
        write(*args)

    monkeypatch.setattr(replica.shared_dir, "publish_replica", hung)

    def writers():
        return [t for t in threading.enumerate() if t.name == "shapecache-fleet-view"]

    try:
        for _ in range(3):
            returned = []
            caller = threading.Thread(target=lambda: returned.append(replica.record_routing_stats()))
            caller.start()
            caller.join(_replica.FLEET_WRITE_WAIT_S + 5)
            assert returned and returned[0]["shapecache"]["sizes"] == [[8, 8]]  # the router's stats, in time
        assert len(writes) == 1 and len(writers()) == 1  # later periods wait for the one write under way
        assert "takes over" in caplog.text
    finally:
        volume_back.set()
    for thread in writers():
        thread.join(10)
    assert [s.sizes for s in NetReplica.fleet_view(tmp_path)] == [{(8, 8)}]  # written once the volume is back
    replica(size=(8, 12))
    replica.record_routing_stats()  # no write under way: this one is written before the call returns
    assert len(writes) == 2 and [s.sizes for s in NetReplica.fleet_view(tmp_path)] == [{(8, 8), (8, 12)}]


def test_a_publication_sweeps_what_gone_replicas_and_killed_publishers_left(tmp_path):
    from shapecache.ray_serve import _shared_dir

    fleet = tmp_path / NetReplica.replicas_dir()
    fleet.mkdir()
    day_old = time.time() - _shared_dir.GONE_AFTER_S - 60
    files = {"gone.json": day_old, "recent.json": time.time() - 600, ".gone.json.x.tmp": time.time() - 7200,
             ".writing.json.y.tmp": time.time() - 60, "notes.txt": day_old}
    for name, mtime in files.items():
        (fleet / name).write_text("{}")
        os.utime(fleet / name, (mtime, mtime))
    replica = NetReplica(shared_dir=tmp_path)
    replica(size=(8, 8))
    replica.record_routing_stats()
    left = {p.name for p in fleet.iterdir()}
    assert not left & {"gone.json", ".gone.json.x.tmp"}
    assert {".writing.json.y.tmp", "notes.txt", "recent.json"} <= left  # a write in flight; not a replica's
    assert len(left) == 4  # and this replica's own


def test_replicas_and_the_policy_import_nothing_of_ray():
    code = ("import sys; from shapecache.ray_serve import CachedReplica, Placement, SharedDir, request_size; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_size_is_held_while_its_request_runs():
    replica = NetReplica()
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            state = ReplicaState.from_routing_stats("r", replica.record_routing_stats())
            seen.append((state.sizes, state.building))
            return x

    replica.cached = sc.cached(Probe(), backend="eager")
    replica(size=(8, 8))
    replica(size=(8, 8))
    # the first request builds (inline: the router sends the replica no new size meanwhile)
    assert seen == [({(8, 8)}, 1), ({(8, 8)}, 0)]


def test_a_pipeline_replica_reads_height_and_width():
    pytest.importorskip("diffusers")
    from shapecache.testing import tiny_pipelines

    class Painter(CachedReplica):
        def __init__(self):
            super().__init__(sc.wrap(tiny_pipelines.stable_diffusion(), backend="eager", prewarm=False))

        def __call__(self, prompt, height, width):
            return self.serve(prompt, height=height, width=width, num_inference_steps=1, output_type="pt").images

    painter = Painter()
    painter("a cat", height=32, width=32)
    painter("a cat", height=32, width=48)
    assert held(painter) == {(32, 32), (32, 48)}
    painter.serve("a cat", num_inference_steps=1, output_type="pt")  # no size: served, not noted
    assert held(painter) == {(32, 32), (32, 48)}


def test_a_replica_started_after_others_prewarms_the_fleet_s_hot_sizes(tmp_path):
    first = NetReplica(shared_dir=tmp_path, max_entries=4)
    for size in [(8, 8), (8, 12), (8, 8), (16, 16)]:
        first(size=size)
    records = [json.loads(line)["size"] for line in (tmp_path / NetReplica.sizes_file()).read_text().splitlines()]
    assert records == [[8, 8], [8, 12], [16, 16]]  # sizes built on request, each once

    second = NetReplica(shared_dir=tmp_path, max_entries=4)
    assert second.wait_prewarmed(60)
    assert second.prewarmed == [(16, 16), (8, 12), (8, 8)]  # most built first, then the larger
    assert held(second) == {(8, 8), (8, 12), (16, 16)}
    misses = sc.stats(second.cached)["misses"]
    second(size=(8, 12))
    assert sc.stats(second.cached)["misses"] == misses  # served by the pre-warmed entry
    # what a replica pre-warms is not the fleet's demand: the records did not grow
    assert len((tmp_path / NetReplica.sizes_file()).read_text().splitlines()) == 3


def test_a_replacement_prewarms_what_no_live_replica_holds_then_the_most_requested(tmp_path):
    shared = SharedDir(tmp_path)
    # (16, 16) was built most often (it kept being evicted), but was requested least
    shared.record_sizes([(16, 16), (16, 16), (16, 16), (8, 8), (8, 12), (12, 12)], NetReplica.sizes_file())
    now = time.time()
    published = {  # replica id -> (sizes held, requests served, published at, its period)
        "live": ([(8, 8)], {(8, 8): 50, (16, 16): 3}, now - 1, 600.0),
        # killed a minute ago: its sizes are held nowhere now, and its demand is the replacement's
        "dead": ([(8, 12), (12, 12)], {(8, 12): 40, (12, 12): 2}, now - 60, 2.0),
        "foreign": ([], {(99, 99): 10**9, (16, 16): -10**9}, now, None),  # sizes no replica built, and no count
    }
    for replica_id, (sizes, requests, at, period) in published.items():
        stats = routing_stats(sizes, {"bytes": 0, "budget": None, "entries": [], "pending_builds": 0,
                                      **dict.fromkeys(COUNTS, 0)}, at, requests=requests, period_s=period)
        shared.publish_replica(NetReplica.replicas_dir(), replica_id, stats)
    assert shared.hot_sizes(NetReplica.sizes_file(), replicas=NetReplica.replicas_dir()) == \
        [(8, 12), (16, 16), (12, 12), (8, 8)]
    assert shared.hot_sizes(NetReplica.sizes_file()) == [(16, 16), (12, 12), (8, 12), (8, 8)]  # built: most first
    replacement = NetReplica(shared_dir=tmp_path, max_entries=2, prewarm="inline")
    assert replacement.prewarmed == [(8, 12), (16, 16)] and held(replacement) == {(8, 12), (16, 16)}
    # what it pre-warmed is not demand: it publishes no request
    assert ReplicaState.from_routing_stats("r", replacement.record_routing_stats()).requests == {}


def publish(shared: SharedDir, replica_id: str, sizes, requests: dict, at: float, period_s: float | None,
            replica_class=None) -> None:
    stats = routing_stats(sizes, {"bytes": 0, "budget": None, "entries": [], "pending_builds": 0,
                                  **dict.fromkeys(COUNTS, 0)}, at, requests=requests, period_s=period_s)
    shared.publish_replica((replica_class or NetReplica).replicas_dir(), replica_id, stats)


@pytest.mark.parametrize("late_replica", ["died", "published again"])
def test_a_prewarm_waits_for_a_replica_that_missed_a_publication_to_be_gone_or_live(tmp_path, monkeypatch, late_replica):
    from shapecache.ray_serve import _replica

    shared = SharedDir(tmp_path)
    shared.record_sizes([(8, 8), (8, 12)], NetReplica.sizes_file())
    now = time.time()
    publish(shared, "other", [(8, 8)], {(8, 8): 50}, now, 600.0)
    publish(shared, "late", [(8, 12)], {(8, 12): 40}, now - 4, 2.0)  # its period is 2 s: it missed one
    slept = []

    def sleep(seconds):  # meanwhile the late replica is found gone, or publishes again
        slept.append(seconds)
        at = time.time() - 100 if late_replica == "died" else time.time()
        publish(shared, "late", [(8, 12)], {(8, 12): 40}, at, 2.0)

    monkeypatch.setattr(_replica, "_sleep", sleep)
    replica = NetReplica(shared_dir=tmp_path, max_entries=1, prewarm="inline")  # room for one size
    assert slept and all(0 < s <= 1.0 for s in slept)
    # died: its size is held nowhere, so it comes first; alive: each size is held, the most requested first
    assert replica.prewarmed == ([(8, 12)] if late_replica == "died" else [(8, 8)])


def test_sizes_built_in_the_background_on_request_are_recorded_once_built_and_prewarmed_by_the_next(tmp_path):
    first = BackgroundReplica(shared_dir=tmp_path, max_entries=4)
    sizes_file = tmp_path / BackgroundReplica.sizes_file()
    try:
        for size in [(8, 8), (8, 12)]:
            first(size=size)  # served uncached: its build is queued
        assert not sizes_file.exists()  # nothing built yet
        assert sc.wait(first.cached, timeout=60)
        for size in [(8, 8), (8, 12), (8, 8)]:
            first(size=size)  # served by the entries the background built
        records = [json.loads(line)["size"] for line in sizes_file.read_text().splitlines()]
        assert records == [[8, 8], [8, 12]]  # each once, when its first call used what was built for it
        second = BackgroundReplica(shared_dir=tmp_path, max_entries=4)
        try:
            assert second.wait_prewarmed(60)
            assert set(second.prewarmed) == {(8, 8), (8, 12)} and held(second) == {(8, 8), (8, 12)}
        finally:
            sc.uncached(second.cached)
    finally:
        sc.uncached(first.cached)


def test_prewarm_stops_when_the_budget_is_full_and_keeps_to_the_limit(tmp_path):
    SharedDir(tmp_path).record_sizes([(8, 8), (8, 12), (12, 8), (16, 16), (16, 16)], NetReplica.sizes_file())
    full = NetReplica(shared_dir=tmp_path, max_entries=2, prewarm="inline")
    assert full.prewarmed == [(16, 16), (8, 12)]  # a third would evict the first: not built
    assert sc.stats(full.cached)["evictions"] == 0
    limited = NetReplica(shared_dir=tmp_path, max_entries=4, prewarm_limit=1, prewarm="inline")
    assert limited.prewarmed == [(16, 16)]  # built most often
    # A record of many sizes: a replica not told a limit builds PREWARM_LIMIT of them, and
    # every one where told None.
    many = [(8, 8 + i) for i in range(PREWARM_LIMIT + 3)]
    SharedDir(tmp_path).record_sizes(many, NetReplica.sizes_file())
    assert len(NetReplica(shared_dir=tmp_path, max_entries=100, prewarm="inline").prewarmed) == PREWARM_LIMIT
    every = set(many) | {(8, 8), (8, 12), (12, 8), (16, 16)}
    unlimited = NetReplica(shared_dir=tmp_path, max_entries=100, prewarm_limit=None, prewarm="inline")
    assert len(unlimited.prewarmed) == len(every)


def test_a_replica_serves_while_it_prewarms_and_publishes_a_size_once_it_is_built(tmp_path):
    release = threading.Event()

    class Slow(NetReplica):
        def warm_up(self, size):
            if size == (16, 16):
                assert release.wait(60)
            super().warm_up(size)

    SharedDir(tmp_path).record_sizes([(16, 16), (8, 8)], Slow.sizes_file())

    replica = Slow(shared_dir=tmp_path, max_entries=4)  # returns at once: ready
    assert replica.prewarmed == [] and not replica.wait_prewarmed(0.1)
    replica(size=(12, 12))  # a request served during the pre-warm: held, and the fleet's demand
    state = ReplicaState.from_routing_stats("r", replica.record_routing_stats())
    # (16, 16) is being built: not advertised as held, but its build holds the replica (no new size meanwhile)
    assert state.sizes == {(12, 12)} and state.building == 1
    release.set()
    assert replica.wait_prewarmed(60)
    assert replica.prewarmed == [(16, 16), (8, 8)] and held(replica) == {(16, 16), (8, 8), (12, 12)}
    recorded = [json.loads(line)["size"] for line in (tmp_path / Slow.sizes_file()).read_text().splitlines()]
    assert recorded == [[16, 16], [8, 8], [12, 12]]  # what the pre-warm built is not recorded again


def test_a_stopped_replica_says_so_and_the_next_prewarms_its_sizes_first_without_waiting(tmp_path, monkeypatch):
    from shapecache.ray_serve import _replica

    entered, release = threading.Event(), threading.Event()

    class Slow(NetReplica):
        def warm_up(self, size):
            entered.set()
            assert release.wait(60)
            super().warm_up(size)

    shared = SharedDir(tmp_path)
    shared.record_sizes([(8, 8), (8, 12), (12, 12)], Slow.sizes_file())
    old = Slow(shared_dir=tmp_path, max_entries=4)  # pre-warming (12, 12), the largest, when Serve stops it
    assert entered.wait(60)
    old.record_routing_stats()
    for size in [(8, 12)] * 3 + [(12, 12)]:
        old(size=size)
    time.sleep(0.05)
    old.record_routing_stats()  # a publication with a period: its silence would be waited for
    old.stop()  # as Ray Serve calls it (through __del__) when it stops the replica, its requests drained
    release.set()
    assert old.wait_prewarmed(60) and old.prewarmed == [(12, 12)]  # the size under way, then no next
    old.stop()  # (again: nothing)
    [state] = shared.fleet(Slow.replicas_dir())
    assert state.stopped and state.sizes == {(8, 12), (12, 12)} and state.requests == {(8, 12): 3, (12, 12): 1}
    # a routing-stats call during the rest of its shutdown does not make it live again
    assert ReplicaState.from_routing_stats("r", old.record_routing_stats()).stopped
    assert shared.fleet(Slow.replicas_dir())[0].stopped

    # as the fleet sees it 5 s on, beside a live replica holding a size requested more
    [path] = (tmp_path / Slow.replicas_dir()).glob("*.json")
    last = json.loads(path.read_text())
    last["shapecache"].update(published_at=time.time() - 5, period_s=2.0)
    path.write_text(json.dumps(last))
    publish(shared, "survivor", [(8, 8)], {(8, 8): 50}, time.time(), 600.0, Slow)
    slept = []
    monkeypatch.setattr(_replica, "_sleep", slept.append)
    new = Slow(shared_dir=tmp_path, max_entries=2, prewarm="inline")  # a rolling update's new replica
    assert slept == []  # nothing to wait for, though the old one is silent past its period
    assert new.prewarmed == [(8, 12), (12, 12)]  # what it held and served, the most requested first
    # (unmarked, its sizes would count as held, and (8, 8) would come first after a wait)

    # Outside Serve the garbage collector's call publishes nothing: it may come on any thread,
    # at any allocation, where a lock or a thread started could deadlock
    outside = NetReplica(shared_dir=tmp_path / "outside", max_entries=1)
    outside.record_routing_stats()
    del outside
    gc.collect()
    [left] = SharedDir(tmp_path / "outside").fleet(NetReplica.replicas_dir())
    assert not left.stopped

    class Partial(NetReplica):
        def __init__(self):
            raise RuntimeError("a constructor that failed")

    with pytest.raises(RuntimeError):
        Partial()
    Partial.__new__(Partial).__del__()  # a replica made in part: nothing raised


def test_a_stats_call_read_before_the_stop_does_not_write_over_the_last_publication(tmp_path, monkeypatch):
    from shapecache.ray_serve import _replica

    read, go_on = threading.Event(), threading.Event()

    def slow_stats(*args, **kwargs):  # a stats call that read the replica, then lost the CPU
        stats = routing_stats(*args, **kwargs)
        if not kwargs["stopped"]:
            read.set()
            assert go_on.wait(60)
        return stats

    replica = NetReplica(shared_dir=tmp_path)
    monkeypatch.setattr(_replica, "routing_stats", slow_stats)
    late = threading.Thread(target=replica.record_routing_stats)
    late.start()
    assert read.wait(60)
    replica.stop()
    go_on.set()
    late.join(60)
    [state] = SharedDir(tmp_path).fleet(NetReplica.replicas_dir())
    assert state.stopped


def test_the_shared_directory_sets_the_caches_and_skips_torn_lines(tmp_path, monkeypatch, caplog):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "SHAPECACHE_TUNING_DB", "SHAPECACHE_SHARED_DIR"):
        monkeypatch.setenv(name, "")  # recorded, so that what apply() sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_HOST", "cache.internal")
    shared = SharedDir(tmp_path / "fleet")
    env = shared.environment()
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "fleet" / "inductor")
    assert env["SHAPECACHE_TUNING_DB"] == str(tmp_path / "fleet" / "tuning.json")
    assert env["TORCHINDUCTOR_REDIS_HOST"] == "cache.internal"
    shared.apply()
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == env["TORCHINDUCTOR_CACHE_DIR"]
    (tmp_path / "fleet").chmod(0o777)  # inductor's cache in it would run anyone's code: said so
    with caplog.at_level(logging.WARNING, logger="shapecache"):
        shared.apply()
    assert any("users other than its owner may write the directory (mode 777" in r.getMessage()
               and "whoever can write there runs code in every replica" in r.getMessage() for r in caplog.records)
    (tmp_path / "fleet").chmod(0o755)
    with open(tmp_path / "fleet" / NetReplica.sizes_file(), "ab") as f:
        f.write(b'{"size": [8, 8], "at": 1}\n{"size": [8,\n{"other": 1}\n{"size": [12, 8], "at": 2}\n')
        # What another process may have written: no line of it stops a replica, none is a size.
        f.write(b'{"size": [Infinity, 8]}\n{"size": [1e400, 8]}\n' + b"[" * 100_000 + b"\n\xff\xfe\n"
                b'{"size": [-5, 3]}\n{"size": [0, 0]}\n{"size": [1234567890123456789012, 8]}\n'
                b'{"size": [true, 8]}\n{"size": []}\n{"size": "8x8"}\n')
    assert shared.hot_sizes(NetReplica.sizes_file()) == [(12, 8), (8, 8)]  # equal counts: larger first
    monkeypatch.setenv("SHAPECACHE_SHARED_DIR", str(tmp_path / "fleet"))
    assert SharedDir.from_option().path == shared.path
    monkeypatch.delenv("SHAPECACHE_SHARED_DIR")
    assert SharedDir.from_option() is None


@pytest.mark.parametrize(("given", "match"), [
    ({"prewarm_limit": 0}, "prewarm_limit=0"),
    ({"prewarm": "eager"}, "prewarm='eager'"),
    ({"shared_dir": 3}, "shared_dir=3"),
])
def test_bad_options_are_named(tmp_path, given, match):
    with pytest.raises((TypeError, ValueError), match=match):
        NetReplica(**given)


def test_a_size_no_request_could_have_is_no_size_and_is_refused_where_given():
    from shapecache.ray_serve._request_size import check_size, request_size

    assert request_size({"height": 768, "width": 512}, ("height", "width")) == (768, 512)
    for kwargs in ({"size": -1}, {"size": 0}, {"size": 1 << 17}, {"size": tuple(range(1, 100_001))}, {"size": ()},
                   {"size": True}):
        assert request_size(kwargs, ("size",)) is None, kwargs
    assert request_size({"height": 0, "width": 8}, ("height", "width")) is None
    assert check_size((768.0, 512), 2) == (768, 512)
    for size, keys in (((float("inf"), 8), 2), ((float("nan"), 8), 2), ((-5, 3), 2), ((0, 0), 2), ((10**22, 8), 2),
                       (tuple(range(1, 20)), 1), ((8, 8, 8), 2), ("8x8", 1)):
        with pytest.raises(TypeError, match=r"size=.*: expected .*each from 1 to 65536"):
            check_size(size, keys)


def test_a_replica_of_an_uncached_object_or_bad_size_keys_is_refused():
    class Plain(CachedReplica):
        pass

    with pytest.raises(TypeError, match="cached=Linear object: expected what sc.cached or sc.wrap returned"):
        Plain(torch.nn.Linear(2, 2))

    class BadKeys(CachedReplica):
        size_keys = ("height", "")

    with pytest.raises(ValueError, match="size_keys="):
        BadKeys(sc.cached(torch.nn.Linear(2, 2), backend="eager"))


def test_a_size_that_fails_to_prewarm_is_skipped_and_the_replica_serves(tmp_path, caplog):
    class NeedsAnImage(NetReplica):
        def __call__(self, image, size):  # a request needs more than its size: warm_up is not overridden
            with torch.inference_mode(), self.serving(size):
                return self.cached(image)

    SharedDir(tmp_path).record_sizes([(8, 8)], NeedsAnImage.sizes_file())
    with caplog.at_level("WARNING", logger="shapecache"):
        replica = NeedsAnImage(shared_dir=tmp_path, prewarm="inline")
    assert replica.prewarmed == [] and "override warm_up" in caplog.text
    assert replica(torch.ones(1, 3, 8, 8), size=(8, 8)).shape == (1, 3, 8, 8)


def test_deployments_of_other_classes_keep_their_own_records(tmp_path):
    class Other(NetReplica):
        pass

    NetReplica(shared_dir=tmp_path)(size=(8, 8))
    assert Other(shared_dir=tmp_path, prewarm="inline").prewarmed == []


@pytest.mark.parametrize("size", [512, "64x64", (8.5, 8), (True, 8), ()])
def test_a_bad_size_is_named(size):
    with pytest.raises(TypeError, match=r"^size=.*: expected a sequence of integers"):
        with NetReplica().serving(size):
            pass
    class Painter(NetReplica):
        size_keys = ("height", "width")

    with pytest.raises(TypeError, match=r"^size=\(8,\): expected 2 integers, one per size key"):
        with Painter().serving((8,)):
            pass


def test_a_record_that_cannot_be_written_warns_and_the_request_is_served(tmp_path, caplog):
    replica = NetReplica(shared_dir=tmp_path)
    (tmp_path / NetReplica.sizes_file()).mkdir()  # opening it for appending fails
    with caplog.at_level("WARNING", logger="shapecache"):
        assert replica(size=(8, 8)).shape == (1, 3, 8, 8)
    assert "could not record size (8, 8)" in caplog.text
