// onebit (Seide et al. 2014, "1-bit SGD"): one sign bit per element plus the
// per-tensor means of the non-negative and the negative elements; decoding
// maps bit 0 to the non-negative mean and bit 1 to the negative mean. The
// quantisation error is fed back by the ErrorFeedback decorator (the Python
// registry wraps onebit in it by default).
//
//   encode: sums = reduce(G, sign sums); bits = map(G, signbit) packed as uint1
//   payload: header{bits=1, words[0]=mean_pos, words[1]=mean_neg} + uint1[n]
#include "compress/compressor.h"
#include "compress/ops.h"

namespace hipress::compress {
namespace {

class OneBit final : public Compressor {
 public:
  explicit OneBit(const Params& p) : Compressor({"onebit", kOneBit, Category::kQuantization, 1.0 / 32, false, 1}) {
    ParamReader r("onebit", p);
    r.finish();
  }

  size_t max_encoded_bytes(size_t n, size_t, size_t) const override { return kHeaderBytes + ops::packed_bytes(n, 1); }

  size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView*) const override {
    check_capacity(*this, n, 0, 0, cap);
    ops::SignSums s = ops::reduce_sign_sums(in, n);
    float pos = s.pos_count ? static_cast<float>(s.pos_sum / static_cast<double>(s.pos_count)) : 0.0f;
    float neg = s.neg_count ? static_cast<float>(s.neg_sum / static_cast<double>(s.neg_count)) : 0.0f;
    Header h;
    h.algo = kOneBit;
    h.bits = 1;
    h.numel = n;
    h.body_bytes = ops::packed_bytes(n, 1);
    h.set_f(0, pos);
    h.set_f(1, neg);
    write_header(h, out);
    ops::pack_signbits(in, n, out + kHeaderBytes);
    return kHeaderBytes + h.body_bytes;
  }

  void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const override {
    Header h = read_header(in, bytes, kOneBit, n);
    if (h.bits != 1) throw FormatError("onebit payload: bit width " + std::to_string(h.bits) + ", expected 1");
    expect_body(h, ops::packed_bytes(n, 1), "onebit");
    float table[2] = {h.f(0), h.f(1)};
    ops::dequantize_table(in + kHeaderBytes, n, 1, table, alpha, add, out);
  }
};

}  // namespace
HIPRESS_REGISTER_COMPRESSOR("onebit", OneBit);
}  // namespace hipress::compress
