#include "cache/trace_gate.h"

#include <pybind11/pybind11.h>

#include <chrono>

namespace shapecache {

namespace {

TraceGate* gate = nullptr;

// This thread's Runs: in progress (nested Runs count once each) and started, for telling its
// own from other threads'.
thread_local int64_t runs_here = 0;
thread_local uint64_t started_here = 0;

}  // namespace

TraceGate& TraceGate::instance() {
  // Never destroyed: a thread may still hold a Run as the interpreter exits.
  if (gate == nullptr) gate = new TraceGate();
  return *gate;
}

void TraceGate::after_fork() {
  // The parent's is left: its mutex may be held by a thread the child lacks. The child's one
  // thread keeps the Runs it is inside (a fork from user code), which it will leave.
  gate = new TraceGate();
  gate->in_progress_ = runs_here;
  gate->started_ = started_here;
}

TraceGate::Run::Run() {
  TraceGate& g = instance();
  const auto me = std::this_thread::get_id();
  const auto open_to_me = [&] { return runs_here > 0 || g.closed_by_ == std::thread::id{} || g.closed_by_ == me; };
  const auto count = [&] {
    ++g.started_;
    ++g.in_progress_;
    ++started_here;
    ++runs_here;
  };
  {
    std::lock_guard<std::mutex> lock(g.mutex_);
    if (open_to_me()) {
      count();
      return;
    }
  }
  // The mutex is never held while the GIL is waited for: let go of the GIL, wait, count, and
  // let go of the mutex before the GIL is taken again. The wait is bounded: a lock of the
  // user's that the closer's trace waits for, held here around this call, would otherwise
  // never be let go of. Past the bound the Run goes on, counted: the closer sees it
  // (runs_elsewhere) and leaves what its trace wrote as it is.
  pybind11::gil_scoped_release no_gil;
  std::unique_lock<std::mutex> lock(g.mutex_);
  g.changed_.wait_for(lock, std::chrono::duration<double>(kLongestWaitS), open_to_me);
  count();
}

TraceGate::Run::~Run() {
  TraceGate& g = instance();
  {
    std::lock_guard<std::mutex> lock(g.mutex_);
    --g.in_progress_;
    --runs_here;
  }
  g.changed_.notify_all();
}

bool TraceGate::close(double timeout_s) {
  if (runs_here > 0) return false;
  const auto me = std::this_thread::get_id();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  pybind11::gil_scoped_release no_gil;
  std::unique_lock<std::mutex> lock(mutex_);
  if (!changed_.wait_until(lock, deadline, [&] { return closed_by_ == std::thread::id{} || closed_by_ == me; })) {
    return false;  // another trace holds it: this one is not alone, and leaves the gate to it
  }
  closed_by_ = me;
  if (changed_.wait_until(lock, deadline, [&] { return in_progress_ == 0; })) return true;
  // Not alone after all: the gate opens again at once (the trace counts runs instead), so
  // that no thread waits for a trace that gained nothing by it.
  closed_by_ = std::thread::id{};
  lock.unlock();
  changed_.notify_all();
  return false;
}

void TraceGate::open() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_by_ != std::this_thread::get_id()) return;
    closed_by_ = std::thread::id{};
  }
  changed_.notify_all();
}

TraceGate::Elsewhere TraceGate::runs_elsewhere() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return Elsewhere{started_ - started_here, in_progress_ - runs_here};
}

}  // namespace shapecache
