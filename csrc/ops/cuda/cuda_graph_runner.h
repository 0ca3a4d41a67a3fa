// CudaGraphRunner: one shape bucket captured as a CUDA graph and replayed from C++.
//
// Policy (DeviceGraphs, one per device):
//   - Every graph of a device is captured into one private memory pool, on one stream, and
//     replayed on that stream under one lock, so graphs never run at the same time: the
//     temporaries of each reuse the same memory, and the pool is as large as the largest
//     graph needs, not the sum of all of them.
//   - Capture the largest bucket first. Blocks a large graph freed serve every smaller one,
//     but a larger graph captured after smaller ones needs blocks the pool does not have: the
//     pool grows by the difference and its old blocks no longer fit anything. Largest first,
//     the pool reaches its final size with the first capture.
//   - Inputs are copied into a graph's static inputs and outputs copied out of its static
//     outputs, so a caller's results stay valid after later replays of any graph in the pool.
//   - A graph is stale when the weights it captured were replaced or the workspace arena it
//     may have captured moved: it is then rebuilt, never replayed.
#pragma once

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ops/entry_runner.h"
#include "ops/weight_snapshot.h"

namespace shapecache {

namespace py = pybind11;

struct DeviceGraphs {
  static DeviceGraphs& of(c10::DeviceIndex device);

  // Bytes the allocator holds in this device's graph pool now.
  int64_t pool_bytes() const;

  const c10::DeviceIndex device;
  const decltype(at::cuda::graph_pool_handle()) pool;
  c10::cuda::CUDAStream stream;  // every capture and every replay of the device
  std::mutex mutex;              // one capture or replay at a time

 private:
  explicit DeviceGraphs(c10::DeviceIndex index);
};

class CudaGraphRunner final : public EntryRunner {
 public:
  // Captures function(owner, *args, **kwargs) (without owner when it is None) on static copies
  // of the tensors in `args` and `kwargs`. The caller has warmed the function up already:
  // nothing may be tuned, compiled or lazily initialised inside capture.
  static std::shared_ptr<CudaGraphRunner> capture(const py::object& function, const py::object& owner,
                                                  const py::tuple& args, const py::dict& kwargs,
                                                  std::vector<std::string> parameter_names,
                                                  std::shared_ptr<WeightSnapshot> weights);

  py::object run(const py::tuple& args, const py::dict& kwargs) override;
  bool valid() override;

  int64_t static_input_bytes() const;
  c10::DeviceIndex device() const { return device_->device; }

 private:
  CudaGraphRunner() = default;
  std::vector<at::Tensor> inputs_in_key_order(const py::tuple& args, const py::dict& kwargs) const;

  at::cuda::CUDAGraph graph_;
  DeviceGraphs* device_ = nullptr;
  std::vector<std::string> parameter_names_;  // canonical argument order, as in the key
  std::vector<at::Tensor> static_inputs_;     // one per tensor of a call, in canonical order
  std::vector<at::Tensor> static_outputs_;    // every tensor of the outputs, in walk order
  py::object output_structure_;               // the outputs as captured (static tensors inside)
  std::shared_ptr<WeightSnapshot> weights_;   // null for functions without an owner module
  uint64_t workspace_generation_ = 0;         // the arena's generation when captured
};

void bind_cuda_graphs(py::module_& m);

}  // namespace shapecache
