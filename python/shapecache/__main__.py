"""``python -m shapecache demo|repro|serve`` (see shapecache.scenarios)."""

from shapecache.scenarios._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
