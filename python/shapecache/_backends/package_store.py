"""The package store: frozen graphs on the CPU that one process compiled, loaded by every
process that traces the same program instead of compiled again; a cache layer around the
compilers (compilers.compile_on), as inductor's FX graph cache is around inductor.

Used where ``SHAPECACHE_SHARED_DIR`` is set (ray_serve's shared directory) and the route allows
a package (compilers.choose_route): the packages are in its ``packages/`` (``directory_in``).
``PackageStore.key`` is made from the build's saved program; ``lookup`` loads the package of
that key, in tens of milliseconds, with no compile (and the trace stays: the guards come from
it). Otherwise the build compiles by its route, and ``publish`` then stores the package: one
the process compiler made (a background build's, and an inline build's where a directory is
set) is copied in; for a graph compiled in this process (a background build under
SHAPECACHE_BACKGROUND_COMPILER=thread), the saved program is handed to the build workers as a
publication (shapecache/_background.py), which they compile in the compiler's process when
no build waits.

The key is what makes the package's code and constants: the saved program (its graph and its
weights, read from the file, less what differs between two saves of one program: the call's
example inputs, the save's serialization id, and the source paths in the nodes' stack traces),
inductor's options and configuration, torch's version and build, the settings torch compiles
under (compile_settings.py: the default dtype, the thread count, determinism, the matmul
precisions), and the host (_host). A model whose weights changed makes another key. A key that cannot
be made is a ``Bypass``: the build goes on unstored.

A package is trusted only as far as it can be told who wrote it (package_trust.py): ``lookup``
loads a package from a directory and file that only this process's user can write, or, with a
deployment secret, one sealed under it; whose seal matches every byte (a package changed since
it was published is refused); and whose metadata names its key (each is compiled with the key
in ``aot_inductor.metadata``): never another user's library, nor a package of other weights
copied to a key's name. The checks and the load read a private copy of the file opened.

A package is copied in under a temporary name, sealed and renamed into place, so readers see a
whole file or none; one of its key that is there already is kept, unless it failed those checks or
did not load here. One that does not load here (a
library built against another host's C++ runtime, a noexec temporary directory) costs a
warning, and the build compiles it, then publishes over it. A directory that cannot be read or
written costs a warning, never a build. Each package holds a copy of the weights it reads: the
directory grows by about the model's size per size built (docs/ray-serve.md).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch

from shapecache import _background
from shapecache._backends import compile_process, disk_cache, package_trust
from shapecache._backends.compile_settings import CompileSettings
from shapecache._backends.compilers import CompiledGraph, NotForThisGraph
from shapecache._backends.entry import described
from shapecache._old_files import remove_old_files

logger = logging.getLogger("shapecache")

ENVIRONMENT = "SHAPECACHE_SHARED_DIR"
FORMAT = 3  # in every key: packages of another layout (3: sealed) are another key
KEY_METADATA = "shapecache_key"  # the package's metadata entry that names the key it was built for

_unloadable: set[str] = set()  # keys whose file in the directory did not load here: published over
_warned: set[tuple] = set()  # (directory, "read" or "write"): what was warned of about a directory, once


def directory_in(shared: Path) -> Path:
    """Where the packages are in the shared directory `shared`."""
    return shared / "packages"


class Bypass(Exception):
    """Why a build's package is neither looked up nor published (its key cannot be made)."""


class Refused(Exception):
    """Why a file in the directory is not read (the message): it cannot be trusted, is a link,
    or is not as it was sealed."""


class PackageStore:
    """The packages in one directory."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.unusable = ""  # why the deployment's secret cannot be used: nothing is shared
        try:
            self.secret = package_trust.secret()  # None: packages are trusted by owner (package_trust.py)
        except package_trust.SecretUnusable as unusable:
            self.secret, self.unusable = None, str(unusable)

    @classmethod
    def from_environment(cls) -> PackageStore | None:
        """The store of ``$SHAPECACHE_SHARED_DIR/packages``; None where the variable is not set."""
        shared = os.environ.get(ENVIRONMENT)
        return cls(directory_in(Path(shared).expanduser())) if shared else None

    def key(self, saved: compile_process.SavedProgram, options: dict) -> str:
        """The key of `saved` compiled with inductor `options`. Raises Bypass, also where the
        deployment's secret is set but cannot be used."""
        if self.unusable:
            raise Bypass(self.unusable)
        try:
            return key(saved.path(), options)
        except Exception as error:  # noqa: BLE001  (a shared directory is never worth a build)
            raise Bypass(described(error)) from error

    @staticmethod
    def log_bypass(bypass: Bypass) -> None:
        logger.warning("shapecache: a graph is not shared (%s)", bypass)

    def lookup(self, key: str) -> CompiledGraph | None:
        """The package of `key`, loaded, where it can be trusted and is as it was sealed
        (sealed_copy), and was built for this key (its metadata names the key: a package of
        another program or other weights, copied or renamed to this key's name, is not). None
        where the directory has none, or one that fails (with a warning: it is published over)."""
        found = self.directory / f"{key}.pt2"
        try:
            copy = self.sealed_copy(found.name, "shared package")
        except Refused as refused:
            logger.warning("shapecache: the shared package %s is not loaded: %s; the graph is compiled here "
                           "and published in its place", found, refused)
            _unloadable.add(key)
            return None
        if copy is None:
            return None
        try:
            with open(copy, "rb") as package_file:
                why = _not_built_for(key, package_file)
            if why is not None:
                logger.warning("shapecache: the shared package %s is not loaded: %s; the graph is compiled here "
                               "and published in its place", found, why)
                _unloadable.add(key)
                return None
            package = compile_process.load(copy)
        except OSError as error:  # a file that cannot be read (a full disk): a miss
            logger.warning("shapecache: the shared package %s cannot be read (%s)", found, error)
            return None
        except compile_process.Failed as failure:
            logger.warning("shapecache: the shared package %s does not load (%s); the graph is compiled and the "
                           "package published again", found, failure)
            _unloadable.add(key)
            return None
        finally:
            removed(copy)
        disk_cache.note_shared_package_loaded()
        return CompiledGraph(package, [], package.constant_bytes, package=str(found))

    def sealed_copy(self, name: str, what: str, max_bytes: int | None = None) -> str | None:
        """A copy, in a file of this process's own (the caller removes it), of the file `name` in
        the directory, where it can be trusted (package_trust.py: its directory and file only
        this process's user can write, or a seal under the deployment's secret) and is as it
        was sealed. The file is opened in the directory checked and copied from that
        descriptor: a file swapped in or rewritten meanwhile is never what is read. None where
        the directory has none, or it cannot be read (logged, `what` naming it), and for every file
        where the deployment's secret is set but cannot be used (logged once). Raises Refused
        where it cannot be trusted, is a link, is larger than `max_bytes`, or is not as sealed."""
        found = self.directory / name
        if self.unusable:  # the deployment's secret cannot be used: nothing is shared, records neither
            _warn_once(self.directory, "read", f"the shared packages in {self.directory} are not read: {self.unusable}")
            return None
        try:
            directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        except OSError as error:
            _warn_once(self.directory, "read", f"the shared packages in {self.directory} cannot be read ({error})")
            return None
        try:
            if (why := package_trust.untrusted_directory(os.fstat(directory), self.secret)) is not None:
                _warn_once(self.directory, "read", f"the shared packages in {self.directory} are not loaded: {why}")
                return None
            # (O_NONBLOCK: a FIFO planted there would block the open.)
            opened = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=directory)
        except FileNotFoundError:
            return None
        except OSError as error:  # a file this process may not read, a link: a miss
            if error.errno == errno.ELOOP:
                raise Refused(f"it is a link, which cannot be read ({error})") from error
            logger.warning("shapecache: the %s %s cannot be read (%s)", what, found, error)
            return None
        finally:
            os.close(directory)
        copy = None
        try:
            status = os.fstat(opened)
            if (why := package_trust.untrusted_file(status, self.secret)) is not None:
                raise Refused(why)
            if max_bytes is not None and status.st_size > max_bytes:
                raise Refused(f"it holds {status.st_size} bytes; at most {max_bytes} are read")
            copy = _private_copy(opened)
            with open(copy, "rb") as copied:
                if (why := _unsealed(copied, self.secret)) is not None:
                    raise Refused(why)
        except OSError as error:  # a file that cannot be read or copied (a full disk): a miss
            logger.warning("shapecache: the %s %s cannot be read (%s)", what, found, error)
            removed(copy)
            copy = None
        except BaseException:
            removed(copy)
            raise
        finally:
            os.close(opened)
        return copy

    @staticmethod
    def stamped(options: dict, key: str) -> dict:
        """Inductor's `options` for the package of `key`: its metadata names the key (lookup)."""
        return {**options, "aot_inductor.metadata": {KEY_METADATA: key}}

    def publish(self, key: str, compiled: CompiledGraph, saved: compile_process.SavedProgram, options: dict,
                owner) -> None:
        """Stores `compiled`, the graph of `saved` under `key`: its package where it is one, else
        `saved` is handed to the build workers, which compile it in the compiler's process when no
        build waits (``sc.wait`` on `owner`, the cached function, waits for it). Dropped where
        the directory cannot be written or the workers have enough waiting."""
        if compiled.package is not None:
            if writable(self.directory, self.secret):
                copy_in(key, compiled.package, self.directory, self.secret)
        elif writable(self.directory, self.secret):
            _background.publish_later(torch.device("cpu"), _Publication(saved.hand_over(), key, options, self, owner))


def removed(path: str | None) -> None:
    """Removes the file at `path`, where there is one."""
    if path is not None:
        with contextlib.suppress(OSError):
            os.remove(path)


def _private_copy(opened: int) -> str:
    """A copy of the file open as `opened`, in a file of this process's own (0600, in the
    temporary directory), whose path this returns; the caller removes it. Raises OSError."""
    descriptor, path = tempfile.mkstemp(prefix="shapecache-package-", suffix=".pt2")
    try:
        with os.fdopen(descriptor, "wb") as copy, open(opened, "rb", closefd=False) as source:
            shutil.copyfileobj(source, copy)
    except BaseException:
        os.remove(path)
        raise
    return path


def _unsealed(package_file, secret: bytes | None) -> str | None:
    """Why the package in `package_file` is not as its publisher sealed it (package_trust.unsealed)."""
    try:
        return package_trust.unsealed(package_file, secret)
    except (OSError, ValueError) as error:
        return f"its seal cannot be read ({error})"


def _not_built_for(key: str, package_file) -> str | None:
    """Why the package in `package_file` is not `key`'s: its metadata names another key, or
    none; None where it names `key`. Raises compile_process.Failed where it is no package."""
    try:
        with zipfile.ZipFile(package_file) as archive:
            names = [n for n in archive.namelist() if n.endswith("_metadata.json")]
            built_for = {json.loads(archive.read(n)).get(KEY_METADATA) for n in names}
    except Exception as error:  # noqa: BLE001  (a damaged archive: zipfile's and json's failures share no base class)
        raise compile_process.Failed(described(error)) from error
    if built_for != {key}:
        return "it was built for another program or other weights (its metadata names another key)"
    return None


def key(saved: str, options: dict) -> str:
    """The key of the program saved in `saved` (compile_process.save) compiled with `options`.
    Raises OSError, zipfile.BadZipFile or ValueError where the saved program cannot be read."""
    digest = hashlib.sha256()
    digest.update(json.dumps(setting(options), sort_keys=True, default=repr).encode())
    with zipfile.ZipFile(os.path.join(saved, compile_process.PROGRAM)) as archive:
        # Each member under the archive's own folder, whose name is the file's.
        members = sorted((info.filename.split("/", 1)[-1], info) for info in archive.infolist())
        for name, info in members:
            if name.startswith("data/sample_inputs/") or name == ".data/serialization_id":
                continue
            digest.update(f"{name}\0".encode())
            if name.startswith("models/") and name.endswith(".json"):
                digest.update(_without_sources(archive.read(info)))
                continue
            with archive.open(info) as member:
                while chunk := member.read(1 << 20):
                    digest.update(chunk)
    return digest.hexdigest()


def setting(options: dict) -> dict:
    """What a package of a program compiled with inductor `options` depends on besides the
    program: the layout, torch's version and build, the settings torch compiles under, the
    host, the options and inductor's configuration (in every key, and every call id:
    call_index.py)."""
    return {"format": FORMAT, "torch": torch.__version__, "torch build": torch.version.git_version,
            "settings": CompileSettings.of_this_thread().as_json(),
            "host": _host(), "options": {**options, "freezing": True}, "inductor": _inductor_config()}


def _without_sources(graph: bytes) -> bytes:
    """The serialized graph without its nodes' stack traces, which name the files of the model's,
    shapecache's and torch's code by absolute path: replicas installed in other places (a Ray
    runtime_env, another node) trace the same program."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "stack_trace"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return json.dumps(strip(json.loads(graph)), sort_keys=True).encode()


def _inductor_config() -> dict:
    """Inductor's configuration as this process set it, less what does not change the code
    (torch's own selection for its FX graph cache key). The compiler's process is given the
    build's options and freezing only: a package is read where the configuration is the one it
    was published under."""
    from torch._inductor import config as inductor_config

    return inductor_config.save_config_portable()


@functools.cache
def _host() -> str:
    """What a package's library depends on besides the program: the machine, the instructions the
    kernels may use (ATen's vector capability and the CPU's feature flags, "flags" on x86 and
    "Features" on ARM; inductor compiles for the host's CPU), the C library, and the C++
    compiler asked for (CXX). (Inductor's own choice, cpu_vec_isa.pick_vec_isa, compiles probes:
    a second a process.)"""
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        flags = next((line.split(":", 1)[1] for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    # The instruction sets only: the rest of the line (hypervisor, microcode mitigations) varies
    # between otherwise identical nodes.
    isa = sorted(flag for flag in flags.split() if flag.startswith(_INSTRUCTION_SETS))
    return " ".join((platform.machine(), str(torch.backends.cpu.get_cpu_capability()),
                     hashlib.sha256(" ".join(isa).encode()).hexdigest()[:16], "-".join(platform.libc_ver()),
                     os.environ.get("CXX", "")))


_INSTRUCTION_SETS = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "popcnt", "lzcnt", "abm", "movbe", "aes",
                     "pclmul", "vpclmul", "vaes", "gfni", "sha", "adx", "asimd", "fp", "sve", "i8mm", "bf16",
                     "dotprod", "atomics", "neon")


def copy_in(key: str, package: str, target: Path, secret: bytes | None = None) -> None:
    """Copies the package at `package` into `target` as `key`'s (place), unless a package of
    `key` that loaded is there already. A failure (a full disk, a directory that cannot be
    written, a package that is no zip archive) is logged, never raised: the entry is built
    either way."""
    try:
        if key not in _unloadable and (target / f"{key}.pt2").is_file():
            return  # another process's: replacing it could fail a reader on a network file system
        place(f"{key}.pt2", package, target, secret)
        _unloadable.discard(key)
    except (OSError, ValueError) as error:
        logger.warning("shapecache: a package could not be shared through %s (%s)", target, error)


def place(name: str, source: str, target: Path, secret: bytes | None = None) -> None:
    """Copies the zip archive at `source` into `target` as `name`: under a temporary name,
    sealed (under `secret` where given, package_trust.seal), written to disk (fsync) before it
    is renamed into place, so that a reader, or a crash, sees the whole file or none. The file
    is its owner's alone (0600; with a `secret`, its group's too: 0640): a package holds a copy
    of the weights. Raises OSError, or ValueError where `source` is no zip archive."""
    target.mkdir(mode=0o755, parents=True, exist_ok=True)  # (never writable by others, whatever the umask)
    remove_old_files(target, ((f".*{_COPYING}", _ABANDONED_AFTER_S),))
    descriptor, temporary = tempfile.mkstemp(dir=target, prefix=f".{name}.", suffix=_COPYING)  # (0600)
    if secret is not None:  # shared between users on purpose: its group reads it too
        os.fchmod(descriptor, 0o640)
    try:
        with os.fdopen(descriptor, "w+b") as copy, open(source, "rb") as original:
            shutil.copyfileobj(original, copy)
            package_trust.seal(copy, secret)
            os.fsync(copy.fileno())
        os.replace(temporary, target / name)
        with contextlib.suppress(OSError):  # the rename itself, on a file system that needs it
            directory = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)


_COPYING = ".tmp"  # the suffix of a package being copied in
_ABANDONED_AFTER_S = 3600  # how old a copy is before it counts as a killed publisher's (each holds up to a copy of the weights)


class _Publication(_background.Publication):
    """A saved program whose package the directory lacks, compiled in the compiler's process by a
    build worker and copied in (unless another process published it meanwhile)."""

    def __init__(self, saved: str, key: str, options: dict, store: PackageStore, owner):
        self.saved, self.key, self.options, self.store, self.owner = saved, key, options, store, owner
        self.settings = CompileSettings.of_this_thread()  # as the key has them

    def run(self) -> None:
        target = self.store.directory
        try:
            if compile_process.PROCESS.failed:  # packages crash this machine's processes: none is made
                return
            if self.key in _unloadable or not (target / f"{self.key}.pt2").is_file():
                copy_in(self.key, compile_process.compile_saved(self.saved, PackageStore.stamped(self.options, self.key),
                                                                self.settings), target, self.store.secret)
        except NotForThisGraph:
            pass  # the graph writes what it reads: it is compiled in each process
        except _background.Exiting:
            raise
        except Exception as error:  # noqa: BLE001  (Failed, a directory gone: the next program is still published)
            logger.warning("shapecache: compiling a package to share failed (%s)", error)
        finally:
            self.drop()

    def drop(self) -> None:
        shutil.rmtree(self.saved, ignore_errors=True)


def writable(target: Path, secret: bytes | None) -> bool:
    """Whether packages can be published to `target` (made where missing): checked before the
    compile a publication costs. A directory that cannot be written, or whose packages no
    process would load (package_trust.untrusted_directory), is logged once."""
    try:
        target.mkdir(mode=0o755, parents=True, exist_ok=True)
        error = package_trust.untrusted_directory(target.stat(), secret)
        if error is None:
            if os.access(target, os.W_OK | os.X_OK):
                return True
            error = "not writable"
    except OSError as failure:
        error = str(failure)
    _warn_once(target, "write", f"packages could not be shared through {target} ({error})")
    return False


def _warn_once(directory: Path, what: str, message: str) -> None:
    """Logs `message` about `what` ("read", "write") of `directory`, the first time only."""
    if (directory, what) not in _warned:
        _warned.add((directory, what))
        logger.warning("shapecache: %s", message)
