// StateGuard: what a compiled entry was built from, checked in C++ before each of its calls.
//
// A compiled entry bakes in more than its key: the tensors its graph reads (with freezing,
// copies of them) and the Python state the traced code read: module attributes (FreeU's
// factors), each submodule's training flag, attention processors and their scales, hooks.
// The Python side (shapecache/_backends/guards.py) says what to record when the entry is
// built; this class records it and checks it:
//   - dicts (a module's __dict__, its _parameters, _buffers, _modules and hook dicts, the
//     __dict__ of plain objects hanging from it, a function's globals): their items (all,
//     or the names the code reads) and their version;
//   - tensors: the Python object's TensorImpl, its storage, offset and version counter, so
//     that `.data =`, `.to()`, swap_tensors and in-place updates are all seen;
//   - closure cells: what they hold;
//   - objects' classes: `obj.__class__ = Other` (token-merging libraries swap a block's class)
//     and, through add_class, a class's own dict (a method patched on the class);
//   - lists (peft's merged adapters, a processor's scales): their items, compared on every
//     check, since a list keeps no version;
//   - other containers that keep no version (a set of active layers, a small numpy array of
//     per-block gains): a snapshot of each, made by a Python function and compared on every
//     check.
//
// check() costs one version read per dict and a few pointer reads per tensor while nothing
// moved. A dict whose version moved has its items compared again, by identity, and by value
// for numbers, strings and tuples of those: writing the same value again costs one
// comparison and no rebuild (the dict's recorded version then moves on).
//
// Dict versions: CPython 3.11 bumps a version tag in a dict on every change (ma_version_tag).
// From 3.12 that tag is deprecated; as torch's own guards do (torch/csrc/dynamo/guards.cpp),
// each guarded dict is watched by a dict watcher that gives it a new version on each change.
//
// CPython 3.13.0 sends no watcher event for `obj.name = value` where obj's __dict__ still
// shares the object's inline values: there, such a dict's items are compared on every check
// (probe_dict_watchers finds out at import whether this interpreter sends it).
//
// The Python side does not add items to a guard: it fills a record (guards.GuardRecord), one
// list of items per kind, which a StateGuard is made from in one call, with one crossing of
// the seam (by the cache, when it reads a builder's BuiltEntry; built_entry.h).
//
// Threading: every method runs with the GIL held (the GIL is the cache's lock, shape_cache.h).
#pragma once

#include <pybind11/pybind11.h>

#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shapecache {

namespace py = pybind11;

class StateGuard {
 public:
  StateGuard() = default;
  // A guard over a whole record (guards.GuardRecord): its lists `dicts` of (dict, path, keys or
  // None), `tensors` of (tensor, path, the version it was read at or None), `cells`, `lists`,
  // `types` and `class_dicts` of (object, path), `snapshots` of (object, path, snapshot_of),
  // each item added by the add_ method of its kind. An object of another kind than its list's
  // is a TypeError naming its path.
  explicit StateGuard(const py::handle& record);

  // Finds out whether this interpreter's dict watchers see attribute stores (see above). Once,
  // at import, before any guard is made: it runs Python code, which may switch threads.
  static void probe_dict_watchers();

  // Each kind of item (what a guards.GuardRecord's lists hold):
  // Guards `dict`'s items: every item when `keys` is None (an added or removed key counts as
  // a change), else the items of those keys (a key absent now must stay absent).
  void add_dict(const py::dict& dict, std::string path, const py::object& keys);
  // Guards a tensor the entry reads. `check_version`: in-place updates count as changes (off
  // for buffers the graph itself writes, and for inference tensors, which keep no version).
  void add_tensor(const py::object& tensor, std::string path, bool check_version);
  // Guards what a closure cell holds.
  void add_cell(const py::object& cell, std::string path);
  // Guards a list's items (compared on every check: a list keeps no version).
  void add_list(const py::list& list, std::string path);
  // Guards which class `obj` is an instance of.
  void add_type(const py::object& obj, std::string path);
  // Guards a class's own attributes (its dict), as add_dict guards an object's.
  void add_class(const py::type& cls, std::string path);
  // Guards what `snapshot_of(obj)` returns, compared (==) with its value now on every check.
  void add_snapshot(const py::object& obj, const py::object& snapshot_of, std::string path);

  // True while everything is as recorded. Once false, always false.
  bool check();
  // After check() returned false: what changed, named by its path.
  const std::string& changed() const { return changed_; }

  // Visits every Python object the guard holds a reference to, once per reference (for the
  // garbage collector: a guard holding a cached module's dict closes a cycle through the
  // cache, which only the dispatcher's tp_traverse makes visible).
  int traverse(visitproc visit, void* arg) const;

 private:
  struct Item {
    py::object key;
    py::object value;  // null when the key was absent
  };
  struct GuardedDict {
    py::object dict;
    uint64_t version;
    bool all_keys;
    std::vector<Item> items;
    std::string path;
  };
  struct GuardedTensor {
    py::object tensor;
    const c10::TensorImpl* impl;
    const c10::StorageImpl* storage;
    const void* data;
    int64_t offset;
    int64_t version;  // -1: not checked
    bool requires_grad;  // what autograd records of it: a graph traced without it computes no gradient
    // Checked where the version is not: a change of them in place (.t_(), as_strided_) moves
    // the version counter, and is seen by it where it is checked. Empty for a tensor that has
    // no strides (sparse, nested): not checked.
    std::vector<int64_t> sizes, strides;
    std::string path;
  };
  struct GuardedList {
    py::object list;
    std::vector<py::object> items;
    std::string path;
  };
  struct GuardedType {
    py::object object;
    py::object type;
    std::string path;
  };
  struct GuardedSnapshot {
    py::object object;
    py::object snapshot_of;
    py::object snapshot;
    std::string path;
  };
  struct GuardedCell {
    py::object cell;
    py::object content;  // null when the cell was empty
    std::string path;
  };

  // Compares a dict's items with the record; names the first that differs.
  bool same_items(GuardedDict& guarded);
  bool tensor_unchanged(const GuardedTensor& guarded);
  bool fail(std::string what);

  std::vector<GuardedDict> dicts_;
  std::vector<GuardedTensor> tensors_;
  std::vector<GuardedCell> cells_;
  std::vector<GuardedList> lists_;
  std::vector<GuardedType> types_;
  std::vector<GuardedSnapshot> snapshots_;
  bool stale_ = false;
  std::string changed_;
};

}  // namespace shapecache
