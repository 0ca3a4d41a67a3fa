#include "cache/compiled_graph_runner.h"

namespace shapecache {

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
