// CallModes: the thread-local modes that change what a call computes, read from one call and
// set again around another.
//
// Grad mode, inference mode, and autocast (on or off, and its dtype) for one device type. An
// entry's key records them, so an entry is only ever built and run under its own. A CUDA graph
// recaptured because another call rebuilt the device's pool must be captured under the modes
// of the call that built it, not those of the call that triggered the rebuild: under that
// call's autocast a float32 graph would come back float16, without a word.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/ScalarType.h>

namespace shapecache {

struct CallModes {
  c10::DeviceType device_type = c10::DeviceType::CPU;  // whose autocast
  bool grad = true;
  bool inference = false;
  bool autocast = false;
  at::ScalarType autocast_dtype = at::kHalf;

  // The calling thread's modes now.
  static CallModes of_this_thread(c10::DeviceType device_type) {
    return CallModes{device_type, c10::GradMode::is_enabled(), c10::InferenceMode::is_enabled(),
                     at::autocast::is_autocast_enabled(device_type), at::autocast::get_autocast_dtype(device_type)};
  }
};

// Sets `modes` on this thread for its lifetime; the thread's own come back on every way out.
class CallModesScope {
 public:
  explicit CallModesScope(const CallModes& modes)
      : device_type_(modes.device_type),
        inference_(modes.inference),  // first: entering or leaving inference mode sets grad mode too
        grad_(modes.grad),
        autocast_before_(at::autocast::is_autocast_enabled(modes.device_type)),
        dtype_before_(at::autocast::get_autocast_dtype(modes.device_type)) {
    at::autocast::set_autocast_enabled(device_type_, modes.autocast);
    at::autocast::set_autocast_dtype(device_type_, modes.autocast_dtype);
  }
  ~CallModesScope() {
    at::autocast::set_autocast_enabled(device_type_, autocast_before_);
    at::autocast::set_autocast_dtype(device_type_, dtype_before_);
  }
  CallModesScope(const CallModesScope&) = delete;
  CallModesScope& operator=(const CallModesScope&) = delete;

 private:
  c10::DeviceType device_type_;
  c10::InferenceMode inference_;
  c10::AutoGradMode grad_;
  bool autocast_before_;
  at::ScalarType dtype_before_;
};

}  // namespace shapecache
