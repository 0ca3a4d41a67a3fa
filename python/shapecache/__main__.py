"""Command line: ``python -m shapecache demo``."""

import argparse

from shapecache import demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shapecache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="serve a small conv net at mixed sizes and print a per-size table")
    demo.add_arguments(demo_parser)
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
