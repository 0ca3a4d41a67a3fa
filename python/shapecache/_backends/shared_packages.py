"""Packages shared through a directory: a frozen graph on the CPU that one process compiled is
loaded by every process that traces the same program, instead of compiled again.

Used where ``SHAPECACHE_SHARED_DIR`` is set (ray_serve's shared directory): the packages are in
its ``packages/``. A frozen build (compile_process.packable) saves its exported program and
looks for the package of its key there: one found is loaded, in tens of milliseconds, with no
compile (and the trace stays: the guards come from it). Otherwise the build compiles as it
would without the directory, and the package is then published: a background build through
the compiler's process already made it (it is copied in); a build that compiled in this
process hands its saved program, once that compile is done, to the publisher, a thread that
runs the compiler's process on it at the build workers' lower priority.

The key is what makes the package's code and constants: the saved program (its graph and its
weights, read from the file, less what differs between two saves of one program: the call's
example inputs, the save's serialization id, and the source paths in the nodes' stack traces),
inductor's options and configuration, torch's version, the thread count, and the host (_host).
A model whose weights changed makes another key; a package is never read for weights it was
not built from.

A package is copied in under a temporary name and renamed into place, so readers see a whole
file or none; one of its key that is there already is kept. One that does not load here (a
library built against another host's C++ runtime, a noexec temporary directory) costs a
warning, and the build compiles it, then publishes over it. A directory that cannot be read or
written costs a warning, never a build. Each package holds a copy of the weights it reads: the
directory grows by about the model's size per size built (docs/ray-serve.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import threading
import zipfile
from pathlib import Path

import torch

from shapecache._backends import compile_process
from shapecache._build_workers import lower_priority

logger = logging.getLogger("shapecache")

ENVIRONMENT = "SHAPECACHE_SHARED_DIR"
FORMAT = 1  # in every key: packages of another layout are another key
MAX_WAITING = 4  # saved programs waiting for the publisher (each a copy of the weights on disk)

_lock = threading.Condition()
_waiting: list[tuple] = []  # (saved program's directory, key, options, threads, the packages' directory)
_publishing: set[str] = set()  # keys waiting or being compiled
_publisher: threading.Thread | None = None
_closing = False  # the interpreter is exiting: nothing more is published
_loaded_here = 0  # packages this process loaded from the directory
_unloadable: set[str] = set()  # keys whose file in the directory did not load here: published over
_unwritable: set[Path] = set()  # directories found not writable (warned of once)


def directory() -> Path | None:
    """``$SHAPECACHE_SHARED_DIR/packages``, where the variable is set."""
    shared = os.environ.get(ENVIRONMENT)
    return Path(shared).expanduser() / "packages" if shared else None


def key(saved: str, options: dict) -> str:
    """The key of the program saved in `saved` (compile_process.save) compiled with `options`.
    Raises compile_process.Failed where the saved program cannot be read."""
    digest = hashlib.sha256()
    setting = {"format": FORMAT, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "host": _host(), "options": {**options, "freezing": True}, "inductor": _inductor_config()}
    digest.update(json.dumps(setting, sort_keys=True, default=repr).encode())
    try:
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
    except (OSError, zipfile.BadZipFile, ValueError) as error:
        raise compile_process.Failed(f"the saved program cannot be read: {error}") from error
    return digest.hexdigest()


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


def load(key: str) -> compile_process.Package | None:
    """The package of `key` loaded from the directory; None where it has none, or one that does
    not load (with a warning)."""
    global _loaded_here
    found = directory() / f"{key}.pt2"
    try:
        if not found.is_file():
            return None
    except OSError as error:  # a directory this process may not read: a miss
        logger.warning("shapecache: the shared packages in %s cannot be read (%s)", found.parent, error)
        return None
    try:
        package = compile_process.load(str(found))
    except compile_process.Failed as failure:
        logger.warning("shapecache: the shared package %s does not load (%s); the graph is compiled and the package "
                       "published again", found, failure)
        with _lock:
            _unloadable.add(key)
        return None
    with _lock:
        _loaded_here += 1
    return package


def loaded_count() -> int:
    """How many packages this process loaded from the directory."""
    return _loaded_here


def publish(key: str, package: str, target: Path | None = None) -> None:
    """Copies the package at `package` into the directory (`target`, default directory()) as
    `key`'s, unless a package of `key` that loaded is there already. A failure (a full disk, a
    directory that cannot be written) is logged, never raised: the entry is built either way."""
    target = directory() if target is None else target
    try:
        if key not in _unloadable and (target / f"{key}.pt2").is_file():
            return  # another process's: replacing it could fail a reader on a network file system
        target.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=target, prefix=f".{key}.", suffix=".tmp")
        os.close(descriptor)
        try:
            shutil.copyfile(package, temporary)
            os.chmod(temporary, 0o644)  # (mkstemp's file is its owner's alone) readable by every replica's user
            os.replace(temporary, target / f"{key}.pt2")
            _unloadable.discard(key)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)
    except OSError as error:
        logger.warning("shapecache: a package could not be shared through %s (%s)", target, error)


class Publication:
    """A saved program (compile_process.save) whose package the directory lacks, held until this
    process has compiled it: then handed to the publisher (hand_over), or, where that compile
    failed, removed (drop). The publisher's compile starts after this process's, not beside it."""

    def __init__(self, saved: str, key: str, options: dict):
        self.saved, self.key, self.options = saved, key, options
        self.threads = torch.get_num_threads()  # as the key has it

    def hand_over(self) -> None:
        publish_later(self.saved, self.key, self.options, self.threads)

    def drop(self) -> None:
        shutil.rmtree(self.saved, ignore_errors=True)


def publish_later(saved: str, key: str, options: dict, threads: int) -> None:
    """Hands the program saved in `saved` to the publisher, which compiles it in the compiler's
    process and publishes it, then removes `saved`. Removed at once where its key is waiting or
    being compiled already, or MAX_WAITING programs wait (a later build of the size publishes it)."""
    global _publisher
    with _lock:
        target = directory()
        if (key in _publishing or len(_waiting) >= MAX_WAITING or _closing or target is None
                or not _writable(target)):
            shutil.rmtree(saved, ignore_errors=True)
            return
        _publishing.add(key)
        _waiting.append((saved, key, options, threads, target))
        if _publisher is None or not _publisher.is_alive():
            _publisher = threading.Thread(target=_publish_waiting, name="shapecache-publisher", daemon=True)
            _publisher.start()
        _lock.notify_all()


def _writable(target: Path) -> bool:
    """Whether packages can be published to `target` (made where missing): checked before the
    compile a publication costs; a directory that cannot be written is logged once."""
    try:
        target.mkdir(parents=True, exist_ok=True)
        if os.access(target, os.W_OK | os.X_OK):
            return True
        error = "not writable"
    except OSError as failure:
        error = str(failure)
    if target not in _unwritable:
        _unwritable.add(target)
        logger.warning("shapecache: packages could not be shared through %s (%s)", target, error)
    return False


def wait(timeout: float | None = None) -> bool:
    """Waits until the publisher has nothing waiting or compiling; False where `timeout` seconds
    passed first."""
    with _lock:
        return _lock.wait_for(lambda: not _publishing, timeout)


def close(timeout: float = 10.0) -> None:
    """Removes the saved programs that wait for the publisher and waits up to `timeout` seconds
    for it to remove the one it compiles: the interpreter is exiting (compile_process.stop_all
    stopped that compile already)."""
    global _closing
    with _lock:
        _closing = True
        for saved, key, *_ in _waiting:
            shutil.rmtree(saved, ignore_errors=True)
            _publishing.discard(key)
        _waiting.clear()
        _lock.notify_all()
        publisher = _publisher
    if publisher is not None:
        publisher.join(timeout)


def _publish_waiting() -> None:
    lower_priority()  # its compiler's process takes what the serving threads leave
    while True:
        with _lock:
            _lock.wait_for(lambda: _waiting or _closing)
            if _closing:
                return
            saved, key, options, threads, target = _waiting.pop(0)
        try:
            # (Unless another process published it meanwhile.)
            if key in _unloadable or not (target / f"{key}.pt2").is_file():
                publish(key, compile_process.compile_saved(saved, options, threads), target)
        except compile_process.Unsuitable:
            pass  # the graph writes what it reads: it is compiled in each process
        except compile_process.Stopped:
            pass
        except Exception as error:  # noqa: BLE001  (Failed, a directory gone: the next program is still published)
            logger.warning("shapecache: compiling a package to share failed (%s)", error)
        finally:
            shutil.rmtree(saved, ignore_errors=True)
            with _lock:
                _publishing.discard(key)
                _lock.notify_all()


def _forget_parents_publisher() -> None:
    # A forked child has no publisher; the programs waiting are the parent's to remove.
    global _lock, _waiting, _publishing, _publisher, _closing
    _lock, _waiting, _publishing, _publisher, _closing = threading.Condition(), [], set(), None, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_publisher)
