"""Tuned convolutions: ``tune_convs`` routes a module's ``Conv2d`` layers through
``shapecache::conv2d``, and ``TuningDb`` keeps the chosen algorithms on disk.

The file (default ``~/.cache/shapecache/tuning.json``; ``SHAPECACHE_TUNING_DB`` or
``db=`` for another) holds records of every process that used it:

- writes take an exclusive lock on ``<file>.lock``, read what is there, merge their own
  records in (a record of the same problem is replaced, others' are kept), write a
  temporary file beside it and rename it over the old one: a reader never sees half a file,
  and several processes writing at once lose nothing;
- a file whose contents cannot be used, or that has another format version, is moved aside
  to ``<file>.corrupt-<time>`` with a warning, and work goes on without it;
- only a regular file is ever moved or replaced: a path to anything else (a device, a
  directory), or one that cannot be read or written (permissions, a read-only directory),
  leaves the records in memory, with one warning;
- a rewrite keeps the file's permissions, and removes temporary files that a writer killed
  mid-write left behind (any present while the lock is held are such);
- records of another environment (device model, library versions, thread count) stay in the
  file for the machines they belong to, and are not used here.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import tempfile
import time
import types
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from shapecache import _background
from shapecache._extension import _C
from shapecache._holder import CacheHolder
from shapecache.budget import parse_budget

FORMAT = "shapecache-tuning"
VERSION = 1


def default_path() -> Path:
    configured = os.environ.get("SHAPECACHE_TUNING_DB")
    if configured:
        return Path(configured).expanduser()
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_home / "shapecache" / "tuning.json"


class TuningDb:
    """The tuning records file of one path."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()

    def load(self) -> int:
        """Gives this file's records to the tuner; returns how many it took."""
        with self._locked():
            records = self._read()
        return _C.tuning_load(records)

    def flush(self) -> int:
        """Merges the records tuned since the last flush into the file; returns how many."""
        new = _C.tuning_take_unsaved()
        if not new:
            return 0
        with self._locked():
            merged = {_C.record_key(r): r for r in self._read()}
            merged.update((_C.record_key(r), r) for r in new)
            self._write(list(merged.values()))
        return len(new)

    def records(self) -> list[dict]:
        """The records in the file now (all environments)."""
        with self._locked():
            return self._read()

    def check_path(self) -> None:
        """Raises OSError unless the path is a regular file or names none yet."""
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISREG(mode):
            raise OSError(f"{self.path} is not a regular file")

    @property
    def _temporary_prefix(self) -> str:
        return f".{self.path.name}.tmp-"

    @contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> list[dict]:
        """The file's records; a missing file has none; an unreadable one is set aside."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError("not a shapecache tuning file")
            if data.get("version") != VERSION:
                raise ValueError(f"format version {data.get('version')!r}, this shapecache reads {VERSION}")
            records = data["records"]
            for record in records:
                _C.record_key(record)  # every record must parse
            return records
        except Exception as error:  # noqa: BLE001  (any defect: set the file aside, never crash)
            self.check_path()
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            os.replace(self.path, aside)
            warnings.warn(
                f"shapecache: the tuning records in {self.path} could not be used ({error}); "
                f"moved the file to {aside} and continuing without it",
                RuntimeWarning,
                stacklevel=3,
            )
            return []

    def _write(self, records: list[dict]) -> None:
        self.check_path()
        for leftover in self.path.parent.glob(self._temporary_prefix + "*"):
            leftover.unlink(missing_ok=True)  # the lock is ours: no live writer owns it
        text = json.dumps({"format": FORMAT, "version": VERSION, "records": records}, indent=1)
        try:
            mode = stat.S_IMODE(os.stat(self.path).st_mode)
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask  # what open() would have made
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=self._temporary_prefix)
        try:
            os.fchmod(handle, mode)  # mkstemp makes 0600: others sharing the file could not read it
            with os.fdopen(handle, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


_databases: dict[Path, TuningDb | None] = {}  # None: that path cannot be used; records stay in memory


def open_db(db) -> TuningDb | None:
    """The database for `db` (None: the default path; False: none), loaded once per process."""
    if db is False:
        return None
    if db is not None and not isinstance(db, (str, os.PathLike)):
        raise TypeError(f"db={db!r}: expected a file path, None for {default_path()}, or False for no file")
    path = Path(db).expanduser().resolve() if db is not None else default_path().resolve()
    if path not in _databases:
        database = TuningDb(path)
        try:
            database.check_path()
            database.load()
        except OSError as error:
            warnings.warn(f"shapecache: cannot use the tuning records file {path} ({error}); tuning records are "
                          "kept in memory for this process", RuntimeWarning, stacklevel=3)
            database = None
        _databases[path] = database
    return _databases[path]


def _flush_at_exit() -> None:
    for database in _databases.values():
        if database is None:
            continue
        try:
            database.flush()
        except OSError as error:
            warnings.warn(f"shapecache: could not write tuning records to {database.path}: {error}", RuntimeWarning,
                          stacklevel=1)


_background.at_exit(_flush_at_exit)  # after the running build, which may tune convolutions


class TunedConvs(CacheHolder):
    """What ``tune_convs`` did: ``routed`` layer names, ``skipped`` {name: reason};
    ``sc.uncached(handle)`` restores every layer."""

    def __init__(self, module, routed, skipped, hook):
        self.module, self.routed, self.skipped, self._hook = module, routed, skipped, hook

    def remove(self) -> None:
        """Deprecated: ``sc.uncached(handle)``."""
        warnings.warn("TunedConvs.remove() is deprecated; use shapecache.uncached(handle)", DeprecationWarning,
                      stacklevel=2)
        self.uncache()

    def uncache(self):
        for name in self.routed:
            conv = self.module.get_submodule(name)
            conv.__dict__.pop("forward", None)
            conv.__dict__.pop("_shapecache_padding", None)
        if self._hook is not None:
            self._hook.remove()
        self.routed = []
        return self.module

    def __repr__(self) -> str:
        return f"<TunedConvs: {len(self.routed)} routed, {len(self.skipped)} skipped>"


def tune_convs(module: torch.nn.Module, db=None, workspace_cap=None) -> TunedConvs:
    """Routes every ``nn.Conv2d`` of `module` (diffusers' conv subclasses too) through the tuned op.

    Args:
        db: tuning records file; None: ``SHAPECACHE_TUNING_DB`` or ``~/.cache/shapecache/tuning.json``;
            False: keep records in memory only. New records are written after each forward
            that tuned something, and at exit.
        workspace_cap: the most workspace memory tuned algorithms may use on each device of
            the module (bytes, or a string such as "256MiB"); None leaves the cap as it is.

    Returns:
        A TunedConvs handle; ``sc.uncached(handle)`` undoes the routing.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"tune_convs: expected an nn.Module, got {type(module).__name__}")
    if workspace_cap is not None:
        cap = parse_budget(workspace_cap, argument="workspace_cap")
        if cap.bytes is None:
            raise ValueError(f"workspace_cap={workspace_cap!r}: expected bytes (an int or a string such as '256MiB')")
        for device in {p.device for p in module.parameters()}:
            _C.set_workspace_cap(device, cap.bytes)
    database = open_db(db)

    routed, skipped = [], {}
    for name, conv in module.named_modules():
        if not isinstance(conv, torch.nn.Conv2d):
            continue
        reason = _why_not(conv)
        if reason:
            skipped[name] = reason
            continue
        conv._shapecache_padding = _numeric_padding(conv)
        conv.forward = types.MethodType(_tuned_forward, conv)
        routed.append(name)

    hook = None
    if database is not None:
        def flush_new_records(_module, _args, _output):
            if _C.tuning_has_unsaved() and _databases.get(database.path) is database:
                try:
                    database.flush()
                except OSError as error:  # the file went away or became unwritable: keep them in memory
                    _databases[database.path] = None
                    warnings.warn(f"shapecache: could not write tuning records to {database.path} ({error}); "
                                  "they are kept in memory for this process", RuntimeWarning, stacklevel=2)

        hook = module.register_forward_hook(flush_new_records)
    return TunedConvs(module, routed, skipped, hook)


def _tuned_forward(self, input, *args, **kwargs):
    # *args, **kwargs: diffusers' LoRACompatibleConv passes a LoRA `scale`, unused without a LoRA layer.
    unbatched = input.dim() == 3
    if unbatched:
        input = input.unsqueeze(0)
    out = torch.ops.shapecache.conv2d(input, self.weight, self.bias, list(self.stride), self._shapecache_padding,
                                      list(self.dilation), self.groups)
    return out.squeeze(0) if unbatched else out


def _why_not(conv: torch.nn.Conv2d) -> str:
    """Why `conv` cannot be routed ('' when it can)."""
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} (only 'zeros' is tuned)"
    if type(conv).forward is not torch.nn.Conv2d.forward:
        if type(conv).__name__ != "LoRACompatibleConv" or getattr(conv, "lora_layer", None) is not None:
            return f"{type(conv).__name__} has its own forward"
    if "forward" in conv.__dict__:
        return "its forward was replaced already"
    if _numeric_padding(conv) is None:
        return "padding='same' that is not symmetric"
    return ""


def _numeric_padding(conv: torch.nn.Conv2d):
    if conv.padding == "valid":
        return [0, 0]
    if conv.padding == "same":
        pads = []
        for kernel, dilation in zip(conv.kernel_size, conv.dilation, strict=True):
            total = dilation * (kernel - 1)
            if total % 2:
                return None
            pads.append(total // 2)
        return pads
    return list(conv.padding)
