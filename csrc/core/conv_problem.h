// ConvProblem: one exact convolution problem, the key of a tuning record; TuningTable: the
// records of a process, with the ones not yet written to disk.
//
// A record is only valid where it was measured: the environment (device model, library
// versions, thread count) is part of the key, as a hash here and as text in the file.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace shapecache {

// Plain and standard-layout: zero it before filling, compare and hash over its bytes.
struct ConvProblem {
  uint64_t environment;  // hash of the environment text (see TuningRecord::environment)
  int64_t n, c, h, w;    // input sizes
  int64_t k, r, s;       // output channels, kernel height, kernel width
  int64_t stride[2];
  int64_t padding[2];
  int64_t dilation[2];
  int64_t groups;
  int8_t device_type;  // c10::DeviceType
  int8_t dtype;        // c10::ScalarType
  uint8_t layout;      // 0: contiguous, 1: channels-last
  uint8_t has_bias;
  uint8_t reserved[4];  // always 0

  bool operator==(const ConvProblem& other) const { return std::memcmp(this, &other, sizeof(*this)) == 0; }
};
static_assert(sizeof(ConvProblem) == 8 + 8 * 14 + 8, "ConvProblem must have no implicit padding");

struct ConvProblemHash {
  size_t operator()(const ConvProblem& p) const {
    // FNV-1a over the bytes.
    const auto* bytes = reinterpret_cast<const unsigned char*>(&p);
    uint64_t h = 0xcbf2'9ce4'8422'2325ULL;
    for (size_t i = 0; i < sizeof(p); ++i) h = (h ^ bytes[i]) * 0x0000'0100'0000'01b3ULL;
    return static_cast<size_t>(h);
  }
};

// The algorithm chosen for a problem, with what it costs.
struct TuningRecord {
  ConvProblem problem;
  std::string environment;  // "torch 2.13.0; cpu Intel(R) Xeon(R) ...; threads 2"
  std::string algorithm;    // e.g. "aten", "aten_channels_last", "im2col_gemm", "cudnn:1"
  int64_t workspace_bytes = 0;
  double microseconds = 0;  // median time of one call when tuned
  int slot = -1;            // index of `algorithm` among the tuner's candidates (not persisted)
  // Whether workspace_bytes was computed in this process for this problem (not persisted):
  // a record read from a file is a hint, never trusted to size a buffer.
  bool verified = false;
};

uint64_t hash_environment(const std::string& environment);

class TuningTable {
 public:
  const TuningRecord* find(const ConvProblem& problem) {
    auto it = records_.find(problem);
    if (it == records_.end()) return nullptr;
    ++hits_;
    return &it->second;
  }

  // A record measured in this process: kept, and queued to be written out.
  void add_tuned(const TuningRecord& record) {
    records_[record.problem] = record;
    unsaved_.push_back(record);
    ++tuned_;
  }

  // A record read from disk: kept; not queued. Returns false if the problem was known.
  // A loaded record checked against its problem: its algorithm needs `bytes` of workspace.
  void verify(const ConvProblem& problem, int64_t bytes) {
    auto it = records_.find(problem);
    if (it == records_.end()) return;
    it->second.workspace_bytes = bytes;
    it->second.verified = true;
  }

  // A loaded record whose algorithm does not apply to its problem: as if it never was.
  void forget(const ConvProblem& problem) { records_.erase(problem); }

  bool add_loaded(const TuningRecord& record) {
    auto inserted = records_.emplace(record.problem, record).second;
    if (inserted) ++loaded_;
    return inserted;
  }

  // Records tuned since the last call (to write to disk).
  std::vector<TuningRecord> take_unsaved() {
    std::vector<TuningRecord> out;
    out.swap(unsaved_);
    return out;
  }

  bool has_unsaved() const { return !unsaved_.empty(); }
  void clear() {
    records_.clear();
    unsaved_.clear();
  }
  size_t size() const { return records_.size(); }
  int64_t tuned() const { return tuned_; }    // problems measured in this process
  int64_t loaded() const { return loaded_; }  // records read from disk
  int64_t hits() const { return hits_; }      // lookups that found a record

 private:
  std::unordered_map<ConvProblem, TuningRecord, ConvProblemHash> records_;
  std::vector<TuningRecord> unsaved_;
  int64_t tuned_ = 0;
  int64_t loaded_ = 0;
  int64_t hits_ = 0;
};

inline uint64_t hash_environment(const std::string& environment) {
  uint64_t h = 0xcbf2'9ce4'8422'2325ULL;
  for (unsigned char ch : environment) h = (h ^ ch) * 0x0000'0100'0000'01b3ULL;
  return h;
}

}  // namespace shapecache
