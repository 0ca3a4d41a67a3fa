"""Background work and the process's lifecycle, owned in one place: the build workers, the
publications they run when no build waits, the compiler processes builds start, the lock that
makes builds one at a time, and the one fork handler and one exit handler of shapecache.

Builds: one worker thread per device, process-wide, runs the builds queued for its device one
at a time, in the order they were asked for (``csrc/cache/build_queue.h`` holds the queue; a
``_C.ShapeCache`` calls ``wake`` once the call that queued a build has returned). A worker waits
in Python with the GIL released and holds the GIL while it builds, as any Python thread does:
the serving threads keep running between the build's own releases of the GIL (inductor's
compiles, its C++ compiler subprocesses, torch's kernels).

Publications: work a build leaves for later that serves other processes, not this one (a
package compiled for the shared directory, _backends/package_store.py). The device's worker
runs them only when no build of its device is ready, one at a time, each named by a key that is
queued once. ``wait`` waits for those of the functions it is given, as for their builds.

Compiler processes (_backends/compile_process.py) are started through ``start_process``, so
that exit can stop them and a forked child can let go of them.

At interpreter exit (one handler): builds still waiting and publications are dropped, compiler
processes are stopped, the running build is waited for, as ``concurrent.futures`` waits for its
running tasks (a thread stopped inside torch's C++ code at exit aborts the process), then what
other parts of shapecache asked for with ``at_exit`` runs. After ``fork()`` (one handler) the
child drops what its parent had queued, was building or compiling (the next miss of such a
bucket queues it again), and starts its own worker when it queues a build.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable

import torch

from shapecache._extension import _C

BUILD_NICENESS = 10  # added to the process's niceness for the worker thread (os.setpriority)
# The interpreter's switch interval while a build runs (sys.setswitchinterval), unless it is
# shorter already. Every torch operator a serving thread calls releases the GIL while it
# computes; a build (inductor's lowering and code generation, pure Python) takes the GIL then,
# and the serving thread gets it back only when the interval has passed: up to 5 ms (Python's
# default) per operator, seconds per UNet call. Measured in docs/background-builds.md.
BUILD_SWITCH_INTERVAL = 0.0005

_lock = threading.Lock()  # guards everything below that a thread changes
_workers: dict[str, threading.Thread] = {}
_leaving: dict[str, bool] = {}  # the device's worker found nothing to run and is ending
_worker_threads: set[int] = set()  # threading.get_ident() of each worker
_publications: dict[str, list[Publication]] = {}  # device -> publications waiting, oldest first
_publishing: dict[str, Publication] = {}  # key -> each publication waiting or running
_processes: set[subprocess.Popen] = set()  # the compiler processes started and not yet let go of (process_ended)
_parents_processes: list[subprocess.Popen] = []  # in a forked child: its parent's, let go of
_exiting = False  # the interpreter is exiting: nothing more starts
_at_exit_calls: list[Callable[[], None]] = []
_after_fork_calls: list[Callable[[], None]] = []
_build_lock = threading.RLock()
_process_lock = threading.Lock()  # guards _processes (a process starts under it: exit sees every one)

MAX_PUBLICATIONS = 4  # publications waiting, process-wide (each holds a saved program on disk)


def build_lock() -> threading.RLock:
    """The lock that makes compiled builds one at a time: they change inductor's configuration for
    their duration (``config.patch`` is process-wide) and give the modules inductor loads
    meanwhile to one entry. (A function: a forked child gets a new lock.)"""
    return _build_lock


class Exiting(Exception):
    """The interpreter is exiting: the work was stopped, and nothing is to be made of it."""


class Publication:
    """Work a build leaves for a worker to run when no build waits: `run` once, or `drop` where
    it will not run (exit, a full queue, its key queued already). `owner` is the cached function
    whose ``wait`` waits for it."""

    key: str
    owner: object

    def run(self) -> None:
        raise NotImplementedError

    def drop(self) -> None:
        raise NotImplementedError


def wake(device: torch.device) -> None:
    """A build or publication was queued for `device`: start its worker unless one is running."""
    name = str(device)
    with _lock:
        worker = _workers.get(name)
        if worker is not None and worker.is_alive() and not _leaving.get(name):
            return
        worker = _workers[name] = threading.Thread(target=_serve, args=(device, name),
                                                   name=f"shapecache-build-{name}", daemon=True)
        _leaving[name] = False
        worker.start()


def publish_later(device: torch.device, publication: Publication) -> bool:
    """Queues `publication` for `device`'s worker. False, and it is dropped, where its key is
    queued or running already, MAX_PUBLICATIONS wait, or the interpreter is exiting."""
    name = str(device)
    with _lock:
        waiting = sum(len(queue) for queue in _publications.values())
        refused = _exiting or publication.key in _publishing or waiting >= MAX_PUBLICATIONS
        if not refused:
            _publishing[publication.key] = publication
            _publications.setdefault(name, []).append(publication)
    if refused:
        publication.drop()
        return False
    try:
        wake(device)
    except BaseException:  # no thread can start: nothing would ever run it
        with _lock:
            _publishing.pop(publication.key, None)
            if publication in _publications.get(name, []):
                _publications[name].remove(publication)
        publication.drop()
        raise
    return True


def on_a_worker() -> bool:
    """Whether the calling thread is a background builds' worker."""
    return threading.get_ident() in _worker_threads


def _serve(device: torch.device, name: str) -> None:
    # A worker ends when it has nothing to run: a thread that ran torch's CPU kernels keeps an
    # OpenMP thread pool of its own for as long as it lives, and with more pool threads than
    # cores, OpenMP stops spinning between parallel regions, which slows every compiled call of
    # the serving threads after an idle moment (docs/background-builds.md).
    ident = threading.get_ident()
    _worker_threads.add(ident)
    lower_priority()
    try:
        while True:
            publication = None
            with _lock:  # a build queued from here on starts another worker
                if _C.devices_with_ready_builds().count(device) == 0:
                    queue = _publications.get(name)
                    if not queue or _exiting:
                        _leaving[name] = True
                        return
                    publication = queue.pop(0)
            try:
                if publication is not None:
                    _run(publication)
                    continue
                # Outermost, the count of running builds, which wait() and a fork read: it
                # falls to 0 only once what the build changed is restored.
                with _short_build_changes(), objects_before_frozen():
                    _C.run_next_build(device)
            except BaseException:  # noqa: BLE001  (a build's failure is its bucket's; the worker serves on)
                sys.excepthook(*sys.exc_info())
    finally:
        _worker_threads.discard(ident)


def _run(publication: Publication) -> None:
    try:
        publication.run()
    except Exiting:
        pass
    finally:
        with _lock:
            _publishing.pop(publication.key, None)


@contextlib.contextmanager
def objects_before_frozen():
    """Keeps the objects that exist before a build out of the garbage collector's full
    collections until it ends. A full collection holds the GIL while it walks every object
    (with torch, inductor and a model loaded, long enough to be seen in a serving thread's
    latency; docs/background-builds.md), and a build makes several, its own and the automatic
    ones: each stopped the threads that serve. Frozen,
    they walk the build's new objects only. Garbage from before waits for the end of the build.
    Left alone when any object is frozen already: a server that froze before it forked keeps
    them frozen (gc.unfreeze() would unfreeze theirs too). CPython 3.12.1 starts with 375
    frozen objects of its own, so there builds leave the collector alone."""
    freeze = gc.get_freeze_count() == 0
    # The flag is up whenever objects may be frozen (set before, cleared after): a fork between
    # the two steps leaves a child that unfreezes, never one that keeps the build's freeze.
    if freeze:
        _build_changes["froze"] = True
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
            _build_changes["froze"] = False


# What running builds have changed of the process, to undo after the last (and in a forked
# child): how many run, the switch interval before and as set (guarded by _lock), whether
# gc.freeze() is theirs (written by the one build that froze, with the GIL).
_build_changes = {"builds": 0, "previous": None, "set": None, "froze": False}


@contextlib.contextmanager
def _short_build_changes():
    """BUILD_SWITCH_INTERVAL while any build runs; the interval before is restored after the
    last, unless someone else changed it meanwhile."""
    with _lock:
        if _build_changes["builds"] == 0:
            _build_changes["previous"] = sys.getswitchinterval()
            _build_changes["set"] = min(_build_changes["previous"], BUILD_SWITCH_INTERVAL)
            sys.setswitchinterval(_build_changes["set"])
        _build_changes["builds"] += 1
    try:
        yield
    finally:
        with _lock:
            _build_changes["builds"] -= 1
            if _build_changes["builds"] == 0 and sys.getswitchinterval() == _build_changes["set"]:
                sys.setswitchinterval(_build_changes["previous"])


def lower_priority() -> None:
    """Gives this thread, and the compiler processes it starts, a lower CPU priority than the
    threads that serve calls: where cores are fewer than the work, a build takes what serving
    leaves. (On Linux a thread has a nice value of its own, which processes it forks inherit.)"""
    try:
        # Added to the process's own niceness (its main thread's), which a host may have raised
        # already: Ray starts its workers at 15, and an absolute 10 would put builds above serving.
        process = os.getpriority(os.PRIO_PROCESS, os.getpid())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, process + BUILD_NICENESS))
    except (AttributeError, OSError):  # not Linux, or not permitted: the default priority
        pass


def wait(dispatchers, timeout: float | None) -> bool:
    """Waits until no build of `dispatchers` (``_C.ShapeDispatcher``) is waiting or running,
    nor a publication of their functions; False when `timeout` seconds passed first."""
    if on_a_worker():
        raise RuntimeError("shapecache.wait was called from a background build, which would wait for itself")
    # A build queued by a call that has not returned yet (this wait may be inside it) is ready
    # when that call returns: it is asked for now.
    for device in _C.make_all_builds_ready():
        wake(device)
    owners = {id(d.function) for d in dispatchers}
    deadline = None if timeout is None else time.monotonic() + timeout
    while (any(d.pending_builds for d in dispatchers) or _settling()
           or any(id(p.owner) in owners for p in list(_publishing.values()))):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        # A short sleep, not a condition: a build ends on the worker, a cancellation on any
        # thread, and both are rare beside a build's seconds.
        time.sleep(0.01)
    return True


def _settling() -> bool:
    """A worker has installed the last build of the process and is still restoring what a build
    changes (the switch interval, the frozen objects): a wait that returned now would leave the
    caller in the build's settings."""
    return _build_changes["builds"] > 0 and _C.pending_builds() == 0


def start_process(command: list[str], **popen) -> subprocess.Popen:
    """Starts a compiler process (``subprocess.Popen(command, **popen)``), which exit stops and a
    forked child lets go of; ``process_ended`` once it has ended. Raises Exiting where the
    interpreter is exiting, and OSError where it cannot start."""
    with _process_lock:
        if _exiting:
            raise Exiting
        process = subprocess.Popen(command, **popen)
        _processes.add(process)
    return process


def process_ended(process: subprocess.Popen) -> None:
    """`process` (start_process) has ended; raises Exiting where exit stopped it."""
    with _process_lock:
        _processes.discard(process)
        if _exiting:
            raise Exiting


def at_exit(call: Callable[[], None]) -> None:
    """Runs `call` at interpreter exit, after the running build has ended."""
    _at_exit_calls.append(call)


def after_fork_in_child(call: Callable[[], None]) -> None:
    """Runs `call` in a forked child, after this module has let go of its parent's work: for
    state of the parent's that the child must not use (a lock, a process's handle)."""
    _after_fork_calls.append(call)


def _at_exit() -> None:
    global _exiting
    _C.cancel_all_builds()
    with _lock, _process_lock:
        _exiting = True
        dropped = [p for queue in _publications.values() for p in queue]
        _publications.clear()
        for publication in dropped:
            _publishing.pop(publication.key, None)
        # A compile in a process of its own is stopped, not waited for: its process group,
        # which holds the C++ compilers it started.
        for process in _processes:
            if process.returncode is None:  # (one reaped already: its id may be another's by now)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
    for publication in dropped:
        publication.drop()
    # The running build is waited for, and a running publication (its compiler stopped, it only
    # removes its files); the compiler's own workers may be gone by now, which fails the
    # build, and a failure at exit is nobody's to read.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deadline = time.monotonic() + _PUBLICATION_EXIT_S
        while any(thread.is_alive() for thread in list(_workers.values())) and (
                _C.pending_builds() or (_publishing and time.monotonic() < deadline)):
            time.sleep(0.01)
    for call in _at_exit_calls:  # each runs, whatever the one before raised
        try:
            call()
        except Exception:  # noqa: BLE001
            sys.excepthook(*sys.exc_info())
    # (Not in an interactive session, where sys.last_value is the prompt's last error.)
    if _workers and isinstance(getattr(sys, "last_value", None), KeyboardInterrupt) and not hasattr(sys, "ps1"):
        _exit_as_interrupted()


_PUBLICATION_EXIT_S = 10.0  # how long exit waits for a stopped publication to clean up


def _exit_as_interrupted() -> None:
    """Keeps the exit status of a process that Ctrl-C ended (130, by SIGINT) when builds ran
    meanwhile. CPython remembers that a KeyboardInterrupt ended the main module in one
    process-wide flag, which the run of any string of source (exec of a str, as code generation
    does) clears, from any thread (run_eval_code_obj, Python/pythonrun.c): a build that ran
    after the interrupt made the process exit with 1. The flag is set again the way it is set,
    by running a string that raises KeyboardInterrupt, with its report silenced."""
    import ctypes
    import io

    saved = sys.stderr, sys.excepthook, getattr(sys, "last_value", None), getattr(sys, "last_traceback", None)
    sys.stderr, sys.excepthook = io.StringIO(), lambda *exc_info: None  # the user's hook sees one interrupt
    try:
        ctypes.pythonapi.PyRun_SimpleString(b"raise KeyboardInterrupt")
    except Exception:  # noqa: BLE001  (an exit status is not worth an error at exit)
        pass
    finally:
        sys.stderr, sys.excepthook, sys.last_value, sys.last_traceback = saved


_forked_mid_build = {"parent": None}  # in a child forked while a build ran: the parent's pid


def forked_mid_build() -> int | None:
    """The parent's pid when this process was forked while a build ran in it, else None. Such
    a child has what the build had half made and no thread to finish it: a module the build was
    importing stays half imported, and the compiler's own state (its pools, its caches' locks)
    may be mid-change. Its compiled buckets run uncached (_backends.make_builder)."""
    return _forked_mid_build["parent"]


def _forget_parents_work() -> None:
    """In a forked child: no worker of the parent's is here, none of their builds or
    publications (their files are the parent's to remove), and none of its compiler processes
    (the child's copies of their pipes are closed: a compiler ends when its stdin closes, which a
    child holding it open would delay). What a build running at the fork had changed of the
    process is undone. Each lock is new: a thread of the parent may have held it."""
    global _lock, _build_lock, _process_lock
    _lock, _build_lock, _process_lock = threading.Lock(), threading.RLock(), threading.Lock()
    if _build_changes["builds"]:
        _forked_mid_build["parent"] = os.getppid()
    _workers.clear()
    _leaving.clear()
    _worker_threads.clear()
    _publications.clear()
    _publishing.clear()
    # The child's copies of their pipes are replaced by /dev/null, not closed: their objects
    # close their descriptors when finalized, and a closed number may be another file's by then.
    null = os.open(os.devnull, os.O_RDWR)
    for process in _processes:
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(null, pipe.fileno())
    os.close(null)
    _parents_processes.extend(_processes)  # (kept: finalizing one could flush into /dev/null, at most)
    _processes.clear()
    if _build_changes["builds"] and sys.getswitchinterval() == _build_changes["set"]:
        sys.setswitchinterval(_build_changes["previous"])
    if _build_changes["froze"]:
        gc.unfreeze()
    _build_changes.update(builds=0, previous=None, set=None, froze=False)
    _C.forget_parents_builds()
    _C.trace_gate_after_fork()
    for call in _after_fork_calls:
        call()


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_work)
