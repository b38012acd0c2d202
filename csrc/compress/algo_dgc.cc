// DGC, deep gradient compression (Lin et al. 2018), per tensor:
//   u <- momentum * u + g            momentum correction
//   v <- v + u                       local gradient accumulation
//   density = warm-up schedule(step) exponential 25%, 6.25%, 1.56%, 0.4% over
//             warmup_steps steps (4 equal stages), then `ratio` (0.1%)
//   send the exact top-k of |v| (k = ceil(density * n)); the threshold is first
//   estimated on a random sample (sample_ratio of the elements), so only the
//   ~2k candidates above it are ranked instead of sorting all of v
//   v[sent] <- 0, u[sent] <- 0      momentum factor masking
// Ties at the k-th magnitude go to the lowest indices, so the selection is
// deterministic and identical in the reference. Without a state, encode is a
// plain top-k(ratio) of its input (what a ring step calls to re-sparsify a
// merged buffer). Gradient clipping is left to the optimizer.
//
//   state: buffers momentum (n), accum (n); scalars step, rng counter
//   payload: sparse.h, words[0] = density used
#include <cmath>
#include <stdexcept>

#include "compress/compressor.h"
#include "compress/ops.h"
#include "compress/sparse.h"

namespace hipress::compress {
namespace {

class DGC final : public Compressor {
 public:
  explicit DGC(const Params& p) : Compressor({"dgc", kDGC, Category::kSparsification, 0.002, false, 1}) {
    ParamReader r("dgc", p);
    ratio_ = r.get("ratio", 0.001);
    momentum_ = static_cast<float>(r.get("momentum", 0.9));
    sample_ratio_ = r.get("sample_ratio", 0.01);
    warmup_ = static_cast<uint64_t>(r.get("warmup_steps", 0));
    seed_ = static_cast<uint64_t>(r.get("seed", 0));
    r.finish();
    if (!(ratio_ > 0 && ratio_ <= 1)) throw std::invalid_argument("dgc: ratio must be in (0, 1]");
    if (!(sample_ratio_ > 0 && sample_ratio_ <= 1)) throw std::invalid_argument("dgc: sample_ratio must be in (0, 1]");
    info_.rate = 2 * ratio_;
    key_ = rng_key(seed_);
  }

  // Density at a step: stage s = step * 4 / warmup_steps of the warm-up uses
  // 0.25^(s+1) (never below ratio).
  double density(uint64_t step) const {
    if (warmup_ == 0 || step >= warmup_) return ratio_;
    uint64_t stage = step * 4 / warmup_;
    return std::max(ratio_, std::pow(0.25, static_cast<double>(stage + 1)));
  }

  std::vector<StateBuf> state_buffers(size_t n, size_t, size_t) const override {
    return {{"momentum", n}, {"accum", n}};
  }

  size_t max_encoded_bytes(size_t n, size_t, size_t) const override {
    return sparse::max_bytes(sparse::count_for(density(0), n));
  }

  size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView* st) const override {
    check_capacity(*this, n, 0, 0, cap);
    if (n > 0xffffffffULL) throw std::invalid_argument("dgc: tensors of 2^32 elements or more are not supported");
    size_t sample = std::min(n, std::max<size_t>(4096, static_cast<size_t>(std::ceil(sample_ratio_ * n))));
    if (!st) {
      size_t k = sparse::count_for(ratio_, n);
      size_t got = ops::topk_abs_exact(in, n, k, sparse::idx_ptr(out), sparse::val_ptr(out, k), sample, key_, 0);
      return sparse::finish(out, kDGC, n, got, static_cast<float>(ratio_));
    }
    float* u = state_buf(st, 0, n, "dgc", "momentum");
    float* v = state_buf(st, 1, n, "dgc", "accum");
    if (!st->scalars) throw std::invalid_argument("dgc: state scalars missing");
    uint64_t step = st->scalars[kStep], counter = st->scalars[kRngCounter];
    ops::axpby(u, momentum_, in, 1.0f, n);
    ops::add(v, u, n);
    double d = density(step);
    size_t k = sparse::count_for(d, n);
    uint32_t* idx = sparse::idx_ptr(out);
    float* val = sparse::val_ptr(out, k);
    size_t got = ops::topk_abs_exact(v, n, k, idx, val, sample, key_, counter);
    for (size_t j = 0; j < got; ++j) {
      v[idx[j]] = 0.0f;
      u[idx[j]] = 0.0f;
    }
    st->scalars[kStep] = step + 1;
    st->scalars[kRngCounter] = counter + sample;
    return sparse::finish(out, kDGC, n, got, static_cast<float>(d));
  }

  void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const override {
    sparse::decode(in, bytes, kDGC, "dgc", out, n, alpha, add);
  }

 private:
  double ratio_, sample_ratio_;
  float momentum_;
  uint64_t warmup_, seed_;
  RngKey key_;
};

}  // namespace
HIPRESS_REGISTER_COMPRESSOR("dgc", DGC);
}  // namespace hipress::compress
