"""Telling when a module's weights are replaced (see csrc/cache/weight_snapshot.h).

torch calls global module registration hooks whenever any module registers a parameter,
buffer or submodule (``module.weight = nn.Parameter(...)`` included). The hooks installed
here bump a counter that snapshots compare against in C++ on every call. They are installed
with the first snapshot, not at import: a process that never captures a graph pays nothing.
A snapshot reads the module's tensors when it is taken, so registrations before the hooks
existed need no counting.
"""

from __future__ import annotations

import threading

import torch
from torch.nn.modules import module as _module

from shapecache._extension import _C

_hooks_lock = threading.Lock()
_hooks = []  # the handles, once installed


def tensors_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's parameters, then its buffers, in registration order."""
    return [*module.parameters(), *module.buffers()]


def snapshot(module: torch.nn.Module) -> _C.WeightSnapshot:
    """A snapshot of `module`'s weights as they are now (the module is held weakly)."""
    install_registration_hooks()
    return _C.WeightSnapshot(module, tensors_of)


def install_registration_hooks() -> None:
    """Installs the process-wide registration hooks, once."""
    if _hooks:
        return
    with _hooks_lock:
        if not _hooks:
            _hooks.extend([
                _module.register_module_parameter_registration_hook(_bump),
                _module.register_module_buffer_registration_hook(_bump),
                _module.register_module_module_registration_hook(_bump),
            ])


def _bump(*_):
    # While Dynamo traces a forward that registers something, the hook would only break its
    # graph: the registration itself happens when the compiled code runs, and bumps then.
    if not torch.compiler.is_compiling():
        _C.bump_module_generation()
