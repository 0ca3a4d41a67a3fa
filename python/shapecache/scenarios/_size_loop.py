"""The out-of-memory scenario of the source reports, as a function: one model asked for many
image sizes in a loop, under a strategy.

    records = size_loop(unet, [(1024, 1024), (1024, 1152), (1360, 1536)], strategy="naive")

Strategies:
  naive          what per-size graph caches do: a new compiled artifact per size, each with
                 its own memory, none ever dropped (CUDA: a CUDA graph per size in a pool of
                 its own; CPU: a torch.compile graph per size)
  torch_compile  CUDA: torch.compile(mode="reduce-overhead", dynamic=False) (CUDA graph trees);
                 CPU: torch.compile with its default dynamic-shape behaviour (a static graph
                 for the first shape, then one dynamic graph)
  shapecache     sc.cached (a module) or sc.wrap (a pipeline) under `budget`; a module on the
                 CPU with backend="compile"

`freezing=True` turns on inductor's freezing (weights folded into each compiled graph, as CPU
inference guides recommend). The naive and torch_compile strategies get it the way their users
set it, process-wide: Dynamo reads that flag when it traces, and only then treats weights as
constants (a per-call ``options={"freezing": True}`` reaches inductor after weights became
graph inputs, and freezes nothing). shapecache gets it as a compile option of its own builds.

Each size gets a record: build seconds (its first call), call seconds (the fastest of the calls after the first),
allocated / reserved / peak bytes after it (shapecache.testing.memory), the cache's evictions and
fallbacks (shapecache only), and the error that ended the loop, if any: like the reported
processes, the loop stops at the first out-of-memory error.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

import shapecache as sc
from shapecache import _timing
from shapecache.scenarios._naive import naive_forward
from shapecache.testing.memory import memory_figures
from shapecache.testing.memory_cap import allocation_failure, out_of_memory

STRATEGIES = ("naive", "torch_compile", "shapecache")
ORDERS = ("given", "largest_first")


@dataclass
class SizeRecord:
    size: tuple
    build_seconds: float = 0.0
    call_seconds: float = 0.0
    allocated: int = 0
    reserved: int = 0
    peak: int = 0
    evictions: int = 0
    fallbacks: int = 0
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """'1024x1024,1152x896' -> [(1024, 1024), (1152, 896)]; a ValueError names what cannot be read."""
    sizes = []
    for item in text.split(","):
        try:
            height, width = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"cannot read {item!r}; expected HEIGHTxWIDTH items such as 1024x1152") from None
        if height < 1 or width < 1:
            raise ValueError(f"{item!r}: height and width must be positive")
        sizes.append((height, width))
    return sizes


def size_loop(model_or_pipe, sizes: Sequence, order: str = "given", strategy: str = "shapecache", budget=None, *,
              batch: int = 1, steps: int = 2, compile_options: dict | None = None,
              inputs: Callable | None = None, freezing: bool = False, repeats: int = 1,
              after_first: Callable[[SizeRecord], None] | None = None) -> list[SizeRecord]:
    """Runs `model_or_pipe` at every size of `sizes` (pixels, (height, width)) under `strategy`.

    Args:
        model_or_pipe: a diffusers pipeline, a UNet2DConditionModel, or any module when
            `inputs(size) -> (args, kwargs)` says how to call it.
        order: "given", or "largest_first" (by pixel count).
        budget: the cache's budget for the shapecache strategy (see shapecache.budget).
        batch: images per call (a UNet's batch is doubled, as with classifier-free guidance).
        steps: denoising steps per pipeline call.
        compile_options: extra torch.compile arguments for every strategy's compiles.
        freezing: inductor's freezing for every strategy (see the module's docstring).
        repeats: calls timed per size after its first; the fastest is its call time.
        after_first: called with the first size's record once it is measured.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {STRATEGIES}")
    if order not in ORDERS:
        raise ValueError(f"order={order!r}: expected one of {ORDERS}")
    sizes = [tuple(s) for s in sizes]
    if order == "largest_first":
        sizes = sorted(sizes, key=lambda s: (s[0] * s[1], s), reverse=True)
    compile_options = dict(compile_options or {})
    is_pipe = hasattr(model_or_pipe, "components") and callable(model_or_pipe) and \
        not isinstance(model_or_pipe, torch.nn.Module)
    module = _denoiser(model_or_pipe) if is_pipe else model_or_pipe
    device = next(module.parameters()).device
    call = _pipeline_call(model_or_pipe, batch, steps) if is_pipe else _module_call(module, batch, inputs)

    undo = _apply(strategy, model_or_pipe, module, is_pipe, device, budget, compile_options, freezing)
    records = []
    try:
        with torch.no_grad():
            for size in sizes:
                record = SizeRecord(size=size)
                records.append(record)
                try:
                    record.build_seconds = _timing.seconds(lambda: call(size), device)
                    record.call_seconds = min(_timing.timings(lambda: call(size), device, repeats))
                except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
                    if not out_of_memory(error):
                        raise
                    record.error = f"{type(error).__name__}: {allocation_failure(error)}"
                figures = memory_figures(device)
                record.allocated, record.reserved, record.peak = figures.allocated, figures.reserved, figures.peak
                if strategy == "shapecache":
                    st = sc.stats(model_or_pipe if is_pipe else module)
                    record.evictions, record.fallbacks = st["evictions"], st["fallbacks"]
                if record.error:
                    break
                if after_first is not None and len(records) == 1:
                    after_first(record)
    finally:
        undo()
    return records


def _denoiser(pipe) -> torch.nn.Module:
    for name in ("unet", "transformer"):
        if isinstance(getattr(pipe, name, None), torch.nn.Module):
            return getattr(pipe, name)
    raise ValueError(f"size_loop: {type(pipe).__name__} has no unet or transformer")


def _pipeline_call(pipe, batch, steps):
    def call(size):
        pipe(prompt=["a photo of a cat"] * batch, height=size[0], width=size[1], num_inference_steps=steps,
             output_type="latent")

    return call


def _module_call(module, batch, inputs):
    if inputs is not None:
        def call(size):
            args, kwargs = inputs(size)
            return module(*args, **kwargs)

        return call
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "cross_attention_dim"):
        raise ValueError(f"size_loop: pass inputs=... to say how to call a {type(module).__name__}")
    from shapecache.diffusers import unet_inputs

    def call(size):  # latents at 1/8 of the pixels, the batch doubled as with classifier-free guidance
        return module(**unet_inputs(module, size[0] // 8, size[1] // 8, 2 * batch))

    return call


def _apply(strategy, model_or_pipe, module, is_pipe, device, budget, compile_options, freezing) -> Callable:
    """Puts `strategy` in place; returns what undoes it."""
    if strategy == "shapecache":
        options = dict(compile_options)
        if freezing:
            options["options"] = {**options.get("options", {}), "freezing": True}
        if is_pipe:
            sc.wrap(model_or_pipe, budget=budget, progress=False)
            return lambda: sc.uncached(model_or_pipe)
        backend = "compile" if device.type == "cpu" else "auto"
        sc.cached(module, budget=budget, backend=backend, compile_options=options)
        return lambda: sc.uncached(module)

    from torch._inductor import config as inductor_config

    frozen_before = inductor_config.freezing
    inductor_config.freezing = frozen_before or freezing

    def undo():
        module.__dict__.pop("forward", None)
        inductor_config.freezing = frozen_before

    if strategy == "torch_compile":
        options = {"mode": "reduce-overhead", "dynamic": False} if device.type == "cuda" else {}
        options.update(compile_options)
        module.forward = torch.compile(module.forward, **options)
        return undo
    module.forward = types.MethodType(naive_forward(type(module).forward, device, compile_options), module)
    return undo
