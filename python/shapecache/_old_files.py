"""Files that processes now gone left in a directory other processes share (a replica's stats,
a publisher's temporary copy when it was killed mid-write): removed once per directory and
process, by age."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from pathlib import Path

_swept: set[Path] = set()  # directories this process swept
_lock = threading.Lock()


def remove_old_files(directory: Path, rules: tuple[tuple[str, float], ...]) -> None:
    """The first time this process asks for `directory`: removes each regular file there that
    this user owns, matching a (glob pattern, seconds) of `rules` and last modified over those
    seconds ago. By modification time, the file server's clock: the ages asked for are far
    longer than any skew, and spare a file another process is still writing. Errors (a file
    gone meanwhile, a directory that cannot be read) are left alone: the next process sweeps."""
    with _lock:
        if directory in _swept:
            return
        _swept.add(directory)
    now = time.time()
    for pattern, seconds in rules:
        with contextlib.suppress(OSError):
            for path in directory.glob(pattern):
                with contextlib.suppress(OSError):
                    status = path.lstat()
                    if stat.S_ISREG(status.st_mode) and status.st_uid == os.geteuid() and now - status.st_mtime > seconds:
                        path.unlink()
