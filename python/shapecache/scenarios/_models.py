"""Models of the scenarios, built offline with random weights."""

from __future__ import annotations

import torch

MODELS = ("tiny-sd", "res-convnet", "sd15", "sdxl")


class ResidualConvNet(torch.nn.Module):
    """A denoiser's shape without its size: residual blocks of GroupNorm, SiLU and a 3x3
    convolution at 512 channels on 4-channel latents, 54 MiB of float32 weights. Inductor
    builds one in seconds, and fuses its normalisations and activations."""

    def __init__(self, channels: int = 4, hidden: int = 512, blocks: int = 6):
        super().__init__()
        self.conv_in = torch.nn.Conv2d(channels, hidden, 3, padding=1)
        self.norms = torch.nn.ModuleList(torch.nn.GroupNorm(32, hidden) for _ in range(blocks))
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(hidden, hidden, 3, padding=1) for _ in range(blocks))
        self.conv_out = torch.nn.Conv2d(hidden, channels, 3, padding=1)

    def forward(self, latents):
        x = self.conv_in(latents)
        for norm, conv in zip(self.norms, self.convs, strict=True):
            x = x + conv(torch.nn.functional.silu(norm(x)))
        return self.conv_out(x)


def model_inputs(name: str, model, batch: int):
    """`inputs(size) -> (args, kwargs)` for size_loop, or None where it knows the model."""
    if name != "res-convnet":
        return None
    device = next(model.parameters()).device

    def inputs(size):  # latents at 1/8 of the pixels
        return (torch.randn(batch, 4, size[0] // 8, size[1] // 8, device=device),), {}

    return inputs


def build_model(name: str, device: torch.device):
    """The model of `name` on `device` (random weights; SD1.5/SDXL UNets in fp16 on CUDA)."""
    if name == "res-convnet":
        torch.manual_seed(0)
        with torch.device(device):
            return ResidualConvNet().eval()
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
