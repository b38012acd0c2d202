// Numerical results here must match hipress/compression/reference.py bit for
// bit: keep FMA contraction off so a*b+c rounds twice, as numpy does.
#pragma GCC optimize("fp-contract=off")

#include "compress/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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
#endif
  for (; j < len; ++j) u[j] = u32_to_unit(mix32(mix32((lo + static_cast<uint32_t>(j)) ^ k0) ^ k1));
}

}  // namespace

// ---- map -------------------------------------------------------------------
void axpby(float* y, float beta, const float* x, float gamma, size_t n) {
  if (beta == 1.0f && gamma == 1.0f) {
    add(y, x, n);
    return;
  }
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      float p = beta * y[i];
      float q = gamma * x[i];
      y[i] = p + q;
    }
  });
}

void add(float* y, const float* x, size_t n) {
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) y[i] += x[i];
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

void pack_signbits(const float* in, size_t n, uint8_t* out) {
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    size_t i = b;
    uint8_t* o = out + b / 8;
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
  });
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
  // Byte -> `per` floats lookup table (bits < 8); worth building only for large n.
  std::vector<float> lut;
  if (bits < 8 && n >= 4096) {
    lut.resize(256 * per);
    for (int v = 0; v < 256; ++v)
      for (int k = 0; k < per; ++k) lut[v * per + k] = tab[(v >> (k * bits)) & (ncodes - 1)];
  }
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
float kth_largest_abs(const float* in, size_t n, size_t k) {
  if (k == 0 || k > n) throw std::invalid_argument("kth_largest_abs: need 1 <= k <= n");
  std::vector<float> a(n);
  for (size_t i = 0; i < n; ++i) a[i] = std::fabs(in[i]);
  std::nth_element(a.begin(), a.begin() + (k - 1), a.end(), std::greater<float>());
  return a[k - 1];
}

size_t filter_abs_ge(const float* in, size_t n, float thr, uint32_t* idx, float* val, size_t cap) {
  size_t nc = nchunks_of(n);
  if (nc <= 1) {
    size_t cnt = 0;
    for (size_t i = 0; i < n; ++i) {
      float a = std::fabs(in[i]);
      if (a >= thr && a > 0.0f) {
        if (cnt < cap) {
          idx[cnt] = static_cast<uint32_t>(i);
          val[cnt] = in[i];
        }
        ++cnt;
      }
    }
    return cnt;
  }
  std::vector<std::vector<uint32_t>> part(nc);
  parallel_for(nc, [&](size_t c) {
    auto& v = part[c];
    size_t b = c * kGrain, e = chunk_end(c, n);
    for (size_t i = b; i < e; ++i) {
      float a = std::fabs(in[i]);
      if (a >= thr && a > 0.0f) v.push_back(static_cast<uint32_t>(i));
    }
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
// From candidates (ascending indices, a superset of every element >= the k-th
// largest magnitude), keep the exact top-k with lowest-index tie breaking.
size_t select_topk_from(const float* in, const uint32_t* cidx, size_t ccount, size_t k, uint32_t* idx, float* val) {
  std::vector<float> mags(ccount);
  for (size_t j = 0; j < ccount; ++j) mags[j] = std::fabs(in[cidx[j]]);
  std::vector<float> tmp(mags);
  std::nth_element(tmp.begin(), tmp.begin() + (k - 1), tmp.end(), std::greater<float>());
  const float t = tmp[k - 1];
  size_t gt = 0;
  for (size_t j = 0; j < ccount; ++j) gt += mags[j] > t;
  size_t eq_left = k - gt, out = 0;
  for (size_t j = 0; j < ccount; ++j) {
    bool take = mags[j] > t || (mags[j] == t && eq_left > 0);
    if (mags[j] == t && eq_left > 0 && !(mags[j] > t)) --eq_left;
    if (take) {
      idx[out] = cidx[j];
      val[out] = in[cidx[j]];
      ++out;
    }
  }
  return out;
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
    std::vector<uint32_t> cidx(cap);
    std::vector<float> cval(cap);
    size_t cnt = filter_abs_ge(in, n, thr, cidx.data(), cval.data(), cap);
    if (cnt >= k && cnt <= cap) return select_topk_from(in, cidx.data(), cnt, k, idx, val);
  }
  // Fallback: exact threshold over everything.
  float t = kth_largest_abs(in, n, k);
  size_t gt = 0;
  for (size_t i = 0; i < n; ++i) gt += std::fabs(in[i]) > t;
  size_t eq_left = k - gt, out = 0;
  for (size_t i = 0; i < n && out < k; ++i) {
    float a = std::fabs(in[i]);
    if (a > t || (a == t && eq_left > 0)) {
      if (!(a > t)) --eq_left;
      idx[out] = static_cast<uint32_t>(i);
      val[out] = in[i];
      ++out;
    }
  }
  return out;
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
namespace {
inline float dot_lanes(const float* a, const float* b, size_t n) {
  constexpr int L = 16;
  float s[L] = {};
  size_t i = 0;
  for (; i + L <= n; i += L)
    for (int l = 0; l < L; ++l) s[l] += a[i + l] * b[i + l];
  float t = 0;
  for (int l = 0; l < L; ++l) t += s[l];
  for (; i < n; ++i) t += a[i] * b[i];
  return t;
}
constexpr size_t kRowGrain = 64;
}  // namespace

void matmul_nn(const float* A, const float* B, float* C, size_t m, size_t k, size_t n) {
  // B^T (n x k) so every output is a contiguous dot product.
  std::vector<float> BT(n * k);
  for (size_t i = 0; i < k; ++i)
    for (size_t j = 0; j < n; ++j) BT[j * k + i] = B[i * n + j];
  parallel_range(m, kRowGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i)
      for (size_t j = 0; j < n; ++j) C[i * n + j] = dot_lanes(A + i * k, BT.data() + j * k, k);
  });
}

void matmul_tn(const float* A, const float* B, float* C, size_t m, size_t k, size_t n) {
  // CT (n x k): CT[j, :] += B[i, j] * A[i, :]; threads own disjoint column ranges of A.
  std::vector<float> CT(n * k, 0.0f);
  const size_t cgrain = 4096;
  parallel_range(k, cgrain, [&](size_t cb, size_t ce) {
    for (size_t i = 0; i < m; ++i) {
      const float* a = A + i * k;
      for (size_t j = 0; j < n; ++j) {
        float bij = B[i * n + j];
        float* ct = CT.data() + j * k;
        for (size_t c = cb; c < ce; ++c) ct[c] += bij * a[c];
      }
    }
  });
  for (size_t c = 0; c < k; ++c)
    for (size_t j = 0; j < n; ++j) C[c * n + j] = CT[j * k + c];
}

void matmul_nt(const float* A, const float* B, float* C, size_t m, size_t r, size_t n, float alpha, bool add) {
  std::vector<float> BT(r * n);
  for (size_t c = 0; c < n; ++c)
    for (size_t j = 0; j < r; ++j) BT[j * n + c] = B[c * r + j];
  parallel_range(m, kRowGrain, [&](size_t b, size_t e) {
    std::vector<float> row(n);
    for (size_t i = b; i < e; ++i) {
      std::fill(row.begin(), row.end(), 0.0f);
      for (size_t j = 0; j < r; ++j) {
        float a = A[i * r + j];
        const float* bt = BT.data() + j * n;
        for (size_t c = 0; c < n; ++c) row[c] += a * bt[c];
      }
      float* o = C + i * n;
      if (add) {
        if (alpha == 1.0f)
          for (size_t c = 0; c < n; ++c) o[c] += row[c];
        else
          for (size_t c = 0; c < n; ++c) o[c] += alpha * row[c];
      } else {
        if (alpha == 1.0f)
          std::memcpy(o, row.data(), n * sizeof(float));
        else
          for (size_t c = 0; c < n; ++c) o[c] = alpha * row[c];
      }
    }
  });
}

void orthogonalize(float* P, size_t rows, size_t r, float eps) {
  for (size_t j = 0; j < r; ++j) {
    for (size_t l = 0; l < j; ++l) {
      double d = 0;
      for (size_t i = 0; i < rows; ++i) d += static_cast<double>(P[i * r + l]) * P[i * r + j];
      float df = static_cast<float>(d);
      for (size_t i = 0; i < rows; ++i) P[i * r + j] -= df * P[i * r + l];
    }
    double s = 0;
    for (size_t i = 0; i < rows; ++i) s += static_cast<double>(P[i * r + j]) * P[i * r + j];
    float inv = static_cast<float>(1.0 / (std::sqrt(s) + eps));
    for (size_t i = 0; i < rows; ++i) P[i * r + j] *= inv;
  }
}

}  // namespace hipress::compress::ops
