"""A bucket's graph compiled in a process of its own: how a background build on the CPU keeps
the compiler off the serving threads' GIL, and how a build where packages are shared makes
the package it shares.

Inductor's lowering and code generation are Python that holds the GIL for most of a build (a
minute for a UNet on the CPU); every operator a serving thread calls releases the GIL and then
waits to get it back, so calls served meanwhile stall for seconds (docs/background-builds.md).
So the worker does here only what needs the live model: ``torch.export`` traces the call (a
few seconds; the guards come from that trace, trace.py). It saves the exported program, and
the compiler's process (``python -m shapecache._backends.compile_process``, started at the
first such build at the priority of the thread that asks for it, a worker's lower one or an
inline build's, and kept warm for the next ones:
``CompilerProcess``) compiles it with AOTInductor into a package, whose kernels and frozen
weights this process then loads: in tens of milliseconds, with no Python of the compiler's
run here.

``ProcessCompiler`` is one of the compilers (compilers.py), chosen there for a background
build of a graph that inductor's freezing makes (``freezing`` on, grad off), and for an inline
build of one where a shared directory is set (its package is the entry, shared as it is): its
weights are constants, and the package holds a copy of every one it reads (an in-process
frozen entry copies those freezing transforms and reads the rest where they are). Without
freezing the graph reads the model's weights where they are, which a package of copies would
not; a graph that writes what it reads (BatchNorm's statistics in training) would write the
package's copies (the compiler's process refuses it: NotForThisGraph); under autocast the
exported graph records no casts. Those compile in this process; so does a build this compiler
failed, with a warning, the later builds of a graph it failed for good (compilers.Route.
failures; a Transient failure is not kept), and every later build where the compiler's process
cannot start or crashed again once started anew (a segmentation fault, an illegal
instruction: ``failed``).
The route costs a small model time: the graph compiles as one C++ file
(docs/background-builds.md).

The same steps (SavedProgram, compile_saved, load) make and read the packages that processes
share through a shared directory (package_store.py).

The compiler's process never touches the model: it reads the saved programs only. It ends
with this process (it watches its standard input, which only this process holds open), after
``SHAPECACHE_COMPILER_IDLE_S`` seconds without a build (default 300), or when killed; the next
build starts another. It does not get the terminal's Ctrl-C (a process group of its own). It
is started through shapecache's owner of background work (shapecache/_background.py), which
stops it at interpreter exit rather than waiting for it, and lets go of it in a forked child,
which starts its own.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import glob
import json
import logging
import os
import queue
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile

import torch

from shapecache import _background
from shapecache._backends import disk_cache, package_extractions
from shapecache._backends.compile_settings import CompileSettings
from shapecache._backends.compilers import (
    DEADLINE_VARIABLE,
    CompiledGraph,
    CompilerFailed,
    NotForThisGraph,
    deadline_ceiling,
    idle_seconds,
)
from shapecache._backends.entry import described

# The package keeps the constants in a file beside the library, which the loader reads into
# memory: the library itself is never unloaded (glibc keeps it mapped after the loader goes),
# and with the constants inside it the weights' pages would stay mapped with it.
_PACKAGE_OPTIONS = {"aot_inductor.package_constants_in_so": False,
                    "aot_inductor.package_constants_on_disk_format": "binary_blob"}

PROGRAM = "program.pt2"  # the saved program's name in its directory (save)

class Failed(Exception):
    """Saving the program, the compiler's process or loading its package failed (the message
    is the error's first line, or the last line the process wrote)."""


class Transient(Failed):
    """A failure that says nothing of the graph: the compiler's process ended or was killed
    before it replied (the out-of-memory killer, its deadline, a stop), or the machine ran out
    of something (memory, disk, processes) while the program was saved, compiled or loaded.
    The next build tries the route again."""


def failure_of(error: BaseException) -> Failed:
    """`error`, met saving a program, starting the compiler's process or loading a package, as
    a Failed: Transient where it is the machine's (machines_failure)."""
    return (Transient if machines_failure(error) else Failed)(described(error))


def machines_failure(error: BaseException) -> bool:
    """Whether `error` (of a save, a compile, a load) is the machine's, not the graph's: memory,
    disk, processes or files ran out, or a compiler was killed. Read from its type and errno,
    the return codes of the processes in its causes, and its whole text with its causes (torch's
    writer says "file write failed" for a full disk; GCC names the killed compiler)."""
    seen, depth = error, 0
    while seen is not None and depth < 16:
        if isinstance(seen, MemoryError) or (isinstance(seen, OSError) and seen.errno in _RAN_OUT):
            return True
        if isinstance(seen, subprocess.CalledProcessError) and seen.returncode < 0:  # killed by a signal
            return True
        seen, depth = seen.__cause__ or seen.__context__, depth + 1
    text = "".join(traceback.format_exception(error))
    return any(report in text for report in _TRANSIENT_REPORTS)


# What ran out, where an OSError is the machine's: disk, quota, memory, processes, files.
_RAN_OUT = {errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EAGAIN, errno.EMFILE, errno.ENFILE}
# What a report says where the machine, not the graph, failed it.
_TRANSIENT_REPORTS = ("Killed signal terminated program", "terminated with signal", "died with <Signals",
                      "No space left on device", "Cannot allocate memory", "out of memory allocating",
                      "file write failed", "Disk quota exceeded")


class Package:
    """A loaded package: the graph over the call's tensors, and the bytes of its constants."""

    def __init__(self, loader, constant_bytes: int):
        self._run = loader.run
        self.constant_bytes = constant_bytes
        self._loader = loader  # its library and constants live as long as this object

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
        except (Failed, ValueError) as failure:  # (ValueError: a setting of that process's, set since it was checked)
            # A failure of the graph's own (saving it, compiling it, loading its package) is
            # lasting: the same graph at another size would fail so too. Not so a Transient one,
            # a setting, or a route closed to every graph (``failed``).
            lasting = isinstance(failure, Failed) and not isinstance(failure, Transient) and not self.failed
            where = ("this and later builds of the process compile in the serving process, where they slow"
                     if self.failed else "it and this graph's later builds, at any size, compile in the serving "
                     "process, where they slow" if lasting else "it compiles in the serving process, where it slows")
            raise CompilerFailed(f"compiling a build's package in a process of its own failed ({failure}); {where} "
                                 "the calls served meanwhile", lasting=lasting) from failure
        disk_cache.note_compiled_by_the_compiler_process()
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
        raise failure_of(error) from error
    return directory


_BUILD_PREFIX = "shapecache-build-"  # then the process's id: save()'s directories
_swept = False


_LEFT_FOR_S = 3600  # how old a dead process's build directory is before another removes it


def _remove_builds_of_dead_processes() -> None:
    """Removes, once per process, the build directories and compilers' directories that
    processes which no longer run left in the temporary directory, untouched for over an hour:
    one killed (SIGKILL, as Ray stops a replica) runs no clean-up, and a build's directory holds
    a copy of the weights. (The hour spares a process of another PID namespace that shares the
    directory, which looks dead from here, unless one of its builds waits an hour, or it has
    built nothing for an hour: its compilers' directory is touched at each build.)"""
    global _swept
    if _swept:
        return
    _swept = True
    temporary = glob.escape(tempfile.gettempdir())
    for prefix in (_BUILD_PREFIX, _COMPILER_PREFIX):
        _remove_dead(prefix, glob.glob(os.path.join(temporary, f"{prefix}*-*")))


def _remove_dead(prefix: str, paths: list[str]) -> None:
    for path in paths:
        owner = os.path.basename(path)[len(prefix):].split("-", 1)[0]
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


def compile_saved(directory: str, options: dict, settings: CompileSettings | None = None) -> str:
    """The program saved in `directory` (save) compiled by AOTInductor in the compiler's process
    into a package in that directory, whose path this returns. Raises Failed where that process
    failed (where it could not start or crashed twice, the route is not tried again in this
    process: PROCESS.failed), NotForThisGraph where the graph writes what it reads,
    _background.Exiting where the interpreter is exiting. `settings`: torch's, which that
    process compiles under (compile_settings.py; default: this thread's now)."""
    package = os.path.join(directory, "package.pt2")
    # Freezing as this process has it (its options or inductor's config, which that process
    # does not share).
    _run_compiler(os.path.join(directory, PROGRAM), package, {**options, "freezing": True},
                  settings or CompileSettings.of_this_thread())
    return package


def load(path: str) -> Package:
    """The package at `path` (a copy of its own: the sealed copy a store made, or a compile's
    output) loaded into this process. Raises Failed."""
    try:
        with zipfile.ZipFile(path) as archive:
            blobs = {os.path.basename(i.filename): i.file_size for i in archive.infolist()
                     if i.filename.endswith("_weights.blob")}
        loader = _package_loader(path)
    except Exception as error:  # noqa: BLE001  (zipfile's and the loader's failures share no base class)
        raise failure_of(error) from error
    package_extractions.remove_extracted_constants(blobs)
    package_extractions.remove_orphaned_once()
    return Package(loader, sum(blobs.values()))


def _package_loader(path: str):
    """AOTInductor's loader of the package at `path`, made as torch._inductor.aoti_load_package
    makes it (model "model", not single-threaded, one runner, the current device; torch 2.11 and
    2.13, torch/_inductor/package/package.py), less its comparison of the package's device
    information with this machine's, which only warns, and which on the CPU compiles and runs
    inductor's vector-instruction probes (cpu_vec_isa.pick_vec_isa: a second in a new process).
    A package's key holds what that compares (package_store.setting, the host). The loader
    extracts the package to a directory of its own, removed when it is freed, and reads the
    constants into memory: their file is removed at once (package_extractions: in a temporary
    directory on tmpfs, a second copy of the weights for the entry's life)."""
    return torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)


STOPPED_LIMIT_S = 120.0  # how long the compiler's process may stay stopped before its build fails
DEADLINE_FLOOR_S = 300.0  # a compile's deadline is never shorter (deadline_seconds)
DEADLINE_FACTOR = 8.0  # times the slowest compile measured: the deadline of the next
BUILDS_PER_PROCESS = 64  # builds a compiler's process takes before it is ended (what each leaves mapped)
_COMPILER_PREFIX = "shapecache-compiler-"  # then the process's id: a compiler's private directory
_REPLY_LIMIT = 4000  # characters of a failure's text a reply carries
logger = logging.getLogger("shapecache")


class CompilerProcess:
    """The compiler's process, kept warm between builds: it imports torch and inductor once,
    then compiles the programs it is sent one at a time, each request a line of JSON on its
    stdin, each reply a line of JSON, naming its request, on a pipe of its own (nothing it
    prints at start-up can pass for one). Its temporary directory (inductor's cache, its
    precompiled headers, the packages its trials extract) and working directory is
    `directory`, private to this process's compilers (0700), which the next one started
    reuses; where the user sets TORCHINDUCTOR_CACHE_DIR, inductor's cache is that one, and
    outlives them. It ends after ``idle_seconds()`` without a build, when its stdin closes
    (this process ended), when killed, or after BUILDS_PER_PROCESS builds; the next build
    starts another. Its environment is the part of this process's that a compile reads, as it
    is when the process starts (``compiler_environment``)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.builds = 0
        self.gave_up = ""  # why the last request was given up while the process ran (it is then killed)
        self.ran_past_deadline = False  # whether that was its deadline (not a stop)
        self.started_at = time.time()
        # The niceness it runs at, the starting thread's, which it cannot lower (unprivileged)
        self.niceness = thread_niceness()
        replies, self._replies_write = os.pipe()
        # -P: the working directory is not put first on its sys.path, so a module there (a
        # json.py beside the user's script) is never imported in place of the library's own.
        # -s: nor is the user's site directory (its usercustomize runs at start-up), unless
        # this process imports from it (torch installed with pip --user).
        command = [sys.executable, "-P", *_without_user_site(), "-m", "shapecache._backends.compile_process",
                   directory, str(self._replies_write), str(idle_seconds())]
        # A process group of its own, not a session: the terminal's Ctrl-C is not sent to it,
        # and it shares the scheduler's group (autogroup: one per session) with the serving
        # process, inside which its lower priority counts; in a group of its own it would
        # take a fair half of the CPU whatever its priority.
        try:
            self.process = _background.start_process(
                command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                process_group=0, cwd=directory, pass_fds=(self._replies_write,),
                env=compiler_environment(directory))
        except BaseException:
            os.close(replies)
            raise
        finally:
            os.close(self._replies_write)  # the child's end: its end is the pipe's end of file
        self._replies = replies
        self._unread = b""
        self._let_go = False

    def request(self, deadline_s: float, **request) -> dict | None:
        """The reply to `request`; None where the process ended without one, or answered what
        is not one (it is then ended with what it started: see `process.returncode`), or stayed
        stopped STOPPED_LIMIT_S seconds, or ran `deadline_s` seconds (not counting the time it
        was stopped) without replying (``gave_up`` says which: the caller kills it)."""
        self.gave_up, self.ran_past_deadline = "", False
        self.builds += 1
        request["id"] = self.builds
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):  # it ended (idle) as the request was sent
            self.end()
            return None
        try:
            line = self._reply_line(deadline_s)
        except BaseException:  # (a Ctrl-C on an inline build's thread: the compile it asked for goes with it)
            self.end()
            raise
        try:
            reply = json.loads(line) if line is not None else None
            if not isinstance(reply, dict) or reply.get("id") != request["id"]:
                raise ValueError(f"not a reply to request {request['id']}")
        except ValueError:  # (json's errors are ValueErrors) a process that does not answer as it must
            self.end()
            return None
        self._log(reply)
        return reply

    def _reply_line(self, deadline_s: float) -> bytes | None:
        """The next line of the replies' pipe; None where the process ended first, or stayed
        stopped too long, or ran past `deadline_s` (``gave_up`` says which)."""
        waiting = select.poll()  # (not select.select: a descriptor past 1024 in a busy server)
        waiting.register(self._replies, select.POLLIN)
        stopped_since = None
        running_s, last = 0.0, time.monotonic()
        while b"\n" not in self._unread:
            if waiting.poll(1000):
                chunk = os.read(self._replies, 1 << 16)
                if not chunk:
                    return None  # every writer has closed it: the process ended
                self._unread += chunk
                continue
            if self.process.poll() is not None:  # ended (a writer it left, its own children, may live on)
                return None
            now = time.monotonic()
            if not _stopped(self.process.pid):
                stopped_since = None
                running_s += now - last
                if running_s >= deadline_s:
                    self.ran_past_deadline = True
                    self.gave_up = (f"its compile ran {deadline_s:g} s, its deadline ({DEADLINE_VARIABLE} or "
                                    f"{DEADLINE_FACTOR:.0f} times the slowest compile before it), and was killed")
                    return None
            elif stopped_since is None:
                stopped_since = now
            elif now - stopped_since >= STOPPED_LIMIT_S:
                self.gave_up = (f"it was stopped (SIGSTOP, a frozen cgroup, a debugger) for {STOPPED_LIMIT_S:.0f} s, "
                                "and was killed")
                return None
            last = now
        line, _, self._unread = self._unread.partition(b"\n")
        return line

    def _log(self, reply: dict) -> None:
        """Logs where the build's time went in this process (the first: its start and imports too)."""
        ready_at = reply.pop("ready_at", None)
        split = {"start": ready_at - self.started_at} if self.builds == 1 and ready_at is not None else {}
        split.update(reply.pop("seconds", {}))
        logger.debug("shapecache: the compiler's process (pid %d) took %s", self.process.pid,
                     ", ".join(f"{step} {seconds:.2f} s" for step, seconds in split.items()),
                     extra={"compiler_split": split})

    def running(self) -> bool:
        return self.process.poll() is None

    def end(self) -> None:
        """Stops it with what it started (its process group: the C++ compilers a crash left
        running too), and lets go of it. Raises _background.Exiting where exit stopped it."""
        if self._let_go:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.ended()

    def ended(self) -> None:
        """After it ended: its pipes closed. Raises _background.Exiting where exit stopped it."""
        if self._let_go:
            return
        self._let_go = True
        try:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
            with contextlib.suppress(OSError):
                os.close(self._replies)
        finally:
            _background.process_ended(self.process)

    def resident_bytes(self) -> int:
        """Its resident memory (its process alone, not the C++ compilers it runs); 0 where it
        has ended or /proc cannot tell."""
        try:
            with open(f"/proc/{self.process.pid}/statm") as statm:
                return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            return 0


# What a compile reads of its environment: where programs, libraries and headers are found,
# the compiler and its flags, the user and locale, the Python it runs (PYTHONPATH and the user
# site, as this process imports), the conda or Nix environment, and the settings of torch
# (ATen's CPU capability, AOTInductor's and inductor's defaults), Triton, CUDA and the CPU's
# thread libraries. Anything else (a cloud key, a token, PYTHONSTARTUP, PYTHONBREAKPOINT)
# stays here.
_ENVIRONMENT_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "SHELL",
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONUSERBASE", "PYTHONNOUSERSITE",
    "VIRTUAL_ENV", "LD_LIBRARY_PATH", "LD_PRELOAD", "LIBRARY_PATH", "CPATH", "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH", "CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "GCC_EXEC_PREFIX",
    "COMPILER_PATH", "SDKROOT", "MACOSX_DEPLOYMENT_TARGET", "XDG_CACHE_HOME"})
_ENVIRONMENT_PREFIXES = ("LC_", "TORCH", "PYTORCH_", "ATEN_", "AOT_INDUCTOR_", "AOTINDUCTOR_", "INDUCTOR_",
                         "HALIDE_", "TRITON_", "CUDA", "CUDNN_", "CUBLAS", "NVIDIA_", "NVCC_", "OMP_", "KMP_",
                         "GOMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "CONDA_", "NIX_", "CCACHE_",
                         "SHAPECACHE_")


def compiler_environment(directory: str) -> dict[str, str]:
    """The compiler process's environment: of this process's, only what a compile reads
    (_ENVIRONMENT_NAMES, _ENVIRONMENT_PREFIXES), with TMPDIR its private `directory`, where
    inductor keeps its precompiled headers between builds."""
    kept = {name: value for name, value in os.environ.items()
            if name in _ENVIRONMENT_NAMES or name.startswith(_ENVIRONMENT_PREFIXES)}
    return {**kept, "TMPDIR": directory}


def _without_user_site() -> list[str]:
    """["-s"] where this process imports nothing from the user's site directory; else []."""
    import site

    user_site = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user_site and any(os.path.abspath(p).startswith(os.path.abspath(user_site)) for p in sys.path if p):
        return []
    return ["-s"]


_compiler: dict = {"process": None, "lock": threading.Lock(), "directory": None,  # this process's
             "slowest": 0.0}  # the slowest compile measured (seconds; a forked child keeps it)


def deadline_seconds() -> float:
    """How long the next compile in the compiler's process may run (stopped time not counted)
    before it is killed and its build compiles in the serving process: DEADLINE_FACTOR times
    the slowest compile this process measured (a compile killed at its deadline counts as
    that long: a larger graph than those before gets a longer one), at least
    DEADLINE_FLOOR_S (a compiler may run beside builds and requests that take the CPU), and
    at most the user's ceiling (compilers.deadline_ceiling), which is the deadline until a
    compile is measured."""
    ceiling, slowest = deadline_ceiling(), _compiler["slowest"]
    return ceiling if slowest == 0 else min(ceiling, max(DEADLINE_FLOOR_S, DEADLINE_FACTOR * slowest))


def _forget_parents_compiler() -> None:
    """In a forked child (_background's fork handler): its parent's compiler's process, the
    lock of its requests (a thread of the parent may have held it) and its directory (the
    parent's to remove) are not the child's."""
    _compiler.update(process=None, lock=threading.Lock(), directory=None)


_background.after_fork_in_child(_forget_parents_compiler)


def _compilers_directory() -> str:
    """The private directory of this process's compilers: made at the first (0700), reused
    while it is still this user's directory of mode 0700 (not a link, nor one another user made
    in its place), removed at exit (where this process is killed: by its compiler's process
    when one runs, else by a later process's sweep, _remove_builds_of_dead_processes). Touched
    at each build, so that the sweep, which goes by age, spares it."""
    directory = _compiler["directory"]
    if directory is not None and not _private(directory):
        directory = None
    if directory is None:
        directory = _compiler["directory"] = tempfile.mkdtemp(prefix=f"{_COMPILER_PREFIX}{os.getpid()}-")
        owner = os.getpid()
        _background.at_exit(lambda: os.getpid() == owner and shutil.rmtree(directory, ignore_errors=True))
    with contextlib.suppress(OSError):
        os.utime(directory)
    return directory


def _private(directory: str) -> bool:
    """Whether `directory` is a directory (not a link) of this user's, of mode 0700."""
    try:
        status = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid() and stat.S_IMODE(status.st_mode) == 0o700


def resident_bytes() -> int:
    """The resident memory of this process's compiler's process; 0 where none runs. (Reads
    /proc, and reaps nothing: the process is let go of by the next build.)"""
    compiler = _compiler["process"]
    return compiler.resident_bytes() if compiler is not None and compiler.process.returncode is None else 0


def thread_niceness() -> int | None:
    """The calling thread's niceness (on Linux a thread has one of its own, which the processes
    it starts inherit); None where it cannot be read."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None


def _run_compiler(saved: str, package: str, options: dict, settings: CompileSettings) -> None:
    """Has the compiler's process compile the program saved at `saved` into `package`, starting
    one where none runs, or where the one that runs is at a lower priority than the calling
    thread (started by a background build: an inline build's request waits on this compile).
    A process that ends without replying is started anew for the build once; ended again,
    this build fails, and where that end was a crash (or the process could not start up), the
    route is not tried again in this process (PROCESS.failed). Raises Failed (Transient where
    the process ended without a reply or the machine ran out of something),
    NotForThisGraph, and _background.Exiting where the interpreter is exiting."""
    with _compiler["lock"]:
        ended_idle = restarted = False
        while True:
            compiler = _compiler["process"]
            if compiler is not None and not compiler.running():  # ended idle, or killed since its last build
                _compiler["process"] = None
                compiler.ended()
                compiler = None
            niceness = thread_niceness()
            if compiler is not None and None not in (niceness, compiler.niceness) and niceness < compiler.niceness:
                _compiler["process"] = None  # (a process at a higher priority takes lower-priority builds as it is)
                compiler.end()
                compiler = None
            if compiler is None:
                try:
                    compiler = _compiler["process"] = CompilerProcess(_compilers_directory())
                except OSError as error:
                    if machines_failure(error):  # no memory or processes left to start one now
                        raise Transient(f"the compiler's process could not start: {error}") from error
                    # No Python to start here (an embedded interpreter): not tried again.
                    PROCESS.failed = f"the compiler's process could not start: {error}"
                    raise Failed(PROCESS.failed) from error
            started, deadline_s = time.monotonic(), deadline_seconds()
            reply = compiler.request(deadline_s, saved=saved, package=package, options=options,
                                     settings=settings.as_json())
            if reply is not None:
                if "error" not in reply and "unsuitable" not in reply:
                    _compiler["slowest"] = max(_compiler["slowest"], time.monotonic() - started)
                if compiler.builds >= BUILDS_PER_PROCESS:  # a new one for the next build
                    _compiler["process"] = None
                    compiler.end()
                break
            _compiler["process"] = None
            if compiler.gave_up:  # this build's failure only: the route stays open
                compiler.end()
                if compiler.ran_past_deadline:  # a larger graph than those measured: the next gets longer
                    _compiler["slowest"] = max(_compiler["slowest"], deadline_s)
                raise Transient(f"the compiler's process gave no reply: {compiler.gave_up}")
            compiler.end()  # what a crash left running goes too; raises Exiting where exit stopped it
            status = compiler.process.returncode
            if status == 0 and not ended_idle:
                ended_idle = True
                continue  # it ended idle as this build's request came: a new one takes it
            if not restarted:
                restarted = True
                continue
            if status in (-signal.SIGKILL, 0):  # the out-of-memory killer, an operator: this build's failure only
                raise Transient(f"the compiler's process ended ({_ending(status)}) without compiling, and again "
                                "when started anew")
            # Its package crashed it (a toolchain that links its own copy of the C++ library),
            # which every package of this machine would, or it cannot start up: not tried again.
            PROCESS.failed = f"the compiler's process ended by {_ending(status)}, and again when started anew"
            raise Failed(PROCESS.failed)
    if "unsuitable" in reply:
        raise NotForThisGraph
    if "error" in reply:
        raise (Transient if reply.get("transient") else Failed)(str(reply["error"]))


def _ending(status: int) -> str:
    return f"signal {-status}" if status < 0 else f"exit status {status}"


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (its state in /proc: T, or t for a tracer's stop); False
    where /proc cannot tell (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _why(error: BaseException) -> str:
    """The line of a failed compile's report that says why: the last that names an error (a
    C++ compiler's own error precedes torch's advice), else the error in a line."""
    text = "".join(traceback.format_exception(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error:" in line]
    return (named[-1] if named else described(error))[:_REPLY_LIMIT]


_building = {"directory": None}  # in the compiler's process: the directory of the build it runs


def _read_requests(requests: queue.Queue, directory: str) -> None:
    """Puts each request line of stdin on `requests`. At its end (the process that started this
    one ended: only it holds the pipe open) ends this process and what it started (its process
    group), removing the build's directory and the compilers' `directory`, which the parent
    would have. (A read of the file descriptor itself: a daemon thread inside sys.stdin's
    buffered reader would hold its lock at interpreter exit, which is fatal.)"""
    pending = b""
    while chunk := os.read(0, 1 << 16):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            requests.put(json.loads(line))
    for path in (_building["directory"], directory):
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
    if os.getpgid(0) == os.getpid():  # the leader of its own group, as CompilerProcess starts it
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


def _serve(directory: str, replies_fd: int, idle_s: float) -> None:
    """Compiles the requests of stdin one at a time, each reply a line on `replies_fd`; ends
    after `idle_s` seconds without one (not before the first). `directory` is its private
    directory, checked before anything is written there or removed from it."""
    if not _private(directory) or os.path.realpath(tempfile.gettempdir()) != os.path.realpath(directory):
        sys.exit(f"shapecache: the compiler's directory {directory!r} is not this user's private directory")
    tempfile.tempdir = directory
    ready_at = time.time()
    replies = os.fdopen(replies_fd, "w")
    requests: queue.Queue = queue.Queue()
    threading.Thread(target=_read_requests, args=(requests, directory), daemon=True,
                     name="shapecache-requests").start()
    waited: float | None = None  # the first request is waited for however long
    while True:
        try:
            request = requests.get(timeout=waited)
        except queue.Empty:  # (its directory is kept for the next one)
            os._exit(0)
        waited = idle_s
        _building["directory"] = os.path.dirname(request["saved"])
        CompileSettings.from_json(request["settings"]).apply()  # the serving process's
        began = time.time()
        seconds: dict = {}
        try:
            _compile(request["saved"], request["package"], request["options"], seconds)
            reply = {}
        except NotForThisGraph:
            reply = {"unsuitable": True}
        except Exception as error:  # noqa: BLE001  (any failure of one compile is that build's)
            reply = {"error": _why(error), "transient": machines_failure(error)}
        _building["directory"] = None
        gc.collect()  # the program's weights and the trial's package, before the next build
        _remove_outputs(directory, ready_at if request["id"] == 1 else began)
        replies.write(json.dumps({**reply, "id": request["id"], "ready_at": ready_at, "seconds": seconds}) + "\n")
        replies.flush()


def _remove_outputs(directory: str, since: float) -> None:
    """Removes what a build wrote to inductor's cache where that cache is in the compilers'
    private `directory` (TORCHINDUCTOR_CACHE_DIR unset): the generated C++, its objects and
    libraries, which the package holds and nothing reads again, so that the directory does not
    grow with every build of a long-lived server. The precompiled headers stay."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache = os.path.realpath(cache_dir())
    if not cache.startswith(os.path.realpath(directory) + os.sep):
        return
    for root, _folders, files in os.walk(cache, topdown=False):
        if "precompiled_headers" in os.path.relpath(root, cache).split(os.sep):
            continue
        for name in files:
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if os.lstat(path).st_mtime >= since:
                    os.remove(path)
        if root != cache:
            with contextlib.suppress(OSError):
                os.rmdir(root)  # emptied


def _compile(saved: str, package: str, options: dict, seconds: dict) -> None:
    """Compiles the saved program into `package`, then loads it and runs it once on zeros: a
    package that cannot be loaded or run here (a C++ compiler that links its own copy of the C++
    library into it, which crashes the process that loads it) fails here, not in the serving
    process. The constants file the compiler leaves in inductor's cache directory (a copy of
    the weights, which the package holds) is removed. Raises NotForThisGraph for a graph that
    writes what it reads. `seconds` receives each step's time."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    began = time.perf_counter()
    program = torch.export.load(saved)
    with torch.no_grad():  # freezing applies to graphs compiled without grad (compile_fx)
        # The traced program shows in-place writes only once functionalized, as the compiler
        # does it too.
        signature = program.run_decompositions(decomp_table={}).graph_signature  # functional, nothing decomposed
        if signature.buffers_to_mutate or signature.user_inputs_to_mutate:
            raise NotForThisGraph
        seconds["read"] = time.perf_counter() - began
        torch._inductor.aoti_compile_and_package(program, package_path=package,
                                                 inductor_configs=package_extractions.marked(
                                                     {**options, **_PACKAGE_OPTIONS}))
        seconds["compile"] = time.perf_counter() - began - seconds["read"]
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
        loader = _package_loader(package)
        with contextlib.suppress(Exception):
            loader.run(zeros)
        seconds["trial"] = time.perf_counter() - began - seconds["read"] - seconds["compile"]


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
