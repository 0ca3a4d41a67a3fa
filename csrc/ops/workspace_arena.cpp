#include "ops/workspace_arena.h"

#include <ATen/detail/CUDAHooksInterface.h>

#include <map>
#include <memory>
#include <string>

namespace shapecache {
namespace {
thread_local uint64_t thread_leases = 0;
}  // namespace

uint64_t WorkspaceArena::leases_on_this_thread() { return thread_leases; }

WorkspaceArena& WorkspaceArena::of(const c10::Device& given) {
  // torch.device("cuda") has no index: it names the current device, whose arena it shares.
  const c10::Device device = given.is_cuda() && !given.has_index()
                                 ? c10::Device(c10::kCUDA, at::detail::getCUDAHooks().current_device())
                                 : given;
  static std::mutex registry_mutex;
  static auto* arenas = new std::map<std::string, std::unique_ptr<WorkspaceArena>>();  // never freed:
  // buffers must not be released after the allocator is gone at process exit.
  std::lock_guard<std::mutex> guard(registry_mutex);
  auto& arena = (*arenas)[device.str()];
  if (!arena) arena.reset(new WorkspaceArena(device));
  return *arena;
}

std::optional<WorkspaceArena::Lease> WorkspaceArena::lease(int64_t bytes) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (bytes > cap_) return std::nullopt;
  ++thread_leases;
  const int64_t held = buffer_.defined() ? buffer_.numel() : 0;
  if (bytes > held) {
    // Release the old buffer first so that the allocator can reuse its block for the new one.
    buffer_ = at::Tensor();
    buffer_ = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device_));
    ++generation_;
  }
  return Lease{std::move(lock), buffer_};
}

bool WorkspaceArena::allows(int64_t bytes) const {
  std::lock_guard<std::mutex> guard(mutex_);
  return bytes <= cap_;
}

void WorkspaceArena::set_cap(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "workspace_cap must be >= 0 bytes, got ", bytes);
  std::lock_guard<std::mutex> guard(mutex_);
  cap_ = bytes;
}

int64_t WorkspaceArena::cap() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return cap_;
}

int64_t WorkspaceArena::bytes() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return buffer_.defined() ? buffer_.numel() : 0;
}

uint64_t WorkspaceArena::generation() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return generation_;
}

}  // namespace shapecache
