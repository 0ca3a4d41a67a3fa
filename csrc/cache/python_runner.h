// PythonRunner: an entry served by a Python callable (an eager function, Dynamo's compiled
// code), called as the plain function is, with the owner first and the padded arguments, and
// valid while the StateGuard of what it was built from holds.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <utility>

#include "cache/entry_runner.h"
#include "cache/state_guard.h"

namespace shapecache {

class PythonRunner : public EntryRunner {
 public:
  PythonRunner(py::object callable, std::shared_ptr<StateGuard> guard)
      : callable_(std::move(callable)), guard_(std::move(guard)) {}

  py::object run(const Call& call) override {
    PyObject* out = PyObject_Call(callable_.ptr(), call.entry_args.ptr(), call.entry_kwargs.ptr());
    if (out == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(out);
  }

  bool valid() override { return !guard_ || guard_->check(); }

  std::string changed() const override { return guard_ ? guard_->changed() : std::string(); }

  const py::object& callable() const { return callable_; }
  const std::shared_ptr<StateGuard>& guard() const { return guard_; }

 private:
  py::object callable_;
  std::shared_ptr<StateGuard> guard_;  // null: the entry depends on nothing that can change
};

}  // namespace shapecache
