// The pybind11 module shapecache._C: the cache objects and the core's types. Ops are
// registered with the dispatcher elsewhere (TORCH_LIBRARY), not here. Import torch first.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/bucket_policy.h"
#include "cache/call_modes.h"
#include "core/budgeted_lru.h"
#include "core/pool_generations.h"
#include "cache/shape_dispatcher.h"
#include "cache/call_key.h"
#include "ops/conv2d.h"
#include "ops/conv_tuner.h"
#include "cache/shape_cache.h"
#include "cache/entry_runner.h"
#include "cache/compiled_graph_runner.h"
#include "cache/state_guard.h"
#include "ops/workspace_arena.h"
#if SHAPECACHE_WITH_CUDA
#include "cache/cuda/cuda_graph_runner.h"
#endif

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
      .def("unpin", [](IntLru& lru, int64_t key) { return evicted_keys(lru.unpin(key)); })
      .def("pin_count", &IntLru::pin_count)
      .def("could_fit", &IntLru::could_fit)
      .def(
          "make_room_for", [](IntLru& lru, int64_t bytes) { return evicted_keys(lru.make_room_for(bytes)); },
          py::arg("bytes"))
      .def("erase", [](IntLru& lru, int64_t key) { return lru.erase(key).has_value(); })
      .def("clear", [](IntLru& lru) { return evicted_keys(lru.clear()); })
      .def(
          "set_limits",
          [](IntLru& lru, std::optional<int64_t> budget, std::optional<int64_t> max_entries) {
            return evicted_keys(lru.set_limits(limit_from_python(budget), limit_from_python(max_entries)));
          },
          py::arg("budget"), py::arg("max_entries") = py::none())
      .def("set_shared_bytes", [](IntLru& lru, int64_t bytes) { return evicted_keys(lru.set_shared_bytes(bytes)); })
      .def("set_entry_bytes", [](IntLru& lru, int64_t key, int64_t bytes) { return evicted_keys(lru.set_entry_bytes(key, bytes)); })
      .def("keys",
           [](const IntLru& lru) {
             py::list keys;  // most recently used first
             lru.for_each([&](int64_t key, int64_t, int64_t, int) { keys.append(key); });
             return keys;
           })
      .def_property_readonly("entry_bytes", &IntLru::entry_bytes)
      .def_property_readonly("shared_bytes", &IntLru::shared_bytes)
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

// The pool lifecycle with every torch call a Python callable, so that its rules can be checked
// on the CPU against a model of torch's allocators (ids cross as (int, int) tuples).
void bind_pool_generations(py::module_& m) {
  using Generation = PoolGenerations::Generation;
  py::class_<PoolGenerations>(m, "PoolGenerations")
      .def(py::init<>())
      .def(
          "capture",
          [](PoolGenerations& pool, py::function open_pool, py::function begin, py::function body, py::function end,
             py::function ended, py::function device_end, py::function device_release, py::function host_end,
             py::function host_release) {
            auto id_call = [](py::function f) { return [f](const PoolId& id) { f(py::make_tuple(id.first, id.second)); }; };
            CaptureSteps steps{
                [open_pool] { return open_pool().cast<PoolId>(); },
                id_call(begin),
                [body] { body(); },
                [end] { end(); },
                [ended] { return ended().cast<bool>(); },
                PoolAllocatorCalls{id_call(device_end), id_call(device_release)},
                PoolAllocatorCalls{id_call(host_end), id_call(host_release)},
            };
            const PoolId id = pool.capture(steps);
            return py::make_tuple(id.first, id.second);
          },
          py::arg("open_pool"), py::arg("begin"), py::arg("body"), py::arg("end"), py::arg("ended"),
          py::arg("device_end"), py::arg("device_release"), py::arg("host_end"), py::arg("host_release"))
      .def("graph_released", [](PoolGenerations& pool, PoolId id) { pool.graph_released(id); })
      .def_property_readonly("live_graphs", &PoolGenerations::live_graphs)
      .def_property_readonly("generations", [](const PoolGenerations& pool) {
        py::list out;
        for (const Generation& g : pool.generations()) {
          py::dict d;
          d["id"] = py::make_tuple(g.id.first, g.id.second);
          d["graphs"] = g.graphs;
          d["recording"] = g.recording;
          d["retired"] = g.retired;
          out.append(d);
        }
        return out;
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

  // The modes a CUDA graph is recaptured under (call_modes.h), readable and usable on any device.
  py::class_<CallModes>(m, "CallModes")
      .def_static(
          "of_this_thread", [](const std::string& device_type) { return CallModes::of_this_thread(c10::Device(device_type).type()); },
          py::arg("device_type"))
      .def_readonly("grad", &CallModes::grad)
      .def_readonly("inference", &CallModes::inference)
      .def_readonly("autocast", &CallModes::autocast)
      .def_property_readonly("autocast_dtype",
                             [](const CallModes& m) {
                               return py::reinterpret_borrow<py::object>(
                                   reinterpret_cast<PyObject*>(torch::getTHPDtype(m.autocast_dtype)));
                             })
      .def(
          "run",
          [](const CallModes& modes, const py::function& function) {
            CallModesScope scope(modes);
            return function();
          },
          py::arg("function"), "Calls `function()` under these modes; the thread's own come back after.");

  m.def(
      "crop_outputs",
      [](py::object outputs, std::vector<std::vector<int64_t>> shapes) -> py::object {
        std::optional<py::object> cropped = crop_outputs(outputs, shapes);
        return cropped ? std::move(*cropped) : py::object(py::none());
      },
      py::arg("outputs"), py::arg("shapes"),
      "`outputs` with each tensor narrowed to its shape in `shapes` (map order); None when they do not match.");

  py::class_<ShapeCache, std::shared_ptr<ShapeCache>>(m, "ShapeCache")
      .def(py::init([](py::object budget_for_device, std::optional<int64_t> max_entries,
                       py::object release_device_memory, py::object run_on_fake_tensors,
                       py::object wake_build_worker) {
             return std::make_shared<ShapeCache>(
                 std::move(budget_for_device), max_entries ? *max_entries : EntryLru::kUnlimited,
                 CacheCallbacks{std::move(release_device_memory), std::move(run_on_fake_tensors),
                                std::move(wake_build_worker)});
           }),
           py::arg("budget_for_device"), py::arg("max_entries") = py::none(),
           py::arg("release_device_memory") = py::none(), py::arg("run_on_fake_tensors") = py::none(),
           py::arg("wake_build_worker") = py::none())
      .def("stats", [](const ShapeCache& cache) { return cache.stats(); })
      .def("clear", [](ShapeCache& cache) { cache.clear(); })
      .def(
          "set_shared_bytes",
          [](ShapeCache& cache, c10::Device device, std::optional<int64_t> pool, std::optional<int64_t> workspace) {
            SharedBytes bytes = cache.shared_bytes(device);  // a figure not given stays as it is
            if (pool) bytes.pool = *pool;
            if (workspace) bytes.workspace = *workspace;
            cache.set_shared_bytes(device, bytes);
          },
          py::arg("device"), py::arg("pool") = py::none(), py::arg("workspace") = py::none())
      .def(
          "evict_unpinned", [](ShapeCache& cache, c10::Device device) { return cache.evict_unpinned(device).size(); },
          py::arg("device"))
      .def("entries", &ShapeCache::entries, py::arg("device"),
           "The device's entries, most recently used first: (id, runner, pinned) each.")
      .def(
          "set_entry_bytes",
          [](ShapeCache& cache, c10::Device device, uint64_t id, int64_t bytes) {
            py::list ids;  // what left the cache; the entries themselves are destroyed on return
            for (const auto& gone : cache.set_entry_bytes(device, id, bytes)) ids.append(gone.value.id);
            return ids;
          },
          py::arg("device"), py::arg("id"), py::arg("bytes"))
      .def(
          "erase_entry", [](ShapeCache& cache, c10::Device device, uint64_t id) { return cache.erase_entry(device, id).has_value(); },
          py::arg("device"), py::arg("id"))
      .def("contains_entry", &ShapeCache::contains_entry, py::arg("device"), py::arg("id"))
      .def(
          "could_fit", [](ShapeCache& cache, c10::Device device, int64_t bytes) { return cache.lru(device).could_fit(bytes); },
          py::arg("device"), py::arg("bytes"), "Whether an entry of `bytes` fits the device's budget, after evictions.")
      .def("count_pool_rebuild", &ShapeCache::count_pool_rebuild, py::arg("device"))
      .def(
          "handle",
          [](const std::shared_ptr<ShapeCache>& cache, c10::Device device) {
            return BuildHandle(cache, device, /*run_call=*/false);
          },
          py::arg("device"), "A BuildHandle on `device`, as a builder gets one (for tests of what builders do).");

  py::class_<BuiltEntry>(m, "BuiltEntry", "What a builder returns for a new bucket (csrc/cache/built_entry.h).")
      .def(py::init([](py::object runner, int64_t bytes, py::object output, std::string backend,
                       std::shared_ptr<StateGuard> guard, std::optional<std::string> failure, bool ran_call) {
             if (runner.is_none() && !failure) throw py::value_error("BuiltEntry: runner=None needs a failure");
             return BuiltEntry{std::move(runner), bytes,        std::move(output), ran_call, std::move(backend),
                               std::move(guard),  failure.value_or("")};
           }),
           py::arg("runner"), py::arg("bytes"), py::arg("output"), py::arg("backend"), py::arg("guard") = nullptr,
           py::arg("failure") = py::none(), py::kw_only(), py::arg("ran_call") = true)
      .def_readonly("runner", &BuiltEntry::runner)
      .def_readonly("bytes", &BuiltEntry::bytes)
      .def_readonly("output", &BuiltEntry::output)
      .def_readonly("ran_call", &BuiltEntry::ran_call)
      .def_readonly("backend", &BuiltEntry::backend)
      .def_readonly("guard", &BuiltEntry::guard)
      .def_readonly("failure", &BuiltEntry::failure);

  py::class_<BuildHandle>(m, "BuildHandle", "All a builder may do to its cache (csrc/cache/build_handle.h).")
      .def_property_readonly("device",
                             [](const BuildHandle& h) {
                               return py::reinterpret_steal<py::object>(THPDevice_New(h.device()));
                             })
      .def_property_readonly("run_call", &BuildHandle::run_call)
      .def("set_shared_bytes", &BuildHandle::set_shared_bytes, py::arg("pool") = py::none(),
           py::arg("workspace") = py::none())
      .def("could_fit", &BuildHandle::could_fit, py::arg("bytes"))
      .def("entries", &BuildHandle::entries)
      .def("erase_entry", &BuildHandle::erase_entry, py::arg("id"))
      .def("contains_entry", &BuildHandle::contains_entry, py::arg("id"))
      .def("set_entry_bytes", &BuildHandle::set_entry_bytes, py::arg("id"), py::arg("bytes"))
      .def("evict_unpinned", &BuildHandle::evict_unpinned)
      .def("count_pool_rebuild", &BuildHandle::count_pool_rebuild)
      .def("describe", &BuildHandle::describe);

  m.def("run_next_build", [](c10::Device device) { return BuildQueue::instance().run_next(device); },
        py::arg("device"), "Runs the oldest background build queued for `device`; False when none waits.");
  m.def("pending_builds", [] { return BuildQueue::instance().pending(); },
        "Background builds waiting or running, on every device.");
  m.def("cancel_all_builds", [] { return BuildQueue::instance().cancel_all().size(); },
        "Drops every waiting background build (at interpreter exit); the running ones end as they do.");
  m.def("forget_running_builds", [] { BuildQueue::instance().forget_running(); },
        "In a forked child: its parent's running builds do not run here.");
  {
    py::list names;
    FunctionCounters{}.for_each([&](const char* name, int64_t) { names.append(name); });
    m.attr("FUNCTION_COUNTERS") = py::tuple(names);
  }

  py::class_<EntryRunner, std::shared_ptr<EntryRunner>>(m, "EntryRunner")
      .def("valid", &EntryRunner::valid)
      .def("__call__", [](EntryRunner& runner, py::args args, py::kwargs kwargs) { return runner.run(args, kwargs); });

  py::class_<CompiledGraphRunner, EntryRunner, std::shared_ptr<CompiledGraphRunner>>(m, "CompiledGraphRunner")
      .def(py::init<py::object, std::vector<std::string>, py::object, std::shared_ptr<StateGuard>>(), py::arg("graph"),
           py::arg("parameter_names"), py::arg("rebuild"), py::arg("guard"));
  m.def("tensors_in_key_order", &tensors_in_key_order, py::arg("args"), py::arg("kwargs"), py::arg("parameter_names"),
        "A call's tensors in the order its key holds them (without the owner a method is bound to).");

  py::class_<StateGuard, std::shared_ptr<StateGuard>>(m, "StateGuard",
                                                      "What an entry was built from (csrc/cache/state_guard.h).")
      .def(py::init<>())
      .def("add_dict", &StateGuard::add_dict, py::arg("dict"), py::arg("path"), py::arg("keys") = py::none())
      .def("add_tensor", &StateGuard::add_tensor, py::arg("tensor"), py::arg("path"), py::arg("check_version") = true)
      .def("add_cell", &StateGuard::add_cell, py::arg("cell"), py::arg("path"))
      .def("add_list", &StateGuard::add_list, py::arg("list"), py::arg("path"))
      .def("add_type", &StateGuard::add_type, py::arg("object"), py::arg("path"))
      .def("add_class", &StateGuard::add_class, py::arg("cls"), py::arg("path"))
      .def("check", &StateGuard::check)
      .def_property_readonly("changed", &StateGuard::changed)
      .def_property_readonly("dict_count", &StateGuard::dict_count)
      .def_property_readonly("tensor_count", &StateGuard::tensor_count);

  py::class_<ShapeDispatcher>(
      m, "ShapeDispatcher", py::dynamic_attr(), py::custom_type_setup([](PyHeapTypeObject* heap_type) {
        // The collector sees through the dispatcher to its entries (ShapeDispatcher::traverse).
        auto* type = &heap_type->ht_type;
        type->tp_flags |= Py_TPFLAGS_HAVE_GC;
        type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) {
          if (int result = py::detail::pybind11_traverse(self, visit, arg)) return result;
          if (!py::detail::is_holder_constructed(self)) return 0;
          return py::cast<const ShapeDispatcher&>(py::handle(self)).traverse(visit, arg);
        };
        type->tp_clear = [](PyObject* self) {
          if (py::detail::is_holder_constructed(self)) py::cast<ShapeDispatcher&>(py::handle(self)).clear_references();
          return py::detail::pybind11_clear(self);
        };
      }))
      .def(py::init<py::object, py::object, std::shared_ptr<ShapeCache>, std::vector<ArgumentBuckets>,
                    std::vector<std::string>, py::object, bool, py::object>(),
           py::arg("function"), py::arg("builder"), py::arg("cache"), py::arg("buckets"), py::arg("parameter_names"),
           py::arg("owner"), py::arg("key_training"), py::arg("background") = py::none())
      .def("__call__", &ShapeDispatcher::call)
      .def("queue_build", &ShapeDispatcher::queue_build,
           "Queues the background build of the bucket of a call with these arguments, without running it.")
      .def("stats", &ShapeDispatcher::stats)
      .def("clear", &ShapeDispatcher::clear)
      .def_property_readonly("pending_builds", &ShapeDispatcher::pending_builds)
      .def_property_readonly("function", &ShapeDispatcher::function)
      .def_property_readonly("cache", &ShapeDispatcher::cache);
}

// Tuning records cross to Python as plain dicts (the file format's fields).
py::dict record_to_dict(const TuningRecord& r) {
  const ConvProblem& p = r.problem;
  py::dict d;
  d["environment"] = r.environment;
  d["device_type"] = c10::DeviceTypeName(static_cast<c10::DeviceType>(p.device_type), /*lower_case=*/true);
  d["dtype"] = std::string(torch::getTHPDtype(static_cast<c10::ScalarType>(p.dtype))->name);
  d["layout"] = p.layout ? "channels_last" : "contiguous";
  d["input"] = py::make_tuple(p.n, p.c, p.h, p.w);
  d["weight"] = py::make_tuple(p.k, p.c / p.groups, p.r, p.s);
  d["stride"] = py::make_tuple(p.stride[0], p.stride[1]);
  d["padding"] = py::make_tuple(p.padding[0], p.padding[1]);
  d["dilation"] = py::make_tuple(p.dilation[0], p.dilation[1]);
  d["groups"] = p.groups;
  d["bias"] = static_cast<bool>(p.has_bias);
  d["algorithm"] = r.algorithm;
  d["workspace_bytes"] = r.workspace_bytes;
  d["microseconds"] = r.microseconds;
  return d;
}

c10::ScalarType dtype_from_name(const std::string& name) {
  for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
    const auto type = static_cast<c10::ScalarType>(i);
    THPDtype* dtype = torch::getTHPDtype(type);
    if (dtype != nullptr && name == dtype->name) return type;
  }
  throw py::value_error("unknown dtype '" + name + "'");
}

// Raises KeyError/TypeError/ValueError on a malformed record (the file is then set aside).
TuningRecord record_from_dict(const py::dict& d) {
  TuningRecord r;
  ConvProblem& p = r.problem;
  std::memset(&p, 0, sizeof(p));
  r.environment = d["environment"].cast<std::string>();
  p.environment = hash_environment(r.environment);
  p.device_type = static_cast<int8_t>(c10::Device(d["device_type"].cast<std::string>()).type());
  p.dtype = static_cast<int8_t>(dtype_from_name(d["dtype"].cast<std::string>()));
  const auto layout = d["layout"].cast<std::string>();
  if (layout != "contiguous" && layout != "channels_last") throw py::value_error("unknown layout '" + layout + "'");
  p.layout = layout == "channels_last" ? 1 : 0;
  const auto input = d["input"].cast<std::vector<int64_t>>();
  const auto weight = d["weight"].cast<std::vector<int64_t>>();
  const auto stride = d["stride"].cast<std::vector<int64_t>>();
  const auto padding = d["padding"].cast<std::vector<int64_t>>();
  const auto dilation = d["dilation"].cast<std::vector<int64_t>>();
  if (input.size() != 4 || weight.size() != 4 || stride.size() != 2 || padding.size() != 2 || dilation.size() != 2) {
    throw py::value_error("a tuning record has sizes of the wrong length");
  }
  p.n = input[0], p.c = input[1], p.h = input[2], p.w = input[3];
  p.k = weight[0], p.r = weight[2], p.s = weight[3];
  for (int i = 0; i < 2; ++i) p.stride[i] = stride[i], p.padding[i] = padding[i], p.dilation[i] = dilation[i];
  p.groups = d["groups"].cast<int64_t>();
  p.has_bias = d["bias"].cast<bool>() ? 1 : 0;
  r.algorithm = d["algorithm"].cast<std::string>();
  r.workspace_bytes = d["workspace_bytes"].cast<int64_t>();
  r.microseconds = d["microseconds"].cast<double>();
  return r;
}

void bind_tuning(py::module_& m) {
  m.def(
      "tune_conv2d",
      [](const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
         std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups) {
        const TuningResult result =
            ConvTuner::instance().tune(make_conv_args(input, weight, bias, stride, padding, dilation, groups));
        py::dict out = record_to_dict(result.record);
        py::list candidates;
        for (const CandidateTiming& c : result.candidates) {
          py::dict t;
          t["algorithm"] = c.algorithm;
          t["workspace_bytes"] = c.workspace_bytes;
          t["microseconds"] = c.microseconds < 0 ? py::object(py::none()) : py::float_(c.microseconds);
          t["skipped"] = c.skipped;
          candidates.append(t);
        }
        out["candidates"] = candidates;
        return out;
      },
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("stride"), py::arg("padding"), py::arg("dilation"),
      py::arg("groups"), "Times every algorithm for this problem and records the fastest that fits.");
  m.def(
      "conv2d_algorithm",
      [](const std::string& algorithm, const at::Tensor& input, const at::Tensor& weight,
         const std::optional<at::Tensor>& bias, std::vector<int64_t> stride, std::vector<int64_t> padding,
         std::vector<int64_t> dilation, int64_t groups) {
        return ConvTuner::instance().run_named(make_conv_args(input, weight, bias, stride, padding, dilation, groups),
                                               algorithm);
      },
      py::arg("algorithm"), py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("stride"),
      py::arg("padding"), py::arg("dilation"), py::arg("groups"), "Runs one named algorithm (no tuning).");
  m.def("tuning_load", [](const py::list& records) {
    std::vector<TuningRecord> parsed;
    for (py::handle r : records) parsed.push_back(record_from_dict(py::reinterpret_borrow<py::dict>(r)));
    return ConvTuner::instance().load(parsed);
  });
  m.def("tuning_take_unsaved", [] {
    py::list out;
    for (const TuningRecord& r : ConvTuner::instance().take_unsaved()) out.append(record_to_dict(r));
    return out;
  });
  m.def("tuning_has_unsaved", [] { return ConvTuner::instance().has_unsaved(); });
  m.def("tuning_stats", [] {
    const TunerStats s = ConvTuner::instance().stats();
    py::dict d;
    d["tuned"] = s.tuned;
    d["loaded"] = s.loaded;
    d["hits"] = s.hits;
    d["records"] = s.records;
    return d;
  });
  m.def("tuning_clear", [] { ConvTuner::instance().clear(); });
  m.def("tuning_set_enabled", [](bool enabled) { ConvTuner::instance().set_enabled(enabled); });
  m.def("_tuning_fail_candidate", [](std::string name) { ConvTuner::instance().fail_candidate_for_tests(std::move(name)); },
        "Fault injection for tests: tuning makes the named candidate fail ('' for none).");
  m.def("tuning_environment", [](c10::Device device) { return ConvTuner::instance().environment(device); });
  m.def("record_key", [](const py::dict& record) {  // the identity of a record's problem, for merging files
    const TuningRecord r = record_from_dict(record);
    return py::bytes(reinterpret_cast<const char*>(&r.problem), sizeof(r.problem));
  });

  m.def("workspace_stats", [](c10::Device device) {
    WorkspaceArena& arena = WorkspaceArena::of(device);
    py::dict d;
    d["bytes"] = arena.bytes();
    d["cap"] = arena.cap() == WorkspaceArena::kUnlimited ? py::object(py::none()) : py::int_(arena.cap());
    d["generation"] = arena.generation();
    return d;
  });
  m.def("workspace_leases_on_this_thread", &WorkspaceArena::leases_on_this_thread);
  m.def(
      "set_workspace_cap",
      [](c10::Device device, std::optional<int64_t> bytes) {
        WorkspaceArena::of(device).set_cap(bytes ? *bytes : WorkspaceArena::kUnlimited);
      },
      py::arg("device"), py::arg("bytes"));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "shapecache's C++ core: shape keys, bucket policies, the budgeted LRU, the cached call, conv tuning";
  bind_core(m);
  bind_pool_generations(m);
  bind_cache(m);
  bind_tuning(m);
#if SHAPECACHE_WITH_CUDA
  bind_cuda_graphs(m);
  m.attr("has_cuda_graphs") = true;
#else
  m.attr("has_cuda_graphs") = false;
#endif
}
