// PowerSGD (Vogels et al. 2019), rank r, one power iteration per step with a
// warm-started Q and error feedback. The tensor is viewed as a matrix M of
// rows x cols (the state's shape; a 1-D tensor is n x 1, which PowerSGD cannot
// compress: its payload is as large as the input, like PyTorch's hook which
// sends such tensors uncompressed). r_eff = min(r, rows, cols).
//
// Two communication rounds; P and Q are SUMMED across ranks (aggregatable: a
// strategy adds payloads with combine() and never decodes in between):
//   round 0  encode_round(0, g):  M = g + e (e: residual; just g without error
//            feedback); Q initialised once from the RNG (uniform in [-1, 1));
//            P = M Q                                     -> payload kind 1 (P)
//   (sum P over ranks)
//   round 1  encode_round(1, prev = sum P): P^ = orthogonalize(sum P);
//            Q = M^T P^; e = M - P^ Q^T (local projection error)
//                                                        -> payload kind 2 (Q)
//   (sum Q over ranks)
//   finish(sum Q):  out (+)= P^ (sum Q)^T; Q_state = sum Q (warm start)
// The result is the SUM over ranks of the rank-r approximations; divide by the
// world size to average, after decoding.
// Single process: encode() runs both rounds locally (sum over one rank) and
// emits kind 0 = P^ and Q together, which decode() reconstructs without state.
//
//   state: buffers matrix (n: M, then the residual e), q (cols*r), p (rows*r);
//          scalars flags bit 0 (Q initialised), rng counter
//   payload: header{kind, count = r_eff, words[0] = rows, words[1] = cols}
//            + fp32 body (kind 1: rows*r, kind 2: cols*r, kind 0: both)
#pragma GCC optimize("fp-contract=off")
#include <cstring>
#include <stdexcept>
#include <vector>

#include "compress/compressor.h"
#include "compress/ops.h"

namespace hipress::compress {
namespace {

enum Kind : uint8_t { kFull = 0, kP = 1, kQ = 2 };

class PowerSGD final : public Compressor {
 public:
  explicit PowerSGD(const Params& p) : Compressor({"powersgd", kPowerSGD, Category::kLowRank, 0.0, true, 2}) {
    ParamReader r("powersgd", p);
    double rank = r.get("rank", 4);
    seed_ = static_cast<uint64_t>(r.get("seed", 0));
    ef_ = r.get("error_feedback", 1) != 0;
    r.finish();
    if (!(rank >= 1 && rank <= 4096)) throw std::invalid_argument("powersgd: rank must be in [1, 4096]");
    rank_ = static_cast<size_t>(rank);
    info_.rate = 2.0 * rank_ / 1024.0;  // nominal: a 1024 x 1024 matrix
    key_ = rng_key(seed_);
  }

  struct Dims {
    size_t rows, cols, r;
  };
  Dims dims(size_t n, size_t rows, size_t cols) const {
    if (rows == 0 && cols == 0) {
      rows = n;
      cols = n ? 1 : 0;
    }
    if (rows * cols != n)
      throw std::invalid_argument("powersgd: matrix shape " + std::to_string(rows) + " x " + std::to_string(cols) +
                                  " does not hold " + std::to_string(n) + " elements");
    return {rows, cols, std::min(rank_, std::min(rows, cols))};
  }

  std::vector<StateBuf> state_buffers(size_t n, size_t rows, size_t cols) const override {
    Dims d = dims(n, rows, cols);
    return {{"matrix", n}, {"q", d.cols * d.r}, {"p", d.rows * d.r}};
  }

  size_t max_encoded_bytes(size_t n, size_t rows, size_t cols) const override {
    if (rows == 0 && cols == 0) return kHeaderBytes + 8 * n;  // any shape: r_eff (rows + cols) <= 2n
    Dims d = dims(n, rows, cols);
    return kHeaderBytes + 4 * d.r * (d.rows + d.cols);
  }

  size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView* st) const override {
    Bufs b = bufs(n, st, "encode");
    check_capacity(*this, n, b.d.rows, b.d.cols, cap);
    const Dims& d = b.d;
    round0_matrix(in, n, b, st);
    float* P = b.p;
    ops::matmul_nn(b.m, b.q, P, d.rows, d.cols, d.r);
    ops::orthogonalize(P, d.rows, d.r);
    float* Qo = reinterpret_cast<float*>(out + kHeaderBytes + 4 * d.rows * d.r);
    std::vector<float> Q(d.cols * d.r);
    ops::matmul_tn(b.m, P, Q.data(), d.rows, d.cols, d.r);
    residual(b, Q.data());
    std::memcpy(b.q, Q.data(), 4 * Q.size());  // warm start
    std::memcpy(out + kHeaderBytes, P, 4 * d.rows * d.r);
    std::memcpy(Qo, Q.data(), 4 * Q.size());
    return write(out, n, d, kFull);
  }

  void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const override {
    Header h = read_header(in, bytes, kPowerSGD, n);
    Dims d = payload_dims(h, n);
    if (h.kind != kFull)
      throw FormatError("powersgd payload of round " + std::to_string(h.kind - 1) +
                        " needs the state: use encode_round/finish");
    expect_body(h, 4 * d.r * (d.rows + d.cols), "powersgd");
    std::vector<float> P(d.rows * d.r), Q(d.cols * d.r);
    std::memcpy(P.data(), in + kHeaderBytes, 4 * P.size());
    std::memcpy(Q.data(), in + kHeaderBytes + 4 * P.size(), 4 * Q.size());
    if (d.r == 0) {
      if (!add) std::memset(out, 0, 4 * n);
      return;
    }
    ops::matmul_nt(P.data(), Q.data(), out, d.rows, d.r, d.cols, alpha, add);
  }

  size_t encode_round(int round, const float* in, size_t n, const uint8_t* prev, size_t prev_bytes, uint8_t* out,
                      size_t cap, StateView* st) const override {
    Bufs b = bufs(n, st, "encode_round");
    const Dims& d = b.d;
    if (round == 0) {
      if (cap < kHeaderBytes + 4 * d.rows * d.r) throw std::invalid_argument("powersgd: output buffer too small for P");
      round0_matrix(in, n, b, st);
      std::vector<float> P(d.rows * d.r);
      ops::matmul_nn(b.m, b.q, P.data(), d.rows, d.cols, d.r);
      std::memcpy(out + kHeaderBytes, P.data(), 4 * P.size());
      return write(out, n, d, kP);
    }
    if (round == 1) {
      if (cap < kHeaderBytes + 4 * d.cols * d.r) throw std::invalid_argument("powersgd: output buffer too small for Q");
      read_body(prev, prev_bytes, n, d, kP, b.p);
      ops::orthogonalize(b.p, d.rows, d.r);
      std::vector<float> Q(d.cols * d.r);
      ops::matmul_tn(b.m, b.p, Q.data(), d.rows, d.cols, d.r);
      residual(b, Q.data());
      std::memcpy(out + kHeaderBytes, Q.data(), 4 * Q.size());
      return write(out, n, d, kQ);
    }
    throw std::invalid_argument("powersgd: round must be 0 or 1 (then finish)");
  }

  void finish(const uint8_t* in, size_t bytes, float* out, size_t n, StateView* st, bool add) const override {
    Bufs b = bufs(n, st, "finish");
    const Dims& d = b.d;
    read_body(in, bytes, n, d, kQ, b.q);
    if (d.r == 0) {
      if (!add) std::memset(out, 0, 4 * n);
      return;
    }
    ops::matmul_nt(b.p, b.q, out, d.rows, d.r, d.cols, 1.0f, add);
  }

  size_t combine(const uint8_t* a, size_t abytes, const uint8_t* bb, size_t bbytes, uint8_t* out,
                 size_t cap) const override {
    Header ha = read_header(a, abytes, kPowerSGD, SIZE_MAX);
    Header hb = read_header(bb, bbytes, kPowerSGD, SIZE_MAX);
    Dims da = payload_dims(ha, ha.numel);
    expect_body(ha, body_bytes(da, ha.kind), "powersgd");
    expect_body(hb, body_bytes(payload_dims(hb, hb.numel), hb.kind), "powersgd");
    if (ha.kind != hb.kind || ha.numel != hb.numel || ha.count != hb.count || ha.words[0] != hb.words[0] ||
        ha.words[1] != hb.words[1])
      throw FormatError("powersgd combine: payloads of different rounds or shapes");
    if (ha.kind == kFull) throw FormatError("powersgd combine: kind-0 payloads (P^, Q) are not summable, only P or Q");
    size_t nf = ha.body_bytes / 4;
    if (cap < kHeaderBytes + ha.body_bytes) throw std::invalid_argument("powersgd combine: output buffer too small");
    std::vector<float> x(nf), y(nf);
    std::memcpy(x.data(), a + kHeaderBytes, 4 * nf);
    std::memcpy(y.data(), bb + kHeaderBytes, 4 * nf);
    for (size_t i = 0; i < nf; ++i) x[i] += y[i];
    std::memcpy(out, a, kHeaderBytes);
    std::memcpy(out + kHeaderBytes, x.data(), 4 * nf);
    return kHeaderBytes + ha.body_bytes;
  }

 private:
  struct Bufs {
    Dims d;
    float *m, *q, *p;
  };

  Bufs bufs(size_t n, StateView* st, const char* what) const {
    if (!st || !st->scalars) throw std::invalid_argument(std::string("powersgd ") + what + " needs a state (new_state)");
    Dims d = dims(n, st->rows, st->cols);
    return {d, state_buf(st, 0, n, "powersgd", "matrix"), state_buf(st, 1, d.cols * d.r, "powersgd", "q"),
            state_buf(st, 2, d.rows * d.r, "powersgd", "p")};
  }

  void round0_matrix(const float* in, size_t n, Bufs& b, StateView* st) const {
    if (ef_)
      ops::add(b.m, in, n);
    else
      std::memcpy(b.m, in, 4 * n);
    if (!(st->scalars[kFlags] & 1)) {
      size_t nq = b.d.cols * b.d.r;
      ops::random_uniform(key_, st->scalars[kRngCounter], b.q, nq);
      for (size_t i = 0; i < nq; ++i) b.q[i] = 2.0f * b.q[i] - 1.0f;
      st->scalars[kRngCounter] += nq;
      st->scalars[kFlags] |= 1;
    }
  }

  // e = M - P^ Q^T (kept in the matrix buffer) or 0 without error feedback.
  void residual(Bufs& b, const float* Q) const {
    size_t n = b.d.rows * b.d.cols;
    if (!ef_) {
      std::memset(b.m, 0, 4 * n);
      return;
    }
    if (b.d.r) ops::matmul_nt(b.p, Q, b.m, b.d.rows, b.d.r, b.d.cols, -1.0f, true);
  }

  static size_t body_bytes(const Dims& d, uint8_t kind) {
    return 4 * d.r * (kind == kP ? d.rows : kind == kQ ? d.cols : d.rows + d.cols);
  }

  Dims payload_dims(const Header& h, size_t n) const {
    size_t rows = h.words[0], cols = h.words[1];
    if (h.kind > kQ) throw FormatError("powersgd payload: unknown kind " + std::to_string(h.kind));
    if (static_cast<uint64_t>(rows) * cols != n || h.count > std::min(rows, cols))
      throw FormatError("powersgd payload: inconsistent shape " + std::to_string(rows) + " x " + std::to_string(cols) +
                        " rank " + std::to_string(h.count) + " for " + std::to_string(n) + " elements");
    return {rows, cols, h.count};
  }

  void read_body(const uint8_t* in, size_t bytes, size_t n, const Dims& d, uint8_t kind, float* dst) const {
    Header h = read_header(in, bytes, kPowerSGD, n);
    if (h.kind != kind)
      throw FormatError("powersgd: expected a payload of kind " + std::to_string(kind) + ", got kind " +
                        std::to_string(h.kind));
    Dims pd = payload_dims(h, n);
    if (pd.rows != d.rows || pd.cols != d.cols || pd.r != d.r)
      throw FormatError("powersgd: payload shape does not match the state's");
    expect_body(h, body_bytes(d, kind), "powersgd");
    std::memcpy(dst, in + kHeaderBytes, h.body_bytes);
  }

  size_t write(uint8_t* out, size_t n, const Dims& d, uint8_t kind) const {
    if (d.rows > 0xffffffffULL || d.cols > 0xffffffffULL) throw std::invalid_argument("powersgd: dimension >= 2^32");
    Header h;
    h.algo = kPowerSGD;
    h.kind = kind;
    h.numel = n;
    h.count = static_cast<uint32_t>(d.r);
    h.body_bytes = body_bytes(d, kind);
    h.words[0] = static_cast<uint32_t>(d.rows);
    h.words[1] = static_cast<uint32_t>(d.cols);
    write_header(h, out);
    return kHeaderBytes + h.body_bytes;
  }

  size_t rank_ = 4;
  uint64_t seed_ = 0;
  bool ef_ = true;
  RngKey key_;
};

}  // namespace
HIPRESS_REGISTER_COMPRESSOR("powersgd", PowerSGD);
}  // namespace hipress::compress
