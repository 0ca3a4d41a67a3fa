"""shapecache's command line: demo, repro, serve, gpu-check, info.

Exit status: 0 when the command showed its result (a strategy running out of memory is such a
result); 1 when a strategy failed to run, the demo could not show that the per-size graphs
outgrow the memory limit while shapecache completes, or the command failed; 2 for a usage
error."""

import argparse

from shapecache.scenarios import _gpu_check as gpu_check
from shapecache.scenarios import _repro as repro
from shapecache.scenarios import _serve as serve


def parse_arguments(argv=None) -> argparse.Namespace:
    """The command line's arguments; usage errors exit with status 2 and argparse's message."""
    parser = argparse.ArgumentParser(prog="python -m shapecache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="the out-of-memory size loop under a memory limit: on the CPU a 54 MiB conv net compiled "
                    "with freezing, on CUDA the tiny pipeline")
    repro.add_arguments(demo_parser)
    repro_parser = commands.add_parser("repro", help="run the out-of-memory size loop per strategy; table and plot")
    repro.add_arguments(repro_parser)
    serve_parser = commands.add_parser(
        "serve", help="serve a model at mixed sizes through the cache and print a per-size table")
    serve.add_arguments(serve_parser)
    gpu_parser = commands.add_parser(
        "gpu-check", help="verify the GPU path in one command (tests, benchmarks, the SDXL loop); writes a report")
    gpu_check.add_arguments(gpu_parser)
    commands.add_parser("info", help="what this shapecache was built with: the torch, its CUDA, whether CUDA code was "
                                     "built (and if not, why and how to build it)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_arguments(argv)
    if args.command in ("demo", "repro"):
        results = repro.run(args)
        if any("failed" in result for result in results.values()):
            return 1
        if args.command == "demo":
            sizes = args.sizes or repro.parse_sizes(repro.DEFAULT_SIZES[args.model])
            missing = repro.shown(results, len(sizes), repro.budget_bytes(args) if args.budget else None)
            if missing:
                print(f"the demo could not show its result: {missing}")
                return 1
        return 0
    if args.command == "gpu-check":
        return gpu_check.run(args)
    if args.command == "info":
        from shapecache._built_with import build_info, cpu_only_reason

        for name, value in build_info().items():
            print(f"{name}: {value}")
        reason = cpu_only_reason()
        if reason is not None:
            print(f"note: {reason}")
        return 0
    serve.run(args)
    return 0

