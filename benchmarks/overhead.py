"""Per-call overhead of a cache hit, against a direct call and against torch.compile.

    python benchmarks/overhead.py [--calls 2000] [--device cpu] [--json out.json] [--skip-unet]

Two models, each called at one shape many times; each row is the lowest of 5 medians of per-call wall
times after warm-up, and "overhead" is the row's median minus the direct call of the same
model:
  - tiny: two 16x16 Linears (the call's own work is small, so the overhead shows);
  - unet holder: a module holding an SD1.5-config UNet2DConditionModel (686 tensors, 709
    modules, random weights) whose forward is trivial, so only the per-call machinery is
    timed: the key, the lookup, the guards a hit checks (state_guard.h), and the runner.
    torch.compile's row is its guard check on the same module (needs diffusers).
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


class UNetHolder(torch.nn.Module):
    """A full-size model beside a trivial forward: what a hit costs besides the model's work."""

    def __init__(self):
        super().__init__()
        from diffusers import UNet2DConditionModel

        self.unet = UNet2DConditionModel(  # Stable Diffusion 1.5's configuration
            sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
            block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        )
        self.scale = 2.0

    def forward(self, x):
        return x * self.scale


def median_us(call, x, calls: int, device: torch.device, rounds: int = 5) -> tuple[float, float]:
    """(median, p90) of per-call wall times in microseconds: the round with the lowest median of
    `rounds` rounds of calls // rounds calls each, so that a burst of other work on the machine
    during one round does not move the figure."""
    for _ in range(max(50, calls // 10)):
        call(x)
    best = None
    for _ in range(rounds):
        times = []
        for _ in range(max(1, calls // rounds)):
            start = time.perf_counter_ns()
            call(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter_ns() - start) / 1e3)
        times.sort()
        figures = (statistics.median(times), times[int(0.9 * len(times))])
        if best is None or figures[0] < best[0]:
            best = figures
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--skip-inductor", action="store_true", help="leave out the torch.compile rows")
    parser.add_argument("--skip-unet", action="store_true", help="leave out the UNet holder's rows")
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
        tables = [("tiny", rows)]
        if not args.skip_unet:
            tables.append(("unet holder", unet_rows(device, args)))

    print(f"torch {torch.__version__}, device {device}, {args.calls} calls per row, python {sys.version.split()[0]}")
    header = f"{'model':<12} {'path':<44} {'median us':>10} {'p90 us':>9} {'overhead us':>12} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for model, table in tables:
        base = table[0][1][0]
        for name, (median, p90) in table:
            print(f"{model:<12} {name:<44} {median:>10.2f} {p90:>9.2f} {median - base:>12.2f} {median / base:>7.2f}")
    for note in notes:
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"model": model, "path": n, "median_us": m, "p90_us": p, "overhead_us": m - table[0][1][0]}
                       for model, table in tables for n, (m, p) in table], f, indent=2)
    return 0


notes: list[str] = []


def unet_rows(device, args) -> list:
    holder = UNetHolder().to(device).eval()
    tensors = sum(1 for _ in holder.unet.parameters()) + sum(1 for _ in holder.unet.buffers())
    print(f"unet holder: {tensors} tensors, {sum(1 for _ in holder.unet.modules())} modules", file=sys.stderr)
    x = torch.randn(4, 16, device=device)
    rows = [("direct eager call", median_us(holder, x, args.calls, device))]
    rows.append(("shapecache eager (hit)", median_us(sc.cached(holder, backend="eager"), x, args.calls, device)))
    sc.uncached(holder)
    if not args.skip_inductor:
        cached = sc.cached(holder, backend="compile")
        rows.append(("shapecache compile (hit)", median_us(cached, x, args.calls, device)))
        sc.uncached(holder)
        rows.append(("torch.compile (guards hit)", median_us(torch.compile(holder, dynamic=False), x, args.calls, device)))
    # What a hit adds when the call ran every module of the UNet: the guard over its whole tree.
    from shapecache._backends import guard_record
    from shapecache._extension import _C

    record = guard_record({"unet": holder.unet})
    kinds = [kind for kind, _ in record.describe()]
    check = _C.StateGuard(record).check
    median, _ = median_us(lambda _: check(), x, args.calls, device)
    notes.append(f"a guard over the whole UNet ({kinds.count('dicts') + kinds.count('class_dicts')} dicts, {kinds.count('tensors')} tensors), as a hit "
                 f"of a call that ran every module checks it: {median:.2f} us per check")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
