// CompiledGraphRunner: serves a bucket from a graph compiled for the call's tensors alone
// (the "compile" backend's exported graphs, python/shapecache/_backends/exported.py).
//
// The graph's inputs are the call's tensors in key order (call_key.h: tensors_in_key_order),
// the order its build traced them in. Key order does not depend on how a call spells its
// arguments (by position or by keyword), so no call needs respelling, and the call's other
// arguments are constants of the bucket, as its key holds them. The graph returns the
// output's tensors; `rebuild(tensors)` puts them back into the output's structure with its
// other leaves, or, when the output is one tensor, the runner returns it itself.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "cache/entry_runner.h"
#include "cache/state_guard.h"

namespace shapecache {

namespace py = pybind11;

class CompiledGraphRunner : public EntryRunner {
 public:
  // `rebuild`: None when the output is the graph's one tensor.
  CompiledGraphRunner(py::object graph, std::vector<std::string> parameter_names, py::object rebuild,
                      std::shared_ptr<StateGuard> guard)
      : graph_(std::move(graph)),
        parameter_names_(std::move(parameter_names)),
        rebuild_(std::move(rebuild)),
        guard_(std::move(guard)) {}

  py::object run(const py::tuple& args, const py::dict& kwargs) override;
  bool valid() override { return !guard_ || guard_->check(); }

 private:
  py::object graph_;
  std::vector<std::string> parameter_names_;
  py::object rebuild_;
  std::shared_ptr<StateGuard> guard_;  // what the graph was built from (state_guard.h)
};

}  // namespace shapecache
