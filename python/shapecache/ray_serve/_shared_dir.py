"""The directory replicas share: inductor's on-disk caches, shapecache's packages of frozen
graphs and tuning records, and the fleet's hot sizes, so that a replica that starts after
others builds from what they compiled.

Layout under the directory:

- ``inductor/``: TORCHINDUCTOR_CACHE_DIR, inductor's FX graph cache and its kernels. Inductor
  writes each file under a temporary name and renames it into place, and takes a file lock
  where two processes could write one entry, so replicas may share it.
- ``tuning.json``: SHAPECACHE_TUNING_DB, the tuned-convolution records (written by atomic
  replace, merged with what another process wrote meanwhile; see ops/_tuning.py).
- ``packages/``: frozen graphs compiled with AOTInductor, one file per program, loaded by a
  replica that traces the same program instead of compiled (the package store,
  shapecache/_backends/package_store.py, which reads SHAPECACHE_SHARED_DIR and owns the
  layout: ``SharedDir.packages``). Each is renamed into place whole.
- ``replicas.<replica class>/<replica id>.json``: the routing stats each replica of that class
  last published (``CachedReplica.record_routing_stats``), written under a temporary name and
  renamed into place every stats period: the fleet view (``fleet``) reads them. A process's
  first publication there removes the files of replicas gone for a day (``remove_old_files``).
- ``sizes.<replica class>.jsonl``: one line per size a replica of that class built on request,
  ``{"size": [...], "at": unix seconds}``,
  appended with one ``write`` on a file opened ``O_APPEND``. On a local file system each line
  lands whole; on a network file system without atomic appends (NFS) two lines can interleave,
  and the reader skips a line it cannot parse.

Inductor's Redis remote cache is configured by its own environment variables
(TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE=1, TORCHINDUCTOR_REDIS_HOST, TORCHINDUCTOR_REDIS_PORT),
which ``environment`` passes on to the replicas where the driver has them.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import stat
import tempfile
import time
from pathlib import Path

from shapecache._backends import SHARED_DIR_VARIABLE, shared_packages_directory, untrusted_shared_directory
from shapecache._old_files import remove_old_files
from shapecache.ray_serve._placement import ReplicaState
from shapecache.ray_serve._prewarm_order import decided_at, prewarm_order
from shapecache.ray_serve._request_size import MAX_DIMENSIONS, MAX_SIDE

logger = logging.getLogger("shapecache")

ENVIRONMENT_VARIABLE = SHARED_DIR_VARIABLE  # read by the package store, set by a deployment
_REPLICA_FILE = re.compile(r"[^A-Za-z0-9_.-]")  # what a replica's file name may not hold
GONE_AFTER_S = 24 * 3600  # a replica's file not written for this long is a replica that is gone
ABANDONED_AFTER_S = 3600  # a temporary file this old is a publisher's that was killed mid-write
_REPLICA_FILE_LIMIT = 4 << 20  # bytes: a replica's stats file larger than this is not read
REMOTE_CACHE_VARIABLES = ("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_REDIS_HOST", "TORCHINDUCTOR_REDIS_PORT")


class SharedDir:
    """One shared directory (created when missing)."""

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise TypeError(f"shared_dir={path!r}: expected a directory path (str or os.PathLike)")
        self.path = Path(path).expanduser().absolute()
        self.path.mkdir(parents=True, exist_ok=True)

    @property
    def packages(self) -> Path:
        """Where the package store keeps the packages shared here."""
        return shared_packages_directory(self.path)

    @classmethod
    def from_option(cls, path=None) -> SharedDir | None:
        """`path` when given, else SHAPECACHE_SHARED_DIR when set, else None (nothing shared)."""
        if path is None:
            path = os.environ.get(ENVIRONMENT_VARIABLE) or None
        return None if path is None else cls(path)

    def environment(self) -> dict[str, str]:
        """The environment variables that point a replica's caches here (for a Ray
        ``runtime_env``), with inductor's remote-cache variables of this process."""
        env = {
            ENVIRONMENT_VARIABLE: str(self.path),
            "TORCHINDUCTOR_CACHE_DIR": str(self.path / "inductor"),
            "SHAPECACHE_TUNING_DB": str(self.path / "tuning.json"),
        }
        env.update({name: os.environ[name] for name in REMOTE_CACHE_VARIABLES if name in os.environ})
        return env

    def apply(self) -> None:
        """Points this process's caches here. Inductor reads TORCHINDUCTOR_CACHE_DIR whenever it
        opens its cache; one that is set to another directory is left alone, with a warning.
        A directory other users may write is warned of: shapecache's packages in it are checked
        (package_trust.py), but inductor loads what its cache holds (pickles, libraries)
        without asking who wrote it."""
        for name, value in self.environment().items():
            current = os.environ.setdefault(name, value)
            if current != value and name not in REMOTE_CACHE_VARIABLES:
                logger.warning("shapecache: %s=%s is set, so it is not shared through %s", name, current, self.path)
        if (why := untrusted_shared_directory(self.path.stat(), None)) is not None:
            logger.warning("shapecache: %s: %s. Inductor's cache in it (inductor/) is loaded without a check, so "
                           "whoever can write there runs code in every replica; shapecache's packages are loaded "
                           "only as package_trust allows", self.path, why)

    def publish_replica(self, name: str, replica_id: str, stats: dict) -> None:
        """Writes what replica `replica_id` published to the fleet's directory `name` (one per
        replica class, ``CachedReplica.replicas_dir()``), renamed into place whole. The first
        publication of a process there removes what replicas long gone left (`remove_old_files`)."""
        directory = self.path / name
        directory.mkdir(mode=0o755, exist_ok=True)
        # Replica ids are never reused: without this, each replica Serve ever started would leave one.
        remove_old_files(directory, (("*.json", GONE_AFTER_S), (".*.tmp", ABANDONED_AFTER_S)))
        path = directory / (_REPLICA_FILE.sub("_", replica_id) + ".json")
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(stats))
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def fleet(self, name: str, max_age_s: float = 60.0) -> list[ReplicaState]:
        """What each replica in the fleet's directory `name` published within `max_age_s`
        (older: a replica that is gone), by replica id. The files are other processes'
        writing: one that is not stats of this format counts as missing and is left out."""
        states = []
        now = time.time()
        try:
            paths = sorted((self.path / name).glob("*.json"))
        except OSError:
            return []
        for path in paths:
            try:  # a regular file (not a FIFO, a device or a link), written lately, of a bounded size
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    status = os.fstat(f.fileno())
                    # (mtime is the file server's clock: only a file far older than max_age_s is skipped unread)
                    if not stat.S_ISREG(status.st_mode) or now - status.st_mtime > 10 * max_age_s + 600 \
                            or status.st_size > _REPLICA_FILE_LIMIT:
                        continue
                    text = f.read(_REPLICA_FILE_LIMIT + 1)
                if len(text) > _REPLICA_FILE_LIMIT:
                    continue
                stats = json.loads(text.decode("utf-8"), parse_constant=_no_constant)
            except (OSError, ValueError, RecursionError):
                continue
            state = ReplicaState.from_routing_stats(path.stem, stats)
            if state.fresh(now, max_age_s):
                states.append(state)
        return states

    def record_sizes(self, sizes, name: str) -> None:
        """Appends the sizes a replica built to the fleet's record `name` (one per replica class,
        ``CachedReplica.sizes_file()``)."""
        now = time.time()
        lines = "".join(json.dumps({"size": list(size), "at": now}) + "\n" for size in sizes)
        if not lines:
            return
        fd = os.open(self.path / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)

    def decided_s(self, replicas: str) -> float:
        """Seconds until each replica publishing in the fleet's directory `replicas` that missed a
        publication is known to be live or gone (``decided_at``): 0 where none did."""
        now = time.time()
        return decided_at(self.fleet(replicas, GONE_AFTER_S), now) - now

    def hot_sizes(self, name: str, limit: int | None = None, replicas: str | None = None) -> list[tuple[int, ...]]:
        """The sizes the fleet built (the record `name`) in the order a new replica builds them
        (``prewarm_order``: those requested that no live replica holds first, then the most
        requested), as the replicas publishing in the fleet's directory `replicas`
        (``CachedReplica.replicas_dir()``; None: none) published them, those gone within
        GONE_AFTER_S included. The record is other processes' writing: a line that is not a
        size a request could have had (torn, foreign, not JSON, not UTF-8, numbers out of range,
        a side not in 1..MAX_SIDE) is skipped, and the count of those is logged; no line can
        keep a replica from starting. The replicas' stats only order the record's sizes."""
        counts: collections.Counter = collections.Counter()
        skipped = 0
        try:
            with open(self.path / name, "rb") as f:
                for line in f:
                    if (size := _size_of(line)) is None:
                        skipped += 1
                    else:
                        counts[size] += 1
        except FileNotFoundError:
            return []
        if skipped:
            logger.warning("shapecache: %d lines of %s are not sizes and were skipped", skipped, self.path / name)
        fleet = self.fleet(replicas, GONE_AFTER_S) if replicas is not None and counts else []
        ranked = prewarm_order(counts, fleet, time.time())
        return ranked if limit is None else ranked[:limit]




def _size_of(line: bytes) -> tuple[int, ...] | None:
    """The size a line of the record holds; None where it holds none a request could have had."""
    try:
        size = json.loads(line.decode("utf-8"), parse_constant=_no_constant)["size"]
        if not isinstance(size, list) or not 0 < len(size) <= MAX_DIMENSIONS:
            return None
        if not all(type(side) is int and 1 <= side <= MAX_SIDE for side in size):
            return None
        return tuple(size)
    except (ValueError, KeyError, TypeError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a size")

