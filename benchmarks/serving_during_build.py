"""What serving costs while the compile backend builds in the background, on the CPU.

    python benchmarks/serving_during_build.py [--model unet] [--size 256x256] [--threads 1]
                                              [--switch-interval SECONDS]

A cached model misses at `--size` (build="background", freezing on), then the plain model is
called back to back at the same size until the build ends. Prints the plain call's time alone,
the build's time, and the calls made during the build: their median, the slowest, and those
over 3x the call alone with when they started. `--switch-interval` sets the interpreter's
switch interval for the whole run (by default the worker's own, BUILD_SWITCH_INTERVAL, applies
during the build). Exits 1 when no call ran during the build (nothing was measured).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

import shapecache as sc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("res-convnet", "unet"), default="unet")
    parser.add_argument("--size", default="256x256")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the serving thread")
    parser.add_argument("--switch-interval", type=float, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())  # a cold build
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_sizes import build as build_model

    torch.set_num_threads(args.threads)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    height, width = (int(v) for v in args.size.split("x"))
    model, inputs = build_model(args.model)
    call_args = inputs(height, width)
    plain = type(model).forward
    with torch.no_grad():
        for _ in range(2):
            plain(model, *call_args)
        begin = time.perf_counter()
        plain(model, *call_args)
        alone = time.perf_counter() - begin
    cached = sc.cached(model, backend="compile", compile_options={"options": {"freezing": True}}, budget="4GiB",
                       build="background")
    start = time.perf_counter()
    during = []
    with torch.no_grad():
        cached(*call_args)  # the miss: runs uncached and queues the build
        while cached.forward.pending_builds:
            begin = time.perf_counter()
            plain(model, *call_args)
            during.append((begin - start, time.perf_counter() - begin))
    build = time.perf_counter() - start
    print(f"{args.model} at {args.size}, torch {torch.__version__}, {args.threads} torch thread(s), switch interval "
          f"{'the worker default' if args.switch_interval is None else f'{args.switch_interval * 1e3:g} ms'}")
    print(f"plain call alone {alone * 1e3:.0f} ms; background build {build:.1f} s")
    if not during:
        print("no call ran during the build: nothing measured", file=sys.stderr)
        return 1
    times = [d for _, d in during]
    slow = [(round(t, 1), round(d * 1e3)) for t, d in during if d > 3 * alone]
    print(f"calls during the build: {len(times)}, median {statistics.median(times) * 1e3:.0f} ms, slowest "
          f"{max(times) * 1e3:.0f} ms, over 3x alone: {len(slow)}")
    print("over 3x alone (start s, ms):", slow)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
