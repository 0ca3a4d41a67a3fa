#include "cache/call_key.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/DynamicTypes.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <sstream>
#include <string_view>
#include <utility>

namespace shapecache {
namespace {

// Nested containers deeper than this are not keyed (and a self-containing list never ends).
constexpr int kMaxNesting = 16;

MemoryLayout layout_of(const at::Tensor& t) {
  if (t.is_contiguous()) return MemoryLayout::kContiguous;
  if (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) return MemoryLayout::kChannelsLast;
  if (t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d)) return MemoryLayout::kChannelsLast3d;
  return MemoryLayout::kOtherStrides;
}

// A tensor whose sizes can be keyed: strided, not nested (a strided nested tensor has no
// sizes to read: asking throws an internal error).
void check_keyable(const at::Tensor& t) {
  // A subclass (a user's, or the fake and functional tensors of a trace) runs its own Python
  // code per operator: a graph built for plain tensors must not serve it.
  if (t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}))) {
    throw UnkeyableArgument("a tensor subclass, or a fake or functional tensor (only plain tensors are keyed)");
  }
  if (t.is_nested()) throw UnkeyableArgument("a nested tensor (only plain strided tensors are keyed)");
  if (t.layout() != c10::kStrided) {
    std::ostringstream what;
    what << "a tensor with layout " << t.layout() << " (only strided tensors are keyed)";
    throw UnkeyableArgument(what.str());
  }
}

void add_tensor(ShapeKey& key, const at::Tensor& t, uint8_t alias) {
  check_keyable(t);
  if (t.dim() > 255) throw UnkeyableArgument("a tensor of more than 255 dimensions");
  TensorSignature signature;
  std::memset(&signature, 0, sizeof(signature));
  signature.ndim = static_cast<uint8_t>(t.dim());
  signature.dtype = static_cast<int8_t>(t.scalar_type());
  signature.device_type = static_cast<int8_t>(t.device().type());
  signature.device_index = static_cast<int16_t>(t.device().index());
  signature.layout = static_cast<uint8_t>(layout_of(t));
  signature.requires_grad = t.requires_grad() ? 1 : 0;
  signature.alias = alias;
  key.add_tensor(signature, t.sizes().data());
  // A graph compiled for one set of strides asserts them (inductor) or reads memory as laid
  // out then (a CUDA graph): other strides are another entry.
  if (signature.layout == static_cast<uint8_t>(MemoryLayout::kOtherStrides)) {
    for (const int64_t stride : t.strides()) key.add_word(static_cast<uint64_t>(stride));
  }
}

std::string_view utf8_of(PyObject* text) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(text, &size);
  if (data == nullptr) throw py::error_already_set();
  return {data, static_cast<size_t>(size)};
}

class KeyWriter {
 public:
  explicit KeyWriter(Call& out) : out_(out) {}

  void add_value(PyObject* obj, int depth) {
    ShapeKey& key = out_.key;
    if (THPVariable_Check(obj)) {
      const at::Tensor& t = THPVariable_Unpack(obj);
      add_tensor(key, t, alias_of(t));
      note_device(t.device());
      out_.tensors.push_back(py::reinterpret_borrow<py::object>(obj));
    } else if (obj == Py_None) {
      key.add_none();
    } else if (PyBool_Check(obj)) {
      key.add_bool(obj == Py_True);
    } else if (PyLong_Check(obj)) {
      int overflow = 0;
      long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
      if (overflow != 0) throw UnkeyableArgument("an int outside the 64-bit range");
      key.add_int(value);
    } else if (PyFloat_Check(obj)) {
      key.add_float(PyFloat_AS_DOUBLE(obj));
    } else if (PyUnicode_Check(obj)) {
      key.add_string(utf8_of(obj));
    } else if (THPDtype_Check(obj)) {
      key.add_tag(KeyTag::kDtype);
      key.add_word(static_cast<uint64_t>(reinterpret_cast<THPDtype*>(obj)->scalar_type));
    } else if (THPDevice_Check(obj)) {
      const c10::Device& device = reinterpret_cast<THPDevice*>(obj)->device;
      key.add_tag(KeyTag::kDevice);
      key.add_word(static_cast<uint64_t>(device.type()));
      key.add_word(static_cast<uint64_t>(static_cast<int64_t>(device.index())));
    } else if (PyTuple_Check(obj) || PyList_Check(obj)) {
      check_depth(depth);
      const bool is_tuple = PyTuple_Check(obj);
      const Py_ssize_t n = is_tuple ? PyTuple_GET_SIZE(obj) : PyList_GET_SIZE(obj);
      key.begin_container(is_tuple ? KeyTag::kTuple : KeyTag::kList, static_cast<size_t>(n));
      for (Py_ssize_t i = 0; i < n; ++i) {
        add_value(is_tuple ? PyTuple_GET_ITEM(obj, i) : PyList_GET_ITEM(obj, i), depth + 1);
      }
    } else if (PyDict_Check(obj)) {
      check_depth(depth);
      key.begin_container(KeyTag::kDict, static_cast<size_t>(PyDict_Size(obj)));
      Py_ssize_t position = 0;
      PyObject* name = nullptr;
      PyObject* value = nullptr;
      while (PyDict_Next(obj, &position, &name, &value)) {
        if (!PyUnicode_Check(name)) throw UnkeyableArgument("a dict with a key that is not a string");
        key.add_tag(KeyTag::kKeyword);
        key.add_string(utf8_of(name));
        add_value(value, depth + 1);
      }
    } else {
      throw UnkeyableArgument(std::string("an object of type ") + Py_TYPE(obj)->tp_name);
    }
  }

  // A bucketed argument: keyed by its bucket sizes, padded when they differ from its own.
  // Returns the padded tensor, or nullopt when the argument already has its bucket's sizes.
  std::optional<py::object> add_bucketed(PyObject* obj, const ArgumentBuckets& spec, int64_t argument,
                                         const std::string& name) {
    if (!THPVariable_Check(obj)) {
      throw py::type_error("buckets: argument '" + name + "' has a bucket policy, so it must be a tensor; got " +
                           Py_TYPE(obj)->tp_name);
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    check_keyable(t);
    const int64_t ndim = t.dim();
    std::vector<int64_t> sizes = t.sizes().vec();
    std::vector<CropDim> padded_dims;
    for (const auto& [dim, policy] : spec.dims) {
      const int64_t d = dim < 0 ? dim + ndim : dim;
      if (d < 0 || d >= ndim) {
        throw py::value_error("buckets: dimension " + std::to_string(dim) + " of argument '" + name +
                              "' is out of range for a tensor of " + std::to_string(ndim) + " dimensions");
      }
      int64_t bucket = 0;
      try {
        bucket = policy.bucket(sizes[d]);
      } catch (const std::logic_error& e) {  // out_of_range: above the largest listed size
        throw py::value_error("buckets: argument '" + name + "', dimension " + std::to_string(dim) + ": " + e.what());
      } catch (const std::overflow_error& e) {
        throw py::value_error("buckets: argument '" + name + "', dimension " + std::to_string(dim) + ": " + e.what());
      }
      if (bucket != sizes[d]) padded_dims.push_back(CropDim{argument, d, sizes[d], bucket});
      sizes[d] = bucket;
    }
    note_device(t.device());
    if (padded_dims.empty()) {
      add_tensor(out_.key, t, alias_of(t));
      out_.tensors.push_back(py::reinterpret_borrow<py::object>(obj));
      return std::nullopt;
    }
    // Zeros of the bucket's sizes in the argument's own memory format, the argument copied
    // into the leading corner.
    at::Tensor padded = at::empty(sizes, t.options(), t.suggest_memory_format()).zero_();
    at::Tensor corner = padded;
    for (const CropDim& p : padded_dims) corner = corner.narrow(p.dim, 0, p.original);
    corner.copy_(t);
    add_tensor(out_.key, padded, alias_of(t));  // aliasing as the caller passed it: the padded copy is fresh
    out_.crop.insert(out_.crop.end(), padded_dims.begin(), padded_dims.end());
    out_.padded = true;
    py::object wrapped = py::reinterpret_steal<py::object>(THPVariable_Wrap(padded));
    out_.tensors.push_back(wrapped);
    return wrapped;
  }

  void note_device(const c10::Device& device) {
    if (!device_) device_ = device;
  }

  // 1 + the position of the first earlier tensor of the call with the same storage, or 0.
  // Tensors with no storage (meta, wrapper subclasses) never alias here.
  uint8_t alias_of(const at::Tensor& t) {
    const void* storage = t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
    uint8_t alias = 0;
    if (storage != nullptr) {
      for (size_t i = 0; i < storages_.size() && i < 254; ++i) {
        if (storages_[i] == storage) {
          alias = static_cast<uint8_t>(i + 1);
          break;
        }
      }
    }
    storages_.push_back(storage);
    return alias;
  }
  c10::Device device() const { return device_.value_or(c10::Device(c10::kCPU)); }

 private:
  static void check_depth(int depth) {
    if (depth >= kMaxNesting) throw UnkeyableArgument("containers nested more than 16 deep");
  }

  Call& out_;
  std::optional<c10::Device> device_;
  std::vector<const void*> storages_;  // each tensor's storage, in the order keyed
};

uint64_t context_flags(int training) {
  uint64_t flags = 0;
  flags |= at::GradMode::is_enabled() ? 1u : 0u;
  flags |= c10::InferenceMode::is_enabled() ? 2u : 0u;
  flags |= static_cast<uint64_t>(training + 1) << 2;  // 0: not a module, 1: eval, 2: train
  if (at::autocast::is_autocast_enabled(at::kCPU)) {
    flags |= 1u << 4;
    flags |= static_cast<uint64_t>(at::autocast::get_autocast_dtype(at::kCPU)) << 8;
  }
  if (at::autocast::is_autocast_enabled(at::kCUDA)) {
    flags |= 1u << 5;
    flags |= static_cast<uint64_t>(at::autocast::get_autocast_dtype(at::kCUDA)) << 16;
  }
  return flags;
}

const ArgumentBuckets* buckets_for_position(const std::vector<ArgumentBuckets>& buckets, int64_t position) {
  for (const ArgumentBuckets& b : buckets) {
    if (b.position == position) return &b;
  }
  return nullptr;
}

const ArgumentBuckets* buckets_for_name(const std::vector<ArgumentBuckets>& buckets, std::string_view name) {
  for (const ArgumentBuckets& b : buckets) {
    if (!b.name.empty() && b.name == name) return &b;
  }
  return nullptr;
}


}  // namespace

py::tuple with_owner(const py::object& owner, const py::tuple& args) {
  if (owner.is_none()) return args;
  const Py_ssize_t n = PyTuple_GET_SIZE(args.ptr());
  py::tuple out(n + 1);
  PyTuple_SET_ITEM(out.ptr(), 0, owner.inc_ref().ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(args.ptr(), i);
    Py_INCREF(item);
    PyTuple_SET_ITEM(out.ptr(), i + 1, item);
  }
  return out;
}

Call make_call(const CallContext& context, const py::object& owner, const py::tuple& args, const py::dict& kwargs,
               const std::vector<ArgumentBuckets>& buckets) {
  Call out;
  out.owner = owner;
  out.args = args;
  out.kwargs = kwargs;
  ShapeKey& key = out.key;
  key.add_tag(KeyTag::kContext);
  key.add_word(context.function_id);
  key.add_word(context_flags(context.training));

  KeyWriter writer(out);
  std::optional<py::list> padded_args;
  std::optional<py::dict> padded_kwargs;
  auto write = [&](const NamedArgument& argument) {
    const ArgumentBuckets* spec = nullptr;
    if (!buckets.empty()) {
      spec = argument.position >= 0 ? buckets_for_position(buckets, argument.position) : nullptr;
      if (spec == nullptr && !argument.name.empty()) spec = buckets_for_name(buckets, argument.name);
    }
    const std::string name = argument.name.empty() ? "args[" + std::to_string(argument.position) + "]"
                                                   : std::string(argument.name);
    if (spec == nullptr) {
      try {
        writer.add_value(argument.value, 0);
      } catch (const UnkeyableArgument& e) {
        throw UnkeyableArgument("argument '" + name + "' is " + e.what());
      }
      return;
    }
    auto padded = writer.add_bucketed(argument.value, *spec, spec - buckets.data(), name);
    if (!padded) return;
    if (argument.keyword == nullptr) {
      if (!padded_args) padded_args = py::list(args);
      (*padded_args)[argument.position] = *padded;
    } else {
      if (!padded_kwargs) padded_kwargs = py::dict(kwargs);
      (*padded_kwargs)[argument.keyword] = *padded;
    }
  };

  size_t unnamed = 0;
  const std::vector<NamedArgument> arguments = canonical_arguments(args, kwargs, context.parameter_names, &unnamed);
  key.begin_container(KeyTag::kTuple, unnamed);
  for (size_t i = 0; i < unnamed; ++i) write(arguments[i]);
  key.begin_container(KeyTag::kDict, arguments.size() - unnamed);
  for (size_t i = unnamed; i < arguments.size(); ++i) {
    key.add_tag(KeyTag::kKeyword);
    key.add_string(arguments[i].name);
    write(arguments[i]);
  }

  out.device = writer.device();
  out.entry_args = with_owner(owner, padded_args ? py::tuple(*padded_args) : args);
  out.entry_kwargs = padded_kwargs ? *padded_kwargs : kwargs;
  return out;
}

std::vector<NamedArgument> canonical_arguments(const py::tuple& args, const py::dict& kwargs,
                                               const std::vector<std::string>* parameter_names, size_t* unnamed) {
  const Py_ssize_t n = PyTuple_GET_SIZE(args.ptr());
  const Py_ssize_t named_positional =
      parameter_names ? std::min<Py_ssize_t>(n, static_cast<Py_ssize_t>(parameter_names->size())) : 0;
  std::vector<NamedArgument> out;
  out.reserve(static_cast<size_t>(n + PyDict_Size(kwargs.ptr())));
  for (Py_ssize_t i = named_positional; i < n; ++i) out.push_back(NamedArgument{{}, PyTuple_GET_ITEM(args.ptr(), i), i, nullptr});
  *unnamed = out.size();
  for (Py_ssize_t i = 0; i < named_positional; ++i) {
    out.push_back(NamedArgument{(*parameter_names)[i], PyTuple_GET_ITEM(args.ptr(), i), i, nullptr});
  }
  Py_ssize_t position = 0;
  PyObject* keyword = nullptr;
  PyObject* value = nullptr;
  while (PyDict_Next(kwargs.ptr(), &position, &keyword, &value)) {
    out.push_back(NamedArgument{utf8_of(keyword), value, -1, keyword});
  }
  std::sort(out.begin() + static_cast<std::ptrdiff_t>(*unnamed), out.end(),
            [](const NamedArgument& a, const NamedArgument& b) { return a.name < b.name; });
  return out;
}

namespace {

// The walk of for_each_tensor: the tensors' Python objects
// (borrowed), in order.
void collect_tensors(PyObject* value, std::vector<PyObject*>& out) {
  if (THPVariable_Check(value)) {
    out.push_back(value);
  } else if (PyTuple_Check(value)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(value); ++i) collect_tensors(PyTuple_GET_ITEM(value, i), out);
  } else if (PyList_Check(value)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); ++i) collect_tensors(PyList_GET_ITEM(value, i), out);
  } else if (PyDict_Check(value)) {
    Py_ssize_t position = 0;
    PyObject* key = nullptr;
    PyObject* item = nullptr;
    while (PyDict_Next(value, &position, &key, &item)) collect_tensors(item, out);
  }
}

}  // namespace

void for_each_tensor(PyObject* value, const std::function<void(const at::Tensor&)>& visit) {
  std::vector<PyObject*> tensors;
  collect_tensors(value, tensors);
  for (PyObject* tensor : tensors) visit(THPVariable_Unpack(tensor));
}

py::object map_tensors(const py::object& value, const std::function<at::Tensor(const at::Tensor&)>& map) {
  PyObject* obj = value.ptr();
  if (THPVariable_Check(obj)) return py::reinterpret_steal<py::object>(THPVariable_Wrap(map(THPVariable_Unpack(obj))));
  if (obj == Py_None || PyBool_Check(obj) || PyLong_Check(obj) || PyFloat_Check(obj) || PyUnicode_Check(obj)) {
    return value;
  }
  if (PyTuple_Check(obj) || PyList_Check(obj)) {
    py::list items;
    for (py::handle item : value) items.append(map_tensors(py::reinterpret_borrow<py::object>(item), map));
    if (PyList_CheckExact(obj)) return std::move(items);
    if (PyTuple_CheckExact(obj)) return py::tuple(items);
    if (py::hasattr(value, "_make")) return value.attr("_make")(items);  // a namedtuple
  } else if (PyDict_Check(obj)) {
    py::dict items;
    for (auto [name, item] : py::reinterpret_borrow<py::dict>(value)) {
      items[name] = map_tensors(py::reinterpret_borrow<py::object>(item), map);
    }
    if (PyDict_CheckExact(obj)) return std::move(items);
    return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(obj)))(**items);
  }
  throw py::type_error(std::string("shapecache cannot walk an output of type ") + Py_TYPE(obj)->tp_name +
                       " (padded buckets and CUDA graphs need outputs that are tensors, or tuples, lists and dicts "
                       "of them)");
}

namespace {
struct OutputsDoNotMatch {};
}  // namespace

std::optional<py::object> crop_outputs(const py::object& outputs, const std::vector<std::vector<int64_t>>& shapes) {
  size_t next = 0;
  auto crop = [&](const at::Tensor& t) {
    if (next == shapes.size()) throw OutputsDoNotMatch{};
    const std::vector<int64_t>& shape = shapes[next++];
    if (static_cast<size_t>(t.dim()) != shape.size()) throw OutputsDoNotMatch{};
    at::Tensor out = t;
    for (size_t d = 0; d < shape.size(); ++d) {
      const int64_t size = t.size(static_cast<int64_t>(d));
      if (shape[d] > size) throw OutputsDoNotMatch{};
      if (shape[d] < size) out = out.narrow(static_cast<int64_t>(d), 0, shape[d]);
    }
    return out;
  };
  try {
    py::object cropped = map_tensors(outputs, crop);
    if (next != shapes.size()) return std::nullopt;
    return cropped;
  } catch (const OutputsDoNotMatch&) {
    return std::nullopt;
  }
}

namespace {

// torch's own name of a dtype ("float32", not ATen's "Float").
std::string dtype_name(int64_t scalar_type) {
  return torch::getTHPDtype(static_cast<c10::ScalarType>(scalar_type))->name;
}

class KeyReader {
 public:
  explicit KeyReader(const std::vector<uint64_t>& words) : words_(words) {}

  void item(std::ostringstream& out) {
    const auto tag = static_cast<KeyTag>(next());
    switch (tag) {
      case KeyTag::kTensor: {
        const uint64_t packed = next();
        TensorSignature s;
        std::memcpy(&s, &packed, sizeof(s));
        out << "(";
        for (uint8_t d = 0; d < s.ndim; ++d) out << (d ? ", " : "") << static_cast<int64_t>(next());
        out << (s.ndim == 1 ? ",) " : ") ") << dtype_name(s.dtype) << " "
            << c10::Device(static_cast<c10::DeviceType>(s.device_type), static_cast<c10::DeviceIndex>(s.device_index));
        if (s.layout == static_cast<uint8_t>(MemoryLayout::kChannelsLast)) out << " channels_last";
        if (s.layout == static_cast<uint8_t>(MemoryLayout::kChannelsLast3d)) out << " channels_last_3d";
        if (s.layout == static_cast<uint8_t>(MemoryLayout::kOtherStrides)) {
          out << " strides (";
          for (uint8_t d = 0; d < s.ndim; ++d) out << (d ? ", " : "") << static_cast<int64_t>(next());
          out << ")";
        }
        if (s.requires_grad) out << " requires_grad";
        if (s.alias) out << " same storage as tensor " << static_cast<int>(s.alias - 1);
        break;
      }
      case KeyTag::kInt:
        out << static_cast<int64_t>(next());
        break;
      case KeyTag::kFloat: {
        const uint64_t bits = next();
        double value = 0;
        std::memcpy(&value, &bits, sizeof(value));
        out << value;
        break;
      }
      case KeyTag::kBool:
        out << (next() ? "True" : "False");
        break;
      case KeyTag::kNone:
        out << "None";
        break;
      case KeyTag::kString:
        out << "'" << string() << "'";
        break;
      case KeyTag::kDtype:
        out << "torch." << dtype_name(static_cast<int64_t>(next()));
        break;
      case KeyTag::kDevice: {
        const auto type = static_cast<c10::DeviceType>(next());
        const auto index = static_cast<c10::DeviceIndex>(static_cast<int64_t>(next()));
        out << "device('" << c10::Device(type, index) << "')";
        break;
      }
      case KeyTag::kTuple:
      case KeyTag::kList:
      case KeyTag::kDict: {
        const char* open = tag == KeyTag::kTuple ? "(" : tag == KeyTag::kList ? "[" : "{";
        const char* close = tag == KeyTag::kTuple ? ")" : tag == KeyTag::kList ? "]" : "}";
        const uint64_t n = next();
        out << open;
        for (uint64_t i = 0; i < n; ++i) {
          if (i) out << ", ";
          item(out);
        }
        out << close;
        break;
      }
      case KeyTag::kKeyword:
        next();  // the name's kString tag
        out << string() << "=";
        item(out);
        break;
      default:
        out << "?";
        break;
    }
  }

  // The call's arguments: a tuple of positional ones, then a dict of keywords, printed flat.
  std::string call() {
    std::ostringstream out;
    if (words_.size() < 3 || static_cast<KeyTag>(words_[0]) != KeyTag::kContext) return "?";
    position_ = 3;
    bool first = true;
    for (int part = 0; part < 2 && position_ < words_.size(); ++part) {
      next();  // kTuple / kDict
      const uint64_t n = next();
      for (uint64_t i = 0; i < n; ++i) {
        out << (first ? "" : ", ");
        first = false;
        item(out);
      }
    }
    return out.str();
  }

 private:
  uint64_t next() { return position_ < words_.size() ? words_[position_++] : 0; }

  std::string string() {
    const uint64_t length = next();
    std::string text(length, '\0');
    for (uint64_t offset = 0; offset < length; offset += sizeof(uint64_t)) {
      const uint64_t chunk = next();
      std::memcpy(text.data() + offset, &chunk, std::min<uint64_t>(sizeof(uint64_t), length - offset));
    }
    return text;
  }

  const std::vector<uint64_t>& words_;
  size_t position_ = 0;
};

}  // namespace

std::string describe_key(const ShapeKey& key) { return KeyReader(key.words()).call(); }

}  // namespace shapecache
