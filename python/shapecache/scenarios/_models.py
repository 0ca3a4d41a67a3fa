"""Models of the scenarios, built offline with random weights."""

from __future__ import annotations

import torch

MODELS = ("tiny-sd", "sd15", "sdxl")


def build_model(name: str, device: torch.device):
    """The model of `name` on `device` (random weights; SD1.5/SDXL UNets in fp16 on CUDA)."""
    if name == "tiny-sd":
        from shapecache.testing import tiny_pipelines

        return tiny_pipelines.stable_diffusion().to(device)
    from diffusers import UNet2DConditionModel

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # built where it runs: no host copy of the weights
        if name == "sd15":
            unet = UNet2DConditionModel(cross_attention_dim=768, sample_size=64)
        else:
            unet = UNet2DConditionModel(
                sample_size=128, block_out_channels=(320, 640, 1280), layers_per_block=2,
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
                use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                projection_class_embeddings_input_dim=2816)
    return unet.to(dtype).eval()
