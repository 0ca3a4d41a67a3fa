#include "cache/compiled_graph_runner.h"

#include <utility>

namespace shapecache {

bool CompiledGraphRunner::runs_now() {
  // torch.compiler's module and the flag's name, interned (found in the attribute cache).
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<std::pair<py::object, py::object>> storage;
  const auto& [compiler, name] = storage
                                     .call_once_and_store_result([] {
                                       return std::make_pair(py::object(py::module_::import("torch.compiler")),
                                                             py::reinterpret_steal<py::object>(
                                                                 PyUnicode_InternFromString("_is_exporting_flag")));
                                     })
                                     .get_stored();
  PyObject* flag = PyObject_GetAttr(compiler.ptr(), name.ptr());
  if (flag == nullptr) {  // a torch without the flag: nothing to wait for
    PyErr_Clear();
    return true;
  }
  const bool exporting = flag == Py_True;
  Py_DECREF(flag);
  return !exporting;
}

py::object CompiledGraphRunner::run(const Call& call) {
  py::tuple inputs = call.tensor_tuple();
  PyObject* out = PyObject_Call(graph_.ptr(), inputs.ptr(), nullptr);
  if (out == nullptr) throw py::error_already_set();
  py::object tensors = py::reinterpret_steal<py::object>(out);
  if (!rebuild_.is_none()) return rebuild_(tensors);
  PyObject* first = PySequence_GetItem(tensors.ptr(), 0);
  if (first == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(first);
}

}  // namespace shapecache
