"""Build time of a second process: inductor's on-disk caches, cold against warm.

    python benchmarks/warm_start.py [--sizes 64x64,64x96,96x96,96x128]

For shapecache's compile backend without and with freezing: one process builds every size
with an empty cache directory (TORCHINDUCTOR_CACHE_DIR, a fresh temporary one), a second
process builds the same sizes with what the first left there. Prints per variant the build
seconds of each size in both processes, what inductor's FX graph cache did (cold, warm, not
cached), the speed-up and the cache directory's size.
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


def build_sizes(freezing: bool, sizes: list) -> dict:
    import torch

    import shapecache as sc
    from shapecache._backends import disk_cache_counts, disk_cache_state
    from shapecache.scenarios import build_model

    model = build_model("res-convnet", torch.device("cpu"))
    options = {"options": {"freezing": True}} if freezing else {}
    sc.cached(model, backend="compile", compile_options=options)
    rows = []
    with torch.no_grad():
        for height, width in sizes:
            x = torch.randn(1, 4, height // 8, width // 8)
            before, start = disk_cache_counts(), time.perf_counter()
            model(x)
            rows.append({"seconds": time.perf_counter() - start, "cache": disk_cache_state(before)})
    return {"rows": rows}


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64x64,64x96,96x96,96x128")
    parser.add_argument("--child", choices=("plain", "freezing"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in item.split("x")) for item in args.sizes.split(",")]
    if args.child:
        print(json.dumps(build_sizes(args.child == "freezing", sizes)))
        return
    print(f"res-convnet (54 MiB of weights), shapecache compile backend, {os.cpu_count()} cores; "
          f"sizes {args.sizes}; build seconds per size, inductor's cache state in brackets\n")
    for variant in ("plain", "freezing"):
        with tempfile.TemporaryDirectory(prefix="inductor-") as directory:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": directory}
            runs = []
            for process in ("cold", "warm"):
                done = subprocess.run([sys.executable, __file__, "--child", variant, "--sizes", args.sizes],
                                      capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    raise SystemExit(f"{variant} ({process}): {(done.stderr.strip().splitlines() or ['?'])[-1]}")
                runs.append(json.loads(done.stdout.strip().splitlines()[-1])["rows"])
            size = directory_bytes(Path(directory))
        totals = [sum(r["seconds"] for r in rows) for rows in runs]
        for process, rows, total in zip(("cold", "warm"), runs, totals, strict=True):
            cells = "  ".join(f"{r['seconds']:5.1f} [{r['cache']}]" for r in rows)
            print(f"{variant:<9} {process} process: {cells}   total {total:5.1f} s")
        print(f"{variant:<9} warm is {totals[0] / totals[1]:.1f}x faster; the cache directory holds "
              f"{size / 2**20:.0f} MiB\n")


if __name__ == "__main__":
    main()
