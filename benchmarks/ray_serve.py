"""shapecache on Ray Serve: Ray's default router against the size-affinity router, then a
new replica cold against one started from the shared directory.

    python benchmarks/ray_serve.py [--model res-convnet|unet] [--sizes 4] [--requests 60]
                                   [--streams uniform,zipf] [--routers default,affinity]
                                   [--replicas 2] [--kill] [--build inline|background]
                                   [--replies FILE]

One run on this machine, real Ray Serve (a local cluster of 2 CPUs; each replica 0.5 CPU and
one torch thread; HTTP off, handles only). Two replicas of the model, cached with the compile
backend (inductor; `--compile frozen`, the default: inductor's freezing, whose graphs the
replicas share as packages through the shared directory; `--compile frozen-no-prepack`: freezing
without weight prepacking, whose graphs inductor's FX graph cache keeps too; `--compile plain`:
no freezing), each under a byte budget that holds about half of the sizes. A seeded stream of
requests at `--sizes` sizes (uniform, then Zipf with exponent 1.1) is sent by 2 client threads
through a deployment handle, once per router, each run with its own empty cache directory.
A replica runs one model call at a time (as a GPU does), so a request's build is its own.

Prints per stream and router: the hit rate after warm-up (the requests served by a hit,
after the first 2 x sizes and the first request of every size, which all end first), p50/p99 latency at the client, builds and evictions, and per replica the
cache's peak bytes against its budget and the process's peak resident memory, and the bound
no router can beat on the stream (``hit_rate_bound``: the replicas' entries pooled, the whole
stream seen ahead; with `--kill`, the killed replica's entries lost, its replacement serving at
once or never). Then a third
replica is started alone, once cold (no shared directory, an empty inductor cache) and once
with the shared directory the affinity run filled (that run waits, before its replicas stop,
until they have published a package per size), with a budget that holds every size (it is to
serve all the fleet's hot sizes): seconds from `serve.run` until it has served every hot size
once at compiled speed (a hit). Exits 1 when a run failed.

With `--kill`, half-way through the measured requests the replica that served the most of
them is killed (``ray.kill``; Serve starts a replacement), for both routers on the same
stream; the tables then also give, for each size the killed replica served, the seconds from
its first request after the kill to its first hit, when the replacement first served, and the
bound with the replacement's room from that request on (what the run could have got at best,
given how long Serve took to replace the replica). `--replicas N` runs N replicas (default 2;
3 with a kill leaves two while the replacement starts). `--build background` builds a size a
replica does not hold in the background, serving its requests uncached meanwhile (they count
as misses); the default, inline, makes the request wait for its build.

Per router it also says what made the slow requests slow (those over half the default's p99:
their own build, a wait behind another call in the replica, or time outside the call), and
`--replies FILE` appends every reply to FILE as a JSON line (stream, router, index, seconds
from the run's first request to its send, size, replica, outcome, latency at the client,
seconds queued in the replica and in the call, and when the call started, on the clock
perf_counter reads).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from shapecache.ray_serve import CachedReplica, SharedDir, deployment, hit_rate_bound  # noqa: E402

MiB = 1 << 20
STATS_PERIOD_S = 2.0  # how often each replica publishes what it holds (deployment's stats_period_s)
ALL_SIZES = [(256, 256), (256, 192), (192, 256), (192, 192), (128, 256), (256, 128), (128, 128), (128, 192)]
COMPILE_OPTIONS = {
    "frozen": {"options": {"freezing": True}},  # shared as packages through the shared directory
    "frozen-no-prepack": {"options": {"freezing": True, "cpp.weight_prepack": False}},  # and in the FX graph cache
    "plain": {},
}
PUBLISH_TIMEOUT_S = 900  # how long the affinity run waits for its replicas to publish their packages
CLIENTS = 2


class ModelReplica(CachedReplica):
    size_keys = ("size",)

    def __init__(self, model: str, budget: int, compile_variant: str, build: str = "inline"):
        import torch

        import shapecache as sc
        from shapecache.scenarios import build_model

        torch.set_num_threads(1)
        self.torch, self.sc, self.model_name = torch, sc, model
        if model == "unet":
            from diffusers import UNet2DConditionModel

            torch.manual_seed(0)
            network = UNet2DConditionModel(  # Stable Diffusion 1.5's layout at a quarter of its width
                block_out_channels=(64, 128, 256, 256), cross_attention_dim=256, attention_head_dim=8,
                sample_size=32).eval()
            self.text = torch.randn(1, 8, 256)
        else:
            network = build_model(model, torch.device("cpu"))
        self.call_lock = threading.Lock()  # one model call at a time, as on a GPU
        super().__init__(sc.cached(network, backend="compile", budget=budget, build=build,
                                   compile_options=COMPILE_OPTIONS[compile_variant]))

    def _run(self, size):
        latents = self.torch.ones(1, 4, size[0] // 8, size[1] // 8)
        if self.model_name == "unet":
            return self.cached(latents, 1, encoder_hidden_states=self.text)
        return self.cached(latents)

    def __call__(self, size):
        size = tuple(size)
        arrived = time.perf_counter()
        with self.call_lock:
            start = time.perf_counter()
            with self.torch.inference_mode(), self.serving(size) as served:
                self._run(size)
            seconds = time.perf_counter() - start
            stats = self.sc.stats(self.cached)
        # Not a hit: built here, or (background builds) served uncached while its build waits or runs.
        return {"replica": serve.get_replica_context().replica_id.unique_id, "built": served.outcome != "hit",
                "outcome": served.outcome, "queued": start - arrived, "started": start, "seconds": seconds,
                "builds": stats["builds"], "evictions": stats["evictions"],
                "peak_bytes": stats["peak_bytes"], "budget": stats["budget"],
                "smallest_entry": min((e["bytes"] for e in stats["entries"] if e["bytes"] > 0), default=None),
                "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def make_stream(kind: str, sizes: list, requests: int, seed: int) -> list:
    rng = random.Random(seed)
    if kind == "uniform":
        return [rng.choice(sizes) for _ in range(requests)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(sizes))]
    return rng.choices(sizes, weights=weights, k=requests)


def warmup_length(stream: list, least: int) -> int:
    """Requests before the stream is warm: at least `least`, and every size asked for once."""
    first_seen = {}
    for index, size in enumerate(stream):
        first_seen.setdefault(size, index)
    return max(least, max(first_seen.values()) + 1)


def run_stream(handle, stream: list) -> list:
    def one(size):
        start = time.perf_counter()
        reply = handle.remote(size=size).result(timeout_s=900)
        return {**reply, "size": size, "latency": time.perf_counter() - start, "sent": start,
                "ended": time.perf_counter()}

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, stream))


def kill_busiest_replica(app_name: str, replies: list) -> tuple[str, set]:
    """Kills the replica of `app_name` that served the most of `replies`; returns its id and
    the ids of the app's replicas alive before the kill (Serve names each replica's actor
    ``SERVE_REPLICA::<app>#<deployment>#<id>``)."""
    served = statistics.mode(r["replica"] for r in replies)
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith(f"SERVE_REPLICA::{app_name}#")]
    for actor in actors:
        if actor["name"].endswith(f"#{served}"):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
            return served, {a["name"].rsplit("#", 1)[-1] for a in actors}
    raise RuntimeError(f"no replica actor named for {served}")


def kill_index(stream: list, warmup: int) -> int:
    """The request before which `--kill` kills a replica: half-way through the measured ones."""
    return warmup + (len(stream) - warmup) // 2


def rehomed_seconds(killed: str, before: list, after: list) -> dict:
    """For each size the killed replica served before the kill: (seconds from its first request
    after the kill to the end of its first hit, inf where none was; the requests of it after
    the kill). A size requested once after the kill, by the request that built it again, has
    had no chance of a hit."""
    sizes = {tuple(r["size"]) for r in before if r["replica"] == killed}
    rehomed = {}
    for size in sizes:
        mine = sorted((r for r in after if tuple(r["size"]) == size), key=lambda r: r["sent"])
        hits = [r["ended"] for r in mine if not r["built"]]
        rehomed[size] = ((min(hits) - mine[0]["sent"]) if mine and hits else math.inf, len(mine))
    return rehomed


def rehomed_text(rehomed: dict) -> str:
    """'256x256 6.1 s (9 requests after the kill), 128x256 never (1 request after the kill)'."""
    return ", ".join(f"{h}x{w} {'never' if math.isinf(s) else f'{s:.1f} s'} ({n} request{'s' * (n != 1)} after the kill)"
                     for (h, w), (s, n) in sorted(rehomed.items()))


def router_run(kind: str, router: str, args, stream: list, shared: SharedDir) -> dict:
    options = dict(num_replicas=args.replicas, max_ongoing_requests=4, ray_actor_options={"num_cpus": 0.5})
    if router == "affinity":
        app = deployment(ModelReplica, shared_dir=shared.path, stats_period_s=STATS_PERIOD_S, **options)
    else:  # Ray's default router (power of two choices), the same replicas
        options["ray_actor_options"]["runtime_env"] = {"env_vars": shared.environment()}
        app = serve.deployment(ModelReplica, **options)
    handle = serve.run(app.bind(args.model, args.budget, args.compile, args.build), name=f"{router}", route_prefix=None)
    time.sleep(3 * STATS_PERIOD_S)  # the replicas have published once before the traffic starts
    warmup = warmup_length(stream, args.warmup)
    published = None
    rehomed = None
    killed_at = alive = None
    replies: list = []
    try:  # the warm-up requests end before the measured ones start
        replies += run_stream(handle, stream[:warmup])
        if args.kill:
            half = kill_index(stream, warmup)
            replies += run_stream(handle, stream[warmup:half])
            killed, alive = kill_busiest_replica(router, replies[warmup:])
            killed_at = time.perf_counter()
            after = run_stream(handle, stream[half:])
            rehomed = rehomed_seconds(killed, replies, after)
            replies += after
        else:
            replies += run_stream(handle, stream[warmup:])
        if router == "affinity" and args.compile != "plain":
            published = wait_for_packages(shared, len({tuple(size) for size in stream}))
    finally:
        if args.replies is not None:  # (what a failed run got, up to its last whole part, too)
            write_replies(args.replies, kind, router, replies, warmup, killed_at)
        serve.delete(f"{router}")
    warm = replies[warmup:]
    latencies = sorted(r["latency"] for r in warm)
    last = {}
    for reply in replies:
        last[reply["replica"]] = reply
    homes = {}
    for reply in warm:
        homes.setdefault(tuple(reply["size"]), set()).add(reply["replica"])
    smallest = min((r["smallest_entry"] for r in replies if r["smallest_entry"]), default=None)
    per_replica = None if smallest is None else max(1, args.budget // smallest)
    replaced = None
    if args.kill:
        by_start = sorted(replies, key=lambda r: r["started"])  # the order the calls started
        replaced = replacement(by_start, half, alive, killed_at)
        if per_replica is not None:
            replaced["bound"] = bound_as_served(by_start, warmup, half, replaced, args.replicas, per_replica)
    return {
        "hit_rate": sum(not r["built"] for r in warm) / len(warm),
        "bound": None if per_replica is None else bounds(stream, warmup, args, per_replica),
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)],
        "builds": sum(r["builds"] for r in last.values()),
        "evictions": sum(r["evictions"] for r in last.values()),
        "replicas": {rid: {k: r[k] for k in ("peak_bytes", "budget", "max_rss", "builds")} for rid, r in last.items()},
        "replicas_per_size": statistics.mean(len(v) for v in homes.values()),
        "published": published,
        "rehomed": rehomed,
        "replaced": replaced,
        "per_replica": per_replica,
        "warm": warm,
    }


def write_replies(path: str, stream: str, router: str, replies: list, warmup: int, killed_at: float | None) -> None:
    first = replies[0]["sent"] if replies else 0.0
    with open(path, "a") as log:
        for index, reply in enumerate(replies):
            print(json.dumps({"stream": stream, "router": router, "index": index, "warm": index >= warmup,
                              "sent_s": reply["sent"] - first,
                              "after_kill_s": None if killed_at is None else reply["sent"] - killed_at,
                              **{k: reply[k] for k in ("size", "replica", "outcome", "latency", "queued", "started",
                                                           "seconds")}}),
                  file=log)


def replacement(by_start: list, half: int, alive: set, killed_at: float) -> dict:
    """When the killed replica's replacement (a replica not alive before the kill) first served:
    the index of that request in `by_start` (the replies in the order their calls started), and
    the seconds from the kill to its end; None for both where it served none."""
    first = next((i for i in range(half, len(by_start)) if by_start[i]["replica"] not in alive), None)
    return {"index": first, "after_s": None if first is None else by_start[first]["ended"] - killed_at}


def bound_as_served(by_start: list, warmup: int, half: int, replaced: dict, replicas: int, per_replica: int) -> float:
    """``hit_rate_bound`` of the requests in the order their calls started, `by_start` (each
    replica makes one call at a time, so a replica served its requests in this order, which two
    clients' requests need not keep), the replacement's room from the first it served. The
    warm-up's requests and those before the kill all ended before the next started, so their
    places hold. (The replica's perf_counter and the driver's are one clock on Linux:
    CLOCK_MONOTONIC.)"""
    served = [tuple(r["size"]) for r in by_start]
    return hit_rate_bound(served, replicas * per_replica, counted_from=warmup, kill_at=half, lost=per_replica,
                          replaced_at=len(served) if replaced["index"] is None else replaced["index"])


def slow_requests(warm: list, over_s: float) -> str:
    """What made the measured requests slower than `over_s` slow: their own build (or an
    uncached call), or, for a hit, the largest part of its time: the call itself, its wait in
    the replica behind another call, or the time outside the replica (Ray's routing, the wait
    for a core)."""
    slow = [r for r in warm if r["latency"] > over_s]
    parts = collections.Counter()
    for r in slow:
        if r["outcome"] != "hit":
            parts["built"] += 1
            continue
        outside = r["latency"] - r["queued"] - r["seconds"]
        parts[max((r["seconds"], "call"), (r["queued"], "queued"), (outside, "outside"))[1]] += 1
    return (f"{len(slow)} of {len(warm)} took over {over_s * 1e3:.0f} ms: {parts['built']} built or ran uncached; "
            f"hits slow mostly in their call {parts['call']}, waiting behind another call {parts['queued']}, "
            f"outside the call {parts['outside']}")


def bounds(stream: list, warmup: int, args, per_replica: int) -> dict:
    """`hit_rate_bound` of the stream after the warm-up: the replicas' entries pooled
    (`per_replica` each: the budget over the smallest entry measured); with the kill, the
    killed replica's lost and its replacement's room there at once, or never."""
    entries = args.replicas * per_replica
    if not args.kill:
        return {"entries": entries, "bound": hit_rate_bound(stream, entries, counted_from=warmup)}
    half = kill_index(stream, warmup)
    return {"entries": entries,
            "bound": hit_rate_bound(stream, entries, counted_from=warmup, kill_at=half, lost=per_replica),
            "without_replacement": hit_rate_bound(stream, entries, counted_from=warmup, kill_at=half,
                                                  lost=per_replica, entries_after_kill=entries - per_replica)}


def wait_for_packages(shared: SharedDir, count: int) -> dict:
    """Waits until the shared directory holds `count` packages (a replica's build of a frozen
    graph publishes its package as it ends; an earlier release's, after it): their count and
    the seconds waited."""
    start = time.perf_counter()
    packages = shared.packages
    while True:
        found = len(list(packages.glob("*.pt2"))) if packages.is_dir() else 0
        waited = time.perf_counter() - start
        if found >= count or waited > PUBLISH_TIMEOUT_S:
            return {"packages": found, "of": count, "waited": waited}
        time.sleep(1)


def new_replica_run(label: str, args, shared: SharedDir | None, hot: list) -> dict:
    """A replica started alone: with `shared`, it pre-warms the hot sizes from that directory;
    without, it starts cold (an empty inductor cache, nothing shared, nothing published)."""
    start = time.perf_counter()
    actor_options = {"num_cpus": 0.5}
    if shared is None:
        empty = tempfile.mkdtemp(prefix="shapecache-cold-")
        actor_options["runtime_env"] = {"env_vars": {"TORCHINDUCTOR_CACHE_DIR": os.path.join(empty, "inductor"),
                                                     "SHAPECACHE_TUNING_DB": os.path.join(empty, "tuning.json")}}
    app = deployment(ModelReplica, shared_dir=None if shared is None else shared.path, num_replicas=1,
                     max_ongoing_requests=4, ray_actor_options=actor_options)
    handle = serve.run(app.bind(args.model, args.budget_all, args.compile, args.build), name=label, route_prefix=None)
    ready = time.perf_counter() - start
    try:
        replies = []
        for size in hot:  # until each hot size has been served once at compiled speed
            while True:
                reply = handle.remote(size=size).result(timeout_s=900)
                replies.append(reply)
                if not reply["built"]:
                    break
        done = time.perf_counter() - start
    finally:
        serve.delete(label)
    return {"ready": ready, "served_all": done, "built_on_request": sum(r["built"] for r in replies)}


def fmt_bytes(n) -> str:
    return "none" if n is None else f"{n / MiB:.0f} MiB"


def report_stream(kind: str, results: dict) -> None:
    """Prints, under the table, what each router's run of stream `kind` got beyond it."""
    ran = [(name, results[kind, name]) for name in ("default", "affinity") if (kind, name) in results]
    if not ran:
        return
    d, a = results.get((kind, "default")), results.get((kind, "affinity"))
    print()
    if d is not None and a is not None:
        print(f"{kind}: affinity/default p99 {a['p99'] / d['p99']:.2f}x, hit rate {a['hit_rate']:.0%} "
              f"against {d['hit_rate']:.0%}")
    over = [v for _, r in ran for v in r["replicas"].values() if v["peak_bytes"] > v["budget"]]
    print(f"{kind}: replicas over budget: {len(over)}")
    b = ran[-1][1]["bound"]
    if b is not None:
        print(f"{kind}: the bound for any router (hit_rate_bound, {b['entries']} entries pooled): "
              f"{b['bound']:.0%}" + (f" with the replacement serving at once, {b['without_replacement']:.0%} "
                                      "without one" if "without_replacement" in b else ""))
    slow_over = (d if d is not None else ran[0][1])["p99"] / 2  # half the default's p99, where it ran
    for name, r in ran:
        rep = r["replaced"]
        if rep is not None:
            when = ("served none of the stream" if rep["index"] is None else
                    f"first served call {rep['index']} (of the stream's, in the order they started), "
                    f"ending {rep['after_s']:.1f} s after the kill")
            line = f"{kind} {name}: the replacement {when}"
            if "bound" in rep:
                prewarmed = min(1.0, rep["bound"] + r["per_replica"] / len(r["warm"]))
                line += (f"; the bound as the calls ran, its room from then on: {rep['bound']:.0%} "
                         f"({prewarmed:.0%} with what its pre-warm, which the bound leaves out, could add: at "
                         f"most {r['per_replica']} hits)")
            print(line)
        print(f"{kind} {name}: {slow_requests(r['warm'], slow_over)}")
        if r["rehomed"] is not None:
            print(f"{kind} {name}: the killed replica's sizes, first request after the kill to first hit: "
                  + rehomed_text(r["rehomed"]))
    if a is not None and a["published"] is not None:
        p = a["published"]
        print(f"{kind}: the affinity replicas published {p['packages']} of {p['of']} packages, "
              f"{p['waited']:.0f} s after the stream ended")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("res-convnet", "unet"), default="res-convnet")
    parser.add_argument("--compile", choices=tuple(COMPILE_OPTIONS), default="frozen",
                        help="frozen: inductor's freezing; frozen-no-prepack: without weight prepacking; plain: no "
                             "freezing (default %(default)s)")
    parser.add_argument("--build", choices=("inline", "background"), default="inline",
                        help="how a replica builds a size it does not hold: inline (the request waits) or background "
                             "(served uncached meanwhile) (default %(default)s)")
    parser.add_argument("--sizes", type=int, default=4, choices=range(2, len(ALL_SIZES) + 1), metavar="M")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--streams", default="uniform,zipf")
    parser.add_argument("--routers", default="default,affinity",
                        help="default and/or affinity (the new replicas need an affinity run's directory)")
    parser.add_argument("--budget-mib", type=int, default=None,
                        help="each replica's budget (default: half the sizes' entries, measured at the first build)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kill", action="store_true", help="kill the busiest replica half-way (both routers)")
    parser.add_argument("--replies", default=None, metavar="FILE",
                        help="append every reply to FILE, a JSON object a line: stream, router, index, send time, "
                             "size, replica, "
                             "outcome, latency at the client, seconds queued in the replica and in the call, when "
                             "the call started")
    args = parser.parse_args(argv)
    sizes = ALL_SIZES[:args.sizes]
    args.warmup = 2 * len(sizes)
    streams, routers = args.streams.split(","), args.routers.split(",")
    if not set(streams) <= {"uniform", "zipf"} or not set(routers) <= {"default", "affinity"}:
        parser.error(f"--streams={args.streams!r}, --routers={args.routers!r}: expected uniform and/or zipf, "
                     "default and/or affinity")
    if args.kill and args.replicas < 2:
        parser.error(f"--kill with --replicas={args.replicas}: the kill would leave no replica to serve while Serve "
                     "replaces it; expected --replicas 2 or more")
    if args.requests <= args.warmup:
        parser.error(f"--requests={args.requests}: must exceed the warm-up's {args.warmup} requests")

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    failures = []
    results, new_replica = {}, {}
    try:
        serve.start(proxy_location="Disabled")
        if args.budget_mib is None:  # about half the sizes: what one entry costs, times sizes / 2, plus half an entry
            with tempfile.TemporaryDirectory(prefix="shapecache-probe-") as probe:
                shared = SharedDir(probe)
                app = serve.deployment(ModelReplica, ray_actor_options={
                    "num_cpus": 0.5, "runtime_env": {"env_vars": shared.environment()}})
                handle = serve.run(app.bind(args.model, None, args.compile, "inline"), name="probe", route_prefix=None)
                entry = handle.remote(size=sizes[0]).result(timeout_s=900)["peak_bytes"]
                serve.delete("probe")
            args.budget = int(entry * (len(sizes) // 2 + 0.5))
            args.budget_all = int(entry * (len(sizes) + 0.5))
        else:
            args.budget = args.budget_mib * MiB
            args.budget_all = args.budget * 2
        print(f"{args.model} ({args.compile}, {args.build} builds), {len(sizes)} sizes, {args.requests} requests per stream from {CLIENTS} clients, "
              f"{args.replicas} replicas of 0.5 CPU and 1 torch thread, budget {fmt_bytes(args.budget)} each"
              f"{', the busiest killed half-way' if args.kill else ''} "
              f"(a third replica: {fmt_bytes(args.budget_all)})\n", flush=True)
        affinity_dir = None
        for kind in streams:
            stream = make_stream(kind, sizes, args.requests, args.seed)
            for router in routers:
                directory = tempfile.mkdtemp(prefix=f"shapecache-{router}-")
                try:
                    results[kind, router] = router_run(kind, router, args, stream, SharedDir(directory))
                    published = results[kind, router]["published"]
                    if published is not None and published["packages"] < published["of"]:
                        failures.append(f"{kind}/{router}: {published['packages']} of {published['of']} packages were "
                                        f"published within {PUBLISH_TIMEOUT_S} s; the shared replica would not read them")
                    if router == "affinity":
                        affinity_dir = directory
                except Exception as error:  # noqa: BLE001 - reported, and the exit status says so
                    failures.append(f"{kind}/{router}: {type(error).__name__}: {error}")
                print(f"  {kind:8} {router:9} done", flush=True)
        if affinity_dir is not None:
            # (in the order the shared replica pre-warms them, so that each request asks for the next)
            hot = SharedDir(affinity_dir).hot_sizes(ModelReplica.sizes_file(), replicas=ModelReplica.replicas_dir())
            if not hot:  # a third replica would measure nothing
                failures.append("new replica: the affinity run recorded no hot size (none of its builds ended "
                                "within the stream)")
            else:
                for label, shared in (("cold", None), ("shared", SharedDir(affinity_dir))):
                    try:
                        new_replica[label] = new_replica_run(label, args, shared, hot)
                    except Exception as error:  # noqa: BLE001
                        failures.append(f"new replica {label}: {type(error).__name__}: {error}")
    finally:
        serve.shutdown()
        ray.shutdown()

    print("\n| stream | router | hit rate after warm-up | p50 | p99 | builds | evictions | replicas per size | "
          "each replica: cache peak / budget, process peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (kind, router), r in results.items():
        each = "; ".join(f"{fmt_bytes(v['peak_bytes'])} / {fmt_bytes(v['budget'])}, {fmt_bytes(v['max_rss'])}"
                         for v in r["replicas"].values())
        print(f"| {kind} | {router} | {r['hit_rate']:.0%} | {r['p50'] * 1e3:.0f} ms | {r['p99'] * 1e3:.0f} ms | "
              f"{r['builds']} | {r['evictions']} | {r['replicas_per_size']:.2f} | {each} |")
    for kind in streams:
        report_stream(kind, results)
    if new_replica:
        print("\n| third replica | ready (serve.run returned) | served every hot size at compiled speed | "
              "builds on request |")
        print("|---|---|---|---|")
        for label, r in new_replica.items():
            print(f"| {label} | {r['ready']:.1f} s | {r['served_all']:.1f} s | {r['built_on_request']} |")
        if len(new_replica) == 2:
            print(f"\nshared directory against cold: {new_replica['cold']['served_all'] / new_replica['shared']['served_all']:.1f}x "
                  "faster to serve every hot size")
    runs = {f"{k}/{r}": {**{n: x for n, x in v.items() if n != "warm"}, "rehomed": None if v["rehomed"] is None else
                         {f"{h}x{w}": {"seconds": s, "requests": n} for (h, w), (s, n) in v["rehomed"].items()}}
            for (k, r), v in results.items()}
    print(json.dumps({"runs": runs, "new_replica": new_replica}), file=sys.stderr)
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
