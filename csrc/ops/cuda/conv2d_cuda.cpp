// CUDA algorithms of shapecache::conv2d (built only where torch has CUDA):
//   aten                ATen's default path (cuDNN with ATen's own algorithm choice)
//   aten_channels_last  the same on channels-last copies
//   cudnn:<n>           cuDNN forward algorithm n (legacy API, still in cuDNN 9), run on the
//                       caller's tensors with its workspace from the device's arena; built
//                       where cuDNN's headers and library were found (SHAPECACHE_WITH_CUDNN)
// Each is timed with CUDA events on the current stream of the input's device.
#include <torch/library.h>

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#if SHAPECACHE_WITH_CUDNN
#include <ATen/cudnn/Handle.h>
#include <cudnn.h>
#endif

#include <memory>
#include <sstream>
#include <string>

#include "ops/conv2d.h"

namespace shapecache {
namespace {

#if SHAPECACHE_WITH_CUDNN
void check(cudnnStatus_t status, const char* what) {
  TORCH_CHECK(status == CUDNN_STATUS_SUCCESS, "shapecache::conv2d: ", what, " failed: ", cudnnGetErrorString(status));
}

cudnnDataType_t cudnn_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return CUDNN_DATA_FLOAT;
    case at::kHalf: return CUDNN_DATA_HALF;
    case at::kBFloat16: return CUDNN_DATA_BFLOAT16;
    case at::kDouble: return CUDNN_DATA_DOUBLE;
    default: TORCH_CHECK(false, "shapecache::conv2d: cuDNN has no ", type, " convolution");
  }
}

bool cudnn_supports(at::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16 || type == at::kDouble;
}

// The descriptors of one problem, created and destroyed around each use (host-only calls,
// also allowed during graph capture).
struct Descriptors {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  at::Tensor input, weight, output;  // in the layout the descriptors describe

  explicit Descriptors(const ConvArgs& a) {
    const auto format = a.input.suggest_memory_format();
    const bool nhwc = format == at::MemoryFormat::ChannelsLast;
    input = a.input.contiguous(format);
    weight = a.weight.contiguous(format);
    const auto type = cudnn_type(input.scalar_type());
    check(cudnnCreateTensorDescriptor(&x), "cudnnCreateTensorDescriptor");
    check(cudnnCreateTensorDescriptor(&y), "cudnnCreateTensorDescriptor");
    check(cudnnCreateFilterDescriptor(&w), "cudnnCreateFilterDescriptor");
    check(cudnnCreateConvolutionDescriptor(&conv), "cudnnCreateConvolutionDescriptor");
    set_tensor(x, input, type);
    check(cudnnSetFilter4dDescriptor(w, type, nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW, weight.size(0),
                                     weight.size(1), weight.size(2), weight.size(3)),
          "cudnnSetFilter4dDescriptor");
    const auto compute = input.scalar_type() == at::kDouble ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    check(cudnnSetConvolution2dDescriptor(conv, a.padding[0], a.padding[1], a.stride[0], a.stride[1], a.dilation[0],
                                          a.dilation[1], CUDNN_CROSS_CORRELATION, compute),
          "cudnnSetConvolution2dDescriptor");
    check(cudnnSetConvolutionGroupCount(conv, static_cast<int>(a.groups)), "cudnnSetConvolutionGroupCount");
    // As ATen does: tensor cores for half types; for float32 only where TF32 is allowed for
    // convolutions. Asked without an operator, torch (2.11, 2.13: Context::allowTF32CuDNN)
    // raises once the convolution's and the RNN's flags differ (fp32_precision set for one).
    cudnnMathType_t math = CUDNN_TENSOR_OP_MATH;
    if (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble) {
      math = at::globalContext().allowTF32CuDNN(at::Float32Op::CONV) ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
    }
    check(cudnnSetConvolutionMathType(conv, math), "cudnnSetConvolutionMathType");
    int n = 0, c = 0, h = 0, wd = 0;
    check(cudnnGetConvolution2dForwardOutputDim(conv, x, w, &n, &c, &h, &wd), "cudnnGetConvolution2dForwardOutputDim");
    output = at::empty({n, c, h, wd}, input.options(), format);
    set_tensor(y, output, type);
  }

  ~Descriptors() {
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x) cudnnDestroyTensorDescriptor(x);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;

 private:
  static void set_tensor(cudnnTensorDescriptor_t desc, const at::Tensor& t, cudnnDataType_t type) {
    check(cudnnSetTensor4dDescriptorEx(desc, type, t.size(0), t.size(1), t.size(2), t.size(3), t.stride(0),
                                       t.stride(1), t.stride(2), t.stride(3)),
          "cudnnSetTensor4dDescriptorEx");
  }
};

int64_t cudnn_workspace_bytes(const ConvArgs& a, cudnnConvolutionFwdAlgo_t algorithm) {
  if (!cudnn_supports(a.input.scalar_type())) return -1;
  c10::cuda::CUDAGuard guard(a.input.device());
  Descriptors d(a);
  size_t bytes = 0;
  const cudnnStatus_t status =
      cudnnGetConvolutionForwardWorkspaceSize(at::native::getCudnnHandle(), d.x, d.w, d.conv, d.y, algorithm, &bytes);
  return status == CUDNN_STATUS_SUCCESS ? static_cast<int64_t>(bytes) : -1;
}

at::Tensor cudnn_run(const ConvArgs& a, const at::Tensor& workspace, cudnnConvolutionFwdAlgo_t algorithm) {
  c10::cuda::CUDAGuard guard(a.input.device());
  Descriptors d(a);
  cudnnHandle_t handle = at::native::getCudnnHandle();
  check(cudnnSetStream(handle, at::cuda::getCurrentCUDAStream(a.input.device().index()).stream()), "cudnnSetStream");
  // alpha/beta are float for every type but double (cuDNN's scaling parameter rule).
  const double alpha_d = 1, beta_d = 0;
  const float alpha_f = 1, beta_f = 0;
  const bool is_double = a.input.scalar_type() == at::kDouble;
  const void* alpha = is_double ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = is_double ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
  const size_t bytes = workspace.defined() ? static_cast<size_t>(workspace.numel()) : 0;
  check(cudnnConvolutionForward(handle, alpha, d.x, d.input.data_ptr(), d.w, d.weight.data_ptr(), d.conv, algorithm,
                                bytes ? workspace.data_ptr() : nullptr, bytes, beta, d.y, d.output.data_ptr()),
        "cudnnConvolutionForward");
  if (a.bias) d.output.add_(a.bias->view({1, -1, 1, 1}));
  return d.output;
}

std::string cudnn_algorithm_name(int algorithm) { return "cudnn:" + std::to_string(algorithm); }
#endif  // SHAPECACHE_WITH_CUDNN

ConvDeviceHooks cuda_hooks() {
  ConvDeviceHooks hooks;
  hooks.algorithms.push_back({"aten", [](const ConvArgs&) -> int64_t { return 0; },
                              [](const ConvArgs& a, const at::Tensor&) { return conv2d_aten(a); }});
  hooks.algorithms.push_back(
      {"aten_channels_last", [](const ConvArgs&) -> int64_t { return 0; }, [](const ConvArgs& a, const at::Tensor&) {
         return at::conv2d(a.input.contiguous(at::MemoryFormat::ChannelsLast),
                           a.weight.contiguous(at::MemoryFormat::ChannelsLast), a.bias, a.stride, a.padding,
                           a.dilation, a.groups)
             .contiguous(a.input.suggest_memory_format());
       }});
#if SHAPECACHE_WITH_CUDNN
  for (int i = 0; i < CUDNN_CONVOLUTION_FWD_ALGO_COUNT; ++i) {
    const auto algorithm = static_cast<cudnnConvolutionFwdAlgo_t>(i);
    hooks.algorithms.push_back(
        {cudnn_algorithm_name(i), [algorithm](const ConvArgs& a) { return cudnn_workspace_bytes(a, algorithm); },
         [algorithm](const ConvArgs& a, const at::Tensor& workspace) { return cudnn_run(a, workspace, algorithm); }});
  }
#endif
  hooks.time = [](const c10::Device& device, const std::function<void()>& work) {
    c10::cuda::CUDAGuard guard(device);
    const auto stream = at::cuda::getCurrentCUDAStream(device.index());
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);  // timing events
    start.record(stream);
    work();
    stop.record(stream);
    stop.synchronize();
    return static_cast<double>(start.elapsed_time(stop)) * 1000.0;
  };
  hooks.capturing = [](const c10::Device& device) {
    c10::cuda::CUDAGuard guard(device);
    return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  };
  hooks.environment = [](const c10::Device& device) {
    const cudaDeviceProp* properties = at::cuda::getDeviceProperties(device.index());
    std::ostringstream out;
    out << "cuda " << properties->name << " sm_" << properties->major << properties->minor;
#if SHAPECACHE_WITH_CUDNN
    out << "; cudnn " << cudnnGetVersion();
#endif
    out << "; tf32 " << (at::globalContext().allowTF32CuDNN(at::Float32Op::CONV) ? "on" : "off");
    return out.str();
  };
  hooks.devices = [] {
    std::vector<c10::Device> devices;
    for (c10::DeviceIndex i = 0; i < c10::cuda::device_count(); ++i) devices.emplace_back(c10::DeviceType::CUDA, i);
    return devices;
  };
  return hooks;
}

const bool registered = (register_conv_device(c10::DeviceType::CUDA, cuda_hooks()), true);

at::Tensor conv2d_cuda(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  // The dispatcher sets no device guard for custom ops: everything below runs on the input's device.
  c10::cuda::CUDAGuard guard(input.device());
  return conv2d_tuned(input, weight, bias, stride, padding, dilation, groups);
}

}  // namespace

TORCH_LIBRARY_IMPL(shapecache, CUDA, m) { m.impl("conv2d", &conv2d_cuda); }

}  // namespace shapecache
