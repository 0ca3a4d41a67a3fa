"""sc.wrap on tiny pipelines of every supported family, on CPU."""

import logging

import pytest
import torch

pytest.importorskip("diffusers")

import shapecache as sc  # noqa: E402
from shapecache._extension import _C  # noqa: E402
from shapecache.testing import tiny_pipelines as tp  # noqa: E402


def flux_inputs(batch=1):
    g = torch.Generator().manual_seed(1)
    return {"prompt_embeds": torch.randn(batch, 512, 32, generator=g),
            "pooled_prompt_embeds": torch.randn(batch, 32, generator=g)}


def sd3_inputs(batch=1):
    g = torch.Generator().manual_seed(1)
    return {"prompt_embeds": torch.randn(batch, 333, 32, generator=g),
            "pooled_prompt_embeds": torch.randn(batch, 64, generator=g),
            "negative_prompt_embeds": torch.randn(batch, 333, 32, generator=g),
            "negative_pooled_prompt_embeds": torch.randn(batch, 64, generator=g)}


def text_inputs(batch=1):
    return {"prompt": ["a photo of a cat", "a painting of a dog"][:batch]}


# family: (pipeline factory, call inputs, sizes in any order with a duplicate)
FAMILIES = {
    "sd": (tp.stable_diffusion, text_inputs, [(32, 32), (48, 32), (32, 48), (32, 32)]),
    "sdxl": (tp.stable_diffusion_xl, text_inputs, [(64, 64), (64, 96), (64, 64)]),
    "flux": (tp.flux, flux_inputs, [(32, 32), (48, 48), (32, 48)]),
    "sd3": (tp.stable_diffusion_3, sd3_inputs, [(32, 32), (32, 48), (32, 32)]),
}


def run(pipe, inputs, size, output_type="pt", **kwargs):
    height, width = size
    return pipe(**inputs, height=height, width=width, num_inference_steps=2,
                generator=torch.Generator().manual_seed(0), output_type=output_type, **kwargs).images


@pytest.mark.parametrize("family", FAMILIES)
def test_wrap_prewarms_largest_first_and_outputs_are_bit_identical(family):
    make, inputs, sizes = FAMILIES[family]
    pipe = make()
    distinct = sorted(set(sizes), key=lambda s: (s[0] * s[1], s), reverse=True)  # ties: taller first
    expected = {s: run(pipe, inputs(), s) for s in distinct}

    assert sc.wrap(pipe, sizes=sizes, budget="1GiB") is pipe
    st = sc.stats(pipe)
    assert [r["size"] for r in st["prewarmed"]] == distinct  # largest pixel count first, no duplicates
    warmed_builds = st["builds"]
    assert warmed_builds == 2 * len(distinct)  # denoiser and VAE decoder per size

    for s in distinct:
        assert torch.equal(run(pipe, inputs(), s), expected[s])
    st = sc.stats(pipe)
    assert st["builds"] == warmed_builds, "pipeline calls must find the entries that pre-warming built"
    assert st["components"]["denoiser"]["hits"] == 2 * len(distinct)  # two steps per run
    assert st["components"]["vae_decoder"]["hits"] == len(distinct)


def test_uncached_restores_the_pipeline():
    pipe = tp.stable_diffusion()
    sc.wrap(pipe, sizes=[(32, 32)])
    assert sc.uncached(pipe) is pipe
    assert "forward" not in pipe.unet.__dict__ and "forward" not in pipe.vae.decoder.__dict__
    assert not hasattr(pipe, "_shapecache")
    with pytest.raises(TypeError, match="expected a function or module wrapped by shapecache.cached"):
        sc.stats(pipe)
    with pytest.raises(TypeError, match="uncached: expected a function or module wrapped by shapecache.cached"):
        sc.uncached(pipe)
    with pytest.raises(AttributeError, match="has no attribute 'unwrap'"):
        sc.unwrap(pipe)  # one verb undoes both wrap and cached


def test_image_to_image_pipeline_with_the_same_components():
    pipe = tp.stable_diffusion("StableDiffusionImg2ImgPipeline")
    image = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(3))

    def call():
        return pipe("a photo of a cat", image=image, strength=1.0, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images

    expected = call()
    sc.wrap(pipe, sizes=[(32, 48)])
    builds = sc.stats(pipe)["builds"]
    assert torch.equal(call(), expected)
    assert sc.stats(pipe)["builds"] == builds


def test_num_images_per_prompt_with_guidance_is_prewarmed_by_batch_size():
    pipe = tp.stable_diffusion()
    expected = run(pipe, text_inputs(), (32, 32), num_images_per_prompt=2)
    sc.wrap(pipe, sizes=[(32, 32)], batch_size=2)
    entry = sc.stats(pipe)["components"]["denoiser"]["entries"][0]["bucket"]
    assert "sample=(4, 4, 16, 16)" in entry  # 2 images, doubled for classifier-free guidance
    assert torch.equal(run(pipe, text_inputs(), (32, 32), num_images_per_prompt=2), expected)
    assert sc.stats(pipe)["builds"] == 2


def test_prewarm_later_logs_each_size_and_shows_progress(caplog, capsys):
    pipe = tp.stable_diffusion()
    sc.wrap(pipe, prewarm=False)
    assert sc.stats(pipe)["builds"] == 0
    with caplog.at_level(logging.INFO, logger="shapecache"):
        records = sc.prewarm(pipe, [(32, 32), (48, 48)], progress=True)
    assert [r["size"] for r in records] == [(48, 48), (32, 32)]
    assert all(r["seconds"] > 0 and r["bytes"] == 0 for r in records)  # eager entries hold no memory
    assert all(r["inductor_cache"] is None for r in records)  # nothing compiled
    warmed = [m for m in caplog.messages if m.startswith("shapecache: warmed")]
    assert [m.split()[2] for m in warmed] == ["48x48", "32x32"]
    assert "shapecache prewarm" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sizes, error, message",
    [
        ([(33, 32)], ValueError, r"sizes\[0\]=\(33, 32\): height 33 is not a multiple of 2, which StableDiffusionPipeline needs"),
        ([(32, 32), (32, 30.0)], TypeError, r"sizes\[1\]=\(32, 30.0\): width must be a positive int"),
        ([(32,)], TypeError, r"sizes\[0\]=\(32,\): expected a \(height, width\) pair"),
        ("32x32", TypeError, r"sizes='32x32': expected a list of \(height, width\) pairs"),
    ],
)
def test_bad_sizes_are_rejected_and_the_pipeline_is_left_alone(sizes, error, message):
    pipe = tp.stable_diffusion()
    with pytest.raises(error, match=message):
        sc.wrap(pipe, sizes=sizes)
    assert not hasattr(pipe, "_shapecache") and "forward" not in pipe.unet.__dict__


def test_flux_sizes_must_divide_by_the_packed_factor():
    pipe = tp.flux()  # VAE factor 1, packed 2x2: sizes must be even
    with pytest.raises(ValueError, match="height 33 is not a multiple of 2"):
        sc.wrap(pipe, sizes=[(33, 32)])


def test_unsupported_pipeline_lists_what_is_supported():
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    unet = UNet2DModel(block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=3, out_channels=3,
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=2)
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler())
    with pytest.raises(ValueError, match=r"DDPMPipeline is not supported \(its unet is a UNet2DModel\). Supported: "
                                         r"pipelines whose denoiser is UNet2DConditionModel"):
        sc.wrap(pipe)


def test_wrapping_twice_and_wrapping_a_cached_component():
    pipe = tp.stable_diffusion()
    sc.wrap(pipe)
    with pytest.raises(ValueError, match="is wrapped already"):
        sc.wrap(pipe)
    other = tp.stable_diffusion()
    sc.cached(other.unet)
    with pytest.raises(ValueError, match="the pipeline's denoiser is cached already"):
        sc.wrap(other)
    assert "forward" not in other.vae.decoder.__dict__  # nothing half-wrapped


def test_stats_of_a_wrapped_pipeline():
    pipe = tp.stable_diffusion()
    sc.wrap(pipe, sizes=[(32, 32), (48, 48)], budget="64MiB", max_entries=3)
    st = sc.stats(pipe)
    assert st["budget"] == 64 * 2**20 and st["max_entries"] == 3
    assert set(st["components"]) == {"denoiser", "vae_decoder"}
    # denoiser and decoder share one cache: four entries do not fit under max_entries=3
    assert len(st["entries"]) == 3 and st["evictions"] == 1
    assert st["memory"] == {}  # CUDA allocator figures, for CUDA devices only


@pytest.mark.cuda
def test_sd15_size_pipeline_over_service_sizes_stays_within_budget():
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    device = torch.device("cuda")
    with torch.device(device):
        unet = UNet2DConditionModel(cross_attention_dim=768, sample_size=64).half().eval()
        vae = AutoencoderKL(block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
                            up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=4, sample_size=512).half().eval()
    pipe = StableDiffusionPipeline(unet=unet, vae=vae, scheduler=DDIMScheduler(), text_encoder=None, tokenizer=None,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    sizes = [(1024, 1024), (1024, 1152), (1152, 1024), (1360, 1536), (1536, 1360), (1536, 1536)]
    # The UNet's graphs fit (about 2 GB of pool at 1536x1536); the decoder's at 1536x1536 does not
    # even alone (about 12 GB of pool measured on an H200): it runs eager, with one warning, and
    # the pool is rebuilt without it instead of staying past the budget.
    budget = 6 * 2**30
    with pytest.warns(RuntimeWarning, match="leaves no room under the budget"):
        sc.wrap(pipe, sizes=sizes, budget=budget, backend="cuda_graph", progress=False)  # captures, not compiles
    embeds = torch.randn(1, 77, 768, device=device, dtype=torch.float16)
    for height, width in sizes:
        pipe(prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), height=height, width=width,
             num_inference_steps=2, output_type="latent")
        st = sc.stats(pipe)
        assert st["bytes"] <= budget
        assert _C.cuda_graph_pool_bytes(device) <= budget  # the allocator's own figure
    assert set(st["memory"]) == {"cuda:0"}
    assert st["fallbacks"] == 0
    unet_entries = sc.stats(pipe.unet)["entries"]
    assert len(unet_entries) == len(sizes) and {e["backend"] for e in unet_entries} == {"cuda_graph"}
    largest = [e for e in sc.stats(pipe.vae.decoder)["entries"] if e["bucket"].startswith("sample=(1, 4, 192, 192) ")]
    assert len(largest) == 1 and largest[0]["backend"] == "eager"


@pytest.mark.slow
def test_compile_backend_is_bit_identical_to_torch_compile():
    size = (32, 48)
    # The denoiser's latents: each comparison costs two inductor builds (the decoder, never
    # called for latents, is not built).
    anchor = tp.stable_diffusion()
    anchor.unet = torch.compile(anchor.unet, dynamic=False)
    expected = run(anchor, text_inputs(), size, output_type="latent")

    pipe = tp.stable_diffusion()
    sc.wrap(pipe, backend="compile")
    assert torch.equal(run(pipe, text_inputs(), size, output_type="latent"), expected)
    st = sc.stats(pipe)
    assert st["builds"] == 1 and [e["backend"] for e in st["entries"]] == ["compile"]


def test_disable_env_leaves_the_pipeline_alone(monkeypatch):
    monkeypatch.setenv("SHAPECACHE_DISABLE", "1")
    pipe = tp.stable_diffusion()
    assert sc.wrap(pipe, sizes=[(32, 32)]) is pipe
    assert not hasattr(pipe, "_shapecache") and "forward" not in pipe.unet.__dict__


def test_every_state_a_user_can_reach_has_a_way_out():
    # A component uncached on its own: uncaching the pipeline still completes, and it can be wrapped again.
    pipe = sc.wrap(tp.stable_diffusion(), sizes=[(32, 32)], progress=False)
    sc.uncached(pipe.unet)
    assert list(sc.stats(pipe)["components"]) == ["vae_decoder"]
    sc.clear(pipe)
    assert sc.stats(pipe)["entries"] == []
    assert sc.uncached(pipe) is pipe
    assert "forward" not in pipe.vae.decoder.__dict__ and not hasattr(pipe, "_shapecache")
    sc.wrap(pipe, sizes=[(32, 32)], progress=False)

    # Something re-assigns the denoiser's forward after wrap (as cache hooks do on removal): stats,
    # clear and uncached still work, and that forward is left as it was set.
    replacement = pipe.unet.forward.__wrapped__.__get__(pipe.unet)
    pipe.unet.forward = replacement
    assert sc.stats(pipe)["components"]["denoiser"]["builds"] == 1
    sc.clear(pipe)
    sc.uncached(pipe)
    assert pipe.unet.__dict__["forward"] is replacement and "forward" not in pipe.vae.decoder.__dict__
    del pipe.unet.forward
    assert sc.wrap(pipe, sizes=[(32, 32)], progress=False) is pipe


def test_background_prewarm_queues_every_size_largest_first_and_runs_nothing():
    pipe = tp.stable_diffusion()
    sc.wrap(pipe, sizes=[(32, 32), (48, 48), (32, 48)], backend="eager", build="background", progress=False)
    assert sc.wait(pipe, timeout=60)
    st = sc.stats(pipe)
    denoiser = st["components"]["denoiser"]
    # queued, not missed: no call ran
    assert (denoiser["calls"], denoiser["misses"], denoiser["background_builds"], denoiser["pending_builds"]) == (0, 0, 3, 0)
    assert st["background_builds"] == 6 and st["prewarmed"] == []  # denoiser and decoder, per size
    # Entries are listed most recently used first: the reverse of the order they were built in.
    built = [tuple(int(n) for n in e["bucket"].split("sample=(")[1].split(")")[0].split(",")[2:])
             for e in reversed(denoiser["entries"])]
    assert built == [(24, 24), (16, 24), (16, 16)]  # latents of 48x48, 32x48, 32x32 (the VAE halves each side)
    pipe(**text_inputs(), height=48, width=48, num_inference_steps=2, output_type="latent")
    assert sc.stats(pipe)["components"]["denoiser"]["hits"] == 2


def test_wrap_takes_compile_options_and_buckets_per_component_as_cached_does():
    pipe = tp.stable_diffusion()
    with pytest.raises(ValueError, match="compile_options were given with backend='eager'"):
        sc.wrap(pipe, backend="eager", compile_options={"mode": "default"})
    with pytest.raises(ValueError, match="'text_encoder' is not a component of this pipeline; expected 'denoiser' or "
                                         "'vae_decoder'"):
        sc.wrap(pipe, buckets={"text_encoder": {}})
    # a bucket of an argument the decoder's forward lacks: named, and nothing is left wrapped
    with pytest.raises(ValueError, match=r"buckets\['vae_decoder'\]: the function has no argument 'latents'; its "
                                         r"arguments are \['sample', 'latent_embeds'\]"):
        sc.wrap(pipe, backend="eager", buckets={"denoiser": {"sample": {2: sc.multiple_of(8)}},
                                                "vae_decoder": {"latents": {2: sc.multiple_of(8)}}})
    assert "forward" not in pipe.unet.__dict__ and "forward" not in pipe.vae.decoder.__dict__
    assert not hasattr(pipe, "_shapecache")

    sc.wrap(pipe, sizes=[(32, 32), (48, 32)], backend="eager",
            buckets={"denoiser": {"sample": {2: sc.multiple_of(32), 3: sc.multiple_of(32)}}})
    # 32 and 48 pixels are 16 and 24 latent rows: one denoiser bucket of 32 x 32, two decoder entries
    components = sc.stats(pipe)["components"]
    assert [e["bucket"].split("sample=")[1][:22] for e in components["denoiser"]["entries"]] == ["(2, 4, 32, 32) float32"]
    assert components["vae_decoder"]["builds"] == 2
    sc.uncached(pipe)
    compiled = tp.stable_diffusion()
    sc.wrap(compiled, backend="compile", compile_options={"options": {"freezing": False}})
    assert compiled.unet.forward.options.compile_options == {"options": {"freezing": False}}


@pytest.mark.slow
def test_wrap_with_upgrade_tries_each_entry_once_and_the_images_stay_the_plain_ones():
    pipe = tp.stable_diffusion()
    size = (32, 32)
    expected = run(pipe, text_inputs(), size)
    sc.wrap(pipe, sizes=[size], upgrade=True)
    assert sc.wait(pipe, timeout=600)
    assert sc.stats(pipe)["upgrades"] + sc.stats(pipe)["upgrades_not_kept"] == 0  # pre-warmed, not yet called
    torch.testing.assert_close(run(pipe, text_inputs(), size), expected, rtol=1e-4, atol=1e-4)  # hits: upgrades asked for
    assert sc.wait(pipe, timeout=600)
    stats = sc.stats(pipe)
    # The denoiser's and the decoder's entries, each compiled and measured once, kept or not.
    assert stats["builds"] == 2 and stats["pending_builds"] == 0
    assert stats["upgrades"] + stats["upgrades_not_kept"] == 2
    assert sorted(e["backend"] for e in stats["entries"]) == sorted(
        ["compile"] * stats["upgrades"] + ["eager"] * stats["upgrades_not_kept"])
    torch.testing.assert_close(run(pipe, text_inputs(), size), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="upgrade=True was given with backend='eager'"):
        sc.wrap(tp.stable_diffusion(), backend="eager", upgrade=True)
