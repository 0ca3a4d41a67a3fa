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

// The guard made from a builder's record of what its entry depends on (guards.GuardRecord).
std::shared_ptr<StateGuard> guard_of(const py::object& record) {
  if (record.is_none()) return nullptr;
  if (!py::hasattr(record, "dicts")) {
    throw py::type_error(std::string("shapecache: BuiltEntry.guard must be a GuardRecord or None, got ") +
                         Py_TYPE(record.ptr())->tp_name);
  }
  return std::make_shared<StateGuard>(record);
}

}  // namespace

BuiltEntry BuiltEntry::from_python(const py::handle& returned) {
  BuiltEntry built;
  py::object runner = field(returned, "runner");
  py::object graph = field(returned, "graph");
  py::object entry_runner = field(returned, "entry_runner");
  py::object rebuild = field(returned, "rebuild");
  py::object built_from = field(returned, "built_from");
  built.bytes = field(returned, "bytes").cast<int64_t>();
  built.output = field(returned, "output");
  built.ran_call = field(returned, "ran_call").cast<bool>();
  built.backend = field(returned, "backend").cast<std::string>();
  built.failure = field(returned, "failure").cast<std::string>();
  built.guard = guard_of(field(returned, "guard"));
  built.upgrade = field(returned, "upgrade").cast<bool>();
  const int serving = int(!runner.is_none()) + int(!graph.is_none()) + int(!entry_runner.is_none());
  if (serving > 1) {
    throw py::value_error("shapecache: a BuiltEntry has one of a runner, a graph and an entry_runner, not several");
  }
  if (serving == 0) {
    if (built.failure.empty()) throw py::value_error("shapecache: a BuiltEntry with no runner needs a failure");
    return built;
  }
  if (!entry_runner.is_none()) {
    // Made in C++ already, with its guard: a record or a start state beside it would be a
    // second account of what it depends on.
    if (!py::isinstance<EntryRunner>(entry_runner)) {
      throw py::type_error(std::string("shapecache: BuiltEntry.entry_runner must be a shapecache._C runner, got ") +
                           Py_TYPE(entry_runner.ptr())->tp_name);
    }
    if (built.guard || !built_from.is_none()) {
      throw py::value_error("shapecache: a BuiltEntry's entry_runner holds its own guard; its guard and built_from "
                            "must be None");
    }
    built.runner = entry_runner.cast<std::shared_ptr<EntryRunner>>();
    built.guard = built.runner->guard();
    built.handle = std::move(entry_runner);
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
  } else {
    built.runner = std::make_shared<PythonRunner>(runner, built.guard);
    built.handle = std::move(runner);
  }
  return built;
}

}  // namespace shapecache
