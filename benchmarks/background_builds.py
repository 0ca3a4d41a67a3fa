"""Seconds to build a new size in the background against inline and against torch.compile.

Each mode runs in a process of its own with an empty inductor cache (a new TORCHINDUCTOR_CACHE_DIR
and TMPDIR), freezing on (the CPU serving set-up), grad off. A size's build time is from the call
that misses to its entry being in (``sc.wait``) for shapecache, and the first call at that size
for torch.compile. The background mode also prints where its builds' time went in the
compiler's process (its start and imports, the program's read, the compile, the trial run of
its package), as the process logs it.

    python benchmarks/background_builds.py [--models toy,mid] [--sizes 20,28]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from shapecache.scenarios import why_it_failed

MODES = ("torch.compile", "inline", "background")
MODELS = ("toy", "mid")


def build_model(name: str):
    import torch

    torch.manual_seed(0)
    if name == "toy":  # two convolutions, 3 -> 32 -> 8 channels
        layers = [torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 8, 3, padding=1)]
        return torch.nn.Sequential(*layers).eval(), 3
    # eight 128-channel conv blocks, about 1.2 M parameters
    layers = [torch.nn.Conv2d(3, 128, 3, padding=1), torch.nn.ReLU()]
    for _ in range(8):
        layers += [torch.nn.Conv2d(128, 128, 3, padding=1), torch.nn.ReLU()]
    layers.append(torch.nn.Conv2d(128, 8, 3, padding=1))
    return torch.nn.Sequential(*layers).eval(), 3


def run_mode(mode: str, model_name: str, sizes: list[int]) -> dict:
    import logging

    import torch

    import shapecache as sc

    model, channels = build_model(model_name)
    parameters = sum(p.numel() for p in model.parameters())
    options = {"options": {"freezing": True}}
    splits: list[dict] = []
    if mode == "torch.compile":
        torch._inductor.config.freezing = True
        forward = torch.compile(model)
    else:
        forward = sc.cached(model, backend="compile", compile_options=options, build=mode)
        if mode == "background":
            handler = logging.Handler()
            handler.emit = lambda record: splits.append(dict(getattr(record, "compiler_split", {})))
            logging.getLogger("shapecache").addHandler(handler)
            logging.getLogger("shapecache").setLevel(logging.DEBUG)
    seconds = []
    with torch.no_grad():
        for size in sizes:
            x = torch.randn(1, channels, size, size)
            begin = time.perf_counter()
            forward(x)
            if mode != "torch.compile":
                assert sc.wait(forward, timeout=1800)
            seconds.append(time.perf_counter() - begin)
    return {"seconds": seconds, "parameters": parameters, "steps": splits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="toy,mid")
    parser.add_argument("--sizes", default="20,28", help="image sizes in pixels, built in this order")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    for given, known, option in ((args.models, MODELS, "--models"), (args.modes, MODES, "--modes")):
        if unknown := [name for name in given.split(",") if name not in known]:
            parser.error(f"{option}: {', '.join(unknown)} not among {', '.join(known)}")
    if args.child:
        print(json.dumps(run_mode(args.child[0], args.child[1], sizes)))
        return
    import torch

    print(f"CPU, torch {torch.__version__}, {os.cpu_count()} cores; freezing on, grad off; each mode in a process of "
          "its own with an empty inductor cache")
    failed = []
    for model_name in args.models.split(","):
        results = {}
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as scratch:
                environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor"),
                               "TMPDIR": scratch}
                done = subprocess.run([sys.executable, __file__, "--child", mode, model_name, "--sizes", args.sizes],
                                      capture_output=True, text=True, env=environment)
            if done.returncode != 0:
                print(f"{model_name} {mode}: failed: {why_it_failed(done)}", flush=True)
                failed.append(f"{model_name} {mode}")
                continue
            results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        if not results:
            continue
        parameters = next(iter(results.values()))["parameters"]
        print(f"\n{model_name} ({parameters / 1e6:.2f} M parameters): seconds to build each size "
              f"({', '.join(f'{s}x{s}' for s in sizes)})")
        inline = results.get("inline")
        for mode, result in results.items():
            cells = []
            for k, seconds in enumerate(result["seconds"]):
                ratio = f" ({seconds / inline['seconds'][k]:.2f}x inline)" if inline and mode != "inline" else ""
                cells.append(f"{seconds:7.1f}{ratio}")
            print(f"  {mode:<14} " + " | ".join(cells))
        for k, steps in enumerate(results.get("background", {}).get("steps", [])):
            print(f"  background build {k + 1}: " + ", ".join(f"{step} {s:.2f} s" for step, s in steps.items()))

    if failed:
        sys.exit(f"\nmodes that did not run: {', '.join(failed)}")


if __name__ == "__main__":
    main()
