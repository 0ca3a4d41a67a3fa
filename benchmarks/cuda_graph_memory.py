"""Peak memory and per-call time over six image sizes: CUDA graphs per size, side by side.

    python benchmarks/cuda_graph_memory.py [--dtype float16] [--batch 2] [--calls 10] [--json out.json]

A UNet of SD1.5 architecture with random weights is called at each size (latents = pixels/8),
in the order given, by each strategy in a process of its own (so peaks do not mix):

  eager              the module itself
  naive_graphs       one torch.cuda.CUDAGraph per size, each with its own pool, all kept
                     (what per-size graph caches such as stable-fast do)
  reduce_overhead    torch.compile(mode="reduce-overhead", dynamic=False): CUDA graph trees
  shapecache         sc.cached(backend="cuda_graph"): one pool per device, replayed from C++
  shapecache_compile sc.cached(backend="compile+cuda_graph")
  largest_alone      shapecache at the largest size only: the floor for peak memory

Each row: peak reserved memory over the whole loop, what stays reserved after it, the median per-call time (CUDA events,
after each size's first call) per size, and the first call's time (build). Ratios are
against `shapecache`. Goal: shapecache's peak <= 1.15x largest_alone's; its per-call time
within 3% of naive_graphs'. Needs a CUDA device and diffusers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from shapecache.scenarios import why_it_failed

# Smallest first: the order that grows a shared pool most.
SIZES = [(1024, 1024), (1024, 1152), (1152, 1024), (1360, 1536), (1536, 1360), (1536, 1536)]
STRATEGIES = ["eager", "naive_graphs", "reduce_overhead", "shapecache", "shapecache_compile", "largest_alone"]
# also: "compile_dynamic" (torch.compile(dynamic=True)), "shapecache_tuned" (cuda_graph + tune_convs)


def run_strategy(strategy: str, dtype_name: str, batch: int, calls: int, model: str = "sd15",
                 budget: int | None = None) -> dict:
    import torch

    import shapecache as sc
    from shapecache.diffusers import unet_inputs
    from shapecache.scenarios import build_model, capture_per_size_graph

    dtype = getattr(torch, dtype_name)
    unet = build_model(model, torch.device("cuda")).to(dtype)
    sizes = SIZES[-1:] if strategy == "largest_alone" else SIZES

    def inputs(size):
        return unet_inputs(unet, size[0] // 8, size[1] // 8, batch, dtype=dtype)

    if strategy == "eager":
        def call(kwargs):
            return unet(**kwargs)[0]
    elif strategy == "naive_graphs":
        graphs = {}

        def call(kwargs):
            key = tuple(kwargs["sample"].shape)
            if key not in graphs:
                graphs[key] = capture_per_size_graph(type(unet).forward, unet, (), kwargs)
            return graphs[key](unet, **kwargs)[0].clone()
    elif strategy in ("reduce_overhead", "compile_dynamic"):
        options = {"mode": "reduce-overhead", "dynamic": False} if strategy == "reduce_overhead" else {"dynamic": True}
        compiled = torch.compile(unet, **options)

        def call(kwargs):
            return compiled(**kwargs)[0].clone()
    else:
        backend = "compile+cuda_graph" if strategy == "shapecache_compile" else "cuda_graph"
        # The largest size alone sets the floor; the others run under `budget` when one is given.
        chosen = budget if budget is not None and strategy != "largest_alone" else 1.0
        sc.cached(unet, backend=backend, budget=chosen, tune_convs=strategy == "shapecache_tuned")

        def call(kwargs):
            return unet(**kwargs)[0]

    torch.cuda.reset_peak_memory_stats()
    rows = []
    with torch.no_grad():
        for size in sizes:
            args = inputs(size)
            torch.cuda.synchronize()
            start = time.perf_counter()
            call(args)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            times = []
            for _ in range(calls):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                call(args)
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            rows.append({"size": size, "first_s": first, "median_ms": statistics.median(times)})
    result = {"strategy": strategy, "model": model, "peak_reserved": torch.cuda.max_memory_reserved(),
              "held_reserved": torch.cuda.memory_reserved(), "sizes": rows,
              "device": torch.cuda.get_device_name()}
    if strategy == "shapecache_tuned":
        from shapecache._extension import _C

        result["tuning"] = _C.tuning_stats()
    if strategy.startswith("shapecache") or strategy == "largest_alone":
        st = sc.stats(unet)
        result.update(pool_bytes=st["pool_bytes"], entry_bytes=st["entry_bytes"], entries=len(st["entries"]),
                      evictions=st["evictions"], pool_rebuilds=st["pool_rebuilds"], budget=st["budget"])
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--model", choices=("sd15", "sdxl"), default="sd15")
    parser.add_argument("--strategy", default=None, help=argparse.SUPPRESS)  # one strategy, in this process
    parser.add_argument("--budget-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.strategy:
        print(json.dumps(run_strategy(args.strategy, args.dtype, args.batch, args.calls, args.model, args.budget_bytes)))
        return 0

    # The largest size alone runs first: 1.05x its pool and entry is the budget of the shapecache
    # strategies, which meet the sizes smallest first, so that the pool must be rebuilt largest
    # first to stay under it.
    strategies = args.strategies.split(",")
    if "largest_alone" in strategies:
        strategies = ["largest_alone"] + [s for s in strategies if s != "largest_alone"]
    results = {}
    budget = None
    for strategy in strategies:
        extra = ["--budget-bytes", str(budget)] if budget is not None else []
        proc = subprocess.run([sys.executable, __file__, "--strategy", strategy, "--dtype", args.dtype,
                               "--batch", str(args.batch), "--calls", str(args.calls), "--model", args.model, *extra],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            results[strategy] = {"strategy": strategy, "error": why_it_failed(proc)}
            continue
        results[strategy] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{strategy}: done", flush=True)
        if args.json:  # after each strategy: a run stopped part-way keeps what it measured
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        if strategy == "largest_alone" and "pool_bytes" in results[strategy]:
            alone = results[strategy]
            budget = int(1.05 * (alone["pool_bytes"] + alone.get("entry_bytes", 0)))

    reference = results.get("shapecache", {})
    gib = 2**30
    device = next((r["device"] for r in results.values() if "device" in r), "?")
    print(f"{device}; {args.model} UNet, {args.dtype}, batch {args.batch}; sizes {', '.join(f'{h}x{w}' for h, w in SIZES)}")
    header = (f"{'strategy':<20} {'peak GiB':>9} {'vs sc':>6} {'held GiB':>9} {'ms/call':>8} {'vs sc':>6} {'build s':>8}"
              "  per size ms")
    print(header)
    print("-" * len(header))
    for strategy, r in results.items():
        if "error" in r:
            print(f"{strategy:<20} failed: {r['error']}")
            continue
        per_call = statistics.mean(s["median_ms"] for s in r["sizes"])
        build = sum(s["first_s"] for s in r["sizes"])
        ref_calls = statistics.mean(s["median_ms"] for s in reference["sizes"]) if "sizes" in reference else None
        peak_ratio = r["peak_reserved"] / reference["peak_reserved"] if "peak_reserved" in reference else float("nan")
        call_ratio = per_call / ref_calls if ref_calls else float("nan")
        sizes = " ".join(f"{s['median_ms']:.1f}" for s in r["sizes"])
        print(f"{strategy:<20} {r['peak_reserved'] / gib:>9.2f} {peak_ratio:>6.2f} {r['held_reserved'] / gib:>9.2f} "
              f"{per_call:>8.2f} {call_ratio:>6.2f} {build:>8.1f}  {sizes}")
    if "shapecache" in results and "largest_alone" in results and "peak_reserved" in reference:
        floor = results["largest_alone"].get("peak_reserved")
        if floor:
            print(f"shapecache peak / largest size alone: {reference['peak_reserved'] / floor:.3f} (goal <= 1.15)")
    if "pool_rebuilds" in reference:
        print(f"shapecache: {reference['pool_rebuilds']} pool rebuild(s), {reference['evictions']} eviction(s) under a "
              f"budget of {(reference.get('budget') or 0) / gib:.2f} GiB")
    if "naive_graphs" in results and "sizes" in results["naive_graphs"] and "sizes" in reference:
        naive = statistics.mean(s["median_ms"] for s in results["naive_graphs"]["sizes"])
        ours = statistics.mean(s["median_ms"] for s in reference["sizes"])
        print(f"shapecache per call / naive graphs: {ours / naive:.3f} (goal <= 1.03)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    # A table with a strategy that could not run measured less than it was asked to.
    failed = [strategy for strategy, r in results.items() if "error" in r]
    if failed:
        print(f"failed: {', '.join(failed)} ({len(failed)} of {len(results)} strategies asked for did not run)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
