"""Command line: ``python -m shapecache demo`` and ``python -m shapecache repro``."""

import argparse

from shapecache import demo, repro


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shapecache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="serve a small conv net at mixed sizes and print a per-size table")
    demo.add_arguments(demo_parser)
    repro_parser = commands.add_parser("repro", help="run the out-of-memory size loop per strategy; table and plot")
    repro.add_arguments(repro_parser)
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo.run(args)
    elif args.command == "repro":
        repro.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
