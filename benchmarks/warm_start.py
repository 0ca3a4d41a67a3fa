"""Build time of a second process: inductor's on-disk caches, cold against warm.

    python benchmarks/warm_start.py [--sizes 64x64,64x96,96x96,96x128] [--variants plain,freezing,...]

For shapecache's compile backend without freezing, with freezing, with freezing but no
weight prepacking (``cpp.weight_prepack: False``), and with freezing and a shared directory
(SHAPECACHE_SHARED_DIR, where each size's graph is published as a package): one process
builds every size with an empty cache directory (TORCHINDUCTOR_CACHE_DIR, a fresh temporary
one, which holds the shared directory too), a second process builds the same sizes with what
the first left there. The first process of the shared variant waits for its packages to be
published before it ends. Prints per variant the build seconds of
each size in both processes, what inductor's FX graph cache did (cold, warm, not cached), the
speed-up, the cache directory's size, and the fastest of 20 cached calls at the largest size
(one torch thread), the speed the variant buys.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shapecache.scenarios import why_it_failed

VARIANTS = {
    "plain": {},
    "freezing": {"options": {"freezing": True}},
    "no-prepack": {"options": {"freezing": True, "cpp.weight_prepack": False}},
    "packages": {"options": {"freezing": True}},  # with a shared directory: each size's package is shared
}
SHARED = {"packages"}  # the variants run with SHAPECACHE_SHARED_DIR set


def build_sizes(variant: str, sizes: list) -> dict:
    import torch

    import shapecache as sc
    from shapecache._backends import disk_cache_counts, disk_cache_state
    from shapecache.scenarios import build_model

    model = build_model("res-convnet", torch.device("cpu"))
    torch.set_num_threads(1)
    sc.cached(model, backend="compile", compile_options=VARIANTS[variant])
    rows = []
    with torch.no_grad():
        for height, width in sizes:
            x = torch.randn(1, 4, height // 8, width // 8)
            before, start = disk_cache_counts(), time.perf_counter()
            model(x)
            rows.append({"seconds": time.perf_counter() - start, "cache": disk_cache_state(before)})
        largest = torch.randn(1, 4, max(h for h, _ in sizes) // 8, max(w for _, w in sizes) // 8)
        model(largest)
        hit = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            model(largest)
            hit = min(hit, time.perf_counter() - start)
    start = time.perf_counter()
    if not sc.wait(model, timeout=1800):  # its publications: the next process is to find every size's package
        raise SystemExit("the packages were not published within 30 minutes")
    return {"rows": rows, "hit": hit, "published": time.perf_counter() - start}


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64x64,64x96,96x96,96x128")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of " + ", ".join(VARIANTS))
    parser.add_argument("--child", choices=tuple(VARIANTS), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        parser.error(f"--variants={args.variants!r}: expected some of {', '.join(VARIANTS)}")
    sizes = [tuple(int(v) for v in item.split("x")) for item in args.sizes.split(",")]
    if args.child:
        print(json.dumps(build_sizes(args.child, sizes)))
        return
    print(f"res-convnet (54 MiB of weights), shapecache compile backend, {os.cpu_count()} cores; "
          f"sizes {args.sizes}; build seconds per size, inductor's cache state in brackets\n")
    for variant in variants:
        with tempfile.TemporaryDirectory(prefix="inductor-") as directory:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": directory}
            env.pop("SHAPECACHE_SHARED_DIR", None)
            if variant in SHARED:
                env["SHAPECACHE_SHARED_DIR"] = os.path.join(directory, "shared")
            runs = []
            for process in ("cold", "warm"):
                done = subprocess.run([sys.executable, __file__, "--child", variant, "--sizes", args.sizes],
                                      capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    raise SystemExit(f"{variant} ({process}): {why_it_failed(done)}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs.append(result["rows"])
                if process == "cold" and variant in SHARED:
                    published = result["published"]
            size = directory_bytes(Path(directory))
        totals = [sum(r["seconds"] for r in rows) for rows in runs]
        for process, rows, total in zip(("cold", "warm"), runs, totals, strict=True):
            cells = "  ".join(f"{r['seconds']:5.1f} [{r['cache']}]" for r in rows)
            print(f"{variant:<10} {process} process: {cells}   total {total:5.1f} s")
        if variant in SHARED:
            print(f"{variant:<10} the cold process published its packages {published:.1f} s after its last call")
        print(f"{variant:<10} warm is {totals[0] / totals[1]:.1f}x faster; the cache directory holds "
              f"{size / 2**20:.0f} MiB; a cached call at the largest size takes {result['hit'] * 1e3:.1f} ms\n")


if __name__ == "__main__":
    main()
