"""Memory per distinct size: a padded cache served a stream of ever-new sizes.

    python benchmarks/many_sizes.py [--sizes 3000] [--backend eager]

A two-layer MLP cached with `multiple_of(8)` on the batch and `max_entries=4` is called at
`--sizes` distinct batch sizes, each once: every call is padded (its outputs cropped to the
plain call's sizes, planned by a fake-tensor run per distinct size) and the entries come and
go under max_entries. Prints, every fifth of the way, the resident memory's growth since the
first 100 sizes, per size: as the process holds it, and after glibc's malloc_trim (what is
still allocated: free heap pages glibc keeps are not held by anything); and the size of
torch's fake-tensor operator cache, which is one dict for the process. Exits 1 when what is
still allocated grows by more than 2 KiB per size.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import torch

import shapecache as sc


def resident_bytes(trim: bool = False) -> int:
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, default=3000)
    parser.add_argument("--backend", default="eager")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).eval()
    model = sc.cached(model, backend=args.backend, buckets={"input": {0: sc.multiple_of(8)}}, max_entries=4)
    warm_up = 100
    step = max(1, (args.sizes - warm_up) // 5)
    print(f"torch {torch.__version__}; {args.sizes} distinct batch sizes, multiple_of(8), max_entries=4, "
          f"backend {args.backend}")
    header = (f"{'sizes':>7} {'rss growth MiB':>15} {'per size KiB':>13} {'trimmed KiB':>12} {'fake cache':>11} "
              f"{'ms/size':>8}")
    print(header)
    print("-" * len(header))
    base = trimmed_base = start = None
    per_size = trimmed = 0.0
    with torch.no_grad():
        for n in range(1, args.sizes + 1):
            model(torch.randn(n, 16))
            if n == warm_up:
                base, trimmed_base, start = resident_bytes(), resident_bytes(trim=True), time.perf_counter()
            elif base is not None and ((n - warm_up) % step == 0 or n == args.sizes):
                growth = resident_bytes() - base
                per_size = growth / (n - warm_up) / 1024
                trimmed = (resident_bytes(trim=True) - trimmed_base) / (n - warm_up) / 1024
                ms = (time.perf_counter() - start) / (n - warm_up) * 1000
                print(f"{n:>7} {growth / 2**20:>15.2f} {per_size:>13.2f} {trimmed:>12.2f} {len(FakeTensorMode.cache):>11} "
                      f"{ms:>8.2f}")
    stats = sc.stats(model)
    print(f"entries {len(stats['entries'])}, builds {stats['builds']}, evictions {stats['evictions']}")
    if trimmed > 2.0:
        print(f"what is allocated grows {trimmed:.2f} KiB per distinct size (limit 2 KiB)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
