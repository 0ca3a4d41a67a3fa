// TraceGate: keeps a trace of the user's code apart from the runs of the user's code that
// shapecache makes on other threads, process-wide.
//
// A trace runs the user's function (on fake tensors); what it writes into Python state that
// the live model shares (a counter in a global, a helper's cache) is put back afterwards
// (python/shapecache/_backends/trace_copies.py: put_back_shared). The put-back is exact only
// where no other thread wrote that state meanwhile: a counter another thread incremented
// during the trace would lose those increments. So:
//
// - Every run of user code from C++ (an uncached call, an eager entry, the call after an
//   inline build: python_call.h) is a `Run`, counted here.
// - A trace that must be alone `close`s the gate: no Run starts on another thread until it
//   `open`s it (or for kLongestWaitS), and `close` waits (the GIL released) for the Runs in
//   progress on other threads to end, up to a bound. A thread already inside a Run passes the gate (it holds a
//   Run the closer waits for), and a thread inside a Run cannot close it (it would wait for
//   itself, or for another thread's Run that waits for it): its trace is not alone.
// - A trace that is not alone reads `runs_elsewhere` before and after: a count that moved,
//   or Runs in progress elsewhere, mean another thread may have written what the trace
//   wrote, and the put-back is not made.
//
// Runs of user code that shapecache does not make (the user's own threads calling the
// plain function) are not seen here.
//
// Threading: the state is under one mutex, never held across a Python call or a wait for the
// GIL; waits release the GIL. After fork the child starts with a new gate (`after_fork`): the
// parent's could be closed by a thread the child does not have.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace shapecache {

class TraceGate {
 public:
  static TraceGate& instance();
  static void after_fork();  // in a forked child: a new gate

  // A run of user code on this thread, for its lifetime. Waits (the GIL released) while
  // another thread holds the gate closed, unless this thread is inside a Run already.
  class Run {
   public:
    Run();
    ~Run();
    Run(const Run&) = delete;
    Run& operator=(const Run&) = delete;
  };

  // Closes the gate for this thread, waiting up to `timeout_s` for the Runs in progress on
  // other threads to end; true where they did (this thread's trace is alone until `open`).
  // False at once on a thread inside a Run; false after waiting for another closer's `open`
  // too long, or for the Runs in progress too long (the gate is then open again). Closed (by
  // this thread) only where it returns true; `open` is harmless either way.
  bool close(double timeout_s);
  void open();  // by the thread that closed it; nothing otherwise

  // The longest a Run waits at a closed gate before it goes on (counted, so the closer
  // sees it): a wait for longer is a lock cycle through the user's code, not a trace.
  static constexpr double kLongestWaitS = 60.0;

  // Runs started on other threads so far, and in progress on them now.
  struct Elsewhere {
    uint64_t started;
    int64_t in_progress;
  };
  Elsewhere runs_elsewhere() const;

 private:
  TraceGate() = default;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::thread::id closed_by_{};  // no thread: open
  uint64_t started_ = 0;
  int64_t in_progress_ = 0;
};

}  // namespace shapecache
