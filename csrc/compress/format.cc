#include "compress/format.h"

#include <cstdio>

namespace hipress::compress {

const char* algo_name(uint8_t id) {
  switch (id) {
    case kOneBit: return "onebit";
    case kTBQ: return "tbq";
    case kTernGrad: return "terngrad";
    case kDGC: return "dgc";
    case kGradDrop: return "graddrop";
    case kPowerSGD: return "powersgd";
    case kSignSGD: return "signsgd";
    case kSignum: return "signum";
    case kEFSignSGD: return "efsignsgd";
    case kQSGD: return "qsgd";
    case kNatural: return "natural";
    case kTernGradGrace: return "terngrad_grace";
    case kU8bit: return "u8bit";
    case kFP16: return "fp16";
    case kBF16: return "bf16";
    case kRandomK: return "randomk";
    case kTopK: return "topk";
    case kThreshold: return "threshold";
    case kAdaq: return "adaq";
    case kDGCGrace: return "dgc_grace";
    case kSketch: return "sketch";
    case kPowerSGDGrace: return "powersgd_grace";
    case kInceptionn: return "inceptionn";
    default: return id >= kFirstUserAlgo ? "user algorithm" : "unknown algorithm";
  }
}

Header read_header(const uint8_t* in, size_t bytes, uint8_t expect_algo, size_t expect_numel) {
  if (in == nullptr && bytes > 0) throw FormatError("compressed payload: null data pointer");
  if (bytes < kHeaderBytes)
    throw FormatError("compressed payload truncated: " + std::to_string(bytes) + " bytes, the header alone needs " +
                      std::to_string(kHeaderBytes));
  Header h;
  std::memcpy(&h, in, kHeaderBytes);
  if (h.magic != kMagic) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "not a hipress compressed payload (magic 0x%08x, expected 0x%08x)", h.magic, kMagic);
    throw FormatError(buf);
  }
  if (h.version != kFormatVersion)
    throw FormatError("compressed payload has format version " + std::to_string(h.version) + ", this build reads " +
                      std::to_string(kFormatVersion));
  if (header_check(h) != h.check) throw FormatError("compressed payload header is corrupt (checksum mismatch)");
  if (expect_algo != 0 && h.algo != expect_algo)
    throw FormatError(std::string("compressed payload was made by ") + algo_name(h.algo) + " (id " +
                      std::to_string(h.algo) + "), cannot decode it with " + algo_name(expect_algo));
  const uint64_t have = bytes - kHeaderBytes;
  if (h.body_bytes > have)
    throw FormatError("compressed payload truncated: header announces " + std::to_string(h.body_bytes) +
                      " body bytes, only " + std::to_string(have) + " present");
  if (h.body_bytes < have)  // a payload is exactly header + body: a longer buffer is not this payload
    throw FormatError("compressed payload has " + std::to_string(have - h.body_bytes) +
                      " trailing bytes after the " + std::to_string(h.body_bytes) + " body bytes its header announces");
  if (expect_numel != SIZE_MAX && h.numel != expect_numel)
    throw FormatError("compressed payload holds " + std::to_string(h.numel) + " elements, output has " +
                      std::to_string(expect_numel));
  return h;
}

void expect_body(const Header& h, uint64_t expected, const char* what) {
  if (h.body_bytes != expected)
    throw FormatError(std::string(what) + ": payload body has " + std::to_string(h.body_bytes) + " bytes, expected " +
                      std::to_string(expected));
}

}  // namespace hipress::compress
