// SketchML as GRACE implements it (grace_dl/tensorflow/compressor/sketch.py; Jiang et al.,
// SIGMOD 2018; GRACE Table I "SketchML", hybrid, error feedback on): the values are split into
// `quantiles` buckets by quantile edges (tfp.stats.quantiles with linear interpolation: edge j
// is the j/q quantile, j = 0..q), each element is sent as its bucket's index (one byte), and
// the decoder sets it to the mean of its bucket (the q bucket means travel with the payload).
// GRACE pairs it with residual memory (ErrorFeedback, on by default in the registry).
//
// Hand-written, not a CompLL spec: the DSL cannot express it. Its quantile edges are order
// statistics at q + 1 ranks (sort returns the k first elements of an order in index order,
// threshold one sampled magnitude rank); the bucket of an element needs a table of q - 1 edges
// (globals are scalars, payload headers hold 4 words); the bucket means are a segmented
// (group-by) reduction into q sums, which reduce cannot express; and the payload carries a
// fixed-length float table plus packed codes, which concat's single data-dependent count does
// not describe.
//
// Where it differs from GRACE: with more than `sample` elements the edges are the quantiles of
// `sample` (default 16384) elements drawn uniformly at random (with replacement, counter-based RNG: counters
// c .. c + sample - 1 of the tensor's stream), as SketchML's own quantile sketch is an
// approximation too; exact below that (and with sample = 0). Bucket means are always exact
// over all elements. SketchML's MinMaxSketch hashing of the bucket indices is not in GRACE
// either (it sends uint8 codes) and is not done. Payload: header (bits 8, count = q), q fp32
// bucket means, then n uint8 codes (code < q).

#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "compress/compressor.h"
#include "compress/ops.h"
#include "compress/rng.h"
#include "compress/thread_pool.h"

namespace hipress::compress {
namespace {

constexpr uint8_t kSketchId = kSketch;
constexpr size_t kMaxBuckets = 256;

// codes[i] = min(top, number of E[0..NE) <= in[i]) for edges E sorted ascending, padded with +inf
// (a NaN compares false everywhere: bucket 0; +inf counts the padding too: clamped to top).
template <size_t NE>
void bucket_codes(const float* in, size_t n, const float* E, uint8_t top, uint8_t* codes) {
  for (size_t i = 0; i < n; ++i) {
    const float x = in[i];
    uint32_t k = 0;
    for (size_t j = 0; j < NE; ++j) k += E[j] <= x ? 1u : 0u;
    codes[i] = static_cast<uint8_t>(k < top ? k : top);
  }
}

class Sketch final : public Compressor {
 public:
  explicit Sketch(const Params& p)
      : Compressor({"sketch", kSketchId, Category::kQuantization, 0.25, false, 1}) {
    ParamReader r("sketch", p);
    const double q = r.get("quantiles", 64);
    const double s = r.get("sample", 16384);
    const double seed = r.get("seed", 0);
    r.finish();
    if (!(q >= 1 && q <= static_cast<double>(kMaxBuckets)) || q != std::floor(q))
      throw std::invalid_argument("sketch: quantiles must be an integer in [1, 256]");
    if (!(s >= 0 && s <= 4294967295.0) || s != std::floor(s))
      throw std::invalid_argument("sketch: sample must be an integer in [0, 2^32)");
    if (!(seed >= 0 && seed <= 18446744073709551615.0) || seed != std::floor(seed))
      throw std::invalid_argument("sketch: seed must be a non-negative integer");
    q_ = static_cast<size_t>(q);
    sample_ = static_cast<size_t>(s);
    key_ = rng_key(static_cast<uint64_t>(seed));
  }

  size_t max_encoded_bytes(size_t n, size_t, size_t) const override { return kHeaderBytes + 4 * q_ + n; }

  size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView* st) const override {
    if (cap < max_encoded_bytes(n, 0, 0)) throw std::invalid_argument("sketch: output buffer too small");
    if (n > 0xffffffffULL) throw std::invalid_argument("sketch: more than 2^32 - 1 elements");
    const size_t q = q_;
    // 1. the sorted values the edges are read from: all elements, or a random sample
    std::vector<float> sorted;
    if (sample_ == 0 || n <= sample_) {
      sorted.assign(in, in + n);
    } else {
      uint64_t counter = st && st->scalars ? st->scalars[kRngCounter] : 0;
      std::vector<uint32_t> pos(sample_);
      ops::random_index(key_, counter, static_cast<uint32_t>(n), pos.data(), sample_);
      sorted.resize(sample_);
      for (size_t j = 0; j < sample_; ++j) sorted[j] = in[pos[j]];
      if (st && st->scalars) st->scalars[kRngCounter] = counter + sample_;
    }
    // NaN sorts last: moved behind the numbers first, so the sort compares numbers only
    auto nan_at = std::partition(sorted.begin(), sorted.end(), [](float v) { return !std::isnan(v); });
    std::sort(sorted.begin(), nan_at);
    // 2. interior edges 1..q-1 (edge 0 and edge q only bound the outer buckets)
    const size_t m = sorted.size();
    float edges[kMaxBuckets] = {};
    for (size_t j = 1; m > 0 && j < q; ++j) {
      const double posd = static_cast<double>(j) * static_cast<double>(m - 1) / static_cast<double>(q);
      const size_t lo = static_cast<size_t>(std::floor(posd));
      const size_t hi = std::min(m - 1, lo + 1);
      const double f = posd - static_cast<double>(lo);
      edges[j - 1] = static_cast<float>(static_cast<double>(sorted[lo]) +
                                        (static_cast<double>(sorted[hi]) - static_cast<double>(sorted[lo])) * f);
    }
    const size_t ne = q - 1;
    std::vector<float>().swap(sorted);
    // 3. bucket = number of interior edges <= x (NaN: 0), counted against the edges padded with
    //    +inf to a power of two so the count is a fixed-length, vectorisable loop; codes, then
    //    per-chunk sums (4 interleaved partial sums per bucket, merged in a fixed order, so the
    //    result does not depend on the thread count)
    size_t padded = 8;
    while (padded < ne) padded *= 2;
    alignas(64) float E[kMaxBuckets];
    for (size_t j = 0; j < padded; ++j) E[j] = j < ne ? edges[j] : std::numeric_limits<float>::infinity();
    uint8_t* codes = out + kHeaderBytes + 4 * q;
    const size_t nch = (n + ops::kGrain - 1) / ops::kGrain;
    std::vector<double> sums(nch * q, 0.0);
    std::vector<uint64_t> counts(nch * q, 0);
    const uint8_t top = static_cast<uint8_t>(q - 1);
    parallel_range(n, ops::kGrain, [&](size_t b, size_t e) {
      switch (padded) {
        case 8: bucket_codes<8>(in + b, e - b, E, top, codes + b); break;
        case 16: bucket_codes<16>(in + b, e - b, E, top, codes + b); break;
        case 32: bucket_codes<32>(in + b, e - b, E, top, codes + b); break;
        case 64: bucket_codes<64>(in + b, e - b, E, top, codes + b); break;
        case 128: bucket_codes<128>(in + b, e - b, E, top, codes + b); break;
        default: bucket_codes<256>(in + b, e - b, E, top, codes + b); break;
      }
      const size_t c = b / ops::kGrain;
      double part[4][kMaxBuckets] = {};
      uint64_t cnt[kMaxBuckets] = {};
      size_t i = b;
      for (; i + 4 <= e; i += 4)
        for (int l = 0; l < 4; ++l) part[l][codes[i + l]] += static_cast<double>(in[i + l]);
      for (; i < e; ++i) part[0][codes[i]] += static_cast<double>(in[i]);
      for (size_t i2 = b; i2 < e; ++i2) ++cnt[codes[i2]];
      for (size_t j = 0; j < q; ++j) {
        sums[c * q + j] = (part[0][j] + part[1][j]) + (part[2][j] + part[3][j]);
        counts[c * q + j] = cnt[j];
      }
    });
    float means[kMaxBuckets];
    for (size_t j = 0; j < q; ++j) {
      double s = 0;
      uint64_t k = 0;
      for (size_t c = 0; c < nch; ++c) {
        s += sums[c * q + j];
        k += counts[c * q + j];
      }
      means[j] = k ? static_cast<float>(s / static_cast<double>(k)) : 0.0f;
      if (!std::isfinite(means[j])) means[j] = 0.0f;  // inf/NaN input: never an undecodable payload
    }
    std::memcpy(out + kHeaderBytes, means, 4 * q);
    Header h;
    h.algo = kSketchId;
    h.bits = 8;
    h.count = static_cast<uint32_t>(q);
    h.numel = n;
    h.body_bytes = 4 * q + n;
    write_header(h, out);
    return kHeaderBytes + h.body_bytes;
  }

  void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const override {
    Header h = read_header(in, bytes, kSketchId, n);
    if (h.bits != 8 || h.kind != 0)
      throw FormatError("sketch payload: unexpected bit width " + std::to_string(h.bits) + " / kind " +
                        std::to_string(h.kind) + " (corrupt payload)");
    if (h.count < 1 || h.count > kMaxBuckets)
      throw FormatError("sketch payload: " + std::to_string(h.count) + " buckets, expected 1..256 (corrupt payload)");
    const size_t q = h.count;
    expect_body(h, 4 * q + n, "sketch");
    float table[kMaxBuckets];
    std::memcpy(table, in + kHeaderBytes, 4 * q);
    for (size_t j = 0; j < q; ++j)
      if (!std::isfinite(table[j]))
        throw FormatError("sketch payload: bucket mean " + std::to_string(j) + " is inf or NaN (corrupt payload)");
    const uint8_t* codes = in + kHeaderBytes + 4 * q;
    for (size_t i = 0; i < n; ++i)  // validate before touching out
      if (codes[i] >= q)
        throw FormatError("sketch payload: code " + std::to_string(codes[i]) + " at element " + std::to_string(i) +
                          " names no bucket (" + std::to_string(q) + " buckets; corrupt payload)");
    for (size_t j = 0; j < q; ++j) table[j] *= alpha;
    parallel_range(n, ops::kGrain, [&](size_t b, size_t e) {
      if (add)
        for (size_t i = b; i < e; ++i) out[i] += table[codes[i]];
      else
        for (size_t i = b; i < e; ++i) out[i] = table[codes[i]];
    });
  }

 private:
  size_t q_ = 64;
  size_t sample_ = 16384;
  RngKey key_{};
};

}  // namespace
HIPRESS_REGISTER_COMPRESSOR("sketch", Sketch);
}  // namespace hipress::compress
