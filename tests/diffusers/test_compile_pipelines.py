"""Settings users change on a pipeline between calls are seen by compiled entries.

Two tiers, both on real diffusers models built from configs:
- every change (FreeU, attention processors, fused projections, attention slicing, LoRA
  through peft, an IP-adapter's scale, cache hooks) against the guard a compiled entry
  records (guards.py): the denoiser's call traced on a detached copy, as a build traces it,
  and the guard recorded from the modules that ran must report the change. No compiler runs.
- end to end, with ``sc.wrap(pipe, backend="compile")`` beside an identical plain pipeline:
  the denoised latents agree after FreeU, LoRA fusing and unfusing, and a FirstBlockCache hook
  (a compiled graph may round differently from eager, by far less than any change makes).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("diffusers")

import shapecache as sc  # noqa: E402
from shapecache._backends import guards  # noqa: E402
from shapecache._backends.trace_copies import DetachedTrees  # noqa: E402
from shapecache.testing import tiny_pipelines as tp  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning", "ignore::UserWarning")]

SIZE = (32, 32)
CLOSE = {"rtol": 1e-3, "atol": 1e-3}


def lora(rank: int = 4):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                      init_lora_weights=False)


def add_adapters(pipe):
    pytest.importorskip("peft")
    torch.manual_seed(7)  # adapters initialised alike in every pipeline
    pipe.unet.add_adapter(lora(), adapter_name="a")
    pipe.unet.add_adapter(lora(2), adapter_name="b")


def set_processor(pipe):
    from diffusers.models.attention_processor import AttnProcessor

    pipe.unet.set_attn_processor(AttnProcessor())


def load_ip_adapter(pipe):
    """A tiny IP-adapter of random weights, in the format diffusers loads: per cross-attention
    processor (numbered from 1 in steps of 2) a key and a value projection of the image tokens,
    and an image projection of the image embedding."""
    from diffusers.models.attention_processor import IPAdapterAttnProcessor
    from diffusers.models.embeddings import ImageProjection

    unet, config = pipe.unet, pipe.unet.config
    torch.manual_seed(3)
    widths = {"down_blocks": list(config.block_out_channels), "up_blocks": list(reversed(config.block_out_channels))}
    projections, number = {}, 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        block, index = name.split(".")[:2]
        hidden = config.block_out_channels[-1] if block == "mid_block" else widths[block][int(index)]
        weights = IPAdapterAttnProcessor(hidden_size=hidden, cross_attention_dim=config.cross_attention_dim).state_dict()
        projections[f"{number}.to_k_ip.weight"] = weights["to_k_ip.0.weight"]
        projections[f"{number}.to_v_ip.weight"] = weights["to_v_ip.0.weight"]
        number += 2
    image = ImageProjection(cross_attention_dim=config.cross_attention_dim, image_embed_dim=config.cross_attention_dim,
                            num_image_text_embeds=4).state_dict()
    image_proj = {"proj.weight": image["image_embeds.weight"], "proj.bias": image["image_embeds.bias"],
                  "norm.weight": image["norm.weight"], "norm.bias": image["norm.bias"]}
    unet._load_ip_adapter_weights([{"image_proj": image_proj, "ip_adapter": projections}])


# A change users make between calls: (name, change, needs before it).
CHANGES = [
    ("enable_freeu", lambda p: p.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4), []),
    ("freeu_other_factors", lambda p: p.enable_freeu(s1=0.5, s2=0.2, b1=1.5, b2=1.4),
     [lambda p: p.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)]),
    ("disable_freeu", lambda p: p.disable_freeu(), [lambda p: p.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)]),
    ("set_attn_processor", set_processor, []),
    ("fuse_qkv_projections", lambda p: p.fuse_qkv_projections(), []),
    ("unfuse_qkv_projections", lambda p: p.unfuse_qkv_projections(), [lambda p: p.fuse_qkv_projections()]),
    ("enable_attention_slicing", lambda p: p.enable_attention_slicing(1), []),
    ("disable_attention_slicing", lambda p: p.disable_attention_slicing(), [lambda p: p.enable_attention_slicing(1)]),
    ("add_adapter", add_adapters, []),
    ("set_adapters_weighted", lambda p: p.set_adapters(["a", "b"], adapter_weights=[0.5, 1.5]), [add_adapters]),
    ("disable_lora", lambda p: p.disable_lora(), [add_adapters]),
    ("enable_lora", lambda p: p.enable_lora(), [add_adapters, lambda p: p.disable_lora()]),
    ("delete_adapters", lambda p: p.delete_adapters("b"), [add_adapters]),
    ("fuse_lora", lambda p: p.fuse_lora(), [add_adapters]),
    ("unfuse_lora", lambda p: p.unfuse_lora(), [add_adapters, lambda p: p.fuse_lora()]),
    ("set_ip_adapter_scale", lambda p: p.set_ip_adapter_scale(0.3), [load_ip_adapter]),
]


def denoiser_inputs(unet, with_image=False):
    g = torch.Generator().manual_seed(0)
    kwargs = {}
    if with_image:
        kwargs["added_cond_kwargs"] = {"image_embeds": [torch.randn(2, 1, unet.config.cross_attention_dim, generator=g)]}
    return (torch.randn(2, 4, 4, 4, generator=g), torch.tensor(10), torch.randn(2, 77, 32, generator=g)), kwargs


def recorded_guard(unet, args, kwargs):
    """The guard a compiled build of this call records (exported.py), without compiling:
    the call runs on a detached copy, and the modules that ran are guarded."""
    copies = DetachedTrees()
    copy = copies.of(unet)
    with torch.no_grad():
        copy(*args, **kwargs)
    reached = {id(copies.live(module)) for module in copies.ran.values()}
    assert len(reached) > 20  # the trace reached the denoiser's blocks
    return guards.guard({"self": unet}, functions=[type(unet).forward], reached=reached)


@pytest.mark.parametrize("name,change,before", CHANGES, ids=[c[0] for c in CHANGES])
def test_each_change_is_seen_by_the_guard_a_compiled_denoiser_records(name, change, before):
    pipe = tp.stable_diffusion()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in before:
            step(pipe)
        args, kwargs = denoiser_inputs(pipe.unet, with_image=name == "set_ip_adapter_scale")
        guard = recorded_guard(pipe.unet, args, kwargs)
        assert guard.check()
        change(pipe)
    assert not guard.check(), f"{name} was not seen"
    assert guard.changed


def test_calling_the_denoiser_changes_nothing_its_guard_holds():
    pipe = tp.stable_diffusion()
    pipe.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    add_adapters(pipe)
    pipe.unet.eval()  # peft adds its layers in training mode
    args, kwargs = denoiser_inputs(pipe.unet)
    guard = recorded_guard(pipe.unet, args, kwargs)
    with torch.no_grad():
        pipe.unet(*args, **kwargs)
    pipe.unet.eval()  # the same values again
    assert guard.check(), guard.changed


def images(pipe, inputs):
    """The denoised latents: what the changes act on (the decoder would be one more build)."""
    return pipe(**inputs, height=SIZE[0], width=SIZE[1], num_inference_steps=2,
                generator=torch.Generator().manual_seed(0), output_type="latent").images


def compare_through(make, inputs, changes):
    """Runs a compiled and a plain pipeline after each change; returns how far each moved the image."""
    plain, wrapped = make(), make()
    sc.wrap(wrapped, budget="2GiB", backend="compile")
    before = images(plain, inputs)
    torch.testing.assert_close(images(wrapped, inputs), before, **CLOSE)
    moved = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, change in changes:
            for pipe in (plain, wrapped):
                change(pipe)
            expected = images(plain, inputs)
            torch.testing.assert_close(images(wrapped, inputs), expected, **CLOSE, msg=lambda m, n=name: f"after {n}: {m}")
            moved[name] = (expected - before).abs().max().item()
            before = expected
    return wrapped, moved


def test_freeu_and_lora_fusing_give_the_plain_pipelines_images_end_to_end():
    pytest.importorskip("peft")
    # Each change costs a build: FreeU and the adapters come in one (each alone, and disabling
    # FreeU, are seen by the guard-level tests above).
    def freeu_and_adapters(pipe):
        CHANGES[0][1](pipe)
        add_adapters(pipe)

    changes = [("freeu_and_adapters", freeu_and_adapters),
               ("fuse_lora", lambda p: p.fuse_lora()), ("unfuse_lora", lambda p: p.unfuse_lora())]
    wrapped, moved = compare_through(tp.stable_diffusion, {"prompt": ["a photo of a cat"]}, changes)
    # Each change moved the image (so the comparisons above could fail), except fusing and
    # unfusing, which compute the same adapters another way: there a graph built for the other
    # way would answer wrongly (unfusing restores the weights in place and pops peft's list of
    # merged adapters), and the denoiser was rebuilt after every change.
    assert moved["freeu_and_adapters"] > 1e-2, moved
    assert sc.stats(wrapped)["components"]["denoiser"]["invalidations"] >= 3


def test_a_first_block_cache_hook_gives_the_plain_pipelines_images_end_to_end():
    from diffusers.hooks import FirstBlockCacheConfig

    g = torch.Generator().manual_seed(1)
    inputs = {"prompt_embeds": torch.randn(1, 512, 32, generator=g), "pooled_prompt_embeds": torch.randn(1, 32, generator=g)}
    changes = [("enable_cache", lambda p: p.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))),
               ("disable_cache", lambda p: p.transformer.disable_cache())]
    wrapped, _ = compare_through(tp.flux, inputs, changes)
    denoiser = sc.stats(wrapped)["components"]["denoiser"]
    # The hook's state changes on every call: the denoiser ran uncached meanwhile, or rebuilt.
    assert denoiser["uncached_calls"] + denoiser["invalidations"] + denoiser["fallbacks"] > 0, denoiser
