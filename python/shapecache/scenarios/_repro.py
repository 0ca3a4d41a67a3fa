"""``python -m shapecache repro``: the out-of-memory scenario, strategy by strategy, in one table
and one picture. ``python -m shapecache demo`` is the same command, which also exits with 1 when
the run did not show that the per-size graphs outgrow the limit while shapecache completes.
Their defaults are the same: on the CPU, a residual conv net with 54 MiB of weights compiled
with inductor's freezing under a budget of 160 MiB; on CUDA, an SDXL-architecture UNet (random
weights, fp16) at five sizes from 1024x1024 to 1536x1536 under a budget of 24 GiB, or 60% of
the device's memory where that is less.

Each strategy runs the size loop (shapecache.scenarios) in a process of its own, so that one
strategy's memory does not count against the next, under the same memory cap
(shapecache.testing.memory_cap):
- CUDA: the process is capped at ``--budget``, and shapecache is also given it as its budget.
- CPU: once the first size is built (the compiler loaded, what every strategy pays once), the
  process's data segment is capped at its size then plus the budget plus LIMIT_SLACK, so
  that a strategy that outgrows the budget meets a real allocation failure. Where no cap can
  be set, the verdict compares the memory's growth with the same figure: "over the budget
  at HxW".

Each size's call time is the best of CALL_REPEATS calls after its first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from shapecache.budget import device_memory_bytes, format_bytes, parse_budget
from shapecache.scenarios import _arguments
from shapecache.scenarios._child_process import why_it_failed
from shapecache.scenarios._models import MODELS, build_model, model_inputs
from shapecache.scenarios._size_loop import parse_sizes, size_loop
from shapecache.testing.memory_cap import CapUnavailable, cap_cuda_memory, cap_data_segment

# On the CPU, what a strategy may grow beyond the budget after its first size: the compiler's
# transient memory while it builds (the cache makes room for a new entry before building it,
# estimated by the last entry, so a build never runs beside a full budget), an entry larger
# than that estimate, and the allocator's fragmentation. The demo's table prints each
# strategy's growth since its first size, the figure this bounds.
LIMIT_SLACK = 128 << 20
CALL_REPEATS = 3

DEFAULT_MODEL = {"cpu": "res-convnet", "cuda": "sdxl"}
# The budget and freezing a model gets on a kind of device when the command line names none,
# chosen so that the per-size strategies outgrow the budget within a few sizes while
# shapecache stays under it: on the CPU each per-size graph of a frozen model keeps its own
# copy of the weights; on CUDA each per-size graph keeps a pool of its own as large as its
# size needs.
MODEL_DEFAULTS = {("res-convnet", "cpu"): {"budget": "160MiB", "freezing": True},
                  ("res-convnet", "cuda"): {"budget": "160MiB", "freezing": True},
                  ("sdxl", "cuda"): {"budget": "24GiB"}}
# The strategies run by default. On CUDA torch_compile (reduce-overhead) compiles the full
# UNet cold, minutes per run: it runs when asked for.
DEFAULT_STRATEGIES = {"cpu": ["naive", "torch_compile", "shapecache"], "cuda": ["naive", "shapecache"]}
# A default budget on CUDA is at most this share of the device's memory: the cap must leave
# room for the CUDA context and for other processes' memory.
DEVICE_SHARE = 0.6

DEFAULT_SIZES = {"tiny-sd": "32x32,32x48,48x32,48x64,64x64",
                 "res-convnet": "64x64,64x96,96x96,96x128,128x128,128x160,160x160,160x192,192x192",
                 "sd15": "1024x1024,1024x1152,1360x1536,1536x1360,1536x1536",
                 "sdxl": "1024x1024,1024x1152,1360x1536,1536x1360,1536x1536"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODELS, default=None,
                        help="(default: res-convnet on the CPU, sdxl on CUDA)")
    parser.add_argument("--sizes", type=_arguments.sizes, default=None,
                        help="HEIGHTxWIDTH,... in pixels (default: per model)")
    parser.add_argument("--order", choices=("given", "largest_first"), default="given")
    parser.add_argument("--budget", type=_arguments.budget, default=None,
                        help="cache budget and memory limit, e.g. 20GiB (default: 160MiB for res-convnet, "
                             "24GiB or 60%% of the device's memory for sdxl, else none)")
    parser.add_argument("--freezing", action=argparse.BooleanOptionalAction, default=None,
                        help="compile with inductor's freezing (default: on for res-convnet)")
    parser.add_argument("--strategies", type=_arguments.strategies, default=None,
                        help="comma-separated, of: naive, torch_compile, shapecache (default: all on the CPU, "
                             "naive,shapecache on CUDA)")
    parser.add_argument("--device", type=_arguments.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=_arguments.positive_int, default=1)
    parser.add_argument("--plot", default=None, help="write the memory plot to this PNG")
    parser.add_argument("--json", default=None, help="write every record to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one strategy, in this process


def apply_defaults(args) -> None:
    """Fills what the command line left unset: the model and strategies by `--device`, the rest
    by the model and the device."""
    device = torch.device(args.device)
    kind = "cpu" if device.type == "cpu" else "cuda"
    if args.model is None:
        args.model = DEFAULT_MODEL[kind]
    if args.strategies is None:
        args.strategies = DEFAULT_STRATEGIES[kind]
    budget_given = args.budget is not None
    for name, value in {"budget": None, "freezing": False, **MODEL_DEFAULTS.get((args.model, kind), {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not budget_given and args.budget and device.type == "cuda":
        if budget_bytes(args) > device_memory_bytes(device) * DEVICE_SHARE:
            args.budget = f"{DEVICE_SHARE:.0%}"


def run_child(args) -> dict:
    """One strategy in this process; prints its records as JSON."""
    device = torch.device(args.device)
    if device.type == "cuda" and args.budget:
        cap_cuda_memory(budget_bytes(args), device)  # for the rest of this process
    model = build_model(args.model, device)
    sizes = args.sizes or parse_sizes(DEFAULT_SIZES[args.model])
    limit = {}

    def limit_memory(first):
        if device.type == "cpu" and args.budget:
            limit.update(limit_data_segment(budget_bytes(args) + LIMIT_SLACK))
            limit["from"] = first.reserved

    records = size_loop(model, sizes, order=args.order, strategy=args.child, budget=args.budget, batch=args.batch,
                        inputs=model_inputs(args.model, model, args.batch), freezing=args.freezing,
                        repeats=CALL_REPEATS, after_first=limit_memory)
    return {"strategy": args.child, "records": [r.as_dict() for r in records], "limit": limit}


def limit_data_segment(extra: int) -> dict:
    """Caps this process's data segment at its present size plus `extra` bytes, for the rest of
    its life (shapecache.testing.memory_cap); returns what was set, or why nothing was."""
    try:
        cap = cap_data_segment(extra)
    except CapUnavailable as error:
        return {"set": False, "why": str(error)}
    return {"set": True, "kind": "RLIMIT_DATA", "bytes": cap.limit, "above_first_size": extra}


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
                  ["--freezing" if args.freezing else "--no-freezing"]
        print(f"running {strategy}...", flush=True)
        proc = subprocess.run(command, capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            failed = why_it_failed(proc) if proc.returncode else "it printed no result"
            results[strategy] = {"strategy": strategy, "failed": failed}
        else:
            results[strategy] = json.loads(lines[-1])

    print(f"\nshapecache {getattr(args, 'command', 'repro')}: {args.model} on {args.device}, {len(sizes)} sizes "
          f"({args.order}), budget {args.budget or 'none'}{', freezing' if args.freezing else ''}")
    if args.device == "cpu" and budget:
        limits = {r.get("limit", {}).get("set") for r in results.values() if "records" in r}
        print("memory limit: " + (f"RLIMIT_DATA at the size after the first size + the budget + "
                                  f"{format_bytes(LIMIT_SLACK)} of slack" if limits == {True} else
                                  "none could be set; verdicts compare memory growth with the budget"))
    print(f"build s: a size's first call; call ms: the fastest of the {CALL_REPEATS} calls after it")
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
