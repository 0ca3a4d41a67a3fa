// What runs on this thread, for the cached calls on it: how deep inside cached calls it is,
// the background builds those calls queued (ready only once the outermost cached call has
// returned), and whether a build or a trace is on its stack (then cached calls are
// transparent). Thread-local; touched with the GIL held only.
#pragma once

#include <pybind11/pybind11.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

#include "core/shape_key.h"

namespace shapecache {

namespace py = pybind11;

// Held for the length of every cached call. When the outermost cached call of the thread
// ends (returning or raising: the calls that queued builds succeeded either way), the builds
// queued inside it become ready and their workers are woken.
class CachedCallScope {
 public:
  CachedCallScope();
  ~CachedCallScope();
  CachedCallScope(const CachedCallScope&) = delete;
  CachedCallScope& operator=(const CachedCallScope&) = delete;
};

// A build queued by a call on this thread: ready once the outermost cached call returns.
// `wake(device)` is the worker's waker (None: no worker to wake).
void make_ready_when_outermost_returns(uint64_t function_id, const c10::Device& device, const ShapeKey& key,
                                       py::object wake);

// Set while a builder or a crop plan's fake-tensor run is on this thread's stack: cached
// functions they reach (a cached submodule, recursion) are transparent. They call the
// original and build nothing, so no entry is built from the fake tensors of a trace, and a
// captured or traced call is one graph, not graphs inside a graph.
class InsideBuild {
 public:
  InsideBuild();
  ~InsideBuild();
  InsideBuild(const InsideBuild&) = delete;
  InsideBuild& operator=(const InsideBuild&) = delete;

 private:
  bool outer_;
};

// Set while this thread runs a background build: no caller is there to see a warning raised
// as an error.
class InBackgroundBuild {
 public:
  InBackgroundBuild();
  ~InBackgroundBuild();
  InBackgroundBuild(const InBackgroundBuild&) = delete;
  InBackgroundBuild& operator=(const InBackgroundBuild&) = delete;
};
bool in_background_build();

// While one is open on a thread, the entries its cached calls served there: hits (`used`) and
// entries built inline by a call (`built`), by entry id, each once per record. What a server
// reads to know which entries a request used, instead of comparing every entry's figures
// before and after it. Records open inside one another (a request served inside a warm-up)
// each see what was served while they were open; each is closed on the thread that opened it.
class EntriesServed {
 public:
  void open();
  void close();
  std::vector<uint64_t> used;
  std::vector<uint64_t> built;

 private:
  friend void note_entry_served(uint64_t id, bool built);
  EntriesServed* outer_ = nullptr;
  bool open_ = false;
};
// Notes entry `id` served (built: it was built inline for the call) in the record open on this
// thread, if any: one thread-local read otherwise.
void note_entry_served(uint64_t id, bool built);

// Whether a call here is part of a trace: inside a build, or under a dispatch mode (the fake
// and functional modes of torch.export and AOT autograd, a proxy mode, a debug mode), where
// tensors are not what an entry could run on.
bool transparent_here();

}  // namespace shapecache
