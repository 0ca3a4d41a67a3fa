"""A real local Ray Serve app: two replicas of a tiny cached conv net behind the size-affinity
router, asked for 4 sizes. Run as a script by test_ray_app.py (in a process of its own, under a
hard timeout); prints one JSON line: which replica served each request, and each replica's
routing stats at the end.

    RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 python tests/ray_serve/two_replicas.py
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from shapecache.ray_serve import CachedReplica, SharedDir, deployment  # noqa: E402

SIZES = [(8, 8), (8, 12), (12, 8), (16, 16)]
ROUNDS = 6
STATS_PERIOD_S = 0.5
# The test is about where sizes go, not about spill-over (tests/ray_serve/test_placement.py):
# under load (this test beside others on 2 cores) a replica can miss Ray's queue-length probe
# deadlines for a while, and with max_ongoing_requests=1 the router's count of a replica's
# requests can lag its last reply, which both would spill requests. The requests are sent one
# at a time, so no replica is ever at max_ongoing_requests=4.
SPILL_AFTER_S = 30.0


class TinyNet(CachedReplica):
    size_keys = ("size",)

    def __init__(self):
        import torch

        import shapecache as sc
        from shapecache.testing.models import SmallConvNet

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.torch = torch
        super().__init__(sc.cached(SmallConvNet().eval(), backend="eager", max_entries=2))

    def __call__(self, size):
        with self.torch.inference_mode(), self.serving(size):
            self.cached(self.torch.ones(1, 3, *size))
        return serve.get_replica_context().replica_id.to_full_id_str(), sorted(self.sizes_held())


def router_state(handle) -> str:
    """What a handle's router held (Serve's private fields, read only to say why a request was
    never routed: whether the router had its replicas, and what the size-affinity policy knew)."""
    try:
        router = handle._router._asyncio_router
        request_router = router._request_router
        if request_router is None:
            return f"no request router yet (replicas received: {router._running_replicas is not None})"
        return (f"{len(request_router._replicas)} replicas; homes {request_router._placement.homes}; "
                f"published {[(rid, state) for rid, (_, state) in request_router._parsed.items()]}")
    except Exception as error:  # noqa: BLE001 - a diagnosis only
        return f"unreadable ({error!r})"


async def fleet_view_in_a_loop(handle) -> dict:
    try:
        TinyNet.fleet_view(handle=handle, timeout_s=30)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    states = await TinyNet.fleet_view_async(handle=handle, timeout_s=30)
    return {"refused": refused, "view": {s.replica_id: sorted(s.sizes) for s in states}}


def main() -> int:
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    shared = tempfile.TemporaryDirectory(prefix="two-replicas-")
    try:
        serve.start(proxy_location="Disabled")
        app = deployment(TinyNet, shared_dir=shared.name, num_replicas=2, stats_period_s=STATS_PERIOD_S, spill_after_s=SPILL_AFTER_S, max_ongoing_requests=4,
                         ray_actor_options={"num_cpus": 0.5}).bind()
        handle = serve.run(app, name="tiny", route_prefix=None)
        # Until the replicas first publish what they hold (one stats period after they start),
        # requests with a size go by Ray's default policy, which may put three sizes on one
        # replica: the traffic starts after that
        time.sleep(3 * STATS_PERIOD_S)
        served = [[size, *handle.remote(size=size).result(timeout_s=60)] for _ in range(ROUNDS) for size in SIZES]
        # A new handle has a router of its own, which knows nothing of where sizes went: it
        # routes by what the replicas published
        time.sleep(4 * STATS_PERIOD_S)
        fresh = serve.get_deployment_handle("TinyNet", app_name="tiny")
        try:
            served_fresh = [[size, *fresh.remote(size=size).result(timeout_s=60)] for size in SIZES for _ in range(2)]
        except TimeoutError:
            print(f"the new handle's router, as the timeout found it: {router_state(fresh)}", file=sys.stderr)
            raise
        # The fleet view through Serve (handle.broadcast): every replica's stats, no shared
        # directory read
        view = {s.replica_id: {"sizes": sorted(s.sizes), "hits": s.counts.get("hits", 0)}
                for s in TinyNet.fleet_view(handle=handle, timeout_s=30)}
        # ... and awaited in an event loop, where the blocking form refuses to run
        view_async = asyncio.run(fleet_view_in_a_loop(handle))
        # One replica killed: the requests after it are served by the replicas left (Ray
        # retries a request whose replica died before it started), its sizes among them
        victim = served[-1][1]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed_at = time.monotonic()
        after_kill = []
        for _ in range(3):
            for size in SIZES:
                try:
                    reply = handle.remote(size=size).result(timeout_s=60)
                    after_kill.append([size, *reply, time.monotonic() - killed_at])
                except Exception as error:  # noqa: BLE001 - the test reports it
                    after_kill.append([size, None, repr(error), time.monotonic() - killed_at])
        # Serve stops the replicas left (a delete, as a rolling update or a scale-down stops
        # some): each publishes its last stats, marked stopped, to the fleet view
        serve.delete("tiny")
        stopped = {s.replica_id: s.stopped for s in SharedDir(shared.name).fleet(TinyNet.replicas_dir(), 3600)}
        print(json.dumps({"served": served, "served_by_a_new_router": served_fresh, "killed": victim,
                          "after_kill": after_kill, "stopped": stopped, "fleet_view": view,
                          "fleet_view_async": view_async}))
    finally:
        serve.shutdown()
        ray.shutdown()
        shared.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
