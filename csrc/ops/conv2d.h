// shapecache::conv2d: a 2-D convolution whose algorithm is tuned per exact problem.
// Schema (registered once, in conv2d.cpp; each device adds its kernel beside it):
//   conv2d(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding,
//          int[2] dilation, int groups) -> Tensor
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "ops/conv_tuner.h"

namespace shapecache {

// Checks the arguments (TORCH_CHECK, naming what was received) and packs them.
ConvArgs make_conv_args(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups);

// The kernel every device registers: checks, then the tuner.
at::Tensor conv2d_tuned(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups);

// ATen's own convolution of `args`, in the input's suggested memory format: the default
// algorithm of every device.
at::Tensor conv2d_aten(const ConvArgs& args);

}  // namespace shapecache
