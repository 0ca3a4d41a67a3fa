"""shapecache against what people use today, in one run, on the GPU.

    python benchmarks/comparison.py [--models sd15,sdxl] [--json comparison.json]

For SD1.5 and SDXL-architecture UNets (random fp16 weights, batch 2) over six sizes from 1024x1024 to 1536x1536:
peak reserved memory, per-step time and time to the first result at each new size, for
eager, naive per-size graphs, torch.compile reduce-overhead, torch.compile dynamic=True and
shapecache (cuda_graph, compile+cuda_graph), with ratios against shapecache; then shapecache
with tuned convolutions twice, in two processes sharing one records file: the second one
tunes nothing. Each strategy runs in a process of its own (cuda_graph_memory.run_strategy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shapecache.scenarios import why_it_failed

HERE = Path(__file__).resolve().parent
STRATEGIES = ["eager", "naive_graphs", "reduce_overhead", "compile_dynamic", "shapecache", "shapecache_compile"]


def run(strategy, model, args, env=None) -> dict:
    proc = subprocess.run([sys.executable, str(HERE / "cuda_graph_memory.py"), "--strategy", strategy, "--model", model,
                           "--dtype", args.dtype, "--batch", str(args.batch), "--calls", str(args.calls)],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        return {"strategy": strategy, "error": why_it_failed(proc)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(r) -> tuple:
    per_step = statistics.mean(s["median_ms"] for s in r["sizes"])
    first = statistics.mean(s["first_s"] for s in r["sizes"])
    return r["peak_reserved"] / 2**30, per_step, first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="sd15,sdxl")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--strategies", default=",".join(STRATEGIES + ["shapecache_tuned"]),
                        help="comma-separated, of: " + ", ".join(STRATEGIES + ["shapecache_tuned"]) + " (default: all; "
                             "shapecache is the reference of the ratios and always runs)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    chosen = args.strategies.split(",")
    unknown = sorted(set(chosen) - set(STRATEGIES) - {"shapecache_tuned"})
    if unknown:
        parser.error(f"--strategies: unknown {unknown}; expected some of {STRATEGIES + ['shapecache_tuned']}")

    report = {}
    for model in args.models.split(","):
        results = {s: run(s, model, args) for s in STRATEGIES if s in chosen or s == "shapecache"}
        if "shapecache_tuned" in chosen:
            with tempfile.TemporaryDirectory() as tmp:
                env = {"SHAPECACHE_TUNING_DB": f"{tmp}/tuning.json"}
                results["shapecache_tuned (cold)"] = run("shapecache_tuned", model, args, env)
                results["shapecache_tuned (records)"] = run("shapecache_tuned", model, args, env)
        report[model] = results
        reference = results["shapecache"]
        print(f"\n{model}: {next((r['device'] for r in results.values() if 'device' in r), '?')}, {args.dtype}, "
              f"batch {args.batch}")
        header = (f"{'strategy':<28} {'peak GiB':>9} {'vs sc':>6} {'ms/step':>8} {'vs sc':>6} "
                  f"{'first result s':>14} {'vs sc':>6}")
        print(header)
        print("-" * len(header))
        ref = summary(reference) if "sizes" in reference else None
        for name, r in results.items():
            if "error" in r:
                print(f"{name:<28} failed: {r['error'][:80]}")
                continue
            peak, step, first = summary(r)
            ratios = [value / base if ref else float("nan") for value, base in zip((peak, step, first), ref or (1, 1, 1))]
            print(f"{name:<28} {peak:>9.2f} {ratios[0]:>6.2f} {step:>8.2f} {ratios[1]:>6.2f} {first:>14.2f} "
                  f"{ratios[2]:>6.2f}")
            if "tuning" in r:
                print(f"{'':<28} tuning: {r['tuning']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    # A table with a strategy that could not run measured less than it was asked to.
    failed = [f"{model}: {name}" for model, results in report.items() for name, r in results.items() if "error" in r]
    if failed:
        print(f"failed: {', '.join(failed)} (strategies asked for that did not run)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
