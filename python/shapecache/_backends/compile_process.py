"""A bucket's graph compiled in a process of its own: how a background build on the CPU keeps
the compiler off the serving threads' GIL.

Inductor's lowering and code generation are Python that holds the GIL for most of a build (a
minute for a UNet on the CPU); every operator a serving thread calls releases the GIL and then
waits to get it back, so calls served meanwhile stall for seconds (docs/background-builds.md).
So the worker does here only what needs the live model: ``torch.export`` traces the call (a
few seconds; the guards come from that trace, trace.py). It saves the exported program, and
a new Python process (``python -m shapecache._backends.compile_process``, started by the
worker, so at its lower priority) compiles it with AOTInductor into a package, whose kernels
and frozen weights this process then loads: in tens of milliseconds, with no Python of the
compiler's run here.

``ProcessCompiler`` is one of the compilers (compilers.py), chosen there for a background
build of a graph that inductor's freezing makes (``freezing`` on, grad off): its
weights are constants, and the package holds a copy of every one it reads (an in-process
frozen entry copies those freezing transforms and reads the rest where they are). Without
freezing the graph reads the model's weights where they are, which a package of copies would
not; a graph that writes what it reads (BatchNorm's statistics in training) would write the
package's copies (the compiler's process refuses it: NotForThisGraph); under autocast the
exported graph records no casts. Those compile in this process; so does a build this compiler
failed, with a warning, and every later build where the compiler's process cannot start or
crashed (a segmentation fault, an illegal instruction: ``failed``). The route costs a small
model time: every build starts Python and inductor again and compiles the graph as one C++
file (docs/background-builds.md).

The same steps (SavedProgram, compile_saved, load) make and read the packages that processes
share through a shared directory (package_store.py).

The package's process never touches the model: it reads the saved program only. It ends with
this process (it watches its standard input, which only this process holds open), and does not
get the terminal's Ctrl-C (a process group of its own). It is started through shapecache's
owner of background work (shapecache/_background.py), which stops it at interpreter exit
rather than waiting for it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile

import torch

from shapecache import _background
from shapecache._backends.compilers import CompiledGraph, CompilerFailed, NotForThisGraph
from shapecache._backends.entry import described

# The package keeps the constants in a file beside the library, which the loader reads into
# memory: the library itself is never unloaded (glibc keeps it mapped after the loader goes),
# and with the constants inside it the weights' pages would stay mapped with it.
_PACKAGE_OPTIONS = {"aot_inductor.package_constants_in_so": False,
                    "aot_inductor.package_constants_on_disk_format": "binary_blob"}

PROGRAM = "program.pt2"  # the saved program's name in its directory (save)
_UNSUITABLE = 3  # the compiler's exit status for a graph that writes what it reads (NotForThisGraph)
# The signals a crash of the process itself ends it with, as a package that cannot run here does.
_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGFPE}

class Failed(Exception):
    """Saving the program, the compiler's process or loading its package failed (the message
    is the error's first line, or the last line the process wrote)."""


class Package:
    """A loaded package: the graph over the call's tensors, and the bytes of its constants."""

    def __init__(self, loaded, constant_bytes: int):
        self._run = loaded.loader.run
        self.constant_bytes = constant_bytes
        self._loaded = loaded  # its library and constants live as long as this object

    def __call__(self, *tensors):
        return self._run(tensors)


class ProcessCompiler:
    """AOTInductor in a process of its own (compilers.py). `failed`: why the route cannot work in
    this process (its compiler could not start, or a package crashed it), where it cannot; the
    route is then not chosen again."""

    name = "process"

    def __init__(self):
        self.failed = ""

    def compile(self, traced, options: dict, saved: SavedProgram) -> CompiledGraph:
        try:
            path = compile_saved(saved.path(), options)
            package = load(path)
        except Failed as failure:
            where = ("this and later builds of the process compile in the serving process, where they slow"
                     if self.failed else "it compiles in the serving process, where it slows")
            raise CompilerFailed(f"compiling a background build in a process of its own failed ({failure}); {where} "
                                 "the calls served meanwhile") from failure
        return CompiledGraph(package, [], package.constant_bytes, package=path)


PROCESS = ProcessCompiler()


class SavedProgram:
    """An exported program saved to ``program.pt2`` in a new temporary directory, on first use
    (``path``): what a package is compiled from, and what its key is read from. Its owner removes
    it (``remove``), unless it was handed on (``hand_over``). Not a finalizer: a child forked
    meanwhile would remove it at its exit."""

    def __init__(self, program):
        self._program = program
        self._directory: str | None = None
        self._failed: Failed | None = None

    def path(self) -> str:
        """The directory it is saved in (saved now where it is not yet). Raises Failed, again for
        a program that could not be saved (it is not tried twice)."""
        if self._failed is not None:
            raise self._failed
        if self._directory is None:
            try:
                self._directory = save(self._program)
            except Failed as failure:
                self._failed = failure
                raise
            finally:
                self._program = None
        return self._directory

    def hand_over(self) -> str:
        """Its directory, now the caller's to remove."""
        directory, self._directory = self.path(), None
        return directory

    def remove(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None


def save(program) -> str:
    """`program` (an ExportedProgram) saved to ``program.pt2`` in a new temporary directory,
    whose path this returns; the caller removes it (not a finalizer: a child forked meanwhile
    would remove it at its exit). Raises Failed."""
    _remove_builds_of_dead_processes()
    directory = None
    try:
        directory = tempfile.mkdtemp(prefix=f"{_BUILD_PREFIX}{os.getpid()}-")
        torch.export.save(program, os.path.join(directory, PROGRAM))
    except Exception as error:  # noqa: BLE001  (the serializer's failures share no base class; a full /tmp)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        raise Failed(described(error)) from error
    return directory


_BUILD_PREFIX = "shapecache-build-"  # then the process's id: save()'s directories
_swept = False


_LEFT_FOR_S = 3600  # how old a dead process's build directory is before another removes it


def _remove_builds_of_dead_processes() -> None:
    """Removes, once per process, the build directories that processes which no longer run left
    in the temporary directory over an hour ago: one killed (SIGKILL, as Ray stops a replica) runs
    no clean-up, and each directory holds a copy of the weights. (The hour spares a process of
    another PID namespace that shares the directory, which looks dead from here, unless one of
    its builds waits an hour.)"""
    global _swept
    if _swept:
        return
    _swept = True
    for path in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{_BUILD_PREFIX}*-*")):
        owner = os.path.basename(path)[len(_BUILD_PREFIX):].split("-", 1)[0]
        if not owner.isdigit() or int(owner) == os.getpid():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                if time.time() - os.path.getmtime(path) > _LEFT_FOR_S:
                    shutil.rmtree(path, ignore_errors=True)
        except (PermissionError, OverflowError):  # another user's process, or no process id at all
            pass


def compile_saved(directory: str, options: dict, threads: int | None = None) -> str:
    """The program saved in `directory` (save) compiled by AOTInductor in a new process into a
    package in that directory, whose path this returns. Raises Failed where that process
    failed (where it could not start or crashed, the route is not tried again in this process:
    PROCESS.failed), NotForThisGraph where the graph writes what it reads,
    _background.Exiting where the interpreter is exiting. `threads`: the thread count the kernels
    are generated for (default: this process's)."""
    package = os.path.join(directory, "package.pt2")
    # Freezing as this process has it (its options or inductor's config, which that process
    # does not share).
    _run_compiler(os.path.join(directory, PROGRAM), package, {**options, "freezing": True},
                  torch.get_num_threads() if threads is None else threads)
    return package


def load(package: str) -> Package:
    """The package at `package` loaded into this process. Raises Failed."""
    try:
        with zipfile.ZipFile(package) as archive:
            blobs = {os.path.basename(i.filename): i.file_size for i in archive.infolist()
                     if i.filename.endswith("_weights.blob")}
        # The loader extracts the package to a directory of its own, removed when it is freed,
        # and reads the constants into memory: their file is removed at once (in a temporary
        # directory on tmpfs, a second copy of the weights for the entry's life).
        loaded = torch._inductor.aoti_load_package(package)
    except Exception as error:  # noqa: BLE001  (zipfile's and the loader's failures share no base class)
        raise Failed(described(error)) from error
    _remove_extracted(blobs)
    return Package(loaded, sum(blobs.values()))


def _run_compiler(saved: str, package: str, options: dict, threads: int) -> None:
    """Runs the compiler's process on the program saved at `saved`, which writes `package`.
    Raises _background.Exiting where the interpreter is exiting."""
    # -P: the working directory is not put first on its sys.path, so a module there (a json.py
    # beside the user's script) is never imported in place of the library's own.
    command = [sys.executable, "-P", "-m", "shapecache._backends.compile_process", saved, package, json.dumps(options),
               str(threads)]
    # Its temporary files (the package its trial extracts) go with the build's directory.
    environment = {**os.environ, "TMPDIR": os.path.dirname(saved)}
    # A process group of its own, not a session: the terminal's Ctrl-C is not sent to it,
    # and it shares the scheduler's group (autogroup: one per session) with the serving
    # process, inside which its lower priority counts; in a group of its own it would take
    # a fair half of the CPU whatever its priority.
    try:
        process = _background.start_process(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, process_group=0, env=environment)
    except OSError as error:  # no Python to start here (an embedded interpreter): not tried again
        PROCESS.failed = f"the compiler's process could not start: {error}"
        raise Failed(PROCESS.failed) from error
    try:
        errors = _wait_for(process)
    finally:
        try:
            process.stdin.close()
            process.stderr.close()
        finally:
            _background.process_ended(process)  # raises Exiting where exit stopped it
    if errors is None:
        raise Failed(f"the compiler's process was stopped (SIGSTOP, a frozen cgroup, a debugger) for {STOPPED_LIMIT_S:.0f} s, "
                     "and was killed")
    if process.returncode == _UNSUITABLE:
        raise NotForThisGraph
    if -process.returncode in _CRASHES:
        # Its package crashed it (a toolchain that links its own copy of the C++ library),
        # which every package of this machine would. Not tried again.
        PROCESS.failed = f"the compiler's process ended by signal {-process.returncode}"
        raise Failed(PROCESS.failed)
    if process.returncode < 0:  # killed (the out-of-memory killer, an operator): this build's failure only
        raise Failed(f"the compiler's process was killed by signal {-process.returncode}")
    if process.returncode != 0:
        raise Failed(_why(errors.decode(errors="replace"), process.returncode))


STOPPED_LIMIT_S = 120.0  # how long the compiler's process may stay stopped before its build fails


def _wait_for(process: subprocess.Popen) -> bytes | None:
    """What the compiler's process wrote to its standard error, once it has ended (its stdin
    stays open: see _exit_with_parent); None where it stayed stopped STOPPED_LIMIT_S seconds
    (a SIGSTOP, a frozen cgroup: a compile that would never end), after which it and what it
    started are killed. A process that runs, however long, is waited for."""
    errors: list[bytes] = []
    reader = threading.Thread(target=lambda: errors.append(process.stderr.read()), daemon=True,
                              name="shapecache-compiler-output")
    reader.start()
    stopped_since = None
    while True:
        try:
            process.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            pass
        if not _stopped(process.pid):
            stopped_since = None
        elif stopped_since is None:
            stopped_since = time.monotonic()
        elif time.monotonic() - stopped_since >= STOPPED_LIMIT_S:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            reader.join()
            return None
    reader.join()
    return errors[0] if errors else b""


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (its state in /proc: T, or t for a tracer's stop); False
    where /proc cannot tell (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _why(errors: str, status: int) -> str:
    """The line of the compiler's output that says why it failed: the last that names an error
    (torch's own advice follows it), else its exit status."""
    lines = [line.strip() for line in errors.splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error:" in line]
    return named[-1] if named else f"exit status {status}"


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


def _exit_with_parent() -> None:
    """Ends this process and what it started (its process group) when the one that started it
    ends: its end closes our stdin. (A read of the file descriptor itself: a daemon thread
    inside sys.stdin's buffered reader would hold its lock at interpreter exit, which is fatal.)"""
    while os.read(0, 1 << 12):
        pass
    shutil.rmtree(os.path.dirname(sys.argv[1]), ignore_errors=True)  # its build's directory, which the parent left
    if os.getpgid(0) == os.getpid():  # the leader of its own group, as _run_compiler starts it
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


def _compile(saved: str, package: str, options: dict) -> None:
    """Compiles the saved program into `package`, then loads it and runs it once on zeros: a
    package that cannot be loaded or run here (a C++ compiler that links its own copy of the C++
    library into it, which crashes the process that loads it) fails here, not in the serving
    process. The constants file the compiler leaves in inductor's cache directory (a copy of
    the weights, which the package holds) is removed."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    program = torch.export.load(saved)
    with torch.no_grad():  # freezing applies to graphs compiled without grad (compile_fx)
        # The traced program shows in-place writes only once functionalized, as the compiler
        # does it too.
        signature = program.run_decompositions(decomp_table={}).graph_signature  # functional, nothing decomposed
        if signature.buffers_to_mutate or signature.user_inputs_to_mutate:
            sys.exit(_UNSUITABLE)
        torch._inductor.aoti_compile_and_package(program, package_path=package,
                                                 inductor_configs={**options, **_PACKAGE_OPTIONS})
        with zipfile.ZipFile(package) as archive:
            blobs = [os.path.basename(n) for n in archive.namelist() if n.endswith("_weights.blob")]
        for name in blobs:
            for path in glob.glob(os.path.join(glob.escape(cache_dir()), "*", name)):
                with contextlib.suppress(FileNotFoundError):  # another process's compile of the same graph
                    os.remove(path)
        inputs = {spec.arg.name for spec in program.graph_signature.input_specs
                  if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT}
        zeros = [torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype).zero_()
                 for v in (node.meta["val"] for node in program.graph.nodes
                           if node.op == "placeholder" and node.name in inputs)]
        # A crash here is the process's end (a signal); an error the model raises on zeros (a
        # value check, a division by an input) says nothing of the package.
        loaded = torch._inductor.aoti_load_package(package)
        with contextlib.suppress(Exception):
            loaded.loader.run(zeros)


if __name__ == "__main__":
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    torch.set_num_threads(int(sys.argv[4]))
    _compile(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
