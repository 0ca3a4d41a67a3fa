#include "ops/cuda/cuda_graph_runner.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <unordered_map>
#include <unordered_set>

#include "ops/call_key.h"
#include "ops/workspace_arena.h"

namespace shapecache {
namespace {

// `later` waits, on the GPU, for what `earlier` has queued so far.
void order_after(const c10::cuda::CUDAStream& earlier, const c10::cuda::CUDAStream& later) {
  if (earlier == later) return;
  at::cuda::CUDAEvent event;
  event.record(earlier);
  event.block(later);
}

}  // namespace

DeviceGraphs::DeviceGraphs(c10::DeviceIndex index)
    : device(index), pool(at::cuda::graph_pool_handle()), stream(c10::cuda::getStreamFromPool(false, index)) {}

DeviceGraphs& DeviceGraphs::of(c10::DeviceIndex device) {
  static std::mutex registry_mutex;
  static auto* devices = new std::map<c10::DeviceIndex, std::unique_ptr<DeviceGraphs>>();  // never freed
  std::lock_guard<std::mutex> guard(registry_mutex);
  auto& graphs = (*devices)[device];
  if (!graphs) graphs.reset(new DeviceGraphs(device));
  return *graphs;
}

int64_t DeviceGraphs::pool_bytes() const {
  int64_t bytes = 0;
  for (const auto& segment : c10::cuda::CUDACachingAllocator::snapshot().segments) {
    if (segment.device == device && segment.owner_private_pool_id == pool) bytes += segment.total_size;
  }
  return bytes;
}

std::shared_ptr<CudaGraphRunner> CudaGraphRunner::capture(const py::object& function, const py::object& owner,
                                                          const py::tuple& args, const py::dict& kwargs,
                                                          std::vector<std::string> parameter_names,
                                                          std::shared_ptr<WeightSnapshot> weights) {
  std::shared_ptr<CudaGraphRunner> runner(new CudaGraphRunner());
  runner->parameter_names_ = std::move(parameter_names);
  runner->weights_ = std::move(weights);

  // Static inputs: a copy of every tensor of the call (one per distinct tensor, so an input
  // passed twice stays one tensor inside the graph), listed in canonical order.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> copies;
  auto static_copy = [&](const at::Tensor& t) {
    auto [it, fresh] = copies.try_emplace(t.unsafeGetTensorImpl());
    if (fresh) it->second = t.clone(at::MemoryFormat::Preserve);
    return it->second;
  };
  for (const at::Tensor& t : runner->inputs_in_key_order(args, kwargs)) runner->static_inputs_.push_back(static_copy(t));
  TORCH_CHECK(!runner->static_inputs_.empty(), "cuda_graph: a call without tensor arguments cannot be captured");
  const c10::Device device = runner->static_inputs_.front().device();
  TORCH_CHECK(device.is_cuda(), "cuda_graph: the call's tensors are on ", device, "; CUDA graphs need CUDA tensors");
  const py::object static_args = map_tensors(args, static_copy);
  const py::object static_kwargs = map_tensors(kwargs, static_copy);

  c10::cuda::CUDAGuard device_guard(device);
  DeviceGraphs& graphs = DeviceGraphs::of(device.index());
  runner->device_ = &graphs;
  runner->workspace_generation_ = WorkspaceArena::of(device).generation();
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device.index());

  py::object outputs;
  {
    std::lock_guard<std::mutex> lock(graphs.mutex);
    order_after(caller, graphs.stream);  // the static inputs were written on the caller's stream
    c10::cuda::CUDAStreamGuard stream_guard(graphs.stream);
    runner->graph_.capture_begin(graphs.pool);
    try {
      py::tuple call_args = owner.is_none() ? py::tuple(static_args) : py::tuple(py::make_tuple(owner) + static_args);
      outputs = function(*call_args, **static_kwargs);
    } catch (...) {
      // No capture may be left open, whatever failed inside it (an out-of-memory error, a
      // synchronising operation): end it, then report the original error.
      try {
        runner->graph_.capture_end();
      } catch (...) {
      }
      throw;
    }
    runner->graph_.capture_end();
    order_after(graphs.stream, caller);
  }
  runner->output_structure_ = outputs;
  for_each_tensor(outputs.ptr(), [&](const at::Tensor& t) { runner->static_outputs_.push_back(t); });
  return runner;
}

std::vector<at::Tensor> CudaGraphRunner::inputs_in_key_order(const py::tuple& args, const py::dict& kwargs) const {
  size_t unnamed = 0;
  std::vector<at::Tensor> inputs;
  for (const NamedArgument& argument : canonical_arguments(args, kwargs, &parameter_names_, &unnamed)) {
    for_each_tensor(argument.value, [&](const at::Tensor& t) { inputs.push_back(t); });
  }
  return inputs;
}

py::object CudaGraphRunner::run(const py::tuple& args, const py::dict& kwargs) {
  const std::vector<at::Tensor> inputs = inputs_in_key_order(args, kwargs);
  TORCH_INTERNAL_ASSERT(inputs.size() == static_inputs_.size(), "cuda_graph: the call has ", inputs.size(),
                        " tensors, the graph was captured with ", static_inputs_.size());
  DeviceGraphs& graphs = *device_;
  c10::cuda::CUDAGuard device_guard(graphs.device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(graphs.device);
  std::vector<at::Tensor> outputs;
  outputs.reserve(static_outputs_.size());
  {
    // Replays of a device take turns on its stream: after the caller's work, before the
    // caller's later work. Output memory belongs to the caller's stream; it is written on
    // the graphs' stream, which the caller then waits for.
    std::lock_guard<std::mutex> lock(graphs.mutex);
    for (const at::Tensor& s : static_outputs_) outputs.push_back(at::empty_like(s));
    order_after(caller, graphs.stream);
    c10::cuda::CUDAStreamGuard stream_guard(graphs.stream);
    for (size_t i = 0; i < inputs.size(); ++i) static_inputs_[i].copy_(inputs[i], /*non_blocking=*/true);
    graph_.replay();
    for (size_t i = 0; i < outputs.size(); ++i) outputs[i].copy_(static_outputs_[i], /*non_blocking=*/true);
    order_after(graphs.stream, caller);
  }
  size_t next = 0;  // the outputs' structure, rebuilt around the copies (in the same walk order)
  return map_tensors(output_structure_, [&](const at::Tensor&) { return outputs.at(next++); });
}

bool CudaGraphRunner::valid() {
  if (WorkspaceArena::of(c10::Device(c10::DeviceType::CUDA, device_->device)).generation() != workspace_generation_) {
    return false;
  }
  return !weights_ || weights_->unchanged();
}

int64_t CudaGraphRunner::static_input_bytes() const {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const at::Tensor& t : static_inputs_) {
    if (seen.insert(t.storage().data()).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

void bind_cuda_graphs(py::module_& m) {
  py::class_<CudaGraphRunner, EntryRunner, std::shared_ptr<CudaGraphRunner>>(m, "CudaGraphRunner")
      .def_property_readonly("static_input_bytes", &CudaGraphRunner::static_input_bytes)
      .def_property_readonly("device", &CudaGraphRunner::device);
  m.def("capture_cuda_graph", &CudaGraphRunner::capture, py::arg("function"), py::arg("owner"), py::arg("args"),
        py::arg("kwargs"), py::arg("parameter_names"), py::arg("weights"),
        "Captures one call as a CUDA graph in its device's shared pool (warm the function up first).");
  m.def(
      "cuda_graph_pool_bytes", [](c10::Device device) { return DeviceGraphs::of(device.index()).pool_bytes(); },
      py::arg("device"));
}

}  // namespace shapecache
