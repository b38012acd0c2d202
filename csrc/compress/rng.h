// Counter-based random numbers for CompLL (paper 000, Table 4: random(a, b)).
//
// Every random number is a pure function of (seed, counter): element i of a
// call that starts at counter c uses counter c + i. Nothing is sequential, so
// loops vectorise, chunks can run on any thread in any order, and the pure
// reference (hipress/compression/reference.py) reproduces the stream exactly
// with numpy uint32 arithmetic.
//
//   key0, key1 = two 32-bit words of splitmix64(seed)
//   lo, hi     = low and high 32 bits of the 64-bit counter
//   h          = mix32(mix32(lo ^ key0) ^ hi ^ key1)
//   mix32(x)   = "lowbias32" (C. Wellons): x ^= x>>16; x *= 0x7feb352d;
//                x ^= x>>15; x *= 0x846ca68b; x ^= x>>16
//   uniform    = (h >> 8) * 2^-24              in [0, 1), exactly representable in fp32
//   index < n  = (uint64(h) * n) >> 32          (n < 2^32), no division, no float rounding
#pragma once

#include <cstddef>
#include <cstdint>

// Host and device: under nvcc the functions are __host__ __device__ (the CUDA back end's kernels,
// csrc/compress/cuda/hp_device.h, draw from this same stream).
#if defined(__CUDACC__)
#define HIPRESS_RNG_FN __host__ __device__ inline
#else
#define HIPRESS_RNG_FN inline
#endif

namespace hipress::compress {

struct RngKey {
  uint32_t k0 = 0, k1 = 0;
};

HIPRESS_RNG_FN uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

HIPRESS_RNG_FN RngKey rng_key(uint64_t seed) {
  uint64_t s = splitmix64(seed);
  return RngKey{static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32)};
}

HIPRESS_RNG_FN uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// The 32-bit random word for one 64-bit counter value.
HIPRESS_RNG_FN uint32_t rng_u32(RngKey k, uint64_t counter) {
  uint32_t lo = static_cast<uint32_t>(counter), hi = static_cast<uint32_t>(counter >> 32);
  return mix32(mix32(lo ^ k.k0) ^ hi ^ k.k1);
}

HIPRESS_RNG_FN float u32_to_unit(uint32_t h) { return static_cast<float>(h >> 8) * (1.0f / 16777216.0f); }

HIPRESS_RNG_FN uint32_t u32_to_index(uint32_t h, uint32_t n) {
  return static_cast<uint32_t>((static_cast<uint64_t>(h) * n) >> 32);
}

}  // namespace hipress::compress
