// CompiledGraphRunner: serves a bucket from a graph compiled for the call's tensors alone
// (the "compile" backend's exported graphs, python/shapecache/_backends/exported.py).
//
// The graph's inputs are the call's tensors in key order (Call::tensors), the order its
// build traced them in (BuildHandle::tensors). Key order does not depend on how a call spells its
// arguments (by position or by keyword), so no call needs respelling, and the call's other
// arguments are constants of the bucket, as its key holds them. The graph returns the
// output's tensors; `rebuild(tensors)` puts them back into the output's structure with its
// other leaves, or, when the output is one tensor, the runner returns it itself.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "cache/entry_runner.h"
#include "cache/state_guard.h"

namespace shapecache {

namespace py = pybind11;

class CompiledGraphRunner : public EntryRunner {
 public:
  // `rebuild`: None when the output is the graph's one tensor.
  CompiledGraphRunner(py::object graph, py::object rebuild, std::shared_ptr<StateGuard> guard)
      : graph_(std::move(graph)), rebuild_(std::move(rebuild)), guard_(std::move(guard)) {}

  py::object run(const Call& call) override;
  bool valid() override { return !guard_ || guard_->check(); }
  // Not while torch.export traces, on any thread: it sets torch.compiler._is_exporting_flag for
  // the whole process, and the compiled graph's Dynamo-disabled wrappers then enter
  // fx_traceback.annotate, writing a global dict the tracing thread writes too (torch 2.13,
  // _dynamo/eval_frame.py, DisableContext): a call beside another thread's export can raise
  // KeyError and leave torch's trace metadata behind. (A build's trace runs on a worker while
  // compiled entries serve.)
  bool runs_now() override;
  std::string changed() const override { return guard_ ? guard_->changed() : std::string(); }
  const std::shared_ptr<StateGuard>& guard() const override { return guard_; }

 private:
  py::object graph_;
  py::object rebuild_;
  std::shared_ptr<StateGuard> guard_;  // what the graph was built from (state_guard.h)
};

}  // namespace shapecache
