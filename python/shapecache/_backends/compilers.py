"""Compilers of a traced call, and the one place where a build's route is chosen.

A compiler turns a trace (trace.py) into a graph that runs: ``Compiler.compile`` returns a
``CompiledGraph``. There are two:

- ``InductorCompiler`` (inductor_compiler.py): inductor's ``compile_fx``, in this process.
- ``ProcessCompiler`` (compile_process.py): AOTInductor in a process of its own, whose package
  this process loads; for frozen graphs built in the background, so that inductor's Python
  never holds the serving threads' GIL, and for those built inline where packages are shared,
  so that the package the fleet loads is the entry's own, not compiled a second time.

The package store (package_store.py) is a cache layer around them: looked up before any
compiler runs, published to after.

``choose_route`` decides everything about where a build's graph comes from, once per build,
from the trace, the options, the device, whether the build is in the background and the
compilers that failed a graph of its kind before (Route.failures): the options inductor
gets, the compilers to try in order, and the store. Nothing else decides it.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from shapecache._backends.entry import described

if TYPE_CHECKING:
    from shapecache._backends.compile_process import SavedProgram
    from shapecache._backends.package_store import PackageStore
    from shapecache._backends.trace import Trace


class CompiledGraph(NamedTuple):
    """What a compiler or the package store gives for a trace."""

    run: Callable  # the call's tensors in key order -> the output's tensors
    # The tensors the graph holds that the model does not (freezing's folded and packed
    # weights): what the entry holds, measured whatever other threads do meanwhile.
    constants: list
    constant_bytes: int = 0  # bytes it holds besides `constants` (a package's constants file)
    package: str | None = None  # the package file it was loaded from, where it is one
    key: str | None = None  # the key it is stored under in the package store, where it is (compile_on)


class CompilerFailed(Exception):
    """The compiler could not build this graph; the next compiler of the route builds it, with
    a warning that says so (the message: what failed, and what it costs). `lasting`: the
    failure is the graph's own, which the same graph at other sizes would meet too, so that
    their routes pass over this compiler (Route.failures)."""

    def __init__(self, message: str, lasting: bool = False):
        super().__init__(message)
        self.lasting = lasting


class NotForThisGraph(Exception):
    """The compiler cannot build this graph as it is meant (a package of a graph that writes the
    tensors it reads would write its own copies); the next compiler builds it, silently, and
    the same graph's later builds pass over it (lasting, as CompilerFailed's can be)."""


class Compiler(Protocol):
    name: str

    def compile(self, traced: Trace, options: dict, saved: SavedProgram) -> CompiledGraph:
        """`traced`'s graph compiled with inductor `options`. `saved` is the trace's program,
        saved to disk on first use (compile_process.SavedProgram). Raises CompilerFailed or
        NotForThisGraph; the last compiler of a route raises what fails."""
        ...


# torch.compile arguments a traced build understands; any other (a backend other than inductor,
# a mode that captures CUDA graphs) goes to Dynamo (compile.py).
_MODES = (None, "default", "max-autotune-no-cudagraphs")
BACKGROUND_COMPILER = "SHAPECACHE_BACKGROUND_COMPILER"  # "thread": background builds compile in this process


def handles(compile_options: dict) -> bool:
    """Whether a build with `compile_options` (keyword arguments of torch.compile) is traced and
    compiled here (else Dynamo builds it)."""
    if set(compile_options) - {"options", "mode", "fullgraph"}:
        return False
    return compile_options.get("mode") in _MODES


def background_compiler() -> str:
    """Where background builds of frozen graphs compile, as ``SHAPECACHE_BACKGROUND_COMPILER``
    says: "process" (unset, the default) or "thread"; anything else is a ValueError naming the
    variable (checked when a cached object is made: check_settings)."""
    value = os.environ.get(BACKGROUND_COMPILER, "").strip().lower() or "process"
    if value not in ("process", "thread"):
        raise ValueError(f"{BACKGROUND_COMPILER}={os.environ[BACKGROUND_COMPILER]!r}: expected 'process' (a background "
                         "build compiles in a process of its own) or 'thread' (in the serving process)")
    return value


def check_settings(in_background: bool) -> None:
    """Checks, where a cached object is made, the settings its builds' routes read
    (choose_route): where builds are in the background, BACKGROUND_COMPILER; where a build may
    compile in the compiler's process (a background one there, or any where packages are
    shared), that process's idle time and deadline. Raises ValueError naming the variable."""
    from shapecache._backends import package_store

    in_process = in_background and background_compiler() == "process"
    if in_process or os.environ.get(package_store.ENVIRONMENT):
        idle_seconds()
        deadline_ceiling()


IDLE_VARIABLE = "SHAPECACHE_COMPILER_IDLE_S"  # seconds the compiler's process waits for its next build
IDLE_S = 300.0  # its default
DEADLINE_VARIABLE = "SHAPECACHE_COMPILE_DEADLINE_S"  # the most seconds one compile in that process may take
DEADLINE_S = 3600.0  # its default


def idle_seconds() -> float:
    """How long the compiler's process waits for its next build before it ends (IDLE_VARIABLE;
    checked with ``background_compiler``). Raises ValueError naming the variable for a value
    that is not a positive number of seconds."""
    return _seconds(IDLE_VARIABLE, IDLE_S, "the compiler's process waits for its next build")


def deadline_ceiling() -> float:
    """The most seconds a compile in the compiler's process may take before it is killed
    (DEADLINE_VARIABLE; the deadline itself follows the compiles measured: compile_process.
    deadline_seconds). Raises ValueError as idle_seconds does."""
    return _seconds(DEADLINE_VARIABLE, DEADLINE_S, "a compile in the compiler's process may take")


def _seconds(variable: str, default: float, meaning: str) -> float:
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{variable}={os.environ[variable]!r}: expected a positive number of seconds {meaning} "
                         f"(default {default:.0f})")
    return seconds


def inductor_options(compile_options: dict) -> dict:
    """Inductor's options for torch.compile's `compile_options` (its mode's, then its own)."""
    options = dict(compile_options.get("options") or {})
    mode = compile_options.get("mode")
    if mode not in (None, "default"):
        options = {**torch._inductor.list_mode_options(mode), **options}
    return options


@dataclass(frozen=True)
class Route:
    """Where a build's graph comes from (choose_route)."""

    options: dict  # inductor's options for this build
    compilers: tuple  # tried in order: a CompilerFailed or NotForThisGraph moves on to the next
    store: PackageStore | None  # looked up first and published to after; None: not stored
    why: str  # why the first compiler is not the process one, or why nothing is stored ("" where both apply)
    # The process compiler comes first only to make the package the store shares (an inline
    # build): passed over where the package cannot be shared (no key, a directory not writable).
    to_share: bool = False
    # The cached function's record of compilers that failed one of its graphs for good
    # ((compiler name, graph_kind) -> why; BuildContext.failed_compilers), which compile_on adds
    # to: the later routes of a graph of that kind pass them over.
    failures: dict | None = None


def choose_route(traced: Trace, compile_options: dict, in_background: bool, name: str,
                 failures: dict | None = None) -> Route:
    """The route of one build of `traced` (`name`: the cached function's, for a warning;
    `failures`: its record of the compilers that failed a kind of graph for good, Route.failures).

    - Inductor's options are `compile_options`'; freezing is turned off, with a warning, where the
      graph reads weights that are inference tensors (made or loaded under inference_mode):
      they keep no version counter, so a frozen copy would miss an update in place.
    - A graph may be a package where it is a frozen graph (freezing on, grad off) of one
      CPU device, without autocast (export records no casts), whose options are JSON (the
      compiler's process reads them so), without code in inductor's configuration (a custom
      graph pass, a choices class: code of this process's), in a process whose packages work.
      Its options then hold what the build's context set in inductor's configuration.
    - Such a graph compiles in a process of its own where the build is in the background and
      ``SHAPECACHE_BACKGROUND_COMPILER`` is not "thread", and where the build is inline and
      ``SHAPECACHE_SHARED_DIR`` is set: its package is the entry, and is shared as it is (an
      inline build's wait is then the package's compile, where the fleet's next build of
      that graph, on any replica, is a load). It compiles in this process otherwise, and
      whenever the process compiler fails.
    - The package store is used for such a graph where ``SHAPECACHE_SHARED_DIR`` is set.
    - Where the process compiler failed a graph of the same kind for good (the same operators:
      the graph at another size; a compile error, a graph that writes what it reads), the graph
      compiles in this process and the store is neither looked up nor published to: its
      package would fail as that one did, every build again.
    """
    from torch._inductor import config as inductor_config

    from shapecache._backends import compile_process, package_store
    from shapecache._backends.inductor_compiler import INDUCTOR

    options = inductor_options(compile_options)
    if traced.reads_inference_weights and options.get("freezing", inductor_config.freezing):
        options["freezing"] = False
        warnings.warn(f"shapecache: inductor's freezing is off for {name}: its weights are inference tensors (made "
                      "or loaded under torch.inference_mode()), which keep no version counter, so an update in place "
                      "(load_state_dict) would not be seen in a frozen copy; its graphs read the weights where they "
                      "are. Make and load the model outside inference_mode to freeze them.", RuntimeWarning,
                      stacklevel=4)
    why = package_refusal(traced.device, options)
    if why:
        return Route(options, (INDUCTOR,), None, why)
    options = package_options(options)
    if failures and (why := failures.get((compile_process.PROCESS.name, graph_kind(traced)))):
        return Route(options, (INDUCTOR,), None, f"the compiler's process failed this graph of {name} at another "
                     f"size ({why})", failures=failures)
    store = package_store.PackageStore.from_environment()
    compilers = (INDUCTOR,)
    if in_background and background_compiler() == "thread":
        why = f"{BACKGROUND_COMPILER}=thread"
    elif in_background or store is not None:
        compilers = (compile_process.PROCESS, INDUCTOR)
    else:
        why = "the build is inline"
    if store is None:
        why = why or f"{package_store.ENVIRONMENT} is not set"
    return Route(options, compilers, store, why, to_share=not in_background and store is not None, failures=failures)


def graph_kind(traced: Trace) -> str:
    """What a graph shares with the same call's graphs at other sizes, and not with another
    spelling of the call, the module in another mode (training's BatchNorm) or other dtypes:
    its inputs' dtypes and its operators in order. (Shapes are the operators' arguments; where
    a shape changes which operators run, the graph is of another kind.)"""
    nodes = traced.program.graph.nodes
    dtypes = [str(getattr(node.meta.get("val"), "dtype", None)) for node in nodes if node.op == "placeholder"]
    operators = [str(node.target) for node in nodes if node.op == "call_function"]
    return hashlib.sha256("\n".join([*dtypes, "", *operators]).encode()).hexdigest()


def package_options(options: dict) -> dict:
    """Inductor's `options` for a graph that may be a package, with what this context set in
    inductor's configuration: a compiler in another process, or a package compiled later,
    compiles under it too."""
    return {**configured(), **options}


def package_refusal(device: torch.device | None, options: dict) -> str:
    """Why a graph on `device` (None: several) compiled with inductor `options` cannot be a
    package; "" where it can."""
    from torch._inductor import config as inductor_config

    from shapecache._backends import compile_process

    if device is None or device.type != "cpu":
        return "a package is made of a graph on one CPU device"
    if not options.get("freezing", inductor_config.freezing) or torch.is_grad_enabled():
        return "a package is made of a frozen graph (freezing on, grad off)"
    if torch.is_autocast_enabled("cpu"):
        return "the exported graph records no autocast"
    try:
        json.dumps(options)
    except (TypeError, ValueError):
        return "inductor's options are not JSON, which the compiler's process reads"
    code = [name for name in _CODE_SETTINGS if getattr(inductor_config, name, None)]
    if code:  # code of this process's, which neither the compiler's process nor a package key has
        return f"inductor's configuration holds code of this process's (torch._inductor.config.{code[0]})"
    try:
        json.dumps(configured())
    except (TypeError, ValueError, RuntimeError) as error:  # (RuntimeError: torch's, for a setting it cannot save)
        return f"inductor's configuration cannot reach the compiler's process ({described(error)})"
    return compile_process.PROCESS.failed


def configured() -> dict:
    """Inductor's settings that this thread's context holds at other values than a new process
    would (set in code; a TORCHINDUCTOR_* variable is the new process's value too), named as
    ``inductor_configs`` names them, less those that hold code (_CODE_SETTINGS) or do not
    change the code (torch's own selection for its FX graph cache key, ``save_config_portable``).
    By value: a setting set back to its default (as torch's own compiles leave some) is not."""
    from torch._inductor import config as inductor_config

    return {name: value for name, value in inductor_config.save_config_portable().items()
            if value != _new_process_value(inductor_config, name)}


def _new_process_value(config, name: str):
    """What `name` of torch's configuration module `config` holds in a new process of this
    environment: the value its variable forces or sets, else its default (torch 2.13's
    utils/_config_module.py, _ConfigEntry; a field this torch lacks counts as unset)."""
    from torch.utils import _config_module

    entry = getattr(config, "_config", {}).get(name)
    if entry is None:
        return _UNKNOWN
    unset = getattr(_config_module, "_UNSET_SENTINEL", _UNKNOWN)
    for source in ("env_value_force", "env_value_default"):
        value = getattr(entry, source, unset)
        if value is not unset:
            return value
    return getattr(entry, "default", _UNKNOWN)


_UNKNOWN = object()


# Inductor's settings that hold code (torch: _save_config_ignore), which cannot reach another process.
_CODE_SETTINGS = ("pre_grad_custom_pass", "joint_custom_pre_pass", "joint_custom_post_pass", "post_grad_custom_pre_pass",
                  "post_grad_custom_post_pass", "custom_partitioner_fn", "_pre_fusion_custom_pass",
                  "inductor_choices_class")


def compile_on(route: Route, traced: Trace, saved: SavedProgram, owner: Callable) -> CompiledGraph:
    """`traced`'s graph by `route`: the store's package where it has one, else the first of its
    compilers that builds it (a failure of one is warned of, and the next builds; a refusal or a
    lasting failure is recorded in ``route.failures``). Published to the store only where the
    route's first compiler built it: where that one refused the graph or failed, a package of it
    would be refused or fail again. `owner`: the cached function whose ``wait`` waits for the
    publication."""
    from shapecache._backends.package_store import Bypass, writable

    key, options, compilers = None, route.options, route.compilers
    if route.store is not None:
        try:
            key = route.store.key(saved, route.options)
        except Bypass as bypass:
            route.store.log_bypass(bypass)
        else:
            if (found := route.store.lookup(key)) is not None:
                return found._replace(key=key)
            options = route.store.stamped(options, key)
        if route.to_share and (key is None or not writable(route.store.directory, route.store.secret)):
            compilers, key = compilers[1:], None  # (a package made to share that cannot be: compiled here)
    compiled = None
    for position, compiler in enumerate(compilers):
        last = position == len(compilers) - 1
        try:
            compiled = compiler.compile(traced, options, saved)
            if position > 0:
                key = None
            break
        except NotForThisGraph:
            _record(route, compiler, traced, "it writes tensors it reads")
            if last:
                raise
        except CompilerFailed as failure:
            if failure.lasting:
                _record(route, compiler, traced, described(failure.__cause__ or failure))
            if last:
                raise
            warnings.warn(f"shapecache: {failure}", RuntimeWarning, stacklevel=4)
    if key is not None:
        route.store.publish(key, compiled, saved, route.options, owner)
        compiled = compiled._replace(key=key)
    return compiled


def _record(route: Route, compiler: Compiler, traced: Trace, why: str) -> None:
    """Notes in the cached function's record (Route.failures) that `compiler` failed `traced`'s
    graph for good: the later routes of graphs of its kind (graph_kind) pass it over."""
    if route.failures is not None:
        route.failures.setdefault((compiler.name, graph_kind(traced)), why)
