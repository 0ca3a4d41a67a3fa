#include "cache/crop_plans.h"

#include <string>
#include <utility>
#include <vector>

#include "cache/call_key.h"
#include "cache/call_scope.h"
#include "cache/python_call.h"

namespace shapecache {

std::shared_ptr<const CropPlan> CropPlans::plan_for(const Call& call) {
  ShapeKey plan_key = call.key;
  for (const CropDim& c : call.crop) {
    plan_key.add_int(c.argument);
    plan_key.add_int(c.dim);
    plan_key.add_int(c.original);
  }
  if (auto found = plans_.find(plan_key); found != plans_.end()) return found->second;
  auto plan = std::make_shared<CropPlan>();
  if (run_on_fake_tensors_.is_none()) {
    plan->reason = "the cached function was made without run_on_fake_tensors";
  } else {
    try {
      InsideBuild planning;
      py::object outputs = run_on_fake_tensors_(function_, with_owner(call.owner, call.args), call.kwargs);
      // Sizes in the order crop_outputs will meet the real outputs: the same walk.
      std::vector<std::vector<int64_t>> shapes;
      map_tensors(outputs, [&](const at::Tensor& t) {
        shapes.push_back(t.sizes().vec());
        return t;
      });
      plan->shapes = std::move(shapes);
    } catch (py::error_already_set& error) {
      if (!error.matches(PyExc_Exception)) throw;  // KeyboardInterrupt, SystemExit
      plan->reason = describe_error(error);
    } catch (const py::type_error& error) {  // an output map_tensors cannot walk
      plan->reason = std::string("TypeError: ") + error.what();
    }
  }
  if (plans_.size() >= kMaxPlans) plans_.clear();
  return plans_.emplace(std::move(plan_key), std::move(plan)).first->second;
}

std::optional<py::object> CropPlans::crop(const Call& call, const py::object& outputs) {
  return crop_outputs(outputs, *call.crop_plan->shapes);
}

}  // namespace shapecache
