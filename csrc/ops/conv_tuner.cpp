#include "ops/conv_tuner.h"

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <sstream>

#include "ops/workspace_arena.h"

namespace shapecache {
namespace {

std::map<c10::DeviceType, ConvDeviceHooks>& device_hooks() {
  static std::map<c10::DeviceType, ConvDeviceHooks> hooks;
  return hooks;
}

const ConvDeviceHooks& hooks_for(const c10::Device& device) {
  auto& all = device_hooks();
  auto it = all.find(device.type());
  TORCH_CHECK(it != all.end(), "shapecache::conv2d: no implementation for device ", device,
              " in this build (built for: CPU", all.count(c10::DeviceType::CUDA) ? ", CUDA" : "", ")");
  return it->second;
}

int slot_of(const ConvDeviceHooks& hooks, const std::string& algorithm) {
  for (size_t i = 0; i < hooks.algorithms.size(); ++i) {
    if (hooks.algorithms[i].name == algorithm) return static_cast<int>(i);
  }
  return -1;
}

// Median of a few runs after one warm-up; fewer runs for slow candidates.
double median_microseconds(const ConvDeviceHooks& hooks, const c10::Device& device, const std::function<void()>& work) {
  const double first = hooks.time(device, work);  // warm-up: lazy initialisation, caches
  const int runs = first > 20'000 ? 2 : 5;
  std::vector<double> times;
  for (int i = 0; i < runs; ++i) times.push_back(hooks.time(device, work));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

void register_conv_device(c10::DeviceType type, ConvDeviceHooks hooks) {
  TORCH_INTERNAL_ASSERT(!hooks.algorithms.empty(), "a device needs at least its default algorithm");
  device_hooks()[type] = std::move(hooks);
}

ConvTuner& ConvTuner::instance() {
  static ConvTuner tuner;
  return tuner;
}

std::string ConvTuner::environment(const c10::Device& device) {
  std::ostringstream out;
  out << "torch " << TORCH_VERSION << "; " << hooks_for(device).environment(device);
  return out.str();
}

ConvProblem ConvTuner::problem_of(const ConvArgs& a) {
  ConvProblem p;
  std::memset(&p, 0, sizeof(p));
  // The environment text is the same for every problem of a device (and thread count, which
  // CPU timings depend on); hash it once per pair.
  // Keyed by plain integers: this runs on every tuned convolution call, with no string to build.
  static thread_local std::map<std::tuple<int, int, int>, uint64_t> environment_hashes;
  const c10::Device& device = a.input.device();
  const auto where = std::make_tuple(static_cast<int>(device.type()), static_cast<int>(device.index()),
                                     at::get_num_threads());
  auto it = environment_hashes.find(where);
  if (it == environment_hashes.end()) {
    it = environment_hashes.emplace(where, hash_environment(environment(device))).first;
  }
  p.environment = it->second;
  p.n = a.input.size(0);
  p.c = a.input.size(1);
  p.h = a.input.size(2);
  p.w = a.input.size(3);
  p.k = a.weight.size(0);
  p.r = a.weight.size(2);
  p.s = a.weight.size(3);
  for (int i = 0; i < 2; ++i) {
    p.stride[i] = a.stride[i];
    p.padding[i] = a.padding[i];
    p.dilation[i] = a.dilation[i];
  }
  p.groups = a.groups;
  p.device_type = static_cast<int8_t>(a.input.device().type());
  p.dtype = static_cast<int8_t>(a.input.scalar_type());
  p.layout = a.input.suggest_memory_format() == at::MemoryFormat::ChannelsLast ? 1 : 0;
  p.has_bias = a.bias.has_value() ? 1 : 0;
  return p;
}

at::Tensor ConvTuner::run_algorithm(const ConvDeviceHooks& hooks, int slot, const ConvArgs& args,
                                    int64_t workspace_bytes) {
  const ConvAlgorithm& algorithm = hooks.algorithms.at(slot);
  if (workspace_bytes <= 0) return algorithm.run(args, at::Tensor());
  const c10::Device device = args.input.device();
  WorkspaceArena& arena = WorkspaceArena::of(device);
  // During CUDA graph capture the arena must not grow: the new buffer would come from the
  // graph's private pool. Records loaded from disk may not have grown it yet.
  const bool may_grow = !(hooks.capturing && hooks.capturing(device));
  auto lease = (may_grow || arena.bytes() >= workspace_bytes) ? arena.lease(workspace_bytes) : std::nullopt;
  if (!lease) return hooks.algorithms.front().run(args, at::Tensor());  // above the cap, or capturing
  return algorithm.run(args, lease->buffer);
}

at::Tensor ConvTuner::run(const ConvArgs& args) {
  const c10::Device device = args.input.device();
  const ConvDeviceHooks& hooks = hooks_for(device);
  const ConvProblem problem = problem_of(args);
  int slot = -1;
  int64_t workspace_bytes = 0;
  bool verified = false;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (const TuningRecord* record = table_.find(problem)) {
      slot = record->slot;
      workspace_bytes = record->workspace_bytes;
      verified = record->verified;
    }
  }
  if (slot >= 0 && !verified) {
    // A record from a file is a hint: the workspace its algorithm needs is computed here (a
    // smaller figure would let the algorithm write past its buffer), and a record whose
    // algorithm does not apply to this problem is dropped, and the problem tuned.
    const int64_t needed = hooks.algorithms.at(slot).workspace_bytes(args);
    std::lock_guard<std::mutex> guard(mutex_);
    if (needed < 0) {
      table_.forget(problem);
      slot = -1;
    } else {
      table_.verify(problem, needed);
      workspace_bytes = needed;
    }
  }
  if (slot < 0) {
    // Tuning runs outside graph capture (it synchronises and times): a capture runs the default.
    if (hooks.capturing && hooks.capturing(device)) return hooks.algorithms.front().run(args, at::Tensor());
    const TuningRecord record = tune(args).record;
    slot = record.slot;
    workspace_bytes = record.workspace_bytes;
  }
  return run_algorithm(hooks, slot, args, workspace_bytes);
}

TuningResult ConvTuner::tune(const ConvArgs& args) {
  const c10::Device device = args.input.device();
  const ConvDeviceHooks& hooks = hooks_for(device);
  TORCH_CHECK(!(hooks.capturing && hooks.capturing(device)),
              "shapecache::conv2d: cannot tune during CUDA graph capture; run the problem once before capturing");
  WorkspaceArena& arena = WorkspaceArena::of(device);
  std::lock_guard<std::mutex> guard(mutex_);

  TuningResult result;
  int best = -1;
  double best_time = 0;
  for (size_t i = 0; i < hooks.algorithms.size(); ++i) {
    const ConvAlgorithm& algorithm = hooks.algorithms[i];
    CandidateTiming timing;
    timing.algorithm = algorithm.name;
    timing.workspace_bytes = algorithm.workspace_bytes(args);
    if (timing.workspace_bytes < 0) {
      timing.skipped = "not applicable";
    } else if (!arena.allows(timing.workspace_bytes)) {
      timing.skipped = "workspace above the cap";
    } else {
      // A candidate that needs more than the arena holds is timed on scratch memory, freed
      // right after: the arena grows only for the algorithm that is chosen.
      const int64_t bytes = timing.workspace_bytes;
      // A candidate that fails to run (a cuDNN algorithm that reports it applies, then does
      // not; scratch memory that cannot be had) is skipped: only the default, which applies
      // to every problem, may fail the caller's call.
      try {
        if (algorithm.name == failing_candidate_) throw std::runtime_error("failure injected for tests");
        at::Tensor scratch;
        if (bytes > arena.bytes()) scratch = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
        timing.microseconds = median_microseconds(hooks, device, [&] {
          if (scratch.defined()) {
            algorithm.run(args, scratch);
          } else {
            run_algorithm(hooks, static_cast<int>(i), args, bytes);
          }
        });
      } catch (const std::exception& error) {
        if (i == 0) throw;
        timing.skipped = std::string("failed: ") + error.what();
        timing.microseconds = -1;
        result.candidates.push_back(timing);
        continue;
      }
      if (best < 0 || timing.microseconds < best_time) {
        best = static_cast<int>(i);
        best_time = timing.microseconds;
      }
    }
    result.candidates.push_back(timing);
  }
  TORCH_INTERNAL_ASSERT(best >= 0, "the default algorithm needs no workspace and always applies");

  TuningRecord& record = result.record;
  record.problem = problem_of(args);
  record.environment = environment(device);
  record.algorithm = hooks.algorithms[best].name;
  record.workspace_bytes = result.candidates[best].workspace_bytes;
  record.microseconds = best_time;
  record.slot = best;
  record.verified = true;
  table_.add_tuned(record);
  return result;
}

at::Tensor ConvTuner::run_named(const ConvArgs& args, const std::string& algorithm) {
  const ConvDeviceHooks& hooks = hooks_for(args.input.device());
  const int slot = slot_of(hooks, algorithm);
  if (slot < 0) {
    std::ostringstream names;
    for (const ConvAlgorithm& a : hooks.algorithms) names << " " << a.name;
    TORCH_CHECK(false, "shapecache::conv2d: no algorithm '", algorithm, "' on ", args.input.device(),
                "; there are:", names.str());
  }
  const int64_t bytes = hooks.algorithms[slot].workspace_bytes(args);
  TORCH_CHECK(bytes >= 0, "shapecache::conv2d: algorithm '", algorithm, "' does not apply to this problem");
  return run_algorithm(hooks, slot, args, bytes);
}

int64_t ConvTuner::load(const std::vector<TuningRecord>& records) {
  std::lock_guard<std::mutex> guard(mutex_);
  // The environments of this process's devices, per device type that the records mention.
  std::map<c10::DeviceType, std::set<std::string>> here;
  int64_t taken = 0;
  for (TuningRecord record : records) {
    const auto type = static_cast<c10::DeviceType>(record.problem.device_type);
    const auto& all = device_hooks();
    auto hooks = all.find(type);
    if (hooks == all.end()) continue;
    if (!here.count(type)) {
      for (const c10::Device& device : hooks->second.devices()) here[type].insert(environment(device));
    }
    if (!here[type].count(record.environment)) continue;  // measured on another machine or setup
    record.problem.environment = hash_environment(record.environment);
    record.slot = slot_of(hooks->second, record.algorithm);
    if (record.slot < 0) continue;  // an algorithm this build does not have
    if (table_.add_loaded(record)) ++taken;
  }
  return taken;
}

std::vector<TuningRecord> ConvTuner::take_unsaved() {
  std::lock_guard<std::mutex> guard(mutex_);
  return table_.take_unsaved();
}

bool ConvTuner::has_unsaved() {
  std::lock_guard<std::mutex> guard(mutex_);
  return table_.has_unsaved();
}

TunerStats ConvTuner::stats() {
  std::lock_guard<std::mutex> guard(mutex_);
  return TunerStats{table_.tuned(), table_.loaded(), table_.hits(), static_cast<int64_t>(table_.size())};
}

void ConvTuner::clear() {
  std::lock_guard<std::mutex> guard(mutex_);
  table_.clear();
}

void ConvTuner::fail_candidate_for_tests(std::string name) {
  std::lock_guard<std::mutex> guard(mutex_);
  failing_candidate_ = std::move(name);
}

}  // namespace shapecache
