"""Loads the C++ extension ``shapecache._C``: torch first (the extension links against its
libraries), then a check that the installed torch is the one the extension was built
against. A different torch fails to load with an undefined symbol at best and misbehaves at
worst; this says which two versions met instead. Every module that needs the extension
imports ``_C`` from here.

Loading the extension defines the ``torch.ops.shapecache`` ops and their C++ kernels; their
fake (meta) and autograd registrations are made by ``import shapecache.ops``, which everything
that routes layers through them (``tune_convs``) imports.
"""

from __future__ import annotations

import torch


def _check_torch() -> None:
    try:
        from shapecache import _build_info
    except ImportError:  # an in-tree build without CMake's generated file: nothing to compare
        return
    if _build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"shapecache's C++ extension was built against torch {_build_info.TORCH_VERSION}, but torch "
            f"{torch.__version__} is installed. Rebuild shapecache against the installed torch: "
            "pip install --no-build-isolation --no-deps --force-reinstall <shapecache source>"
        )


_check_torch()

import shapecache._C as _C  # noqa: E402, F401  (what the other modules import from here)
