// WeightSnapshot: the parameters and buffers an entry captured, to tell when they are replaced.
//
// A CUDA graph reads its weights at the addresses it captured. Updating them in place
// (copy_, load_state_dict) is seen by the graph; replacing them is not:
//   - a new tensor assigned to the module (module.weight = nn.Parameter(...), a new buffer or
//     submodule): torch's module registration hooks announce it, and bump module_generation();
//   - new storage under the same tensor (p.data = ..., module.to(...)): its data pointer moves.
// valid() checks both in C++: one integer compare, and one pointer compare per tensor.
// Only after a registration anywhere in the process does it ask Python for the owner's tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace shapecache {

namespace py = pybind11;

// Bumped by torch's global module registration hooks (installed by shapecache.weights).
uint64_t module_generation();
void bump_module_generation();

class WeightSnapshot {
 public:
  // `owner`: the module (held weakly); `tensors_of(owner) -> list[Tensor]`: its parameters
  // and buffers now, in a stable order.
  WeightSnapshot(const py::object& owner, py::object tensors_of);

  bool valid();
  size_t size() const { return tensors_.size(); }

 private:
  std::vector<at::Tensor> current() const;

  py::object owner_;      // weak reference
  py::object tensors_of_;
  std::vector<at::Tensor> tensors_;  // held: a stale graph still points into their memory
  std::vector<const void*> data_;    // their data pointers when captured
  uint64_t generation_;              // module_generation() when last verified
  bool stale_ = false;               // once stale, always stale
};

}  // namespace shapecache
