// DestroyAfterCapture<T>: what a thread lets go of while it captures a CUDA graph is destroyed
// when the capture ends, torch-free.
//
// Why: the captured function is Python, so the garbage collector can run inside a capture and
// free an entry of the same device, whose graph is then destroyed on the capturing thread with
// the capture in flight. Destroying a graph calls cudaGraphExecDestroy and cudaGraphDestroy
// (CUDAGraph::reset() of torch 2.11 and 2.13), 2.13's destructor also cudaStreamDestroy, and the
// graph's pool goes back to torch's allocator; neither version relaxes the thread's capture
// mode on that path (read in the shipped libtorch_cuda.so and libc10_cuda.so of 2.11.0+cu130
// and 2.13.0+cu130: no call of cudaThreadExchangeStreamCaptureMode from reset() or the
// destructor). Under the thread-local capture mode shapecache captures with, a call CUDA counts
// unsafe on the capturing thread invalidates the capture, which on 2.11 then leaves the
// device's generator capturing (pool_generations.h, A9). Nothing needs the graph gone before
// the capture ends, so it waits.
//
// Rules, kept here and checked by tests/core/test_destroy_after_capture.py:
//   D1 While a capture scope is open on thread t, destroy(x) called on t keeps x.
//   D2 destroy(x) called on any other thread, or on t with no scope open, destroys x at once
//      (another thread's calls are outside t's capture: thread-local mode).
//   D3 Closing t's outermost scope destroys what it kept, in the order it was kept, after the
//      scope is marked closed: a destructor that lets go of something else destroys it at once.
//      A scope closed by an exception does the same.
//   D4 Destruction runs outside this class's lock: a destructor may take other locks (a
//      graph's takes its device's) and call back into destroy().
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace shapecache {

template <class T>
class DestroyAfterCapture {
 public:
  class Scope {
   public:
    explicit Scope(DestroyAfterCapture& owner) : owner_(&owner) { owner_->open(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope() { owner_->close(); }

   private:
    DestroyAfterCapture* owner_;
  };

  // Open for the duration of one capture, on the capturing thread.
  Scope capturing() { return Scope(*this); }

  void destroy(std::unique_ptr<T> object) {
    if (!object) return;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (depth_ > 0 && capturing_thread_ == std::this_thread::get_id()) {  // D1
        kept_.push_back(std::move(object));
        return;
      }
    }
    object.reset();  // D2, D4
  }

  // Whether this thread has a scope open now.
  bool capturing_on_this_thread() const {
    std::lock_guard<std::mutex> guard(mutex_);
    return depth_ > 0 && capturing_thread_ == std::this_thread::get_id();
  }

  size_t kept() const {
    std::lock_guard<std::mutex> guard(mutex_);
    return kept_.size();
  }

 private:
  void open() {
    std::lock_guard<std::mutex> guard(mutex_);
    // One capturing thread at a time: a device's captures take turns on its lock, and a
    // nested capture on the same thread fails in CUDA before it records anything.
    if (depth_++ == 0) capturing_thread_ = std::this_thread::get_id();
  }

  void close() noexcept {
    std::vector<std::unique_ptr<T>> kept;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (--depth_ > 0) return;
      capturing_thread_ = std::thread::id();
      kept.swap(kept_);
    }
    for (auto& object : kept) object.reset();  // D3, in order, D4
  }

  mutable std::mutex mutex_;
  std::thread::id capturing_thread_;
  int depth_ = 0;
  std::vector<std::unique_ptr<T>> kept_;
};

}  // namespace shapecache
