// _C._testing: what only tests use. The core's classes over plain values (the LRU over ints,
// the pool lifecycle with Python callables for torch's calls, the deferral of destruction
// during a capture over probes), a call's key and crop, a
// builder's handle outside a build, the call modes a graph is recaptured under, one named
// convolution algorithm run untuned, and fault injection into tuning.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/Device.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cache/build_handle.h"
#include "cache/call_modes.h"
#include "cache/entry_runner.h"
#include "cache/python_runner.h"
#include "cache/call_key.h"
#include "cache/shape_cache.h"
#include "core/budgeted_lru.h"
#include "core/destroy_after_capture.h"
#include "core/pool_generations.h"
#include "ops/conv2d.h"
#include "ops/conv_tuner.h"
#include "ops/workspace_arena.h"

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

// DestroyAfterCapture over probes that record their destruction: (id, whether the destroying
// thread had a scope open then, whether it was the thread that asked). A probe may hold another
// probe's id to let go of from its own destructor (D3, D4).
struct DestroyedProbe;
struct ProbeLog {
  std::mutex mutex;
  std::vector<std::tuple<int64_t, bool, bool>> destroyed;
};
struct DestroyedProbe {
  int64_t id = 0;
  std::thread::id asked_on;
  DestroyAfterCapture<DestroyedProbe>* owner = nullptr;
  std::shared_ptr<ProbeLog> log;
  std::unique_ptr<DestroyedProbe> then;  // let go of in this probe's destructor
  ~DestroyedProbe() {
    const bool scope_open = owner->capturing_on_this_thread();
    {
      std::lock_guard<std::mutex> guard(log->mutex);
      log->destroyed.emplace_back(id, scope_open, asked_on == std::this_thread::get_id());
    }
    owner->destroy(std::move(then));
  }
};
struct DestroyAfterCaptureProbe {
  DestroyAfterCapture<DestroyedProbe> deferral;
  std::shared_ptr<ProbeLog> log = std::make_shared<ProbeLog>();
  std::vector<std::unique_ptr<DestroyAfterCapture<DestroyedProbe>::Scope>> scopes;
  std::unique_ptr<DestroyedProbe> make(int64_t id, std::optional<int64_t> then) {
    auto probe = std::make_unique<DestroyedProbe>();
    probe->id = id;
    probe->asked_on = std::this_thread::get_id();
    probe->owner = &deferral;
    probe->log = log;
    if (then) probe->then = make(*then, std::nullopt);
    return probe;
  }
};

void bind_destroy_after_capture(py::module_& m) {
  py::class_<DestroyAfterCaptureProbe>(m, "DestroyAfterCaptureProbe")
      .def(py::init<>())
      .def("open", [](DestroyAfterCaptureProbe& p) { p.scopes.push_back(std::make_unique<DestroyAfterCapture<DestroyedProbe>::Scope>(p.deferral)); })
      .def("close", [](DestroyAfterCaptureProbe& p) { p.scopes.pop_back(); })
      // Opens a scope, lets go of `ids` inside it, then throws: the scope closes by unwinding.
      .def("destroy_in_failing_capture",
           [](DestroyAfterCaptureProbe& p, const std::vector<int64_t>& ids) {
             try {
               auto scope = p.deferral.capturing();
               for (int64_t id : ids) p.deferral.destroy(p.make(id, std::nullopt));
               throw std::runtime_error("capture failed");
             } catch (const std::runtime_error&) {
             }
           })
      .def("destroy",
           [](DestroyAfterCaptureProbe& p, int64_t id, std::optional<int64_t> then) {
             auto probe = p.make(id, then);
             py::gil_scoped_release release;
             p.deferral.destroy(std::move(probe));
           },
           py::arg("id"), py::arg("then") = std::nullopt)
      .def_property_readonly("kept", [](const DestroyAfterCaptureProbe& p) { return p.deferral.kept(); })
      .def_property_readonly("destroyed", [](DestroyAfterCaptureProbe& p) {
        std::lock_guard<std::mutex> guard(p.log->mutex);
        return p.log->destroyed;
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
             py::function host_release, py::function reset, bool reset_releases_failed_capture,
             py::object end_generator_capture) {
            auto id_call = [](py::function f) { return [f](const PoolId& id) { f(py::make_tuple(id.first, id.second)); }; };
            CaptureSteps steps{
                [open_pool] { return open_pool().cast<PoolId>(); },
                id_call(begin),
                [body] { body(); },
                [end] { end(); },
                [ended] { return ended().cast<bool>(); },
                PoolAllocatorCalls{id_call(device_end), id_call(device_release)},
                PoolAllocatorCalls{id_call(host_end), id_call(host_release)},
                [reset] { reset(); },
                reset_releases_failed_capture,
            };
            if (!end_generator_capture.is_none()) steps.end_generator_capture = [end_generator_capture] { end_generator_capture(); };
            const PoolId id = pool.capture(steps);
            return py::make_tuple(id.first, id.second);
          },
          py::arg("open_pool"), py::arg("begin"), py::arg("body"), py::arg("end"), py::arg("ended"),
          py::arg("device_end"), py::arg("device_release"), py::arg("host_end"), py::arg("host_release"),
          py::arg("reset"), py::arg("reset_releases_failed_capture"), py::arg("end_generator_capture") = py::none())
      .def("graph_released", [](PoolGenerations& pool, PoolId id) { pool.graph_released(id); })
      .def_property_readonly("live_graphs", &PoolGenerations::live_graphs)
      .def("ids",
           [](const PoolGenerations& pool, bool in_use) {
             py::list out;
             for (const PoolId& id : pool.ids(in_use)) out.append(py::make_tuple(id.first, id.second));
             return out;
           },
           py::arg("in_use"))
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

// A runner released by another thread between a hit's valid() and its run, as a CUDA graph
// may be by a pool rebuild (entry_runner.h, EntryReleased): runs `callable` as a PythonRunner
// does until `released` is set, then throws EntryReleased.
class ReleasedBeforeRun final : public EntryRunner {
 public:
  explicit ReleasedBeforeRun(py::object callable) : runner_(std::move(callable), nullptr) {}
  py::object run(const Call& call) override {
    if (released) throw EntryReleased();
    return runner_.run(call);
  }
  bool valid() override { return true; }
  std::string changed() const override { return std::string(); }
  const std::shared_ptr<StateGuard>& guard() const override { return runner_.guard(); }
  bool released = false;

 private:
  PythonRunner runner_;
};

}  // namespace

void bind_testing(py::module_& m) {
  py::class_<ReleasedBeforeRun, EntryRunner, std::shared_ptr<ReleasedBeforeRun>>(m, "ReleasedBeforeRun")
      .def(py::init<py::object>(), py::arg("callable"))
      .def_readwrite("released", &ReleasedBeforeRun::released);
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
      .def("fits_in_place", &IntLru::fits_in_place, py::arg("key"), py::arg("bytes"))
      .def("fits_free_with_shared", &IntLru::fits_free_with_shared, py::arg("bytes"), py::arg("shared_bytes"))
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
        d["inserts"] = c.inserts;
        d["rejections"] = c.rejections;
        d["evictions"] = c.evictions;
        d["peak_bytes"] = c.peak_bytes;
        return d;
      });

  bind_pool_generations(m);
  bind_destroy_after_capture(m);

  m.def(
      "call_key",
      [](py::tuple args, py::dict kwargs, std::vector<ArgumentBuckets> buckets, uint64_t function_id, int training,
         std::vector<std::string> parameter_names) {
        CallContext context;
        context.function_id = function_id;
        context.training = training;
        context.parameter_names = &parameter_names;
        Call call = make_call(context, py::none(), args, kwargs, buckets);
        py::dict out;
        out["words"] = py::tuple(py::cast(call.key.words()));
        out["hash"] = call.key.hash();
        out["device"] = py::reinterpret_steal<py::object>(THPDevice_New(call.device));
        out["description"] = describe_key(call.key);
        out["padded"] = call.padded;
        out["args"] = call.entry_args;
        out["kwargs"] = call.entry_kwargs;
        out["tensors"] = call.tensor_tuple();
        py::list crop;
        for (const CropDim& c : call.crop) crop.append(py::make_tuple(c.dim, c.original, c.padded));
        out["crop"] = crop;
        return out;
      },
      py::arg("args"), py::arg("kwargs"), py::arg("buckets") = std::vector<ArgumentBuckets>{},
      py::arg("function_id") = 0, py::arg("training") = -1, py::arg("parameter_names") = std::vector<std::string>{},
      "The Call of calling a function with `args` and `kwargs`: its key, padded arguments and tensors in key order.");

  m.def(
      "crop_outputs",
      [](py::object outputs, std::vector<std::vector<int64_t>> shapes) -> py::object {
        std::optional<py::object> cropped = crop_outputs(outputs, shapes);
        return cropped ? std::move(*cropped) : py::object(py::none());
      },
      py::arg("outputs"), py::arg("shapes"),
      "`outputs` with each tensor narrowed to its shape in `shapes` (map order); None when they do not match.");

  m.def(
      "build_handle",
      [](const std::shared_ptr<ShapeCache>& cache, c10::Device device) {
        return BuildHandle::to_python(BuildHandle(cache, device, /*run_call=*/false));
      },
      py::arg("cache"), py::arg("device"), "A BuildHandle on `device` of `cache`, as a builder gets one.");

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
      "conv2d_algorithm",
      [](const std::string& algorithm, const at::Tensor& input, const at::Tensor& weight,
         const std::optional<at::Tensor>& bias, std::vector<int64_t> stride, std::vector<int64_t> padding,
         std::vector<int64_t> dilation, int64_t groups) {
        return ConvTuner::instance().run_named(make_conv_args(input, weight, bias, stride, padding, dilation, groups),
                                               algorithm);
      },
      py::arg("algorithm"), py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("stride"),
      py::arg("padding"), py::arg("dilation"), py::arg("groups"), "Runs one named algorithm (no tuning).");
  m.def("workspace_leases_on_this_thread", &WorkspaceArena::leases_on_this_thread);

  m.def("tuning_fail_candidate", [](std::string name) { ConvTuner::instance().fail_candidate_for_tests(std::move(name)); },
        "Fault injection for tests: tuning makes the named candidate fail ('' for none).");
}
