"""Speed by strategy and size: what each way of running a UNet gives per call, at what memory.

    python benchmarks/compiled_speed.py [--model sdxl] [--sizes 1024x1024,1152x896] [--out DIR]
                                        [--seconds 300 | --until EPOCH] [--device cuda]

An SDXL-architecture UNet (random fp16 weights, batch 2; latents = pixels/8) at each size, by
each strategy, each in a process of its own (so peaks and compile caches do not mix):

  eager               the module itself
  torch_compile       torch.compile(dynamic=False): inductor's graph of the size
  reduce_overhead     torch.compile(mode="reduce-overhead", dynamic=False): that graph in CUDA graph trees
  cuda_graph          sc.cached(backend="cuda_graph"): the eager kernels captured
  compile_cuda_graph  sc.cached(backend="compile+cuda_graph"): inductor's graph captured
  compile             sc.cached(backend="compile"): the bucket exported whole and compiled by inductor
  auto                sc.cached(backend="auto"), shapecache's default
  auto_upgrade        sc.cached(backend="auto", upgrade=True): auto's entry at once, then inductor's
                      graph of the bucket compiled in the background, kept where it is faster; its
                      row adds the calls served while it compiled (their p99 against eager's median)
                      and the seconds until the upgrade was decided

Per row: the first call's seconds (compiling and capturing included: "cold" is a compile with
an empty inductor cache, "warm" the same strategy again over the cache the cold run filled),
the median milliseconds of `--calls` calls (CUDA events on the CUDA device, the wall clock on
the CPU), the ratio to eager's, the peak and held reserved memory, and the largest absolute
difference from eager's output. Sizes go in order, every strategy at a size before the next
size, then the compiling strategies once more warm; whatever `--seconds` (or `--until`) leaves no time for is
listed as not run. The table is rewritten to `--out` (speed.md, speed.json) after every row, so
a run stopped part-way keeps what it measured.

`--model tiny --device cpu` runs the same code on a tiny UNet on the CPU (the dry run of
``python -m shapecache gpu-check --quick --dry-run``): the graph strategies then report the
error they give there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STRATEGIES = ["eager", "torch_compile", "reduce_overhead", "cuda_graph", "compile_cuda_graph", "compile", "auto",
              "auto_upgrade"]
COMPILING = {"torch_compile", "reduce_overhead", "compile_cuda_graph", "compile", "auto_upgrade"}
BACKENDS = {"cuda_graph": "cuda_graph", "compile_cuda_graph": "compile+cuda_graph", "compile": "compile", "auto": "auto",
            "auto_upgrade": "auto"}
UPGRADE_WAIT_S = 1800  # the most an upgrade is waited for (the run's own deadline stops it sooner)
STOP_SECONDS = 3  # kept aside to stop a child that runs out of time (subprocess.run kills it at once)


def build_unet(model: str, device, dtype):
    import torch

    if model == "tiny":
        from diffusers import UNet2DConditionModel

        torch.manual_seed(0)
        unet = UNet2DConditionModel(
            block_out_channels=(32, 64), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, norm_num_groups=8)
        return unet.to(device=device, dtype=dtype).eval()
    from shapecache.scenarios import build_model

    return build_model(model, device).to(dtype)


def measure(strategy: str, model: str, size: tuple, device_name: str, dtype_name: str, batch: int, calls: int) -> dict:
    """One row, in this process."""
    import torch

    import shapecache as sc
    from shapecache.diffusers import unet_inputs

    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name)
    cuda = device.type == "cuda"
    unet = build_unet(model, device, dtype)
    torch.manual_seed(1)
    inputs = unet_inputs(unet, size[0] // 8, size[1] // 8, batch, dtype=dtype)

    def synchronize():
        if cuda:
            torch.cuda.synchronize(device)

    with torch.no_grad():
        reference = unet(**inputs)[0].float().cpu()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if strategy == "eager":
            call = unet
        elif strategy in ("torch_compile", "reduce_overhead"):
            options = {"mode": "reduce-overhead"} if strategy == "reduce_overhead" else {}
            call = torch.compile(unet, dynamic=False, **options)
        else:
            call = sc.cached(unet, backend=BACKENDS[strategy], upgrade=strategy == "auto_upgrade")

        synchronize()
        start = time.perf_counter()
        output = call(**inputs)[0]
        synchronize()
        first = time.perf_counter() - start

        def timed_call() -> float:
            nonlocal output
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                output = call(**inputs)[0]
                end.record()
                end.synchronize()
                return begin.elapsed_time(end)
            begin_s = time.perf_counter()
            output = call(**inputs)[0]
            return (time.perf_counter() - begin_s) * 1e3

        upgrading = {}
        if strategy == "auto_upgrade":  # served while the bucket compiles, until the upgrade is decided
            during, start = [timed_call()], time.perf_counter()  # the first hit asks for the upgrade
            while sc.stats(unet)["pending_builds"] and time.perf_counter() - start < UPGRADE_WAIT_S:
                during.append(timed_call())
            sc.wait(unet, timeout=UPGRADE_WAIT_S)
            upgrading = {"upgrade_s": time.perf_counter() - start, "calls_while_upgrading": len(during),
                         "p99_while_upgrading_ms": statistics.quantiles(during, n=100)[98] if len(during) > 1
                         else (during or [float("nan")])[0]}
        times = [timed_call() for _ in range(calls)]
        difference = (output.float().cpu() - reference).abs().max().item()
    row = {"strategy": strategy, "size": list(size), "first_s": first, "median_ms": statistics.median(times),
           "max_abs_difference": difference, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "torch": torch.__version__, **upgrading}
    if cuda:
        row.update(peak_bytes=torch.cuda.max_memory_reserved(device), held_bytes=torch.cuda.memory_reserved(device))
    if strategy in BACKENDS:
        stats = sc.stats(unet)
        row.update(entries=[entry["backend"] for entry in stats["entries"]], pool_bytes=stats["pool_bytes"],
                   upgrades=stats["upgrades"], upgrades_not_kept=stats["upgrades_not_kept"])
    return row


def parse_sizes(text: str) -> list[tuple]:
    """The scenarios' size list (HEIGHTxWIDTH,...), each a multiple of 8 (latents are 1/8)."""
    from shapecache.scenarios import parse_sizes as parse

    try:
        sizes = parse(text)
    except ValueError as error:
        raise SystemExit(f"--sizes: {error}") from None
    for height, width in sizes:
        if height % 8 or width % 8:
            raise SystemExit(f"--sizes: {height}x{width} is not a multiple of 8")
    return sizes


def plan(strategies: list[str], sizes: list[tuple]) -> list[tuple]:
    """(strategy, size, compile) in the order they run: every strategy at the first size with
    cold compiles, the compiling ones there again warm, then each further size (cold)."""
    order = [(s, sizes[0], "cold" if s in COMPILING else "") for s in strategies]
    order += [(s, sizes[0], "warm") for s in strategies if s in COMPILING]
    for size in sizes[1:]:
        order += [(s, size, "cold" if s in COMPILING else "") for s in strategies]
    return order


def run_child(args, strategy, size, compiled, cache_dirs, seconds) -> dict:
    env = dict(os.environ)
    if compiled:
        # cold: an empty inductor cache of the strategy's own; warm: the one its cold run filled
        key = (strategy, tuple(size))
        if compiled == "cold" or key not in cache_dirs:
            cache_dirs[key] = tempfile.mkdtemp(prefix=f"inductor-{strategy}-", dir=args.cache_root)
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dirs[key]
    command = [sys.executable, __file__, "--one", strategy, "--sizes", f"{size[0]}x{size[1]}", "--model", args.model,
               "--device", args.device, "--dtype", args.dtype, "--batch", str(args.batch), "--calls", str(args.calls)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=seconds)
    except subprocess.TimeoutExpired:  # the run's own deadline: what it left time for is measured
        return {"error": f"not finished: the run's time ran out after {seconds:.0f} s", "out_of_time": True}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return {"error": (lines[-1] if lines else f"exit status {proc.returncode}")[:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def failure(result: dict, strategy: str, device: str) -> bool:
    """Whether a row's error fails the run: not one cut short by the run's own deadline, nor,
    off CUDA (the dry run), a graph strategy's refusal to run there."""
    if "error" not in result or "out_of_time" in result:
        return False
    return device.startswith("cuda") or strategy not in ("cuda_graph", "compile_cuda_graph")


def table(rows: list[dict]) -> str:
    gib = 2**30
    eager = {tuple(r["size"]): r["median_ms"] for r in rows if r["strategy"] == "eager" and "median_ms" in r}
    lines = ["| size | strategy | compile | first call s | ms/call | vs eager | peak GiB | held GiB | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        size = "x".join(map(str, r["size"]))
        head = f"| {size} | {r['strategy']} | {r.get('compile') or '-'} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | |")
            continue
        ratio = r["median_ms"] / eager[tuple(r["size"])] if tuple(r["size"]) in eager else float("nan")
        peak = f"{r['peak_bytes'] / gib:.2f}" if "peak_bytes" in r else "-"
        held = f"{r['held_bytes'] / gib:.2f}" if "held_bytes" in r else "-"
        lines.append(f"{head} {r['first_s']:.2f} | {r['median_ms']:.2f} | {ratio:.3f} | {peak} | {held} | "
                     f"{r['max_abs_difference']:.3g} |")
    upgraded = [r for r in rows if "upgrade_s" in r]
    if upgraded:
        lines += ["", "auto_upgrade while its bucket compiled (p99 against eager's median at the size):", "",
                  "| size | compile | calls served | p99 ms | p99 vs eager | decided after s | entry after |",
                  "|---|---|---|---|---|---|---|"]
        for r in upgraded:
            size = tuple(r["size"])
            ratio = r["p99_while_upgrading_ms"] / eager[size] if size in eager else float("nan")
            lines.append(f"| {'x'.join(map(str, size))} | {r.get('compile') or '-'} | {r['calls_while_upgrading']} | "
                         f"{r['p99_while_upgrading_ms']:.2f} | {ratio:.3f} | {r['upgrade_s']:.1f} | "
                         f"{', '.join(r.get('entries', [])) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("sdxl", "sd15", "tiny"), default="sdxl")
    parser.add_argument("--sizes", default="1024x1024,1152x896")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: float16 on CUDA, float32 on the CPU")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=600, help="the whole run's limit (default %(default)s)")
    parser.add_argument("--until", type=float, default=None,
                        help="a time (seconds since the epoch) by which the run ends, if sooner than --seconds")
    parser.add_argument("--out", default="compiled-speed")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one strategy, in this process
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("float16" if args.device.startswith("cuda") else "float32")
    sizes = parse_sizes(args.sizes)
    if args.one:
        print(json.dumps(measure(args.one, args.model, sizes[0], args.device, args.dtype, args.batch, args.calls)))
        return 0
    strategies = args.strategies.split(",")
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"--strategies: unknown {unknown}; expected some of {STRATEGIES}")
    if "eager" not in strategies:
        strategies.insert(0, "eager")  # the reference of every ratio

    seconds = args.seconds if args.until is None else min(args.seconds, args.until - time.time())
    deadline = time.monotonic() + seconds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, cache_dirs = [], {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="compiled-speed-") as cache_root:
        args.cache_root = cache_root
        for strategy, size, compiled in plan(strategies, sizes):
            left = deadline - time.monotonic() - STOP_SECONDS
            base = {"strategy": strategy, "size": list(size), "compile": compiled}
            cold_failed = any("error" in r and r["strategy"] == strategy and r["size"] == list(size) for r in rows)
            if compiled == "warm" and cold_failed:
                continue
            if left <= 5:
                rows.append({**base, "error": f"not run: the run's {seconds:.0f} s were spent"})
            else:
                started = time.monotonic()
                result = run_child(args, strategy, size, compiled, cache_dirs, left)
                rows.append({**result, **base, "seconds": round(time.monotonic() - started, 1)})
                failed = failed or failure(result, strategy, args.device)
            (out / "speed.json").write_text(json.dumps(rows, indent=1))
            text = f"# Speed by strategy and size: {args.model} UNet, {args.dtype}, batch {args.batch}\n\n" + table(rows)
            device = next((r["device"] for r in rows if "device" in r), args.device)
            (out / "speed.md").write_text(f"{text}\n\ndevice: {device}\n")
            last = rows[-1]
            said = last["error"] if "error" in last else f"{last['median_ms']:.2f} ms"
            print(f"{strategy} {size[0]}x{size[1]} {compiled}: {said}", flush=True)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
