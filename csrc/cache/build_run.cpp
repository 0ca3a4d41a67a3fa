#include "cache/build_run.h"

#include <string>
#include <utility>

#include "cache/build_handle.h"
#include "cache/call.h"
#include "cache/call_scope.h"
#include "cache/python_call.h"

namespace shapecache {
namespace {

bool runtime_error_says(py::error_already_set& error, const char* text) {
  return error.matches(PyExc_RuntimeError) && std::string(py::str(error.value())).find(text) != std::string::npos;
}

}  // namespace

const py::object& out_of_memory_type() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> storage;
  return storage.call_once_and_store_result([] { return py::module_::import("torch").attr("OutOfMemoryError"); }).get_stored();
}

// torch's CPU allocator raises a plain RuntimeError ("[enforce fail at alloc_cpu.cpp]
// DefaultCPUAllocator: can't allocate memory", also inside the errors torch.compile wraps it in).
bool is_out_of_memory(py::error_already_set& error) {
  return error.matches(out_of_memory_type()) || error.matches(PyExc_MemoryError) ||
         runtime_error_says(error, "DefaultCPUAllocator: can't allocate memory");
}

// oneDNN reports a failed allocation while creating a primitive (its JIT code, its scratchpad)
// as "could not create a primitive", the text of every failed creation (dnnl.hpp wraps
// dnnl_primitive_create's status in it, and torch keeps only the text). Under a data-segment
// limit a convolution of a new size raises it where the next size raises the allocator's own
// error. A build that raises it is retried once after making room, like an out-of-memory
// build; only a definite one is reported to the user as out of memory.
bool may_be_out_of_memory(py::error_already_set& error) {
  return is_out_of_memory(error) || runtime_error_says(error, "could not create a primitive");
}

BuildRun::BuildRun(py::object function, py::object builder, std::shared_ptr<ShapeCache> cache,
                   FunctionCounters& counters, py::object release_device_memory)
    : function_(std::move(function)),
      builder_(std::move(builder)),
      cache_(std::move(cache)),
      counters_(counters),
      release_device_memory_(std::move(release_device_memory)) {}

std::optional<BuiltEntry> BuildRun::operator()(const c10::Device& device, const py::tuple& args,
                                               const py::dict& kwargs, const py::tuple& tensors, bool run_call,
                                               py::object upgrading) {
  py::object handle = BuildHandle::to_python(BuildHandle(cache_, device, run_call, tensors, std::move(upgrading)));
  for (int attempt = 0;; ++attempt) {
    try {
      py::object result;
      {
        InsideBuild building;
        result = builder_(args, kwargs, handle);
      }
      BuiltEntry built = BuiltEntry::from_python(result);
      // An entry whose builder did not run the call (eager, a compiled graph) is run here, once
      // the builder has returned and the entry's guard is made, so that what the run changes of
      // what the entry reads is seen (MissPolicy::build checks), and so that a recursive cached
      // function costs the interpreter's recursion limit one Python frame per level, as any
      // decorator does, and not the builder's frame too. An entry stale when built, or none, is
      // not run: the plain call answers.
      if (run_call && !built.ran_call) {
        if (built.runner && !built.started_stale) {
          std::string failure = first_run(built, args, kwargs, tensors);
          if (!failure.empty()) {
            built.failure = "its first run raised " + failure;
            built.runner = nullptr;
            built.handle = py::none();
          }
        }
        if (!built.ran_call) built.output = call_python(function_, args, kwargs);
        built.ran_call = true;
      }
      return built;
    } catch (py::error_already_set& error) {
      if (!may_be_out_of_memory(error)) throw;
    }  // the error, and the traceback that holds the failed build's tensors, are released here
    if (attempt == 1) return std::nullopt;
    ++counters_.oom_retries;
    release_device_memory(device);
  }
}

// The call's own errors (an eager entry's run is the plain call) reach the caller, out of
// memory included, which the build's retry then handles; any error of a graph's run is the
// entry's: it is returned, named, and the graph is not kept (the plain call answers, after the
// error and what its traceback holds are released).
std::string BuildRun::first_run(BuiltEntry& built, const py::tuple& args, const py::dict& kwargs,
                                const py::tuple& tensors) {
  Call call;
  call.entry_args = args;
  call.entry_kwargs = kwargs;
  for (py::handle t : tensors) call.tensors.push_back(py::reinterpret_borrow<py::object>(t));
  const bool eager = built.backend == "eager";
  try {
    built.output = built.runner->run(call);
    built.ran_call = true;
    return "";
  } catch (py::error_already_set& error) {
    if (eager) throw;
    return describe_error(error);
  } catch (const std::exception& error) {  // a runner's own C++ error (a CUDA graph's replay)
    if (eager) throw;
    return first_line(error.what());
  }
}

void BuildRun::release_device_memory(const c10::Device& device) {
  {
    auto evicted = cache_->evict_unpinned(device);
  }  // the evicted entries are destroyed before the allocator's cache is emptied
  if (release_device_memory_.is_none()) return;
  release_device_memory_(BuildHandle::to_python(BuildHandle(cache_, device, /*run_call=*/false)));
}

py::object BuildRun::run_uncached(const c10::Device& device, const py::tuple& args, const py::dict& kwargs) {
  try {
    return call_python(function_, args, kwargs);
  } catch (py::error_already_set& error) {
    if (!is_out_of_memory(error)) throw;
    const std::string state = "shapecache: " + cache_->describe(device) +
                              ". Building an entry ran out of memory twice, so the call ran uncached, and the "
                              "uncached call ran out of memory too: the model does not fit beside what the cache holds";
    py::raise_from(error, out_of_memory_type().ptr(), state.c_str());
    throw py::error_already_set();
  }
}

int BuildRun::traverse(visitproc visit, void* arg) const {
  Py_VISIT(function_.ptr());
  Py_VISIT(builder_.ptr());
  Py_VISIT(release_device_memory_.ptr());
  return 0;
}

}  // namespace shapecache
