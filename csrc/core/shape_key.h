// ShapeKey: what makes two calls of a cached function share one compiled entry.
//
// A key is a flat sequence of 64-bit words, filled in one pass over the call's arguments
// and compared and hashed over its bytes (the ParamsHash idea, with a variable length
// because a call has any number of tensors and values). Every item starts with a tag word,
// so no two different argument lists can produce the same word sequence:
//   tensor:  kTensor, TensorSignature (one word), then ndim words of bucketed sizes, then
//            ndim words of strides when the layout is kOtherStrides
//   int:     kInt, value            float: kFloat, bit pattern     bool: kBool, value
//   None:    kNone                   string: kString, length, bytes packed 8 per word
//   tuple/list/dict: kTuple/kList/kDict, item count, then the items (dict: name, value)
//   keyword: kKeyword, then the name as a string, then the value
//   dtype / device values: kDtype, scalar type / kDevice, type, index
//   context: kContext, then words the caller chooses (function identity, autograd mode...)
// Torch-free on purpose: dtype and device arrive as small integers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace shapecache {

enum class KeyTag : uint64_t {
  kTensor = 0x5445'4e53'0000'0001ULL,
  kInt,
  kFloat,
  kBool,
  kNone,
  kString,
  kTuple,
  kList,
  kDict,
  kKeyword,
  kDtype,    // a torch.dtype passed as a value
  kDevice,   // a torch.device passed as a value
  kContext,  // call context: function identity, grad mode, training flag
};

// How a tensor's memory is laid out, as far as compiled artifacts care: a graph captured
// for a contiguous input is not valid for a channels-last one of the same shape.
enum class MemoryLayout : uint8_t {
  kContiguous = 0,
  kChannelsLast = 1,
  kChannelsLast3d = 2,
  kOtherStrides = 3,
};

// Everything about one tensor argument except its sizes, packed into one word. Plain and
// standard-layout; zero it before filling so the padding bytes hash the same every time.
struct TensorSignature {
  uint8_t ndim;            // number of sizes that follow in the key
  int8_t dtype;            // c10::ScalarType as an integer
  int8_t device_type;      // c10::DeviceType as an integer
  uint8_t layout;          // MemoryLayout
  int16_t device_index;    // -1 for "current" / CPU
  uint8_t requires_grad;   // 0 or 1: autograd changes what a compiled graph records
  // 0, or 1 + the position (among the call's tensors, up to 254) of an earlier tensor this
  // one shares storage with: a graph captured for f(a, a) reads one buffer twice, and must
  // not serve f(b, c).
  uint8_t alias;
};
static_assert(sizeof(TensorSignature) == sizeof(uint64_t), "TensorSignature must pack into one key word");

class ShapeKey {
 public:
  void add_tag(KeyTag tag) { words_.push_back(static_cast<uint64_t>(tag)); }
  void add_word(uint64_t word) { words_.push_back(word); }

  void add_tensor(const TensorSignature& signature, const int64_t* sizes) {
    add_tag(KeyTag::kTensor);
    uint64_t packed = 0;
    std::memcpy(&packed, &signature, sizeof(packed));
    words_.push_back(packed);
    for (uint8_t d = 0; d < signature.ndim; ++d) {
      words_.push_back(static_cast<uint64_t>(sizes[d]));
    }
  }
  void add_int(int64_t value) {
    add_tag(KeyTag::kInt);
    words_.push_back(static_cast<uint64_t>(value));
  }
  void add_float(double value) {
    add_tag(KeyTag::kFloat);
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits));
    words_.push_back(bits);
  }
  void add_bool(bool value) {
    add_tag(KeyTag::kBool);
    words_.push_back(value ? 1 : 0);
  }
  void add_none() { add_tag(KeyTag::kNone); }
  void add_string(std::string_view text) {
    add_tag(KeyTag::kString);
    words_.push_back(text.size());
    for (size_t offset = 0; offset < text.size(); offset += sizeof(uint64_t)) {
      uint64_t chunk = 0;
      std::memcpy(&chunk, text.data() + offset, std::min(sizeof(uint64_t), text.size() - offset));
      words_.push_back(chunk);
    }
  }
  void begin_container(KeyTag tag, size_t item_count) {
    add_tag(tag);
    words_.push_back(item_count);
  }

  const std::vector<uint64_t>& words() const { return words_; }
  size_t size_in_words() const { return words_.size(); }

  // Hash over the key's bytes, word by word (splitmix64 finaliser per word, combined).
  size_t hash() const {
    uint64_t h = 0x9e37'79b9'7f4a'7c15ULL ^ words_.size();
    for (uint64_t w : words_) {
      uint64_t z = w + 0x9e37'79b9'7f4a'7c15ULL;
      z = (z ^ (z >> 30)) * 0xbf58'476d'1ce4'e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d0'49bb'1331'11ebULL;
      z ^= z >> 31;
      h = (h ^ z) * 0x0000'0100'0000'01b3ULL + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }

  bool operator==(const ShapeKey& other) const { return words_ == other.words_; }
  bool operator!=(const ShapeKey& other) const { return !(*this == other); }

 private:
  std::vector<uint64_t> words_;
};

struct ShapeKeyHash {
  size_t operator()(const ShapeKey& key) const { return key.hash(); }
};

}  // namespace shapecache
