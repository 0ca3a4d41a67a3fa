#include "ops/tuning_records.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <string>
#include <vector>

namespace shapecache {

py::dict record_to_dict(const TuningRecord& r) {
  const ConvProblem& p = r.problem;
  py::dict d;
  d["environment"] = r.environment;
  d["device_type"] = c10::DeviceTypeName(static_cast<c10::DeviceType>(p.device_type), /*lower_case=*/true);
  d["dtype"] = std::string(torch::getTHPDtype(static_cast<c10::ScalarType>(p.dtype))->name);
  d["layout"] = p.layout ? "channels_last" : "contiguous";
  d["input"] = py::make_tuple(p.n, p.c, p.h, p.w);
  d["weight"] = py::make_tuple(p.k, p.c / p.groups, p.r, p.s);
  d["stride"] = py::make_tuple(p.stride[0], p.stride[1]);
  d["padding"] = py::make_tuple(p.padding[0], p.padding[1]);
  d["dilation"] = py::make_tuple(p.dilation[0], p.dilation[1]);
  d["groups"] = p.groups;
  d["bias"] = static_cast<bool>(p.has_bias);
  d["algorithm"] = r.algorithm;
  d["workspace_bytes"] = r.workspace_bytes;
  d["microseconds"] = r.microseconds;
  return d;
}

namespace {

c10::ScalarType dtype_from_name(const std::string& name) {
  for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
    const auto type = static_cast<c10::ScalarType>(i);
    THPDtype* dtype = torch::getTHPDtype(type);
    if (dtype != nullptr && name == dtype->name) return type;
  }
  throw py::value_error("unknown dtype '" + name + "'");
}

}  // namespace

TuningRecord record_from_dict(const py::dict& d) {
  TuningRecord r;
  ConvProblem& p = r.problem;
  std::memset(&p, 0, sizeof(p));
  r.environment = d["environment"].cast<std::string>();
  p.environment = hash_environment(r.environment);
  p.device_type = static_cast<int8_t>(c10::Device(d["device_type"].cast<std::string>()).type());
  p.dtype = static_cast<int8_t>(dtype_from_name(d["dtype"].cast<std::string>()));
  const auto layout = d["layout"].cast<std::string>();
  if (layout != "contiguous" && layout != "channels_last") throw py::value_error("unknown layout '" + layout + "'");
  p.layout = layout == "channels_last" ? 1 : 0;
  const auto input = d["input"].cast<std::vector<int64_t>>();
  const auto weight = d["weight"].cast<std::vector<int64_t>>();
  const auto stride = d["stride"].cast<std::vector<int64_t>>();
  const auto padding = d["padding"].cast<std::vector<int64_t>>();
  const auto dilation = d["dilation"].cast<std::vector<int64_t>>();
  if (input.size() != 4 || weight.size() != 4 || stride.size() != 2 || padding.size() != 2 || dilation.size() != 2) {
    throw py::value_error("a tuning record has sizes of the wrong length");
  }
  p.n = input[0], p.c = input[1], p.h = input[2], p.w = input[3];
  p.k = weight[0], p.r = weight[2], p.s = weight[3];
  for (int i = 0; i < 2; ++i) p.stride[i] = stride[i], p.padding[i] = padding[i], p.dilation[i] = dilation[i];
  p.groups = d["groups"].cast<int64_t>();
  p.has_bias = d["bias"].cast<bool>() ? 1 : 0;
  r.algorithm = d["algorithm"].cast<std::string>();
  r.workspace_bytes = d["workspace_bytes"].cast<int64_t>();
  r.microseconds = d["microseconds"].cast<double>();
  return r;
}

}  // namespace shapecache
