"""``sc.encode_prompts``: prompt embeddings for many prompts, without growing memory.

Encoding prompts one by one inside a loop keeps whatever the loop keeps: with autograd on,
every embedding holds the text encoder's activations; on the GPU, every embedding holds
device memory. Here the encoders run in batches under ``torch.inference_mode()``, each
prompt's embeddings are copied to host memory (pinned when they came from CUDA, so that
moving them back is asynchronous), and the device copies are dropped before the next batch.
The result is one dict per prompt of keyword arguments for the pipeline's ``__call__``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Sequence

import torch

from shapecache import _checks, _timing
from shapecache.budget import format_bytes
from shapecache.diffusers._families import family_of

logger = logging.getLogger("shapecache")

_TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


class PromptEmbeddings(list):
    """One dict of ``__call__`` keyword arguments per prompt; ``released_bytes`` says how much
    device memory moving the text encoders off the GPU freed (0 when they were not moved)."""

    released_bytes: int = 0


def encode_prompts(
    pipe,
    prompts: Sequence[str],
    batch_size: int = 8,
    device=None,
    release_encoders: bool = False,
    *,
    negative_prompts: Sequence[str] | str | None = None,
    guidance: bool | None = None,
) -> PromptEmbeddings:
    """Encodes `prompts` with `pipe`'s own ``encode_prompt``, `batch_size` at a time.

    Args:
        device: where the encoders run; None: the pipeline's execution device.
        release_encoders: afterwards, move the text encoders to the CPU.
        negative_prompts: one per prompt, or one for all; None: the pipeline's default.
        guidance: also return negative embeddings for classifier-free guidance; None: the
            family's default (SD, SDXL, SD3: yes; Flux has none).

    Returns:
        A PromptEmbeddings list: for each prompt, ``prompt_embeds`` and (where the pipeline
        has them) ``pooled_prompt_embeds``, ``negative_prompt_embeds``,
        ``negative_pooled_prompt_embeds``, each of batch 1, on the CPU, with no autograd graph.
    """
    family = family_of(pipe)
    if isinstance(prompts, str) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts={prompts!r}: expected a list of strings")
    prompts = list(prompts)  # once: a generator given here is consumed by this line only
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"prompts={prompts!r}: expected a list of strings")
    _checks.positive_int("batch_size", batch_size)
    if isinstance(negative_prompts, str):
        negative_prompts = [negative_prompts] * len(prompts)
    if negative_prompts is not None and len(negative_prompts) != len(prompts):
        raise ValueError(
            f"negative_prompts: expected one per prompt ({len(prompts)}), got {len(negative_prompts)}"
        )
    device = torch.device(device) if device is not None else pipe._execution_device
    use_cfg = family.uses_cfg if guidance is None else bool(guidance)
    accepted = set(inspect.signature(pipe.encode_prompt).parameters)

    out = PromptEmbeddings()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        kwargs = {"prompt": batch, "device": device, "num_images_per_prompt": 1}
        if "do_classifier_free_guidance" in accepted:
            kwargs["do_classifier_free_guidance"] = use_cfg
        if negative_prompts is not None and "negative_prompt" in accepted:
            kwargs["negative_prompt"] = negative_prompts[start : start + batch_size]
        with torch.inference_mode():
            encoded = pipe.encode_prompt(**kwargs)
        named = _name_outputs(family.name, encoded)
        with torch.no_grad():
            for i in range(len(batch)):
                out.append({name: _to_host(t[i : i + 1]) for name, t in named.items() if t is not None})
        del encoded, named  # the device copies go before the next batch is encoded

    if release_encoders:
        out.released_bytes = _release_text_encoders(pipe)
    return out


def _name_outputs(family: str, encoded) -> dict:
    if family == "flux":  # (prompt_embeds, pooled_prompt_embeds, text_ids): text_ids are per pipeline
        return {"prompt_embeds": encoded[0], "pooled_prompt_embeds": encoded[1]}
    if len(encoded) == 2:
        return {"prompt_embeds": encoded[0], "negative_prompt_embeds": encoded[1]}
    return {
        "prompt_embeds": encoded[0],
        "negative_prompt_embeds": encoded[1],
        "pooled_prompt_embeds": encoded[2],
        "negative_pooled_prompt_embeds": encoded[3],
    }


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A plain (not inference-mode) CPU copy; pinned when it comes from CUDA."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    return host.copy_(t, non_blocking=t.is_cuda)


def _release_text_encoders(pipe) -> int:
    encoders = [getattr(pipe, name, None) for name in _TEXT_ENCODERS]
    encoders = [e for e in encoders if isinstance(e, torch.nn.Module) and e.device.type == "cuda"]
    if not encoders:
        return 0
    devices = {e.device for e in encoders}
    for d in devices:
        _timing.synchronize(d)  # pending copies out of the encoders' outputs finish first
    before = sum(torch.cuda.memory_allocated(d) for d in devices)
    for encoder in encoders:
        encoder.to("cpu")
    freed = before - sum(torch.cuda.memory_allocated(d) for d in devices)
    logger.info("shapecache: moved %d text encoder(s) to the CPU, freeing %s", len(encoders), format_bytes(freed))
    return freed
