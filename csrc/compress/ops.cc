// Numerical results here must match hipress/compression/reference.py bit for
// bit: keep FMA contraction off so a*b+c rounds twice, as numpy does.
#pragma GCC optimize("fp-contract=off")

#include "compress/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#if defined(__AVX2__)
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on _mm512_undefined_*().
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

namespace hipress::compress::ops {
namespace {

inline size_t nchunks_of(size_t n) { return (n + kGrain - 1) / kGrain; }
inline size_t chunk_end(size_t c, size_t n) { return std::min(n, (c + 1) * kGrain); }

inline uint32_t float_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

// The target's native float vector (GCC vector types: SSE2, AVX or AVX-512 registers), for loops whose
// lane-by-lane arithmetic is written once for every target.
#if defined(__AVX512F__)
constexpr size_t kVecFloats = 16;
#elif defined(__AVX__)
constexpr size_t kVecFloats = 8;
#else
constexpr size_t kVecFloats = 4;
#endif
typedef float vfloat __attribute__((vector_size(kVecFloats * sizeof(float))));
inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
// A store that bypasses the caches (no read of the line first), for a result nothing reads again
// soon: with it a pass over memory moves one stream less. p must be aligned to the vector's size;
// stream_fence() must follow the loop before another thread reads the results.
inline void vstore_stream(float* p, vfloat v) {
#if defined(__AVX512F__)
  _mm512_stream_ps(p, reinterpret_cast<__m512>(v));
#elif defined(__AVX2__)
  _mm256_stream_ps(p, reinterpret_cast<__m256>(v));
#else
  vstore(p, v);  // (immintrin.h is included for AVX2 and up only)
#endif
}
inline bool valigned(const float* p) { return reinterpret_cast<uintptr_t>(p) % sizeof(vfloat) == 0; }
inline void stream_fence() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}
typedef int32_t vint __attribute__((vector_size(kVecFloats * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kVecFloats * sizeof(uint32_t))));
// floor(x) on every lane with adds and selects only (the DSL prelude's hp::vfloor, checked there against
// std::floor over all 2^32 floats): without SSE4.1, floorf is a library call per element.
inline vfloat vfloor(vfloat x) {
  const vint xb = reinterpret_cast<vint>(x);
  const vint sign = xb & static_cast<int32_t>(0x80000000u);
  const vint big_bits = sign - sign + 0x4b000000;  // 2^23
  const vfloat big = reinterpret_cast<vfloat>(big_bits);
  const vfloat m = reinterpret_cast<vfloat>(sign | big_bits);  // copysign(2^23, x)
  const vfloat t = (x + m) - m;                                // x rounded to an integer (|x| < 2^23)
  const vfloat r = t > x ? t - 1.0f : t;
  const vfloat signed_r = reinterpret_cast<vfloat>((reinterpret_cast<vint>(r) & 0x7fffffff) | sign);
  const vfloat ax = reinterpret_cast<vfloat>(xb & 0x7fffffff);
  return ax < big ? signed_r : x;  // |x| >= 2^23 is an integer already (NaN: returned as is)
}

// spread8[b]: bit k of b moved to bit 2k (for interleaving two 1-bit masks into 2-bit codes).
struct Spread8 {
  uint16_t v[256];
  Spread8() {
    for (int b = 0; b < 256; ++b) {
      uint16_t s = 0;
      for (int k = 0; k < 8; ++k) s |= static_cast<uint16_t>(((b >> k) & 1) << (2 * k));
      v[b] = s;
    }
  }
};
const Spread8 kSpread;

// Runs fn(lo32_start, hi32, count, offset) over [counter, counter + n) split at 2^32
// boundaries so that the high counter word is constant inside each segment.
template <class F>
void rng_segments(uint64_t counter, size_t n, F fn) {
  size_t off = 0;
  while (off < n) {
    uint64_t c = counter + off;
    uint64_t room = (uint64_t{1} << 32) - (c & 0xffffffffULL);
    size_t len = static_cast<size_t>(std::min<uint64_t>(room, n - off));
    fn(static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), len, off);
    off += len;
  }
}


#if defined(__AVX512F__)
// rng.h's stream on 16 lanes: the uniforms for counter words (lo + 0..15, hi), with k1 = hi ^ key.k1.
struct Uniform16 {
  __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i k0, k1;
  __m512i m1 = _mm512_set1_epi32(0x7feb352d), m2 = _mm512_set1_epi32(static_cast<int>(0x846ca68bu));
  __m512 unit = _mm512_set1_ps(1.0f / 16777216.0f);
  Uniform16(uint32_t key0, uint32_t key1)
      : k0(_mm512_set1_epi32(static_cast<int>(key0))), k1(_mm512_set1_epi32(static_cast<int>(key1))) {}
  __m512i mix(__m512i x) const {  // mix32
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, m1);
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, m2);
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  __m512 at(uint32_t lo) const {
    __m512i c = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(lo)), iota);
    __m512i h = mix(_mm512_xor_si512(mix(_mm512_xor_si512(c, k0)), k1));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), unit);
  }
};
#endif

// u[j] = uniform for counter words (lo + j, hi) with k1 = hi ^ key.k1.
inline void fill_uniform(uint32_t lo, uint32_t k0, uint32_t k1, float* u, size_t len) {
  size_t j = 0;
#if defined(__AVX512F__)
  const Uniform16 rng(k0, k1);
  for (; j + 16 <= len; j += 16) _mm512_storeu_ps(u + j, rng.at(lo + static_cast<uint32_t>(j)));
#else
  {
    // rng.h's stream on GCC vector types (the target's width), lane by lane the scalar arithmetic
    typedef uint32_t vu32 __attribute__((vector_size(kVecFloats * sizeof(uint32_t))));
    constexpr size_t V = kVecFloats;
    vu32 iota;
    for (size_t l = 0; l < V; ++l) iota[l] = static_cast<uint32_t>(l);
    auto mix = [](vu32 x) {
      x ^= x >> 16;
      x *= 0x7feb352dU;
      x ^= x >> 15;
      x *= 0x846ca68bU;
      return x ^ (x >> 16);
    };
    for (; j + V <= len; j += V) {
      const vu32 h = mix(mix((lo + static_cast<uint32_t>(j) + iota) ^ k0) ^ k1);
      const vfloat f = __builtin_convertvector(reinterpret_cast<vint>(h >> 8), vfloat) * (1.0f / 16777216.0f);
      vstore(u + j, f);
    }
  }
#endif
  for (; j < len; ++j) u[j] = u32_to_unit(mix32(mix32((lo + static_cast<uint32_t>(j)) ^ k0) ^ k1));
}

}  // namespace

// ---- map -------------------------------------------------------------------
void axpby(float* out, const float* y, float beta, const float* x, float gamma, size_t n) {
  if (beta == 1.0f && gamma == 1.0f) {
    parallel_range(n, kGrain, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) out[i] = y[i] + x[i];
    });
    return;
  }
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      float p = beta * y[i];
      float q = gamma * x[i];
      out[i] = p + q;
    }
  });
}

void add(float* y, const float* x, size_t n) {
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) y[i] += x[i];
  });
}

// NaN and Inf: kAbsBits and kFirstNonFinite (ops.h).
namespace {
// chunk(b, e) does the work on elements [b, e) and returns the largest sign-cleared bits it read;
// whether every chunk stayed below the first NaN/Inf.
template <class F>
bool chunks_finite(size_t n, F chunk) {
  std::vector<uint32_t> top(nchunks_of(n), 0);
  parallel_for(top.size(), [&](size_t c) { top[c] = chunk(c * kGrain, chunk_end(c, n)); });
  return std::all_of(top.begin(), top.end(), [](uint32_t t) { return t < kFirstNonFinite; });
}

// A float vector's bits as unsigned lanes: the NaN/Inf test above, a vector at a time.
inline vuint vload_bits(const float* p) {
  vuint v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vuint vmax(vuint a, vuint b) { return a > b ? a : b; }
inline uint32_t hmax(vuint v) {
  uint32_t m = 0;
  for (size_t l = 0; l < kVecFloats; ++l) m = std::max(m, v[l]);
  return m;
}
}  // namespace

bool copy_finite(float* out, const float* in, size_t n) {
  return chunks_finite(n, [&](size_t i, size_t e) {
    constexpr size_t V = kVecFloats;
    vuint m0 = {}, m1 = {};
    for (; i + 2 * V <= e; i += 2 * V) {  // two vectors at a time: two independent max chains
      const vuint v0 = vload_bits(in + i), v1 = vload_bits(in + i + V);
      std::memcpy(out + i, &v0, sizeof v0);
      std::memcpy(out + i + V, &v1, sizeof v1);
      m0 = vmax(m0, v0 & kAbsBits);
      m1 = vmax(m1, v1 & kAbsBits);
    }
    uint32_t m = hmax(vmax(m0, m1));
    for (; i < e; ++i) {
      uint32_t u;
      std::memcpy(&u, in + i, sizeof u);
      std::memcpy(out + i, &u, sizeof u);
      m = std::max(m, u & kAbsBits);
    }
    return m;
  });
}

// bf16's rounding and NaN: round_to_bf16_bits, kBf16NaN (ops.h).
constexpr uint32_t kFirstBf16Overflow = 0x7f7f8000u;  // the smallest |x| bits that round to Inf

bool copy_finite_bf16(uint16_t* out, const float* in, size_t n) {
  const bool finite = chunks_finite(n, [&](size_t i, size_t e) {
    constexpr size_t V = kVecFloats;
    typedef uint16_t vhalf __attribute__((vector_size(V * sizeof(uint16_t))));
    vuint m0 = {};
    for (; i + V <= e; i += V) {
      const vuint v = vload_bits(in + i);
      const vuint a = v & kAbsBits;
      m0 = vmax(m0, a);
      const vuint nan = reinterpret_cast<vuint>(a > kFirstNonFinite);  // all ones where NaN
      const vhalf h = __builtin_convertvector((round_to_bf16_bits(v) & ~nan) | (kBf16NaN & nan), vhalf);
      std::memcpy(out + i, &h, sizeof h);
    }
    uint32_t m = hmax(m0);
    for (; i < e; ++i) {
      uint32_t u;
      std::memcpy(&u, in + i, sizeof u);
      const uint32_t a = u & kAbsBits;
      m = std::max(m, a);
      out[i] = static_cast<uint16_t>(a > kFirstNonFinite ? kBf16NaN : round_to_bf16_bits(u));
    }
    // chunks_finite compares with the first NaN/Inf: lift a value that overflows bf16 to it
    return m >= kFirstBf16Overflow ? kFirstNonFinite : m;
  });
  return finite;
}

void bf16_difference(uint16_t* out, const float* p, const uint16_t* base, size_t n) {
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) out[i] = float_to_bf16(p[i] - bf16_to_float(base[i]));
  });
}

void bf16_average_delta(float* delta, uint16_t* ref, const uint16_t* sum, const uint16_t* base,
                        const uint16_t* sent, float ranks, size_t n) {
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const float mean = bf16_to_float(sum[i]) / ranks;
      ref[i] = float_to_bf16(bf16_to_float(base[i]) + mean);
      delta[i] = mean - bf16_to_float(sent[i]);
    }
  });
}

// The vector body of both momentum updates, from i while a whole vector fits: u_out = g = m * u_in + g,
// the product rounded before the sum as in torch's two passes (this file's fp-contract=off); with Track,
// the largest |g| bits into t. The new velocity is read again only in the next step: it is streamed past
// the caches where u_out is aligned, so its lines are not read from memory before they are written
// (VGG19-like's 45 MB in training, 4 ranks on 2 cores: 20-24 ms of CPU per step and rank before, 10-16
// after). Returns where the scalar tail starts.
namespace {
template <bool Track>
size_t momentum_vectors(float* u_out, const float* u_in, float m, float* g, size_t i, size_t e, vuint& t) {
  constexpr size_t V = kVecFloats;
  const vfloat vm = m - vfloat{};
  auto run = [&](auto store) {
    for (; i + V <= e; i += V) {
      const vfloat gv = vload(g + i);
      if (Track) t = vmax(t, reinterpret_cast<vuint>(gv) & kAbsBits);
      const vfloat v = vm * vload(u_in + i) + gv;
      store(u_out + i, v);
      vstore(g + i, v);
    }
  };
  if (valigned(u_out + i)) {
    run([](float* p, vfloat v) { vstore_stream(p, v); });
    stream_fence();
  }
  run([](float* p, vfloat v) { vstore(p, v); });  // (nothing is left where the streamed loop ran)
  return i;
}
}  // namespace

void momentum_update(float* u_out, const float* u_in, float m, float* g, size_t n) {
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    vuint unused = {};
    for (size_t i = momentum_vectors<false>(u_out, u_in, m, g, b, e, unused); i < e; ++i) {
      float v = m * u_in[i];
      v += g[i];
      u_out[i] = v;
      g[i] = v;
    }
  });
}

bool momentum_update_finite(float* u_out, const float* u_in, float m, float* g, size_t n) {
  return chunks_finite(n, [&](size_t i, size_t e) {
    vuint t0 = {};
    i = momentum_vectors<true>(u_out, u_in, m, g, i, e, t0);
    uint32_t t = hmax(t0);
    for (; i < e; ++i) {
      uint32_t u;
      std::memcpy(&u, g + i, sizeof u);
      t = std::max(t, u & kAbsBits);
      float v = m * u_in[i];
      v += g[i];
      u_out[i] = v;
      g[i] = v;
    }
    return t;
  });
}

// ---- reduce ----------------------------------------------------------------
MinMax reduce_minmax(const float* in, size_t n) {
  if (n == 0) return {0.0f, 0.0f};
  size_t nc = nchunks_of(n);
  std::vector<MinMax> part(nc);
  parallel_for(nc, [&](size_t c) {
    constexpr int L = 16;
    float mn[L], mx[L];
    for (int l = 0; l < L; ++l) {
      mn[l] = std::numeric_limits<float>::infinity();
      mx[l] = -std::numeric_limits<float>::infinity();
    }
    size_t b = c * kGrain, e = chunk_end(c, n), i = b;
#if defined(__AVX512F__)
    {
      __m512 a0 = _mm512_loadu_ps(mn), a1 = a0, x0 = _mm512_loadu_ps(mx), x1 = x0;
      for (; i + 32 <= e; i += 32) {
        __m512 v0 = _mm512_loadu_ps(in + i), v1 = _mm512_loadu_ps(in + i + 16);
        a0 = _mm512_min_ps(v0, a0);  // NaN in v keeps the accumulator
        a1 = _mm512_min_ps(v1, a1);
        x0 = _mm512_max_ps(v0, x0);
        x1 = _mm512_max_ps(v1, x1);
      }
      _mm512_storeu_ps(mn, _mm512_min_ps(a0, a1));
      _mm512_storeu_ps(mx, _mm512_max_ps(x0, x1));
    }
#endif
    for (; i + L <= e; i += L)
      for (int l = 0; l < L; ++l) {
        float v = in[i + l];
        mn[l] = v < mn[l] ? v : mn[l];
        mx[l] = v > mx[l] ? v : mx[l];
      }
    for (; i < e; ++i) {
      float v = in[i];
      mn[0] = v < mn[0] ? v : mn[0];
      mx[0] = v > mx[0] ? v : mx[0];
    }
    MinMax r{mn[0], mx[0]};
    for (int l = 1; l < L; ++l) {
      r.min = mn[l] < r.min ? mn[l] : r.min;
      r.max = mx[l] > r.max ? mx[l] : r.max;
    }
    part[c] = r;
  });
  MinMax r = part[0];
  for (size_t c = 1; c < nc; ++c) {
    r.min = std::min(r.min, part[c].min);
    r.max = std::max(r.max, part[c].max);
  }
  if (!(r.min <= r.max)) return {0.0f, 0.0f};  // all NaN
  return r;
}

float reduce_max_abs(const float* in, size_t n) {
  MinMax m = reduce_minmax(in, n);
  return std::max(std::fabs(m.min), std::fabs(m.max));
}

SignSums reduce_sign_sums(const float* in, size_t n) {
  size_t nc = nchunks_of(n);
  std::vector<SignSums> part(nc);
  parallel_for(nc, [&](size_t c) {
    constexpr int L = 8;
    double ps[L] = {}, ns[L] = {};
    uint32_t nn[L] = {};
    size_t b = c * kGrain, e = chunk_end(c, n), i = b;
    uint64_t negc = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    {
      // Exact double accumulation, 16 lanes (two 8-double halves) per sign.
      __m512d p0 = _mm512_setzero_pd(), p1 = p0, n0 = p0, n1 = p0;
      for (; i + 16 <= e; i += 16) {
        __m512 v = _mm512_loadu_ps(in + i);
        __mmask16 m = _mm512_movepi32_mask(_mm512_castps_si512(v));
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        __mmask8 mlo = static_cast<__mmask8>(m), mhi = static_cast<__mmask8>(m >> 8);
        n0 = _mm512_mask_add_pd(n0, mlo, n0, lo);
        n1 = _mm512_mask_add_pd(n1, mhi, n1, hi);
        p0 = _mm512_mask_add_pd(p0, static_cast<__mmask8>(~mlo), p0, lo);
        p1 = _mm512_mask_add_pd(p1, static_cast<__mmask8>(~mhi), p1, hi);
        negc += static_cast<uint64_t>(__builtin_popcount(m));
      }
      alignas(64) double t[8];
      _mm512_store_pd(t, _mm512_add_pd(p0, p1));
      for (int l = 0; l < 8; ++l) ps[l] += t[l];
      _mm512_store_pd(t, _mm512_add_pd(n0, n1));
      for (int l = 0; l < 8; ++l) ns[l] += t[l];
    }
#else
    {
      // The same 16 lanes and order as the AVX-512 path, with GCC vector types and masks (no branch per
      // element: a sign is a coin flip to the branch predictor). An element adds +0.0 to the other
      // sign's lane, which leaves that (never -0.0) sum as it is. Lane l of the AVX-512 path's p0 (p1)
      // sums the elements i + l (i + 8 + l); here quarter q of the 16 (4 elements, one 4-double vector)
      // goes to accumulator q, so lane l's total is acc[l / 4] + acc[2 + l / 4].
      typedef float vf4 __attribute__((vector_size(16), aligned(4)));
      typedef int32_t vi4 __attribute__((vector_size(16)));
      typedef double vd4 __attribute__((vector_size(32)));
      typedef int64_t vl4 __attribute__((vector_size(32)));
      vd4 pa[4] = {}, na[4] = {};
      vi4 cnt = {};
      for (; i + 16 <= e; i += 16)
        for (int q = 0; q < 4; ++q) {
          const vf4 v = *reinterpret_cast<const vf4*>(in + i + 4 * q);
          const vi4 m = reinterpret_cast<vi4>(v) >> 31;  // -1: negative
          const vl4 w = __builtin_convertvector(m, vl4);
          const vl4 d = reinterpret_cast<vl4>(__builtin_convertvector(v, vd4));
          na[q] += reinterpret_cast<vd4>(d & w);
          pa[q] += reinterpret_cast<vd4>(d & ~w);
          cnt -= m;
        }
      for (int l = 0; l < 8; ++l) {
        ps[l] += pa[l / 4][l % 4] + pa[2 + l / 4][l % 4];
        ns[l] += na[l / 4][l % 4] + na[2 + l / 4][l % 4];
      }
      for (int l = 0; l < 4; ++l) negc += static_cast<uint64_t>(cnt[l]);
    }
#endif
    for (; i + L <= e; i += L)
      for (int l = 0; l < L; ++l) {
        float v = in[i + l];
        uint32_t neg = float_bits(v) >> 31;
        double d = static_cast<double>(v);
        ns[l] += neg ? d : 0.0;
        ps[l] += neg ? 0.0 : d;
        nn[l] += neg;
      }
    SignSums s;
    for (int l = 0; l < L; ++l) {
      s.pos_sum += ps[l];
      s.neg_sum += ns[l];
      negc += nn[l];
    }
    for (; i < e; ++i) {
      float v = in[i];
      if (float_bits(v) >> 31) {
        s.neg_sum += v;
        ++negc;
      } else {
        s.pos_sum += v;
      }
    }
    s.neg_count = negc;
    s.pos_count = (e - b) - negc;
    part[c] = s;
  });
  SignSums r;
  for (auto& p : part) {
    r.pos_sum += p.pos_sum;
    r.neg_sum += p.neg_sum;
    r.pos_count += p.pos_count;
    r.neg_count += p.neg_count;
  }
  return r;
}

double reduce_sum_sq(const float* in, size_t n) {
  size_t nc = nchunks_of(n);
  std::vector<double> part(nc);
  parallel_for(nc, [&](size_t c) {
    constexpr int L = 8;
    double s[L] = {};
    size_t b = c * kGrain, e = chunk_end(c, n), i = b;
    for (; i + L <= e; i += L)
      for (int l = 0; l < L; ++l) {
        double d = in[i + l];
        s[l] += d * d;
      }
    double t = 0;
    for (int l = 0; l < L; ++l) t += s[l];
    for (; i < e; ++i) t += static_cast<double>(in[i]) * in[i];
    part[c] = t;
  });
  double r = 0;
  for (double p : part) r += p;
  return r;
}

// ---- random ----------------------------------------------------------------
void random_uniform(RngKey key, uint64_t counter, float* out, size_t n) {
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    rng_segments(counter + b, e - b, [&](uint32_t lo, uint32_t hi, size_t len, size_t off) {
      fill_uniform(lo, key.k0, hi ^ key.k1, out + b + off, len);
    });
  });
}

void random_index(RngKey key, uint64_t counter, uint32_t range, uint32_t* out, size_t n) {
  rng_segments(counter, n, [&](uint32_t lo, uint32_t hi, size_t len, size_t off) {
    uint32_t* o = out + off;
    uint32_t k1 = hi ^ key.k1;
    for (size_t j = 0; j < len; ++j)
      o[j] = u32_to_index(mix32(mix32((lo + static_cast<uint32_t>(j)) ^ key.k0) ^ k1), range);
  });
}

// ---- bit packing -----------------------------------------------------------
namespace {
void pack_range(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
  // n is a multiple of 8 here except possibly for the last range.
  size_t full = n / 8, i;
  switch (bits) {
    case 1:
      for (i = 0; i < full; ++i) {
        uint64_t w;
        std::memcpy(&w, codes + 8 * i, 8);
        // bit 8k -> bit k: gather the low bit of every byte.
        out[i] = static_cast<uint8_t>(((w & 0x0101010101010101ULL) * 0x0102040810204080ULL) >> 56);
      }
      break;
    case 2:
      for (i = 0; i < full * 2; ++i) {
        uint32_t w;
        std::memcpy(&w, codes + 4 * i, 4);
        out[i] = static_cast<uint8_t>((w | (w >> 6) | (w >> 12) | (w >> 18)) & 0xff);
      }
      break;
    case 4:
      for (i = 0; i < full * 4; ++i) {
        uint16_t w;
        std::memcpy(&w, codes + 2 * i, 2);
        out[i] = static_cast<uint8_t>((w | (w >> 4)) & 0xff);
      }
      break;
    case 8:
      std::memcpy(out, codes, full * 8);
      break;
  }
  size_t done = full * 8;
  if (done < n) {
    size_t nb = packed_bytes(n, bits) - packed_bytes(done, bits);
    uint8_t* o = out + packed_bytes(done, bits);
    std::memset(o, 0, nb);
    for (size_t j = done; j < n; ++j) {
      size_t bit = (j - done) * bits;
      o[bit / 8] |= static_cast<uint8_t>(codes[j] << (bit % 8));
    }
  }
}
}  // namespace

void pack_bits(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
  if (bits != 1 && bits != 2 && bits != 4 && bits != 8) throw std::invalid_argument("pack_bits: bits must be 1, 2, 4 or 8");
  parallel_range(n, kGrain, [&](size_t b, size_t e) { pack_range(codes + b, e - b, bits, out + b * bits / 8); });
}

void unpack_bits(const uint8_t* in, size_t n, int bits, uint8_t* codes) {
  if (bits != 1 && bits != 2 && bits != 4 && bits != 8) throw std::invalid_argument("unpack_bits: bits must be 1, 2, 4 or 8");
  const unsigned mask = (1u << bits) - 1;
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      size_t bit = i * bits;
      codes[i] = static_cast<uint8_t>((in[bit / 8] >> (bit % 8)) & mask);
    }
  });
}

namespace {
// Sign bits of in[b, e) into o (the byte of element b: b is a multiple of 8), LSB first.
void signbits_range(const float* in, size_t b, size_t e, uint8_t* o) {
  size_t i = b;
#if defined(__AVX2__)
  for (; i + 32 <= e; i += 32) {
    uint32_t m0 = _mm256_movemask_ps(_mm256_loadu_ps(in + i));
    uint32_t m1 = _mm256_movemask_ps(_mm256_loadu_ps(in + i + 8));
    uint32_t m2 = _mm256_movemask_ps(_mm256_loadu_ps(in + i + 16));
    uint32_t m3 = _mm256_movemask_ps(_mm256_loadu_ps(in + i + 24));
    uint32_t w = m0 | (m1 << 8) | (m2 << 16) | (m3 << 24);
    std::memcpy(o, &w, 4);
    o += 4;
  }
#endif
  for (; i + 8 <= e; i += 8) {
    unsigned m = 0;
    for (int k = 0; k < 8; ++k) m |= (float_bits(in[i + k]) >> 31) << k;
    *o++ = static_cast<uint8_t>(m);
  }
  if (i < e) {
    unsigned m = 0;
    for (int k = 0; i + k < e; ++k) m |= (float_bits(in[i + k]) >> 31) << k;
    *o = static_cast<uint8_t>(m);
  }
}

// res[b, e) = beta * y + gamma * x (axpby's arithmetic), and the sum of the squares of what was
// written, in double: 8 interleaved lanes merged in lane order, as one chunk of hp::sum_rows. The 8
// lanes are one vector of 8 doubles (GCC leaves the generated code's scalar: one add chain per lane,
// ~3x slower); a multiply and an add per value, no FMA (this file's fp-contract=off): the same
// roundings. y is res itself or apart from it (restrict: the loop needs no runtime overlap test,
// which an in-place residual, y == res, would fail on every call).
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef double vd8 __attribute__((vector_size(8 * sizeof(double))));
template <bool InPlace>
double compensate_squares(float* __restrict res, const float* __restrict y, float beta, float gamma,
                          const float* __restrict x, size_t b, size_t e) {
  constexpr size_t L = 8;
  const float* yy = InPlace ? res : y;
  vd8 lanes = {};
  size_t i = b;
  for (; i + L <= e; i += L) {
    vf8 yv, xv;
    std::memcpy(&yv, yy + i, sizeof yv);
    std::memcpy(&xv, x + i, sizeof xv);
    const vf8 v = beta * yv + gamma * xv;
    std::memcpy(res + i, &v, sizeof v);
    lanes += __builtin_convertvector(v * v, vd8);
  }
  double lane[L];
  std::memcpy(lane, &lanes, sizeof lane);
  for (; i < e; ++i) {
    const float p = beta * yy[i], q = gamma * x[i], v = p + q;
    res[i] = v;
    lane[0] += static_cast<double>(v * v);
  }
  for (size_t l = 1; l < L; ++l) lane[0] += lane[l];
  return lane[0];
}

double compensate_squares(float* res, const float* y, float beta, float gamma, const float* x, size_t b, size_t e) {
  return y == res ? compensate_squares<true>(res, nullptr, beta, gamma, x, b, e)
                  : compensate_squares<false>(res, y, beta, gamma, x, b, e);
}

// The sign bits of res[b, e) into o, then res -= decode (+-scale by sign).
void signs_feed_back(float* res, size_t b, size_t e, float scale, uint8_t* o) {
  signbits_range(res, b, e, o);
  const float neg = scale, pos = -scale;  // what is added: -(decoded value)
  for (size_t i = b; i < e; ++i) res[i] = res[i] + ((float_bits(res[i]) >> 31) ? neg : pos);
}

float row_scale(double sum, size_t count) { return std::sqrt(static_cast<float>(sum / static_cast<double>(count))); }
}  // namespace

void pack_signbits(const float* in, size_t n, uint8_t* out) {
  parallel_range(n, kGrain, [&](size_t b, size_t e) { signbits_range(in, b, e, out + b / 8); });
}

bool feedback_scaled_signs(float* res, const float* res_in, float beta, float gamma, const float* in, size_t n,
                           size_t len, uint8_t* bits, float* scales) {
  if (n == 0) return true;
  if (len == 0 || (len < n && len % 8 != 0))
    throw std::invalid_argument("feedback_scaled_signs: rows must be a multiple of 8 elements");
  const float* y = res_in ? res_in : res;
  if (len >= n) {  // one row: its chunks spread over the threads, twice (the scale needs every chunk)
    const size_t nc = nchunks_of(n);
    std::vector<double> part(nc);
    parallel_for(nc, [&](size_t c) {
      part[c] = compensate_squares(res, y, beta, gamma, in, c * kGrain, chunk_end(c, n));
    });
    double sum = part[0];
    for (size_t c = 1; c < nc; ++c) sum += part[c];
    scales[0] = row_scale(sum, n);
    if (!std::isfinite(scales[0])) return false;
    parallel_range(n, kGrain, [&](size_t b, size_t e) { signs_feed_back(res, b, e, scales[0], bits + b / 8); });
    return true;
  }
  const size_t rows = (n + len - 1) / len;
  std::vector<uint8_t> bad(rows, 0);  // per row (rows run on several threads): its scale was not finite
  parallel_for(rows, [&](size_t r) {
    const size_t rb = r * len, re = std::min(n, rb + len);
    double sum = 0;  // the row's chunks in order (+0 + s is s)
    for (size_t b = rb; b < re; b += kGrain)
      sum += compensate_squares(res, y, beta, gamma, in, b, std::min(re, b + kGrain));
    scales[r] = row_scale(sum, re - rb);
    if (std::isfinite(scales[r]))
      signs_feed_back(res, rb, re, scales[r], bits + rb / 8);
    else
      bad[r] = 1;
  });
  return std::find(bad.begin(), bad.end(), 1) == bad.end();
}

void threshold_ternary_codes(const float* in, size_t n, float tau, uint8_t* out) {
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    size_t i = b;
    uint8_t* o = out + b / 4;
#if defined(__AVX2__)
    const __m256 pt = _mm256_set1_ps(tau), nt = _mm256_set1_ps(-tau);
    for (; i + 8 <= e; i += 8) {
      __m256 v = _mm256_loadu_ps(in + i);
      unsigned p = _mm256_movemask_ps(_mm256_cmp_ps(v, pt, _CMP_GT_OQ));
      unsigned q = _mm256_movemask_ps(_mm256_cmp_ps(v, nt, _CMP_LT_OQ));
      uint16_t w = static_cast<uint16_t>(kSpread.v[p] | (kSpread.v[q] << 1));
      std::memcpy(o, &w, 2);
      o += 2;
    }
#endif
    for (; i + 8 <= e; i += 8) {
      unsigned p = 0, q = 0;
      for (int k = 0; k < 8; ++k) {
        p |= static_cast<unsigned>(in[i + k] > tau) << k;
        q |= static_cast<unsigned>(in[i + k] < -tau) << k;
      }
      uint16_t w = static_cast<uint16_t>(kSpread.v[p] | (kSpread.v[q] << 1));
      std::memcpy(o, &w, 2);
      o += 2;
    }
    if (i < e) {
      size_t nb = packed_bytes(e - i, 2);
      std::memset(o, 0, nb);
      for (size_t k = 0; i + k < e; ++k) {
        float v = in[i + k];
        unsigned c = v > tau ? 1u : (v < -tau ? 2u : 0u);
        o[k / 4] |= static_cast<uint8_t>(c << (2 * (k % 4)));
      }
    }
  });
}


#if defined(__AVX512F__) && defined(__AVX512BW__)
// Stochastic rounding of len (multiple of 64) elements straight into packed
// 2/4/8-bit codes: the RNG, the map and the packing never leave registers.
void quantize_tile_avx512(const float* x, size_t len, float lo, float inv_gap, float maxq, int bits, uint32_t k0,
                          uint32_t k1, uint32_t clo, uint8_t* out) {
  const Uniform16 rng(k0, k1);
  const __m512 vlo = _mm512_set1_ps(lo), vinv = _mm512_set1_ps(inv_gap), vmax = _mm512_set1_ps(maxq);
  const __m512 zero = _mm512_setzero_ps();
  auto codes16 = [&](size_t j) {  // 16 codes as bytes
    __m512 u = rng.at(clo + static_cast<uint32_t>(j));
    __m512 r = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), vlo), vinv);
    r = _mm512_add_ps(r, u);
    __m512 f = _mm512_roundscale_ps(r, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    f = _mm512_min_ps(_mm512_max_ps(f, zero), vmax);
    return _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(f));
  };
  for (size_t j = 0; j < len; j += 64) {
    __m512i b = _mm512_castsi128_si512(codes16(j));
    b = _mm512_inserti32x4(b, codes16(j + 16), 1);
    b = _mm512_inserti32x4(b, codes16(j + 32), 2);
    b = _mm512_inserti32x4(b, codes16(j + 48), 3);
    if (bits == 8) {
      _mm512_storeu_si512(out + j, b);
    } else if (bits == 4) {
      __m512i w = _mm512_or_si512(b, _mm512_srli_epi16(b, 4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j / 2), _mm512_cvtepi16_epi8(w));
    } else {
      __m512i w = _mm512_or_si512(_mm512_or_si512(b, _mm512_srli_epi32(b, 6)),
                                  _mm512_or_si512(_mm512_srli_epi32(b, 12), _mm512_srli_epi32(b, 18)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j / 4), _mm512_cvtepi32_epi8(w));
    }
  }
}
#endif

void quantize_stochastic(const float* in, size_t n, float lo, float inv_gap, int bits, RngKey key, uint64_t counter,
                         uint8_t* out) {
  if (bits != 1 && bits != 2 && bits != 4 && bits != 8) throw std::invalid_argument("quantize_stochastic: bad bits");
  const float maxq = static_cast<float>((1 << bits) - 1);
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    constexpr size_t T = 1024;  // tile: codes stay in L1 between map and pack
    alignas(64) float u[T];
    alignas(64) uint8_t codes[T];
    for (size_t t = b; t < e; t += T) {
      size_t len = std::min(T, e - t);
#if defined(__AVX512F__) && defined(__AVX512BW__)
      {
        uint64_t c0 = counter + t;
        // Fast path: whole tile of 64-element groups inside one 2^32 counter segment.
        if (len % 64 == 0 && bits >= 2 && (c0 >> 32) == ((c0 + len - 1) >> 32)) {
          quantize_tile_avx512(in + t, len, lo, inv_gap, maxq, bits, key.k0,
                               static_cast<uint32_t>(c0 >> 32) ^ key.k1, static_cast<uint32_t>(c0),
                               out + t * bits / 8);
          continue;
        }
      }
#endif
      rng_segments(counter + t, len, [&](uint32_t clo, uint32_t chi, size_t slen, size_t off) {
        uint32_t k1 = chi ^ key.k1;
        fill_uniform(clo, key.k0, k1, u + off, slen);
      });
      const float* x = in + t;
      size_t j0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      {
        const __m512 vlo = _mm512_set1_ps(lo), vinv = _mm512_set1_ps(inv_gap), vmax = _mm512_set1_ps(maxq);
        const __m512 zero = _mm512_setzero_ps(), unit = _mm512_set1_ps(1.0f / 16777216.0f);
        for (; j0 + 16 <= len; j0 += 16) {
          __m512 u16 = _mm512_loadu_ps(u + j0);
          __m512 r = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j0), vlo), vinv);
          r = _mm512_add_ps(r, u16);
          __m512 f = _mm512_roundscale_ps(r, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
          f = _mm512_max_ps(f, zero);  // NaN -> 0 (max returns the second operand)
          f = _mm512_min_ps(f, vmax);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j0), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(f)));
        }
        (void)unit;
      }
#else
      {
        // The same operations on whole vectors (GCC vector types): floor without a library call, the
        // clamps as selects (NaN -> 0, as max(f, 0) above).
        constexpr size_t V = kVecFloats;
        for (; j0 + V <= len; j0 += V) {
          vfloat r = (vload(x + j0) - lo) * inv_gap;
          r = r + vload(u + j0);
          vfloat f = vfloor(r);
          f = f > 0.0f ? f : 0.0f;
          f = f < maxq ? f : maxq;
          // byte 0 of every int32 lane (the codes are < 256), gathered by one byte shuffle
          typedef uint8_t vb4 __attribute__((vector_size(4 * V)));
          vb4 pick;
          for (size_t l = 0; l < 4 * V; ++l) pick[l] = static_cast<uint8_t>(l < V ? 4 * l : 0);
          const vb4 q = __builtin_shuffle(reinterpret_cast<vb4>(__builtin_convertvector(f, vint)), pick);
          std::memcpy(codes + j0, &q, V);
        }
      }
#endif
      for (size_t j = j0; j < len; ++j) {
        float r = (x[j] - lo) * inv_gap;
        r = r + u[j];
        float f = std::floor(r);
        f = f > 0.0f ? f : 0.0f;
        f = f < maxq ? f : maxq;
        codes[j] = static_cast<uint8_t>(static_cast<int>(f));
      }
      pack_range(codes, len, bits, out + t * bits / 8);
    }
  });
}


#if defined(__AVX512F__) && defined(__AVX512BW__)
// out[0, cnt) (+)= tab[code] for cnt (multiple of 16) BITS-wide codes at p.
template <int BITS, bool ADD>
void dequant16(const uint8_t* p, size_t cnt, const float* tab, float* out) {
  alignas(64) float tab16[16] = {};
  for (int c = 0; c < (BITS < 8 ? (1 << BITS) : 0); ++c) tab16[c] = tab[c];
  const __m512 tv = _mm512_load_ps(tab16);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i sh = _mm512_mullo_epi32(iota, _mm512_set1_epi32(BITS));
  const __m512i msk = _mm512_set1_epi32((1 << BITS) - 1);
  for (size_t i = 0; i < cnt; i += 16, p += 2 * BITS) {
    __m512i idx;
    if constexpr (BITS == 1) {
      uint16_t w;
      std::memcpy(&w, p, 2);
      idx = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(w), sh), msk);
    } else if constexpr (BITS == 2) {
      uint32_t w;
      std::memcpy(&w, p, 4);
      idx = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(w)), sh), msk);
    } else if constexpr (BITS == 4) {
      __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      __m128i lo4 = _mm_and_si128(b8, _mm_set1_epi8(0x0f));
      __m128i hi4 = _mm_and_si128(_mm_srli_epi16(b8, 4), _mm_set1_epi8(0x0f));
      idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo4, hi4));
    } else {
      idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    __m512 v;
    if constexpr (BITS == 8)
      v = _mm512_i32gather_ps(idx, tab, 4);
    else
      v = _mm512_permutexvar_ps(idx, tv);
    if constexpr (ADD) v = _mm512_add_ps(_mm512_loadu_ps(out + i), v);
    _mm512_storeu_ps(out + i, v);
  }
}
#endif

void dequantize_table(const uint8_t* packed, size_t n, int bits, const float* table, float alpha, bool add, float* out) {
  if (bits != 1 && bits != 2 && bits != 4 && bits != 8) throw std::invalid_argument("dequantize_table: bad bits");
  const int ncodes = 1 << bits;
  std::vector<float> tab(ncodes);
  for (int c = 0; c < ncodes; ++c) tab[c] = alpha == 1.0f ? table[c] : alpha * table[c];
  const int per = 8 / bits;  // elements per byte
  // Byte -> `per` floats lookup table (bits < 8) for the scalar path; worth building only for large n,
  // and not where the AVX-512 path decodes every chunk (onebit's per-row decode calls this once per row:
  // building the table per call made a 4096 x 4096 decode 10x slower, 22.6 ms against 2.4).
  std::vector<float> lut;
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
  if (bits < 8 && n >= 4096) {
    lut.resize(256 * per);
    for (int v = 0; v < 256; ++v)
      for (int k = 0; k < per; ++k) lut[v * per + k] = tab[(v >> (k * bits)) & (ncodes - 1)];
  }
#endif
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    size_t i = b;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    {
      const uint8_t* p = packed + b * bits / 8;  // b is a multiple of 64 elements
      size_t cnt = (e - b) / 16 * 16;
      switch (bits * 2 + (add ? 1 : 0)) {
        case 2: dequant16<1, false>(p, cnt, tab.data(), out + b); break;
        case 3: dequant16<1, true>(p, cnt, tab.data(), out + b); break;
        case 4: dequant16<2, false>(p, cnt, tab.data(), out + b); break;
        case 5: dequant16<2, true>(p, cnt, tab.data(), out + b); break;
        case 8: dequant16<4, false>(p, cnt, tab.data(), out + b); break;
        case 9: dequant16<4, true>(p, cnt, tab.data(), out + b); break;
        case 16: dequant16<8, false>(p, cnt, tab.data(), out + b); break;
        case 17: dequant16<8, true>(p, cnt, tab.data(), out + b); break;
      }
      i = b + cnt;
    }
#endif
    if (!lut.empty() && i == b) {
      const uint8_t* p = packed + b * bits / 8;
      float* o = out + b;
      size_t nbytes = (e - b) / per;
      if (add) {
        for (size_t j = 0; j < nbytes; ++j) {
          const float* l = &lut[p[j] * per];
          for (int k = 0; k < per; ++k) o[j * per + k] += l[k];
        }
      } else {
        for (size_t j = 0; j < nbytes; ++j) std::memcpy(o + j * per, &lut[p[j] * per], per * sizeof(float));
      }
      i = b + nbytes * per;
    } else if (bits == 8 && i == b) {
      if (add)
        for (; i < e; ++i) out[i] += tab[packed[i]];
      else
        for (; i < e; ++i) out[i] = tab[packed[i]];
    }
    for (; i < e; ++i) {
      size_t bit = i * bits;
      float v = tab[(packed[bit / 8] >> (bit % 8)) & (ncodes - 1)];
      if (add)
        out[i] += v;
      else
        out[i] = v;
    }
  });
}

// ---- sort / filter ----------------------------------------------------------
namespace {
// The k-th largest (1 <= k <= n) of n magnitudes' bits, get(i) = |x_i|'s bits (sign cleared): as integers
// they are ordered as the magnitudes (a NaN above inf), so a radix selection finds the k-th exactly, the
// value std::nth_element with std::greater finds (without NaNs). Three histograms, of the top 11 bits,
// the next 11 and the last 9: the first over all n, the others over the elements of the bin that holds
// the k-th (copied out in a second pass); returned as the float those bits are. nth_element took 60% of
// DGC's encode at its warm-up's 25% density (docs/compll_kernels.md).
template <class Get>
float kth_largest_magnitude(size_t n, size_t k, Get get) {
  std::vector<uint32_t> hist(2048, 0);
  for (size_t i = 0; i < n; ++i) ++hist[get(i) >> 20];
  // the bin holding the k-th largest, and the k-th's rank among its bin's elements (1-based)
  auto pick = [&](size_t bins, size_t& rank) {
    for (size_t b = bins; b-- > 0;) {
      if (rank <= hist[b]) return static_cast<uint32_t>(b);
      rank -= hist[b];
    }
    return uint32_t{0};  // not reached: the bins hold n >= rank elements
  };
  size_t rank = k;
  const uint32_t top = pick(2048, rank);
  std::vector<uint32_t> bin;
  bin.reserve(hist[top]);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t v = get(i);
    if ((v >> 20) == top) bin.push_back(v);
  }
  std::fill(hist.begin(), hist.end(), 0);
  for (uint32_t v : bin) ++hist[(v >> 9) & 0x7ff];
  const uint32_t mid = pick(2048, rank);
  std::fill(hist.begin(), hist.end(), 0);
  for (uint32_t v : bin)
    if (((v >> 9) & 0x7ff) == mid) ++hist[v & 0x1ff];
  const uint32_t low = pick(512, rank);
  const uint32_t bits = (top << 20) | (mid << 9) | low;
  float t;
  std::memcpy(&t, &bits, sizeof t);
  return t;
}
}  // namespace

float kth_largest_abs(const float* in, size_t n, size_t k) {
  if (k == 0 || k > n) throw std::invalid_argument("kth_largest_abs: need 1 <= k <= n");
  return kth_largest_magnitude(n, k, [&](size_t i) { return float_bits(in[i]) & 0x7fffffffu; });
}

namespace {
// hit(i) for every i in [b, e) with |in[i]| >= thr and |in[i]| > 0, in ascending order. For thr > 0
// a block of elements is first tested as integers, lanes at a time: the bits of non-negative floats
// are ordered as their values, so a block without |x|'s bits >= thr's holds no hit and is skipped
// (at DGC's densities most are). A block that passes is checked element by element, as before.
template <class F>
void scan_abs_ge(const float* in, size_t b, size_t e, float thr, F&& hit) {
  size_t i = b;
  if (thr > 0.0f) {
    constexpr size_t kBlock = 4 * kVecFloats;
    const vint tb = vint{} + static_cast<int32_t>(float_bits(thr));
    for (; i + kBlock <= e; i += kBlock) {
      vint lanes[kBlock / kVecFloats];
      vint any = {};
      for (size_t j = 0; j < kBlock; j += kVecFloats)
        any |= lanes[j / kVecFloats] = (reinterpret_cast<vint>(vload(in + i + j)) & 0x7fffffff) >= tb;
      bool some = false;
      for (size_t l = 0; l < kVecFloats; ++l) some |= any[l] != 0;
      if (!some) continue;
      // only the lanes that passed, lowest first (a per-element loop over the block mispredicted its
      // branch at DGC's warm-up densities); each checked as a float too (a NaN's bits pass, it does not)
      for (size_t j = 0; j < kBlock; j += kVecFloats) {
        uint32_t mask = 0;
        for (size_t l = 0; l < kVecFloats; ++l) mask |= static_cast<uint32_t>(lanes[j / kVecFloats][l] != 0) << l;
        for (; mask; mask &= mask - 1) {
          const size_t at = i + j + static_cast<size_t>(__builtin_ctz(mask));
          if (std::fabs(in[at]) >= thr) hit(at);  // (> 0 as thr is)
        }
      }
    }
  }
  for (; i < e; ++i) {
    float a = std::fabs(in[i]);
    if (a >= thr && a > 0.0f) hit(i);
  }
}
}  // namespace

size_t filter_abs_ge(const float* in, size_t n, float thr, uint32_t* idx, float* val, size_t cap) {
  size_t nc = nchunks_of(n);
  if (nc <= 1) {
    size_t cnt = 0;
    scan_abs_ge(in, 0, n, thr, [&](size_t i) {
      if (cnt < cap) {
        idx[cnt] = static_cast<uint32_t>(i);
        val[cnt] = in[i];
      }
      ++cnt;
    });
    return cnt;
  }
  std::vector<std::vector<uint32_t>> part(nc);
  parallel_for(nc, [&](size_t c) {
    auto& v = part[c];
    scan_abs_ge(in, c * kGrain, chunk_end(c, n), thr, [&](size_t i) { v.push_back(static_cast<uint32_t>(i)); });
  });
  size_t cnt = 0;
  for (auto& v : part) {
    for (uint32_t i : v) {
      if (cnt < cap) {
        idx[cnt] = i;
        val[cnt] = in[i];
      }
      ++cnt;
    }
  }
  return cnt;
}

namespace {
// One element of the top-k's final pass (ascending indices): taken if its magnitude a is above the k-th
// largest t, or equal to it while equal ones are still wanted (the lowest indices win ties). Written
// at out unconditionally and counted only if taken: no branch to mispredict where many are taken (at
// DGC's 25% warm-up density a quarter are); the caller stops at out == k, so out < k here.
inline void take_if_top(float a, float t, size_t& eq_left, uint32_t i, float v, uint32_t* idx, float* val,
                        size_t& out) {
  const bool above = a > t;
  const bool take = above | ((a == t) & (eq_left > 0));
  eq_left -= static_cast<size_t>(take & !above);
  idx[out] = i;
  val[out] = v;
  out += take;
}
// The top-k of n elements given the k-th largest magnitude t (mag(i), at(i): the element's index, val_of(i):
// its value), in ascending order: every magnitude above t, then the lowest-index ones equal to it.
template <class Mag, class At, class ValOf>
size_t take_top(size_t n, size_t k, float t, Mag mag, At at, ValOf val_of, uint32_t* idx, float* val) {
  size_t gt = 0;
  for (size_t j = 0; j < n; ++j) gt += mag(j) > t;
  size_t eq_left = k - gt, out = 0;
  for (size_t j = 0; j < n && out < k; ++j) take_if_top(mag(j), t, eq_left, at(j), val_of(j), idx, val, out);
  return out;
}
// From candidates (ascending indices cidx, their values cval: a superset of every element >= the k-th
// largest magnitude), keep the exact top-k with lowest-index tie breaking.
size_t select_topk_from(const uint32_t* cidx, const float* cval, size_t ccount, size_t k, uint32_t* idx, float* val) {
  std::vector<float> mags(ccount);
  for (size_t j = 0; j < ccount; ++j) mags[j] = std::fabs(cval[j]);
  const float t = kth_largest_magnitude(ccount, k, [&](size_t j) { return float_bits(mags[j]); });
  return take_top(ccount, k, t, [&](size_t j) { return mags[j]; }, [&](size_t j) { return cidx[j]; },
                  [&](size_t j) { return cval[j]; }, idx, val);
}
}  // namespace

size_t topk_abs_exact(const float* in, size_t n, size_t k, uint32_t* idx, float* val, size_t sample_hint, RngKey key,
                      uint64_t counter) {
  if (n > 0xffffffffULL) throw std::invalid_argument("topk_abs_exact: more than 2^32 - 1 elements");
  k = std::min(k, n);
  if (k == 0) return 0;
  if (k == n) {
    for (size_t i = 0; i < n; ++i) {
      idx[i] = static_cast<uint32_t>(i);
      val[i] = in[i];
    }
    return n;
  }
  if (sample_hint > 0 && k * 8 < n && n >= 4096) {
    size_t s = std::min(sample_hint, n);
    std::vector<uint32_t> pos(s);
    random_index(key, counter, static_cast<uint32_t>(n), pos.data(), s);
    std::vector<float> sm(s);
    for (size_t j = 0; j < s; ++j) sm[j] = std::fabs(in[pos[j]]);
    // Aim for ~2k candidates (+ slack for small samples).
    double want = 2.0 * static_cast<double>(k) * static_cast<double>(s) / static_cast<double>(n) + 8.0;
    size_t r = std::min(s, static_cast<size_t>(want));
    std::nth_element(sm.begin(), sm.begin() + (r - 1), sm.end(), std::greater<float>());
    float thr = sm[r - 1];
    size_t cap = 8 * k + 1024;
    // not zero-filled (a vector's would be: 16 MB at 6.25% of 4 Mi elements, more than the filter)
    std::unique_ptr<uint32_t[]> cidx(new uint32_t[cap]);
    std::unique_ptr<float[]> cval(new float[cap]);
    size_t cnt = filter_abs_ge(in, n, thr, cidx.get(), cval.get(), cap);
    if (cnt >= k && cnt <= cap) return select_topk_from(cidx.get(), cval.get(), cnt, k, idx, val);
  }
  // Fallback: exact threshold over everything.
  return take_top(n, k, kth_largest_abs(in, n, k), [&](size_t i) { return std::fabs(in[i]); },
                  [](size_t i) { return static_cast<uint32_t>(i); }, [&](size_t i) { return in[i]; }, idx, val);
}

float sampled_threshold(const float* in, size_t n, double keep, size_t sample, RngKey key, uint64_t counter) {
  if (n == 0 || sample == 0) return 0.0f;
  if (n > 0xffffffffULL) throw std::invalid_argument("sampled_threshold: more than 2^32 - 1 elements");
  std::vector<uint32_t> pos(sample);
  random_index(key, counter, static_cast<uint32_t>(n), pos.data(), sample);
  std::vector<float> sm(sample);
  for (size_t j = 0; j < sample; ++j) sm[j] = std::fabs(in[pos[j]]);
  size_t r = static_cast<size_t>(std::ceil(keep * static_cast<double>(sample)));
  r = std::max<size_t>(1, std::min(r, sample));
  std::nth_element(sm.begin(), sm.begin() + (r - 1), sm.end(), std::greater<float>());
  return sm[r - 1];
}

void scatter(const uint32_t* idx, const float* val, size_t k, float alpha, bool add, float* out) {
  if (alpha == 1.0f) {
    if (add)
      for (size_t j = 0; j < k; ++j) out[idx[j]] += val[j];
    else
      for (size_t j = 0; j < k; ++j) out[idx[j]] = val[j];
  } else {
    if (add)
      for (size_t j = 0; j < k; ++j) out[idx[j]] += alpha * val[j];
    else
      for (size_t j = 0; j < k; ++j) out[idx[j]] = alpha * val[j];
  }
}

// ---- matmul / decomp --------------------------------------------------------
// Every output keeps the summation order it always had (16 float lanes, then the lanes in order, then
// the tail; matmul_tn and matmul_nt in row order), so the results are bit for bit those of the
// one-output-at-a-time loops; what changed is that a pass over the big matrix serves several outputs at
// once: kGroup independent accumulator chains instead of one latency-bound chain per output, one read
// of a matrix row instead of r.
namespace {
constexpr size_t kLanes = 16;
constexpr size_t kRowGrain = 64;
constexpr size_t kGroup = 4;  // outputs per pass: 4 chains of 16 lanes fit the registers of AVX2 and AVX-512

// acc[r][g] += the 16-lane partial sums of dot(row r of a, b[g]) over [0, len), for R rows of a,
// `stride` floats apart (len a multiple of 16; lane l takes the elements l mod 16). With x (rows at the
// same stride), each row = a_in + x first, in the same pass (the sum is what the dots read; a_in is a
// itself or where a's old values are). Each load of b[g] serves the R rows: fewer loads per
// multiply-add, and R * G independent accumulator chains.
template <size_t G, size_t R, bool ADD>
inline void dot_lanes_block(float* a, const float* a_in, const float* x, size_t stride, const float* const* b,
                            size_t len, float (*acc)[kGroup][kLanes]) {
  constexpr size_t V = kVecFloats, P = kLanes / V;  // 16 lanes as P native vectors
  vfloat s[R][G][P];
  for (size_t r = 0; r < R; ++r)
    for (size_t g = 0; g < G; ++g)
      for (size_t q = 0; q < P; ++q) s[r][g][q] = vload(acc[r][g] + q * V);
  for (size_t i = 0; i < len; i += kLanes)
    for (size_t q = 0; q < P; ++q) {
      if (q == 0)  // 2 KB ahead: the blocks break the row stream
        for (size_t r = 0; r < R; ++r) {
          __builtin_prefetch(a_in + r * stride + i + 512);
          if (ADD) __builtin_prefetch(x + r * stride + i + 512);
        }
      vfloat bv[G];
      for (size_t g = 0; g < G; ++g) bv[g] = vload(b[g] + i + q * V);
      for (size_t r = 0; r < R; ++r) {
        vfloat av = vload(a_in + r * stride + i + q * V);
        if (ADD) {
          av += vload(x + r * stride + i + q * V);
          vstore(a + r * stride + i + q * V, av);
        }
        for (size_t g = 0; g < G; ++g) s[r][g][q] += av * bv[g];
      }
    }
  for (size_t r = 0; r < R; ++r)
    for (size_t g = 0; g < G; ++g)
      for (size_t q = 0; q < P; ++q) vstore(acc[r][g] + q * V, s[r][g][q]);
}
// Rows at a time where the registers hold R * G * (16 / V) accumulators and the G b vectors: 4 with
// AVX-512's 32 registers, 1 with AVX2's 16 (4 x 4 x 2 accumulators would spill).
constexpr size_t kDotRows = kVecFloats == 16 ? 4 : 1;
// dot_lanes_block for G = 1..kGroup outputs, chosen at run time
template <size_t R, bool ADD>
inline void dot_lanes(size_t G, float* a, const float* a_in, const float* x, size_t stride, const float* const* b,
                      size_t len, float (*acc)[kGroup][kLanes]) {
  switch (G) {
    case 4: return dot_lanes_block<4, R, ADD>(a, a_in, x, stride, b, len, acc);
    case 3: return dot_lanes_block<3, R, ADD>(a, a_in, x, stride, b, len, acc);
    case 2: return dot_lanes_block<2, R, ADD>(a, a_in, x, stride, b, len, acc);
    default: return dot_lanes_block<1, R, ADD>(a, a_in, x, stride, b, len, acc);
  }
}
// Row stride of a scratch matrix of `cols` floats: off a multiple of 4 KiB, so that rows updated
// together do not falsely wait on each other's stores (4K aliasing).
inline size_t padded_stride(size_t cols) { return (cols * sizeof(float)) % 4096 == 0 ? cols + 16 : cols; }
}  // namespace

namespace {
// matmul_nn, and with X: A = A_in + X in the same pass (A is then written; X == nullptr: A is only read).
// A_in: A itself, or where A's old values are (add_matmul_nn).
void matmul_nn_impl(float* A, const float* A_in, const float* X, const float* B, float* C, size_t m, size_t k,
                    size_t n) {
  // B^T (n x k) so every output is a contiguous dot product: 16 lane sums, the lanes added in order,
  // then the tail. The dot products of a chunk of rows run over column blocks of kColBlock, so that the
  // block of kGroup rows of B^T they read stays in cache across the chunk's rows (L2 at 4096 floats:
  // 512, in L1, broke each matrix row into 2 KB pieces and was slower; docs/compll_kernels.md).
  std::vector<float> BT(n * k);
  for (size_t i = 0; i < k; ++i)
    for (size_t j = 0; j < n; ++j) BT[j * k + i] = B[i * n + j];
  const size_t kfull = k / kLanes * kLanes;
  constexpr size_t kColBlock = 4096;
  parallel_range(m, kRowGrain, [&](size_t b, size_t e) {
    float acc[kRowGrain][kGroup][kLanes];
    if (X)  // the rows' tails (past the last 16 lanes) first; the first group's pass adds the rest
      for (size_t i = b; i < e; ++i)
        for (size_t c = kfull; c < k; ++c) A[i * k + c] = A_in[i * k + c] + X[i * k + c];
    for (size_t j = 0; j < n; j += kGroup) {
      const size_t G = std::min(kGroup, n - j);
      std::memset(acc, 0, sizeof acc);
      for (size_t cb = 0; cb < kfull; cb += kColBlock) {
        const size_t len = std::min(kColBlock, kfull - cb);
        const float* bt[kGroup];
        for (size_t g = 0; g < G; ++g) bt[g] = BT.data() + (j + g) * k + cb;
        const bool add = X && j == 0;  // the first group's pass adds X
        size_t i = b;
        for (; i + kDotRows <= e; i += kDotRows)
          if (add)
            dot_lanes<kDotRows, true>(G, A + i * k + cb, A_in + i * k + cb, X + i * k + cb, k, bt, len, acc + (i - b));
          else
            dot_lanes<kDotRows, false>(G, A + i * k + cb, A + i * k + cb, nullptr, k, bt, len, acc + (i - b));
        for (; i < e; ++i)
          if (add)
            dot_lanes<1, true>(G, A + i * k + cb, A_in + i * k + cb, X + i * k + cb, k, bt, len, acc + (i - b));
          else
            dot_lanes<1, false>(G, A + i * k + cb, A + i * k + cb, nullptr, k, bt, len, acc + (i - b));
      }
      for (size_t i = b; i < e; ++i)
        for (size_t g = 0; g < G; ++g) {
          const float* a = A + i * k;
          const float* bt = BT.data() + (j + g) * k;
          float t = 0;
          for (size_t l = 0; l < kLanes; ++l) t += acc[i - b][g][l];
          for (size_t c = kfull; c < k; ++c) t += a[c] * bt[c];
          C[i * n + j + g] = t;
        }
    }
  });
}
}  // namespace

void matmul_nn(const float* A, const float* B, float* C, size_t m, size_t k, size_t n) {
  matmul_nn_impl(const_cast<float*>(A), A, nullptr, B, C, m, k, n);  // without X, A is only read
}

void add_matmul_nn(float* A, const float* X, const float* B, float* C, size_t m, size_t k, size_t n,
                   const float* A_in) {
  // PowerSGD's error feedback and first product in one pass over the matrix instead of two (the
  // add's result is the same floats, and so is the product).
  matmul_nn_impl(A, A_in ? A_in : A, X, B, C, m, k, n);
}

void matmul_tn(const float* A, const float* B, float* C, size_t m_, size_t k_, size_t n_) {
  // CT (n x k): CT[j, :] += B[i, j] * A[i, :] for i in order; threads own disjoint column tiles. Each
  // A element read serves kGroup outputs, and the kGroup accumulators of a column vector stay in
  // registers over kRowBlock rows of A (one load and store of CT per block instead of per row). A
  // tile's rows are pieces of its width, k floats apart: a stride the hardware prefetchers do not
  // follow, so each vector's column is prefetched for the next block's rows, and a block is 4 rows
  // (fewer pieces in flight). 4096 x 4096, rank 4: 4.1-4.4 ms before, 3.5-3.7 ms with both.
  const size_t ld_ = padded_stride(k_);
  std::vector<float> CT(n_ * ld_, 0.0f);
  const size_t cgrain = 2048;
  constexpr size_t kRowBlock = 4;
  parallel_range(k_, cgrain, [&](size_t cb, size_t ce) {
    const size_t m = m_, k = k_, n = n_, ld = ld_;  // locals: see matmul_nt
    constexpr size_t V = kVecFloats;
    const size_t w = ce - cb, wv = w / V * V;
    size_t j = 0;
    for (; j + kGroup <= n; j += kGroup) {
      float* ct[kGroup];
      for (size_t g = 0; g < kGroup; ++g) ct[g] = CT.data() + (j + g) * ld + cb;
      for (size_t i0 = 0; i0 < m; i0 += kRowBlock) {
        const size_t rows = std::min(kRowBlock, m - i0);
        float bv[kRowBlock][kGroup];
        for (size_t ii = 0; ii < rows; ++ii)
          for (size_t g = 0; g < kGroup; ++g) bv[ii][g] = B[(i0 + ii) * n + j + g];
        const float* a = A + i0 * k + cb;
        const bool ahead = i0 + 2 * kRowBlock <= m;
        size_t c = 0;
        for (; c < wv; c += V) {
          if (ahead)
            for (size_t ii = 0; ii < kRowBlock; ++ii) __builtin_prefetch(a + (kRowBlock + ii) * k + c);
          vfloat acc[kGroup];
          for (size_t g = 0; g < kGroup; ++g) acc[g] = vload(ct[g] + c);
          for (size_t ii = 0; ii < rows; ++ii) {
            const vfloat av = vload(a + ii * k + c);
            for (size_t g = 0; g < kGroup; ++g) acc[g] += bv[ii][g] * av;
          }
          for (size_t g = 0; g < kGroup; ++g) vstore(ct[g] + c, acc[g]);
        }
        for (; c < w; ++c)
          for (size_t ii = 0; ii < rows; ++ii)
            for (size_t g = 0; g < kGroup; ++g) ct[g][c] += bv[ii][g] * a[ii * k + c];
      }
    }
    for (; j < n; ++j) {
      float* ct = CT.data() + j * ld + cb;
      for (size_t i = 0; i < m; ++i) {
        const float* a = A + i * k + cb;
        const float bij = B[i * n + j];
        for (size_t c = 0; c < w; ++c) ct[c] += bij * a[c];
      }
    }
  });
  for (size_t c = 0; c < k_; ++c)
    for (size_t j = 0; j < n_; ++j) C[c * n_ + j] = CT[j * ld_ + c];
}

namespace {
// Rows [b, e) of matmul_nt. Each output element: the r terms summed in order j = 0..r-1 from 0, then
// scaled and stored or added, a vector of columns at a time. R: the rank as a constant (0: r, known
// at run time). The row's coefficients are broadcast once per row into registers: read through `A`
// in the loop (and r, n, alpha as captured references), the compiler must assume a store to the
// output may change them, and it reloaded and re-broadcast them for every vector (4096 x 4096, rank
// 4: 7.5 -> 5.0 ms).
template <size_t R>
void nt_rows(const float* A, const float* bt, float* C, size_t b, size_t e, size_t r, size_t n, size_t ld,
             float alpha, bool add) {
  constexpr size_t V = kVecFloats;
  if (R) r = R;
  const size_t nv = n / V * V;
  const vfloat va = alpha - vfloat{};
  vfloat av[R ? R : 1];
  size_t i = b;
  if (R && kVecFloats == 16) {
    // AVX-512: kNtRows rows at a time, so each load of bt serves them all (the registers hold their
    // coefficients, kNtRows x R of them); every output's sum is the same, in the same order
    constexpr size_t kNtRows = R <= 4 ? 4 : 2;
    for (; i + kNtRows <= e; i += kNtRows) {
      vfloat rv[kNtRows][R ? R : 1];
      for (size_t t = 0; t < kNtRows; ++t)
        for (size_t j = 0; j < R; ++j) rv[t][j] = A[(i + t) * r + j] - vfloat{};
      for (size_t c = 0; c < nv; c += V) {
        vfloat bv[R ? R : 1];
        for (size_t j = 0; j < R; ++j) bv[j] = vload(bt + j * ld + c);
        for (size_t t = 0; t < kNtRows; ++t) {
          float* o = C + (i + t) * n;
          vfloat s = vfloat{};
          for (size_t j = 0; j < R; ++j) s += rv[t][j] * bv[j];
          if (alpha != 1.0f) s = va * s;
          vstore(o + c, add ? vload(o + c) + s : s);
        }
      }
      for (size_t t = 0; t < kNtRows; ++t) {
        const float* a = A + (i + t) * r;
        float* o = C + (i + t) * n;
        for (size_t c = nv; c < n; ++c) {
          float u = 0.0f;
          for (size_t j = 0; j < r; ++j) u += a[j] * bt[j * ld + c];
          if (alpha != 1.0f) u = alpha * u;
          o[c] = add ? o[c] + u : u;
        }
      }
    }
  }
  for (; i < e; ++i) {
    const float* a = A + i * r;
    float* o = C + i * n;
    size_t c = 0;
    if (R) {
      for (size_t j = 0; j < R; ++j) av[j] = a[j] - vfloat{};
      for (; c < nv; c += V) {
        vfloat s = vfloat{};
        for (size_t j = 0; j < R; ++j) s += av[j] * vload(bt + j * ld + c);
        if (alpha != 1.0f) s = va * s;
        vstore(o + c, add ? vload(o + c) + s : s);
      }
    } else {
      for (; c < nv; c += V) {
        vfloat s = vfloat{};
        for (size_t j = 0; j < r; ++j) s += a[j] * vload(bt + j * ld + c);
        if (alpha != 1.0f) s = va * s;
        vstore(o + c, add ? vload(o + c) + s : s);
      }
    }
    for (; c < n; ++c) {
      float t = 0.0f;
      for (size_t j = 0; j < r; ++j) t += a[j] * bt[j * ld + c];
      if (alpha != 1.0f) t = alpha * t;
      o[c] = add ? o[c] + t : t;
    }
  }
}
}  // namespace

void matmul_nt(const float* A, const float* B, float* C, size_t m, size_t r, size_t n, float alpha, bool add) {
  const size_t ld = padded_stride(n);
  std::vector<float> BT(r * ld);
  for (size_t c = 0; c < n; ++c)
    for (size_t j = 0; j < r; ++j) BT[j * ld + c] = B[c * r + j];
  const float* bt = BT.data();
  parallel_range(m, kRowGrain, [&](size_t b, size_t e) {
    switch (r) {  // PowerSGD's usual ranks as constants
      case 1: return nt_rows<1>(A, bt, C, b, e, r, n, ld, alpha, add);
      case 2: return nt_rows<2>(A, bt, C, b, e, r, n, ld, alpha, add);
      case 4: return nt_rows<4>(A, bt, C, b, e, r, n, ld, alpha, add);
      case 8: return nt_rows<8>(A, bt, C, b, e, r, n, ld, alpha, add);
      default: return nt_rows<0>(A, bt, C, b, e, r, n, ld, alpha, add);
    }
  });
}

void orthogonalize(float* P, size_t rows, size_t r, float eps) {
  // eps is relative to the column's norm before the projections, so the result does not depend on
  // P's scale: with an absolute eps, PowerSGD's warm start (P = M Q, Q carrying the last
  // gradient's scale, so P ~ |M|^2) fell below eps for small gradients and the basis collapsed
  // (docs/pipeline.md). A zero column stays zero. The projections run twice ("twice is enough"):
  // one pass leaves an overlap of about (float eps) x cond(P), so a warm-started P (cond ~ the
  // squared singular value ratio) came out far from orthonormal, and even a full-rank PowerSGD
  // lost 7-30% of an activation gradient.
  for (size_t j = 0; j < r; ++j) {
    double s0 = 0;
    for (size_t i = 0; i < rows; ++i) s0 += static_cast<double>(P[i * r + j]) * P[i * r + j];
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t l = 0; l < j; ++l) {
        double d = 0;
        for (size_t i = 0; i < rows; ++i) d += static_cast<double>(P[i * r + l]) * P[i * r + j];
        float df = static_cast<float>(d);
        for (size_t i = 0; i < rows; ++i) P[i * r + j] -= df * P[i * r + l];
      }
    }
    double s = 0;
    for (size_t i = 0; i < rows; ++i) s += static_cast<double>(P[i * r + j]) * P[i * r + j];
    float inv = s0 > 0 ? static_cast<float>(1.0 / (std::sqrt(s) + eps * std::sqrt(s0))) : 0.0f;
    for (size_t i = 0; i < rows; ++i) P[i * r + j] *= inv;
  }
}

}  // namespace hipress::compress::ops
