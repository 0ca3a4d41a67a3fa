"""``python -m shapecache repro``: the out-of-memory scenario, strategy by strategy, in one table
and one picture. ``python -m shapecache demo`` is the same command with its defaults: the tiny
pipeline, on CUDA where there is a device, else on the CPU.

Each strategy runs the size loop (shapecache.scenarios) in a process of its own, so that one
strategy's memory does not count against the next. On CUDA the process is capped at
``--budget`` (torch.cuda.set_per_process_memory_fraction): every strategy meets the same
limit, and shapecache is also given it as its budget. On the CPU no cap applies; the budget
bounds the cache only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from shapecache.budget import format_bytes, parse_budget
from shapecache.scenarios import _arguments
from shapecache.scenarios._models import MODELS, build_model
from shapecache.scenarios._size_loop import parse_sizes, size_loop

DEFAULT_SIZES = {"tiny-sd": "32x32,32x48,48x32,48x64,64x64",
                 "sd15": "1024x1024,1024x1152,1360x1536,1536x1360,1536x1536",
                 "sdxl": "1024x1024,1024x1152,1360x1536,1536x1360,1536x1536"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODELS, default="tiny-sd", help="(default %(default)s)")
    parser.add_argument("--sizes", type=_arguments.sizes, default=None,
                        help="HEIGHTxWIDTH,... in pixels (default: per model)")
    parser.add_argument("--order", choices=("given", "largest_first"), default="given")
    parser.add_argument("--budget", type=_arguments.budget, default=None,
                        help="memory cap and cache budget, e.g. 20GiB (default: none)")
    parser.add_argument("--strategies", type=_arguments.strategies, default=["naive", "torch_compile", "shapecache"],
                        help="comma-separated, of: naive, torch_compile, shapecache (default: all)")
    parser.add_argument("--device", type=_arguments.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=_arguments.positive_int, default=1)
    parser.add_argument("--plot", default=None, help="write the memory plot to this PNG")
    parser.add_argument("--json", default=None, help="write every record to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one strategy, in this process


def run_child(args) -> dict:
    """One strategy in this process; prints its records as JSON."""
    device = torch.device(args.device)
    if device.type == "cuda" and args.budget:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes(args) / total), device)
    model = build_model(args.model, device)
    sizes = args.sizes or parse_sizes(DEFAULT_SIZES[args.model])
    records = size_loop(model, sizes, order=args.order, strategy=args.child, budget=args.budget, batch=args.batch)
    return {"strategy": args.child, "records": [r.as_dict() for r in records]}


def budget_bytes(args) -> int:
    """`--budget` in bytes on `--device`."""
    return parse_budget(args.budget, argument="--budget").bytes_for(torch.device(args.device))


def verdict(result: dict, planned: int) -> str:
    if "failed" in result:
        return f"failed: {result['failed']}"
    records = result["records"]
    bad = next((r for r in records if r["error"]), None)
    if bad:
        return f"OOM at {bad['size'][0]}x{bad['size'][1]}"
    return "completed" if len(records) == planned else f"stopped after {len(records)} sizes"


def run(args) -> dict:
    if args.child:
        print(json.dumps(run_child(args)))
        return {}
    sizes = args.sizes or parse_sizes(DEFAULT_SIZES[args.model])
    strategies = args.strategies
    results = {}
    for strategy in strategies:
        command = [sys.executable, "-m", "shapecache", "repro", "--child", strategy, "--model", args.model,
                   "--sizes", ",".join(f"{h}x{w}" for h, w in sizes), "--order", args.order, "--device", args.device,
                   "--batch", str(args.batch)] + (["--budget", args.budget] if args.budget else [])
        proc = subprocess.run(command, capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            results[strategy] = {"strategy": strategy, "failed": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            results[strategy] = json.loads(lines[-1])

    print(f"shapecache {getattr(args, 'command', 'repro')}: {args.model} on {args.device}, {len(sizes)} sizes ({args.order}), "
          f"budget {args.budget or 'none'}")
    for strategy, result in results.items():
        print(f"\n{strategy}: {verdict(result, len(sizes))}")
        if "records" not in result:
            continue
        header = f"{'size':>11} {'build s':>8} {'call s':>8} {'allocated':>10} {'reserved':>10} {'peak':>10} {'evictions':>9}"
        print(header)
        for r in result["records"]:
            size = f"{r['size'][0]}x{r['size'][1]}"
            if r["error"]:
                print(f"{size:>11}  {r['error'][:70]}")
                continue
            print(f"{size:>11} {r['build_seconds']:>8.3f} {r['call_seconds']:>8.4f} {format_bytes(r['allocated']):>10} "
                  f"{format_bytes(r['reserved']):>10} {format_bytes(r['peak']):>10} {r['evictions']:>9}")
    print("\nverdicts: " + "; ".join(f"{s}: {verdict(r, len(sizes))}" for s, r in results.items()))
    if args.plot:
        plot(results, sizes, args, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "budget": args.budget, "sizes": sizes,
                       "results": results}, f, indent=1)
    return results


def plot(results: dict, sizes, args, path: str) -> None:
    """Reserved memory after each size, one line per strategy; the budget as a horizontal line;
    an X where a strategy ran out of memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2**30
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=120)
    labels = [f"{h}x{w}" for h, w in sizes]
    for strategy, result in results.items():
        records = result.get("records", [])
        done = [r for r in records if not r["error"]]
        line, = axes.plot(range(len(done)), [r["reserved"] / gib for r in done], marker="o", label=strategy)
        failed = next((i for i, r in enumerate(records) if r["error"]), None)
        if failed is not None:
            y = done[-1]["reserved"] / gib if done else 0
            axes.plot([failed], [y], marker="X", markersize=12, color=line.get_color(), linestyle="none")
            axes.annotate("OOM", (failed, y), textcoords="offset points", xytext=(6, 6), color=line.get_color())
    if args.budget:
        budget = budget_bytes(args) / gib
        axes.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"budget {args.budget}")
    axes.set_xticks(range(len(labels)), labels, rotation=30)
    axes.set_xlabel(f"size, in loop order ({args.order})")
    axes.set_ylabel("reserved memory (GiB)" if args.device.startswith("cuda") else "resident memory (GiB)")
    axes.set_title(f"{args.model} on {args.device}: memory over the size loop")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
