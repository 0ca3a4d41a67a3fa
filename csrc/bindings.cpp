// The pybind11 module shapecache._C: the cache objects and the core's types. Ops are
// registered with the dispatcher elsewhere (TORCH_LIBRARY), not here. Import torch first.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/Device.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/bucket_policy.h"
#include "core/budgeted_lru.h"
#include "ops/cached_function.h"
#include "ops/call_key.h"
#include "ops/shape_cache.h"

namespace py = pybind11;
using namespace shapecache;

namespace {

// The LRU over plain ints, so the core's invariants can be tested from Python directly.
using IntLru = BudgetedLru<int64_t, int64_t>;

int64_t limit_from_python(const std::optional<int64_t>& value) {
  return value ? *value : IntLru::kUnlimited;
}

py::list evicted_keys(const std::vector<IntLru::Evicted>& evicted) {
  py::list keys;
  for (const auto& e : evicted) keys.append(e.key);
  return keys;
}

void bind_core(py::module_& m) {
  py::class_<BucketPolicy>(m, "BucketPolicy")
      .def_static("exact", &BucketPolicy::exact)
      .def_static("multiple_of", &BucketPolicy::multiple_of, py::arg("n"))
      .def_static("power_of_two", &BucketPolicy::power_of_two, py::arg("minimum") = 1)
      .def_static("sizes", &BucketPolicy::explicit_sizes, py::arg("sizes"))
      .def("bucket", &BucketPolicy::bucket, py::arg("size"))
      .def_property_readonly("pads", &BucketPolicy::pads)
      .def("__repr__", &BucketPolicy::describe);

  py::class_<ArgumentBuckets>(m, "ArgumentBuckets")
      .def(py::init([](int64_t position, std::string name, std::vector<std::pair<int64_t, BucketPolicy>> dims) {
             return ArgumentBuckets{position, std::move(name), std::move(dims)};
           }),
           py::arg("position"), py::arg("name"), py::arg("dims"))
      .def_readonly("position", &ArgumentBuckets::position)
      .def_readonly("name", &ArgumentBuckets::name);

  py::class_<IntLru>(m, "IntLru")
      .def(py::init([](std::optional<int64_t> budget, std::optional<int64_t> max_entries) {
             return std::make_unique<IntLru>(limit_from_python(budget), limit_from_python(max_entries));
           }),
           py::arg("budget") = py::none(), py::arg("max_entries") = py::none())
      .def(
          "insert",
          [](IntLru& lru, int64_t key, int64_t value, int64_t bytes) {
            auto result = lru.insert(key, value, bytes);
            return py::make_tuple(result.inserted, evicted_keys(result.evicted));
          },
          py::arg("key"), py::arg("value"), py::arg("bytes"))
      .def("find", [](IntLru& lru, int64_t key) -> std::optional<int64_t> {
        const int64_t* v = lru.find(key);
        return v ? std::optional<int64_t>(*v) : std::nullopt;
      })
      .def("peek", [](IntLru& lru, int64_t key) -> std::optional<int64_t> {
        const int64_t* v = lru.peek(key);
        return v ? std::optional<int64_t>(*v) : std::nullopt;
      })
      .def("pin", &IntLru::pin)
      .def("unpin", &IntLru::unpin)
      .def("pin_count", &IntLru::pin_count)
      .def("could_fit", &IntLru::could_fit)
      .def("erase", [](IntLru& lru, int64_t key) { return lru.erase(key).has_value(); })
      .def("clear", [](IntLru& lru) { return evicted_keys(lru.clear()); })
      .def(
          "set_limits",
          [](IntLru& lru, std::optional<int64_t> budget, std::optional<int64_t> max_entries) {
            return evicted_keys(lru.set_limits(limit_from_python(budget), limit_from_python(max_entries)));
          },
          py::arg("budget"), py::arg("max_entries") = py::none())
      .def("set_external_bytes", [](IntLru& lru, int64_t bytes) { return evicted_keys(lru.set_external_bytes(bytes)); })
      .def("keys",
           [](const IntLru& lru) {
             py::list keys;  // most recently used first
             lru.for_each([&](int64_t key, int64_t, int64_t, int) { keys.append(key); });
             return keys;
           })
      .def_property_readonly("entry_bytes", &IntLru::entry_bytes)
      .def_property_readonly("external_bytes", &IntLru::external_bytes)
      .def_property_readonly("total_bytes", &IntLru::total_bytes)
      .def_property_readonly("budget", &IntLru::budget_bytes)
      .def_property_readonly("max_entries", &IntLru::max_entries)
      .def("__len__", &IntLru::size)
      .def_property_readonly("counters", [](const IntLru& lru) {
        const LruCounters& c = lru.counters();
        py::dict d;
        d["hits"] = c.hits;
        d["misses"] = c.misses;
        d["inserts"] = c.inserts;
        d["rejections"] = c.rejections;
        d["evictions"] = c.evictions;
        d["peak_bytes"] = c.peak_bytes;
        return d;
      });
}

void bind_cache(py::module_& m) {
  py::register_exception<UnkeyableArgument>(m, "UnkeyableArgument", PyExc_TypeError);

  m.def(
      "call_key",
      [](py::tuple args, py::dict kwargs, std::vector<ArgumentBuckets> buckets, uint64_t function_id, int training,
         std::vector<std::string> parameter_names) {
        CallContext context;
        context.function_id = function_id;
        context.training = training;
        context.parameter_names = &parameter_names;
        CallKey key = make_call_key(context, args, kwargs, buckets);
        py::dict out;
        out["words"] = py::tuple(py::cast(key.key.words()));
        out["hash"] = key.key.hash();
        out["device"] = py::reinterpret_steal<py::object>(THPDevice_New(key.device));
        out["description"] = describe_key(key.key);
        out["padded"] = key.padded;
        out["args"] = key.padded ? py::object(key.args) : py::object(args);
        out["kwargs"] = key.padded ? py::object(key.kwargs) : py::object(kwargs);
        py::list crop;
        for (const CropDim& c : key.crop) crop.append(py::make_tuple(c.dim, c.original, c.padded));
        out["crop"] = crop;
        return out;
      },
      py::arg("args"), py::arg("kwargs"), py::arg("buckets") = std::vector<ArgumentBuckets>{},
      py::arg("function_id") = 0, py::arg("training") = -1, py::arg("parameter_names") = std::vector<std::string>{},
      "The key of calling a function with `args` and `kwargs` (for tests and debugging).");

  m.def(
      "crop_outputs",
      [](py::object outputs, std::vector<std::tuple<int64_t, int64_t, int64_t>> crop) {
        std::vector<CropDim> dims;
        for (const auto& [dim, original, padded] : crop) dims.push_back(CropDim{dim, original, padded});
        return crop_outputs(outputs, dims);
      },
      py::arg("outputs"), py::arg("crop"));

  py::class_<ShapeCache, std::shared_ptr<ShapeCache>>(m, "ShapeCache")
      .def(py::init([](py::object budget_for_device, std::optional<int64_t> max_entries) {
             return std::make_shared<ShapeCache>(std::move(budget_for_device),
                                                 max_entries ? *max_entries : EntryLru::kUnlimited);
           }),
           py::arg("budget_for_device"), py::arg("max_entries") = py::none())
      .def("stats", [](const ShapeCache& cache) { return cache.stats(); })
      .def("clear", [](ShapeCache& cache) { cache.clear(); })
      .def(
          "set_shared_bytes",
          [](ShapeCache& cache, c10::Device device, int64_t pool, int64_t workspace) {
            cache.set_shared_bytes(device, SharedBytes{pool, workspace});
          },
          py::arg("device"), py::arg("pool") = 0, py::arg("workspace") = 0);

  py::class_<CachedFunction>(m, "CachedFunction", py::dynamic_attr())
      .def(py::init<py::object, py::object, std::shared_ptr<ShapeCache>, std::vector<ArgumentBuckets>,
                    std::vector<std::string>, py::object, bool>(),
           py::arg("function"), py::arg("builder"), py::arg("cache"), py::arg("buckets"), py::arg("parameter_names"),
           py::arg("owner"), py::arg("key_training"))
      .def("__call__", &CachedFunction::call)
      .def("stats", &CachedFunction::stats)
      .def("clear", &CachedFunction::clear)
      .def_property_readonly("function", &CachedFunction::function)
      .def_property_readonly("cache", &CachedFunction::cache);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "shapecache's C++ core: shape keys, bucket policies, the budgeted LRU and the cached call";
  bind_core(m);
  bind_cache(m);
}
