// Tuning records as Python sees them: plain dicts with the records file's fields, read and
// written by python/shapecache/ops/_tuning.py.
#pragma once

#include <pybind11/pybind11.h>

#include "ops/conv_tuner.h"

namespace shapecache {

namespace py = pybind11;

py::dict record_to_dict(const TuningRecord& r);
// Raises KeyError/TypeError/ValueError on a malformed record (the file is then set aside).
TuningRecord record_from_dict(const py::dict& d);

}  // namespace shapecache
