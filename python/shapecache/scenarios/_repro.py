"""``python -m shapecache repro``: the out-of-memory scenario, strategy by strategy, in one table
and one picture. ``python -m shapecache demo`` is the same command with its defaults: on the
CPU, a residual conv net with 54 MiB of weights compiled with inductor's freezing under a
budget of 160 MiB; on CUDA, the tiny pipeline.

Each strategy runs the size loop (shapecache.scenarios) in a process of its own, so that one
strategy's memory does not count against the next, under the same memory limit:
- CUDA: the process is capped at ``--budget`` (torch.cuda.set_per_process_memory_fraction),
  and shapecache is also given it as its budget.
- CPU: once the first size is built (the compiler loaded, what every strategy pays once), the
  process's data segment is capped at its size then plus the budget plus LIMIT_SLACK, with
  RLIMIT_DATA. Of the limits Linux offers, that is the one torch's allocator meets cleanly:
  it counts the heap and private mappings (where tensors and Python objects live) and not the
  libraries' code, so an allocation past it fails with torch's "DefaultCPUAllocator: can't
  allocate memory" (RLIMIT_AS counts every mapping and cut 76 MiB short of its figure in a
  test; RLIMIT_RSS is ignored by Linux). Where no limit can be set, the verdict compares the
  memory's growth with the same figure: "over the budget at HxW".
  The data segment counts address space that is reserved and never written, which the cache's
  budget does not (it counts resident memory, host_memory.py). They agree for the demo's model,
  whose layers are convolutions; a frozen model with Linear layers reserves several times more
  than it writes (MKL's packed weights) and meets this limit sooner than its budget says.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

from shapecache.budget import format_bytes, parse_budget
from shapecache.scenarios import _arguments
from shapecache.scenarios._models import MODELS, build_model, model_inputs
from shapecache.scenarios._size_loop import parse_sizes, size_loop

# On the CPU, what a strategy may grow beyond the budget after its first size: the compiler's
# transient memory while it builds (the cache makes room for a new entry before building it,
# estimated by the last entry, so a build never runs beside a full budget), an entry larger
# than that estimate, and the allocator's fragmentation. With the demo's defaults shapecache's
# data segment peaked 119 MiB above its first size, 169 MiB under this limit (sampled every
# 50 ms over 9 sizes); the per-size graphs reach the limit at the 4th or 5th size.
LIMIT_SLACK = 128 << 20

DEMO_DEFAULTS = {"cpu": {"model": "res-convnet", "budget": "160MiB", "freezing": True},
                 "cuda": {"model": "tiny-sd", "budget": None, "freezing": False}}

DEFAULT_SIZES = {"tiny-sd": "32x32,32x48,48x32,48x64,64x64",
                 "res-convnet": "64x64,64x96,96x96,96x128,128x128,128x160,160x160,160x192,192x192",
                 "sd15": "1024x1024,1024x1152,1360x1536,1536x1360,1536x1536",
                 "sdxl": "1024x1024,1024x1152,1360x1536,1536x1360,1536x1536"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODELS, default=None,
                        help="(default: res-convnet for the demo on the CPU, else tiny-sd)")
    parser.add_argument("--sizes", type=_arguments.sizes, default=None,
                        help="HEIGHTxWIDTH,... in pixels (default: per model)")
    parser.add_argument("--order", choices=("given", "largest_first"), default="given")
    parser.add_argument("--budget", type=_arguments.budget, default=None,
                        help="cache budget and memory limit, e.g. 20GiB (default: 160MiB for the demo on the CPU, "
                             "else none)")
    parser.add_argument("--freezing", action="store_true", default=None,
                        help="compile with inductor's freezing (default: on for the demo on the CPU)")
    parser.add_argument("--strategies", type=_arguments.strategies, default=["naive", "torch_compile", "shapecache"],
                        help="comma-separated, of: naive, torch_compile, shapecache (default: all)")
    parser.add_argument("--device", type=_arguments.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=_arguments.positive_int, default=1)
    parser.add_argument("--plot", default=None, help="write the memory plot to this PNG")
    parser.add_argument("--json", default=None, help="write every record to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one strategy, in this process


def apply_defaults(args) -> None:
    """Fills what the command line left unset: the demo's defaults per device, tiny-sd else."""
    defaults = DEMO_DEFAULTS["cpu" if args.device == "cpu" else "cuda"] if args.command == "demo" else \
        {"model": "tiny-sd", "budget": None, "freezing": False}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def run_child(args) -> dict:
    """One strategy in this process; prints its records as JSON."""
    device = torch.device(args.device)
    if device.type == "cuda" and args.budget:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes(args) / total), device)
    model = build_model(args.model, device)
    sizes = args.sizes or parse_sizes(DEFAULT_SIZES[args.model])
    limit = {}

    def limit_memory(first):
        if device.type == "cpu" and args.budget:
            limit.update(limit_data_segment(budget_bytes(args) + LIMIT_SLACK))
            limit["from"] = first.reserved

    records = size_loop(model, sizes, order=args.order, strategy=args.child, budget=args.budget, batch=args.batch,
                        inputs=model_inputs(args.model, model, args.batch), freezing=args.freezing,
                        repeats=3 if device.type == "cpu" else 1, after_first=limit_memory)
    return {"strategy": args.child, "records": [r.as_dict() for r in records], "limit": limit}


def limit_data_segment(extra: int) -> dict:
    """Caps this process's data segment (RLIMIT_DATA) at its present size plus `extra` bytes;
    returns what was set, or why nothing was (see the module's docstring)."""
    try:
        with open("/proc/self/status") as f:
            data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        cap = data + extra if hard == resource.RLIM_INFINITY else min(hard, data + extra)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    except (OSError, ValueError, StopIteration, AttributeError) as error:
        return {"set": False, "why": f"{type(error).__name__}: {error}"}
    return {"set": True, "kind": "RLIMIT_DATA", "bytes": cap, "above_first_size": extra}


def budget_bytes(args) -> int:
    """`--budget` in bytes on `--device`."""
    return parse_budget(args.budget, argument="--budget").bytes_for(torch.device(args.device))


def verdict(result: dict, planned: int, budget: int | None = None) -> str:
    """"completed", "out of memory at HxW", "over the budget at HxW" (on the CPU, where no
    limit could be set: memory grew past `budget` + LIMIT_SLACK since the first size),
    "stopped after N sizes" or "failed: why"."""
    if "failed" in result:
        return f"failed: {result['failed']}"
    records = result["records"]
    bad = next((r for r in records if r["error"]), None)
    if bad:
        return f"out of memory at {bad['size'][0]}x{bad['size'][1]}"
    if budget and records and not result.get("limit", {}).get("set", True):
        first = records[0]["reserved"]
        over = next((r for r in records if r["reserved"] - first > budget + LIMIT_SLACK), None)
        if over:
            return f"over the budget at {over['size'][0]}x{over['size'][1]}"
    return "completed" if len(records) == planned else f"stopped after {len(records)} sizes"


def shown(results: dict, planned: int, budget: int | None) -> str | None:
    """None when the run showed the demo's result (shapecache completed where the per-size
    graphs ran out of memory or over the budget); else what is missing."""
    ours, naive = results.get("shapecache"), results.get("naive")
    if ours is None or naive is None:
        return "the demo needs both the naive and the shapecache strategies"
    if verdict(ours, planned, budget) != "completed":
        return f"shapecache did not complete ({verdict(ours, planned, budget)})"
    if not verdict(naive, planned, budget).startswith(("out of memory", "over the budget")):
        return f"the per-size graphs did not exceed the memory limit ({verdict(naive, planned, budget)})"
    return None


def run(args) -> dict:
    apply_defaults(args)
    if args.child:
        print(json.dumps(run_child(args)))
        return {}
    sizes = args.sizes or parse_sizes(DEFAULT_SIZES[args.model])
    budget = budget_bytes(args) if args.budget else None
    results = {}
    for strategy in args.strategies:
        command = [sys.executable, "-m", "shapecache", "repro", "--child", strategy, "--model", args.model,
                   "--sizes", ",".join(f"{h}x{w}" for h, w in sizes), "--order", args.order, "--device", args.device,
                   "--batch", str(args.batch)] + (["--budget", args.budget] if args.budget else []) + \
                  (["--freezing"] if args.freezing else [])
        print(f"running {strategy}...", flush=True)
        proc = subprocess.run(command, capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            results[strategy] = {"strategy": strategy, "failed": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            results[strategy] = json.loads(lines[-1])

    print(f"\nshapecache {getattr(args, 'command', 'repro')}: {args.model} on {args.device}, {len(sizes)} sizes "
          f"({args.order}), budget {args.budget or 'none'}{', freezing' if args.freezing else ''}")
    if args.device == "cpu" and budget:
        limits = {r.get("limit", {}).get("set") for r in results.values() if "records" in r}
        print("memory limit: " + (f"RLIMIT_DATA at the size after the first size + the budget + "
                                  f"{format_bytes(LIMIT_SLACK)} of slack" if limits == {True} else
                                  "none could be set; verdicts compare memory growth with the budget"))
    naive_calls = {tuple(r["size"]): r["call_seconds"] for r in results.get("naive", {}).get("records", [])
                   if not r["error"]}
    for strategy, result in results.items():
        print(f"\n{strategy}: {verdict(result, len(sizes), budget)}")
        if "records" not in result:
            continue
        print(table(result["records"], naive_calls if strategy != "naive" else {}, args.device))
    print("\nverdicts: " + "; ".join(f"{s}: {verdict(r, len(sizes), budget)}" for s, r in results.items()))
    if args.plot:
        plot(results, sizes, args, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "budget": args.budget, "sizes": sizes,
                       "results": results}, f, indent=1)
    return results


def table(records: list, naive_calls: dict, device: str) -> str:
    """One strategy's records, a line per size; `vs naive` is the call time over the per-size
    graph's at the same size."""
    memory = "reserved" if device.startswith("cuda") else "resident"
    lines = [f"{'size':>9} {'build s':>8} {'call ms':>8} {'vs naive':>8} {memory:>9} {'growth':>9} {'evictions':>9}"]
    first = records[0]["reserved"] if records else 0
    for r in records:
        size = f"{r['size'][0]}x{r['size'][1]}"
        if r["error"]:
            lines.append(f"{size:>9}  {r['error'][:90]}")
            continue
        naive = naive_calls.get(tuple(r["size"]))
        ratio = f"{r['call_seconds'] / naive:.2f}x" if naive else "-"
        lines.append(f"{size:>9} {r['build_seconds']:>8.2f} {r['call_seconds'] * 1e3:>8.1f} {ratio:>8} "
                     f"{format_bytes(r['reserved']):>9} {format_bytes(r['reserved'] - first):>9} {r['evictions']:>9}")
    return "\n".join(lines)


def plot(results: dict, sizes, args, path: str) -> None:
    """Memory after each size, one line per strategy, with the budget (and on the CPU the limit)
    as horizontal lines and an X where a strategy ran out of memory. On the CPU the figure is
    the growth of resident memory since the first size, the part that the limit caps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = args.device == "cpu"
    unit, unit_name = (2**20, "MiB") if cpu else (2**30, "GiB")
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=120)
    labels = [f"{h}x{w}" for h, w in sizes]
    for strategy, result in results.items():
        records = result.get("records", [])
        done = [r for r in records if not r["error"]]
        base = records[0]["reserved"] if cpu and done else 0
        line, = axes.plot(range(len(done)), [(r["reserved"] - base) / unit for r in done], marker="o", label=strategy)
        failed = next((i for i, r in enumerate(records) if r["error"]), None)
        if failed is not None:
            y = (done[-1]["reserved"] - base) / unit if done else 0
            axes.plot([failed], [y], marker="X", markersize=12, color=line.get_color(), linestyle="none")
            axes.annotate("out of memory", (failed, y), textcoords="offset points", xytext=(6, 6),
                          color=line.get_color())
    if args.budget:
        budget = budget_bytes(args)
        axes.axhline(budget / unit, color="black", linestyle="--", linewidth=1, label=f"budget {args.budget}")
        if cpu:
            axes.axhline((budget + LIMIT_SLACK) / unit, color="red", linestyle=":", linewidth=1,
                         label=f"memory limit (budget + {format_bytes(LIMIT_SLACK)})")
    axes.set_xticks(range(len(labels)), labels, rotation=30)
    axes.set_xlabel(f"size in pixels, in loop order ({args.order})")
    axes.set_ylabel(f"resident memory since the first size ({unit_name})" if cpu else "reserved memory (GiB)")
    axes.set_title(f"{args.model} on {args.device}: memory over the size loop")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
