// common.cuh: small device helpers shared by the toolkit's kernels.
//
// Plain CUDA only (no torch headers), so each .cu file compiles on its own with
// `nvcc -c`. Conversions are explicit intrinsics because torch's extension build
// defines __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "launchers.h"

namespace toolkit {

// ---------------------------------------------------------------------------
// Scalar conversions (math is always fp32)

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// ---------------------------------------------------------------------------
// Packs: N consecutive elements moved with one (or two) wide memory instructions.
// NOTE: alignment is capped at 16 bytes, the widest load; a 32-byte fp32 pack is
// two LDG.128. Callers check `is_aligned` before taking the packed path.

template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Pack {
  T v[N];
};

// Cache hints for data touched once: kCacheStream (ld/st.global.cs, evict first) keeps it from
// pushing out of L1/L2 what the kernel reuses (a norm's weight, say); kCacheNoAllocate (loads of
// read-only data: ld.global.nc.L1::no_allocate.L2::256B) skips L1 and fetches 256-byte L2 sectors.
enum CacheHint : int { kCacheDefault = 0, kCacheStream = 1, kCacheNoAllocate = 2 };

// The kernels' hint masks (their tuning macros): 1 streaming loads, 2 streaming stores, 4 loads
// that skip L1 (over 1).
constexpr int load_hint(int mask) { return (mask & 4) ? kCacheNoAllocate : (mask & 1) ? kCacheStream : kCacheDefault; }
constexpr int store_hint(int mask) { return (mask & 2) ? kCacheStream : kCacheDefault; }

__device__ __forceinline__ int4 load_no_allocate(const int4* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ int2 load_no_allocate(const int2* p) {
  int2 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v2.s32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ int load_no_allocate(const int* p) {
  int v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

template <int kHint, typename W>
__device__ __forceinline__ W load_word(const W* p) {
  if constexpr (kHint == kCacheStream) return __ldcs(p);
  else if constexpr (kHint == kCacheNoAllocate) return load_no_allocate(p);
  else return *p;
}

template <int kHint, typename W>
__device__ __forceinline__ void store_word(W* p, W v) {
  if constexpr (kHint == kCacheStream) __stcs(p, v);
  else *p = v;
}

// The pack's bytes as 16-, 8- or 4-byte words (one instruction each).
template <int kBytes>
using PackWord = typename std::conditional<kBytes % 16 == 0, int4,
                 typename std::conditional<kBytes % 8 == 0, int2, int>::type>::type;

template <typename T, int N, int kHint = kCacheDefault>
__device__ __forceinline__ void load_pack(const T* p, float (&out)[N]) {
  Pack<T, N> pk;
  if constexpr (kHint != kCacheDefault && sizeof(pk) % 4 == 0) {
    using W = PackWord<sizeof(pk)>;
#pragma unroll
    for (int i = 0; i < (int)(sizeof(pk) / sizeof(W)); ++i)
      reinterpret_cast<W*>(&pk)[i] = load_word<kHint>(reinterpret_cast<const W*>(p) + i);
  } else {
    pk = *reinterpret_cast<const Pack<T, N>*>(p);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(pk.v[i]);
}

template <typename T, int N, int kHint = kCacheDefault>
__device__ __forceinline__ void store_pack(T* p, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = from_float<T>(in[i]);
  if constexpr (kHint != kCacheDefault && sizeof(pk) % 4 == 0) {
    using W = PackWord<sizeof(pk)>;
#pragma unroll
    for (int i = 0; i < (int)(sizeof(pk) / sizeof(W)); ++i)
      store_word<kHint>(reinterpret_cast<W*>(p) + i, reinterpret_cast<const W*>(&pk)[i]);
  } else {
    *reinterpret_cast<Pack<T, N>*>(p) = pk;
  }
}

__host__ __device__ __forceinline__ bool is_aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

template <typename T, int N>
__host__ __device__ __forceinline__ int pack_alignment() {
  return sizeof(T) * N > 16 ? 16 : sizeof(T) * N;
}

// ---------------------------------------------------------------------------
// Reductions

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats.
// Starts and ends with a barrier, so back-to-back calls may share `scratch`.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

// Rows of a [rows, cols] fp32 partial-sum matrix summed into out[cols] (cast to T);
// one thread per column, rows in a fixed order: deterministic.
template <typename T>
__global__ void sum_partials_kernel(const float* __restrict__ partial, T* __restrict__ out, int rows, int cols) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float acc = 0.f;
  for (int r = 0; r < rows; ++r) acc += partial[(int64_t)r * cols + c];
  out[c] = from_float<T>(acc);
}

template <typename T>
inline cudaError_t launch_sum_partials(const float* partial, void* out, int rows, int cols, cudaStream_t stream) {
  const int threads = 256;
  sum_partials_kernel<T><<<(cols + threads - 1) / threads, threads, 0, stream>>>(partial, static_cast<T*>(out), rows, cols);
  return cudaGetLastError();
}

inline cudaError_t launch_sum_partials_as(DType dtype, const float* partial, void* out, int rows, int cols,
                                          cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return launch_sum_partials<float>(partial, out, rows, cols, stream);
    case DType::kBFloat16: return launch_sum_partials<__nv_bfloat16>(partial, out, rows, cols, stream);
    case DType::kFloat16: return launch_sum_partials<__half>(partial, out, rows, cols, stream);
  }
  return cudaErrorInvalidValue;
}

// Multiprocessors of the current device (cached per device; launchers size grids with it).
inline int sm_count() {
  static int cached[64] = {0};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64) device = 0;
  if (cached[device] == 0) {
    int count = 0;
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    cached[device] = count > 0 ? count : 1;
  }
  return cached[device];
}

// Blocks of `kernel` resident per SM (cached: the host runs this for every norm of every step).
inline int resident_blocks(const void* kernel, int threads, size_t smem) {
  struct Entry {
    const void* kernel;
    int threads, device;
    size_t smem;
    int blocks;
  };
  thread_local Entry cache[32];
  thread_local int used = 0;
  int device = 0;
  cudaGetDevice(&device);
  for (int i = 0; i < used; ++i)
    if (cache[i].kernel == kernel && cache[i].threads == threads && cache[i].smem == smem && cache[i].device == device)
      return cache[i].blocks;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) != cudaSuccess || blocks < 1) {
    cudaGetLastError();  // clear it: one block per SM still runs correctly
    blocks = 1;
  }
  if (used < 32) cache[used++] = Entry{kernel, threads, device, smem, blocks};
  return blocks;
}

namespace {
// Column sums of [rows, cols] fp32 matrices of per-block partials (the bias and
// norm-weight gradients), in a fixed order (deterministic). A block of 1024 threads takes
// kTile columns: lane l of each of its 32 warps reads column l % kTile of rows l / kTile,
// l / kTile + 32 / kTile, ... of its slice (a warp covers 32 / kTile rows, 16 rows' loads in
// flight); warp shuffles, then one shared-memory step sum the lanes. blockIdx.y = 1 sums
// partial1 into out1 (the norm's db beside its dw in one launch). Launch: launch_column_sum.
template <int kTile>
__global__ void __launch_bounds__(1024) column_sum_kernel(const float* __restrict__ partial0, float* __restrict__ out0,
                                                          const float* __restrict__ partial1, float* __restrict__ out1,
                                                          int rows, int cols) {
  constexpr int kRowLanes = 1024 / kTile;
  __shared__ float tile[32][kTile];
  const float* partial = blockIdx.y ? partial1 : partial0;
  float* out = blockIdx.y ? out1 : out0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = blockIdx.x * kTile + lane % kTile;
  float acc = 0.f;
  if (c < cols)
#pragma unroll 16  // the loads of 16 rows in flight at once (few blocks: latency-bound)
    for (int r = threadIdx.x / kTile; r < rows; r += kRowLanes) acc += partial[(int64_t)r * cols + c];
#pragma unroll
  for (int o = 16; o >= kTile; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane < kTile) tile[warp][lane] = acc;
  __syncthreads();
  if (threadIdx.x < kTile && c < cols) {
    float s = 0.f;
    for (int k = 0; k < 32; ++k) s += tile[k][threadIdx.x];
    out[c] = s;
  }
}

// Columns per block (TOOLKIT_COLUMN_SUM_TILE: 8, 16 or 32, for benchmarks/norm_tune.py). Measured on an
// H200, the norm backward's 528 partial rows (GPU us, RMSNorm 2048 / LayerNorm 1600 / 768): 32 columns
// a block 2.2 / 2.5 / 2.9; 8 a block, so that every SM gets two blocks, 4.0 / 5.1 / 3.4.
#ifndef TOOLKIT_COLUMN_SUM_TILE
#define TOOLKIT_COLUMN_SUM_TILE 32
#endif
inline cudaError_t launch_column_sum(const float* partial0, float* out0, const float* partial1, float* out1, int rows,
                                     int cols, cudaStream_t stream) {
  const int matrices = partial1 ? 2 : 1, tile = TOOLKIT_COLUMN_SUM_TILE;
  const dim3 grid((cols + tile - 1) / tile, matrices);
  if (tile == 8) column_sum_kernel<8><<<grid, 1024, 0, stream>>>(partial0, out0, partial1, out1, rows, cols);
  else if (tile == 16) column_sum_kernel<16><<<grid, 1024, 0, stream>>>(partial0, out0, partial1, out1, rows, cols);
  else column_sum_kernel<32><<<grid, 1024, 0, stream>>>(partial0, out0, partial1, out1, rows, cols);
  return cudaGetLastError();
}

}  // namespace

}  // namespace toolkit

// Dispatch a DType to a C++ type named by `NAME` inside the body.
#define TOOLKIT_DISPATCH(DTYPE, NAME, ...)                          \
  switch (DTYPE) {                                                  \
    case ::toolkit::DType::kFloat32: {                              \
      using NAME = float;                                           \
      __VA_ARGS__;                                                  \
      break;                                                        \
    }                                                               \
    case ::toolkit::DType::kBFloat16: {                             \
      using NAME = __nv_bfloat16;                                   \
      __VA_ARGS__;                                                  \
      break;                                                        \
    }                                                               \
    case ::toolkit::DType::kFloat16: {                              \
      using NAME = __half;                                          \
      __VA_ARGS__;                                                  \
      break;                                                        \
    }                                                               \
    default:                                                        \
      return cudaErrorInvalidValue;                                 \
  }
