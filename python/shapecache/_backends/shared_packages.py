"""Packages shared through a directory: a frozen graph on the CPU that one process compiled is
loaded by every process that traces the same program, instead of compiled again.

On where ``SHAPECACHE_SHARED_DIR`` is set (ray_serve's shared directory): the packages are in
its ``packages/``. A frozen build (compile_process.packable) saves its exported program and
looks for the package of its key there: one found is loaded, in tens of milliseconds, with no
compile (and the trace stays: the guards come from it). Otherwise the build compiles as it
would without the directory, and the package is then published: a background build through
the compiler's process already made it (it is copied in); an inline build, which compiled in
this process, leaves its saved program to the publisher, a thread that runs the compiler's
process on it at the build workers' lower priority, after the entry serves.

The key is what makes the package's code and constants: the saved program (its graph and its
weights, read from the file, less what differs between two saves of one program: the call's
example inputs and the save's random id), inductor's options, torch's version, the thread
count and the vector instructions the kernels are generated for. A model whose weights
changed makes another key; a package is never read for weights it was not built from.

A package is copied in under a temporary name and renamed into place, so readers see a whole
file or none, and two processes publishing one key each write a whole file. One that does not
load (cut short by a full disk, made by another build of torch) costs a warning, and the build
compiles it, then publishes over it. Each package holds a copy of the weights it reads: the
directory grows by about the model's size per size built (docs/ray-serve.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
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
_waiting: list[tuple[str, str, dict, int]] = []  # (saved program's directory, key, options, threads)
_publishing: set[str] = set()  # keys waiting or being compiled
_publisher: threading.Thread | None = None
_closing = False  # the interpreter is exiting: nothing more is published
_loaded_here = 0  # packages this process loaded from the directory
_unloadable: set[str] = set()  # keys whose file in the directory did not load here: published over


def directory() -> Path | None:
    """``$SHAPECACHE_SHARED_DIR/packages``, where the variable is set."""
    shared = os.environ.get(ENVIRONMENT)
    return Path(shared).expanduser() / "packages" if shared else None


def key(saved: str, options: dict) -> str:
    """The key of the program saved in `saved` (compile_process.save) compiled with `options`.
    Raises compile_process.Failed where the saved program cannot be read."""
    digest = hashlib.sha256()
    setting = {"format": FORMAT, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "cpu": _cpu(), "options": {**options, "freezing": True}}
    digest.update(json.dumps(setting, sort_keys=True).encode())
    try:
        with zipfile.ZipFile(os.path.join(saved, compile_process.PROGRAM)) as archive:
            # Each member under the archive's own folder, whose name is the file's.
            members = sorted((info.filename.split("/", 1)[-1], info) for info in archive.infolist())
            for name, info in members:
                if name.startswith("data/sample_inputs/") or name == ".data/serialization_id":
                    continue
                digest.update(f"{name}\0{info.file_size}\0".encode())
                with archive.open(info) as member:
                    while chunk := member.read(1 << 20):
                        digest.update(chunk)
    except (OSError, zipfile.BadZipFile) as error:
        raise compile_process.Failed(f"the saved program cannot be read: {error}") from error
    return digest.hexdigest()


@functools.cache
def _cpu() -> str:
    """The instructions the kernels may use: ATen's vector capability and the CPU's feature flags
    (inductor's own choice, cpu_vec_isa.pick_vec_isa, compiles probes: a second a process)."""
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        flags = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("flags")), "")
    return f"{torch.backends.cpu.get_cpu_capability()} {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def load(key: str) -> compile_process.Package | None:
    """The package of `key` loaded from the directory; None where it has none, or one that does
    not load (with a warning)."""
    global _loaded_here
    found = directory() / f"{key}.pt2"
    if not found.is_file():
        return None
    try:
        package = compile_process.load(str(found))
    except compile_process.Failed as failure:
        logger.warning("shapecache: the shared package %s does not load (%s); the graph is compiled again", found, failure)
        with _lock:
            _unloadable.add(key)
        return None
    with _lock:
        _loaded_here += 1
    return package


def loaded_count() -> int:
    """How many packages this process loaded from the directory."""
    return _loaded_here


def publish(key: str, package: str) -> None:
    """Copies the package at `package` into the directory as `key`'s. A failure (a full disk, a
    directory that cannot be written) is logged, never raised: the entry is built either way."""
    target = directory()
    try:
        target.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=target, prefix=f".{key}.", suffix=".tmp")
        os.close(descriptor)
        try:
            shutil.copyfile(package, temporary)
            os.chmod(temporary, 0o644)  # (mkstemp's file is its owner's alone) readable by every replica's user
            os.replace(temporary, target / f"{key}.pt2")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)
    except OSError as error:
        logger.warning("shapecache: a package could not be shared through %s (%s)", target, error)


def publish_later(saved: str, key: str, options: dict) -> None:
    """Hands the program saved in `saved` to the publisher, which compiles it in the compiler's
    process and publishes it, then removes `saved`. Removed at once where its key is waiting or
    being compiled already, or MAX_WAITING programs wait (a later build of the size publishes it)."""
    global _publisher
    with _lock:
        if key in _publishing or len(_waiting) >= MAX_WAITING or _closing:
            shutil.rmtree(saved, ignore_errors=True)
            return
        _publishing.add(key)
        _waiting.append((saved, key, options, torch.get_num_threads()))  # as the key has it
        if _publisher is None:
            _publisher = threading.Thread(target=_publish_waiting, name="shapecache-publisher", daemon=True)
            _publisher.start()
        _lock.notify_all()


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
        for saved, key, _, _ in _waiting:
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
            saved, key, options, threads = _waiting.pop(0)
        try:
            # (Unless another process published it meanwhile.)
            if key in _unloadable or not (directory() / f"{key}.pt2").is_file():
                publish(key, compile_process.compile_saved(saved, options, threads))
                _unloadable.discard(key)
        except compile_process.Unsuitable:
            pass  # the graph writes what it reads: it is compiled in each process
        except compile_process.Failed as failure:
            logger.warning("shapecache: compiling a package to share failed (%s)", failure)
        except compile_process.Stopped:
            pass
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
