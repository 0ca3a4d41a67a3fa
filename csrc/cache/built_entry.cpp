#include "cache/built_entry.h"

#include <utility>

#include "cache/compiled_graph_runner.h"
#include "cache/python_runner.h"

namespace shapecache {

namespace {

// A field of the builder's result; a result without it is not a BuiltEntry.
py::object field(const py::handle& returned, const char* name) {
  if (!py::hasattr(returned, name)) {
    throw py::type_error(std::string("shapecache: a builder must return a shapecache BuiltEntry, got ") +
                         Py_TYPE(returned.ptr())->tp_name);
  }
  return returned.attr(name);
}

std::shared_ptr<StateGuard> guard_of(const py::object& guard) {
  if (guard.is_none()) return nullptr;
  if (py::isinstance<StateGuard>(guard)) return guard.cast<std::shared_ptr<StateGuard>>();
  if (py::hasattr(guard, "dicts")) return std::make_shared<StateGuard>(guard);  // a record (guards.GuardRecord)
  throw py::type_error(std::string("shapecache: BuiltEntry.guard must be a GuardRecord, a StateGuard or None, got ") +
                       Py_TYPE(guard.ptr())->tp_name);
}

}  // namespace

BuiltEntry BuiltEntry::from_python(const py::handle& returned) {
  BuiltEntry built;
  py::object runner = field(returned, "runner");
  py::object graph = field(returned, "graph");
  py::object rebuild = field(returned, "rebuild");
  py::object built_from = field(returned, "built_from");
  built.bytes = field(returned, "bytes").cast<int64_t>();
  built.output = field(returned, "output");
  built.ran_call = field(returned, "ran_call").cast<bool>();
  built.backend = field(returned, "backend").cast<std::string>();
  built.failure = field(returned, "failure").cast<std::string>();
  built.guard = guard_of(field(returned, "guard"));
  if (!runner.is_none() && !graph.is_none()) {
    throw py::value_error("shapecache: a BuiltEntry has a runner or a graph, not both");
  }
  if (runner.is_none() && graph.is_none()) {
    if (built.failure.empty()) throw py::value_error("shapecache: a BuiltEntry with no runner needs a failure");
    return built;
  }
  // The whole state the build started from, not only what the entry's guard holds: a module
  // the trace ran that was replaced during the build is in neither the entry's guard nor
  // anything else that would see the swap.
  if (!built_from.is_none() && !built_from.cast<StateGuard&>().check()) {
    built.guard = built_from.cast<std::shared_ptr<StateGuard>>();
    built.started_stale = true;
  }
  if (!graph.is_none()) {
    built.runner = std::make_shared<CompiledGraphRunner>(std::move(graph), std::move(rebuild), built.guard);
    built.handle = py::cast(std::static_pointer_cast<CompiledGraphRunner>(built.runner));
  } else if (py::isinstance<EntryRunner>(runner)) {
    if (!built_from.is_none()) {
      throw py::value_error("shapecache: a BuiltEntry's built_from applies to the runners made from it, not to a runner "
                            "made already");
    }
    built.runner = runner.cast<std::shared_ptr<EntryRunner>>();
    built.handle = std::move(runner);
  } else {
    built.runner = std::make_shared<PythonRunner>(runner, built.guard);
    built.handle = std::move(runner);
  }
  return built;
}

}  // namespace shapecache
