"""Python entry points of the C++ ops, with the fake (meta) implementations that
torch.compile and torch.library.opcheck need, and autograd formulas."""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

from shapecache._extension import _C  # noqa: F401  (registers the ops)


def _pair(value, name: str) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value, value]
    pair = list(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
        raise TypeError(f"{name}={value!r}: expected an int or a pair of ints")
    return pair


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1) -> torch.Tensor:
    """``torch.nn.functional.conv2d`` with the algorithm tuned per exact problem.

    The first call of a problem times every algorithm of the device whose workspace fits the
    arena cap and records the fastest (persisted by ``shapecache.tune_convs``'s database);
    later calls run it directly. Results match ATen's to floating-point rounding (other
    algorithms sum in another order). ``padding`` is numeric: for "same"/"valid" use
    ``tune_convs``, which resolves them per layer.
    """
    return torch.ops.shapecache.conv2d(
        input, weight, bias, _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation"), groups
    )


def _output_size(size, kernel, stride, padding, dilation):
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


@torch.library.register_fake("shapecache::conv2d")
def _conv2d_fake(input, weight, bias, stride, padding, dilation, groups):
    torch._check(input.dim() == 4, lambda: f"shapecache::conv2d: input should be 4-D, got {input.dim()}-D")
    n, _, h, w = input.shape
    k, _, r, s = weight.shape
    ho = _output_size(h, r, stride[0], padding[0], dilation[0])
    wo = _output_size(w, s, stride[1], padding[1], dilation[1])
    return torch.empty((n, k, ho, wo), dtype=input.dtype, device=input.device, memory_format=suggest_memory_format(input))


def _conv2d_setup_context(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(input, weight)
    ctx.has_bias = bias is not None
    ctx.bias_shape = list(bias.shape) if bias is not None else None
    ctx.params = (stride, padding, dilation, groups)


def _conv2d_backward(ctx, grad_output):
    input, weight = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.params
    grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
        grad_output, input, weight, ctx.bias_shape, stride, padding, dilation, False, [0, 0], groups,
        [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]],
    )
    return grad_input, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None


torch.library.register_autograd("shapecache::conv2d", _conv2d_backward, setup_context=_conv2d_setup_context)
