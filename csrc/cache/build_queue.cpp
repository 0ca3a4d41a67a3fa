#include "cache/build_queue.h"

#include "cache/shape_dispatcher.h"

namespace shapecache {
namespace {

// A cancelled job's bucket is no longer being built: a later miss may queue it again.
void end_mark(const BuildJob& job) {
  job.dispatcher.cast<ShapeDispatcher&>().cache()->end_build(job.device, job.key);
}

}  // namespace

BuildQueue& BuildQueue::instance() {
  // Never destroyed: its jobs hold Python objects, which must not be released after the
  // interpreter is gone.
  static auto* queue = new BuildQueue();
  return *queue;
}

void BuildQueue::push(BuildJob job) {
  const c10::Device device = job.device;
  waiting_[device].push_back(std::move(job));
}

bool BuildQueue::run_next(const c10::Device& device) {
  auto found = waiting_.find(device);
  if (found == waiting_.end() || found->second.empty()) return false;
  BuildJob job = std::move(found->second.front());
  found->second.pop_front();
  running_[device] = job.function_id;
  // Cleared on every way out; the job's objects are released after, still with the GIL.
  struct Running {
    std::unordered_map<c10::Device, uint64_t>& running;
    const c10::Device& device;
    ~Running() { running.erase(device); }
  } running{running_, device};
  ShapeDispatcher& dispatcher = job.dispatcher.cast<ShapeDispatcher&>();
  dispatcher.run_background_build(job);
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
  for (const auto& [device, id] : running_) count += id == function_id;
  return count;
}

int64_t BuildQueue::pending() const {
  int64_t count = static_cast<int64_t>(running_.size());
  for (const auto& [device, jobs] : waiting_) count += static_cast<int64_t>(jobs.size());
  return count;
}

}  // namespace shapecache
