"""A stream of requests at sizes that were not pre-warmed, on the CPU, per way of compiling.

    python benchmarks/new_sizes.py [--model res-convnet|unet] [--sizes 128x128,192x192,256x256]
                                   [--interval 0.25] [--per-size 120] [--strategies ...]

Requests arrive every `--interval` seconds (an open loop, as a service's requests do); a new
size joins the stream every `--per-size` requests and later requests mix it with the sizes
before it. A request's latency is from its arrival to its end, so a request that arrives while
an earlier one waits for a build waits too. Every strategy runs in a process of its own with an
empty inductor cache (every build is cold).

Strategies: eager; torch.compile with dynamic=False and with dynamic=True, both with inductor's
freezing (as benchmarks/cpu_sizes.py sets it); shapecache's compile backend with freezing,
building inline (a miss waits) or in the background (a miss runs eager while a worker builds):
compiled in a process of its own, as it is by default, or in the serving process
(`-thread`: SHAPECACHE_BACKGROUND_COMPILER=thread).

Printed per strategy: the latency of the first request at each new size, and its ratio to
eager's median latency at that size; p50 and p99 over the stream; for each size, the seconds from its first request to the
first request of it served at compiled speed (within 1.1x the best call that shapecache's
inline entry of that size made in this run), and in the background, what serving while a
build runs costs: the median eager request then against eager's own median at that size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from shapecache.scenarios import why_it_failed

STRATEGIES = ("eager", "compile-static", "compile-dynamic", "shapecache-inline", "shapecache-background",
              "shapecache-background-thread")
COMPILED_WITHIN = 1.1  # a request runs at compiled speed within this factor of the compiled entry's best


def build(model_name: str):
    """(model, inputs(h, w) -> args) with random weights (as benchmarks/cpu_sizes.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_sizes import build as build_model

    return build_model(model_name)


def schedule(sizes: list, requests_per_size: int) -> list:
    """The stream's sizes: a new size every `requests_per_size` requests; between, the newest
    size every other request and the earlier ones in turn."""
    stream = []
    for i in range(requests_per_size * len(sizes)):
        newest = i // requests_per_size
        stream.append(newest if i % 2 == 0 else (i // 2) % (newest + 1))
    return stream


def run_strategy(strategy: str, model_name: str, sizes: list, interval: float, per_size: int) -> dict:
    import torch

    import shapecache as sc

    model, inputs = build(model_name)
    options = {"options": {"freezing": True}}
    pending = None  # -> builds waiting or running, read before each request (a C++ counter)
    if strategy == "eager":
        forward = model
    elif strategy.startswith("compile-"):
        torch._inductor.config.freezing = True
        forward = torch.compile(model, dynamic=strategy == "compile-dynamic")
    else:
        build_mode = strategy.removeprefix("shapecache-").removesuffix("-thread")
        forward = sc.cached(model, backend="compile", compile_options=options, budget="4GiB", build=build_mode)
        dispatcher = forward.forward  # the module's cached forward
        pending = lambda: dispatcher.pending_builds  # noqa: E731
    arguments = [inputs(h, w) for h, w in sizes]
    records = []
    compiler_bytes = 0
    with torch.no_grad():
        start = time.perf_counter()
        for i, k in enumerate(schedule(sizes, per_size)):
            arrival = start + i * interval
            now = time.perf_counter()
            if now < arrival:
                time.sleep(arrival - now)
            building = pending is not None and pending() > 0
            begin = time.perf_counter()
            forward(*arguments[k])
            end = time.perf_counter()
            records.append({"size": k, "arrival": arrival - start, "service": end - begin, "latency": end - arrival,
                            "end": end - start, "building": building})
            if pending is not None and i % 10 == 0:  # the compiler's process, where builds compile in one
                compiler_bytes = max(compiler_bytes, sc.stats(forward)["compiler_bytes"])
    best = {}
    if strategy == "shapecache-inline":  # the compiled entries' best call per size: the reference speed
        with torch.no_grad():
            for k, args in enumerate(arguments):
                times = []
                for _ in range(10):
                    begin = time.perf_counter()
                    forward(*args)
                    times.append(time.perf_counter() - begin)
                best[k] = min(times)
    out = {"records": records, "best": best}
    if pending is not None:
        st = sc.stats(forward)
        out["builds"] = [e["build_seconds"] for e in sorted(st["entries"], key=lambda e: e["id"])]
        out["compiler_bytes"] = compiler_bytes
    return out


def percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def median(values: list) -> float:
    return percentile(values, 50) if values else float("nan")


def report(results: dict, sizes: list, interval: float) -> None:
    names = [f"{h}x{w}" for h, w in sizes]
    reference = {int(k): v for k, v in results.get("shapecache-inline", {}).get("best", {}).items()}
    eager = results.get("eager")
    eager_first = {}
    eager_median = {}
    if eager:
        for k in range(len(sizes)):
            of_size = [r for r in eager["records"] if r["size"] == k]
            eager_first[k] = median([r["latency"] for r in of_size[1:]])
            eager_median[k] = median([r["service"] for r in of_size[1:]])

    print("first request at each new size: latency ms (ratio to eager's median latency at that size)")
    print(f"{'strategy':<22} " + " ".join(f"{n:>20}" for n in names) + f" {'p50 ms':>9} {'p99 ms':>9}")
    for strategy, result in results.items():
        records = result["records"]
        cells = []
        for k in range(len(sizes)):
            first = next(r for r in records if r["size"] == k)
            ratio = f"({first['latency'] / eager_first[k]:.2f}x)" if k in eager_first else ""
            cells.append(f"{first['latency'] * 1e3:>10.0f} {ratio:>9}")
        latencies = [r["latency"] for r in records]
        print(f"{strategy:<22} " + " ".join(f"{c:>20}" for c in cells) +
              f" {percentile(latencies, 50) * 1e3:>9.0f} {percentile(latencies, 99) * 1e3:>9.0f}")

    if reference:
        print(f"\nseconds from a size's first request to its first request at compiled speed (within "
              f"{COMPILED_WITHIN}x shapecache's compiled entry: " +
              ", ".join(f"{names[k]} {reference[k] * 1e3:.1f} ms" for k in sorted(reference)) + ")")
        print(f"{'strategy':<22} " + " ".join(f"{n:>10}" for n in names) + f" {'builds s':>22}")
        for strategy, result in results.items():
            cells = []
            for k in range(len(sizes)):
                of_size = [r for r in result["records"] if r["size"] == k]
                fast = next((r for r in of_size if r["service"] <= COMPILED_WITHIN * reference[k]), None)
                cells.append("never" if fast is None else f"{fast['end'] - of_size[0]['arrival']:.1f}")
            builds = " ".join(f"{b:.1f}" for b in result.get("builds", [])) or "-"
            print(f"{strategy:<22} " + " ".join(f"{c:>10}" for c in cells) + f" {builds:>22}")

    for strategy in ("shapecache-background", "shapecache-background-thread"):
        background = results.get(strategy)
        if not (background and eager):
            continue
        eager_p99 = percentile([r["latency"] for r in eager["records"]], 99)
        building = [r["latency"] for r in background["records"] if r["building"]]
        builds = ", ".join(f"{b:.1f}" for b in background.get("builds", []))
        print(f"\n{strategy}: serving while the worker builds ({os.cpu_count()} cores shared; builds {builds} s)")
        if background.get("compiler_bytes"):
            print(f"  the compiler's process: {background['compiler_bytes'] / 2**20:.0f} MiB resident at most")
        if building:
            p99 = percentile(building, 99)
            print(f"  p99 latency of the {len(building)} requests that arrived while a build ran: {p99 * 1e3:.0f} ms "
                  f"against eager's p99 {eager_p99 * 1e3:.0f} ms ({p99 / eager_p99:.2f}x); slowest "
                  f"{max(building) * 1e3:.0f} ms")
        for k in range(len(sizes)):
            during = [r["service"] for r in background["records"] if r["size"] == k and r["building"]]
            if during and k in eager_median:
                print(f"  {names[k]:>9}: median uncached request {median(during) * 1e3:.1f} ms against eager's "
                      f"{eager_median[k] * 1e3:.1f} ms ({median(during) / eager_median[k]:.2f}x, {len(during)} requests)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("res-convnet", "unet"), default="res-convnet")
    # The defaults keep eager within the stream on 2 cores (at 512x512 a res-convnet call takes
    # longer than a request interval of 0.2 s, and the queue grows without end).
    parser.add_argument("--sizes", default="128x128,192x192,256x256")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between requests")
    parser.add_argument("--per-size", type=int, default=120, help="requests before the next new size")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in item.split("x")) for item in args.sizes.split(",")]
    if args.child:
        print(json.dumps(run_strategy(args.child, args.model, sizes, args.interval, args.per_size)))
        return
    import torch

    print(f"{args.model} on the CPU, torch {torch.__version__}, {os.cpu_count()} cores; a request every "
          f"{args.interval} s, a new size every {args.per_size} requests; each strategy in a process of its own "
          "with an empty inductor cache\n", flush=True)
    results, failed = {}, []
    for strategy in args.strategies.split(","):
        if strategy not in STRATEGIES:
            parser.error(f"--strategies: {strategy!r} is not one of {', '.join(STRATEGIES)}")
    for strategy in args.strategies.split(","):
        compiler = {"SHAPECACHE_BACKGROUND_COMPILER": "thread"} if strategy.endswith("-thread") else {}
        with tempfile.TemporaryDirectory() as cache_dir:
            done = subprocess.run(
                [sys.executable, __file__, "--child", strategy, "--model", args.model, "--sizes", args.sizes,
                 "--interval", str(args.interval), "--per-size", str(args.per_size)],
                capture_output=True, text=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, **compiler})
        if done.returncode != 0:
            print(f"{strategy}: failed: {why_it_failed(done)}", flush=True)
            failed.append(strategy)
            continue
        results[strategy] = json.loads(done.stdout.strip().splitlines()[-1])
    report(results, sizes, args.interval)
    if failed:
        sys.exit(f"\nstrategies that did not run: {', '.join(failed)}")


if __name__ == "__main__":
    main()
