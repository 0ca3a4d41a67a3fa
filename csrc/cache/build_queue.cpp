#include "cache/build_queue.h"

#include <algorithm>

#include "cache/call_key.h"
#include "cache/shape_cache.h"

namespace shapecache {
namespace {

// A cancelled job's bucket is no longer being built: a later miss may queue it again.
void end_mark(const BuildJob& job) { job.cache->end_build(job.device, job.key); }

// `value` with every list, dict and tuple in it copied, and everything else shared: what a
// queued build keeps of its call, whose key holds those containers' contents while the
// caller may change them once the call has returned.
py::object copy_containers(py::handle value) {
  PyObject* v = value.ptr();
  if (PyList_CheckExact(v)) {
    py::list out;
    for (py::handle item : py::reinterpret_borrow<py::list>(value)) out.append(copy_containers(item));
    return out;
  }
  if (PyTuple_CheckExact(v)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(v);
    py::tuple out(n);
    for (Py_ssize_t i = 0; i < n; ++i) PyTuple_SET_ITEM(out.ptr(), i, copy_containers(PyTuple_GET_ITEM(v, i)).release().ptr());
    return out;
  }
  if (PyDict_CheckExact(v)) {
    py::dict out;
    for (auto [k, item] : py::reinterpret_borrow<py::dict>(value)) out[k] = copy_containers(item);
    return out;
  }
  return py::reinterpret_borrow<py::object>(value);
}

}  // namespace

std::optional<py::tuple> BuildJob::entry_args() const {
  if (owner_ref.is_none()) return args;
  py::object owner = owner_ref();
  if (owner.is_none()) return std::nullopt;
  return with_owner(owner, args);
}

BuildJob BuildJob::of_call(const Call& call) {
  BuildJob job;
  job.key = call.key;
  job.device = call.device;
  py::tuple entry_args = copy_containers(call.entry_args).cast<py::tuple>();
  if (call.owner.is_none()) {
    job.args = std::move(entry_args);
  } else {  // entry_args holds the owner first
    job.owner_ref = py::weakref(call.owner);
    job.args = entry_args[py::slice(1, static_cast<Py_ssize_t>(entry_args.size()), 1)];
  }
  job.kwargs = copy_containers(call.entry_kwargs).cast<py::dict>();
  job.tensors = call.tensor_tuple();
  job.modes = CallModes::of_this_thread(call.device.type());
  job.context = py::reinterpret_steal<py::object>(PyContext_CopyCurrent());
  if (!job.context) throw py::error_already_set();
  return job;
}

EnteredContext::EnteredContext(const py::object& context) : context_(context) {
  if (PyContext_Enter(context_.ptr()) != 0) throw py::error_already_set();
}

EnteredContext::~EnteredContext() {
  if (PyContext_Exit(context_.ptr()) != 0) PyErr_Clear();  // only fails where another context was entered since
}

BuildQueue& BuildQueue::instance() {
  // Never destroyed: its jobs hold Python objects, which must not be released after the
  // interpreter is gone.
  static auto* queue = new BuildQueue();
  return *queue;
}

bool BuildQueue::push(BuildJob job) {
  std::deque<BuildJob>& jobs = waiting_[job.device];
  if (jobs.size() >= kMaxWaiting) return false;
  jobs.push_back(std::move(job));
  return true;
}

bool BuildQueue::run_next(const c10::Device& device) {
  auto found = waiting_.find(device);
  if (found == waiting_.end()) return false;
  auto next = std::find_if(found->second.begin(), found->second.end(), [](const BuildJob& j) { return j.ready; });
  if (next == found->second.end()) return false;
  BuildJob job = std::move(*next);
  found->second.erase(next);
  // Held for the run. Let go of already, it would have cancelled its jobs as it went.
  py::object function = job.function_ref();
  if (function.is_none()) {
    end_mark(job);
    return true;
  }
  running_[device] = Running{job.function_id, job.key, job.cache};
  // Cleared on every way out; the job's objects are released after, still with the GIL.
  struct Ended {
    std::unordered_map<c10::Device, Running>& running;
    const c10::Device& device;
    ~Ended() { running.erase(device); }
  } ended{running_, device};
  job.runner->run_queued(job);
  return true;
}

std::vector<BuildJob> BuildQueue::cancel(uint64_t function_id) {
  std::vector<BuildJob> cancelled;
  for (auto& [device, jobs] : waiting_) {
    for (auto it = jobs.begin(); it != jobs.end();) {
      if (it->function_id == function_id) {
        end_mark(*it);
        cancelled.push_back(std::move(*it));
        it = jobs.erase(it);
      } else {
        ++it;
      }
    }
  }
  return cancelled;
}

std::vector<BuildJob> BuildQueue::cancel(uint64_t function_id, const c10::Device& device, const ShapeKey& key) {
  std::vector<BuildJob> cancelled;
  auto found = waiting_.find(device);
  if (found == waiting_.end()) return cancelled;
  for (auto it = found->second.begin(); it != found->second.end(); ++it) {
    if (it->function_id == function_id && it->key == key) {
      end_mark(*it);
      cancelled.push_back(std::move(*it));
      found->second.erase(it);
      break;
    }
  }
  return cancelled;
}

void BuildQueue::make_ready(uint64_t function_id, const c10::Device& device, const ShapeKey& key) {
  auto found = waiting_.find(device);
  if (found == waiting_.end()) return;
  for (BuildJob& job : found->second) {
    if (job.function_id == function_id && job.key == key) job.ready = true;
  }
}

std::vector<c10::Device> BuildQueue::make_all_ready() {
  std::vector<c10::Device> devices;
  for (auto& [device, jobs] : waiting_) {
    for (BuildJob& job : jobs) job.ready = true;
    if (!jobs.empty()) devices.push_back(device);
  }
  return devices;
}

std::vector<c10::Device> BuildQueue::ready_devices() const {
  std::vector<c10::Device> devices;
  for (const auto& [device, jobs] : waiting_) {
    if (std::any_of(jobs.begin(), jobs.end(), [](const BuildJob& j) { return j.ready; })) devices.push_back(device);
  }
  return devices;
}

std::vector<BuildJob> BuildQueue::forget_parents_builds() {
  for (auto& [device, running] : running_) running.cache->end_build(device, running.key);
  running_.clear();
  return cancel_all();
}

std::vector<BuildJob> BuildQueue::cancel_all() {
  std::vector<BuildJob> cancelled;
  for (auto& [device, jobs] : waiting_) {
    for (BuildJob& job : jobs) {
      end_mark(job);
      cancelled.push_back(std::move(job));
    }
    jobs.clear();
  }
  return cancelled;
}

int64_t BuildQueue::pending(uint64_t function_id) const {
  int64_t count = 0;
  for (const auto& [device, jobs] : waiting_) {
    for (const BuildJob& job : jobs) count += job.function_id == function_id;
  }
  for (const auto& [device, running] : running_) count += running.function_id == function_id;
  return count;
}

int64_t BuildQueue::pending() const {
  int64_t count = static_cast<int64_t>(running_.size());
  for (const auto& [device, jobs] : waiting_) count += static_cast<int64_t>(jobs.size());
  return count;
}

}  // namespace shapecache
