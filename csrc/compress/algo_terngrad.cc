// TernGrad as CompLL writes it (paper 000 Fig. 5): min/max scaling onto a
// `bitwidth`-bit grid (2, 4 or 8) with stochastic rounding, unbiased:
//   gap = (max - min) / (2^b - 1)
//   q_i = floor((g_i - min) * (1 / gap) + u_i),  u_i = random(0, 1) at counter c + i
//   decode: min + q_i * gap
// The random stream is the counter-based RNG of rng.h keyed by `seed`; with a
// state the counter advances by n per encode (so successive steps differ and
// a restored state resumes the same stream), without one it starts at 0.
//
//   payload: header{bits=b, words[0]=min, words[1]=max, words[2]=gap} + uint_b[n]
#pragma GCC optimize("fp-contract=off")
#include <cmath>
#include <stdexcept>

#include "compress/compressor.h"
#include "compress/ops.h"

namespace hipress::compress {
namespace {

class TernGrad final : public Compressor {
 public:
  explicit TernGrad(const Params& p) : Compressor({"terngrad", kTernGrad, Category::kQuantization, 2.0 / 32, false, 1}) {
    ParamReader r("terngrad", p);
    double b = r.get("bitwidth", 2);
    seed_ = static_cast<uint64_t>(r.get("seed", 0));
    r.finish();
    if (b != 2 && b != 4 && b != 8) throw std::invalid_argument("terngrad: bitwidth must be 2, 4 or 8");
    bits_ = static_cast<int>(b);
    info_.rate = bits_ / 32.0;
    key_ = rng_key(seed_);
  }

  size_t max_encoded_bytes(size_t n, size_t, size_t) const override {
    return kHeaderBytes + ops::packed_bytes(n, bits_);
  }

  size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView* st) const override {
    check_capacity(*this, n, 0, 0, cap);
    ops::MinMax mm = ops::reduce_minmax(in, n);
    const float levels = static_cast<float>((1 << bits_) - 1);
    float gap = (mm.max - mm.min) / levels;
    float inv_gap = gap > 0.0f ? 1.0f / gap : 0.0f;
    uint64_t counter = st && st->scalars ? st->scalars[kRngCounter] : 0;
    Header h;
    h.algo = kTernGrad;
    h.bits = static_cast<uint8_t>(bits_);
    h.numel = n;
    h.body_bytes = ops::packed_bytes(n, bits_);
    h.set_f(0, mm.min);
    h.set_f(1, mm.max);
    h.set_f(2, gap);
    write_header(h, out);
    ops::quantize_stochastic(in, n, mm.min, inv_gap, bits_, key_, counter, out + kHeaderBytes);
    if (st && st->scalars) st->scalars[kRngCounter] = counter + n;
    return kHeaderBytes + h.body_bytes;
  }

  void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const override {
    Header h = read_header(in, bytes, kTernGrad, n);
    if (h.bits != 2 && h.bits != 4 && h.bits != 8)
      throw FormatError("terngrad payload: bit width " + std::to_string(h.bits) + " (2, 4 or 8 expected)");
    expect_body(h, ops::packed_bytes(n, h.bits), "terngrad");
    float mn = h.f(0), gap = h.f(2);
    float table[256];
    for (int c = 0; c < (1 << h.bits); ++c) {
      float step = static_cast<float>(c) * gap;
      table[c] = mn + step;
    }
    ops::dequantize_table(in + kHeaderBytes, n, h.bits, table, alpha, add, out);
  }

 private:
  int bits_ = 2;
  uint64_t seed_ = 0;
  RngKey key_;
};

}  // namespace
HIPRESS_REGISTER_COMPRESSOR("terngrad", TernGrad);
}  // namespace hipress::compress
