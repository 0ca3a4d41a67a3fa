"""What per-size graph caches do, as the baseline that scenarios and benchmarks measure
shapecache against: a new compiled artifact per input shape, each with memory of its own,
none ever dropped."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map

from shapecache._backends import dynamo_entry_point


def naive_forward(forward: Callable, device: torch.device, compile_options: dict) -> Callable:
    """`forward(self, ...)` served by one artifact per input shape, all kept: on CUDA a CUDA
    graph in a pool of its own (``capture_per_size_graph``), elsewhere a ``torch.compile``
    graph of its own entry point."""
    artifacts = {}

    def shape_key(args, kwargs):
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        return tuple((tuple(t.shape), t.dtype) for t in tensors)

    def naive(self, *args, **kwargs):
        key = shape_key(args, kwargs)
        if key not in artifacts:
            if device.type == "cuda":
                artifacts[key] = capture_per_size_graph(forward, self, args, kwargs)
            else:
                artifacts[key] = torch.compile(dynamo_entry_point(forward), dynamic=False, **compile_options)
        return artifacts[key](self, *args, **kwargs)

    return naive


def capture_per_size_graph(forward: Callable, module, args: tuple, kwargs: dict) -> Callable:
    """`forward(module, *args, **kwargs)` captured as a CUDA graph in a private pool, after a
    warm-up on a side stream. Returns ``replay(module, *args, **kwargs)``: it copies every
    input tensor (nested ones too) into the graph's, replays, and returns the graph's own
    output, overwritten by its next replay, as per-size graph caches do."""
    static_args, static_kwargs = tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, (args, kwargs))
    static_inputs = [t for t in tree_leaves((static_args, static_kwargs)) if isinstance(t, torch.Tensor)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(module, *static_args, **static_kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # no pool argument: a private pool of its own
        out = forward(module, *static_args, **static_kwargs)

    def replay(_module, *call_args, **call_kwargs):
        inputs = [t for t in tree_leaves((call_args, call_kwargs)) if isinstance(t, torch.Tensor)]
        for static, given in zip(static_inputs, inputs, strict=True):
            static.copy_(given)
        graph.replay()
        return out

    return replay
