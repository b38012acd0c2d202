// GradDrop (Aji & Heafield 2017): drop the (1 - ratio) smallest gradients by
// magnitude (ratio 0.01: drop 99%). The threshold is estimated from a random
// sample of sample_ratio * n elements (at least 1024, with replacement): the
// ceil(ratio * s)-th largest sampled |g|. Every element with |g| >= threshold
// (and g != 0) is sent; if the estimate lets through more than 2k (k =
// ceil(ratio * n)), the exact top-2k is sent instead, which bounds the payload.
// What is dropped stays in the residual (ErrorFeedback decorator, on by
// default in the Python registry).
//
//   state: scalars rng counter (advances by the sample size)
//   payload: sparse.h, words[0] = threshold used
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "compress/compressor.h"
#include "compress/ops.h"
#include "compress/sparse.h"

namespace hipress::compress {
namespace {

class GradDrop final : public Compressor {
 public:
  explicit GradDrop(const Params& p) : Compressor({"graddrop", kGradDrop, Category::kSparsification, 0.02, false, 1}) {
    ParamReader r("graddrop", p);
    ratio_ = r.get("ratio", 0.01);
    sample_ratio_ = r.get("sample_ratio", 0.01);
    seed_ = static_cast<uint64_t>(r.get("seed", 0));
    r.finish();
    if (!(ratio_ > 0 && ratio_ <= 1)) throw std::invalid_argument("graddrop: ratio must be in (0, 1]");
    if (!(sample_ratio_ > 0 && sample_ratio_ <= 1)) throw std::invalid_argument("graddrop: sample_ratio must be in (0, 1]");
    info_.rate = 2 * ratio_;
    key_ = rng_key(seed_);
  }

  size_t kmax(size_t n) const { return std::min(n, 2 * sparse::count_for(ratio_, n)); }

  size_t max_encoded_bytes(size_t n, size_t, size_t) const override { return sparse::max_bytes(kmax(n)); }

  size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView* st) const override {
    check_capacity(*this, n, 0, 0, cap);
    if (n > 0xffffffffULL) throw std::invalid_argument("graddrop: tensors of 2^32 elements or more are not supported");
    uint64_t counter = st && st->scalars ? st->scalars[kRngCounter] : 0;
    size_t sample = n == 0 ? 0 : std::max<size_t>(1024, static_cast<size_t>(std::ceil(sample_ratio_ * n)));
    float thr = ops::sampled_threshold(in, n, ratio_, sample, key_, counter);
    size_t km = kmax(n);
    std::vector<uint32_t> idx(km);
    std::vector<float> val(km);
    size_t cnt = ops::filter_abs_ge(in, n, thr, idx.data(), val.data(), km);
    if (cnt > km) cnt = ops::topk_abs_exact(in, n, km, idx.data(), val.data(), 0);
    std::memcpy(sparse::idx_ptr(out), idx.data(), 4 * cnt);
    std::memcpy(sparse::val_ptr(out, cnt), val.data(), 4 * cnt);
    if (st && st->scalars) st->scalars[kRngCounter] = counter + sample;
    return sparse::finish(out, kGradDrop, n, cnt, thr);
  }

  void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const override {
    sparse::decode(in, bytes, kGradDrop, "graddrop", out, n, alpha, add);
  }

 private:
  double ratio_, sample_ratio_;
  uint64_t seed_;
  RngKey key_;
};

}  // namespace
HIPRESS_REGISTER_COMPRESSOR("graddrop", GradDrop);
}  // namespace hipress::compress
