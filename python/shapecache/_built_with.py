"""What this copy of shapecache was built with, and why a build on a CUDA torch has no CUDA
code: ``python -m shapecache info`` prints it, and the first CUDA tensor such a build meets
warns once with the fix (its calls run eager, uncached graphs, until it is rebuilt).

CMake decides at build time (CMakeLists.txt, cmake/cuda_paths.py): CUDA code is built where
the installed torch has CUDA and the CUDA headers are found, in a toolkit or in pip's
``nvidia-*`` packages. torch's CUDA wheels do not depend on every package that supplies them
(CUDA 13's crt/ and CCCL headers), so a plain ``pip install`` on a GPU machine can build
CPU-only; CMake's warning then names the packages, but pip shows it only with ``-v``.
"""

from __future__ import annotations

import warnings

import torch

from shapecache._version import __version__


def build_info() -> dict:
    """shapecache's version, the torch it was built against and its CUDA, whether CUDA code
    (CUDA graphs, the cuDNN convolution) was built, and the torch installed now."""
    from shapecache import _build_info
    from shapecache._extension import _C

    return {
        "shapecache": __version__,
        "built_against_torch": _build_info.TORCH_VERSION,
        "built_against_cuda": _build_info.TORCH_CUDA or None,
        "cuda_code": bool(_C.has_cuda_graphs),
        "compiler": getattr(_build_info, "COMPILER", None),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }


def cpu_only_reason(info=None, torch_cuda: str | None = None) -> str | None:
    """Why this build has no CUDA code although torch has CUDA, with the fix; None where it has
    CUDA code or torch has none. `info` is a ``_build_info`` module (CMake's record of its
    decision); `torch_cuda` the installed torch's CUDA version."""
    if info is None:
        from shapecache import _build_info as info
    if torch_cuda is None:
        torch_cuda = torch.version.cuda
    if info.WITH_CUDA or not torch_cuda:
        return None
    # On a CUDA torch the build has CUDA code unless it was asked not to: where the CUDA headers
    # are missing, it stops (CMakeLists.txt), and another torch is refused at import.
    why = "it was built with SHAPECACHE_CPU_ONLY=ON" if info.CPU_ONLY_ASKED else "its build recorded no CUDA code"
    return (f"this shapecache has no CUDA code although torch {torch.__version__} has CUDA {torch_cuda}: {why}. "
            "Calls on CUDA tensors run eager, with no CUDA graphs; to build the CUDA code, rebuild it without "
            "SHAPECACHE_CPU_ONLY (pip install --no-build-isolation --no-deps --force-reinstall <shapecache source>)")


_warned = False


def warn_if_cpu_only_on_cuda() -> None:
    """Warns once per process, at the first CUDA tensor a cache meets, when this build has no CUDA
    code although torch has CUDA."""
    global _warned
    if _warned:
        return
    _warned = True
    reason = cpu_only_reason()
    if reason is not None:
        warnings.warn(f"shapecache: {reason}", RuntimeWarning, stacklevel=3)
