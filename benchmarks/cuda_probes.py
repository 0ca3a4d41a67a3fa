"""Probes of what threads do to one another on a CUDA device, each a count that should be 0.

    python benchmarks/cuda_probes.py [--device cuda] [--out DIR]

- builds: two threads each call one ``sc.cached(..., backend="auto")`` model at sizes it has
  not met, at the same time, so that one thread's eager timing and capture run beside the
  other's. Counted: calls that raised, buckets that fell back to eager with a warning, and
  answers that differ from the plain module's.
- random numbers: while the main thread captures new buckets (``backend="cuda_graph"``), one
  thread draws ``torch.randn`` from the device's default generator, another from a generator
  of its own. Counted: draws that raised in each. On torch 2.11 a capture registers the
  default generator, and a draw from it on another thread during the capture raises "Offset
  increment outside graph capture"; a generator of the caller's own is not registered
  (docs/gpu.md). torch 2.13 keeps generator state per capture.
- upgrades: one thread serves a model with ``backend="auto", upgrade=True`` at one size while
  the worker compiles and measures its upgrade, and another thread builds new buckets of a
  second model (captures, on CUDA) meanwhile. Counted: calls that raised, wrong answers, and
  upgrades that failed; reported: upgrades kept and not kept.

`--device cpu` runs the same code on the CPU (the dry run of ``gpu-check --quick``), where
``auto`` runs eager and the graph backend reports why it cannot run. The table is written to
`--out` (probes.md, probes.json). Exits 1 when a count is not 0, but for draws from the
default generator (torch 2.11's limit, reported).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import warnings
from pathlib import Path

import torch


def conv_net(device, dtype):
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(4, 64, 3, padding=1)]
    for _ in range(4):
        layers += [torch.nn.GroupNorm(8, 64), torch.nn.SiLU(), torch.nn.Conv2d(64, 64, 3, padding=1)]
    layers.append(torch.nn.Conv2d(64, 4, 3, padding=1))
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype).eval()


def latents(size, device, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, *size, generator=generator).to(device=device, dtype=dtype)


class CheckedCalls:
    """Calls of cached models at sizes, each checked against the plain model's answer: counts
    the calls that answered, and keeps the errors and the sizes answered wrongly."""

    def __init__(self, plain, device, dtype):
        self.plain, self.device, self.dtype = plain, device, dtype
        self.errors, self.mismatches, self.calls = [], [], 0

    def __call__(self, model, size) -> None:
        x = latents(size, self.device, self.dtype, seed=size[0])
        try:
            with torch.no_grad():
                out = model(x)
            self.calls += 1
        except Exception as error:  # noqa: BLE001  (counted: the probe's subject)
            self.errors.append(f"{size}: {error!r}"[:200])
            return
        with torch.no_grad():
            expected = self.plain(x)
        if not torch.allclose(out.float(), expected.float(), atol=1e-2, rtol=1e-2):
            self.mismatches.append(str(size))


def probe_builds(device, dtype) -> dict:
    import shapecache as sc

    model = sc.cached(conv_net(device, dtype), backend="auto")
    sizes = {0: [(64, 64), (96, 80), (128, 112)], 1: [(72, 72), (104, 88), (136, 120)]}
    call = CheckedCalls(conv_net(device, dtype), device, dtype)
    start = threading.Barrier(2)

    def serve(thread):
        start.wait()
        for size in sizes[thread] * 3:
            call(model, size)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=serve, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    fallbacks = [str(w.message)[:200] for w in caught if "runs eager" in str(w.message)]
    backends = sorted(e["backend"] for e in sc.stats(model)["entries"])
    return {"probe": "two threads building new buckets with auto", "calls": call.calls, "errors": call.errors,
            "fallbacks": fallbacks, "mismatches": call.mismatches, "entries": backends}


def probe_random_numbers(device, dtype) -> dict:
    import shapecache as sc

    graph_backend = "cuda_graph" if device.type == "cuda" else "auto"
    model = sc.cached(conv_net(device, dtype), backend=graph_backend)
    stop = threading.Event()
    drawn = {"default generator": [0, []], "own generator": [0, []]}

    def draw(name, generator):
        while not stop.is_set():
            try:
                torch.randn(1 << 16, device=device, generator=generator)
                drawn[name][0] += 1
            except Exception as error:  # noqa: BLE001  (counted: the probe's subject)
                drawn[name][1].append(repr(error)[:200])
            time.sleep(0.0005)

    threads = [threading.Thread(target=draw, args=("default generator", None)),
               threading.Thread(target=draw, args=("own generator", torch.Generator(device=device).manual_seed(1)))]
    for t in threads:
        t.start()
    build_errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for side in range(48, 48 + 8 * 8, 8):
                with torch.no_grad():
                    model(latents((side, side), device, dtype, seed=side))
        except Exception as error:  # noqa: BLE001  (counted)
            build_errors.append(repr(error)[:200])
        finally:
            stop.set()
            for t in threads:
                t.join()
    after = None
    try:
        torch.randn(8, device=device)
    except Exception as error:  # noqa: BLE001  (counted: the default generator left in capture mode)
        after = repr(error)[:200]
    fallbacks = [str(w.message)[:200] for w in caught if "runs eager" in str(w.message)]
    return {"probe": f"random numbers on another thread during captures ({graph_backend})",
            "draws": {name: count for name, (count, _) in drawn.items()},
            "errors": {name: errors[:3] + ([f"... {len(errors)} in all"] if len(errors) > 3 else [])
                       for name, (_, errors) in drawn.items()},
            "error_counts": {name: len(errors) for name, (_, errors) in drawn.items()},
            "build_errors": build_errors, "fallbacks": fallbacks, "default_generator_after": after,
            "entries": sorted(e["backend"] for e in sc.stats(model)["entries"])}


def small_net(device, dtype):
    """A graph inductor compiles in seconds: what the probe is about is where the compile runs."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 4, 3, padding=1))
    return net.to(device=device, dtype=dtype).eval()


def probe_upgrades(device, dtype) -> dict:
    import shapecache as sc

    upgraded = sc.cached(small_net(device, dtype), backend="auto", upgrade=True)
    building = sc.cached(small_net(device, dtype), backend="auto")
    call = CheckedCalls(small_net(device, dtype), device, dtype)
    start = threading.Barrier(2)

    def serve_upgraded():
        start.wait()
        deadline = time.monotonic() + 300
        for _ in range(2):  # its bucket built, then its upgrade queued (one: the probe is where it runs)
            call(upgraded, (64, 64))
        while sc.stats(upgraded)["pending_builds"] and time.monotonic() < deadline:
            call(upgraded, (64, 64))
            time.sleep(0.005)  # a request stream with gaps, not a loop that starves the compile

    def build_new_buckets():
        start.wait()
        for side in range(48, 48 + 8 * 10, 8):
            call(building, (side, side + 8))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=serve_upgraded), threading.Thread(target=build_new_buckets)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        finished = sc.wait(upgraded, timeout=300)
    stats = sc.stats(upgraded)
    failed = [str(w.message)[:200] for w in caught if "upgrade" in str(w.message)]
    if not finished:
        failed.append("the upgrades did not finish within 300 s")
    return {"probe": "upgrades compiled and measured beside another thread's new buckets", "calls": call.calls,
            "errors": call.errors, "mismatches": call.mismatches, "upgrades": stats["upgrades"],
            "upgrades_not_kept": stats["upgrades_not_kept"], "upgrade_failures": failed,
            "entries": sorted(e["backend"] for e in stats["entries"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="cuda-probes")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    results = [probe_builds(device, dtype), probe_random_numbers(device, dtype), probe_upgrades(device, dtype)]
    header = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probes.json").write_text(json.dumps({**header, "probes": results}, indent=1))
    builds, rng, upgrades = results
    lines = [f"# Thread probes: {header['device']}, torch {header['torch']}", "",
             "| probe | calls or draws | errors | eager fallbacks | wrong answers | entries |", "|---|---|---|---|---|---|",
             f"| {builds['probe']} | {builds['calls']} | {len(builds['errors'])} | {len(builds['fallbacks'])} | "
             f"{len(builds['mismatches'])} | {', '.join(builds['entries'])} |"]
    for name, count in rng["draws"].items():
        lines.append(f"| {rng['probe']}: {name} | {count} | {rng['error_counts'][name]} | {len(rng['fallbacks'])} | - | "
                     f"{', '.join(rng['entries'])} |")
    lines.append(f"| {upgrades['probe']} | {upgrades['calls']} | {len(upgrades['errors'])} | - | "
                 f"{len(upgrades['mismatches'])} | {', '.join(upgrades['entries'])} |")
    lines += ["", f"default generator after the captures: {rng['default_generator_after'] or 'draws'}",
              f"upgrades: {upgrades['upgrades']} kept, {upgrades['upgrades_not_kept']} not kept, "
              f"{len(upgrades['upgrade_failures'])} failed"]
    for label, found in (("build errors", builds["errors"] + rng["build_errors"] + upgrades["errors"]),
                         ("fallbacks", builds["fallbacks"]), ("upgrade failures", upgrades["upgrade_failures"]),
                         ("random-number errors", [e for errors in rng["errors"].values() for e in errors])):
        lines += [f"- {label}: {item}" for item in found[:5]]
    text = "\n".join(lines)
    (out / "probes.md").write_text(text + "\n")
    print(text)
    # Every count is shapecache's to keep at 0 but one: draws from the default generator during
    # a capture on torch 2.11, a limit of that torch (docs/gpu.md), reported and not failed.
    failed = {"build errors": builds["errors"] + rng["build_errors"] + upgrades["errors"],
              "wrong answers": builds["mismatches"] + upgrades["mismatches"],
              "upgrade failures": upgrades["upgrade_failures"],
              "own generator errors": rng["errors"]["own generator"],
              "default generator after the captures": [rng["default_generator_after"]] if rng["default_generator_after"]
              else []}
    failed = {name: found for name, found in failed.items() if found}
    if failed:
        print(f"cuda_probes: {', '.join(failed)} not 0", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
