// BucketPolicy: which sizes of one dimension share a compiled entry.
//
//   exact          every size is its own bucket; the call is bit-identical to an uncached one
//   multiple_of(n) sizes round up to the next multiple of n
//   power_of_two   sizes round up to the next power of two (at least `minimum`)
//   one_of([...])  sizes round up to the next listed size; a size above the largest is an error
//
// Any policy but `exact` pads the input up to its bucket and crops outputs back (see
// call_key.h for the crop rule). Padding the batch dimension is exact for inference; padding
// spatial dimensions changes results near the padded border and is opt-in.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace shapecache {

class BucketPolicy {
 public:
  enum class Kind : uint8_t { kExact, kMultipleOf, kPowerOfTwo, kOneOf };

  static BucketPolicy exact() { return BucketPolicy(Kind::kExact, 1, {}); }

  static BucketPolicy multiple_of(int64_t n) {
    if (n < 1) {
      throw std::invalid_argument("multiple_of(n): n must be a positive integer, got " + std::to_string(n));
    }
    return BucketPolicy(Kind::kMultipleOf, n, {});
  }

  static BucketPolicy power_of_two(int64_t minimum = 1) {
    if (minimum < 1) {
      throw std::invalid_argument("power_of_two(minimum): minimum must be a positive integer, got " +
                                  std::to_string(minimum));
    }
    return BucketPolicy(Kind::kPowerOfTwo, minimum, {});
  }

  static BucketPolicy one_of(std::vector<int64_t> sizes) {
    if (sizes.empty()) {
      throw std::invalid_argument("one_of(...): expected at least one bucket size, got an empty list");
    }
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    if (sizes.front() < 1) {
      throw std::invalid_argument("one_of(...): bucket sizes must be positive, got " + std::to_string(sizes.front()));
    }
    return BucketPolicy(Kind::kOneOf, 1, std::move(sizes));
  }

  // The bucket that `size` falls into. Sizes of 0 stay 0 (empty tensors are never padded).
  int64_t bucket(int64_t size) const {
    if (size <= 0) return size;
    switch (kind_) {
      case Kind::kExact:
        return size;
      case Kind::kMultipleOf: {
        // Rounded up without overflow: the remainder first, then one checked addition.
        const int64_t rest = size % parameter_;
        int64_t b = size;
        if (rest != 0 && __builtin_add_overflow(size, parameter_ - rest, &b)) throw too_large(size);
        return b;
      }
      case Kind::kPowerOfTwo: {
        int64_t b = parameter_;
        while (b < size) {
          if (b > INT64_MAX / 2) throw too_large(size);  // doubling again would overflow
          b <<= 1;
        }
        return b;
      }
      case Kind::kOneOf: {
        auto it = std::lower_bound(sizes_.begin(), sizes_.end(), size);
        if (it == sizes_.end()) {
          throw std::out_of_range("size " + std::to_string(size) + " is above the largest bucket of " + describe() +
                                  "; add a larger bucket size or use multiple_of/power_of_two");
        }
        return *it;
      }
    }
    return size;
  }

  bool pads() const { return kind_ != Kind::kExact; }

  std::overflow_error too_large(int64_t size) const {
    return std::overflow_error("size " + std::to_string(size) + " has no bucket under " + describe() +
                               ": its bucket would not fit in a signed 64-bit integer");
  }
  Kind kind() const { return kind_; }
  int64_t parameter() const { return parameter_; }
  const std::vector<int64_t>& sizes() const { return sizes_; }

  std::string describe() const {
    std::ostringstream out;
    switch (kind_) {
      case Kind::kExact:
        out << "exact()";
        break;
      case Kind::kMultipleOf:
        out << "multiple_of(" << parameter_ << ")";
        break;
      case Kind::kPowerOfTwo:
        out << "power_of_two(minimum=" << parameter_ << ")";
        break;
      case Kind::kOneOf:
        out << "one_of([";
        for (size_t i = 0; i < sizes_.size(); ++i) out << (i ? ", " : "") << sizes_[i];
        out << "])";
        break;
    }
    return out.str();
  }

 private:
  BucketPolicy(Kind kind, int64_t parameter, std::vector<int64_t> sizes)
      : kind_(kind), parameter_(parameter), sizes_(std::move(sizes)) {}

  Kind kind_;
  int64_t parameter_;           // n of multiple_of, minimum of power_of_two
  std::vector<int64_t> sizes_;  // sorted, unique, positive (one_of only)
};

// The policies of one tensor argument, addressed by position and/or keyword name, so a
// call that passes the argument either way is bucketed the same.
struct ArgumentBuckets {
  int64_t position = -1;  // index in *args, or -1 for keyword-only
  std::string name;       // keyword name, or empty for positional-only
  std::vector<std::pair<int64_t, BucketPolicy>> dims;  // dimension (negative counts from the end) -> policy
};

}  // namespace shapecache
