"""Per-call overhead of a cache hit, against a direct call and against torch.compile.

    python benchmarks/overhead.py [--calls 2000] [--device cpu] [--json out.json]

A tiny model (so that the call's own work is small and the overhead shows) is called at one
shape many times; each row is the median of per-call wall times after warm-up. "overhead"
is the row's median minus the direct eager call's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import shapecache as sc


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x, scale: float = 1.0):
        return self.b(torch.relu(self.a(x))) * scale


def median_us(call, x, calls: int, device: torch.device) -> tuple[float, float]:
    for _ in range(max(50, calls // 10)):
        call(x)
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        call(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter_ns() - start) / 1e3)
    times.sort()
    return statistics.median(times), times[int(0.9 * len(times))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--skip-inductor", action="store_true", help="leave out the torch.compile rows")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(4, 16, device=device)

    def fresh():
        return Tiny().to(device).eval()

    rows = []
    with torch.no_grad():
        direct = fresh()
        rows.append(("direct eager call", median_us(direct, x, args.calls, device)))
        rows.append(("shapecache eager (hit)", median_us(sc.cached(fresh(), backend="eager"), x, args.calls, device)))
        if not args.skip_inductor:
            compiled = torch.compile(fresh(), dynamic=False)
            rows.append(("torch.compile (guards hit)", median_us(compiled, x, args.calls, device)))
            cached_compiled = sc.cached(fresh(), backend="compile")
            rows.append(("shapecache compile (hit)", median_us(cached_compiled, x, args.calls, device)))
        bucketed = sc.cached(fresh(), backend="eager", buckets={"x": {0: sc.power_of_two()}})
        rows.append(("shapecache eager, batch padded 4->4 (hit)", median_us(bucketed, x, args.calls, device)))
        padded = sc.cached(fresh(), backend="eager", buckets={"x": {0: sc.power_of_two()}})
        x3 = x[:3].contiguous()
        rows.append(("shapecache eager, batch padded 3->4 (hit)", median_us(padded, x3, args.calls, device)))

    base = rows[0][1][0]
    print(f"torch {torch.__version__}, device {device}, {args.calls} calls per row, python {sys.version.split()[0]}")
    header = f"{'path':<44} {'median us':>10} {'p90 us':>9} {'overhead us':>12} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for name, (median, p90) in rows:
        print(f"{name:<44} {median:>10.2f} {p90:>9.2f} {median - base:>12.2f} {median / base:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"path": n, "median_us": m, "p90_us": p, "overhead_us": m - base} for n, (m, p) in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
