#include "ops/conv2d.h"

#include <torch/library.h>

namespace shapecache {

ConvArgs make_conv_args(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  TORCH_CHECK(input.dim() == 4, "shapecache::conv2d: input should be a 4-D (N, C, H, W) tensor, got ", input.dim(),
              "-D with shape ", input.sizes());
  TORCH_CHECK(weight.dim() == 4, "shapecache::conv2d: weight should be a 4-D (K, C/groups, R, S) tensor, got ",
              weight.dim(), "-D with shape ", weight.sizes());
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
              "shapecache::conv2d: stride, padding and dilation should have 2 values each, got ", stride, ", ",
              padding, ", ", dilation);
  TORCH_CHECK(groups >= 1, "shapecache::conv2d: groups should be >= 1, got ", groups);
  TORCH_CHECK(input.size(1) == weight.size(1) * groups, "shapecache::conv2d: input has ", input.size(1),
              " channels but weight expects ", weight.size(1), " x groups=", groups);
  TORCH_CHECK(weight.size(0) % groups == 0, "shapecache::conv2d: output channels ", weight.size(0),
              " are not divisible by groups=", groups);
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(), "shapecache::conv2d: input is ", input.scalar_type(),
              " but weight is ", weight.scalar_type());
  TORCH_CHECK(input.device() == weight.device(), "shapecache::conv2d: input is on ", input.device(),
              " but weight is on ", weight.device());
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(stride[i] >= 1 && dilation[i] >= 1 && padding[i] >= 0,
                "shapecache::conv2d: stride and dilation should be >= 1 and padding >= 0, got stride=", stride,
                " padding=", padding, " dilation=", dilation);
  }
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "shapecache::conv2d: bias should have shape (",
                weight.size(0), ",), got ", bias->sizes());
    TORCH_CHECK(bias->device() == input.device() && bias->scalar_type() == input.scalar_type(),
                "shapecache::conv2d: bias should be ", input.scalar_type(), " on ", input.device(), ", got ",
                bias->scalar_type(), " on ", bias->device());
  }
  return ConvArgs{input, weight, bias, {stride[0], stride[1]}, {padding[0], padding[1]}, {dilation[0], dilation[1]},
                  groups};
}

at::Tensor conv2d_tuned(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  return ConvTuner::instance().run(make_conv_args(input, weight, bias, stride, padding, dilation, groups));
}

at::Tensor conv2d_aten(const ConvArgs& a) {
  return at::conv2d(a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups)
      .contiguous(a.input.suggest_memory_format());
}

TORCH_LIBRARY(shapecache, m) {
  m.def(
      "conv2d(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, int[2] dilation, "
      "int groups) -> Tensor");
}

}  // namespace shapecache
