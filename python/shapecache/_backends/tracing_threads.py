"""torch.fx's tracer patches ``torch.nn.Module.__call__`` and ``__getattr__`` for the whole
process while it traces (``torch.fx._symbolic_trace._Patcher.patch_method``, torch 2.11 to
2.13), and inductor's and AOT autograd's tracers (make_fx) trace with it. A build traces on one
thread while other threads call the user's modules: their calls went into the tracer, and
raised ``NameError: module is not installed as a submodule`` (or read parameters as proxies).
Here those two patches apply to the thread that made them only: on any other thread the
module's own method (whatever was there before the patch) runs. Installed once, by the
compile backend, before its first trace; left alone where torch has no such patcher."""

from __future__ import annotations

import functools
import threading

import torch

_PATCHED_PER_THREAD = ("__call__", "__getattr__")
_installed = False
_install_lock = threading.Lock()


def install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
        try:
            from torch.fx._symbolic_trace import _Patcher
        except ImportError:
            return
        patch_method = getattr(_Patcher, "patch_method", None)
        if patch_method is None:
            return

        @functools.wraps(patch_method)
        def patch_method_for_this_thread(self, cls, name, new_fn, *args, **kwargs):
            if cls is torch.nn.Module and name in _PATCHED_PER_THREAD:
                new_fn = _on_this_thread_only(new_fn, getattr(cls, name))
            return patch_method(self, cls, name, new_fn, *args, **kwargs)

        _Patcher.patch_method = patch_method_for_this_thread


def _on_this_thread_only(patched, before):
    owner = threading.get_ident()

    @functools.wraps(patched)
    def per_thread(*args, **kwargs):
        if threading.get_ident() == owner:
            return patched(*args, **kwargs)
        return before(*args, **kwargs)

    return per_thread
