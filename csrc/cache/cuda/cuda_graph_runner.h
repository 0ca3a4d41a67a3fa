// CudaGraphRunner: one shape bucket captured as a CUDA graph and replayed from C++.
//
// Policy (DeviceGraphs, one per device):
//   - Every graph of a device is captured into one private memory pool, on one stream, and
//     replayed on that stream under one lock, so graphs never run at the same time: the
//     temporaries of each reuse the same memory, and the pool is as large as the largest
//     graph needs, not the sum of all of them.
//   - Capture the largest bucket first. Blocks a large graph freed serve every smaller one,
//     but a larger graph captured after smaller ones needs blocks the pool does not have: the
//     pool grows by the difference and its old blocks no longer fit anything. Largest first,
//     the pool reaches its final size with the first capture.
//   - Inputs are copied into a graph's static inputs and outputs copied out of its static
//     outputs, so a caller's results stay valid after later replays of any graph in the pool.
//     That also makes any replay order safe, though a graph captured later may have placed
//     its temporaries, or its static outputs, in blocks an earlier graph used for its own
//     temporaries: a replay writes those blocks, but every graph reads its static outputs
//     right after its own replay, under the lock, before any other graph runs.
//   - Static inputs are allocated outside the pool, on the graphs' stream, and used only
//     there: freeing them (an eviction) is ordered after the last replay that read them.
//   - A graph is stale when the weights it captured were replaced or the workspace arena its
//     kernels took during capture moved: it is then rebuilt, never replayed. A graph without
//     tuned convolutions never took the arena and stays valid when it grows.
//   - The pool is a sequence of generations (csrc/core/pool_generations.h, which states
//     torch's allocator rules it keeps): captures go into the current one; once none of its
//     graphs is left it retires and the next capture opens a fresh graph_pool_handle(). A
//     failed capture is cleaned up on the device and the host allocator there.
#pragma once

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cache/call_modes.h"
#include "cache/entry_runner.h"
#include "cache/state_guard.h"
#include "core/destroy_after_capture.h"
#include "core/pool_generations.h"

namespace shapecache {

namespace py = pybind11;

class PoolGraph;

struct DeviceGraphs {
  static DeviceGraphs& of(c10::DeviceIndex device);

  // Bytes the allocator holds now in the pools of this device's generations in use (what the
  // graphs hold: the figure charged to the budget), or with in_use=false, of the others: a
  // generation no graph uses holds its blocks until the allocator's cache is emptied
  // (release_device_memory empties it after every rebuild and eviction).
  int64_t pool_bytes(bool in_use = true);  // takes the device's lock

  const c10::DeviceIndex device;
  PoolGenerations generations;   // guarded by `mutex`
  // Every capture and every replay of the device runs on stream(); no work runs on
  // idle_stream(), which is what a destroyed graph names as its capture stream. Both are
  // shapecache's own, made on first use: a stream makes the device's CUDA context (about
  // 0.3-0.5 GiB), and the lock alone (every_device_lock takes every device's) must make none,
  // nor fail where a GPU in EXCLUSIVE_PROCESS mode belongs to another process.
  c10::cuda::CUDAStream stream();
  c10::cuda::CUDAStream idle_stream();
  // One capture or replay at a time; guards the events and `generations` too. Recursive: the
  // function being captured may call another cached function of the device (which then fails
  // to replay inside a capture with an error, instead of waiting forever on this lock). Taken
  // with the GIL released while waiting (lock_device in the .cpp).
  std::recursive_mutex mutex;
  // Every graph, of any device, is destroyed through this: one let go of on a thread while it
  // captures (the garbage collector inside the captured function) is destroyed when that
  // capture ends (core/destroy_after_capture.h has why). Process-wide: the capture mode a
  // destruction could break is the thread's, whichever device the graph is on.
  static DestroyAfterCapture<PoolGraph>& graphs_to_destroy();
  at::cuda::CUDAEvent caller_done;  // orders the graphs' stream after a caller's work
  at::cuda::CUDAEvent graphs_done;  // orders a caller's later work after the graphs' stream

  // The cuBLAS / cuBLASLt workspace every captured GEMM of the device writes into (its address
  // is baked into the graph). torch keeps one per (cuBLAS handle, stream) in process-wide maps
  // and frees them whenever anything calls torch._C._cuda_clearCublasWorkspaces() (inductor's
  // CUDA graph trees do, around each recording), and 2.13's CUDAGraph::reset() frees its
  // capture stream's: a graph replaying into torch's would write into freed memory. So the
  // device owns one buffer, never freed, and before each capture puts it into torch's maps for
  // (this thread's handle, `stream`) as a non-owning pointer: a clear erases the alias, never
  // the buffer. Every capture and replay runs on `stream`, in order, so one buffer serves all.
  // Under `mutex`, on `stream`, outside any capture. Returns the keys it installed.
  std::pair<std::tuple<void*, void*>, std::tuple<void*, void*>> install_blas_workspace();
  // Whether torch's maps still point at the device's buffer for those keys (a clear or resize
  // by another thread during a capture replaces the alias, and that capture may have baked
  // torch's buffer).
  bool blas_workspace_installed(const std::pair<std::tuple<void*, void*>, std::tuple<void*, void*>>& keys);

 private:
  std::once_flag streams_made_;
  std::optional<c10::cuda::CUDAStream> stream_, idle_stream_;
  std::vector<at::DataPtr> blas_workspaces_;  // never freed: torch's maps may still alias an older one
  size_t blas_workspace_bytes_ = 0;

  explicit DeviceGraphs(c10::DeviceIndex index);
};

// at::cuda::CUDAGraph that tells its device's pool generations when it is gone. Its
// destructor, under the device's lock, releases the pool through reset() first (torch does so
// only for a capture that ended: a failed one was cleaned up by PoolGenerations::capture, and
// is not counted).
class PoolGraph final : public at::cuda::CUDAGraph {
 public:
  explicit PoolGraph(DeviceGraphs& graphs) : graphs_(graphs) {}
  ~PoolGraph();  // CUDAGraph's destructor is not virtual: a PoolGraph is only ever owned as one
  bool ended() const { return capture_ended_; }
  // After a failed capture: takes the generators it registered out of capture mode, as
  // capture_epilogue would have (pool_generations.h, A9; torch 2.11 and 2.12 only).
  void end_generator_capture();
  // CUDAGraph::reset(), leaving the cuBLAS workspaces of the device's capture stream alone.
  void reset_keeping_workspaces();

 private:
  DeviceGraphs& graphs_;
};

class CudaGraphRunner final : public EntryRunner {
 public:
  // Captures function(owner, *args, **kwargs) (without owner when it is None) on static copies
  // of the tensors in `args` and `kwargs`; `tensors` are those tensors in key order
  // (BuildHandle.tensors), as every replay is given them (Call::tensors). The caller has warmed the function up already:
  // nothing may be tuned, compiled or lazily initialised inside capture.
  static std::shared_ptr<CudaGraphRunner> capture(const py::object& function, const py::object& owner,
                                                  const py::tuple& args, const py::dict& kwargs,
                                                  const py::tuple& tensors, std::shared_ptr<StateGuard> guard);

  ~CudaGraphRunner() override;  // the graph goes through DeviceGraphs::graphs_to_destroy()

  py::object run(const Call& call) override;
  bool valid() override;
  std::string changed() const override { return guard_ ? guard_->changed() : std::string(); }
  const std::shared_ptr<StateGuard>& guard() const override { return guard_; }

  // Drops the graph and its outputs: every block it held in the pool goes back to the pool,
  // and when no graph of the pool is left, emptying the allocator's cache frees the pool.
  // The static inputs stay (they are outside the pool), so the bucket can be recaptured.
  // Until it is, valid() is false.
  void release();
  // Captures the bucket again, on the same static inputs, into the device's pool (which
  // has emptied meanwhile: see python/shapecache/_backends/graph_pool.py, which rebuilds largest first).
  void recapture();
  bool captured() const { return graph_ != nullptr; }

  int64_t static_input_bytes() const;
  c10::DeviceIndex device() const { return device_->device; }

 private:
  CudaGraphRunner() = default;
  void capture_graph(const py::object& owner);

  std::unique_ptr<PoolGraph> graph_;          // null while released
  DeviceGraphs* device_ = nullptr;
  py::object function_;                       // what is captured
  py::object owner_;                          // weak reference to the module (None for functions)
  py::tuple static_args_;                     // the call, with static tensors in place of the caller's
  py::dict static_kwargs_;
  std::vector<at::Tensor> static_inputs_;     // one per tensor of a call, in canonical order
  std::vector<at::Tensor> static_outputs_;    // every tensor of the outputs, in walk order
  py::object output_structure_;               // the outputs as captured (static tensors inside)
  std::shared_ptr<StateGuard> guard_;  // what the graph was captured from (state_guard.h)
  uint64_t workspace_generation_ = 0;         // the arena's generation when captured
  bool uses_workspace_ = false;               // whether the captured kernels took the arena's buffer
  // The modes of the call that built the entry, which its key records: a recapture (a pool
  // rebuild another call triggered) runs under these, not under that other call's.
  CallModes modes_;
};

void bind_cuda_graphs(py::module_& m);

}  // namespace shapecache
