// fp16 and bf16: the 16-bit casts (GRACE's FP16Compressor; bf16 the same with bfloat16), the
// baseline of the quantizers. Hand-written C++: the CompLL DSL has no 16-bit element type (packed
// codes are 1, 2, 4 or 8 bits; payload arrays of floats are fp32), so a spec cannot express them.
// Payload: the header (bits = 16, no words) and n little-endian 16-bit values. Both round to
// nearest even, as torch's casts do (bf16: NaN -> 0x7FC0, torch's quiet NaN).
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "compress/compressor.h"
#include "compress/format.h"
#include "compress/ops.h"
#include "compress/thread_pool.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace hipress::compress {
namespace {

inline uint16_t to_fp16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
inline float from_fp16(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

// fp16 <-> fp32 of m values: F16C's conversions 8 at a time (GCC does not vectorise _Float16 casts
// without AVX512-FP16), round to nearest even as the scalar cast; the scalar cast for the rest.
inline void fp16_from_f32(const float* in, size_t m, uint16_t* out) {
  size_t j = 0;
#if defined(__F16C__)
  for (; j + 8 <= m; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; j < m; ++j) out[j] = to_fp16(in[j]);
}
inline void f32_from_fp16(const uint16_t* in, size_t m, float* out) {
  size_t j = 0;
#if defined(__F16C__)
  for (; j + 8 <= m; j += 8)
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j))));
#endif
  for (; j < m; ++j) out[j] = from_fp16(in[j]);
}

constexpr size_t kTile = 1024;

template <bool BF>
class HalfCast final : public Compressor {
 public:
  explicit HalfCast(const Params& p)
      : Compressor({BF ? "bf16" : "fp16", BF ? kBF16 : kFP16, Category::kQuantization, 0.5, false, 1}) {
    ParamReader r(info_.name, p);
    r.finish();
  }
  size_t max_encoded_bytes(size_t n, size_t, size_t) const override { return kHeaderBytes + 2 * n; }

  size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView*) const override {
    if (cap < max_encoded_bytes(n, 0, 0)) throw std::invalid_argument(info_.name + ": output buffer too small");
    Header h;
    h.algo = info_.id;
    h.bits = 16;
    h.numel = n;
    h.body_bytes = 2 * static_cast<uint64_t>(n);
    write_header(h, out);
    uint8_t* body = out + kHeaderBytes;
    parallel_range(n, ops::kGrain, [&](size_t b, size_t e) {
      uint16_t tmp[kTile];
      for (size_t i = b; i < e; i += kTile) {
        const size_t m = std::min(kTile, e - i);
        if (BF) {
          for (size_t j = 0; j < m; ++j) tmp[j] = ops::float_to_bf16(in[i + j]);
        } else {
          fp16_from_f32(in + i, m, tmp);
        }
        std::memcpy(body + 2 * i, tmp, 2 * m);
      }
    });
    return kHeaderBytes + 2 * n;
  }

  void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const override {
    Header h = read_header(in, bytes, info_.id, n);
    if (h.bits != 16 || h.count != 0 || h.kind != 0)
      throw FormatError(info_.name + " payload: unexpected bit width " + std::to_string(h.bits) + " / count " +
                        std::to_string(h.count) + " / kind " + std::to_string(h.kind));
    expect_body(h, 2 * static_cast<uint64_t>(n), info_.name.c_str());
    const uint8_t* body = in + kHeaderBytes;
    parallel_range(n, ops::kGrain, [&](size_t b, size_t e) {
      uint16_t tmp[kTile];
      for (size_t i = b; i < e; i += kTile) {
        const size_t m = std::min(kTile, e - i);
        std::memcpy(tmp, body + 2 * i, 2 * m);
        float* o = out + i;
        alignas(64) float v[kTile];
        if (BF) {
          for (size_t j = 0; j < m; ++j) v[j] = ops::bf16_to_float(tmp[j]);
        } else {
          f32_from_fp16(tmp, m, v);
        }
        if (add) {
          for (size_t j = 0; j < m; ++j) o[j] += alpha * v[j];
        } else if (alpha == 1.0f) {
          std::memcpy(o, v, 4 * m);
        } else {
          for (size_t j = 0; j < m; ++j) o[j] = alpha * v[j];
        }
      }
    });
  }
};

using FP16Cast = HalfCast<false>;
using BF16Cast = HalfCast<true>;

}  // namespace
HIPRESS_REGISTER_COMPRESSOR("fp16", FP16Cast);
HIPRESS_REGISTER_COMPRESSOR("bf16", BF16Cast);
}  // namespace hipress::compress
