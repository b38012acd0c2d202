// CompLL unified API (paper 000 Fig. 4) on raw host buffers, the C++ registry
// of algorithms (one generated file per built-in registers itself, like BytePS's
// compressor_registry.h; setup.py generates them from hipress/dsl/specs/*.cll
// with hipress/dsl/target_module.py) and the error-feedback decorator (BytePS
// error_feedback.h, GRACE eq. 4).
//
// Ownership: the gradient `in` is read in place and never written (except
// through a StateView the caller passed); the caller allocates `out` with at
// least max_encoded_bytes() bytes; per-tensor state (residuals, momentum,
// PowerSGD Q, RNG counter, step) lives in caller-owned buffers described by
// StateView, so the Python side can checkpoint it as plain tensors. A
// Compressor object holds only its parameters: encode/decode are const and
// may run concurrently on different tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "compress/format.h"

namespace hipress::compress {

using Params = std::map<std::string, double>;

enum class Category : uint8_t { kQuantization = 0, kSparsification = 1, kLowRank = 2 };
const char* category_name(Category c);

struct AlgoInfo {
  std::string name;
  uint8_t id = 0;
  Category category = Category::kQuantization;
  double rate = 1.0;          // nominal compressed bytes / fp32 input bytes
  bool aggregatable = false;  // payloads may be summed without decoding (low rank)
  int rounds = 1;             // communication rounds per synchronisation
};

// One float buffer of per-tensor state, as an algorithm declares it.
struct StateBuf {
  std::string name;
  size_t len;
};

// Slots of StateView::scalars.
enum StateScalar : int { kRngCounter = 0, kStep = 1, kFlags = 2, kReserved = 3, kNumScalars = 4 };

// Caller-owned per-tensor state. buf[i] has len[i] floats, in the order the
// algorithm's state_buffers() declared them (decorators append theirs).
struct StateView {
  static constexpr int kMaxBufs = 8;
  float* buf[kMaxBufs] = {};
  size_t len[kMaxBufs] = {};
  int nbufs = 0;
  uint64_t* scalars = nullptr;  // kNumScalars words
  size_t rows = 0, cols = 0;    // matrix view of the tensor (low rank); 0: none
  // The residual before this encode, when the caller keeps it elsewhere than its state buffer; the
  // new residual is written to the buffer. That spares the copy an undo log would take of the
  // residual (hipress/sync/base.py StateStore.encode). ErrorFeedback: n floats, the buffer is
  // buf[nbufs - 1]. A low-rank built-in of the DSL (PowerSGD): the old values of the state array its
  // encode (round 0) first updates with a fused add, its "matrix" (hipress/dsl/target_lowrank.py).
  const float* residual_in = nullptr;
};

class Compressor {
 public:
  explicit Compressor(AlgoInfo info) : info_(std::move(info)) {}
  virtual ~Compressor() = default;
  const AlgoInfo& info() const { return info_; }

  // Per-tensor float state buffers for a tensor of n elements (rows x cols).
  virtual std::vector<StateBuf> state_buffers(size_t n, size_t rows, size_t cols) const { return {}; }
  // Upper bound of encode()'s output, header included.
  virtual size_t max_encoded_bytes(size_t n, size_t rows, size_t cols) const = 0;
  // Compresses in[0, n) into out (capacity cap bytes) and returns the bytes
  // written. st may be null: then the algorithm is a pure function of `in`
  // (no residual, no momentum, RNG counter 0), which is what a strategy calls
  // to re-select top-k of a merged dense buffer.
  virtual size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView* st) const = 0;
  // add == false: out = alpha * decode(in); add == true: out += alpha * decode(in)
  // (fused decode + merge). Throws FormatError for a payload it cannot decode.
  virtual void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const = 0;
  // Error feedback's whole encode in one (ErrorFeedback::encode): res = beta * res_in + gamma * in
  // (res_in null: res), the payload of res into out, then res -= decode(payload); the same bits as
  // those three steps, in fewer passes over memory. Returns the payload's bytes, or 0 where this
  // algorithm (or this call: its rows, its state) has no fused form, having touched nothing.
  virtual size_t encode_feedback(const float* in, size_t n, float* res, const float* res_in, float beta, float gamma,
                                 uint8_t* out, size_t cap, StateView* st) const {
    return 0;
  }

  // ---- multi-round low-rank compressors (info().rounds > 1) -------------------
  // Round r's payload from the gradient (round 0) or from the sum over ranks of
  // round r-1's payloads (prev); see hipress/dsl/specs/powersgd.cll for the protocol.
  virtual size_t encode_round(int round, const float* in, size_t n, const uint8_t* prev, size_t prev_bytes,
                              uint8_t* out, size_t cap, StateView* st) const;
  // out (+)= decode of the last round's summed payload, using the state.
  virtual void finish(const uint8_t* in, size_t bytes, float* out, size_t n, StateView* st, bool add) const;
  // Aggregatable payloads: out = a + b elementwise (out may alias a or b).
  virtual size_t combine(const uint8_t* a, size_t abytes, const uint8_t* b, size_t bbytes, uint8_t* out,
                         size_t cap) const;

 protected:
  AlgoInfo info_;
};

// ---- parameters --------------------------------------------------------------
// Reads algorithm parameters, remembering which keys were used; finish()
// rejects unknown keys with std::invalid_argument (a Python ValueError).
class ParamReader {
 public:
  ParamReader(const std::string& algo, const Params& p) : algo_(algo), p_(p) {}
  double get(const std::string& key, double dflt);
  void finish() const;
  const std::string& algo() const { return algo_; }

 private:
  std::string algo_;
  const Params& p_;
  std::vector<std::string> used_;
};

// ---- registry ----------------------------------------------------------------
using Factory = std::function<std::unique_ptr<Compressor>(const Params&)>;
void register_compressor(const std::string& name, Factory f);
std::unique_ptr<Compressor> create_compressor(const std::string& name, const Params& p);
std::vector<std::string> compressor_names();

struct CompressorRegistrar {
  CompressorRegistrar(const char* name, Factory f) { register_compressor(name, std::move(f)); }
};

#define HIPRESS_REGISTER_COMPRESSOR(name, Class)                              \
  static ::hipress::compress::CompressorRegistrar hipress_compressor_##Class( \
      name, [](const ::hipress::compress::Params& p) { return std::unique_ptr<::hipress::compress::Compressor>(new Class(p)); })

// ---- error feedback ------------------------------------------------------------
// Decorator: before encoding, residual = beta * residual + gamma * grad
// (GRACE eq. 4 "compensate"), the inner compressor encodes the compensated
// residual, then residual -= decode(payload) ("update"), in one call: the inner
// compressor's encode_feedback where it has one (the same bits in fewer passes), else
// those three steps. The residual is the last state buffer ("residual"). Without state it is the
// inner compressor unchanged.
class ErrorFeedback : public Compressor {
 public:
  ErrorFeedback(std::shared_ptr<const Compressor> inner, float beta, float gamma);
  std::vector<StateBuf> state_buffers(size_t n, size_t rows, size_t cols) const override;
  size_t max_encoded_bytes(size_t n, size_t rows, size_t cols) const override;
  size_t encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView* st) const override;
  void decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const override;
  const Compressor& inner() const { return *inner_; }
  float beta() const { return beta_; }
  float gamma() const { return gamma_; }

 private:
  std::shared_ptr<const Compressor> inner_;
  float beta_, gamma_;
};

// Helper of the decorators: state buffer i, checked against its expected length.
float* state_buf(StateView* st, int i, size_t expect_len, const char* algo, const char* what);

}  // namespace hipress::compress
