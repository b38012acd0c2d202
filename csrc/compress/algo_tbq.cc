// TBQ, threshold binary quantisation (Strom 2015): elements above +tau are sent
// as +tau, below -tau as -tau, everything else as 0, in 2 bits per element
// (codes 0: 0, 1: +tau, 2: -tau). What is not sent stays in the residual
// (ErrorFeedback decorator, on by default in the Python registry).
//
//   payload: header{bits=2, words[0]=tau} + uint2[n]
#include <cmath>
#include <stdexcept>

#include "compress/compressor.h"
#include "compress/ops.h"

namespace hipress::compress {
namespace {

class TBQ final : public Compressor {
 public:
  explicit TBQ(const Params& p) : Compressor({"tbq", kTBQ, Category::kQuantization, 2.0 / 32, false, 1}) {
    ParamReader r("tbq", p);
    tau_ = static_cast<float>(r.get("threshold", 0.01));
    r.finish();
    if (!(tau_ > 0.0f) || !std::isfinite(tau_)) throw std::invalid_argument("tbq: threshold must be a positive finite number");
  }

  size_t max_encoded_bytes(size_t n, size_t, size_t) const override { return kHeaderBytes + ops::packed_bytes(n, 2); }

  size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView*) const override {
    check_capacity(*this, n, 0, 0, cap);
    Header h;
    h.algo = kTBQ;
    h.bits = 2;
    h.numel = n;
    h.body_bytes = ops::packed_bytes(n, 2);
    h.set_f(0, tau_);
    write_header(h, out);
    ops::threshold_ternary_codes(in, n, tau_, out + kHeaderBytes);
    return kHeaderBytes + h.body_bytes;
  }

  void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const override {
    Header h = read_header(in, bytes, kTBQ, n);
    if (h.bits != 2) throw FormatError("tbq payload: bit width " + std::to_string(h.bits) + ", expected 2");
    expect_body(h, ops::packed_bytes(n, 2), "tbq");
    float tau = h.f(0);
    float table[4] = {0.0f, tau, -tau, 0.0f};  // code 3 is never written
    ops::dequantize_table(in + kHeaderBytes, n, 2, table, alpha, add, out);
  }

 private:
  float tau_;
};

}  // namespace
HIPRESS_REGISTER_COMPRESSOR("tbq", TBQ);
}  // namespace hipress::compress
