// Sparse payloads shared by the sparsification algorithms (DGC, GradDrop):
//   header{count = k} + uint32 idx[k] (strictly ascending, < numel) + fp32 val[k]
#pragma once

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "compress/format.h"
#include "compress/ops.h"

namespace hipress::compress::sparse {

inline size_t max_bytes(size_t kmax) { return kHeaderBytes + 8 * kmax; }

// k = ceil(density * n), at least 1 when n > 0, at most n.
inline size_t count_for(double density, size_t n) {
  if (n == 0) return 0;
  double k = std::ceil(density * static_cast<double>(n));
  if (k < 1) k = 1;
  return k >= static_cast<double>(n) ? n : static_cast<size_t>(k);
}

inline uint32_t* idx_ptr(uint8_t* out) { return reinterpret_cast<uint32_t*>(out + kHeaderBytes); }
inline float* val_ptr(uint8_t* out, size_t k) { return reinterpret_cast<float*>(out + kHeaderBytes + 4 * k); }

// Header for k pairs already written at idx_ptr/val_ptr.
inline size_t finish(uint8_t* out, uint8_t algo, size_t n, size_t k, float p0 = 0, float p1 = 0) {
  Header h;
  h.algo = algo;
  h.numel = n;
  h.count = static_cast<uint32_t>(k);
  h.body_bytes = 8 * static_cast<uint64_t>(k);
  h.set_f(0, p0);
  h.set_f(1, p1);
  write_header(h, out);
  return kHeaderBytes + h.body_bytes;
}

inline void decode(const uint8_t* in, size_t bytes, uint8_t algo, const char* name, float* out, size_t n, float alpha,
                   bool add) {
  Header h = read_header(in, bytes, algo, n);
  if (h.count > n)
    throw FormatError(std::string(name) + " payload: " + std::to_string(h.count) + " pairs for " + std::to_string(n) +
                      " elements");
  expect_body(h, 8 * static_cast<uint64_t>(h.count), name);
  size_t k = h.count;
  // Copy out (the payload may be unaligned) and validate every index before writing.
  std::vector<uint32_t> idx(k);
  std::vector<float> val(k);
  std::memcpy(idx.data(), in + kHeaderBytes, 4 * k);
  std::memcpy(val.data(), in + kHeaderBytes + 4 * k, 4 * k);
  for (size_t j = 0; j < k; ++j)
    if (idx[j] >= n || (j > 0 && idx[j] <= idx[j - 1]))
      throw FormatError(std::string(name) + " payload: index " + std::to_string(idx[j]) + " at position " +
                        std::to_string(j) + " is out of range or not ascending (corrupt payload)");
  if (!add) std::memset(out, 0, n * sizeof(float));
  ops::scatter(idx.data(), val.data(), k, alpha, true, out);
}

}  // namespace hipress::compress::sparse
