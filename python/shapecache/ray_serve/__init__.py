"""shapecache on Ray Serve: replicas that each hold some sizes, a router that sends each
request to a replica holding its size, and a directory through which replicas share what
they compiled. Needs the ``ray`` extra (``pip install "shapecache[ray]"``); nothing of Ray is
imported until a name below is used.

    from shapecache.ray_serve import CachedReplica, deployment

    class Painter(CachedReplica):
        def __init__(self):
            super().__init__(sc.wrap(make_pipeline(), budget="20GiB"))

        def __call__(self, prompt: str, height: int, width: int):
            return self.serve(prompt, height=height, width=width).images[0]

    app = deployment(Painter, num_replicas=2, shared_dir="/mnt/shapecache").bind()

docs/ray-serve.md has the whole app, the routing rules and the measurements.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_PUBLIC = {
    "CachedReplica": "shapecache.ray_serve._replica",
    "Served": "shapecache.ray_serve._replica",
    "deployment": "shapecache.ray_serve._deployment",
    "SizeAffinityRouter": "shapecache.ray_serve._router",
    "SharedDir": "shapecache.ray_serve._shared_dir",
    "Placement": "shapecache.ray_serve._placement",
    "ReplicaState": "shapecache.ray_serve._placement",
    "request_size": "shapecache.ray_serve._request_size",
    "SimulatedFleet": "shapecache.ray_serve._simulated_fleet",
    "SizeCost": "shapecache.ray_serve._simulated_fleet",
    "FleetReport": "shapecache.ray_serve._simulated_fleet",
    "simulate_fleet": "shapecache.ray_serve._simulated_fleet",
    "hit_rate_bound": "shapecache.ray_serve._hit_rate_bound",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'shapecache.ray_serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


if TYPE_CHECKING:
    from shapecache.ray_serve._deployment import deployment  # noqa: F401
    from shapecache.ray_serve._hit_rate_bound import hit_rate_bound  # noqa: F401
    from shapecache.ray_serve._placement import Placement, ReplicaState  # noqa: F401
    from shapecache.ray_serve._replica import CachedReplica, Served  # noqa: F401
    from shapecache.ray_serve._request_size import request_size  # noqa: F401
    from shapecache.ray_serve._router import SizeAffinityRouter  # noqa: F401
    from shapecache.ray_serve._shared_dir import SharedDir  # noqa: F401
    from shapecache.ray_serve._simulated_fleet import FleetReport, SimulatedFleet, SizeCost, simulate_fleet  # noqa: F401
