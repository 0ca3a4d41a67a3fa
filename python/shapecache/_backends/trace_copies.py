"""What a trace does to the user's objects, and how they are left as the plain call leaves them.

Non-strict export swaps fake tensors into the modules it traces, so a trace runs on detached
copies of the call's module trees (``DetachedTrees``): new module objects whose dicts are
copies, sharing the live tensors and plain objects. Any thread may call the live model meanwhile.
What the copies share with the live model (a helper's lazy cache, a list the model appends to)
the trace may still write, and code that refers back to a live module (diffusers' hook registry)
may leave fake tensors in it: both are put back after the trace (``put_back_shared``,
``LiveTensors``), leaving alone what another thread wrote since.
"""

from __future__ import annotations

import types
from collections import OrderedDict

import torch

from shapecache._extension import _C
from shapecache._holder import holder_on

_ABSENT = object()


class DetachedTrees:
    """Copies of module trees for tracing: new module objects whose dicts (attributes,
    parameters, buffers, submodules, hooks) are copies, holding the same tensors and plain
    objects. A module shared in a tree is copied once; a cached module's copy has its own
    forward back. Each copy notes in `ran` when its forward runs (a hook in the copy's own
    hook dict: nothing process-wide, nothing the live model holds)."""

    def __init__(self):
        self._copies: dict[int, torch.nn.Module] = {}  # id(live module) -> its copy
        self._live: dict[int, torch.nn.Module] = {}  # id(copy) -> the live module
        self.ran: dict[int, torch.nn.Module] = {}  # the copies whose forward ran: id -> copy

    def live(self, module: torch.nn.Module) -> torch.nn.Module:
        """The live module of a copy; a module that is no copy (reached through a global) itself."""
        return self._live.get(id(module), module)

    def of(self, module: torch.nn.Module) -> torch.nn.Module:
        copy = self._copies.get(id(module))
        if copy is not None:
            return copy
        copy = object.__new__(type(module))
        self._copies[id(module)] = copy
        self._live[id(copy)] = module
        state = {name: (type(value)(value) if type(value) in (dict, OrderedDict) else value)
                 for name, value in module.__dict__.items()}
        holder = holder_on(module)
        if holder is not None:
            state.pop("_shapecache", None)
            if getattr(holder, "wrapper", None) is state.get("forward"):
                previous = getattr(holder, "previous_forward", None)
                if previous is None:
                    del state["forward"]
                else:
                    state["forward"] = previous
        if isinstance(state.get("forward"), _C.ShapeDispatcher):  # decorated in its class body, bound here
            del state["forward"]
        declared = getattr(type(module), "forward", None)
        if isinstance(declared, _C.ShapeDispatcher):  # the copy runs the decorated function itself
            state["forward"] = types.MethodType(declared.function, copy)
        state["_modules"] = type(state["_modules"])(
            (name, None if child is None else self.of(child)) for name, child in state["_modules"].items())
        object.__setattr__(copy, "__dict__", state)
        copy.register_forward_pre_hook(self._note)
        return copy

    def _note(self, module, _args):
        self.ran[id(module)] = module



class LiveTensors:
    """The parameters and buffers of the live module trees, to put back the fake tensors a
    trace left in them. The copies have dicts of their own: only code that refers back to a
    live module writes these, as diffusers' hook registry does (its forward is bound to the
    live module, and layerwise casting's hook calls `module.to()` on it). A real tensor
    written meanwhile is another thread's, and is kept."""

    def __init__(self, roots):
        self._dicts = [(f"{path}.{name}".rstrip("."), d, dict(d)) for path, root in roots.items()
                       for name, module in root.named_modules(remove_duplicate=True)
                       for d in (module._parameters, module._buffers)]

    def put_back(self) -> list[str]:
        """Puts back each item the trace replaced with a fake tensor; names them."""
        changed = []
        for path, d, before in self._dicts:
            for key in [k for k, v in d.items() if v is not before.get(k) and is_fake_tensor(v)]:
                changed.append(f"{path}.{key}")
                old = before.get(key, _ABSENT)
                if old is _ABSENT:
                    d.pop(key, None)
                elif not is_fake_tensor(old):  # never a fake one back
                    d[key] = old
        return changed



def snapshot(container):
    """The items of a dict or list as they are stored, as a plain dict or list: not through
    the container's own methods, which a subclass may override (transformers' ``ACT2FN`` makes a
    new module on each lookup)."""
    return dict.copy(container) if isinstance(container, dict) else list.copy(container)


def changed_items(before, after) -> list:
    """What changed between two snapshots of one container: (key, value now) of each key of a
    dict added, replaced or removed (_ABSENT), or (None, item) of each item of a list that is
    new; empty where nothing did."""
    if isinstance(after, dict):
        return [(key, after.get(key, _ABSENT)) for key in [*before, *(k for k in after if k not in before)]
                if before.get(key, _ABSENT) is not after.get(key, _ABSENT)]
    if len(after) == len(before) and all(a is b for a, b in zip(after, before, strict=True)):
        return []
    held = {id(item) for item in before}
    return [(None, item) for item in after if id(item) not in held] or [(None, _ABSENT)]


def is_leftover(key, value) -> bool:
    """Whether a change a trace made is its own leftover rather than the call's write: a fake
    tensor, or an entry keyed by a fake tensor's type (a library's memo of the tensor types it
    has seen, as einops' backend table)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return is_fake_tensor(value) or (isinstance(key, type) and issubclass(key, FakeTensor))


def put_back_shared(shared: list, written: list | None, keep_writes: bool = False) -> None:
    """Puts back what the trace wrote into the dicts and lists the copies share with the live
    model (a helper's lazy cache and its "last length", a list the model appends to): every
    key the trace changed, together, so that none is left out of step with its neighbours.
    `shared`: (container, its items before the trace); `written`: their items as the traced
    call ended (None where it did not end: then what changed by now counts as the trace's).
    A value changed again since the traced call ended is another thread's, and is kept; a
    write another thread made during the trace itself cannot be told from the trace's, and is
    undone with it (trace._apart_from_other_threads keeps them apart, or says it could not:
    then `keep_writes`). The trace's writes are reported by the guard over the Python state,
    and the bucket then runs uncached. No container is emptied on the way: another thread may
    read it meanwhile. `keep_writes`: the trace's writes stay (as the plain call's would),
    except in a container that holds a leftover of the trace (is_leftover), which is put back
    whole, so that nothing is left out of step with a value put back."""
    for i, (container, before) in enumerate(shared):
        after = written[i] if written is not None else snapshot(container)
        changes = changed_items(before, after)
        if not changes or (keep_writes and not any(is_leftover(key, value) for key, value in changes)):
            continue
        if isinstance(container, dict):
            for key, traced in changes:
                if dict.get(container, key, _ABSENT) is not traced:
                    continue  # changed again since
                if (old := before.get(key, _ABSENT)) is _ABSENT:
                    container.pop(key, None)
                else:
                    container[key] = old
        elif len(container) == len(after) and all(a is b for a, b in zip(container, after, strict=True)):
            container[:] = before


def is_fake_tensor(value) -> bool:
    """Whether `value` is a fake tensor (a trace's, which nothing outside it may keep)."""
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(value, torch.Tensor) and is_fake(value)

