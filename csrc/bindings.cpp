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

#include "cache/build_handle.h"
#include "cache/cache_figures.h"
#include "cache/call_key.h"
#include "cache/call_modes.h"
#include "cache/call_scope.h"
#include "cache/compiled_graph_runner.h"
#include "cache/entries_released.h"
#include "cache/entry_runner.h"
#include "cache/shape_cache.h"
#include "cache/shape_dispatcher.h"
#include "cache/state_guard.h"
#include "cache/python_call.h"
#include "cache/trace_gate.h"
#include "core/bucket_policy.h"
#include "core/budgeted_lru.h"
#include "core/pool_generations.h"
#include "ops/conv2d.h"
#include "ops/conv_tuner.h"
#include "ops/tuning_records.h"
#include "ops/workspace_arena.h"
#if SHAPECACHE_WITH_CUDA
#include "cache/cuda/cuda_graph_runner.h"
#endif

namespace py = pybind11;
using namespace shapecache;

// The surface only tests use (testing_bindings.cpp): _C._testing.
void bind_testing(py::module_& m);

namespace {

py::list device_list(const std::vector<c10::Device>& devices) {
  py::list list;
  for (const c10::Device& d : devices) list.append(py::reinterpret_steal<py::object>(THPDevice_New(d)));
  return list;
}

void bind_core(py::module_& m) {
  py::class_<BucketPolicy>(m, "BucketPolicy")
      .def_static("exact", &BucketPolicy::exact)
      .def_static("multiple_of", &BucketPolicy::multiple_of, py::arg("n"))
      .def_static("power_of_two", &BucketPolicy::power_of_two, py::arg("minimum") = 1)
      .def_static("one_of", &BucketPolicy::one_of, py::arg("sizes"))
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

}

// Named functions behind the table below: what a binding does beyond forwarding.

std::shared_ptr<ShapeCache> make_shape_cache(py::object budget_for_device, std::optional<int64_t> max_entries) {
  return std::make_shared<ShapeCache>(std::move(budget_for_device), max_entries ? *max_entries : EntryLru::kUnlimited);
}

std::unique_ptr<ShapeDispatcher> make_dispatcher(py::object function, py::object builder,
                                                 std::shared_ptr<ShapeCache> cache, std::vector<ArgumentBuckets> buckets,
                                                 std::vector<std::string> parameter_names, py::object owner,
                                                 bool key_training, py::object background,
                                                 py::object release_device_memory, py::object wake_build_worker,
                                                 py::object run_on_fake_tensors) {
  return std::make_unique<ShapeDispatcher>(std::move(function), std::move(builder), std::move(cache),
                                           std::move(buckets), std::move(parameter_names), std::move(owner),
                                           key_training, std::move(background),
                                           MissServices{std::move(release_device_memory), std::move(wake_build_worker)},
                                           std::move(run_on_fake_tensors));
}

// A native runner called from Python (a build's first run, a replay timed): with the call's
// tensors in key order, which is all such a runner reads of a call.
py::object run_on_tensors(EntryRunner& runner, const py::args& tensors) {
  Call call;
  call.entry_args = tensors;
  for (py::handle t : tensors) call.tensors.push_back(py::reinterpret_borrow<py::object>(t));
  return runner.run(call);
}

// The dispatcher's Python type lets the collector see through it to its entries
// (ShapeDispatcher::traverse) and clear them.
int dispatcher_traverse(PyObject* self, visitproc visit, void* arg) {
  // Its __dict__ must be visited exactly once: a reference counted twice, or not at all, makes
  // the collector miscount the dict, and a cycle through it (a module whose own forward holds
  // it) is never freed. An instance of a Python subclass (CachedFunction) comes here from
  // CPython's subtype_traverse. On 3.11 that has visited its managed dict already, so only the
  // type is visited here, as pybind11_traverse does; from 3.12 on it leaves a dict the base
  // type also manages to the base's traverse, pybind11_traverse (seen with gc.get_referents).
#if PY_VERSION_HEX < 0x030C0000
  const bool dict_visited = Py_TYPE(self)->tp_traverse != &dispatcher_traverse &&
                            (Py_TYPE(self)->tp_flags & Py_TPFLAGS_MANAGED_DICT) != 0;
#else
  const bool dict_visited = false;
#endif
  if (dict_visited) {
    Py_VISIT(Py_TYPE(self));
  } else if (int result = py::detail::pybind11_traverse(self, visit, arg)) {
    return result;
  }
  if (!py::detail::is_holder_constructed(self)) return 0;
  return py::cast<const ShapeDispatcher&>(py::handle(self)).traverse(visit, arg);
}

// The dispatcher's call slot. CPython calls it straight from the caller's frame: no lookup of
// __call__, no pybind11 overload dispatch or argument casting, and one C call per level of a
// recursive cached function (shape_dispatcher.cpp: RecursionAllowance) instead of three.
PyObject* dispatcher_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  try {
    py::detail::loader_life_support casts;  // where pybind11 casts keep their temporaries, as in its dispatcher
    if (!py::detail::is_holder_constructed(self)) {
      PyErr_SetString(PyExc_TypeError, "shapecache: a ShapeDispatcher whose __init__ did not run cannot be called");
      return nullptr;
    }
    auto& dispatcher = py::cast<ShapeDispatcher&>(py::handle(self));
    const auto positional = py::reinterpret_borrow<py::args>(args);
    const auto keywords = kwargs != nullptr ? py::reinterpret_borrow<py::kwargs>(kwargs) : py::kwargs();
    return dispatcher.call(positional, keywords).release().ptr();
  } catch (py::error_already_set& error) {
    error.restore();
    return nullptr;
#ifdef __GLIBCXX__
  } catch (abi::__forced_unwind&) {  // a cancelled thread unwinds through here
    throw;
#endif
  } catch (...) {  // as pybind11's own dispatcher does: the registered translators, then SystemError
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

void dispatcher_type_setup(PyHeapTypeObject* heap_type) {
  auto* type = &heap_type->ht_type;
  type->tp_call = &dispatcher_call;  // (no __call__ is bound: setting one would replace this slot)
  type->tp_flags |= Py_TPFLAGS_HAVE_GC;
  type->tp_traverse = &dispatcher_traverse;
  type->tp_clear = [](PyObject* self) {
    if (py::detail::is_holder_constructed(self)) py::cast<ShapeDispatcher&>(py::handle(self)).clear_references();
    return py::detail::pybind11_clear(self);
  };
}

py::tuple names_of_function_counters() {
  py::list names;
  FunctionCounters{}.for_each([&](const char* name, int64_t) { names.append(name); });
  return py::tuple(names);
}
py::tuple names_of_device_figures() {
  py::list names;
  DeviceFigures{}.for_each([&](const char* name, int64_t, bool) { names.append(name); });
  return py::tuple(names);
}
py::tuple names_of_entry_figures() {
  py::list names;
  EntryFigures{}.for_each([&](const char* name, const auto&) { names.append(name); });
  return py::tuple(names);
}

void bind_cache(py::module_& m) {
  py::register_exception<UnkeyableArgument>(m, "UnkeyableArgument", PyExc_TypeError);

  py::class_<ShapeCache, std::shared_ptr<ShapeCache>>(m, "ShapeCache", "One budget domain (csrc/cache/shape_cache.h).")
      .def(py::init(&make_shape_cache), py::arg("budget_for_device"), py::arg("max_entries") = py::none())
      .def("stats", [](const ShapeCache& cache) { return cache.stats(); })
      .def("clear", [](ShapeCache& cache) { cache.clear(); });

  py::class_<BuildHandle>(m, "BuildHandle", py::dynamic_attr(),
                          "All a builder may do to its cache (csrc/cache/build_handle.h).")
      .def("set_shared_bytes", &BuildHandle::set_shared_bytes, py::arg("pool") = py::none(),
           py::arg("workspace") = py::none())
      .def("set_shared_bytes_if_free", &BuildHandle::set_shared_bytes_if_free, py::arg("pool") = py::none(),
           py::arg("workspace") = py::none(), py::arg("bytes") = 0)
      .def("could_fit", &BuildHandle::could_fit, py::arg("bytes"), py::arg("shared_bytes") = py::none())
      .def("entries", &BuildHandle::entries)
      .def("erase_entry", &BuildHandle::erase_entry, py::arg("id"))
      .def("contains_entry", &BuildHandle::contains_entry, py::arg("id"))
      .def("set_entry_bytes", &BuildHandle::set_entry_bytes, py::arg("id"), py::arg("bytes"))
      .def("evict_unpinned", &BuildHandle::evict_unpinned)
      .def("count_pool_rebuild", &BuildHandle::count_pool_rebuild);

  m.def("run_next_build", [](c10::Device device) { return BuildQueue::instance().run_next(device); },
        py::arg("device"), "Runs the oldest ready background build queued for `device`; False when none is ready.");
  m.def("pending_builds", [] { return BuildQueue::instance().pending(); },
        "Background builds waiting or running, on every device.");
  m.def("cancel_all_builds", [] { return BuildQueue::instance().cancel_all().size(); },
        "Drops every waiting background build (at interpreter exit); the running ones end as they do.");
  m.def("forget_parents_builds", [] { return BuildQueue::instance().forget_parents_builds().size(); },
        "In a forked child: drops the builds its parent had queued or was running.");
  m.def("close_trace_gate", [](double timeout_s) { return TraceGate::instance().close(timeout_s); },
        py::arg("timeout_s"),
        "Keeps runs of user code on other threads from starting, waiting up to `timeout_s` for those in progress; "
        "True where none is left (trace_gate.h). Open it again with open_trace_gate, whatever it returned.");
  m.def("open_trace_gate", [] { TraceGate::instance().open(); }, "Lets runs of user code start again.");
  m.def("runs_elsewhere", [] {
        auto seen = TraceGate::instance().runs_elsewhere();
        return py::make_tuple(seen.started, seen.in_progress);
      },
        "(started, in progress): the runs of user code shapecache made on other threads.");
  m.def("trace_gate_after_fork", &TraceGate::after_fork, "In a forked child: a new gate, open.");
  m.def("run_user_code", [](const py::object& function, const py::tuple& args, const py::dict& kwargs) {
        return call_python(function, args, kwargs);
      },
        py::arg("function"), py::arg("args"), py::arg("kwargs"),
        "function(*args, **kwargs), counted as a run of user code (trace_gate.h): what a builder runs of the "
        "user's code goes through here, as the cache's own runs do.");
  m.def("entries_released", &entries_released,
        "How many entries (and built results never inserted) the process has let go of (entries_released.h).");
  m.def("devices_with_ready_builds", [] { return device_list(BuildQueue::instance().ready_devices()); },
        "The devices whose workers have builds that may start.");
  m.def("make_all_builds_ready", [] { return device_list(BuildQueue::instance().make_all_ready()); },
        "Lets every waiting build start, also those whose calls have not returned (sc.wait); "
        "returns the devices with builds waiting.");
  m.attr("FUNCTION_COUNTERS") = names_of_function_counters();
  m.attr("DEVICE_FIGURES") = names_of_device_figures();
  m.attr("ENTRY_FIGURES") = names_of_entry_figures();

  py::class_<EntryRunner, std::shared_ptr<EntryRunner>>(m, "EntryRunner", "How an entry serves calls (entry_runner.h).")
      .def("valid", &EntryRunner::valid)
      .def("__call__", &run_on_tensors, "Runs on a call's tensors in key order (BuildHandle.tensors).");

  // Made in C++ from a builder's graph (built_entry.h); bound so that it can be listed and called.
  py::class_<CompiledGraphRunner, EntryRunner, std::shared_ptr<CompiledGraphRunner>>(m, "CompiledGraphRunner");

  StateGuard::probe_dict_watchers();
  py::class_<EntriesServed>(m, "EntriesServed",
                            "The entries the cached calls on this thread serve inside a with block "
                            "(csrc/cache/call_scope.h).")
      .def(py::init<>())
      .def("__enter__", [](EntriesServed& self) -> EntriesServed& { self.open(); return self; },
           py::return_value_policy::reference_internal)
      .def("__exit__", [](EntriesServed& self, const py::args&) { self.close(); })
      .def_readonly("used", &EntriesServed::used)
      .def_readonly("built", &EntriesServed::built);
  py::class_<StateGuard, std::shared_ptr<StateGuard>>(m, "StateGuard",
                                                      "What an entry was built from (csrc/cache/state_guard.h).")
      .def(py::init<>())
      .def(py::init<const py::handle&>(), py::arg("record"))
      .def("check", &StateGuard::check)
      .def_property_readonly("changed", &StateGuard::changed);

  py::class_<ShapeDispatcher>(m, "ShapeDispatcher", py::dynamic_attr(), py::custom_type_setup(&dispatcher_type_setup))
      .def(py::init(&make_dispatcher), py::arg("function"), py::arg("builder"), py::arg("cache"), py::arg("buckets"),
           py::arg("parameter_names"), py::arg("owner"), py::arg("key_training"), py::arg("background") = py::none(),
           py::kw_only(), py::arg("release_device_memory") = py::none(), py::arg("wake_build_worker") = py::none(),
           py::arg("run_on_fake_tensors") = py::none())
      .def("queue_build", &ShapeDispatcher::queue_build,
           "Queues the background build of the bucket of a call with these arguments, without running it.")
      .def("stats", &ShapeDispatcher::stats)
      .def("clear", &ShapeDispatcher::clear)
      .def_property_readonly("pending_builds", &ShapeDispatcher::pending_builds)
      .def_property_readonly("function", &ShapeDispatcher::function)
      .def_property_readonly("cache", &ShapeDispatcher::cache);
}

// What the tuning bindings do beyond forwarding: records and figures as Python dicts.

py::dict tune_conv2d(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
                     int64_t groups) {
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
}

int64_t tuning_load(const py::list& records) {
  std::vector<TuningRecord> parsed;
  for (py::handle r : records) parsed.push_back(record_from_dict(py::reinterpret_borrow<py::dict>(r)));
  return ConvTuner::instance().load(parsed);
}

py::list tuning_take_unsaved() {
  py::list out;
  for (const TuningRecord& r : ConvTuner::instance().take_unsaved()) out.append(record_to_dict(r));
  return out;
}

py::dict tuning_stats() {
  const TunerStats s = ConvTuner::instance().stats();
  py::dict d;
  d["tuned"] = s.tuned;
  d["loaded"] = s.loaded;
  d["hits"] = s.hits;
  d["records"] = s.records;
  return d;
}

// The identity of a record's problem, for merging files.
py::bytes record_key(const py::dict& record) {
  const TuningRecord r = record_from_dict(record);
  return py::bytes(reinterpret_cast<const char*>(&r.problem), sizeof(r.problem));
}

py::dict workspace_stats(c10::Device device) {
  WorkspaceArena& arena = WorkspaceArena::of(device);
  py::dict d;
  d["bytes"] = arena.bytes();
  d["cap"] = arena.cap() == WorkspaceArena::kUnlimited ? py::object(py::none()) : py::int_(arena.cap());
  d["generation"] = arena.generation();
  return d;
}

void set_workspace_cap(c10::Device device, std::optional<int64_t> bytes) {
  WorkspaceArena::of(device).set_cap(bytes ? *bytes : WorkspaceArena::kUnlimited);
}

void bind_tuning(py::module_& m) {
  m.def("tune_conv2d", &tune_conv2d, py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("stride"),
        py::arg("padding"), py::arg("dilation"), py::arg("groups"),
        "Times every algorithm for this problem and records the fastest that fits.");
  m.def("tuning_load", &tuning_load);
  m.def("tuning_take_unsaved", &tuning_take_unsaved);
  m.def("tuning_has_unsaved", [] { return ConvTuner::instance().has_unsaved(); });
  m.def("tuning_stats", &tuning_stats);
  m.def("tuning_clear", [] { ConvTuner::instance().clear(); });
  m.def("tuning_environment", [](c10::Device device) { return ConvTuner::instance().environment(device); });
  m.def("record_key", &record_key);
  m.def("workspace_stats", &workspace_stats);
  m.def("set_workspace_cap", &set_workspace_cap, py::arg("device"), py::arg("bytes"));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "shapecache's C++ core: shape keys, bucket policies, the budgeted LRU, the cached call, conv tuning";
  bind_core(m);
  bind_cache(m);
  bind_tuning(m);
  py::module_ testing = m.def_submodule("_testing", "What only tests use: the core's pieces over plain values, fault injection.");
  bind_testing(testing);
#if SHAPECACHE_WITH_CUDA
  bind_cuda_graphs(m);
  m.attr("has_cuda_graphs") = true;
#else
  m.attr("has_cuda_graphs") = false;
#endif
}
