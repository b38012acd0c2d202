// INCEPTIONN (Li et al., MICRO 2018) as GRACE implements it (grace_dl/tensorflow/compressor/inceptionn.py;
// GRACE Table I: quantization, deterministic, no memory): every fp32 element is sent in 32, 16, 8 or 0
// bits by the range of its exponent, plus a 2-bit tag saying which.
//
//   e = the element's biased exponent (8 bits), eb = 127 + trunc(log10(error_bound / 2)) (GRACE's
//   formula: 117, i.e. 2^-10, for its default error_bound 2e-10), mid = eb + ceil((127 - eb) / 2)
//   tag 3: e >= 127 (|x| >= 1, inf, NaN)   the raw fp32 bits
//   tag 2: mid <= e < 127                  sign + 15-bit fixed point, truncated
//   tag 1: eb <= e < mid                   sign + 7-bit fixed point, truncated
//   tag 0: e < eb (|x| < 2^(eb-127))       nothing: decodes to 0
//
// Fixed point: the magnitude field's top bit is worth 2^(top-127), top the largest exponent of the
// class (126 for 16 bits, mid - 1 for 8 bits), so the field is |x| / 2^(top-127) * 2^(W-2) rounded
// toward zero (W = 16 or 8). Where this differs from GRACE: GRACE anchors both fields at 2^0, so its
// 16-bit field never uses its top bit and its 8-bit field has no room for exponents below 2^-6:
// with the default bound, the leading bit of every 8-bit element below 2^-6 shifts out and the
// element does not decode to its value. Anchoring each field at its class's top keeps every
// element of [2^(eb-127), 1) (error below 2^(top-127-W+2)); an exponent more than 7 (15) below
// its class's top (only when 127 - eb > 14) truncates to 0, as a fixed-point value below its
// resolution does.
//
// Hand-written, not a CompLL spec: the DSL cannot express it (three data-dependent arrays of
// different element widths in one payload, 16-bit elements, bit access to the float).
//
// Payload: header (bits 2, count 0, words: n32, n16, n8, eb), then the 2-bit tags packed LSB first
// (ceil(n / 4) bytes, padding 0), the n32 fp32 values, the n16 16-bit codes, the n8 8-bit codes,
// each array in element order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "compress/compressor.h"
#include "compress/format.h"
#include "compress/ops.h"
#include "compress/thread_pool.h"

namespace hipress::compress {
namespace {

struct Classes {
  uint32_t eb, mid;
  // the tag of an fp32 bit pattern
  uint8_t tag(uint32_t u) const {
    const uint32_t e = (u >> 23) & 0xffu;
    return e >= 127 ? 3 : e >= mid ? 2 : e >= eb ? 1 : 0;
  }
};

inline uint32_t mid_of(uint32_t eb) { return eb + (127 - eb + 1) / 2; }

// sign + fixed-point field of W bits for an element of exponent e in a class whose largest exponent is top
template <int W>
inline uint32_t fixed_code(uint32_t u, uint32_t top) {
  const uint32_t e = (u >> 23) & 0xffu;
  const uint32_t significand = (u & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 25 - W + top - e;
  const uint32_t field = shift >= 24 ? 0u : significand >> shift;
  return ((u >> 31) << (W - 1)) | field;
}

template <int W>
inline float fixed_value(uint32_t code, float scale) {
  const float mag = static_cast<float>(code & ((1u << (W - 1)) - 1)) * scale;
  return (code >> (W - 1)) ? -mag : mag;
}

constexpr size_t kGrain = ops::kGrain;  // a multiple of 4: a chunk's tags fill whole bytes
static_assert(kGrain % 4 == 0, "tag bytes per chunk");

struct Counts {
  uint64_t c[4] = {0, 0, 0, 0};
};

class Inceptionn final : public Compressor {
 public:
  explicit Inceptionn(const Params& p) : Compressor({"inceptionn", kInceptionn, Category::kQuantization, 0.3125, false, 1}) {
    ParamReader r("inceptionn", p);
    const double bound = r.get("error_bound", 2e-10);
    r.finish();
    if (!(bound > 0) || !std::isfinite(bound))
      throw std::invalid_argument("inceptionn: error_bound must be a positive finite number");
    const double eb = 127.0 + std::trunc(std::log10(bound / 2));
    if (!(eb >= 1 && eb <= 126))
      throw std::invalid_argument("inceptionn: error_bound must give an exponent 127 + trunc(log10(error_bound / 2)) in "
                                  "[1, 126] (error_bound in [2e-126, 0.2))");
    cls_.eb = static_cast<uint32_t>(eb);
    cls_.mid = mid_of(cls_.eb);
  }

  size_t max_encoded_bytes(size_t n, size_t, size_t) const override { return kHeaderBytes + (n + 3) / 4 + 4 * n; }

  size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView*) const override {
    if (cap < max_encoded_bytes(n, 0, 0)) throw std::invalid_argument("inceptionn: output buffer too small");
    if (n > 0xffffffffULL) throw std::invalid_argument("inceptionn: more than 2^32 - 1 elements");
    const size_t tag_bytes = (n + 3) / 4;
    uint8_t* tags = out + kHeaderBytes;
    const size_t nchunks = (n + kGrain - 1) / kGrain;
    std::vector<Counts> counts(nchunks);
    // pass 1: tags and per-chunk counts
    parallel_range(n, kGrain, [&](size_t b, size_t e) {
      Counts& c = counts[b / kGrain];
      for (size_t i = b; i < e; i += 4) {
        uint8_t byte = 0;
        for (size_t j = 0; j < 4 && i + j < e; ++j) {
          uint32_t u;
          std::memcpy(&u, in + i + j, 4);
          const uint8_t t = cls_.tag(u);
          ++c.c[t];
          byte |= static_cast<uint8_t>(t << (2 * j));
        }
        tags[i / 4] = byte;
      }
    });
    // every chunk's offset in each value array
    std::vector<Counts> start(nchunks);
    Counts total;
    for (size_t k = 0; k < nchunks; ++k) {
      start[k] = total;
      for (int t = 1; t < 4; ++t) total.c[t] += counts[k].c[t];
    }
    uint8_t* v32 = tags + tag_bytes;
    uint8_t* v16 = v32 + 4 * total.c[3];
    uint8_t* v8 = v16 + 2 * total.c[2];
    // pass 2: the values of each class, in element order
    parallel_range(n, kGrain, [&](size_t b, size_t e) {
      Counts at = start[b / kGrain];
      for (size_t i = b; i < e; ++i) {
        uint32_t u;
        std::memcpy(&u, in + i, 4);
        switch (cls_.tag(u)) {
          case 3:
            std::memcpy(v32 + 4 * at.c[3]++, &u, 4);
            break;
          case 2: {
            const uint16_t code = static_cast<uint16_t>(fixed_code<16>(u, 126));
            std::memcpy(v16 + 2 * at.c[2]++, &code, 2);
            break;
          }
          case 1:
            v8[at.c[1]++] = static_cast<uint8_t>(fixed_code<8>(u, cls_.mid - 1));
            break;
          default:
            break;
        }
      }
    });
    Header h;
    h.algo = kInceptionn;
    h.bits = 2;
    h.numel = n;
    h.body_bytes = tag_bytes + 4 * total.c[3] + 2 * total.c[2] + total.c[1];
    h.words[0] = static_cast<uint32_t>(total.c[3]);
    h.words[1] = static_cast<uint32_t>(total.c[2]);
    h.words[2] = static_cast<uint32_t>(total.c[1]);
    h.words[3] = cls_.eb;
    write_header(h, out);
    return kHeaderBytes + h.body_bytes;
  }

  void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const override {
    Header h = read_header(in, bytes, kInceptionn, n);
    if (h.bits != 2 || h.count != 0 || h.kind != 0)
      throw FormatError("inceptionn payload: unexpected bit width " + std::to_string(h.bits) + " / count " +
                        std::to_string(h.count) + " / kind " + std::to_string(h.kind));
    const uint32_t eb = h.words[3];
    if (eb < 1 || eb > 126) throw FormatError("inceptionn payload: exponent bound " + std::to_string(eb) + " not in [1, 126]");
    const uint64_t n32 = h.words[0], n16 = h.words[1], n8 = h.words[2];
    if (n32 + n16 + n8 > n)
      throw FormatError("inceptionn payload: " + std::to_string(n32 + n16 + n8) + " values for " + std::to_string(n) +
                        " elements");
    const size_t tag_bytes = (n + 3) / 4;
    expect_body(h, tag_bytes + 4 * n32 + 2 * n16 + n8, "inceptionn");
    const uint8_t* tags = in + kHeaderBytes;
    if (n % 4 != 0 && (tags[tag_bytes - 1] >> (2 * (n % 4))) != 0)
      throw FormatError("inceptionn payload: padding tags are not zero");
    // pass 1: the tags must announce exactly the header's counts (checked before anything is written)
    const size_t nchunks = (n + kGrain - 1) / kGrain;
    std::vector<Counts> counts(nchunks);
    parallel_range(n, kGrain, [&](size_t b, size_t e) {
      Counts& c = counts[b / kGrain];
      for (size_t i = b; i < e; ++i) ++c.c[(tags[i / 4] >> (2 * (i % 4))) & 3u];
    });
    std::vector<Counts> start(nchunks);
    Counts total;
    for (size_t k = 0; k < nchunks; ++k) {
      start[k] = total;
      for (int t = 1; t < 4; ++t) total.c[t] += counts[k].c[t];
    }
    if (total.c[3] != n32 || total.c[2] != n16 || total.c[1] != n8)
      throw FormatError("inceptionn payload: the tags announce " + std::to_string(total.c[3]) + " / " +
                        std::to_string(total.c[2]) + " / " + std::to_string(total.c[1]) +
                        " 32 / 16 / 8-bit values, the header " + std::to_string(n32) + " / " + std::to_string(n16) +
                        " / " + std::to_string(n8));
    const uint8_t* v32 = tags + tag_bytes;
    const uint8_t* v16 = v32 + 4 * n32;
    const uint8_t* v8 = v16 + 2 * n16;
    const float scale16 = std::ldexp(1.0f, 126 - 127 - 14);
    const float scale8 = std::ldexp(1.0f, static_cast<int>(mid_of(eb)) - 1 - 127 - 6);
    // pass 2
    parallel_range(n, kGrain, [&](size_t b, size_t e) {
      Counts at = start[b / kGrain];
      for (size_t i = b; i < e; ++i) {
        float v = 0.0f;
        switch ((tags[i / 4] >> (2 * (i % 4))) & 3u) {
          case 3:
            std::memcpy(&v, v32 + 4 * at.c[3]++, 4);
            break;
          case 2: {
            uint16_t code;
            std::memcpy(&code, v16 + 2 * at.c[2]++, 2);
            v = fixed_value<16>(code, scale16);
            break;
          }
          case 1:
            v = fixed_value<8>(v8[at.c[1]++], scale8);
            break;
          default:
            break;
        }
        if (add)
          out[i] += alpha * v;
        else
          out[i] = alpha == 1.0f ? v : alpha * v;
      }
    });
  }

 private:
  Classes cls_{};
};

}  // namespace
HIPRESS_REGISTER_COMPRESSOR("inceptionn", Inceptionn);
}  // namespace hipress::compress
