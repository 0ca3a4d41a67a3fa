// WorkspaceArena: the one scratch buffer of a device that every tuned convolution uses.
//
// Policy:
//   - One buffer per device, from torch's allocator on that device (so the caching
//     allocator and its statistics see it, and CUDA use is stream-ordered).
//   - It only grows, to the largest workspace a chosen algorithm needs (candidates that need
//     more are timed on scratch memory freed after timing): every bucket's
//     convolutions share it, so it is sized by the largest, not the sum. Built largest
//     first, it reaches its final size on the first build.
//   - Growth bumps `generation`: a CUDA graph that captured the old address must be rebuilt.
//     Only such a graph: a capture compares `leases_on_this_thread` before and after to learn
//     whether its kernels took the buffer at all (a graph without tuned convolutions did not,
//     and growth leaves it valid).
//   - Capped: a request above the cap is refused, and the tuner leaves out algorithms that
//     would need it.
//   - A kernel holds the arena's lease while it uses the buffer: host threads that run
//     tuned convolutions on the same device take turns.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>

namespace shapecache {

class WorkspaceArena {
 public:
  static constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

  // The arena of `device` (created empty on first use; never destroyed).
  static WorkspaceArena& of(const c10::Device& device);

  struct Lease {
    std::unique_lock<std::mutex> lock;  // held while the buffer is in use
    at::Tensor buffer;                  // uint8, at least the bytes asked for
  };

  // The buffer, grown to `bytes` if needed; nullopt when `bytes` is above the cap.
  std::optional<Lease> lease(int64_t bytes);

  // Whether `bytes` of workspace can be had (within the cap).
  bool allows(int64_t bytes) const;

  void set_cap(int64_t bytes);
  int64_t cap() const;
  int64_t bytes() const;
  uint64_t generation() const;

  // Leases taken so far by the calling thread, of any device's arena. A capture runs its
  // function on the capturing thread, so a change across it means the graph holds an address
  // of an arena's buffer. Another thread's leases never count here.
  static uint64_t leases_on_this_thread();

 private:
  explicit WorkspaceArena(c10::Device device) : device_(device) {}

  const c10::Device device_;
  mutable std::mutex mutex_;
  at::Tensor buffer_;           // empty until the first lease that needs bytes
  int64_t cap_ = kUnlimited;    // bytes the buffer may grow to
  uint64_t generation_ = 0;     // bumped on every growth
};

}  // namespace shapecache
