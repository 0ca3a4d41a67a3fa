"""What AOTInductor's package loader leaves on disk. The loader (torch 2.13's
AOTIModelPackageLoader) extracts a package into a directory ``aotinductor_XXXXXX`` of the
temporary directory (TMPDIR, else /tmp), loads the library from it, reads the constants into
memory, and removes the directory when it is freed. Two things are left to whoever loads:

- the constants file, a second copy of the weights on disk (on a tmpfs ``/tmp``, in memory)
  for the loader's whole life: removed at once (``remove_extracted_constants``);
- the directory of a process killed before its loader was freed (a killed replica, a killed
  compiler): its library, a megabyte or two a package, never removed. A fleet whose replicas
  are killed and replaced accumulates them; the first package a process loads sweeps those
  of shapecache's packages (their metadata says so: ``marked``) that this user owns, over
  ORPHANED_AFTER_S old, and under which no process of this user maps a file
  (``remove_orphaned_once``), on a thread of its own. Other programs' packages are left
  alone: a loader of CUDA kernels reads them from its directory as it first runs them.

What the maps cannot show (a process in another PID namespace sharing the directory, one whose
maps this user cannot read) costs nothing wrong: shapecache's packages are of CPU graphs, whose
loader reads the constants and maps the library as it is made, so a live loader whose
directory is removed runs on, and is freed without error (torch 2.13: the destructor removes
its directory with errors ignored). Only the directory is gone a little sooner.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger("shapecache")

PREFIX = "aotinductor_"
# A directory this old whose library nobody maps is a killed process's: a live loader maps its
# library from the moment it extracts it (within the second), for as long as it lives.
ORPHANED_AFTER_S = 3600.0

# The metadata entry that marks a package as shapecache's (the package store's key marks those
# it publishes too), in the directory its loader extracted.
MARKER = "shapecache_package"
_METADATA_LIMIT = 1 << 16  # bytes: a metadata file larger than this is not read

_sweep_lock = threading.Lock()  # held from the first sweep on


def marked(inductor_configs: dict) -> dict:
    """AOTInductor's `inductor_configs` with MARKER in the package's metadata."""
    metadata = dict(inductor_configs.get("aot_inductor.metadata") or {})
    return {**inductor_configs, "aot_inductor.metadata": {**metadata, MARKER: "1"}}


def remove_extracted_constants(blobs) -> None:
    """Removes the constants files named `blobs` that the loader extracted beside the library it
    loaded, which /proc/self/maps names (nothing where there is none: not Linux)."""
    libraries = {name.removesuffix("_weights.blob") + ".so" for name in blobs}
    paths = {path for path in _mapped_files("self") or () if path.endswith(".so")}
    for path in paths:
        if os.path.basename(path) in libraries:
            blob = path.removesuffix(".so") + "_weights.blob"
            with contextlib.suppress(OSError):
                os.remove(blob)


def remove_orphaned_once() -> None:
    """The first time this process asks: ``remove_orphaned`` in the temporary directory, on a
    thread of its own (it lists the directory and reads this user's processes' maps)."""
    if not _sweep_lock.acquire(blocking=False):
        return  # (never released: once per process)

    def sweep():
        root = Path(os.path.realpath(tempfile.gettempdir()))  # (the maps name resolved paths)
        try:
            removed = remove_orphaned(root)
        except Exception as error:  # noqa: BLE001 - housekeeping: never a build's failure
            logger.debug("shapecache: sweeping %s failed: %s", root, error)
            return
        if removed:
            logger.info("shapecache: removed %d package directories that killed processes left in %s", removed, root)

    with contextlib.suppress(RuntimeError):  # (no thread can start: the interpreter is exiting)
        threading.Thread(target=sweep, name="shapecache-sweep", daemon=True).start()


def remove_orphaned(root: Path, now: float | None = None) -> int:
    """Removes the directories ``aotinductor_*`` directly in `root` that hold one of
    shapecache's packages, that this user owns, last modified over ORPHANED_AFTER_S before
    `now`, and under which no process of this user maps a file (as far as the maps can be
    read: the module says why what they cannot show costs nothing wrong); returns how many.
    Nothing where others may write `root` without its sticky bit. Links and other files are
    left alone, as are errors (the next process sweeps)."""
    now = time.time() if now is None else now
    try:
        status = root.stat()
    except OSError:
        return 0
    # In a directory others may write without the sticky bit, they could rename or swap what is
    # checked before it is removed.
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not status.st_mode & stat.S_ISVTX:
        return 0
    candidates = []
    with contextlib.suppress(OSError):
        for path in root.glob(PREFIX + "*"):
            with contextlib.suppress(OSError):
                status = path.lstat()
                if stat.S_ISDIR(status.st_mode) and status.st_uid == os.geteuid() \
                        and now - status.st_mtime > ORPHANED_AFTER_S and _holds_ours(path):
                    candidates.append(path)
    if not candidates:
        return 0
    mapped = _mapped_by_this_user()
    if mapped is None:
        return 0
    removed = 0
    for path in candidates:
        inside = f"{path}{os.sep}"
        if not any(file.startswith(inside) for file in mapped):
            with contextlib.suppress(OSError):
                shutil.rmtree(path)
                removed += 1
    return removed


def _holds_ours(directory: Path) -> bool:
    """Whether the package extracted in `directory` is shapecache's: a metadata file of it
    (``<root>/data/aotinductor/<model>/*_metadata.json``) names MARKER or the store's key."""
    from shapecache._backends.package_store import KEY_METADATA  # (here: it imports compile_process, which imports this)

    for path in directory.glob("*/data/aotinductor/*/*_metadata.json"):
        with contextlib.suppress(OSError, ValueError, RecursionError):
            status = path.lstat()
            if not stat.S_ISREG(status.st_mode) or status.st_size > _METADATA_LIMIT:
                continue
            metadata = json.loads(path.read_bytes())
            if isinstance(metadata, dict) and (MARKER in metadata or KEY_METADATA in metadata):
                return True
    return False


def _mapped_by_this_user() -> set[str] | None:
    """The files that this user's processes whose maps can be read map; None where there is no
    /proc."""
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    files: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid == os.geteuid():
                files |= _mapped_files(pid) or set()
    return files


def _mapped_files(pid: str) -> set[str] | None:
    """The files process `pid` ("self": this one) maps, by /proc/<pid>/maps (a name that is not
    UTF-8 read with surrogate escapes); None where it cannot be read."""
    files = set()
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith(b"/"):
                    files.add(os.fsdecode(fields[5].rstrip(b"\n")))
    except OSError:  # ended meanwhile, or not readable
        return None
    return files
