"""The public wrapper: ``cached``, ``uncached``, ``stats``, ``clear``.

``cached`` works like ``torch.compile``: bare (``@cached``), with keyword-only options
(``@cached(budget="8GiB")``), on a function, on a method in a class body (each instance gets
its own cache) and on an ``nn.Module`` (its forward is wrapped in place; the module is
returned). ``disable=True`` or ``SHAPECACHE_DISABLE=1`` makes it return what it was given.

What shapecache did to an object is kept in one holder on it, ``obj._shapecache`` (a
``CacheHolder``: a cached module's, or a wrapped pipeline's), which ``stats``, ``clear`` and
``uncached`` read; a cached function is its own holder.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypedDict, TypeVar, Unpack, overload

import torch

from shapecache import _background, _checks
from shapecache._backends import (
    BACKENDS,
    GRAPH_BACKENDS,
    BuildContext,
    builds_in_background,
    check_available,
    check_compiler_settings,
    compiler_resident_bytes,
    make_builder,
    release_device_memory,
)
from shapecache._extension import _C
from shapecache._holder import HOLDER, CacheHolder, holder_on
from shapecache.buckets import call_on_fake_tensors, check_buckets, positional_parameter_names, resolve_buckets
from shapecache.budget import Budget, format_bytes, parse_budget
from shapecache.statistics import CacheStats

__all__ = ["CachedFunction", "cached", "clear", "stats", "uncached", "wait"]


def disabled_by_environment() -> bool:
    """Whether SHAPECACHE_DISABLE asks every wrapper to be a passthrough."""
    return _checks.environment_flag("SHAPECACHE_DISABLE")


@dataclass(frozen=True)
class CacheOptions:
    """The options of one cache, checked once when it is made."""

    budget: Budget
    backend: str = "auto"
    buckets: Mapping | None = None
    max_entries: int | None = None
    compile_options: dict = field(default_factory=dict)
    tune_convs: bool = False
    build: str = "inline"
    upgrade: bool = False

    @classmethod
    def from_arguments(
        cls, *, budget, backend, buckets, max_entries, compile_options, tune_convs=False, build="inline",
        upgrade=False,
    ) -> CacheOptions:
        parsed = parse_budget(budget)
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {', '.join(repr(b) for b in BACKENDS)}")
        if max_entries is not None:
            _checks.positive_int("max_entries", max_entries, "or None for no count limit")
        check_buckets(buckets)
        if compile_options is None:
            compile_options = {}
        if not isinstance(compile_options, Mapping):
            raise TypeError(f"compile_options={compile_options!r}: expected a dict of torch.compile keyword arguments")
        if compile_options and backend not in ("compile", "compile+cuda_graph"):
            raise ValueError(
                f"compile_options were given with backend={backend!r}, which compiles nothing; "
                "use backend='compile' or 'compile+cuda_graph'"
            )
        if backend in GRAPH_BACKENDS and compile_options.get("mode") in ("reduce-overhead", "max-autotune"):
            raise ValueError(
                f"compile_options: mode={compile_options['mode']!r} captures CUDA graphs of its own, inside the ones "
                f"backend={backend!r} captures; use mode='max-autotune-no-cudagraphs' or 'default'"
            )
        inductor_options = compile_options.get("options")
        if backend in GRAPH_BACKENDS and isinstance(inductor_options, Mapping) and inductor_options.get("freezing"):
            raise ValueError(
                f"compile_options: freezing folds a copy of the weights into every bucket's graph (on a GPU one copy per "
                f"size, about 5 GB each for an SDXL UNet in fp16); backend={backend!r} compiles graphs that read the "
                "weights where they are: leave freezing out"
            )
        if "dynamic" in compile_options:
            raise ValueError(
                "compile_options: 'dynamic' is fixed to False; shapecache compiles one static graph per bucket"
            )
        _checks.boolean("tune_convs", tune_convs)
        if build not in BUILDS:
            raise ValueError(f"build={build!r}: expected 'inline' (a miss waits for its build) or 'background' (a "
                             "miss runs uncached while a worker thread builds)")
        check_compiler_settings(in_background=build == "background")
        _checks.boolean("upgrade", upgrade)
        if upgrade and backend != "auto":
            raise ValueError(f"upgrade=True was given with backend={backend!r}; it upgrades what backend='auto' "
                             "builds to a compiled graph where that is faster: use backend='auto', or leave upgrade "
                             "out")
        check_available(backend)  # last: the options are checked even where the backend cannot run
        return cls(parsed, backend, buckets, max_entries, dict(compile_options), tune_convs, build, upgrade)


BUILDS = ("inline", "background")


class CachedFunction(_C.ShapeDispatcher, CacheHolder):
    """A function whose calls are served per shape bucket (the call itself runs in C++,
    csrc/cache/shape_dispatcher.cpp). A cached function is its own holder."""

    def __init__(
        self, function: Callable, options: CacheOptions, *, owner=None, key_training: bool = False, cache=None
    ):
        self.options = options
        has_owner = owner is not None
        buckets = resolve_buckets(function, options.buckets, skip_first=has_owner)
        names = positional_parameter_names(function, skip_first=has_owner)
        if cache is None:  # a cache of its own; functions given one share its budget
            cache = make_cache(options)
        context = BuildContext(has_owner, tuple(names), options.compile_options, options.upgrade)
        builder = make_builder(function, options.backend, context)
        if options.tune_convs:
            builder = _charging_workspace(builder)
        background = None
        if options.build == "background":
            background = functools.partial(builds_in_background, options.backend)
        super().__init__(function, builder, cache, buckets, names, owner, key_training, background,
                         release_device_memory=release_device_memory, wake_build_worker=_background.wake,
                         run_on_fake_tensors=call_on_fake_tensors)
        functools.update_wrapper(self, function)
        if has_owner:  # called bound: the signature callers see has no `self`, as a bound method's has not
            try:
                signature = inspect.signature(function)
                self.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
            except (TypeError, ValueError):
                pass

    def __get__(self, instance, owner_type=None):
        # Decorated in a class body: each instance gets a cache of its own, stored on the
        # instance under the method's name so that later lookups skip this descriptor.
        if instance is None:
            return self
        if type(instance).__weakrefoffset__ == 0:
            raise TypeError(
                f"shapecache.cached on {type(instance).__name__}.{self.__name__}: the instance is held weakly by its "
                f"cache, and {type(instance).__name__} defines __slots__ without '__weakref__'; add '__weakref__' "
                "to its __slots__"
            )
        bound = CachedFunction(
            self.function, self.options, owner=instance, key_training=isinstance(instance, torch.nn.Module)
        )
        try:
            instance.__dict__[self.__name__] = bound
        except AttributeError:
            pass  # no __dict__: a new cache per attribute access would be useless
        return bound

    def stats(self) -> CacheStats:
        out = super().stats()
        budgets = [figures["budget"] for figures in out["devices"].values()]
        out["budget"] = budgets[0] if budgets else None
        out["backend"] = self.options.backend
        out["compiler_bytes"] = compiler_resident_bytes()
        return out

    def dispatchers(self) -> list:
        return [self]

    def uncache(self):
        self.clear()
        return self.__wrapped__

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"{self!r} cannot be copied or pickled: its compiled entries belong to this process. To copy or save a "
            "cached module, call shapecache.uncached(module) first, copy or save it, then cache each copy"
        )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<shapecache.cached {getattr(self, '__qualname__', '?')}: {len(s['entries'])} entries, "
            f"{format_bytes(s['bytes'])} held, budget {self.options.budget}>"
        )


@dataclass
class ModuleHolder(CacheHolder):
    """A cached module's state: its wrapped forward and what to restore."""

    module: torch.nn.Module
    wrapper: CachedFunction  # also the module's instance-level forward
    previous_forward: Callable | None  # the instance-level forward before, if any
    tuned_convs: object | None = None  # a TunedConvs handle, with tune_convs=True

    def stats(self) -> CacheStats:
        return self.wrapper.stats()

    def dispatchers(self) -> list:
        return [self.wrapper]

    def clear(self) -> None:
        self.wrapper.clear()

    def uncache(self):
        self.wrapper.clear()
        if self.tuned_convs is not None:
            self.tuned_convs.uncache()
        # Someone may have set another forward since (a hook library): theirs stays.
        if self.module.__dict__.get("forward") is self.wrapper:
            if self.previous_forward is None:
                del self.module.__dict__["forward"]
            else:
                self.module.__dict__["forward"] = self.previous_forward
        self.module.__dict__.pop(HOLDER, None)
        return self.module


def _charging_workspace(builder):
    """`builder`, then the device's convolution workspace charged to the cache's budget."""

    def build(args, kwargs, handle):
        entry = builder(args, kwargs, handle)
        handle.set_shared_bytes(workspace=_C.workspace_stats(handle.device)["bytes"])
        return entry

    return build


def make_cache(options: CacheOptions):
    """An empty cache: one budget domain, shared by the functions built with it."""
    return _C.ShapeCache(options.budget.bytes_for, options.max_entries)


_Wrapped = TypeVar("_Wrapped", bound=Callable)


class CachedOptions(TypedDict, total=False):
    """``cached``'s keyword options, as its overloads type them (see ``cached`` for each)."""

    budget: int | float | str | None
    backend: str
    buckets: Mapping | None
    max_entries: int | None
    compile_options: Mapping | None
    tune_convs: bool
    build: str
    upgrade: bool
    disable: bool


@overload
def cached(function: None = None, /, **options: Unpack[CachedOptions]) -> Callable[[_Wrapped], _Wrapped]: ...
@overload
def cached(function: _Wrapped, /, **options: Unpack[CachedOptions]) -> _Wrapped: ...
def cached(
    function=None,
    /,
    *,
    budget=None,
    backend: str = "auto",
    buckets: Mapping | None = None,
    max_entries: int | None = None,
    compile_options: Mapping | None = None,
    tune_convs: bool = False,
    build: str = "inline",
    upgrade: bool = False,
    disable: bool = False,
):
    """Serve `function` (or an ``nn.Module``'s forward) from one compiled entry per shape bucket.

    Args:
        budget: bytes the cache may hold per device: an int, a string ("20GiB", "80%"), a
            float fraction in (0, 1] of the device's memory, or None (SHAPECACHE_BUDGET, else
            half of the device's memory). Least recently used entries are evicted to stay
            under it.
        backend: "auto", "eager", "compile", "cuda_graph" or "compile+cuda_graph".
        buckets: {argument: {dimension: policy}}; unlisted dimensions are exact.
        max_entries: at most this many entries per device (None: no count limit).
        compile_options: keyword arguments for torch.compile (mode, backend, options, ...).
        tune_convs: route the module's Conv2d layers through shapecache's tuned convolution
            (shapecache.tune_convs, default records file); its workspace counts against the budget.
        build: "inline": a miss waits for its bucket's build. "background": a miss runs the
            call uncached at once and queues the build for the device's worker thread; the
            bucket's calls run uncached until its entry is ready (``shapecache.wait`` waits for
            them). CUDA graphs are captured inline either way.
        upgrade: with backend "auto": once a bucket's entry is built, a worker thread compiles
            the bucket with inductor (freezing off: no copy of the weights) and measures both;
            the compiled form replaces the entry where it is at least 3% faster and fits in the
            budget's free room (docs/backends.md). ``shapecache.wait`` waits for upgrades too.
        disable: return `function` unchanged.

    Returns:
        A callable with the function's signature; for a module, the module itself.
    """
    options = CacheOptions.from_arguments(
        budget=budget, backend=backend, buckets=buckets, max_entries=max_entries, compile_options=compile_options,
        tune_convs=tune_convs, build=build, upgrade=upgrade,
    )
    _checks.boolean("disable", disable)
    if function is None:
        return lambda f: _cache(f, options, disable)
    return _cache(function, options, disable)


def _cache(function, options: CacheOptions, disable: bool):
    if isinstance(function, CachedFunction):
        raise ValueError(f"{function!r} is cached already; call shapecache.uncached on it first")
    if not callable(function):
        raise TypeError(f"cached: expected a function or an nn.Module, got {function!r} ({type(function).__name__})")
    if disable or disabled_by_environment():
        return function
    if isinstance(function, torch.nn.Module):
        return cache_module(function, options)
    if options.tune_convs:
        raise ValueError("tune_convs=True needs an nn.Module (its Conv2d layers are routed); got a function")
    return CachedFunction(function, options)


def cache_module(module: torch.nn.Module, options: CacheOptions, cache=None) -> torch.nn.Module:
    """Wraps `module`'s forward in place (into `cache`, or a cache of its own); returns it."""
    if holder_on(module) is not None:
        raise ValueError(f"{type(module).__name__} is cached already; call shapecache.uncached on it first")
    own_forward = module.__dict__.get("forward")
    if own_forward is None:
        # The class's forward, called with the module held weakly (see ShapeDispatcher in C++).
        forward = type(module).forward
        if isinstance(forward, CachedFunction):  # decorated in the class body
            forward = forward.function
        wrapper = CachedFunction(forward, options, owner=module, key_training=True, cache=cache)
    else:
        # Someone set an instance-level forward (a hook library, say): wrap it as it is.
        wrapper = CachedFunction(own_forward, options, cache=cache)
    holder = ModuleHolder(module, wrapper, own_forward)
    if options.tune_convs:
        from shapecache.ops import tune_convs

        holder.tuned_convs = tune_convs(module)
    module.forward = wrapper
    module.__dict__[HOLDER] = holder
    return module


def holder_of(obj, what: str):
    """The holder of what shapecache did to `obj`, or a TypeError naming `what`."""
    if isinstance(obj, CacheHolder):  # a cached function, a TunedConvs handle
        return obj
    holder = holder_on(obj)
    if holder is not None:
        return holder
    if isinstance(obj, torch.nn.Module) and isinstance(obj.__dict__.get("forward"), CachedFunction):
        return obj.__dict__["forward"]  # a forward decorated in the class body, bound to this instance
    hint = " (SHAPECACHE_DISABLE is set, so nothing is cached)" if disabled_by_environment() else ""
    raise TypeError(
        f"{what}: expected a function or module wrapped by shapecache.cached, or a pipeline wrapped by "
        f"shapecache.wrap, got {type(obj).__name__}{hint}"
    )


def stats(obj) -> CacheStats:
    """Counters and holdings of a cached function or module, or of a wrapped pipeline
    (``shapecache.PipelineStats``). Every key is defined in ``shapecache.statistics``."""
    return holder_of(obj, "stats").stats()


def wait(obj, timeout: float | None = None) -> bool:
    """Waits until the background builds of a cached function, module or wrapped pipeline
    have ended (built, failed or dropped), and the packages its builds publish to the shared
    directory are published. Returns False if `timeout` seconds passed first."""
    if timeout is not None:
        _checks.non_negative_number("timeout", timeout, "seconds, or None to wait as long as it takes")
    return _background.wait(holder_of(obj, "wait").dispatchers(), timeout)


def entries_served() -> _C.EntriesServed:
    """A context manager that notes, by entry id, the entries the cached calls on this thread
    serve inside its block: ``used`` (hits) and ``built`` (built inline by a call)."""
    return _C.EntriesServed()


def clear(obj) -> None:
    """Drops every entry of a cached function, module or wrapped pipeline (entries that are
    running stay)."""
    holder_of(obj, "clear").clear()


def uncached(obj):
    """Undoes what shapecache did to `obj`; returns the original.

    - a cached function: drops its entries, returns the function;
    - a cached module or wrapped pipeline: restores its forwards, returns it;
    - a ``TunedConvs`` handle (``sc.tune_convs``): restores every routed layer, returns the module.
    """
    if isinstance(obj, torch.nn.Module) and isinstance(type(obj).__dict__.get("forward"), CachedFunction):
        raise ValueError(
            f"{type(obj).__name__}.forward is decorated with shapecache.cached in its class body; "
            "remove the decorator to run it uncached"
        )
    return holder_of(obj, "uncached").uncache()
