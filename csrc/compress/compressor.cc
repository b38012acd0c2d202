#include "compress/compressor.h"

#include <algorithm>
#include <mutex>
#include <stdexcept>

#include "compress/ops.h"

namespace hipress::compress {

const char* category_name(Category c) {
  switch (c) {
    case Category::kQuantization: return "quantization";
    case Category::kSparsification: return "sparsification";
    case Category::kLowRank: return "lowrank";
  }
  return "unknown";
}

size_t Compressor::encode_round(int round, const float*, size_t, const uint8_t*, size_t, uint8_t*, size_t,
                                StateView*) const {
  throw std::invalid_argument(info_.name + " is a single-round compressor: use encode()");
}
void Compressor::finish(const uint8_t*, size_t, float*, size_t, StateView*, bool) const {
  throw std::invalid_argument(info_.name + " is a single-round compressor: use decode()");
}
size_t Compressor::combine(const uint8_t*, size_t, const uint8_t*, size_t, uint8_t*, size_t) const {
  throw std::invalid_argument(info_.name + " payloads are not aggregatable: decode, add, re-encode");
}

double ParamReader::get(const std::string& key, double dflt) {
  used_.push_back(key);
  auto it = p_.find(key);
  return it == p_.end() ? dflt : it->second;
}

void ParamReader::finish() const {
  for (auto& [k, v] : p_)
    if (std::find(used_.begin(), used_.end(), k) == used_.end()) {
      std::string known;
      for (auto& u : used_) known += (known.empty() ? "" : ", ") + u;
      throw std::invalid_argument(algo_ + ": unknown parameter '" + k + "' (known: " + known + ")");
    }
}

namespace {
std::mutex& reg_mu() {
  static std::mutex m;
  return m;
}
std::map<std::string, Factory>& reg() {
  static std::map<std::string, Factory> r;
  return r;
}
}  // namespace

void register_compressor(const std::string& name, Factory f) {
  std::lock_guard<std::mutex> lk(reg_mu());
  reg()[name] = std::move(f);
}

std::unique_ptr<Compressor> create_compressor(const std::string& name, const Params& p) {
  Factory f;
  {
    std::lock_guard<std::mutex> lk(reg_mu());
    auto it = reg().find(name);
    if (it == reg().end()) {
      std::string known;
      for (auto& [k, v] : reg()) known += (known.empty() ? "" : ", ") + k;
      throw std::invalid_argument("unknown native compressor '" + name + "' (known: " + known + ")");
    }
    f = it->second;
  }
  return f(p);
}

std::vector<std::string> compressor_names() {
  std::lock_guard<std::mutex> lk(reg_mu());
  std::vector<std::string> v;
  for (auto& [k, f] : reg()) v.push_back(k);
  return v;
}

float* state_buf(StateView* st, int i, size_t expect_len, const char* algo, const char* what) {
  if (!st || i >= st->nbufs || (st->buf[i] == nullptr && expect_len > 0))
    throw std::invalid_argument(std::string(algo) + ": state buffer '" + what + "' missing");
  if (st->len[i] != expect_len)
    throw std::invalid_argument(std::string(algo) + ": state buffer '" + what + "' has " + std::to_string(st->len[i]) +
                                " elements, expected " + std::to_string(expect_len) +
                                " (state made for another tensor?)");
  return st->buf[i];
}

// ---- error feedback ------------------------------------------------------------
namespace {
AlgoInfo ef_info(const Compressor& inner) {
  AlgoInfo i = inner.info();
  i.name = "ef(" + i.name + ")";
  return i;
}
}  // namespace

ErrorFeedback::ErrorFeedback(std::shared_ptr<const Compressor> inner, float beta, float gamma)
    : Compressor(ef_info(*inner)), inner_(std::move(inner)), beta_(beta), gamma_(gamma) {
  if (inner_->info().rounds != 1)
    throw std::invalid_argument("error feedback decorates single-round compressors; " + inner_->info().name +
                                " has its own error feedback");
}

std::vector<StateBuf> ErrorFeedback::state_buffers(size_t n, size_t rows, size_t cols) const {
  auto v = inner_->state_buffers(n, rows, cols);
  v.push_back({"residual", n});
  return v;
}

size_t ErrorFeedback::max_encoded_bytes(size_t n, size_t rows, size_t cols) const {
  return inner_->max_encoded_bytes(n, rows, cols);
}

size_t ErrorFeedback::encode(const float* in, size_t n, uint8_t* out, size_t cap, StateView* st) const {
  if (!st) return inner_->encode(in, n, out, cap, nullptr);
  int ri = st->nbufs - 1;
  float* res = state_buf(st, ri, n, info_.name.c_str(), "residual");
  StateView inner_st = *st;
  inner_st.nbufs = ri;
  inner_st.residual_in = nullptr;
  if (size_t bytes = inner_->encode_feedback(in, n, res, st->residual_in, beta_, gamma_, out, cap, &inner_st))
    return bytes;
  ops::axpby(res, st->residual_in ? st->residual_in : res, beta_, in, gamma_, n);  // compensate
  size_t bytes = inner_->encode(res, n, out, cap, &inner_st);
  inner_->decode(out, bytes, res, n, -1.0f, true);  // residual = compensated - decoded
  return bytes;
}

void ErrorFeedback::decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) const {
  inner_->decode(in, bytes, out, n, alpha, add);
}

}  // namespace hipress::compress
