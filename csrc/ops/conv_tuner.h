// ConvTuner: picks, per exact convolution problem, the fastest algorithm whose workspace
// fits the device's arena cap, by timing every candidate on the caller's tensors, and
// remembers the choice as a TuningRecord.
//
// Where tuning happens: on the input's own device (its current stream on CUDA), on the
// first call of a problem that has no record, never during CUDA graph capture (a problem
// without a record runs ATen's default path then, untuned and unrecorded).
// Records loaded from disk skip tuning entirely.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>

#include <array>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/conv_problem.h"

namespace shapecache {

struct ConvArgs {
  at::Tensor input;
  at::Tensor weight;
  std::optional<at::Tensor> bias;
  std::array<int64_t, 2> stride;
  std::array<int64_t, 2> padding;
  std::array<int64_t, 2> dilation;
  int64_t groups;
};

// One way to compute a convolution on a device type.
struct ConvAlgorithm {
  std::string name;
  // Workspace bytes it needs for `args`; negative when it cannot run them.
  std::function<int64_t(const ConvArgs&)> workspace_bytes;
  // The output (in the input's suggested memory format); `workspace` holds at least the
  // bytes asked for (undefined when none were).
  std::function<at::Tensor(const ConvArgs&, const at::Tensor& workspace)> run;
};

// What a device type contributes: its algorithms and how to time and describe it.
struct ConvDeviceHooks {
  std::vector<ConvAlgorithm> algorithms;  // the first is the default (ATen's own path)
  // Wall time of `work` in microseconds, as the device sees it (events on CUDA).
  std::function<double(const c10::Device&, const std::function<void()>& work)> time;
  std::function<bool(const c10::Device&)> capturing;  // inside CUDA graph capture
  std::function<std::string(const c10::Device&)> environment;  // model, library versions
  std::function<std::vector<c10::Device>()> devices;            // the devices of this type here
};

void register_conv_device(c10::DeviceType type, ConvDeviceHooks hooks);

struct CandidateTiming {
  std::string algorithm;
  int64_t workspace_bytes = 0;
  double microseconds = -1;  // median; -1 when not timed
  std::string skipped;       // why it was not timed ("" when timed)
};

struct TuningResult {
  TuningRecord record;
  std::vector<CandidateTiming> candidates;
};

struct TunerStats {
  int64_t tuned;    // problems measured in this process
  int64_t loaded;   // records read from disk
  int64_t hits;     // calls that found a record
  int64_t records;  // records known
};

class ConvTuner {
 public:
  static ConvTuner& instance();

  // The op's body: the recorded algorithm, tuning first when the problem has no record.
  at::Tensor run(const ConvArgs& args);

  // Times every candidate for `args` and records the fastest that fits (replacing a record).
  TuningResult tune(const ConvArgs& args);

  // Runs the algorithm called `algorithm` (tests and benchmarks); errors name the choices.
  at::Tensor run_named(const ConvArgs& args, const std::string& algorithm);

  ConvProblem problem_of(const ConvArgs& args);
  std::string environment(const c10::Device& device);

  // Records read from disk; ones whose environment is not one of this process's devices', or
  // whose algorithm this build lacks, are skipped. Returns how many were taken.
  int64_t load(const std::vector<TuningRecord>& records);
  std::vector<TuningRecord> take_unsaved();
  bool has_unsaved();
  TunerStats stats();
  void clear();  // forget every record (tests, and a corrupt file set aside)

  // Fault injection for tests: tuning makes the candidate of this name fail ("" for none).
  void fail_candidate_for_tests(std::string name);

 private:
  ConvTuner() = default;
  at::Tensor run_algorithm(const ConvDeviceHooks& hooks, int slot, const ConvArgs& args, int64_t workspace_bytes);

  std::mutex mutex_;  // guards everything below; held while tuning
  TuningTable table_;
  std::string failing_candidate_;  // see fail_candidate_for_tests
};

}  // namespace shapecache
