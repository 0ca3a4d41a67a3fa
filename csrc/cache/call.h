// Call: one call of a cached function, made once, by the key computation (call_key.h), and
// handed to everything that serves it: the lookup reads its key and device, an entry's runner
// its arguments or its tensors, the miss policy and the builder all of it, the crop its plan.
// Nothing downstream walks the arguments again.
#pragma once

#include <pybind11/pybind11.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/shape_key.h"

namespace shapecache {

namespace py = pybind11;

// One padded dimension of a padded argument, in argument order.
struct CropDim {
  int64_t argument;  // which bucketed argument: its index in the function's ArgumentBuckets
  int64_t dim;
  int64_t original;
  int64_t padded;
};

// What a padded call's outputs are cropped to: the plain call's size of each output tensor,
// or none when the function cannot run on fake tensors (`reason` says why). Made by CropPlans.
struct CropPlan {
  std::optional<std::vector<std::vector<int64_t>>> shapes;
  std::string reason;
};

struct Call {
  ShapeKey key;
  c10::Device device{c10::kCPU};  // budget domain: the first tensor's device, CPU if none
  py::object owner = py::none();  // the object a method is bound to, or None
  // As the caller passed them, without the owner.
  py::tuple args;
  py::dict kwargs;
  // What an entry and the plain function are called with: the arguments padded to their
  // bucket (the caller's own when nothing was padded), the owner first.
  py::tuple entry_args;
  py::dict entry_kwargs;
  // The tensors of entry_args and entry_kwargs, without the owner, in key order: the order
  // of canonical_arguments (call_key.h), and inside each argument the walk's. Calls that
  // share a key have the same number of tensors, in the same roles, however they spell their
  // arguments. Held here: a list or dict the caller passed may be changed by another thread
  // while Python code runs during the call (a guard check, a budget callback).
  std::vector<py::object> tensors;
  bool padded = false;
  std::vector<CropDim> crop;                 // every padded dimension of every argument, in order
  std::shared_ptr<const CropPlan> crop_plan;  // when padded: set by the dispatcher before the lookup

  // `tensors` as a tuple of new references.
  py::tuple tensor_tuple() const {
    py::tuple out(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), py::object(tensors[i]).release().ptr());
    }
    return out;
  }
};

}  // namespace shapecache
