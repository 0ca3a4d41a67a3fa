#include "cache/state_guard.h"

#include <torch/csrc/autograd/python_variable.h>

#include <pybind11/eval.h>

#include <unordered_map>

namespace shapecache {
namespace {

#if PY_VERSION_HEX < 0x030C0000

void watch(PyObject*) {}
uint64_t version_of(PyObject* dict) { return reinterpret_cast<PyDictObject*>(dict)->ma_version_tag; }

#else

// Versions of the watched dicts, bumped by the watcher on every change. Never destroyed: the
// watcher may fire while the interpreter shuts down.
std::unordered_map<PyObject*, uint64_t>& versions() {
  static auto* map = new std::unordered_map<PyObject*, uint64_t>();
  return *map;
}
uint64_t next_version = 1;
int watcher_id = -1;

int on_dict_event(PyDict_WatchEvent event, PyObject* dict, PyObject*, PyObject*) noexcept {
  if (event == PyDict_EVENT_DEALLOCATED) {
    versions().erase(dict);
  } else {  // CLONED too: an empty dict filled from another is a change
    versions()[dict] = next_version++;
  }
  return 0;
}

void watch(PyObject* dict) {
  if (watcher_id < 0) {
    watcher_id = PyDict_AddWatcher(on_dict_event);
    if (watcher_id < 0) throw py::error_already_set();
  }
  if (PyDict_Watch(watcher_id, dict) < 0) throw py::error_already_set();
  if (versions().try_emplace(dict, next_version).second) ++next_version;
}

uint64_t version_of(PyObject* dict) {
  auto found = versions().find(dict);
  return found == versions().end() ? 0 : found->second;
}

#endif

// Whether this interpreter tells a dict's watchers of `obj.name = value` where obj's
// materialized __dict__ still shares the object's inline values (a dict with ma_values).
// CPython 3.13.0 does not: the store goes to the values and no event is sent (seen with
// _testcapi's dict watcher: `o.x = 2` gives none, `o.__dict__["x"] = 2` gives one), so a
// version that did not move proves nothing for such a dict. Probed once, at import
// (probe_dict_watchers); 3.11's version tag and 3.12's watchers see every store.
#if PY_VERSION_HEX >= 0x030D0000
bool attribute_stores_watched = true;
#endif

bool version_proves_unchanged(PyObject* dict) {
#if PY_VERSION_HEX >= 0x030D0000
  return attribute_stores_watched || reinterpret_cast<PyDictObject*>(dict)->ma_values == nullptr;
#else
  (void)dict;
  return true;
#endif
}

// Numbers, strings and tuples of those compare by value: a new 2.0 written over 2.0 is no
// change. Anything else by identity (a processor, a tensor, a function).
bool same_value(PyObject* a, PyObject* b, int depth = 0) {
  if (a == b) return true;
  if (a == nullptr || b == nullptr || Py_TYPE(a) != Py_TYPE(b) || depth > 4) return false;
  if (PyFloat_CheckExact(a) || PyLong_CheckExact(a) || PyUnicode_CheckExact(a) || PyBytes_CheckExact(a)) {
    const int equal = PyObject_RichCompareBool(a, b, Py_EQ);
    if (equal < 0) PyErr_Clear();
    return equal == 1;
  }
  if (PyTuple_CheckExact(a)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(a);
    if (n != PyTuple_GET_SIZE(b)) return false;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!same_value(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i), depth + 1)) return false;
    }
    return true;
  }
  return false;
}

std::string key_text(const py::object& key) {
  if (PyUnicode_Check(key.ptr())) return std::string(py::str(key));
  return std::string(py::repr(key));
}

}  // namespace

void StateGuard::probe_dict_watchers() {
#if PY_VERSION_HEX >= 0x030D0000
  try {
    py::dict scope;
    scope["__builtins__"] = py::module_::import("builtins");
    py::exec("class Probe:\n    pass\nprobe = Probe()\nprobe.x = 1\n", scope);
    py::object probe = scope["probe"];
    PyObject* dict = probe.attr("__dict__").ptr();  // materialized; the object keeps it alive
    watch(dict);
    const uint64_t before = version_of(dict);
    probe.attr("x") = 2;
    attribute_stores_watched = version_of(dict) != before;
  } catch (const py::error_already_set&) {  // (no watcher left, say): trust no version of such a dict
    attribute_stores_watched = false;
  }
#endif
}

namespace {

// The items of one kind of a record: a list of tuples of `size` fields.
std::vector<py::tuple> items_of(const py::handle& record, const char* kind, size_t size) {
  py::object items = record.attr(kind);
  if (!PyList_Check(items.ptr())) throw py::type_error(std::string("StateGuard(record): record.") + kind + " is not a list");
  std::vector<py::tuple> out;
  for (py::handle item : items) {
    if (!PyTuple_Check(item.ptr()) || static_cast<size_t>(PyTuple_GET_SIZE(item.ptr())) != size) {
      throw py::type_error(std::string("StateGuard(record): each item of record.") + kind + " is a tuple of " +
                           std::to_string(size) + ", got " + std::string(py::repr(item)));
    }
    out.push_back(py::reinterpret_borrow<py::tuple>(item));
  }
  return out;
}

// An item's object is of its list's kind, or a TypeError naming its path. A dict or list is
// guarded as the object itself, never converted: a copy would never change.
void check_kind(bool is_kind, const py::handle& object, const std::string& path, const char* kind) {
  if (!is_kind) throw py::type_error("StateGuard(record): " + path + " is a " + Py_TYPE(object.ptr())->tp_name + ", not a " + kind);
}

}  // namespace

StateGuard::StateGuard(const py::handle& record) {
  for (const py::tuple& item : items_of(record, "dicts", 3)) {
    std::string path = item[1].cast<std::string>();
    check_kind(PyDict_Check(item[0].ptr()), item[0], path, "dict");
    add_dict(py::reinterpret_borrow<py::dict>(item[0]), std::move(path), item[2]);
  }
  for (const py::tuple& item : items_of(record, "tensors", 3)) {
    std::string path = item[1].cast<std::string>();
    check_kind(THPVariable_Check(item[0].ptr()), item[0], path, "tensor");
    add_tensor(item[0], std::move(path), true);
    // The version the record read: an update in place since then makes the guard stale.
    if (!item[2].is_none() && tensors_.back().version >= 0) tensors_.back().version = item[2].cast<int64_t>();
  }
  for (const py::tuple& item : items_of(record, "cells", 2)) {
    std::string path = item[1].cast<std::string>();
    check_kind(PyCell_Check(item[0].ptr()), item[0], path, "closure cell");
    add_cell(item[0], std::move(path));
  }
  for (const py::tuple& item : items_of(record, "lists", 2)) {
    std::string path = item[1].cast<std::string>();
    check_kind(PyList_Check(item[0].ptr()), item[0], path, "list");
    add_list(py::reinterpret_borrow<py::list>(item[0]), std::move(path));
  }
  for (const py::tuple& item : items_of(record, "types", 2)) add_type(item[0], item[1].cast<std::string>());
  for (const py::tuple& item : items_of(record, "class_dicts", 2)) {
    std::string path = item[1].cast<std::string>();
    check_kind(PyType_Check(item[0].ptr()), item[0], path, "class");
    add_class(py::reinterpret_borrow<py::type>(item[0]), std::move(path));
  }
  for (const py::tuple& item : items_of(record, "snapshots", 3)) {
    std::string path = item[1].cast<std::string>();
    check_kind(PyCallable_Check(item[2].ptr()), item[2], path + "'s snapshot function", "callable");
    add_snapshot(item[0], item[2], std::move(path));
  }
}

void StateGuard::add_dict(const py::dict& dict, std::string path, const py::object& keys) {
  watch(dict.ptr());
  GuardedDict guarded{dict, version_of(dict.ptr()), keys.is_none(), {}, std::move(path)};
  if (guarded.all_keys) {
    for (auto [key, value] : dict) {
      guarded.items.push_back({py::reinterpret_borrow<py::object>(key), py::reinterpret_borrow<py::object>(value)});
    }
  } else {
    for (py::handle key : keys) {
      PyObject* value = PyDict_GetItemWithError(dict.ptr(), key.ptr());
      if (value == nullptr && PyErr_Occurred()) throw py::error_already_set();
      guarded.items.push_back({py::reinterpret_borrow<py::object>(key), py::reinterpret_borrow<py::object>(value)});
    }
  }
  dicts_.push_back(std::move(guarded));
}

void StateGuard::add_tensor(const py::object& tensor, std::string path, bool check_version) {
  if (!THPVariable_Check(tensor.ptr())) throw py::type_error("StateGuard.add_tensor: " + path + " is not a tensor");
  const at::Tensor& t = THPVariable_Unpack(tensor.ptr());
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const bool has_storage = impl->has_storage();
  const bool strided = t.layout() == c10::kStrided && !t.is_nested();  // (others have no strides to read)
  GuardedTensor guarded{tensor,
                        impl,
                        has_storage ? impl->unsafe_storage().unsafeGetStorageImpl() : nullptr,
                        has_storage ? impl->unsafe_storage().data() : nullptr,
                        has_storage ? impl->storage_offset() : 0,
                        check_version && !t.is_inference() ? static_cast<int64_t>(t._version()) : -1,
                        t.requires_grad(),
                        strided ? t.sizes().vec() : std::vector<int64_t>(),
                        strided ? t.strides().vec() : std::vector<int64_t>(),
                        std::move(path)};
  tensors_.push_back(std::move(guarded));
}

void StateGuard::add_cell(const py::object& cell, std::string path) {
  if (!PyCell_Check(cell.ptr())) throw py::type_error("StateGuard.add_cell: " + path + " is not a closure cell");
  cells_.push_back({cell, py::reinterpret_borrow<py::object>(PyCell_GET(cell.ptr())), std::move(path)});
}

void StateGuard::add_list(const py::list& list, std::string path) {
  GuardedList guarded{list, {}, std::move(path)};
  for (py::handle item : list) guarded.items.push_back(py::reinterpret_borrow<py::object>(item));
  lists_.push_back(std::move(guarded));
}

int StateGuard::traverse(visitproc visit, void* arg) const {
  for (const GuardedDict& guarded : dicts_) {
    Py_VISIT(guarded.dict.ptr());
    for (const Item& item : guarded.items) {
      Py_VISIT(item.key.ptr());
      Py_VISIT(item.value.ptr());  // Py_VISIT skips null (an absent key)
    }
  }
  for (const GuardedTensor& guarded : tensors_) Py_VISIT(guarded.tensor.ptr());
  for (const GuardedList& guarded : lists_) {
    Py_VISIT(guarded.list.ptr());
    for (const py::object& item : guarded.items) Py_VISIT(item.ptr());
  }
  for (const GuardedCell& guarded : cells_) {
    Py_VISIT(guarded.cell.ptr());
    Py_VISIT(guarded.content.ptr());
  }
  for (const GuardedType& guarded : types_) {
    Py_VISIT(guarded.object.ptr());
    Py_VISIT(guarded.type.ptr());
  }
  for (const GuardedSnapshot& guarded : snapshots_) {
    Py_VISIT(guarded.object.ptr());
    Py_VISIT(guarded.snapshot_of.ptr());
    Py_VISIT(guarded.snapshot.ptr());
  }
  return 0;
}

void StateGuard::add_type(const py::object& obj, std::string path) {
  types_.push_back({obj, py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()))),
                    std::move(path)});
}

void StateGuard::add_class(const py::type& cls, std::string path) {
#if PY_VERSION_HEX >= 0x030C0000
  // From 3.12 on, a static builtin type (str, int) keeps its dict in the interpreter's state,
  // not in tp_dict, which is NULL: PyType_GetDict reads both kinds.
  py::object dict = py::reinterpret_steal<py::object>(PyType_GetDict(reinterpret_cast<PyTypeObject*>(cls.ptr())));
#else
  py::object dict = py::reinterpret_borrow<py::object>(reinterpret_cast<PyTypeObject*>(cls.ptr())->tp_dict);
#endif
  if (!dict || !PyDict_Check(dict.ptr())) throw py::type_error("StateGuard.add_class: " + path + " has no dict");
  add_dict(py::reinterpret_borrow<py::dict>(dict), std::move(path), py::none());
}

void StateGuard::add_snapshot(const py::object& obj, const py::object& snapshot_of, std::string path) {
  snapshots_.push_back({obj, snapshot_of, snapshot_of(obj), std::move(path)});
}

bool StateGuard::fail(std::string what) {
  stale_ = true;
  changed_ = std::move(what);
  return false;
}

bool StateGuard::tensor_unchanged(const GuardedTensor& guarded) {
  const at::Tensor& t = THPVariable_Unpack(guarded.tensor.ptr());
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl != guarded.impl) return fail(guarded.path + " was swapped for another tensor");
  if (impl->has_storage()) {
    const c10::Storage& storage = impl->unsafe_storage();
    if (storage.unsafeGetStorageImpl() != guarded.storage || storage.data() != guarded.data ||
        impl->storage_offset() != guarded.offset) {
      return fail(guarded.path + " was given other memory (.data =, .to(), .set_())");
    }
  }
  if (guarded.version >= 0 && static_cast<int64_t>(t._version()) != guarded.version) {
    return fail(guarded.path + " was updated in place");
  }
  if (guarded.version < 0 && !guarded.strides.empty() &&
      (t.sizes() != c10::IntArrayRef(guarded.sizes) || t.strides() != c10::IntArrayRef(guarded.strides))) {
    return fail(guarded.path + " changed its sizes or strides in place");
  }
  if (t.requires_grad() != guarded.requires_grad) {
    return fail(guarded.path + "'s requires_grad was set to " + (t.requires_grad() ? "True" : "False"));
  }
  return true;
}

bool StateGuard::same_items(GuardedDict& guarded) {
  PyObject* dict = guarded.dict.ptr();
  if (guarded.all_keys && PyDict_GET_SIZE(dict) != static_cast<Py_ssize_t>(guarded.items.size())) {
    return fail(guarded.path + " gained or lost an entry");
  }
  for (const Item& item : guarded.items) {
    PyObject* now = PyDict_GetItemWithError(dict, item.key.ptr());
    if (now == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (!same_value(now, item.value.ptr())) return fail(guarded.path + "." + key_text(item.key) + " changed");
  }
  return true;
}

bool StateGuard::check() {
  if (stale_) return false;
  for (GuardedDict& guarded : dicts_) {
    const uint64_t version = version_of(guarded.dict.ptr());
    if (version == guarded.version && version_proves_unchanged(guarded.dict.ptr())) continue;
    if (!same_items(guarded)) return false;
    guarded.version = version;  // the same values were written again
  }
  for (const GuardedTensor& guarded : tensors_) {
    if (!tensor_unchanged(guarded)) return false;
  }
  for (const GuardedType& guarded : types_) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(guarded.object.ptr())) != guarded.type.ptr()) {
      return fail(guarded.path + " changed class");
    }
  }
  for (const GuardedList& guarded : lists_) {
    PyObject* list = guarded.list.ptr();
    bool same = PyList_GET_SIZE(list) == static_cast<Py_ssize_t>(guarded.items.size());
    for (size_t i = 0; same && i < guarded.items.size(); ++i) {
      same = same_value(PyList_GET_ITEM(list, static_cast<Py_ssize_t>(i)), guarded.items[i].ptr());
    }
    if (!same) return fail(guarded.path + " (a list) changed");
  }
  for (const GuardedCell& guarded : cells_) {
    if (!same_value(PyCell_GET(guarded.cell.ptr()), guarded.content.ptr())) {
      return fail(guarded.path + " (a closure variable) changed");
    }
  }
  for (const GuardedSnapshot& guarded : snapshots_) {
    PyObject* now = PyObject_CallOneArg(guarded.snapshot_of.ptr(), guarded.object.ptr());
    const int same = now == nullptr ? -1 : PyObject_RichCompareBool(now, guarded.snapshot.ptr(), Py_EQ);
    Py_XDECREF(now);
    if (same != 1) {
      PyErr_Clear();  // a snapshot that cannot be made or compared counts as a change
      return fail(guarded.path + " changed");
    }
  }
  return true;
}

}  // namespace shapecache
