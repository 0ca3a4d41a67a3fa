#include "cache/weight_snapshot.h"

#include <torch/csrc/autograd/python_variable.h>

#include <atomic>

namespace shapecache {
namespace {

std::atomic<uint64_t> generation{0};

}  // namespace

uint64_t module_generation() { return generation.load(std::memory_order_relaxed); }
void bump_module_generation() { generation.fetch_add(1, std::memory_order_relaxed); }

WeightSnapshot::WeightSnapshot(const py::object& owner, py::object tensors_of)
    : owner_(py::weakref(owner)), tensors_of_(std::move(tensors_of)), generation_(module_generation()) {
  tensors_ = current();
  data_.reserve(tensors_.size());
  for (const at::Tensor& t : tensors_) data_.push_back(t.data_ptr());
}

std::vector<at::Tensor> WeightSnapshot::current() const {
  py::object owner = owner_();
  std::vector<at::Tensor> out;
  if (owner.is_none()) return out;
  for (py::handle item : tensors_of_(owner)) {
    TORCH_CHECK(THPVariable_Check(item.ptr()), "shapecache: tensors_of must return tensors");
    out.push_back(THPVariable_Unpack(item.ptr()));
  }
  return out;
}

bool WeightSnapshot::valid() {
  if (stale_) return false;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].data_ptr() != data_[i]) return !(stale_ = true);
  }
  const uint64_t now = module_generation();
  if (now == generation_) return true;
  // Some module registered a parameter, buffer or submodule: are the owner's still ours?
  const std::vector<at::Tensor> tensors = current();
  bool same = tensors.size() == tensors_.size();
  for (size_t i = 0; same && i < tensors.size(); ++i) {
    same = tensors[i].unsafeGetTensorImpl() == tensors_[i].unsafeGetTensorImpl();
  }
  if (!same) return !(stale_ = true);
  generation_ = now;
  return true;
}

}  // namespace shapecache
