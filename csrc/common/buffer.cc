#include "common/buffer.h"

namespace hipress {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kUInt8: return "uint8";
    case DType::kInt32: return "int32";
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt64: return "int64";
    case DType::kFloat64: return "float64";
  }
  return "unknown";
}

}  // namespace hipress
