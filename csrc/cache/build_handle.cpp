#include "cache/build_handle.h"

#include <torch/csrc/Device.h>

namespace shapecache {

py::object BuildHandle::to_python(BuildHandle handle) {
  py::object device = py::reinterpret_steal<py::object>(THPDevice_New(handle.device_));
  const bool run_call = handle.run_call_;
  py::tuple tensors = handle.tensors_;
  py::object upgrading = handle.upgrading_;
  py::object object = py::cast(std::move(handle));
  object.attr("device") = device;
  object.attr("run_call") = py::bool_(run_call);
  object.attr("tensors") = tensors;
  object.attr("upgrading") = upgrading;
  return object;
}

SharedBytes BuildHandle::shared_given(std::optional<int64_t> pool, std::optional<int64_t> workspace) const {
  SharedBytes bytes = cache_->shared_bytes(device_);  // a figure not given stays as it is
  if (pool) bytes.pool = *pool;
  if (workspace) bytes.workspace = *workspace;
  return bytes;
}

void BuildHandle::set_shared_bytes(std::optional<int64_t> pool, std::optional<int64_t> workspace) {
  auto evicted = cache_->set_shared_bytes(device_, shared_given(pool, workspace));
}

bool BuildHandle::set_shared_bytes_if_free(std::optional<int64_t> pool, std::optional<int64_t> workspace,
                                           int64_t bytes) {
  return cache_->set_shared_bytes_if_free(device_, shared_given(pool, workspace), bytes);
}

py::list BuildHandle::set_entry_bytes(uint64_t id, int64_t bytes) {
  py::list ids;  // what left the cache; the entries themselves are destroyed on return
  for (const auto& gone : cache_->set_entry_bytes(device_, id, bytes)) ids.append(gone.value.id);
  return ids;
}

}  // namespace shapecache
