"""What shapecache knows about each family of diffusers pipelines.

A family is recognised by its denoiser's class, so any pipeline built from the same
components is covered (text-to-image, image-to-image, inpainting variants). For each family
this file knows the VAE factor sizes must divide by, and how the pipeline calls its
denoiser: pre-warming calls it the same way (same argument names, shapes, dtypes, memory
layouts, autograd mode) so that the entries it builds are the ones the pipeline's calls find.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

SUPPORTED = (
    "UNet2DConditionModel (StableDiffusionPipeline, StableDiffusionXLPipeline and their "
    "Img2Img/Inpaint variants)",
    "FluxTransformer2DModel (FluxPipeline, FluxImg2ImgPipeline, ...)",
    "SD3Transformer2DModel (StableDiffusion3Pipeline, StableDiffusion3Img2ImgPipeline, ...)",
)


@dataclass(frozen=True)
class Family:
    name: str
    denoiser_attribute: str  # "unet" or "transformer"
    uses_cfg: bool  # whether the pipeline doubles the batch for classifier-free guidance by default
    size_multiple: Callable  # pipe -> the multiple that heights and widths must be
    denoiser_inputs: Callable  # (pipe, height, width, batch, text_length) -> kwargs of one denoiser call
    default_text_length: Callable  # pipe -> sequence length of the prompt embeddings the pipeline makes


def family_of(pipe) -> Family:
    """The family of `pipe`, or a ValueError that lists what is supported."""
    for attribute in ("unet", "transformer"):
        denoiser = getattr(pipe, attribute, None)
        if denoiser is None:
            continue
        family = _BY_CLASS.get(type(denoiser).__name__)
        if family is not None:
            return family
        found = f"its {attribute} is a {type(denoiser).__name__}"
        break
    else:
        found = "it has no unet or transformer"
    raise ValueError(
        f"shapecache.wrap: {type(pipe).__name__} is not supported ({found}). Supported: pipelines whose "
        "denoiser is " + "; ".join(SUPPORTED)
    )


def denoiser_inputs(pipe, height: int, width: int, batch: int, text_length: int | None = None) -> dict:
    """Keyword arguments of one call of `pipe`'s denoiser for an image of `height` x `width`
    pixels, as the pipeline makes them (names, shapes, dtypes), with random values. `batch`
    is the denoiser's (doubled already for classifier-free guidance)."""
    family = family_of(pipe)
    if text_length is None:
        text_length = family.default_text_length(pipe)
    return family.denoiser_inputs(pipe, height, width, batch, text_length)


def prompt_dtype(pipe, denoiser: torch.nn.Module) -> torch.dtype:
    """The dtype of the prompt embeddings and latents the pipeline makes (its text encoder's)."""
    encoder = getattr(pipe, "text_encoder", None) or getattr(pipe, "text_encoder_2", None)
    return encoder.dtype if encoder is not None else denoiser.dtype


def first_timestep(pipe, device: torch.device) -> torch.Tensor:
    """A timestep as the pipeline's scheduler makes them (its dtype and device matter to keys)."""
    scheduler = copy.deepcopy(pipe.scheduler)  # set_timesteps changes scheduler state
    kwargs = {}
    if "mu" in _parameters(scheduler.set_timesteps) and getattr(scheduler.config, "use_dynamic_shifting", False):
        kwargs["mu"] = 1.0
    scheduler.set_timesteps(2, device=device, **kwargs)
    return scheduler.timesteps[0]


def _parameters(function) -> set:
    import inspect

    return set(inspect.signature(function).parameters)


# --- UNet2DConditionModel: SD 1.x/2.x and SDXL -------------------------------------------


def unet_inputs(unet, latent_height: int, latent_width: int, batch: int, text_length: int = 77, *,
                dtype: torch.dtype | None = None, timestep: torch.Tensor | None = None, time_ids: int = 6,
                pooled_dtype: torch.dtype | None = None, images: int | None = None) -> dict:
    """Keyword arguments of one ``UNet2DConditionModel`` call at a latent size, random where a
    pipeline would compute them.

    Args:
        batch: the UNet's batch (doubled already for classifier-free guidance).
        dtype: of the latents and prompt embeddings; None: the UNet's.
        timestep: None: ``tensor(500)`` on the UNet's device.
        time_ids: SDXL's micro-conditioning ids per image: 6, or 5 with an aesthetics score.
        pooled_dtype: of SDXL's pooled text embeddings; None: `dtype`.
        images: rows of an LCM-style ``timestep_cond``; None: `batch`.
    """
    config = unet.config
    device = unet.device
    dtype = dtype or unet.dtype
    kwargs = {
        "sample": torch.randn(batch, config.in_channels, latent_height, latent_width, device=device, dtype=dtype),
        "timestep": timestep if timestep is not None else torch.tensor(500, device=device),
        "encoder_hidden_states": torch.randn(batch, text_length, config.cross_attention_dim, device=device, dtype=dtype),
        "timestep_cond": None,
        "cross_attention_kwargs": None,
        "added_cond_kwargs": None,
        "return_dict": False,
    }
    if config.time_cond_proj_dim is not None:
        # LCM-style guidance embedding: one row per image, not doubled for guidance
        kwargs["timestep_cond"] = torch.randn(images or batch, config.time_cond_proj_dim, device=device, dtype=dtype)
    if config.addition_embed_type == "text_time":  # SDXL
        pooled = config.projection_class_embeddings_input_dim - time_ids * config.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(batch, pooled, device=device, dtype=pooled_dtype or dtype),
            "time_ids": torch.zeros(batch, time_ids, device=device, dtype=dtype),
        }
    return kwargs


def _unet_inputs(pipe, height, width, batch, text_length):
    unet = pipe.unet
    factor = pipe.vae_scale_factor
    guided = getattr(pipe, "do_classifier_free_guidance", False)
    encoder_2 = getattr(pipe, "text_encoder_2", None)
    return unet_inputs(
        unet, height // factor, width // factor, batch, text_length,
        dtype=prompt_dtype(pipe, unet),
        timestep=first_timestep(pipe, unet.device),
        time_ids=5 if getattr(pipe.config, "requires_aesthetics_score", False) else 6,
        pooled_dtype=encoder_2.dtype if encoder_2 is not None else None,
        images=batch // 2 if guided else batch,
    )


def _unet_text_length(pipe) -> int:
    tokenizer = getattr(pipe, "tokenizer", None) or getattr(pipe, "tokenizer_2", None)
    if tokenizer is not None:
        return tokenizer.model_max_length
    encoder = getattr(pipe, "text_encoder", None)
    return encoder.config.max_position_embeddings if encoder is not None else 77


# --- FluxTransformer2DModel ----------------------------------------------------------------


def _flux_inputs(pipe, height, width, batch, text_length):
    transformer = pipe.transformer
    config = transformer.config
    device, dtype = transformer.device, prompt_dtype(pipe, transformer)
    # Flux packs 2x2 latent patches: one token per (2 * vae factor) pixels in each direction.
    rows = height // (pipe.vae_scale_factor * 2)
    cols = width // (pipe.vae_scale_factor * 2)
    timestep = first_timestep(pipe, device).expand(batch).to(dtype)
    guidance = None
    if config.guidance_embeds:
        guidance = torch.full([1], 3.5, device=device, dtype=torch.float32).expand(batch)
    return {
        "hidden_states": torch.randn(batch, rows * cols, config.in_channels, device=device, dtype=dtype),
        "timestep": timestep / 1000,
        "guidance": guidance,
        "pooled_projections": torch.randn(batch, config.pooled_projection_dim, device=device, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, text_length, config.joint_attention_dim, device=device, dtype=dtype),
        "txt_ids": torch.zeros(text_length, 3, device=device, dtype=dtype),
        "img_ids": pipe._prepare_latent_image_ids(batch, rows, cols, device, dtype),
        "joint_attention_kwargs": {},  # FluxPipeline.__call__ turns a missing value into {}
        "return_dict": False,
    }


# --- SD3Transformer2DModel -----------------------------------------------------------------


def _sd3_inputs(pipe, height, width, batch, text_length):
    transformer = pipe.transformer
    config = transformer.config
    device, dtype = transformer.device, prompt_dtype(pipe, transformer)
    factor = pipe.vae_scale_factor
    return {
        "hidden_states": torch.randn(batch, config.in_channels, height // factor, width // factor, device=device, dtype=dtype),
        "timestep": first_timestep(pipe, device).expand(batch),
        "encoder_hidden_states": torch.randn(batch, text_length, config.joint_attention_dim, device=device, dtype=dtype),
        "pooled_projections": torch.randn(batch, config.pooled_projection_dim, device=device, dtype=dtype),
        "joint_attention_kwargs": None,
        "return_dict": False,
    }


def _sd3_text_length(pipe) -> int:
    # CLIP's tokens, then T5's (max_sequence_length defaults to 256), concatenated.
    return getattr(pipe, "tokenizer_max_length", 77) + 256


_BY_CLASS = {
    "UNet2DConditionModel": Family(
        "unet", "unet", True, lambda pipe: pipe.vae_scale_factor, _unet_inputs, _unet_text_length
    ),
    "FluxTransformer2DModel": Family(
        "flux", "transformer", False, lambda pipe: pipe.vae_scale_factor * 2, _flux_inputs, lambda pipe: 512
    ),
    "SD3Transformer2DModel": Family(
        "sd3", "transformer", True, lambda pipe: pipe.vae_scale_factor, _sd3_inputs, _sd3_text_length
    ),
}
