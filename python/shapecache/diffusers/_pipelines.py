"""``sc.wrap(pipe)``: cache a diffusers pipeline's denoiser and VAE decoder under one budget,
and build every size's entries before the first request, largest first. The pipeline keeps
what was done in a ``PipelineHolder`` (``pipe._shapecache``), which ``sc.stats``,
``sc.clear`` and ``sc.uncached`` read.

Largest first because memory that later entries reuse (allocator blocks, a shared graph
pool, a convolution workspace) then reaches its final size on the first build; built
smallest first, each larger size allocates again and the earlier, smaller blocks cannot
serve it.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from shapecache import _checks, _timing
from shapecache._backends import builds_in_background, compiler_resident_bytes, disk_cache_counts, disk_cache_state
from shapecache._extension import _C
from shapecache._holder import HOLDER, CacheHolder, holder_on
from shapecache.buckets import check_buckets
from shapecache.budget import format_bytes
from shapecache.cache import CacheOptions, cache_module, disabled_by_environment, make_cache, uncached
from shapecache.diffusers._families import Family, family_of
from shapecache.statistics import PipelineStats

logger = logging.getLogger("shapecache")


@dataclass
class PipelineHolder(CacheHolder):
    """What ``wrap`` did to a pipeline, kept on it as ``pipe._shapecache``."""

    pipe: object
    family: Family
    options: CacheOptions
    cache: object  # the _C.ShapeCache that the components share
    components: dict  # name -> cached module: "denoiser", "vae_decoder"
    prewarmed: list = field(default_factory=list)  # one record per size built, in build order

    def stats(self) -> PipelineStats:
        """The cache's totals, each component's stats, the pre-warm records and device memory."""
        totals = self.cache.stats()
        # A component uncached on its own since is left out.
        components = {name: holder_on(module).stats() for name, module in self.components.items()
                      if holder_on(module) is not None}
        budgets = [figures["budget"] for figures in totals["devices"].values()]
        totals["budget"] = budgets[0] if budgets else None
        totals["backend"] = self.options.backend
        totals["compiler_bytes"] = compiler_resident_bytes()
        totals["components"] = components
        totals["prewarmed"] = list(self.prewarmed)
        totals["memory"] = device_memory(totals["devices"])
        for counter in (*_C.FUNCTION_COUNTERS, "pending_builds"):
            totals[counter] = sum(c[counter] for c in components.values())
        return totals

    def clear(self) -> None:
        for module in self.components.values():
            if holder_on(module) is not None:  # each component's clear also cancels its background builds
                holder_on(module).clear()
        self.cache.clear()

    def dispatchers(self) -> list:
        return [d for module in self.components.values() if holder_on(module) is not None
                for d in holder_on(module).dispatchers()]

    def uncache(self):
        for module in self.components.values():
            if holder_on(module) is not None:  # a component uncached on its own already stays so
                uncached(module)
        object.__getattribute__(self.pipe, "__dict__").pop(HOLDER, None)
        return self.pipe


def wrap(
    pipe,
    sizes: Iterable | None = None,
    *,
    budget=None,
    backend: str = "auto",
    compile_options: dict | None = None,
    buckets: Mapping | None = None,
    tune_convs: bool = False,
    prewarm: bool = True,
    max_entries: int | None = None,
    batch_size: int = 1,
    guidance: bool | None = None,
    text_length: int | None = None,
    progress: bool | None = None,
    build: str = "inline",
    upgrade: bool = False,
):
    """Caches `pipe`'s denoiser and VAE decoder under one `budget`; returns `pipe`.

    Args:
        sizes: (height, width) pairs to build before the first call (any order, duplicates
            allowed); built largest first when `prewarm` is true. See ``prewarm`` for
            `batch_size`, `guidance`, `text_length` and `progress`.
        budget, backend, compile_options, max_entries: as for ``sc.cached``; the budget covers
            both components.
        buckets: per component, as ``sc.cached`` takes them for that component's forward:
            ``{"denoiser": {"sample": {2: sc.multiple_of(16), 3: sc.multiple_of(16)}}}`` pads
            a UNet's latents so that nearby sizes share one entry ("vae_decoder" for the
            decoder). docs/buckets.md says what padding changes.
        tune_convs: route both components' Conv2d layers through the tuned convolution.
            Pre-warming then tunes every size's convolutions before the first call.
        build: as for ``sc.cached``. With "background", pre-warming queues each size's
            builds, largest first, and returns at once; ``sc.wait(pipe)`` waits for them.
            (CUDA graphs are captured inline: with them, pre-warming waits as inline does.)
        upgrade: as for ``sc.cached``: each size's entries are upgraded to compiled graphs in
            the background where that is faster; ``sc.wait(pipe)`` waits for the upgrades.
    """
    family = family_of(pipe)
    if isinstance(holder_on(pipe), PipelineHolder):
        raise ValueError(f"{type(pipe).__name__} is wrapped already; call shapecache.uncached(pipe) first")
    options = CacheOptions.from_arguments(
        budget=budget, backend=backend, buckets=None, max_entries=max_entries, compile_options=compile_options,
        tune_convs=tune_convs, build=build, upgrade=upgrade,
    )
    checked_sizes = _check_sizes(pipe, family, sizes) if sizes is not None else []
    components = {"denoiser": getattr(pipe, family.denoiser_attribute)}
    decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
    if isinstance(decoder, torch.nn.Module):
        components["vae_decoder"] = decoder
    buckets_of = _check_component_buckets(buckets, components)
    if disabled_by_environment():  # checked like any call, then left alone
        return pipe
    for name, module in components.items():
        if holder_on(module) is not None:
            raise ValueError(f"the pipeline's {name} is cached already; call shapecache.uncached on it first")

    cache = make_cache(options)
    wrapped = []
    for name, module in components.items():
        try:
            cache_module(module, dataclasses.replace(options, buckets=buckets_of.get(name)), cache)
        except BaseException as error:  # nothing is left half-wrapped
            for done in wrapped:
                uncached(done)
            if isinstance(error, (TypeError, ValueError)) and name in buckets_of:  # a bucket the forward lacks
                raise type(error)(f"buckets[{name!r}]: {str(error).removeprefix('buckets: ')}") from None
            raise
        wrapped.append(module)
    object.__setattr__(pipe, HOLDER, PipelineHolder(pipe, family, options, cache, components))
    if prewarm and checked_sizes:
        _prewarm(pipe, checked_sizes, batch_size, guidance, text_length, progress)
    return pipe


def _check_component_buckets(buckets, components: dict) -> dict:
    """`buckets` of wrap: None, or a dict from component names to what ``sc.cached`` takes."""
    if buckets is None:
        return {}
    if not isinstance(buckets, Mapping):
        raise TypeError(f"buckets={buckets!r}: expected a dict from a component ({', '.join(map(repr, components))}) "
                        "to its buckets, e.g. {'denoiser': {'sample': {2: sc.multiple_of(16), 3: sc.multiple_of(16)}}}")
    for name, component_buckets in buckets.items():
        if name not in components:
            raise ValueError(f"buckets={buckets!r}: {name!r} is not a component of this pipeline; "
                             f"expected {' or '.join(map(repr, components))}")
        try:
            check_buckets(component_buckets)
        except TypeError as error:
            raise TypeError(f"buckets[{name!r}]: {error}") from None
    return dict(buckets)


def prewarm(pipe, sizes: Iterable, *, batch_size: int = 1, guidance: bool | None = None,
            text_length: int | None = None, progress: bool | None = None) -> list:
    """Builds the entries of `sizes` for a wrapped pipeline, largest pixel count first (of two
    sizes with as many pixels, the taller first).

    Args:
        sizes: (height, width) pairs in pixels, each a multiple of the VAE's factor.
        batch_size: images per pipeline call (batch size x num_images_per_prompt).
        guidance: whether calls use classifier-free guidance (doubling the denoiser's batch);
            None: the family's default (SD, SDXL, SD3: yes; Flux: no).
        text_length: tokens in the prompt embeddings; None: what the pipeline's tokenizers make.
        progress: show a progress bar; None: only when stderr is a terminal.

    Returns:
        The records of this call's sizes: {size, batch, seconds, bytes}, in build order.
    """
    state = holder(pipe, "prewarm")
    return _prewarm(pipe, _check_sizes(pipe, state.family, sizes), batch_size, guidance, text_length, progress)


def holder(pipe, what: str) -> PipelineHolder:
    found = holder_on(pipe)
    if not isinstance(found, PipelineHolder):
        raise TypeError(f"{what}: expected a pipeline wrapped by shapecache.wrap, got {type(pipe).__name__}")
    return found


def device_memory(devices: Iterable[str]) -> dict:
    """CUDA allocator figures of each CUDA device the cache has used, read now."""
    figures = {}
    for name in devices:
        device = torch.device(name)
        if device.type == "cuda":
            figures[name] = {
                "memory_allocated": torch.cuda.memory_allocated(device),
                "max_memory_allocated": torch.cuda.max_memory_allocated(device),
                "memory_reserved": torch.cuda.memory_reserved(device),
            }
    return figures


def _check_sizes(pipe, family: Family, sizes) -> list:
    """Sizes as (height, width) ints, deduplicated, largest pixel count first."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise TypeError(f"sizes={sizes!r}: expected a list of (height, width) pairs such as [(1024, 1024), (1152, 896)]")
    multiple = family.size_multiple(pipe)
    checked = []
    for index, size in enumerate(sizes):
        try:
            height, width = size
        except (TypeError, ValueError):
            raise TypeError(f"sizes[{index}]={size!r}: expected a (height, width) pair of ints") from None
        for name, value in (("height", height), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise TypeError(f"sizes[{index}]={size!r}: {name} must be a positive int, got {value!r}")
            if value % multiple:
                raise ValueError(
                    f"sizes[{index}]={size!r}: {name} {value} is not a multiple of {multiple}, which "
                    f"{type(pipe).__name__} needs (its VAE downsamples by that factor); "
                    f"nearest: {value // multiple * multiple or multiple} or {(value // multiple + 1) * multiple}"
                )
        checked.append((height, width))
    return sorted(set(checked), key=lambda hw: (hw[0] * hw[1], hw), reverse=True)


def _prewarm(pipe, sizes, batch_size, guidance, text_length, progress) -> list:
    state = holder(pipe, "prewarm")
    _checks.positive_int("batch_size", batch_size, "the images per pipeline call")
    family = state.family
    use_cfg = family.uses_cfg if guidance is None else bool(guidance)
    denoiser_batch = batch_size * (2 if use_cfg else 1)
    if text_length is None:
        text_length = family.default_text_length(pipe)
    denoiser = state.components["denoiser"]
    decoder = state.components.get("vae_decoder")
    if progress is None:
        progress = sys.stderr.isatty()

    from tqdm.auto import tqdm

    device = next(denoiser.parameters()).device
    if state.options.build == "background" and builds_in_background(state.options.backend, device):
        return _queue_builds(pipe, state, sizes, batch_size, denoiser_batch, text_length)
    records = []
    with torch.no_grad():  # as the pipelines' __call__ run: the autograd mode is part of the key
        for height, width in tqdm(sizes, desc="shapecache prewarm", disable=not progress):
            bytes_before = state.cache.stats()["bytes"]
            compiled_before = disk_cache_counts()
            start = time.perf_counter()
            denoiser(**family.denoiser_inputs(pipe, height, width, denoiser_batch, text_length))
            if decoder is not None:
                decoder(_decoder_input(pipe, decoder, height, width, batch_size))
            _synchronize(denoiser)
            record = {
                "size": (height, width),
                "batch": batch_size,
                "seconds": time.perf_counter() - start,
                "bytes": state.cache.stats()["bytes"] - bytes_before,
                # the on-disk caches for what this size compiled: "warm", "cold", "not cached"
                # (graphs of prepacked frozen weights), "shared package" (", not traced"), or None
                "inductor_cache": disk_cache_state(compiled_before),
            }
            records.append(record)
            state.prewarmed.append(record)
            logger.info(
                "shapecache: warmed %dx%d (batch %d) in %.2f s, %s more held%s",
                height, width, batch_size, record["seconds"], format_bytes(record["bytes"]),
                f", inductor cache {record['inductor_cache']}" if record["inductor_cache"] else "",
            )
    return records


def _queue_builds(pipe, state, sizes, batch_size, denoiser_batch, text_length) -> list:
    """Queues the builds of `sizes`, largest first, for the device's worker; runs nothing.
    Returns no records: the builds end later (``sc.wait``, ``sc.stats``)."""
    family = state.family
    denoiser = state.components["denoiser"]
    decoder = state.components.get("vae_decoder")
    with torch.no_grad():  # the key holds the autograd mode, and the worker builds under the caller's
        for height, width in sizes:
            holder_on(denoiser).wrapper.queue_build(**family.denoiser_inputs(pipe, height, width, denoiser_batch,
                                                                            text_length))
            if decoder is not None:
                holder_on(decoder).wrapper.queue_build(_decoder_input(pipe, decoder, height, width, batch_size))
            logger.info("shapecache: queued the builds of %dx%d (batch %d)", height, width, batch_size)
    return []


def _decoder_input(pipe, decoder, height, width, batch):
    """What AutoencoderKL.decode hands its decoder: latents after post_quant_conv."""
    vae = pipe.vae
    factor = pipe.vae_scale_factor
    parameter = next(decoder.parameters())
    channels = vae.config.latent_channels
    return torch.randn(batch, channels, height // factor, width // factor, device=parameter.device, dtype=parameter.dtype)


def _synchronize(module):
    _timing.synchronize(next(module.parameters()).device)
