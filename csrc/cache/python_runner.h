// PythonRunner: an entry served by a Python callable (an eager function, Dynamo's compiled
// code), called as the plain function is, with the owner first and the padded arguments, and
// valid while the StateGuard of what it was built from holds.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <utility>

#include "cache/entry_runner.h"
#include "cache/python_call.h"
#include "cache/state_guard.h"

namespace shapecache {

class PythonRunner : public EntryRunner {
 public:
  PythonRunner(py::object callable, std::shared_ptr<StateGuard> guard)
      : callable_(std::move(callable)), guard_(std::move(guard)) {}

  py::object run(const Call& call) override { return call_python(callable_, call.entry_args, call.entry_kwargs); }

  bool valid() override { return !guard_ || guard_->check(); }

  std::string changed() const override { return guard_ ? guard_->changed() : std::string(); }

  const py::object& callable() const { return callable_; }
  const std::shared_ptr<StateGuard>& guard() const override { return guard_; }

 private:
  py::object callable_;
  std::shared_ptr<StateGuard> guard_;  // null: the entry depends on nothing that can change
};

}  // namespace shapecache
