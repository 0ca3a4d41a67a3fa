// CPU algorithms of shapecache::conv2d:
//   aten                ATen's default (oneDNN where it applies)
//   aten_channels_last  ATen on channels-last copies of input and weight (oneDNN's native
//                       layout), converted back to the input's format
//   im2col_gemm         per image and group: unfold into a column buffer in the workspace
//                       arena, then one GEMM; wins for small channel counts and 1x1 kernels
//                       on some machines
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

#include "ops/conv2d.h"

namespace shapecache {
namespace {

int64_t output_size(int64_t in, int64_t kernel, int64_t stride, int64_t padding, int64_t dilation) {
  return (in + 2 * padding - dilation * (kernel - 1) - 1) / stride + 1;
}

int64_t im2col_workspace_bytes(const ConvArgs& a) {
  const int64_t rows = a.weight.size(1) * a.weight.size(2) * a.weight.size(3);
  const int64_t ho = output_size(a.input.size(2), a.weight.size(2), a.stride[0], a.padding[0], a.dilation[0]);
  const int64_t wo = output_size(a.input.size(3), a.weight.size(3), a.stride[1], a.padding[1], a.dilation[1]);
  if (ho <= 0 || wo <= 0) return -1;
  return rows * ho * wo * static_cast<int64_t>(a.input.element_size());
}

at::Tensor conv2d_im2col_gemm(const ConvArgs& a, const at::Tensor& workspace) {
  const at::Tensor input = a.input.contiguous();
  const int64_t n = input.size(0), groups = a.groups;
  const int64_t c_per_group = a.weight.size(1), k = a.weight.size(0), k_per_group = k / groups;
  const int64_t r = a.weight.size(2), s = a.weight.size(3);
  const int64_t ho = output_size(input.size(2), r, a.stride[0], a.padding[0], a.dilation[0]);
  const int64_t wo = output_size(input.size(3), s, a.stride[1], a.padding[1], a.dilation[1]);
  const int64_t rows = c_per_group * r * s, columns = ho * wo;

  at::Tensor output = at::empty({n, k, ho, wo}, input.options());
  // The column buffer of one image and group, in the arena (which outlives this call).
  at::Tensor col = at::from_blob(workspace.data_ptr(), {rows, columns}, input.options());
  const at::Tensor weight = a.weight.contiguous().view({groups, k_per_group, rows});
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      at::im2col_out(col, input[i].narrow(0, g * c_per_group, c_per_group), {r, s}, a.dilation, a.padding, a.stride);
      at::Tensor out = output[i].narrow(0, g * k_per_group, k_per_group).view({k_per_group, columns});
      at::mm_out(out, weight[g], col);
    }
  }
  if (a.bias) output.add_(a.bias->view({1, k, 1, 1}));
  return output.contiguous(a.input.suggest_memory_format());
}

at::Tensor conv2d_channels_last(const ConvArgs& a) {
  return at::conv2d(a.input.contiguous(at::MemoryFormat::ChannelsLast),
                    a.weight.contiguous(at::MemoryFormat::ChannelsLast), a.bias, a.stride, a.padding, a.dilation,
                    a.groups)
      .contiguous(a.input.suggest_memory_format());
}

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown cpu";
}

ConvDeviceHooks cpu_hooks() {
  ConvDeviceHooks hooks;
  hooks.algorithms = {
      {"aten", [](const ConvArgs&) -> int64_t { return 0; },
       [](const ConvArgs& a, const at::Tensor&) { return conv2d_aten(a); }},
      {"aten_channels_last", [](const ConvArgs&) -> int64_t { return 0; },
       [](const ConvArgs& a, const at::Tensor&) { return conv2d_channels_last(a); }},
      {"im2col_gemm", im2col_workspace_bytes, conv2d_im2col_gemm},
  };
  hooks.time = [](const c10::Device&, const std::function<void()>& work) {
    const auto start = std::chrono::steady_clock::now();
    work();
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  };
  hooks.environment = [](const c10::Device&) {
    static const std::string model = cpu_model();
    std::ostringstream out;
    out << "cpu " << model << "; threads " << at::get_num_threads();
    return out.str();
  };
  hooks.devices = [] { return std::vector<c10::Device>{c10::Device(c10::DeviceType::CPU)}; };
  return hooks;
}

const bool registered = (register_conv_device(c10::DeviceType::CPU, cpu_hooks()), true);

}  // namespace

TORCH_LIBRARY_IMPL(shapecache, CPU, m) { m.impl("conv2d", &conv2d_tuned); }

}  // namespace shapecache
