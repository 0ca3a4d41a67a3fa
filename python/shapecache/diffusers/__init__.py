"""shapecache for diffusers pipelines: the one place that knows diffusers.

- ``wrap(pipe, sizes, budget)``: caches a pipeline's denoiser and VAE decoder under one
  budget and builds every size before the first request, largest first;
  ``sc.uncached(pipe)`` undoes it.
- ``prewarm(pipe, sizes)``: builds more sizes of a wrapped pipeline.
- ``encode_prompts(pipe, prompts)``: prompt embeddings for many prompts, without growing memory.
- ``denoiser_inputs(pipe, height, width, batch)``: keyword arguments of one denoiser call, as
  the pipeline makes them.
"""

from shapecache.diffusers._families import denoiser_inputs, unet_inputs
from shapecache.diffusers._pipelines import prewarm, wrap
from shapecache.diffusers._prompts import encode_prompts

__all__ = ["denoiser_inputs", "encode_prompts", "prewarm", "unet_inputs", "wrap"]
