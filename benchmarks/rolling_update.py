"""A rolling update on Ray Serve: how soon each new replica pre-warms the fleet's sizes, where
the stopped replicas publish that they stopped (``CachedReplica.stop``, which Serve calls
through ``__del__``) and where they do not (a subclass whose ``stop`` does nothing: what a
replica killed, or one whose ``__del__`` skips the base class's, leaves).

    python benchmarks/rolling_update.py [--runs 2] [--replicas 2]

One local Ray cluster (2 CPUs; each replica 0.5 CPU, one torch thread), HTTP off. A tiny conv
net (eager backend, so that a size's build is milliseconds and the pre-warm's time is its
wait) on `--replicas` replicas sharing a directory is asked for 4 sizes 3 times; then
``serve.run`` with new constructor arguments replaces every replica, one by one. Printed per
run and mode: the seconds each new replica's pre-warm took from its start (its wait for the
replicas that missed a publication included), the sizes it pre-warmed, and the update's time.
Exits 1 when a run failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from shapecache.ray_serve import CachedReplica, deployment  # noqa: E402

SIZES = [(8, 8), (8, 12), (12, 8), (16, 16)]


class TinyNet(CachedReplica):
    size_keys = ("size",)

    def __init__(self, generation: int):
        import torch

        import shapecache as sc
        from shapecache.testing.models import SmallConvNet

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.torch, self.generation = torch, generation
        super().__init__(sc.cached(SmallConvNet().eval(), backend="eager", max_entries=len(SIZES)))

    def __call__(self, size):
        with self.torch.inference_mode(), self.serving(size):
            self.cached(self.torch.ones(1, 3, *size))

    def prewarm_report(self):
        """This replica's id and generation, its pre-warm's seconds and sizes (once it ended)."""
        self.wait_prewarmed(120)
        return serve.get_replica_context().replica_id.unique_id, self.generation, self.prewarm_seconds, self.prewarmed


class SilentTinyNet(TinyNet):
    """Stopped without its last publication."""

    def stop(self) -> None:
        pass


def run(replica_class: type, replicas: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="rolling-update-") as shared:
        def app(generation: int):
            return deployment(replica_class, shared_dir=shared, num_replicas=replicas, max_ongoing_requests=4,
                              ray_actor_options={"num_cpus": 0.5}).bind(generation)

        handle = serve.run(app(1), name="rolling", route_prefix=None)
        time.sleep(3.0)  # the replicas' first publications, after which requests go by size
        for _ in range(3):
            for size in SIZES:
                handle.remote(size=size).result(timeout_s=120)
        time.sleep(3.0)  # each publishes what it holds, with its period
        start = time.monotonic()
        handle = serve.run(app(2), name="rolling", route_prefix=None)  # new arguments: every replica replaced
        update_s = time.monotonic() - start
        reports: dict = {}
        deadline = time.monotonic() + 300
        while len(reports) < replicas and time.monotonic() < deadline:
            replica_id, generation, seconds, prewarmed = handle.prewarm_report.remote().result(timeout_s=180)
            if generation == 2:
                reports[replica_id] = (seconds, prewarmed)
        serve.delete("rolling")
        if len(reports) < replicas:
            raise RuntimeError(f"{len(reports)} of {replicas} new replicas answered")
        return {"update_s": update_s, "new": list(reports.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.replicas < 1:
        parser.error(f"--runs={args.runs}, --replicas={args.replicas}: expected at least 1")

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    failures = []
    rows = []
    try:
        serve.start(proxy_location="Disabled")
        for number in range(1, args.runs + 1):
            for mode, replica_class in (("not marked (anchor)", SilentTinyNet), ("marked stopped", TinyNet)):
                try:
                    result = run(replica_class, args.replicas)
                except Exception as error:  # noqa: BLE001 - reported, and the exit status says so
                    failures.append(f"run {number}, {mode}: {error!r}")
                    continue
                waits = sorted(seconds for seconds, _ in result["new"])
                sizes = [len(prewarmed) for _, prewarmed in result["new"]]
                rows.append((number, mode, result["update_s"], waits, sizes))
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"\nA rolling update of {args.replicas} replicas ({len(SIZES)} sizes): each new replica's pre-warm, "
          "from its start\n")
    print("| run | stopped replicas | update, s | pre-warm of each new replica, s | sizes pre-warmed |")
    print("|---|---|---|---|---|")
    for number, mode, update_s, waits, sizes in rows:
        print(f"| {number} | {mode} | {update_s:.1f} | {', '.join(f'{w:.2f}' for w in waits)} | "
              f"{', '.join(map(str, sizes))} |")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
