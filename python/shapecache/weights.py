"""Telling when a module's weights are replaced (see csrc/ops/weight_snapshot.h).

torch calls the global registration hooks installed here whenever any module registers a
parameter, buffer or submodule (``module.weight = nn.Parameter(...)`` included); each bumps a
counter that entries compare against in C++ on every call.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module

from shapecache import _C


def tensors_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's parameters, then its buffers, in registration order."""
    return [*module.parameters(), *module.buffers()]


def snapshot(module: torch.nn.Module) -> _C.WeightSnapshot:
    """A snapshot of `module`'s weights as they are now (the module is held weakly)."""
    return _C.WeightSnapshot(module, tensors_of)


def _bump(*_):
    # While Dynamo traces a forward that registers something, the hook would only break its
    # graph: the registration itself happens when the compiled code runs, and bumps then.
    if not torch.compiler.is_compiling():
        _C.bump_module_generation()


_module.register_module_parameter_registration_hook(_bump)
_module.register_module_buffer_registration_hook(_bump)
_module.register_module_module_registration_hook(_bump)
