// CropPlans: what the outputs of a padded call are cropped to (invariant 4 for padded
// buckets), one plan per bucket and per sizes the caller's padded dimensions had.
//
// A plan is the plain call's output sizes, found by running the function on fake tensors of
// the caller's sizes (`run_on_fake_tensors`, no compute): the only rule that follows every
// output from every padded argument, through reductions, transposes and constants. Calls of
// one bucket padded in different dimensions (1x4 and 3x1 in a bucket of 3x4) return
// different shapes, so the plan's key holds which dimension of which argument was padded
// from which size. Where no plan can be made, the call runs unpadded (call.crop_plan says why).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <optional>
#include <unordered_map>

#include "cache/call.h"
#include "core/shape_key.h"

namespace shapecache {

namespace py = pybind11;

class CropPlans {
 public:
  // `run_on_fake_tensors(function, args, kwargs) -> outputs`, or None (padded calls then run
  // unpadded).
  CropPlans(py::object function, py::object run_on_fake_tensors)
      : function_(std::move(function)), run_on_fake_tensors_(std::move(run_on_fake_tensors)) {}

  // The plan of a padded call; one fake-tensor run per distinct plan key.
  std::shared_ptr<const CropPlan> plan_for(const Call& call);

  // The outputs of the padded call cropped to the call's plan; nullopt when they do not match
  // it (another count or rank of tensors than the plain call's).
  static std::optional<py::object> crop(const Call& call, const py::object& outputs);

  void clear() { plans_.clear(); }
  // Visits the Python objects held here, for the garbage collector.
  int traverse(visitproc visit, void* arg) const {
    Py_VISIT(function_.ptr());
    Py_VISIT(run_on_fake_tensors_.ptr());
    return 0;
  }

 private:
  // A plan costs a fake-tensor run of the function, once per distinct sizes; the map is
  // emptied when it reaches kMaxPlans, so a stream of ever-new sizes cannot grow it without
  // bound.
  static constexpr size_t kMaxPlans = 4096;
  py::object function_;
  py::object run_on_fake_tensors_;
  std::unordered_map<ShapeKey, std::shared_ptr<const CropPlan>, ShapeKeyHash> plans_;
};

}  // namespace shapecache
