"""Tiny diffusers pipelines built offline, for demos and tests: random weights from configs
(following diffusers' own pipeline tests) and a word-level tokenizer over a small local
vocabulary. Nothing is downloaded. Needs diffusers and transformers."""

from __future__ import annotations

import torch

__all__ = ["flux", "stable_diffusion", "stable_diffusion_3", "stable_diffusion_xl"]

WORDS = ["<pad>", "<unk>", "<bos>", "<eos>", "a", "an", "photo", "painting", "of", "the", "cat", "dog",
         "astronaut", "horse", "riding", "on", "moon", "red", "blue", "small", "big", "city", "at", "night"]


def tokenizer(max_length: int = 77):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
        model_max_length=max_length,
    )


def clip_text_encoder(hidden_size: int = 32, projection_dim: int | None = None):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        bos_token_id=2, eos_token_id=3, hidden_size=hidden_size, intermediate_size=37, layer_norm_eps=1e-05,
        num_attention_heads=4, num_hidden_layers=2, pad_token_id=0, vocab_size=len(WORDS),
        hidden_act="gelu", projection_dim=projection_dim or hidden_size,
    )
    model = CLIPTextModelWithProjection(config) if projection_dim else CLIPTextModel(config)
    return model.eval()


def vae(latent_channels: int = 4, blocks=(4, 8), **overrides):
    from diffusers import AutoencoderKL

    config = dict(
        block_out_channels=list(blocks), in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * len(blocks), up_block_types=["UpDecoderBlock2D"] * len(blocks),
        latent_channels=latent_channels, norm_num_groups=2, sample_size=32,
    )
    config.update(overrides)
    return AutoencoderKL(**config).eval()


def stable_diffusion(cls_name: str = "StableDiffusionPipeline"):
    import diffusers
    from diffusers import DDIMScheduler, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=2,
    ).eval()
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    cls = getattr(diffusers, cls_name)
    pipe = cls(unet=unet, scheduler=scheduler, vae=vae(), text_encoder=clip_text_encoder(), tokenizer=tokenizer(),
               safety_checker=None, feature_extractor=None, image_encoder=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stable_diffusion_xl():
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(2, 4), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=80,  # 6 time ids * 8 + 32 pooled
        cross_attention_dim=64, norm_num_groups=1,
    ).eval()
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1,
                                       beta_schedule="scaled_linear", timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(
        unet=unet, scheduler=scheduler, vae=vae(sample_size=128),
        text_encoder=clip_text_encoder(32), tokenizer=tokenizer(),
        text_encoder_2=clip_text_encoder(32, projection_dim=32), tokenizer_2=tokenizer(),
        image_encoder=None, feature_extractor=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    ).eval()
    autoencoder = vae(latent_channels=1, blocks=(4,), norm_num_groups=1, use_quant_conv=False,
                      use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=autoencoder, text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stable_diffusion_3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
    ).eval()
    autoencoder = vae(latent_channels=4, blocks=(4,), norm_num_groups=1, use_quant_conv=False,
                      use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=autoencoder, transformer=transformer,
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
        text_encoder_3=None, tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
