// Scalar helpers of the CompLL CUDA back end, usable on the host and the device.
//
// Everything here is `__host__ __device__` so the user-defined functions a spec
// declares (generated as `__host__ __device__` inline functions) run unchanged
// in kernels and in the host-side orchestration (e.g. the 2^K-entry decode
// table). Semantics are those of hipress/dsl/prelude.h.txt (the CPU back end):
// 64-bit wrapping integer arithmetic, saturating conversions, and the
// counter-based generator of csrc/compress/rng.h (included: its functions are
// __host__ __device__ under nvcc). tests/unit/test_dsl_cuda.py compiles this header with
// g++ (with __host__/__device__ defined away) and checks it against rng.h and
// format.h bit for bit.
//
// Requires: __host__ and __device__ defined (nvcc, or a shim that defines them away).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "compress/rng.h"

#define HPD __host__ __device__ inline

namespace hpd {

// ---- counter-based random numbers: csrc/compress/rng.h itself (host and device under nvcc) ----
using hipress::compress::mix32;
using hipress::compress::rng_key;
using hipress::compress::rng_u32;
using hipress::compress::RngKey;
using hipress::compress::splitmix64;
using hipress::compress::u32_to_index;
using hipress::compress::u32_to_unit;

// ---- bit patterns ----
HPD uint32_t fbits(float v) { uint32_t b; memcpy(&b, &v, 4); return b; }
HPD float bitsf(uint32_t b) { float v; memcpy(&v, &b, 4); return v; }

// ---- the 48-byte payload header of csrc/compress/format.h ----
// Serialises the fields in format.h's little-endian layout and stores the
// FNV-1a check, exactly like write_header (checked on the host by the tests).
struct HeaderFields {
  uint8_t algo = 0, bits = 0, kind = 0;
  uint32_t count = 0;
  uint64_t numel = 0, body_bytes = 0;
  uint32_t words[4] = {0, 0, 0, 0};
};
constexpr uint32_t kMagic = 0x5A435048u;
constexpr uint8_t kFormatVersion = 1;
constexpr size_t kHeaderBytes = 48;
HPD void put32(uint8_t* p, uint32_t v) { for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i)); }
HPD void put64(uint8_t* p, uint64_t v) { for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i)); }
HPD uint32_t fnv1a(const uint8_t* p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 16777619u;
  return h;
}
HPD void header_serialize(const HeaderFields& f, uint8_t* out /* 48 bytes */) {
  put32(out, kMagic);
  out[4] = f.algo;
  out[5] = kFormatVersion;
  out[6] = f.bits;
  out[7] = f.kind;
  put32(out + 8, 0);
  put32(out + 12, f.count);
  put64(out + 16, f.numel);
  put64(out + 24, f.body_bytes);
  for (int w = 0; w < 4; ++w) put32(out + 32 + 4 * w, f.words[w]);
  put32(out + 8, fnv1a(out, kHeaderBytes));
}
HPD size_t packed_bytes(size_t n, int bits) { return (n * static_cast<size_t>(bits) + 7) / 8; }

// Array views passed to kernels (device pointers + lengths; packed: LSB first, `bits` per code).
struct FView { const float* p; size_t n; };
struct IView { const int32_t* p; size_t n; };
struct PView { const uint8_t* p; size_t n; int bits; };

}  // namespace hpd

namespace hp {
// Integer arithmetic of the DSL: 64-bit, wrapping, never undefined (prelude.h.txt).
HPD int64_t add(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b)); }
HPD int64_t sub(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b)); }
HPD int64_t mul(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b)); }
HPD int64_t neg(int64_t a) { return sub(0, a); }
HPD int64_t div(int64_t a, int64_t b) { return b == 0 ? 0 : (b == -1 ? neg(a) : a / b); }
HPD int64_t mod(int64_t a, int64_t b) { return (b == 0 || b == -1) ? 0 : a % b; }
HPD int64_t shl(int64_t a, int64_t b) { return (b < 0 || b > 63) ? 0 : static_cast<int64_t>(static_cast<uint64_t>(a) << b); }
HPD int64_t shr(int64_t a, int64_t b) { return (b < 0 || b > 63) ? (a < 0 ? -1 : 0) : (a >> b); }
HPD int64_t iabs(int64_t a) { return a < 0 ? neg(a) : a; }
HPD int64_t w32(int64_t a) { return static_cast<int64_t>(static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(a)))); }
HPD int64_t f2i(float f) {
  if (!(f == f)) return 0;
  if (f <= -2147483648.0f) return -2147483647 - 1;
  if (f >= 2147483647.0f) return 2147483647;
  return static_cast<int64_t>(f);
}
HPD int64_t f2i(double f) {
  if (!(f == f)) return 0;
  if (f <= -2147483648.0) return -2147483647 - 1;
  if (f >= 2147483647.0) return 2147483647;
  return static_cast<int64_t>(f);
}
HPD int64_t i2u(int64_t a, int bits) {
  int64_t mx = (int64_t{1} << bits) - 1;
  return a < 0 ? 0 : (a > mx ? mx : a);
}
HPD int64_t f2u(float f, int bits) {
  float mx = static_cast<float>((1 << bits) - 1);
  f = f > 0.0f ? f : 0.0f;  // NaN -> 0
  f = f < mx ? f : mx;
  return static_cast<int64_t>(f);
}
HPD int64_t f2u(double f, int bits) {
  double mx = static_cast<double>((1 << bits) - 1);
  f = f > 0.0 ? f : 0.0;
  f = f < mx ? f : mx;
  return static_cast<int64_t>(f);
}
HPD float fmin2(float a, float b) { return b < a ? b : a; }
HPD float fmax2(float a, float b) { return b > a ? b : a; }
HPD double fmin2(double a, double b) { return b < a ? b : a; }
HPD double fmax2(double a, double b) { return b > a ? b : a; }
HPD float vfloor(float x) { return ::floorf(x); }  // the CPU prelude's vfloor is std::floor's value
HPD double vfloor(double x) { return ::floor(x); }
// ilogb(x): the exponent of |x| (floor(log2 |x|), exact, subnormals included); 0 and NaN: INT32_MIN,
// inf: INT32_MAX. ldexp(x, k): x * 2^k, correctly rounded (x * 2^k is exact in double for the clamped
// k, then rounded once to float). Both checked against std::ilogb / std::ldexp (all 2^32 floats for
// ilogb); written without branches so that a loop calling them vectorises.
HPD int64_t ilogb(float x) {
  uint32_t b; memcpy(&b, &x, 4);
  b &= 0x7fffffffu;
  const int64_t e = static_cast<int64_t>(b >> 23);
  const float s = std::fabs(x) * 8388608.0f;  // a subnormal times 2^23 is normal: its exponent - 23
  uint32_t bs; memcpy(&bs, &s, 4);
  const int64_t es = static_cast<int64_t>(bs >> 23) - 127 - 23;
  int64_t r = e == 0 ? es : e - 127;
  r = b == 0 ? INT64_C(-2147483648) : r;
  return e == 255 ? ((b & 0x7fffffu) ? INT64_C(-2147483648) : INT64_C(2147483647)) : r;
}
HPD float ldexp(float x, int64_t k) {
  const int64_t kc = k < -400 ? -400 : (k > 400 ? 400 : k);  // beyond: 0 or inf for any float, as 2^k
  const uint64_t pb = static_cast<uint64_t>(kc + 1023) << 52;
  double p; memcpy(&p, &pb, 8);
  return static_cast<float>(static_cast<double>(x) * p);
}
// random<float>(0, 1) and random<int32>(a, b) at one counter.
HPD float uni(hpd::RngKey k, uint64_t ctr) { return hpd::u32_to_unit(hpd::rng_u32(k, ctr)); }
HPD int64_t rint(hpd::RngKey k, uint64_t ctr, int64_t a, int64_t b) {
  if (b <= a) return a;
  uint64_t range = static_cast<uint64_t>(b - a);
  if (range > 0xffffffffULL) range = 0xffffffffULL;
  return a + static_cast<int64_t>(hpd::u32_to_index(hpd::rng_u32(k, ctr), static_cast<uint32_t>(range)));
}
HPD uint8_t get_bits(const uint8_t* p, size_t i, int bits) {
  size_t bit = i * static_cast<size_t>(bits);
  return static_cast<uint8_t>((p[bit / 8] >> (bit % 8)) & ((1u << bits) - 1));
}

// Math built-ins of the DSL (the CPU back end's std:: calls): the C functions
// that CUDA declares __host__ __device__. floor/ceil/round/fabs/sqrt are exact
// on both; exp/log/pow on the device are within the CUDA math library's ULP
// bounds, not necessarily the host libm's bits.
namespace m {
#define HPD_MATH1(fn) \
  HPD float fn(float x) { return ::fn##f(x); } \
  HPD double fn(double x) { return ::fn(x); }
HPD_MATH1(floor)
HPD_MATH1(ceil)
HPD_MATH1(round)
HPD_MATH1(sqrt)
HPD_MATH1(exp)
HPD_MATH1(log)
#undef HPD_MATH1
HPD float fabs(float x) { return hpd::bitsf(hpd::fbits(x) & 0x7fffffffu); }
HPD double fabs(double x) { uint64_t b; memcpy(&b, &x, 8); b &= 0x7fffffffffffffffULL; memcpy(&x, &b, 8); return x; }
HPD float pow(float a, float b) { return ::powf(a, b); }
HPD double pow(double a, double b) { return ::pow(a, b); }
HPD bool signbit(float x) { return (hpd::fbits(x) >> 31) != 0; }
HPD bool signbit(double x) { uint64_t b; memcpy(&b, &x, 8); return (b >> 63) != 0; }
HPD bool isnan(float x) { return x != x; }
HPD bool isnan(double x) { return x != x; }
template <class T> HPD T min(T a, T b) { return b < a ? b : a; }
template <class T> HPD T max(T a, T b) { return a < b ? b : a; }
}  // namespace m
}  // namespace hp
