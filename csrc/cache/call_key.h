// The key computation: the Call (call.h) of one call of a cached function, from its Python
// arguments.
//
// Arguments with a parameter name are keyed by name, however they were passed; the rest of
// the positional arguments in order. Tensors are keyed by bucketed sizes, dtype, device, memory layout and requires_grad;
// ints, floats, bools, strings, None, dtypes, devices and tuples/lists/dicts of those by
// value. Anything else cannot be keyed: UnkeyableArgument, and the call runs uncached.
//
// Padding: an argument with a non-exact BucketPolicy is padded with zeros at the end of each
// bucketed dimension. Outputs are cropped to the sizes the plain call would return, found by
// running the function on fake tensors of the caller's sizes (no compute) once per distinct
// sizes of the padded dimensions (ShapeDispatcher's crop plans): the only rule that follows
// every output from every padded argument, through reductions, transposes and constants.
// Each output tensor keeps the leading corner of its padded counterpart; an output whose
// rank or count differs from the plain call's is never guessed at (the call runs uncached).
#pragma once

#include <pybind11/pybind11.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "cache/call.h"
#include "core/bucket_policy.h"
#include "core/shape_key.h"

namespace shapecache {

namespace py = pybind11;

class UnkeyableArgument : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Words that make the same arguments key differently: which function, and the autograd,
// autocast and training state the artifact would be built under.
struct CallContext {
  uint64_t function_id = 0;
  int training = -1;  // -1: not a module; 0/1: module.training
  // Names of the positional parameters: arguments passed in those positions are keyed by
  // name, so passing one by position or by keyword makes no difference.
  const std::vector<std::string>* parameter_names = nullptr;
};

// One argument of a call: by name when it has one, by position when passed positionally.
struct NamedArgument {
  std::string_view name;  // empty for a positional argument without a parameter name
  PyObject* value;
  int64_t position;       // index in *args, or -1 when passed by keyword
  PyObject* keyword;      // the keyword's str object when passed by keyword, else nullptr
};

// A call's arguments in key order: the positional ones past the named parameters (a *args
// tail) in order, then every named one, however it was passed, in name order. Everything
// that must agree between calls sharing an entry (the key, a graph's static inputs) uses it.
// `unnamed` receives how many come first without a name. Borrowed references into the call.
std::vector<NamedArgument> canonical_arguments(const py::tuple& args, const py::dict& kwargs,
                                               const std::vector<std::string>* parameter_names, size_t* unnamed);

// Visits every tensor in `value` (itself, or inside tuples, lists and dict values, in order).
void for_each_tensor(PyObject* value, const std::function<void(const at::Tensor&)>& visit);

// `value` with every tensor t replaced by map(t): tuples, lists (namedtuples) and dicts (and
// dict subclasses such as diffusers' outputs) rebuilt; None, numbers and strings kept.
// Raises TypeError for other objects, which could hide tensors.
py::object map_tensors(const py::object& value, const std::function<at::Tensor(const at::Tensor&)>& map);

// The Call of calling with `args` and `kwargs` (and `owner` first, unless it is None): its
// key, its device, its padded arguments and its tensors in key order, in one walk.
// Throws UnkeyableArgument naming the argument; py::value_error / py::type_error for an
// argument that a bucket policy cannot apply to (a bucketed argument that is no tensor, a
// size above the largest explicit bucket).
Call make_call(const CallContext& context, const py::object& owner, const py::tuple& args, const py::dict& kwargs,
               const std::vector<ArgumentBuckets>& buckets);

// `args` with `owner` in front, unless it is None.
py::tuple with_owner(const py::object& owner, const py::tuple& args);

// Outputs of a padded call cropped to `shapes`, one per output tensor in map_tensors' order
// (the plain call's sizes); nullopt when the outputs do not match them in count or rank, or
// a size is larger than the padded output's.
std::optional<py::object> crop_outputs(const py::object& outputs, const std::vector<std::vector<int64_t>>& shapes);

// "(2, 4, 64, 64) float32 cpu; 3; 'text'" for stats and messages.
std::string describe_key(const ShapeKey& key);

}  // namespace shapecache
