// Self-describing payload format shared by every CompLL algorithm
// (paper 000 Table 4: concat / extract).
//
//   offset size  field
//        0    4  magic        0x5A435048 ("HPCZ" in memory order)
//        4    1  algo         algorithm id (AlgoId)
//        5    1  version      kFormatVersion
//        6    1  bits         algorithm-specific small parameter (bit width, ...)
//        7    1  kind         payload kind (0: full; PowerSGD 1: P, 2: Q)
//        8    4  check        FNV-1a 32 of the 48 header bytes with this field zero
//       12    4  count        algorithm-specific count (sparse pairs, rank)
//       16    8  numel        element count of the dense gradient
//       24    8  body_bytes   bytes that follow the header
//       32   16  words[4]     algorithm parameters (fp32 or uint32 bit patterns)
//   48 ...       body
//
// Little-endian (x86/ARM hosts). decode() checks everything it uses, so a
// truncated, corrupt or foreign payload raises FormatError instead of reading
// out of bounds. A payload is exactly kHeaderBytes + body_bytes long (trailing
// bytes are rejected); fp32 header words (scales, thresholds) must be finite;
// single-round payloads have kind 0. The check is FNV-1a: it detects accidents,
// not forgeries, so every field is validated against what the receiver knows
// (its output's element count) before anything is allocated. The body itself
// has no checksum: a flipped bit inside a quantised body decodes to a
// different (finite, in-range) value; sparse indices are range-checked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace hipress::compress {

constexpr uint32_t kMagic = 0x5A435048u;
constexpr uint8_t kFormatVersion = 1;
constexpr size_t kHeaderBytes = 48;

// Raised for payloads that cannot be decoded (bound to Python ValueError).
struct FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum AlgoId : uint8_t {
  kOneBit = 1,
  kTBQ = 2,
  kTernGrad = 3,
  kDGC = 4,
  kGradDrop = 5,
  kPowerSGD = 6,
  // GRACE's quantizers (docs/grace.md): ids 7-19; 20-29 GRACE's sparsifiers, hybrids and INCEPTIONN
  kSignSGD = 7,
  kSignum = 8,
  kEFSignSGD = 9,
  kQSGD = 10,
  kNatural = 11,
  kTernGradGrace = 12,
  kU8bit = 13,
  kFP16 = 14,
  kBF16 = 15,
  // GRACE's sparsifiers and hybrids (generated from hipress/dsl/specs/, sketch hand-written), and INCEPTIONN
  kRandomK = 20,
  kTopK = 21,
  kThreshold = 22,
  kAdaq = 23,
  kDGCGrace = 24,
  kSketch = 25,
  kPowerSGDGrace = 26,
  kInceptionn = 27,
  kFirstUserAlgo = 64,  // ids >= 64 are free for user algorithms
};

struct Header {
  uint32_t magic = kMagic;
  uint8_t algo = 0;
  uint8_t version = kFormatVersion;
  uint8_t bits = 0;
  uint8_t kind = 0;
  uint32_t check = 0;
  uint32_t count = 0;
  uint64_t numel = 0;
  uint64_t body_bytes = 0;
  uint32_t words[4] = {0, 0, 0, 0};

  float f(int i) const {
    float v;
    std::memcpy(&v, &words[i], 4);
    return v;
  }
  void set_f(int i, float v) { std::memcpy(&words[i], &v, 4); }
};
static_assert(sizeof(Header) == kHeaderBytes, "header layout");

inline uint32_t fnv1a(const uint8_t* p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 16777619u;
  return h;
}

inline uint32_t header_check(Header h) {
  h.check = 0;
  return fnv1a(reinterpret_cast<const uint8_t*>(&h), kHeaderBytes);
}

// Writes h (with its check) to out; out must hold kHeaderBytes.
inline void write_header(Header h, uint8_t* out) {
  h.check = header_check(h);
  std::memcpy(out, &h, kHeaderBytes);
}

const char* algo_name(uint8_t id);

// Reads and validates the header of a payload of `bytes` bytes: magic, version,
// check, that the body is exactly the rest of the payload, and (when expect_algo != 0) the algorithm id and
// (when expect_numel != SIZE_MAX) the element count.
Header read_header(const uint8_t* in, size_t bytes, uint8_t expect_algo, size_t expect_numel);

// The body size an algorithm expects must equal the header's; throws otherwise.
void expect_body(const Header& h, uint64_t expected, const char* what);

}  // namespace hipress::compress
