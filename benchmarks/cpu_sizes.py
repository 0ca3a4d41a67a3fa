"""Compiled speed and memory on the CPU at several input sizes, per way of compiling.

    python benchmarks/cpu_sizes.py [--model res-convnet|unet] [--sizes 64x64,96x96,128x128,160x160]
                                   [--budget 160MiB] [--many 12]

Every variant runs in a process of its own. Variants: eager; torch.compile with dynamic=False,
the default (dynamic after the first recompile) and dynamic=True, each without and with
inductor's freezing (set process-wide, as its users do: Dynamo reads it when it traces);
shapecache's compile backend without and with freezing (as its own compile option) under the
budget. Three tables:

1. per size: the call's milliseconds (best of 10), its ratio to eager and to the per-size
   compiled graph (dynamic=False with freezing), the build seconds (the size's first call) and
   resident memory after the size;
2. `--many` sizes in a row (more than Dynamo's recompile limit of 8): per variant, how many
   sizes ran compiled (a call slower than 0.9x eager at that size counts as not compiled; the
   graphs Dynamo built and shapecache's builds, all of them compiled, are shown beside it);
3. two sizes alternating against one size repeated, per call, once every size is built.

Models: res-convnet (shapecache's demo model: residual GroupNorm/SiLU/conv blocks, 54 MiB) or
unet (a UNet2DConditionModel of 3 levels at 64 to 256 channels with cross-attention, 49 MiB,
built from its config with random weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from shapecache.scenarios import why_it_failed

VARIANTS = ("eager", "static", "static+freezing", "default", "default+freezing", "dynamic", "dynamic+freezing",
            "shapecache", "shapecache+freezing")
MANY_VARIANTS = ("eager", "static+freezing", "default+freezing", "shapecache+freezing")
PER_SIZE = "static+freezing"


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(model_name: str):
    """(model, inputs(size) -> args) with random weights."""
    import torch

    torch.manual_seed(0)
    if model_name == "res-convnet":
        from shapecache.scenarios import build_model

        model = build_model("res-convnet", torch.device("cpu"))
        return model, lambda h, w: (torch.randn(1, 4, h // 8, w // 8),)
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        block_out_channels=(64, 128, 256), layers_per_block=1, cross_attention_dim=256, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), sample_size=32,
    ).eval()
    text = torch.randn(1, 77, 256)
    return model, lambda h, w: (torch.randn(1, 4, h // 8, w // 8), torch.tensor(10), text)


def best_call(forward, args, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def run_variant(variant: str, model_name: str, sizes: list, budget: str) -> dict:
    import torch

    import shapecache as sc

    model, inputs = build(model_name)
    freezing = variant.endswith("+freezing")
    kind = variant.removesuffix("+freezing")
    if kind == "shapecache":
        options = {"options": {"freezing": True}} if freezing else {}
        forward = sc.cached(model, backend="compile", compile_options=options, budget=budget)
    elif kind == "eager":
        forward = model
    else:
        torch._inductor.config.freezing = freezing
        forward = torch.compile(model, dynamic={"static": False, "default": None, "dynamic": True}[kind])
    from torch._dynamo.utils import counters

    rows = []
    with torch.no_grad():
        arguments = {size: inputs(*size) for size in sizes}
        for size in sizes:
            start = time.perf_counter()
            forward(*arguments[size])
            built = time.perf_counter() - start
            rows.append({"size": list(size), "build": built, "call": best_call(forward, arguments[size], 10),
                         "resident": resident_bytes()})
        # Two sizes alternating, against the first repeated; both built above (shapecache keeps
        # the last two under any budget that holds two entries).
        a, b = arguments[sizes[-2]], arguments[sizes[-1]]
        repeated = best_call(forward, b, 20)
        alternating = []
        for _ in range(10):
            for args in (a, b):
                start = time.perf_counter()
                forward(*args)
                alternating.append((time.perf_counter() - start, args is b))
        alternating_b = min(t for t, is_b in alternating if is_b)
    compiled = None
    if kind == "shapecache":  # every build, evicted or not; the entries it keeps say how each was built
        st = sc.stats(forward)
        compiled = st["builds"] if {e["backend"] for e in st["entries"]} == {"compile"} else "not all compiled"
    elif kind != "eager":
        compiled = counters["stats"]["unique_graphs"]
    return {"rows": rows, "repeated": repeated, "alternating": alternating_b, "compiled": compiled}


def run_all(variants, model_name: str, sizes: list, budget: str) -> dict:
    results = {}
    spelled = ",".join(f"{h}x{w}" for h, w in sizes)
    for variant in variants:
        done = subprocess.run([sys.executable, __file__, "--child", variant, "--model", model_name, "--sizes", spelled,
                               "--budget", budget], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{variant}: failed: {why_it_failed(done)}", flush=True)
            continue
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def by_size(result: dict | None) -> dict:
    return {tuple(r["size"]): r["call"] for r in (result or {"rows": []})["rows"]}


def ratio(value: float, base: dict, size: tuple) -> str:
    return f"{value / base[size]:.2f}" if size in base else "-"


def print_sizes(results: dict, header: str) -> None:
    eager, per_size = by_size(results.get("eager")), by_size(results.get(PER_SIZE))
    print(header)
    print(f"{'variant':<20} {'size':>8} {'call ms':>8} {'/eager':>7} {'/per-size':>9} {'build s':>8} {'resident MiB':>12}")
    for variant, result in results.items():
        for r in result["rows"]:
            size = tuple(r["size"])
            print(f"{variant:<20} {size[0]:>4}x{size[1]:<3} {r['call'] * 1e3:>8.1f} {ratio(r['call'], eager, size):>7} "
                  f"{ratio(r['call'], per_size, size):>9} {r['build']:>8.2f} {r['resident'] / 2**20:>12.0f}")
    print("\nthe last two sizes alternating against the last one repeated (best ms of the last size's calls):")
    print(f"{'variant':<20} {'repeated':>9} {'alternating':>12} {'ratio':>6}")
    for variant, result in results.items():
        print(f"{variant:<20} {result['repeated'] * 1e3:>9.1f} {result['alternating'] * 1e3:>12.1f} "
              f"{result['alternating'] / result['repeated']:>6.2f}")


def print_many(results: dict, sizes: list) -> None:
    eager = by_size(results.get("eager"))
    print(f"\n{len(sizes)} sizes in a row ({sizes[0][0]}x{sizes[0][1]} to {sizes[-1][0]}x{sizes[-1][1]}); "
          "a size runs compiled when its call takes under 0.9x eager's")
    print(f"{'variant':<20} {'compiled sizes':>14} {'graphs/builds':>14}  per size: call / eager")
    for variant, result in results.items():
        if variant == "eager":
            continue
        fast = [r["call"] < 0.9 * eager[tuple(r["size"])] for r in result["rows"] if tuple(r["size"]) in eager]
        ratios = " ".join(ratio(r["call"], eager, tuple(r["size"])) for r in result["rows"])
        print(f"{variant:<20} {sum(fast):>8} of {len(fast):<3} {result['compiled']!s:>14}  {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("res-convnet", "unet"), default="res-convnet")
    parser.add_argument("--sizes", default="64x64,96x96,128x128,160x160")
    parser.add_argument("--budget", default="160MiB")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--many", type=int, default=12, help="sizes of the loop past the recompile limit (0: skip)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in item.split("x")) for item in args.sizes.split(",")]
    if args.child:
        print(json.dumps(run_variant(args.child, args.model, sizes, args.budget)))
        return
    import torch

    print(f"{args.model} on the CPU, torch {torch.__version__}, {os.cpu_count()} cores; budget {args.budget} "
          f"for shapecache; each variant in a process of its own\n", flush=True)
    print_sizes(run_all(args.variants.split(","), args.model, sizes, args.budget),
                "1. per size: best of 10 calls, ratio to eager and to the per-size graph (dynamic=False + freezing)")
    if args.many:
        many = [(64, 64 + 8 * i) for i in range(args.many)]
        chosen = [v for v in args.variants.split(",") if v in MANY_VARIANTS]
        print_many(run_all(chosen, args.model, many, args.budget), many)


if __name__ == "__main__":
    main()
