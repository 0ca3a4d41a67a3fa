"""sc.encode_prompts: batched, detached, on the CPU, usable as the pipeline's keyword arguments."""

import gc
import weakref

import pytest
import torch

pytest.importorskip("diffusers")

import shapecache as sc  # noqa: E402
from shapecache.testing import tiny_pipelines as tp  # noqa: E402

PROMPTS = ["a photo of a cat", "a painting of a dog", "an astronaut riding a horse",
           "a red city at night", "the big blue moon"]


def test_batches_and_shapes_match_the_pipelines_own_encoding():
    pipe = tp.stable_diffusion()
    calls = []
    pipe.text_encoder.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    embeds = sc.encode_prompts(pipe, PROMPTS, batch_size=2)
    assert len(embeds) == 5 and calls == [2, 2, 2, 2, 1, 1]  # per batch: the prompts, then their negative prompts
    for prompt, e in zip(PROMPTS, embeds):
        assert set(e) == {"prompt_embeds", "negative_prompt_embeds"}
        single, negative = pipe.encode_prompt(prompt, torch.device("cpu"), 1, True)
        torch.testing.assert_close(e["prompt_embeds"], single, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(e["negative_prompt_embeds"], negative, rtol=1e-5, atol=1e-6)


def test_sdxl_returns_pooled_embeddings_too():
    pipe = tp.stable_diffusion_xl()
    embeds = sc.encode_prompts(pipe, PROMPTS[:3], batch_size=2)
    shapes = {name: tuple(t.shape) for name, t in embeds[0].items()}
    assert shapes == {"prompt_embeds": (1, 77, 64), "negative_prompt_embeds": (1, 77, 64),
                      "pooled_prompt_embeds": (1, 32), "negative_pooled_prompt_embeds": (1, 32)}


def test_results_hold_no_autograd_graph_and_no_activations():
    pipe = tp.stable_diffusion()
    pipe.text_encoder.requires_grad_(True)
    activations = []
    last_layer = pipe.text_encoder.get_submodule("encoder.layers")[-1]
    last_layer.register_forward_hook(lambda module, args, output: activations.append(
        weakref.ref(output[0] if isinstance(output, tuple) else output)))
    embeds = sc.encode_prompts(pipe, PROMPTS, batch_size=4)
    gc.collect()
    assert activations and all(ref() is None for ref in activations)
    for e in embeds:
        for t in e.values():
            assert t.grad_fn is None and not t.requires_grad and not t.is_inference() and t.device.type == "cpu"


def test_embeddings_drive_the_pipeline_like_the_prompt():
    pipe = tp.stable_diffusion()
    kwargs = dict(height=32, width=32, num_inference_steps=2, output_type="pt")
    expected = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), **kwargs).images
    (embeds,) = sc.encode_prompts(pipe, PROMPTS[:1], batch_size=1)
    assert torch.equal(pipe(**embeds, generator=torch.Generator().manual_seed(0), **kwargs).images, expected)


def test_negative_prompts_and_release_on_cpu():
    pipe = tp.stable_diffusion()
    embeds = sc.encode_prompts(pipe, PROMPTS[:2], negative_prompts="blue", release_encoders=True)
    _, negative = pipe.encode_prompt(PROMPTS[0], torch.device("cpu"), 1, True, negative_prompt="blue")
    torch.testing.assert_close(embeds[0]["negative_prompt_embeds"], negative, rtol=1e-5, atol=1e-6)
    assert embeds.released_bytes == 0 and pipe.text_encoder.device.type == "cpu"  # nothing to move off a CPU


def test_prompts_may_come_from_a_generator():
    pipe = tp.stable_diffusion()
    embeds = sc.encode_prompts(pipe, (p for p in ["a cat", "a dog", "a horse"]), batch_size=2)
    assert len(embeds) == 3 and all(e["prompt_embeds"].shape[0] == 1 for e in embeds)
    assert len(sc.encode_prompts(pipe, map(str.strip, [" a cat "]))) == 1


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"prompts": "a cat"}, TypeError, r"prompts='a cat': expected a list of strings"),
        ({"prompts": ["a", 3]}, TypeError, r"expected a list of strings"),
        ({"prompts": ["a"], "batch_size": 0}, ValueError, r"batch_size=0: expected a positive int"),
        ({"prompts": ["a", "b"], "negative_prompts": ["x"]}, ValueError, r"expected one per prompt \(2\), got 1"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        sc.encode_prompts(tp.stable_diffusion(), **kwargs)


@pytest.mark.cuda
def test_encoding_100_prompts_leaves_gpu_memory_where_it_started():
    pipe = tp.stable_diffusion().to("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    embeds = []
    for i in range(100):
        embeds.extend(sc.encode_prompts(pipe, [PROMPTS[i % len(PROMPTS)]]))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert all(e["prompt_embeds"].is_pinned() for e in embeds)
    released = sc.encode_prompts(pipe, PROMPTS[:1], release_encoders=True).released_bytes
    assert released > 0 and torch.cuda.memory_allocated() == before - released
