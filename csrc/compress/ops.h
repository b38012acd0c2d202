// CompLL common operators (paper 000, Table 4) on raw host buffers.
//
// These are the building blocks the DSL code generator (hipress/dsl/) emits calls
// to, for the built-in algorithms (generated into hipress._C at build time) and
// for specs loaded at run time. Conventions:
//   * inputs are `const T*` + element count, outputs are caller-owned buffers
//     of the documented size; nothing here allocates except where stated;
//   * every operator gives the same result for any thread count
//     (set_num_threads) and matches the numpy reference bit for bit, unless its
//     comment says otherwise (float reductions that sum, matmul);
//   * element counts of sparse operators are < 2^32 (uint32 indices).
//
//   operator        functions here
//   sort(G, udf)    topk_abs_exact, kth_largest_abs
//   filter(G, udf)  filter_abs_ge
//   map(G, udf)     map (template), quantize_stochastic, threshold_ternary_codes
//   reduce(G, udf)  reduce_minmax, reduce_max_abs, reduce_sign_sums, reduce_sum_sq
//   random(a, b)    random_uniform, random_index (rng.h: counter-based, seedable)
//   concat/extract  format.h (self-describing header + body), pack_bits/unpack_bits
//   decomp(G, o)    orthogonalize (Gram-Schmidt, PowerSGD)
//   matmul(G0, G1)  matmul_nn, matmul_tn, matmul_nt
//   (merge helpers) axpby, add, scatter_add, gather
//   (fusion)        copy_finite, copy_finite_bf16 (a gradient into its bucket, checked for NaN/Inf on the way),
//                   bf16_difference, bf16_average_delta (COVAP's bf16 averages)
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "compress/rng.h"
#include "compress/thread_pool.h"

namespace hipress::compress::ops {

// Chunk size (elements) used by all parallel kernels; a multiple of 64 so that
// chunk boundaries always fall on whole bytes of packed 1/2/4-bit codes.
constexpr size_t kGrain = 1 << 16;

// ---- map -------------------------------------------------------------------
// out[i] = f(in[i]), chunked over the thread pool. out may alias in.
template <class F>
void map(const float* in, size_t n, float* out, F f) {
  parallel_range(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) out[i] = f(in[i]);
  });
}

// out[i] = beta * y[i] + gamma * x[i]  (error-feedback compensation, GRACE eq. 4); out may be y.
// beta == 1 and gamma == 1 compute y + x (exact same rounding as numpy y + x).
void axpby(float* out, const float* y, float beta, const float* x, float gamma, size_t n);
// y[i] += x[i]
void add(float* y, const float* x, size_t n);
// out[i] = in[i], and whether every element is finite (no NaN, no Inf): a gradient's copy into
// its fusion bucket and the non-finite check of it in one pass over memory, where the check
// would be a second pass (a sum) over the bucket. out must not overlap in.
bool copy_finite(float* out, const float* in, size_t n);
// out[i] = in[i] rounded to bf16 (to nearest, ties to even: torch's .to(torch.bfloat16) bit for bit
// on numbers; a NaN as 0x7fc0), and whether every element sent is finite: no NaN or Inf in, and none
// too large for bf16 (|x| >= 0x7f7f8000 as bits rounds to Inf). A gradient's copy into a bucket
// that travels as bf16 is then also its cast, one pass where a copy and a cast were two.
bool copy_finite_bf16(uint16_t* out, const float* in, size_t n);
// fp32 bits with the sign cleared: NaN and Inf (exponent bits all set) are exactly those that
// compare >= kFirstNonFinite as integers, so one max over the masked bits decides (vectorises).
constexpr uint32_t kAbsBits = 0x7fffffffu, kFirstNonFinite = 0x7f800000u;
// bf16 rounding of fp32 bits: the top half after adding 0x7fff plus the kept half's lowest bit (to
// nearest, ties to even), of one element's bits (uint32_t) or of a vector's: one formula for every
// loop. A NaN becomes kBf16NaN (c10::BFloat16's) instead: rounded, its bits could carry into Inf or
// wrap around to zero (0xffffffff), and the optimizer finds a bad gradient by its NaN/Inf.
constexpr uint32_t kBf16NaN = 0x7fc0u;
template <class Bits>
inline Bits round_to_bf16_bits(Bits v) {
  return (v + (((v >> 16) & 1u) + 0x7fffu)) >> 16;
}
// bf16 <-> fp32 of one value (bf16 is fp32's top half): to bf16 as round_to_bf16_bits, torch's scalar
// cast bit for bit, a NaN as kBf16NaN (a select, so loops that call it vectorise).
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u & kAbsBits) > kFirstNonFinite ? kBf16NaN : round_to_bf16_bits(u));
}
// COVAP's local mode with bf16 averages (hipress/torch/covap.py, Average), one pass each where torch
// made three and seven: a unit's difference from its bf16 reference,
// out[i] = bf16(p[i] - float(base[i])), torch's p.sub_(base.float()).to(torch.bfloat16) bit for bit;
void bf16_difference(uint16_t* out, const float* p, const uint16_t* base, size_t n);
// and, once the ranks' differences are summed (sum), mean = float(sum[i]) / ranks,
// delta[i] = mean - float(sent[i]) and ref[i] = bf16(float(base[i]) + mean), torch's
// sum.float().div_(ranks), base.float().add_(mean), mean.sub_(sent.float()), .to(torch.bfloat16)
// bit for bit. (A NaN becomes 0x7fc0, as torch's scalar cast makes it; its vectorized cast may set other NaN bits.)
void bf16_average_delta(float* delta, uint16_t* ref, const uint16_t* sum, const uint16_t* base,
                        const uint16_t* sent, float ranks, size_t n);
// SGD's momentum update (dampening 0) and its result as the gradient, in one pass:
// u_out = m * u_in + g; g = u_out. Rounded as torch's u.mul_(m).add_(g) rounds it (the
// product, then the sum; never fused), so the result is bit for bit SGD's. u_out may be u_in.
void momentum_update(float* u_out, const float* u_in, float m, float* g, size_t n);
// The same, and whether every element of g as given was finite (no NaN, no Inf): the optimizer's
// non-finite check of a momentum-corrected gradient in the same pass. Where it was not, u_out
// and g hold garbage (the caller sends zeros and the step is undone on every rank).
bool momentum_update_finite(float* u_out, const float* u_in, float m, float* g, size_t n);

// ---- reduce ----------------------------------------------------------------
struct MinMax {
  float min, max;
};
// Min and max over in[0, n); n == 0 gives {0, 0}. NaNs are ignored.
MinMax reduce_minmax(const float* in, size_t n);
float reduce_max_abs(const float* in, size_t n);
// Sums (in double, per-chunk partials combined in order) and counts of the
// elements with the sign bit clear (>= +0) and set (< 0 or -0).
struct SignSums {
  double pos_sum = 0, neg_sum = 0;
  uint64_t pos_count = 0, neg_count = 0;
};
SignSums reduce_sign_sums(const float* in, size_t n);
double reduce_sum_sq(const float* in, size_t n);

// ---- random ----------------------------------------------------------------
// out[i] = uniform in [0, 1) for counter (counter + i)   (see rng.h)
void random_uniform(RngKey key, uint64_t counter, float* out, size_t n);
// out[i] = index in [0, range) for counter (counter + i); range < 2^32
void random_index(RngKey key, uint64_t counter, uint32_t range, uint32_t* out, size_t n);

// ---- bit packing (uint1 / uint2 / uint4 / uint8 arrays) ---------------------
// Element i of a `bits`-wide array lives in byte i*bits/8 at bit (i*bits)%8,
// least significant bits first (numpy packbits(bitorder="little") for bits=1).
// Codes must be < 2^bits. Trailing bits of the last byte are zero.
inline size_t packed_bytes(size_t n, int bits) { return (n * static_cast<size_t>(bits) + 7) / 8; }
void pack_bits(const uint8_t* codes, size_t n, int bits, uint8_t* out);
void unpack_bits(const uint8_t* in, size_t n, int bits, uint8_t* codes);
// uint1 array of sign bits: bit i = signbit(in[i]) (1 for negative and -0).
void pack_signbits(const float* in, size_t n, uint8_t* out);
// Error feedback around onebit's encode (the "scaled signs" idiom, hipress/dsl/idioms.py), fused:
//   res = beta * res_in + gamma * in                 (res_in null: res itself; ErrorFeedback's compensate)
//   scales[r] = sqrt(mean of res^2 over row r)       (rows of `len` elements, the last one shorter)
//   bits = pack_signbits(res)
//   res += signbit(res) ? scales[r] : -scales[r]     (res -= decode: the new residual)
// bit for bit what axpby, the generated per-row sum of squares (hp::sum_rows: its chunks, lanes and
// order), pack_signbits and dequantize_table(alpha -1, add) give one after the other, but each row
// goes through memory once while it is in cache: 2 passes over res where those are 4 (issue 21).
// A row whose scale is not finite (a NaN or inf in it, or a mean square beyond float) is left
// compensated, not updated; returns whether every scale is finite (where not, the caller throws
// decode's FormatError, and the residual is the undo log's to restore). len: > 0, and a multiple of
// 8 unless it covers all of n (each row's bits start on a byte).
bool feedback_scaled_signs(float* res, const float* res_in, float beta, float gamma, const float* in, size_t n,
                           size_t len, uint8_t* bits, float* scales);
// uint2 codes of a threshold ternarisation: 1 if in[i] > tau, 2 if in[i] < -tau, else 0.
void threshold_ternary_codes(const float* in, size_t n, float tau, uint8_t* out_packed);
// Stochastic rounding onto a `bits`-wide grid (TernGrad, paper 000 Fig. 5):
//   q[i] = clamp(floor((in[i] - lo) * inv_gap + u(counter + i)), 0, 2^bits - 1)
// written packed. bits in {1, 2, 4, 8}.
void quantize_stochastic(const float* in, size_t n, float lo, float inv_gap, int bits, RngKey key,
                         uint64_t counter, uint8_t* out_packed);
// out[i] (+)= alpha * table[code_i] for a packed `bits`-wide array (decode of all
// quantisers: the table maps each code to its float value). add=false overwrites.
void dequantize_table(const uint8_t* packed, size_t n, int bits, const float* table, float alpha, bool add,
                      float* out);

// ---- sort / filter (sparsification) -----------------------------------------
// The k-th largest |in[i]| (1-based k, 1 <= k <= n), by sampling-free selection
// (std::nth_element on a copy of |in|; O(n)).
float kth_largest_abs(const float* in, size_t n, size_t k);
// Copies the indices (ascending) and values of every element with |in[i]| >= thr
// and |in[i]| > 0 into idx/val, at most cap of them. Returns the number that
// passed (which may exceed cap: then only the first cap were written).
size_t filter_abs_ge(const float* in, size_t n, float thr, uint32_t* idx, float* val, size_t cap);
// Exact top-k by magnitude with deterministic ties: all i with |in[i]| > t plus
// the lowest-index i with |in[i]| == t, where t is the k-th largest |in|.
// Writes exactly k = min(k, n) pairs, indices ascending. `sample_hint` > 0
// lets it first try a threshold estimated from `sample_hint` random elements
// (counter-based RNG at `counter`), so only the few candidates above it are
// sorted; the result is the same either way.
size_t topk_abs_exact(const float* in, size_t n, size_t k, uint32_t* idx, float* val, size_t sample_hint = 0,
                      RngKey key = {}, uint64_t counter = 0);
// Estimated threshold of GradDrop (Aji & Heafield 2017): the ceil(keep*s)-th
// largest |in[j]| over s = sample random positions j (with replacement).
float sampled_threshold(const float* in, size_t n, double keep, size_t sample, RngKey key, uint64_t counter);
// out[idx[i]] (+)= alpha * val[i]; indices must be < n (checked by the caller).
void scatter(const uint32_t* idx, const float* val, size_t k, float alpha, bool add, float* out);

// ---- decomp / matmul (low rank) --------------------------------------------
// Row-major matrices. C (m x n) = A (m x k) * B (k x n)
void matmul_nn(const float* A, const float* B, float* C, size_t m, size_t k, size_t n);
// A += X (both m x k), then C = A * B as matmul_nn, in one pass over A: the same results as add and
// matmul_nn one after the other. A_in (not null): A = A_in + X instead, A's old values read from A_in
// (where an undo log keeps them: the copy it would take of A is spared)
void add_matmul_nn(float* A, const float* X, const float* B, float* C, size_t m, size_t k, size_t n,
                   const float* A_in = nullptr);
// C (k x n) = A^T * B with A (m x k), B (m x n)
void matmul_tn(const float* A, const float* B, float* C, size_t m, size_t k, size_t n);
// C (m x n) (+)= alpha * A (m x r) * B^T with B (n x r)
void matmul_nt(const float* A, const float* B, float* C, size_t m, size_t r, size_t n, float alpha, bool add);
// In-place Gram-Schmidt orthonormalisation of the r columns of P (rows x r,
// row-major): col_j -= sum_{l<j} (col_l . col_j) col_l ; col_j /= (|col_j| + eps * |col_j before|)
// (eps relative, so the result does not depend on P's scale; a zero column stays zero); the
// projections run twice, which keeps the columns orthonormal for ill-conditioned P.
void orthogonalize(float* P, size_t rows, size_t r, float eps = 1e-8f);

}  // namespace hipress::compress::ops
