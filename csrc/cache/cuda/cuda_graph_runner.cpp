#include "cache/cuda/cuda_graph_runner.h"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>
#include <shared_mutex>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>

#include "cache/call_key.h"
#include "ops/workspace_arena.h"

namespace shapecache {
namespace {

// pool_generations.h, A8: from torch 2.14 on, CUDAGraph::reset() cleans up a capture that did
// not end (ends recording, releases the pool); before, the caller must.
constexpr bool kResetReleasesFailedCapture =
    TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14);

// `later` waits, on the GPU, for what `earlier` has queued so far. `event` is one of the
// device's two events; recording it again is safe once `block` has been queued, since a
// wait takes the event's state at the time it is queued.
void order_after(const c10::cuda::CUDAStream& earlier, const c10::cuda::CUDAStream& later, at::cuda::CUDAEvent& event) {
  if (earlier == later) return;
  event.record(earlier);
  event.block(later);
}

// Takes a device's lock with the GIL released while it waits: the thread holding the lock may
// be capturing, which runs Python code and needs the GIL back (taking the lock with the GIL
// held would deadlock the two threads). Called without the GIL (a destructor run from C++),
// it just waits.
std::unique_lock<std::recursive_mutex> lock_device(DeviceGraphs& graphs) {
  std::unique_lock<std::recursive_mutex> lock(graphs.mutex, std::defer_lock);
  if (lock.try_lock()) return lock;
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release released;
    lock.lock();
  } else {
    lock.lock();
  }
  return lock;
}

py::object strong(const py::object& weak_or_none) {
  if (weak_or_none.is_none()) return py::none();
  py::object alive = weak_or_none();  // a weakref.ref, called
  if (alive.is_none()) {
    PyErr_SetString(PyExc_ReferenceError, "cuda_graph: the module this graph was captured from no longer exists");
    throw py::error_already_set();
  }
  return alive;
}

}  // namespace

PoolGraph::~PoolGraph() {
  const bool ended = capture_ended_;
  try {  // a destructor: nothing may escape (DestroyAfterCapture destroys graphs in noexcept code)
    auto lock = lock_device(graphs_);  // no capture or replay of the device meanwhile
    try {
      // Releases the pool when the capture ended (the base's destructor then does nothing). A
      // capture that did not end keeps its own stream: newer torch's reset() ends it there.
      if (ended) {
        reset_keeping_workspaces();
      } else {
        reset();
      }
    } catch (const std::exception& e) {
      TORCH_WARN("shapecache: cleaning up a CUDA graph failed: ", e.what());
    }
    if (ended) graphs_.generations.graph_released(mempool_id_);
  } catch (const std::exception& e) {
    TORCH_WARN("shapecache: releasing a CUDA graph's pool failed: ", e.what());
  }
}

namespace {

// torch 2.11 and 2.12's CUDAGeneratorState has a public `capturing_` flag and `offset_intragraph_`
// (ATen/cuda/CUDAGeneratorImpl.h); its capture_epilogue(), which clears them, is not exported.
// torch 2.13 has neither: its state is per capture id, and reset() drops a failed capture's.
template <class State, class = void>
struct HasCapturingFlag : std::false_type {};
template <class State>
struct HasCapturingFlag<State, std::void_t<decltype(std::declval<State&>().capturing_)>> : std::true_type {};

// The versions read: the repair must be live on 2.11 and compiled out on 2.13.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 11
static_assert(HasCapturingFlag<at::CUDAGeneratorState>::value, "torch 2.11's CUDAGeneratorState has capturing_");
#elif TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 13
static_assert(!HasCapturingFlag<at::CUDAGeneratorState>::value, "torch 2.13 keeps capture state per capture id");
#endif

template <class State>
void end_capture_mode(State& state) {
  if constexpr (HasCapturingFlag<State>::value) {
    state.capturing_ = false;  // what capture_epilogue() does, less returning the increment
    state.offset_intragraph_ = 0;
  }
}

}  // namespace

void PoolGraph::end_generator_capture() {
  for (auto& [state, increment] : captured_generator_states_) end_capture_mode(*state);
}

void PoolGraph::reset_keeping_workspaces() {
  // torch's reset() (2.13 on) also frees the cuBLAS workspaces kept for its capture stream,
  // which is every graph's of the device, and which the live ones replay into. Pointed at a
  // stream no work ever runs on, it frees none of them.
  capture_stream_ = graphs_.idle_stream();
  reset();
}

namespace {

// A stream of shapecache's own: a pooled stream (getStreamFromPool) may be handed to other
// code too, whose work would then be recorded into a capture. Never destroyed, like the
// registry that holds it.
c10::cuda::CUDAStream own_stream(c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t raw = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  return c10::cuda::getStreamFromExternal(raw, device);
}

}  // namespace

DeviceGraphs::DeviceGraphs(c10::DeviceIndex index)
    : device(index) {}

c10::cuda::CUDAStream DeviceGraphs::stream() {
  std::call_once(streams_made_, [this] {
    stream_.emplace(own_stream(device));
    idle_stream_.emplace(own_stream(device));
  });
  return *stream_;
}

c10::cuda::CUDAStream DeviceGraphs::idle_stream() {
  stream();  // makes both
  return *idle_stream_;
}

DestroyAfterCapture<PoolGraph>& DeviceGraphs::graphs_to_destroy() {
  static auto* deferral = new DestroyAfterCapture<PoolGraph>();  // never destroyed, like the registry
  return *deferral;
}

DeviceGraphs& DeviceGraphs::of(c10::DeviceIndex device) {
  // torch.device("cuda") has no index: it names the current device, as torch's calls take it.
  // One DeviceGraphs (one lock, one pool) per physical device.
  if (device < 0) device = c10::cuda::current_device();
  static std::mutex registry_mutex;
  static auto* devices = new std::map<c10::DeviceIndex, std::unique_ptr<DeviceGraphs>>();  // never freed
  std::lock_guard<std::mutex> guard(registry_mutex);
  auto& graphs = (*devices)[device];
  if (!graphs) graphs.reset(new DeviceGraphs(device));
  return *graphs;
}

namespace {

// torch 2.11's workspace maps hold a DataPtr; 2.13's a (DataPtr, bytes) pair.
template <class Value>
Value workspace_alias(void* data, size_t bytes, c10::Device device) {
  if constexpr (std::is_same_v<Value, at::DataPtr>) {
    return at::DataPtr(data, device);  // non-owning: erasing it frees nothing
  } else {
    return Value(at::DataPtr(data, device), bytes);
  }
}

template <class Value>
const void* workspace_address(const Value& value) {
  if constexpr (std::is_same_v<Value, at::DataPtr>) {
    return value.get();
  } else {
    return value.first.get();
  }
}

}  // namespace

std::pair<std::tuple<void*, void*>, std::tuple<void*, void*>> DeviceGraphs::install_blas_workspace() {
  const size_t needed = std::max(at::cuda::getChosenWorkspaceSize(), at::cuda::getCUDABlasLtWorkspaceSize());
  if (blas_workspaces_.empty() || blas_workspace_bytes_ < needed) {
    blas_workspaces_.push_back(c10::cuda::CUDACachingAllocator::get()->allocate(needed));
    blas_workspace_bytes_ = needed;
  }
  void* data = blas_workspaces_.back().get();
  const c10::Device where(c10::kCUDA, device);
  void* raw_stream = stream().stream();
  // The keys torch reads: (cuBLAS handle, stream) for cuBLAS, and for cuBLASLt (2.11 by
  // default, a map of its own) its handle's; 2.13 reads the cuBLAS map for both.
  const std::tuple<void*, void*> blas_key{static_cast<void*>(at::cuda::getCurrentCUDABlasHandle()), raw_stream};
  const std::tuple<void*, void*> lt_key{static_cast<void*>(at::cuda::getCurrentCUDABlasLtHandle()), raw_stream};
  for (auto [workspaces, key] : {std::pair{&at::cuda::cublas_handle_stream_to_workspace(), blas_key},
                                 std::pair{&at::cuda::cublaslt_handle_stream_to_workspace(), lt_key}}) {
    using Value = typename decltype(workspaces->map)::mapped_type;
    std::unique_lock<std::shared_mutex> guard(workspaces->mutex);
    workspaces->map.insert_or_assign(key, workspace_alias<Value>(data, blas_workspace_bytes_, where));
  }
  at::cuda::getCurrentCUDABlasHandle();  // cublasSetWorkspace(handle, the device's buffer)
  return {blas_key, lt_key};
}

bool DeviceGraphs::blas_workspace_installed(const std::pair<std::tuple<void*, void*>, std::tuple<void*, void*>>& keys) {
  const void* data = blas_workspaces_.back().get();
  for (auto [workspaces, key] : {std::pair{&at::cuda::cublas_handle_stream_to_workspace(), keys.first},
                                 std::pair{&at::cuda::cublaslt_handle_stream_to_workspace(), keys.second}}) {
    std::shared_lock<std::shared_mutex> guard(workspaces->mutex);
    auto found = workspaces->map.find(key);
    if (found == workspaces->map.end() || workspace_address(found->second) != data) return false;
  }
  return true;
}

int64_t DeviceGraphs::pool_bytes(bool in_use) {
  // `generations` changes under the lock, also where no GIL is held (~PoolGraph).
  std::vector<PoolId> ids;
  {
    auto lock = lock_device(*this);
    ids = generations.ids(in_use);
  }
  int64_t bytes = 0;
  for (const auto& segment : c10::cuda::CUDACachingAllocator::snapshot().segments) {
    if (segment.device != device) continue;
    if (std::find(ids.begin(), ids.end(), segment.owner_private_pool_id) != ids.end()) {
      bytes += static_cast<int64_t>(segment.total_size);
    }
  }
  return bytes;
}

namespace {

// A tensor of a Call (call.h), or of BuildHandle.tensors: the key computation put only tensors there.
at::Tensor tensor_of(PyObject* object) {
  TORCH_CHECK(THPVariable_Check(object), "cuda_graph: expected a tensor of the call, got ", Py_TYPE(object)->tp_name);
  return THPVariable_Unpack(object);
}

}  // namespace

std::shared_ptr<CudaGraphRunner> CudaGraphRunner::capture(const py::object& function, const py::object& owner,
                                                          const py::tuple& args, const py::dict& kwargs,
                                                          const py::tuple& tensors,
                                                          std::shared_ptr<StateGuard> guard) {
  std::shared_ptr<CudaGraphRunner> runner(new CudaGraphRunner());
  runner->function_ = function;
  runner->owner_ = owner.is_none() ? py::object(py::none()) : py::object(py::weakref(owner));
  runner->guard_ = std::move(guard);

  std::vector<at::Tensor> inputs;
  inputs.reserve(tensors.size());
  for (py::handle t : tensors) inputs.push_back(tensor_of(t.ptr()));
  TORCH_CHECK(!inputs.empty(), "cuda_graph: a call without tensor arguments cannot be captured");
  const c10::Device device = inputs.front().device();
  TORCH_CHECK(device.is_cuda(), "cuda_graph: the call's tensors are on ", device, "; CUDA graphs need CUDA tensors");
  c10::cuda::CUDAGuard device_guard(device);
  DeviceGraphs& graphs = DeviceGraphs::of(device.index());
  runner->device_ = &graphs;
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device.index());
  runner->modes_ = CallModes::of_this_thread(c10::DeviceType::CUDA);

  // Static inputs: a copy of every tensor of the call (one per distinct tensor, so an input
  // passed twice stays one tensor inside the graph), made on the graphs' stream after the
  // caller's work, listed in canonical order.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> copies;
  auto static_copy = [&](const at::Tensor& t) {
    auto [it, fresh] = copies.try_emplace(t.unsafeGetTensorImpl());
    if (fresh) it->second = t.clone(at::MemoryFormat::Preserve);
    return it->second;
  };
  {
    auto lock = lock_device(graphs);
    order_after(caller, graphs.stream(), graphs.caller_done);
    c10::cuda::CUDAStreamGuard stream_guard(graphs.stream());
    for (const at::Tensor& t : inputs) runner->static_inputs_.push_back(static_copy(t));
    runner->static_args_ = map_tensors(args, static_copy);
    runner->static_kwargs_ = map_tensors(kwargs, static_copy);
  }
  runner->capture_graph(owner);
  return runner;
}

void CudaGraphRunner::capture_graph(const py::object& owner) {
  DeviceGraphs& graphs = *device_;
  c10::cuda::CUDAGuard device_guard(graphs.device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(graphs.device);
  workspace_generation_ = WorkspaceArena::of(c10::Device(c10::DeviceType::CUDA, graphs.device)).generation();
  auto graph = std::make_unique<PoolGraph>(graphs);
  PoolGraph* raw = graph.get();
  const py::tuple call_args =
      owner.is_none() ? static_args_ : py::tuple(py::make_tuple(owner) + static_args_);
  py::object outputs;
  const c10::DeviceIndex index = graphs.device;
  // The allocators' calls the clean-up of a failed capture needs (see pool_generations.h).
  const CaptureSteps steps{
      [] { return at::cuda::graph_pool_handle(); },
      // Thread-local mode: another thread's CUDA calls (an eager model, an allocation) do not
      // invalidate this capture, as they would in the default global mode; what must not run
      // beside a capture of this device (its replays and captures) takes turns on its lock.
      // One exception on torch 2.11 and 2.12 (pool_generations.h, A9): while the capture runs,
      // the device's default generator is in capture mode, so another thread's eager random
      // call on the device raises (torch's own rule for any capture; 2.13 keeps it per capture).
      [raw](const PoolId& id) { raw->capture_begin(id, cudaStreamCaptureModeThreadLocal); },
      [&] { outputs = function_(*call_args, **static_kwargs_); },
      [raw] { raw->capture_end(); },
      [raw] { return raw->ended(); },
      PoolAllocatorCalls{
          [index](const PoolId& id) { c10::cuda::CUDACachingAllocator::endAllocateToPool(index, id); },
          [index](const PoolId& id) { c10::cuda::CUDACachingAllocator::releasePool(index, id); }},
      PoolAllocatorCalls{
          [](const PoolId& id) { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(id); },
          [](const PoolId& id) { at::getHostAllocator(at::kCUDA)->release_pool(id); }},
      [raw] { raw->reset(); },  // a capture that did not end: newer torch ends it on its stream (A8)
      kResetReleasesFailedCapture,
      [raw] { raw->end_generator_capture(); },  // A9
  };
  {
    auto lock = lock_device(graphs);
    order_after(caller, graphs.stream(), graphs.caller_done);
    c10::cuda::CUDAStreamGuard stream_guard(graphs.stream());
    // The device's own cuBLAS workspace, installed outside the capture (where torch would
    // otherwise allocate one inside it, into the generation's pool for good).
    const auto blas_keys = graphs.install_blas_workspace();
    // On failure the allocators are clean and the error propagates; `graph` is destroyed on
    // the way out (counted as released only if its capture ended).
    const uint64_t leases_before = WorkspaceArena::leases_on_this_thread();
    {
      // A graph let go of on this thread meanwhile is destroyed when this block ends, after
      // the capture (under this device's lock, recursive; another device's graph takes its own).
      auto capturing = DeviceGraphs::graphs_to_destroy().capturing();
      graphs.generations.capture(steps);
    }
    uses_workspace_ = WorkspaceArena::leases_on_this_thread() != leases_before;
    if (!graphs.blas_workspace_installed(blas_keys)) {
      // Another thread cleared or resized torch's workspaces during the capture: a GEMM may
      // have baked a buffer of torch's. The alias goes back before `graph` (and the pool
      // blocks torch's buffer may sit in) is released on the way out; the bucket runs eager.
      graphs.install_blas_workspace();
      TORCH_CHECK(false, "cuda_graph: torch's cuBLAS workspaces were cleared or resized during the capture");
    }
    order_after(graphs.stream(), caller, graphs.graphs_done);
  }
  std::vector<at::Tensor> static_outputs;
  for_each_tensor(outputs.ptr(), [&](const at::Tensor& t) { static_outputs.push_back(t); });
  graph_ = std::move(graph);
  static_outputs_ = std::move(static_outputs);
  output_structure_ = std::move(outputs);
}

void CudaGraphRunner::release() {
  auto lock = lock_device(*device_);  // not while another thread replays it
  static_outputs_.clear();
  output_structure_ = py::none();
  DeviceGraphs::graphs_to_destroy().destroy(std::move(graph_));  // its pool blocks go back to the pool
}

CudaGraphRunner::~CudaGraphRunner() { DeviceGraphs::graphs_to_destroy().destroy(std::move(graph_)); }

void CudaGraphRunner::recapture() {
  TORCH_CHECK(!graph_, "cuda_graph: recapture() needs a released graph");
  // Under the modes the entry was built with (call_modes.h), whatever call triggered the rebuild.
  CallModesScope modes(modes_);
  capture_graph(strong(owner_));
}

py::object CudaGraphRunner::run(const Call& call) {
  // Released since the hit's valid() (whose guard may run Python, letting another thread's
  // pool rebuild in), or while this call waits for the lock below: served as a stale miss.
  if (!graph_) throw EntryReleased();
  TORCH_INTERNAL_ASSERT(call.tensors.size() == static_inputs_.size(), "cuda_graph: the call has ",
                        call.tensors.size(), " tensors, the graph was captured with ", static_inputs_.size());
  std::vector<at::Tensor> inputs;  // the call's tensors in key order, as the static inputs are
  inputs.reserve(call.tensors.size());
  for (const py::object& t : call.tensors) inputs.push_back(tensor_of(t.ptr()));
  DeviceGraphs& graphs = *device_;
  c10::cuda::CUDAGuard device_guard(graphs.device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(graphs.device);
  std::vector<at::Tensor> outputs;
  outputs.reserve(static_outputs_.size());
  py::object structure;  // read under the lock: release() and a recapture rewrite it
  {
    // Replays of a device take turns on its stream: after the caller's work, before the
    // caller's later work. Output memory belongs to the caller's stream; it is written on
    // the graphs' stream, which the caller then waits for. The caller's inputs are read on
    // the graphs' stream too, and any reuse of their memory after the caller frees them is
    // queued on the caller's stream, after that wait.
    auto lock = lock_device(graphs);
    if (!graph_) throw EntryReleased();  // (release() takes the lock: checked again under it)
    structure = output_structure_;
    const c10::cuda::CUDAStream stream = graphs.stream();
    for (const at::Tensor& s : static_outputs_) outputs.push_back(at::empty_like(s));
    order_after(caller, stream, graphs.caller_done);
    c10::cuda::CUDAStreamGuard stream_guard(stream);
    for (size_t i = 0; i < inputs.size(); ++i) static_inputs_[i].copy_(inputs[i], /*non_blocking=*/true);
    graph_->replay();
    for (size_t i = 0; i < outputs.size(); ++i) outputs[i].copy_(static_outputs_[i], /*non_blocking=*/true);
    order_after(stream, caller, graphs.graphs_done);
  }
  size_t next = 0;  // the outputs' structure, rebuilt around the copies (in the same walk order)
  return map_tensors(structure, [&](const at::Tensor&) { return outputs.at(next++); });
}

bool CudaGraphRunner::valid() {
  // A released graph whose recapture did not happen (a rebuild cut short by an error) is
  // rebuilt from its caller's next call, like a stale one.
  if (!graph_) return false;
  // Only a graph whose kernels took the arena's buffer holds its address (workspace_arena.h).
  if (uses_workspace_ &&
      WorkspaceArena::of(c10::Device(c10::DeviceType::CUDA, device_->device)).generation() != workspace_generation_) {
    return false;
  }
  return !guard_ || guard_->check();
}

int64_t CudaGraphRunner::static_input_bytes() const {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const at::Tensor& t : static_inputs_) {
    if (seen.insert(t.storage().data()).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

namespace {

// A device's capture and replay lock, held by Python code that must not run beside a capture:
// a device-wide synchronisation, torch.cuda.mem_get_info's figures taken around one, or
// empty_cache's cudaFree (which synchronises the device) on another thread would wait on, or
// break, a capture in progress. Entered and exited on one thread, as `with` does.
class DeviceLockScope {
 public:
  explicit DeviceLockScope(c10::Device device) : graphs_(DeviceGraphs::of(device.index())) {}
  void enter() {
    // One hold per object: a second enter would replace (and so release) the first.
    if (lock_.owns_lock()) throw std::runtime_error("cuda_device_lock: already entered; use one object per `with`");
    lock_ = lock_device(graphs_);
  }
  void exit() {
    if (lock_.owns_lock()) lock_.unlock();
  }

 private:
  DeviceGraphs& graphs_;
  std::unique_lock<std::recursive_mutex> lock_;
};

}  // namespace

void bind_cuda_graphs(py::module_& m) {
  py::class_<DeviceLockScope>(m, "cuda_device_lock",
                              "with _C.cuda_device_lock(device): no capture or replay of the device runs meanwhile.")
      .def(py::init<c10::Device>(), py::arg("device"))
      .def("__enter__", &DeviceLockScope::enter)
      .def("__exit__", [](DeviceLockScope& scope, const py::args&) { scope.exit(); });
  py::class_<CudaGraphRunner, EntryRunner, std::shared_ptr<CudaGraphRunner>>(m, "CudaGraphRunner")
      .def_property_readonly("static_input_bytes", &CudaGraphRunner::static_input_bytes)
      .def_property_readonly("captured", &CudaGraphRunner::captured)
      .def("release", &CudaGraphRunner::release)
      .def("recapture", &CudaGraphRunner::recapture)
      .def_property_readonly("device", &CudaGraphRunner::device);
  m.def("capture_cuda_graph", &CudaGraphRunner::capture, py::arg("function"), py::arg("owner"), py::arg("args"),
        py::arg("kwargs"), py::arg("tensors"), py::arg("guard"),
        "Captures one call as a CUDA graph in its device's shared pool (warm the function up first).");
  m.def(
      "cuda_graph_pool_bytes",
      [](c10::Device device, bool in_use) { return DeviceGraphs::of(device.index()).pool_bytes(in_use); },
      py::arg("device"), py::arg("in_use") = true);
}

}  // namespace shapecache
