// A framework-agnostic view of memory: the C++ core never sees torch::Tensor.
// Like Horovod's horovod/common/, everything below hipress/ sees only
// (pointer, bytes, dtype, device, stream); the Python integration layer turns
// tensors into Buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hipress {

enum class DType : uint8_t { kUInt8 = 0, kInt32 = 1, kFloat32 = 2, kFloat16 = 3, kBFloat16 = 4, kInt64 = 5, kFloat64 = 6 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kUInt8: return 1;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kInt32:
    case DType::kFloat32: return 4;
    case DType::kInt64:
    case DType::kFloat64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t);

// device < 0 means host memory; device >= 0 is a CUDA ordinal.
struct Buffer {
  void* data = nullptr;
  size_t bytes = 0;
  DType dtype = DType::kUInt8;
  int device = -1;
  void* stream = nullptr;  // cudaStream_t where device >= 0, else unused

  size_t count() const { return bytes / dtype_size(dtype); }
  bool on_host() const { return device < 0; }
};

}  // namespace hipress
