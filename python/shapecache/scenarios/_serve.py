"""``python -m shapecache serve``: a model served at several sizes under a budget.

``--model convnet`` (default): a seeded stream of requests at mixed sizes goes through
``sc.cached`` (on the CPU with the compile backend, elsewhere ``auto``: eager would show
hits no faster than plain calls); the table shows, per
size, how often it was asked for, how many times its entry was built (more than once: it was
evicted in between), the slowest build, the fastest cached call next to the fastest of
PLAIN_REPEATS plain calls, and what the cache held at the end.

``--model tiny-sd``: a tiny Stable Diffusion pipeline (random weights, built offline) is
run at every size plainly, then wrapped with ``sc.wrap`` (pre-warmed largest first) and run
again; the table shows per size the pre-warm time and bytes, plain and wrapped call times,
builds during the wrapped calls (0: pre-warming built what the pipeline uses) and whether
the outputs are equal.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import shapecache as sc
from shapecache import _timing
from shapecache.budget import format_bytes
from shapecache.scenarios import _arguments
from shapecache.testing.models import ConvNet

DEFAULT_SIZES = "64x64,64x96,96x64,96x96,128x128"
PLAIN_REPEATS = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=_arguments.sizes, default=DEFAULT_SIZES,
                        help="HEIGHTxWIDTH,... (default %(default)s)")
    parser.add_argument("--requests", type=_arguments.positive_int, default=40,
                        help="requests in the stream (default %(default)s)")
    parser.add_argument("--backend", choices=("auto", "eager", "compile"), default=None,
                        help="(default: compile for convnet on the CPU, else auto)")
    parser.add_argument("--budget", type=_arguments.budget, default=None,
                        help="bytes per device, e.g. 2GiB (default: half the device)")
    parser.add_argument("--model", choices=("convnet", "tiny-sd"), default="convnet", help="(default %(default)s)")
    parser.add_argument("--max-entries", type=_arguments.positive_int, default=None,
                        help="entries kept per device (default: 3 for convnet, no limit for tiny-sd)")
    parser.add_argument("--steps", type=_arguments.positive_int, default=2,
                        help="denoising steps per tiny-sd call (default %(default)s)")
    parser.add_argument("--device", type=_arguments.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict:
    if args.backend is None:
        cpu = torch.device(args.device).type == "cpu"
        args.backend = "compile" if cpu and args.model == "convnet" else "auto"
    if args.model == "tiny-sd":
        return run_pipeline(args)
    if args.max_entries is None:
        args.max_entries = 3
    sizes = args.sizes
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    net = ConvNet().to(device).eval()
    inputs = {s: torch.randn(1, 3, *s, device=device) for s in sizes}

    # Requests skewed towards the first sizes, as a service sees them.
    rng = random.Random(args.seed)
    stream = rng.choices(sizes, weights=list(range(len(sizes), 0, -1)), k=args.requests)

    plain_ms = {}
    with torch.no_grad():
        for s in sizes:
            net(inputs[s])  # first call pays one-time costs
            plain_ms[s] = _best_ms(lambda s=s: net(inputs[s]), device, PLAIN_REPEATS)

    sc.cached(net, budget=args.budget, backend=args.backend, max_entries=args.max_entries)
    per_size = {s: {"requests": 0, "builds": 0, "build_ms": [], "hit_ms": []} for s in sizes}
    with torch.no_grad():
        for s in stream:
            row = per_size[s]
            builds_before = sc.stats(net)["builds"]
            start = time.perf_counter()
            net(inputs[s])
            _timing.synchronize(device)
            elapsed = (time.perf_counter() - start) * 1e3
            row["requests"] += 1
            if sc.stats(net)["builds"] > builds_before:
                row["builds"] += 1
                row["build_ms"].append(elapsed)
            else:
                row["hit_ms"].append(elapsed)

    st = sc.stats(net)
    held = [e["bucket"] for e in st["entries"]]
    print(f"shapecache serve: {len(stream)} requests over {len(sizes)} sizes on {device}, "
          f"backend={args.backend}, budget={st['budget'] and format_bytes(st['budget'])}, "
          f"max_entries={args.max_entries}")
    print(f"build ms: the slowest build; hit ms: the fastest cached call; plain ms: the fastest of "
          f"{PLAIN_REPEATS} calls of the model itself")
    header = f"{'size':>9} {'requests':>8} {'builds':>6} {'hits':>5} {'build ms':>9} {'hit ms':>8} {'plain ms':>9} {'held':>5}"
    print(header)
    print("-" * len(header))
    for s in sizes:
        row = per_size[s]
        print(
            f"{s[0]:>4}x{s[1]:<4} {row['requests']:>8} {row['builds']:>6} {len(row['hit_ms']):>5} "
            f"{_fmt(row['build_ms'], max):>9} {_fmt(row['hit_ms'], min):>8} "
            f"{plain_ms[s]:>9.3f} {'yes' if any(_shape(s) in b for b in held) else 'no':>5}"
        )
    print(
        f"cache: {len(st['entries'])} entries, {format_bytes(st['bytes'])} held (peak {format_bytes(st['peak_bytes'])}), "
        f"hits {st['hits']}, misses {st['misses']}, evictions {st['evictions']}, fallbacks {st['fallbacks']}"
    )
    return {"sizes": per_size, "stats": st, "held": [s for s in sizes if any(_shape(s) in b for b in held)]}


def run_pipeline(args: argparse.Namespace) -> dict:
    from shapecache.testing import tiny_pipelines

    sizes = args.sizes
    device = torch.device(args.device)
    pipe = tiny_pipelines.stable_diffusion().to(device)

    def call(size):
        return pipe("a photo of a cat", height=size[0], width=size[1], num_inference_steps=args.steps,
                    generator=torch.Generator().manual_seed(args.seed), output_type="pt").images

    plain = {s: call(s) for s in sizes}  # first calls pay one-time costs; outputs for comparison
    plain_ms = {s: _best_ms(lambda s=s: call(s), device, 3) for s in sizes}
    sc.wrap(pipe, sizes=sizes, budget=args.budget, backend=args.backend, max_entries=args.max_entries,
            progress=False)
    warmed = {tuple(r["size"]): r for r in sc.stats(pipe)["prewarmed"]}
    rows = {}
    for s in sizes:
        builds_before = sc.stats(pipe)["builds"]
        equal = torch.equal(call(s), plain[s])
        rows[s] = {"builds": sc.stats(pipe)["builds"] - builds_before, "equal": equal,
                   "wrapped_ms": _best_ms(lambda s=s: call(s), device, 3)}

    st = sc.stats(pipe)
    print(f"shapecache serve: tiny Stable Diffusion pipeline, {args.steps} steps, {len(sizes)} sizes on {device}, "
          f"backend={args.backend}, budget={st['budget'] and format_bytes(st['budget'])}")
    print("plain ms, wrapped ms: the fastest of 3 calls")
    print(f"pre-warm order: {', '.join(f'{h}x{w}' for h, w in warmed)}")
    header = (f"{'size':>9} {'warm s':>7} {'warm bytes':>10} {'plain ms':>9} {'wrapped ms':>10} "
              f"{'built in call':>13} {'equal':>5}")
    print(header)
    print("-" * len(header))
    for s in sizes:
        row, record = rows[s], warmed[s]
        print(f"{s[0]:>4}x{s[1]:<4} {record['seconds']:>7.3f} {format_bytes(record['bytes']):>10} "
              f"{plain_ms[s]:>9.2f} {row['wrapped_ms']:>10.2f} {row['builds']:>13} {'yes' if row['equal'] else 'NO':>5}")
    print(f"cache: {len(st['entries'])} entries, {format_bytes(st['bytes'])} held, hits {st['hits']}, "
          f"misses {st['misses']}, evictions {st['evictions']}, fallbacks {st['fallbacks']}")
    return {"sizes": rows, "stats": st}


def _shape(size) -> str:
    """How a request's input shape reads in an entry's bucket."""
    return f"(1, 3, {size[0]}, {size[1]})"


def _best_ms(call, device, repeats: int) -> float:
    return min(_timing.timings(call, device, repeats)) * 1e3


def _fmt(values, reduce) -> str:
    return f"{reduce(values):.3f}" if values else "-"
