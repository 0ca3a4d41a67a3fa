"""What torch compiles a graph under besides inductor's options and configuration: settings
that are torch's, per process or per thread, and that change the code inductor generates or
the kernels it picks. Torch's FX graph cache keys each of them (FxGraphHashDetails, 2.11 and
2.13: the default dtype, the deterministic-algorithms settings, the thread count, the matmul
precisions); the package key holds them (package_store.key), and the compiler's process is
given them with each request (compile_process), so that a graph compiled there, or read
from a package, is the one this process would have compiled.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

# The precision settings (torch.backends' fp32_precision, where this torch has them, and the
# reduced-precision reductions): a name each, as the key and the request carry them.
_PRECISIONS = {
    "mkldnn.matmul.fp32_precision": ("mkldnn", "matmul", "fp32_precision"),
    "mkldnn.conv.fp32_precision": ("mkldnn", "conv", "fp32_precision"),
    "cuda.matmul.fp32_precision": ("cuda", "matmul", "fp32_precision"),
    "cuda.matmul.allow_fp16_reduced_precision_reduction": ("cuda", "matmul", "allow_fp16_reduced_precision_reduction"),
    "cuda.matmul.allow_bf16_reduced_precision_reduction": ("cuda", "matmul", "allow_bf16_reduced_precision_reduction"),
}


@dataclass(frozen=True)
class CompileSettings:
    threads: int  # the thread count CPU kernels are generated for
    default_dtype: str  # what factory operations without a dtype make ("float32")
    deterministic: tuple  # torch.use_deterministic_algorithms: (on, warn only)
    fill_uninitialized_memory: bool
    mkldnn: bool  # torch.backends.mkldnn.enabled: freezing's oneDNN rewrites
    precisions: tuple  # (name, value) of _PRECISIONS this torch has

    @classmethod
    def of_this_thread(cls) -> CompileSettings:
        return cls(threads=torch.get_num_threads(),
                   default_dtype=str(torch.get_default_dtype()).removeprefix("torch."),
                   deterministic=(torch.are_deterministic_algorithms_enabled(),
                                  torch.is_deterministic_algorithms_warn_only_enabled()),
                   fill_uninitialized_memory=bool(torch.utils.deterministic.fill_uninitialized_memory),
                   mkldnn=bool(torch.backends.mkldnn.enabled),
                   precisions=tuple((name, value) for name, value in _precisions().items()))

    def as_json(self) -> dict:
        """As the package key and the compiler's requests carry it."""
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> CompileSettings:
        return cls(**{**value, "deterministic": tuple(value["deterministic"]),
                      "precisions": tuple(tuple(p) for p in value["precisions"])})

    def apply(self) -> None:
        """Sets these in this process (the compiler's, before a compile): each where it differs."""
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(getattr(torch, self.default_dtype))
        if self.deterministic != (torch.are_deterministic_algorithms_enabled(),
                                  torch.is_deterministic_algorithms_warn_only_enabled()):
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.utils.deterministic.fill_uninitialized_memory = self.fill_uninitialized_memory
        torch.backends.mkldnn.enabled = self.mkldnn
        now = _precisions()
        for name, value in self.precisions:
            if name in now and now[name] != value:
                *path, attribute = _PRECISIONS[name]
                setattr(functools.reduce(getattr, path, torch.backends), attribute, value)


def _precisions() -> dict:
    found = {}
    for name, path in _PRECISIONS.items():
        try:
            found[name] = functools.reduce(getattr, path, torch.backends)
        except AttributeError:  # (a torch without it)
            continue
    return found
