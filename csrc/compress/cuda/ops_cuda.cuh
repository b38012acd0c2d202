// Device-side common operators of the CompLL CUDA back end (paper Table 4 on the GPU).
//
// Header-only, included by every .cu file hipress/dsl/codegen_cuda.py generates
// (one translation unit per spec, compiled by hipress/dsl/build.py with nvcc).
// The generated code runs on the host and enqueues these operators on the
// caller's stream; per-element work is a functor (a generated struct holding
// the call's scalar context and array views, whose operator() calls the
// spec's __host__ __device__ user-defined functions).
//
//   map_packed     one thread per output byte: 8/bits codes computed and packed
//                  LSB first by that thread (no atomics on packed words)
//   map_plain      one thread per element
//   reduce_stats   block + grid reduction of min / max (NaN ignored), double sum
//                  and count of the kept elements, in one pass
//   fold_chunks    a user-defined reducer folded per fixed chunk of kGrain
//                  elements (the CPU back end's chunks), partials merged on the
//                  host in chunk order: the same result as the CPU back end
//   scan_u32       device-wide exclusive prefix sum (block scan + recursive
//                  scan of block sums), used by compact
//   compact        stream compaction by flags in ascending index order
//   kth_largest    exact k-th largest 32-bit key by 4 passes of 8-bit radix
//                  histograms (keys: |x| bits, or order-preserving float bits)
//   topk           exact top-k, ties to the lower index (threshold key +
//                  prefix-sum ranks of the ties + compaction)
//   sampled_threshold   the CPU operator's sample (same counters) + kth_largest
//   scatter_set / scatter_decode / dequantize_table / decode_map
//   header_write / header_read   the 48-byte header of format.h
//
// Memory: temporaries are stream-ordered (cudaMallocAsync / cudaFreeAsync) on
// the stream of the current hpc_* call. Scalars the host needs (reduction
// results, counts) are copied back with a stream synchronisation.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "compress/cuda/hp_device.h"
#include "compress/format.h"

namespace hpd {

constexpr size_t kGrain = size_t{1} << 16;  // == hipress::compress::ops::kGrain (CPU chunking)
constexpr int kBlock = 256;

// The stream of the hpc_* call in progress on this host thread.
inline cudaStream_t& cur_stream() {
  static thread_local cudaStream_t s = nullptr;
  return s;
}

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }
inline void sync(const char* what) { check(cudaStreamSynchronize(cur_stream()), what); }

inline unsigned grid_for(size_t n) {
  size_t g = (n + kBlock - 1) / kBlock;
  if (g < 1) g = 1;
  if (g > 65535u * 16u) g = 65535u * 16u;  // grid-stride loops cover the rest
  return static_cast<unsigned>(g);
}

// Stream-ordered device memory, shared ownership (array values are immutable
// once made; in-place operators copy unless they own the only reference).
template <class T>
struct DevBuf {
  std::shared_ptr<T> ptr;
  T* get() const { return ptr.get(); }
  void alloc(size_t n) {
    ptr.reset();
    if (n == 0) return;
    void* p = nullptr;
    cudaStream_t s = cur_stream();
    check(cudaMallocAsync(&p, n * sizeof(T), s), "cudaMallocAsync");
    ptr = std::shared_ptr<T>(static_cast<T*>(p), [s](T* q) { cudaFreeAsync(q, s); });
  }
};

template <class T>
inline void copy_d2h(T* dst, const T* src, size_t n) {
  if (n) check(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToHost, cur_stream()), "copy to host");
  sync("copy to host");
}
inline void copy_d2d(void* dst, const void* src, size_t bytes) {
  if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cur_stream()), "device copy");
}

// ---- map ----
template <class F>
__global__ void k_map_packed(F f, size_t n, int bits, uint8_t* out) {
  const size_t per = static_cast<size_t>(8 / bits), nbytes = (n + per - 1) / per;
  const unsigned mask = (1u << bits) - 1u;
  for (size_t b = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; b < nbytes;
       b += static_cast<size_t>(gridDim.x) * blockDim.x) {
    unsigned byte = 0;
    for (size_t j = 0; j < per; ++j) {
      size_t i = b * per + j;
      if (i < n) byte |= (static_cast<unsigned>(f(i)) & mask) << (j * static_cast<size_t>(bits));
    }
    out[b] = static_cast<uint8_t>(byte);
  }
}
template <class F>
void map_packed(F f, size_t n, int bits, uint8_t* out) {
  if (n == 0) return;
  k_map_packed<<<grid_for(packed_bytes(n, bits)), kBlock, 0, cur_stream()>>>(f, n, bits, out);
  check_launch("map (packed)");
}
template <class T, class F>
__global__ void k_map_plain(F f, size_t n, T* out) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = static_cast<T>(f(i));
}
template <class T, class F>
void map_plain(F f, size_t n, T* out) {
  if (n == 0) return;
  k_map_plain<T><<<grid_for(n), kBlock, 0, cur_stream()>>>(f, n, out);
  check_launch("map");
}

// ---- reductions ----
struct Stats {
  float mn, mx;      // min / max of the kept values (NaN ignored); +-inf when none
  int hmn, hmx;      // some kept value was < +inf / > -inf (the CPU loop's 'has')
  double sum;        // sum of the kept values (double)
  unsigned long long cnt;  // kept elements
};
HPD void stats_init(Stats& s) {
  s.mn = hpd::bitsf(0x7f800000u);
  s.mx = hpd::bitsf(0xff800000u);
  s.hmn = 0;
  s.hmx = 0;
  s.sum = 0;
  s.cnt = 0;
}
HPD void stats_merge(Stats& a, const Stats& b) {
  if (b.mn < a.mn) a.mn = b.mn;
  if (b.mx > a.mx) a.mx = b.mx;
  a.hmn |= b.hmn;
  a.hmx |= b.hmx;
  a.sum += b.sum;
  a.cnt += b.cnt;
}
// F: __device__ bool operator()(size_t i, float& vf, double& vd) const (false: element not kept).
template <class F>
__global__ void k_reduce_stats(F f, size_t n, Stats* part) {
  __shared__ Stats sh[kBlock];
  Stats a;
  stats_init(a);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float vf;
    double vd;
    if (!f(i, vf, vd)) continue;
    if (vf < a.mn) { a.mn = vf; a.hmn = 1; }
    if (vf > a.mx) { a.mx = vf; a.hmx = 1; }
    a.sum += vd;
    a.cnt += 1;
  }
  sh[threadIdx.x] = a;
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) stats_merge(sh[threadIdx.x], sh[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) part[blockIdx.x] = sh[0];
}
template <int = 0>
__global__ void k_reduce_parts(Stats* part, unsigned nparts) {
  __shared__ Stats sh[kBlock];
  Stats a;
  stats_init(a);
  for (unsigned i = threadIdx.x; i < nparts; i += blockDim.x) stats_merge(a, part[i]);
  sh[threadIdx.x] = a;
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) stats_merge(sh[threadIdx.x], sh[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) part[0] = sh[0];
}
template <class F>
Stats reduce_stats(F f, size_t n) {
  Stats r;
  stats_init(r);
  if (n == 0) return r;
  unsigned g = std::min<unsigned>(grid_for(n), 1024u);
  DevBuf<Stats> part;
  part.alloc(g);
  k_reduce_stats<<<g, kBlock, 0, cur_stream()>>>(f, n, part.get());
  check_launch("reduce");
  k_reduce_parts<<<1, kBlock, 0, cur_stream()>>>(part.get(), g);
  check_launch("reduce (partials)");
  copy_d2h(&r, part.get(), 1);
  return r;
}

// A user-defined reducer: F: __device__ void operator()(size_t b, size_t e, Part& p) const folds
// [b, e) in order into p; the host merges the partials in chunk order.
template <class T>
struct FoldPart {
  T v;
  int has;
};
template <class T, class F>
__global__ void k_fold_chunks(F f, size_t n, size_t nc, FoldPart<T>* part) {
  for (size_t c = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; c < nc;
       c += static_cast<size_t>(gridDim.x) * blockDim.x) {
    FoldPart<T> p;
    p.v = T();
    p.has = 0;
    size_t b = c * kGrain, e = b + kGrain < n ? b + kGrain : n;
    f(b, e, p);
    part[c] = p;
  }
}
template <class T, class F>
std::vector<FoldPart<T>> fold_chunks(F f, size_t n) {
  size_t nc = (n + kGrain - 1) / kGrain;
  std::vector<FoldPart<T>> host(nc);
  if (nc == 0) return host;
  DevBuf<FoldPart<T>> part;
  part.alloc(nc);
  k_fold_chunks<T><<<grid_for(nc), kBlock, 0, cur_stream()>>>(f, n, nc, part.get());
  check_launch("reduce (user-defined reducer)");
  copy_d2h(host.data(), part.get(), nc);
  return host;
}

// ---- prefix sum and compaction ----
constexpr int kScanPer = 4;                      // items per thread
constexpr size_t kScanTile = kBlock * kScanPer;  // items per block
__device__ inline uint32_t block_exclusive_scan(uint32_t v, uint32_t* total) {
  __shared__ uint32_t sh[kBlock];
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int d = 1; d < kBlock; d <<= 1) {
    uint32_t t = static_cast<int>(threadIdx.x) >= d ? sh[threadIdx.x - d] : 0;
    __syncthreads();
    sh[threadIdx.x] += t;
    __syncthreads();
  }
  uint32_t incl = sh[threadIdx.x];
  if (total) *total = sh[kBlock - 1];
  __syncthreads();
  return incl - v;
}
template <int = 0>
__global__ void k_scan_tiles(const uint32_t* in, size_t n, uint32_t* out, uint32_t* tile_sums) {
  size_t base = blockIdx.x * kScanTile + threadIdx.x * static_cast<size_t>(kScanPer);
  uint32_t v[kScanPer], s = 0;
  for (int j = 0; j < kScanPer; ++j) {
    v[j] = base + j < n ? in[base + j] : 0;
    s += v[j];
  }
  uint32_t total = 0;
  uint32_t off = block_exclusive_scan(s, &total);
  for (int j = 0; j < kScanPer; ++j) {
    if (base + j < n) out[base + j] = off;
    off += v[j];
  }
  if (threadIdx.x == 0 && tile_sums) tile_sums[blockIdx.x] = total;
}
template <int = 0>
__global__ void k_add_tile_offsets(uint32_t* out, size_t n, const uint32_t* offs) {
  size_t base = blockIdx.x * kScanTile + threadIdx.x * static_cast<size_t>(kScanPer);
  for (int j = 0; j < kScanPer; ++j)
    if (base + j < n) out[base + j] += offs[blockIdx.x];
}
// out[i] = in[0] + ... + in[i-1] (mod 2^32; callers keep totals below 2^32).
inline void scan_u32(const uint32_t* in, size_t n, uint32_t* out) {
  if (n == 0) return;
  size_t tiles = (n + kScanTile - 1) / kScanTile;
  if (tiles > 0x7fffffffULL) throw std::invalid_argument("scan: too many elements");
  if (tiles == 1) {
    k_scan_tiles<<<1, kBlock, 0, cur_stream()>>>(in, n, out, nullptr);
    check_launch("scan");
    return;
  }
  DevBuf<uint32_t> sums, offs;
  sums.alloc(tiles);
  offs.alloc(tiles);
  k_scan_tiles<<<static_cast<unsigned>(tiles), kBlock, 0, cur_stream()>>>(in, n, out, sums.get());
  check_launch("scan");
  scan_u32(sums.get(), tiles, offs.get());
  k_add_tile_offsets<<<static_cast<unsigned>(tiles), kBlock, 0, cur_stream()>>>(out, n, offs.get());
  check_launch("scan (offsets)");
}
template <class P>
__global__ void k_flags(P pred, size_t n, uint32_t* flags) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    flags[i] = pred(i) ? 1u : 0u;
}
template <int = 0>
__global__ void k_compact(const uint32_t* flags, const uint32_t* pos, size_t n, const float* src, size_t cap,
                                 uint32_t* idx, float* val) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    if (flags[i] && pos[i] < cap) {
      idx[pos[i]] = static_cast<uint32_t>(i);
      val[pos[i]] = src[i];
    }
}
// Writes the first `cap` flagged elements (ascending index) to idx/val; returns how many were flagged.
inline size_t compact(const uint32_t* flags, size_t n, const float* src, size_t cap, uint32_t* idx, float* val) {
  if (n == 0) return 0;
  DevBuf<uint32_t> pos;
  pos.alloc(n);
  scan_u32(flags, n, pos.get());
  k_compact<<<grid_for(n), kBlock, 0, cur_stream()>>>(flags, pos.get(), n, src, cap, idx, val);
  check_launch("compact");
  uint32_t last[2];
  copy_d2h(&last[0], pos.get() + (n - 1), 1);
  copy_d2h(&last[1], flags + (n - 1), 1);
  return static_cast<size_t>(last[0]) + last[1];
}
// filter(A, p, cap): P: __device__ bool operator()(size_t i) const.
template <class P>
size_t filter(P pred, size_t n, const float* src, size_t cap, uint32_t* idx, float* val) {
  if (n == 0) return 0;
  if (n > 0xffffffffULL) throw std::invalid_argument("filter: more than 2^32 - 1 elements");
  DevBuf<uint32_t> flags;
  flags.alloc(n);
  k_flags<<<grid_for(n), kBlock, 0, cur_stream()>>>(pred, n, flags.get());
  check_launch("filter");
  return compact(flags.get(), n, src, cap, idx, val);
}

// ---- selection ----
// Order keys: a larger key comes first. -0 and +0 are equal (as for the CPU comparisons).
enum Order { kGreaterAbs = 0, kGreater = 1, kSmaller = 2 };
HPD uint32_t order_key(float x, int order) {
  uint32_t b = hpd::fbits(x);
  if (order == kGreaterAbs) return b & 0x7fffffffu;
  if ((b & 0x7fffffffu) == 0) b = 0;
  uint32_t k = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // monotone in x
  return order == kGreater ? k : ~k;
}
template <int = 0>
__global__ void k_hist(const float* in, size_t n, int order, uint32_t prefix, uint32_t mask, int shift,
                              unsigned int* hist) {
  __shared__ unsigned int sh[256];
  for (int j = threadIdx.x; j < 256; j += blockDim.x) sh[j] = 0;
  __syncthreads();
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t k = order_key(in[i], order);
    if ((k & mask) == prefix) atomicAdd(&sh[(k >> shift) & 255u], 1u);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < 256; j += blockDim.x)
    if (sh[j]) atomicAdd(&hist[j], sh[j]);
}
// The k-th largest key (1 <= k <= n), exactly (histogram counts are integers: no rounding).
inline uint32_t kth_largest_key(const float* in, size_t n, size_t k, int order) {
  if (k == 0 || k > n) throw std::invalid_argument("kth_largest: need 1 <= k <= n");
  DevBuf<unsigned int> hist;
  hist.alloc(256);
  uint32_t prefix = 0, mask = 0;
  unsigned int h[256];
  for (int shift = 24; shift >= 0; shift -= 8) {
    check(cudaMemsetAsync(hist.get(), 0, 256 * sizeof(unsigned int), cur_stream()), "memset");
    k_hist<<<std::min<unsigned>(grid_for(n), 1024u), kBlock, 0, cur_stream()>>>(in, n, order, prefix, mask, shift,
                                                                                  hist.get());
    check_launch("select (histogram)");
    copy_d2h(h, hist.get(), 256);
    int bin = 255;
    for (; bin > 0; --bin) {
      if (h[bin] >= k) break;
      k -= h[bin];
    }
    prefix |= static_cast<uint32_t>(bin) << shift;
    mask |= 255u << shift;
  }
  return prefix;
}
template <int = 0>
__global__ void k_tie_flags(const float* in, size_t n, int order, uint32_t t, uint32_t* eq) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    eq[i] = order_key(in[i], order) == t ? 1u : 0u;
}
template <int = 0>
__global__ void k_topk_flags(const float* in, size_t n, int order, uint32_t t, const uint32_t* eq_rank,
                                    size_t need, uint32_t* flags) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t k = order_key(in[i], order);
    flags[i] = (k > t || (k == t && eq_rank[i] < need)) ? 1u : 0u;
  }
}
struct KeyAbove {
  const float* in;
  int order;
  uint32_t t;
  __device__ bool operator()(size_t i, float& vf, double& vd) const {
    vf = 0.0f;
    vd = 0.0;
    return order_key(in[i], order) > t;
  }
};
// sort(A, order, k): the k first elements in `order`, ties to the lower index, in ascending index
// order. Returns min(k, n).
inline size_t topk(const float* in, size_t n, size_t k, int order, uint32_t* idx, float* val) {
  if (n > 0xffffffffULL) throw std::invalid_argument("sort: more than 2^32 - 1 elements");
  k = std::min(k, n);
  if (k == 0) return 0;
  uint32_t t = kth_largest_key(in, n, k, order);
  DevBuf<uint32_t> eq, rank, flags;
  eq.alloc(n);
  rank.alloc(n);
  flags.alloc(n);
  k_tie_flags<<<grid_for(n), kBlock, 0, cur_stream()>>>(in, n, order, t, eq.get());
  check_launch("sort (ties)");
  scan_u32(eq.get(), n, rank.get());
  uint32_t last[2];
  copy_d2h(&last[0], rank.get() + (n - 1), 1);
  copy_d2h(&last[1], eq.get() + (n - 1), 1);
  size_t ties = static_cast<size_t>(last[0]) + last[1];
  // Elements strictly before t in the order: at most k - 1, the rest of the k are ties.
  const size_t gt = static_cast<size_t>(reduce_stats(KeyAbove{in, order, t}, n).cnt);  // keys before t
  size_t need = k - gt;
  if (need > ties) throw std::logic_error("sort: inconsistent selection");
  k_topk_flags<<<grid_for(n), kBlock, 0, cur_stream()>>>(in, n, order, t, rank.get(), need, flags.get());
  check_launch("sort (select)");
  return compact(flags.get(), n, in, k, idx, val);
}
template <int = 0>
__global__ void k_sample_abs(const float* in, size_t n, RngKey key, uint64_t counter, size_t s, float* out) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < s;
       j += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[j] = hp::m::fabs(in[u32_to_index(rng_u32(key, counter + j), static_cast<uint32_t>(n))]);
}
// threshold(A, f, s): the ceil(f*s)-th largest |A[j]| over s random positions (the CPU operator's counters).
inline float sampled_threshold(const float* in, size_t n, double keep, size_t sample, RngKey key, uint64_t counter) {
  if (n == 0 || sample == 0) return 0.0f;
  if (n > 0xffffffffULL) throw std::invalid_argument("sampled_threshold: more than 2^32 - 1 elements");
  DevBuf<float> sm;
  sm.alloc(sample);
  k_sample_abs<<<grid_for(sample), kBlock, 0, cur_stream()>>>(in, n, key, counter, sample, sm.get());
  check_launch("threshold (sample)");
  size_t r = static_cast<size_t>(std::ceil(keep * static_cast<double>(sample)));
  r = std::max<size_t>(1, std::min(r, sample));
  return bitsf(kth_largest_key(sm.get(), sample, r, kGreaterAbs));
}

// ---- scatter / decode ----
template <int = 0>
__global__ void k_scatter_set(float* dst, size_t n, const int32_t* idx, size_t k, float v) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<size_t>(gridDim.x) * blockDim.x) {
    int64_t ix = idx[j];
    if (ix >= 0 && static_cast<uint64_t>(ix) < n) dst[ix] = v;
  }
}
// A = scatter(A, I, v) in encode: out-of-range indices are ignored.
inline void scatter_set(float* dst, size_t n, const int32_t* idx, size_t k, float v) {
  if (k == 0) return;
  k_scatter_set<<<grid_for(k), kBlock, 0, cur_stream()>>>(dst, n, idx, k, v);
  check_launch("scatter");
}
template <int = 0>
__global__ void k_check_indices(const int32_t* idx, size_t k, size_t n, unsigned long long* first_bad) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<size_t>(gridDim.x) * blockDim.x) {
    int64_t ix = idx[j];
    if (ix < 0 || static_cast<uint64_t>(ix) >= n || (j > 0 && ix <= idx[j - 1])) atomicMin(first_bad, j);
  }
}
template <int = 0>
__global__ void k_scatter_add(const int32_t* idx, const float* val, size_t k, float alpha, float* out) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<size_t>(gridDim.x) * blockDim.x) {
    if (alpha == 1.0f)
      out[idx[j]] += val[j];
    else
      out[idx[j]] += alpha * val[j];
  }
}
// gradient = scatter(I, V) in decode: indices validated first (strictly ascending, in range;
// a bad one throws before the output is touched), then (after zeroing unless add) out[I] += alpha*V.
inline void scatter_decode(const int32_t* idx, const float* val, size_t k, size_t n, float alpha, bool add, float* out,
                           const std::string& name) {
  if (k) {
    DevBuf<unsigned long long> bad;
    bad.alloc(1);
    unsigned long long none = ~0ULL, first = 0;
    check(cudaMemcpyAsync(bad.get(), &none, sizeof none, cudaMemcpyHostToDevice, cur_stream()), "copy");
    k_check_indices<<<grid_for(k), kBlock, 0, cur_stream()>>>(idx, k, n, bad.get());
    check_launch("scatter (check)");
    copy_d2h(&first, bad.get(), 1);
    if (first != none) {
      int32_t ix = 0;
      copy_d2h(&ix, idx + first, 1);
      throw hipress::compress::FormatError(name + " payload: index " + std::to_string(ix) + " at position " +
                                           std::to_string(first) + " is out of range or not ascending (corrupt payload)");
    }
  }
  if (!add && n) check(cudaMemsetAsync(out, 0, n * sizeof(float), cur_stream()), "memset");
  if (k == 0) return;
  k_scatter_add<<<grid_for(k), kBlock, 0, cur_stream()>>>(idx, val, k, alpha, out);
  check_launch("scatter");
}
struct Table {
  float v[256];
};
template <int = 0>
__global__ void k_dequantize(const uint8_t* packed, size_t n, int bits, Table tab, bool add, float* out) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v = tab.v[hp::get_bits(packed, i, bits)];
    if (add)
      out[i] += v;
    else
      out[i] = v;
  }
}
// gradient = map(Q, f) for packed Q and a deterministic f: f tabulated over the 2^bits codes on the
// host, scaled by alpha as ops::dequantize_table does (alpha * table[c], then = or +=).
inline void dequantize_table(const uint8_t* packed, size_t n, int bits, const float* table, float alpha, bool add,
                             float* out) {
  if (bits != 1 && bits != 2 && bits != 4 && bits != 8) throw std::invalid_argument("dequantize_table: bad bits");
  Table t{};
  for (int c = 0; c < (1 << bits); ++c) t.v[c] = alpha == 1.0f ? table[c] : alpha * table[c];
  if (n == 0) return;
  k_dequantize<<<grid_for(n), kBlock, 0, cur_stream()>>>(packed, n, bits, t, add, out);
  check_launch("dequantize");
}
template <class F>
__global__ void k_decode_map(F f, size_t n, float alpha, bool add, float* out) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v = f(i);
    if (alpha != 1.0f) v = alpha * v;
    if (add)
      out[i] += v;
    else
      out[i] = v;
  }
}
template <class F>
void decode_map(F f, size_t n, float alpha, bool add, float* out) {
  if (n == 0) return;
  k_decode_map<<<grid_for(n), kBlock, 0, cur_stream()>>>(f, n, alpha, add, out);
  check_launch("decode map");
}

// ---- header ----
// concat: the header is serialised on the host (hpd::header_serialize, identical to format.h's
// write_header) and copied in front of the body.
inline void header_write(const HeaderFields& f, uint8_t* d_out) {
  uint8_t h[kHeaderBytes];
  header_serialize(f, h);
  check(cudaMemcpyAsync(d_out, h, kHeaderBytes, cudaMemcpyHostToDevice, cur_stream()), "header copy");
  sync("header copy");  // h is a stack buffer
}
// extract: the header is copied to the host and validated by format.h's read_header.
inline hipress::compress::Header header_read(const uint8_t* d_in, size_t bytes, uint8_t algo, size_t n) {
  uint8_t h[kHeaderBytes] = {};
  if (d_in != nullptr && bytes >= kHeaderBytes) copy_d2h(h, d_in, kHeaderBytes);
  return hipress::compress::read_header(d_in == nullptr ? nullptr : h, bytes, algo, n);
}

}  // namespace hpd
