"""``python -m shapecache demo|repro|serve`` (see shapecache.scenarios)."""

from shapecache.scenarios import main

if __name__ == "__main__":
    raise SystemExit(main())
