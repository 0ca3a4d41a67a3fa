"""A bucket's graph compiled in a process of its own: how a background build on the CPU keeps
the compiler off the serving threads' GIL.

Inductor's lowering and code generation are Python that holds the GIL for most of a build (a
minute for a UNet on the CPU); every operator a serving thread calls releases the GIL and then
waits to get it back, so calls served meanwhile stall for seconds (docs/background-builds.md).
So the worker does here only what needs the live model: ``torch.export`` traces the call (a
few seconds; the guards come from that trace, exported.py). It saves the exported program, and
a new Python process (``python -m shapecache._backends.compile_process``, started by the
worker, so at its lower priority) compiles it with AOTInductor into a package, whose kernels
and frozen weights this process then loads: in tens of milliseconds, with no Python of the
compiler's run here.

Used where the graph is one that inductor's freezing makes (``freezing`` on, grad off): its
weights are the graph's own constants, copied into the package, as an in-process frozen entry
holds a copy. (Without freezing the graph reads the model's weights where they are, which a
package of copies would not.) Anything else, or any failure of this route, compiles in this
process as before, with one warning per reason.

The package's process never touches the model: it reads the saved program only. It ends with
this process (it watches its standard input, which only this process holds open), and does not
get the terminal's Ctrl-C (a process group of its own). At interpreter exit the compilers still
running are stopped (``stop_all``) rather than waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import zipfile

import torch

ENVIRONMENT = "SHAPECACHE_BACKGROUND_COMPILER"  # "thread": background builds compile in the serving process

# The package keeps the constants in a file beside the library, which the loader reads into
# memory: the library itself is never unloaded (glibc keeps it mapped after the loader goes),
# and with the constants inside it the weights' pages would stay mapped with it.
_PACKAGE_OPTIONS = {"aot_inductor.package_constants_in_so": False,
                    "aot_inductor.package_constants_on_disk_format": "binary_blob"}

_lock = threading.Lock()
_running: set[subprocess.Popen] = set()
_stopping = False


class Failed(Exception):
    """The compiler's process did not make a package (its last error line is the message)."""


class Stopped(Exception):
    """The process is exiting; the compile was stopped and nothing is to be built."""


class Package:
    """A loaded package: the graph over the call's tensors, and the bytes of its constants."""

    def __init__(self, loaded, constant_bytes: int):
        self._run = loaded.loader.run
        self.constant_bytes = constant_bytes
        self._loaded = loaded  # its library and constants live as long as this object

    def __call__(self, *tensors):
        return self._run(tensors)


def usable(options: dict, device: torch.device, in_background: bool) -> bool:
    """Whether a build with inductor `options` compiles in a process of its own: one in the
    background, on the CPU, of a frozen graph, unless ``SHAPECACHE_BACKGROUND_COMPILER=thread``."""
    from torch._inductor import config as inductor_config

    if not in_background or device.type != "cpu" or os.environ.get(ENVIRONMENT, "").strip().lower() == "thread":
        return False  # (a value other than the two was refused when the cached object was made: where())
    if not options.get("freezing", inductor_config.freezing) or torch.is_grad_enabled():
        return False
    try:
        json.dumps(options)  # the compiler's process reads them as JSON
    except (TypeError, ValueError):
        return False
    return True


def where() -> str:
    """Where background builds compile, as ``SHAPECACHE_BACKGROUND_COMPILER`` says: "process"
    (unset, the default) or "thread"; anything else is a ValueError naming the variable."""
    value = os.environ.get(ENVIRONMENT, "process").strip().lower() or "process"
    if value not in ("process", "thread"):
        raise ValueError(f"{ENVIRONMENT}={os.environ[ENVIRONMENT]!r}: expected 'process' (a background build "
                         "compiles in a process of its own) or 'thread' (in the serving process)")
    return value


def compile_elsewhere(program, options: dict) -> Package:
    """`program` (an ExportedProgram) compiled by AOTInductor in a new process, loaded here.
    Raises Failed where that process failed, Stopped where the interpreter is exiting."""
    with tempfile.TemporaryDirectory(prefix="shapecache-build-") as directory:
        saved, package = os.path.join(directory, "program.pt2"), os.path.join(directory, "package.pt2")
        torch.export.save(program, saved)
        command = [sys.executable, "-m", "shapecache._backends.compile_process", saved, package, json.dumps(options)]
        with _lock:
            if _stopping:
                raise Stopped
            # A process group of its own, not a session: the terminal's Ctrl-C is not sent to it,
            # and it shares the scheduler's group (autogroup: one per session) with the serving
            # process, inside which its lower priority counts; in a group of its own it would
            # take a fair half of the CPU whatever its priority.
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, process_group=0)
            _running.add(process)
        try:
            errors = process.stderr.read()  # until the process ends (stdin stays open: see _exit_with_parent)
            process.wait()
        finally:
            with _lock:
                _running.discard(process)
            process.stdin.close()
            process.stderr.close()
        if _stopping:
            raise Stopped
        if process.returncode != 0:
            lines = [line for line in errors.decode(errors="replace").splitlines() if line.strip()]
            raise Failed(lines[-1] if lines else f"exit status {process.returncode}")
        with zipfile.ZipFile(package) as archive:
            blobs = {os.path.basename(i.filename): i.file_size for i in archive.infolist()
                     if i.filename.endswith("_weights.blob")}
        # The loader extracts the package to a directory of its own, removed when it is freed,
        # and reads the constants into memory: their file is removed at once (in a temporary
        # directory on tmpfs, a second copy of the weights in memory for the entry's life).
        loaded = torch._inductor.aoti_load_package(package)
        _remove_extracted(blobs)
        return Package(loaded, sum(blobs.values()))


def _remove_extracted(blobs) -> None:
    """Removes the constants files named `blobs` that the loader extracted beside the library it
    loaded, which /proc/self/maps names (nothing where there is none: not Linux)."""
    libraries = {name.removesuffix("_weights.blob") + ".so" for name in blobs}
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if line.rstrip().endswith(".so")}
    except OSError:
        return
    for path in paths:
        if os.path.basename(path) in libraries:
            blob = path.removesuffix(".so") + "_weights.blob"
            with contextlib.suppress(OSError):
                os.remove(blob)


def stop_all() -> None:
    """Stops the compilers running, for good: the interpreter is exiting."""
    global _stopping
    with _lock:
        _stopping = True
        for process in _running:
            process.kill()


def _exit_with_parent() -> None:
    """Ends this process when the one that started it ends: its end closes our stdin. (A read
    of the file descriptor itself: a daemon thread inside sys.stdin's buffered reader would
    hold its lock at interpreter exit, which is fatal.)"""
    while os.read(0, 1 << 12):
        pass
    os._exit(1)


def _compile(saved: str, package: str, options: dict) -> None:
    program = torch.export.load(saved)
    with torch.no_grad():  # freezing applies to graphs compiled without grad (compile_fx)
        torch._inductor.aoti_compile_and_package(program, package_path=package,
                                                 inductor_configs={**options, **_PACKAGE_OPTIONS})


if __name__ == "__main__":
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    _compile(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
