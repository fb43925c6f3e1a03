// fused_norm_backward.cu: the backward pass of LayerNorm (GPT-2) and RMSNorm (Llama)
// over the last dimension of a [rows, cols] tensor, fp32 math whatever the dtype
// (the forward pass, and the formulas, are in fused_norm.cu).
//
//   xhat = (x - mean) * rstd, g = dy * w           (RMSNorm: mean = 0)
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm: no mean(g) term)
//   dw = sum over rows of dy * xhat, db = sum over rows of dy
//
// How it is launched: a *row group* of G = roundup32(cols / P) threads owns one
// row, each thread P elements held in registers (one or two 16-byte packs when the
// rows are aligned, else P strided elements). A block holds up to B / G row groups;
// each group takes R rows per iteration, so R rows' loads are in flight before the
// one reduction (warp shuffles plus one shared-memory step) they share. The grid is
// as many blocks as fit on the GPU at once (the occupancy API: one wave); each block
// walks rows, keeps its dw/db in registers, and writes one partial row; one
// column_sum_kernel launch sums the partials of dw and db in a fixed order
// (deterministic). P, R and B are per norm (below); kernels/tune_norm.py times choices.
// NOTE: a warp-per-row layout like the forward's (4-element packs, dw/db for up to
// 16 columns per thread) measured slower here on an H200 (RMSNorm 2048 columns:
// 0.134 vs 0.114 ms; LayerNorm 768: equal) at 97-128 registers per thread.
#include <cuda_pipeline_primitives.h>  // __pipeline_memcpy_async: cp.async, global to shared

#include "common.cuh"

namespace toolkit {
namespace {

// A launch shape: P elements per thread, R rows per row group and iteration, B threads per
// block at most, M blocks per SM promised to __launch_bounds__ (caps registers), prefetch.
// Chosen on an H200 with kernels/tune_norm.py (backward GPU ms, 16384 rows, x fp32, dy bf16):
//   LayerNorm 768 / 1600: (8, 2, 256, 3) 0.042 / 0.091 ms; (8, 1, 512, 2), the shape before, 0.050 / 0.107
//   RMSNorm 2048:         (8, 1, 256, 4) 0.100 ms; (8, 2, 256, 3) spills and takes 0.110
// The tuner builds variants with all five TOOLKIT_NORM_BWD_* macros set: one shape for both norms.
#ifdef TOOLKIT_NORM_BWD_PER
constexpr int kLnPer = TOOLKIT_NORM_BWD_PER, kLnRows = TOOLKIT_NORM_BWD_ROWS, kLnBlock = TOOLKIT_NORM_BWD_BLOCK,
              kLnMinBlocks = TOOLKIT_NORM_BWD_MIN_BLOCKS;
constexpr int kLnStages = TOOLKIT_NORM_BWD_STAGES;
constexpr int kRmsPer = kLnPer, kRmsRows = kLnRows, kRmsBlock = kLnBlock, kRmsMinBlocks = kLnMinBlocks;
constexpr int kRmsStages = kLnStages;
#else
constexpr int kLnPer = 8, kLnRows = 2, kLnBlock = 256, kLnMinBlocks = 3;
constexpr int kLnStages = 0;
constexpr int kRmsPer = 8, kRmsRows = 1, kRmsBlock = 256, kRmsMinBlocks = 4;
constexpr int kRmsStages = 0;
#endif
// Rows wider than P * B columns (up to kNormMaxCols) take the wide shape: 512-thread row-group blocks.
constexpr int kWidePer = 8, kWideBlock = 1024, kWideTarget = 512;
static_assert(kWidePer * kWideBlock >= kNormMaxCols, "the wide shape must hold the widest row");

struct RowLayout {
  int group;   // threads per row group (multiple of 32)
  int groups;  // row groups per block
  int threads() const { return group * groups; }
};

// Row groups of `per` elements a thread, as many per block as fit in `target` threads.
RowLayout row_layout(int cols, int per, int target) {
  RowLayout l;
  l.group = ((cols + per - 1) / per + 31) / 32 * 32;
  l.groups = l.group >= target ? 1 : target / l.group;
  return l;
}

bool narrow(int cols, bool rms) { return cols <= (rms ? kRmsPer * kRmsBlock : kLnPer * kLnBlock); }

RowLayout layout_for(int cols, bool rms) {
  if (!narrow(cols, rms)) return row_layout(cols, kWidePer, kWideTarget);
  return rms ? row_layout(cols, kRmsPer, kRmsBlock) : row_layout(cols, kLnPer, kLnBlock);
}

int rows_per_group(int cols, bool rms) { return !narrow(cols, rms) ? 1 : rms ? kRmsRows : kLnRows; }

// Column of this thread's j-th element: packed rows are kPer contiguous elements per thread.
template <int kPer>
__device__ __forceinline__ int col_of(bool packed, int t, int j, int group) {
  return packed ? t * kPer + j : t + j * group;
}

template <typename T, int kPer>
__device__ __forceinline__ void load_row(const T* __restrict__ row, bool packed, int t, int group, int cols,
                                         float (&v)[kPer]) {
  if (packed) {
    if (t * kPer < cols) load_pack<T, kPer>(row + t * kPer, v);
    else
#pragma unroll
      for (int j = 0; j < kPer; ++j) v[j] = 0.f;
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = t + j * group;
      v[j] = c < cols ? to_float(row[c]) : 0.f;
    }
  }
}

template <typename T, int kPer>
__device__ __forceinline__ void store_row(T* __restrict__ row, bool packed, int t, int group, int cols,
                                          const float (&v)[kPer]) {
  if (packed) {
    if (t * kPer < cols) store_pack<T, kPer>(row + t * kPer, v);
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = t + j * group;
      if (c < cols) row[c] = from_float<T>(v[j]);
    }
  }
}

// v[i] summed over each row group; every thread gets its group's sums.
// scratch: 32 x N floats, not the one of the previous call (its readers may not be done: the one
// barrier here orders this call's writes before its reads, the next call's barrier the reads
// before the writes of the call after). Every thread of the block must call it.
template <int N>
__device__ __forceinline__ void group_sums(float (&v)[N], float* scratch, int group_index, int warps_per_group) {
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int i = 0; i < N; ++i) scratch[warp * N + i] = v[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = 0.f;
  for (int w = 0; w < warps_per_group; ++w)
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += scratch[(group_index * warps_per_group + w) * N + i];
}

// kRows rows of row group g starting at `base`: x and dy into xv / gv, the statistics into mu / rs.
template <typename G, typename T, bool kRms, int kPer, int kRows>
__device__ __forceinline__ void load_rows(const G* __restrict__ dy, const T* __restrict__ x,
                                          const float* __restrict__ mean, const float* __restrict__ rstd, int64_t base,
                                          int64_t rows, int cols, int groups, int g, int t, int group, bool packed,
                                          float (&xv)[kRows][kPer], float (&gv)[kRows][kPer], float (&mu)[kRows],
                                          float (&rs)[kRows]) {
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int64_t r = base + (int64_t)k * groups + g;
    const bool valid = r < rows;
    load_row<T, kPer>(x + (valid ? r : 0) * cols, packed && valid, valid ? t : cols, group, cols, xv[k]);
    load_row<G, kPer>(dy + (valid ? r : 0) * cols, packed && valid, valid ? t : cols, group, cols, gv[k]);
    mu[k] = (!kRms && valid) ? mean[r] : 0.f;
    rs[k] = valid ? rstd[r] : 0.f;
  }
}

// ---------------------------------------------------------------------------
// Staged loads (kStages >= 2): the rows of the next kStages - 1 iterations travel from global to
// shared memory by cp.async while this one is reduced, so the bytes in flight are not bounded by
// registers. Each thread copies, and later reads, only its own slots: no barrier guards them.

// One thread's kPer elements of T, moved in bytes / unit cp.async pieces of `unit` bytes.
template <typename T, int kPer>
struct Slot {
  static constexpr int bytes = kPer * (int)sizeof(T);
  static constexpr int unit = bytes >= 16 ? 16 : bytes;
  static_assert(unit == 4 || unit == 8 || unit == 16, "cp.async moves 4, 8 or 16 bytes");
};

// One row's staging for all `threads` threads of the block: x pieces, dy pieces, mean, rstd;
// piece q of every thread side by side (16-byte accesses of a warp hit no bank twice).
template <typename G, typename T, int kPer>
struct StagedRow {
  using SX = Slot<T, kPer>;
  using SG = Slot<G, kPer>;
  static constexpr int bytes_per_thread = SX::bytes + SG::bytes + 2 * (int)sizeof(float);
  char* base;
  int threads;
  __device__ char* x_piece(int q, int tid) const { return base + ((size_t)q * threads + tid) * SX::unit; }
  __device__ char* g_piece(int q, int tid) const {
    return base + (size_t)threads * SX::bytes + ((size_t)q * threads + tid) * SG::unit;
  }
  __device__ float* mu(int tid) const {
    return reinterpret_cast<float*>(base + (size_t)threads * (SX::bytes + SG::bytes)) + tid;
  }
  __device__ float* rs(int tid) const { return mu(tid) + threads; }
};

// Element j of a thread's slot (byte j * sizeof(E) of its pieces).
template <typename E, int kPer>
__device__ __forceinline__ E* slot_element(char* piece0, int threads, int j) {
  using S = Slot<E, kPer>;
  const int byte = j * (int)sizeof(E);
  return reinterpret_cast<E*>(piece0 + (size_t)(byte / S::unit) * threads * S::unit + byte % S::unit);
}

// Starts the copies of kRows rows (as load_rows reads them) into one stage; rows past the end and
// columns past the row end arrive as zeros (cp.async's zero fill), like load_rows' zeros.
template <typename G, typename T, bool kRms, int kPer, int kRows>
__device__ __forceinline__ void stage_rows(char* stage, const G* __restrict__ dy, const T* __restrict__ x,
                                           const float* __restrict__ mean, const float* __restrict__ rstd,
                                           int64_t base, int64_t rows, int cols, int groups, int g, int t, int group,
                                           bool packed) {
  using Row = StagedRow<G, T, kPer>;
  const int tid = threadIdx.x, threads = blockDim.x;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const Row row{stage + (size_t)k * threads * Row::bytes_per_thread, threads};
    const int64_t r = base + (int64_t)k * groups + g;
    const bool valid = r < rows;
    if (packed) {
      const bool on = valid && t * kPer < cols;
      const char* xs = reinterpret_cast<const char*>(x + (on ? r * cols + t * kPer : 0));
      const char* gs = reinterpret_cast<const char*>(dy + (on ? r * cols + t * kPer : 0));
#pragma unroll
      for (int q = 0; q < Row::SX::bytes / Row::SX::unit; ++q)
        __pipeline_memcpy_async(row.x_piece(q, tid), xs + q * Row::SX::unit, Row::SX::unit, on ? 0 : Row::SX::unit);
#pragma unroll
      for (int q = 0; q < Row::SG::bytes / Row::SG::unit; ++q)
        __pipeline_memcpy_async(row.g_piece(q, tid), gs + q * Row::SG::unit, Row::SG::unit, on ? 0 : Row::SG::unit);
    } else {  // strided columns: plain loads (rows that are not 16-byte aligned are rare)
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int c = t + j * group;
        const bool on = valid && c < cols;
        *slot_element<T, kPer>(row.x_piece(0, tid), threads, j) = on ? x[r * cols + c] : from_float<T>(0.f);
        *slot_element<G, kPer>(row.g_piece(0, tid), threads, j) = on ? dy[r * cols + c] : from_float<G>(0.f);
      }
    }
    __pipeline_memcpy_async(row.rs(tid), rstd + (valid ? r : 0), sizeof(float), valid ? 0 : sizeof(float));
    if (kRms) *row.mu(tid) = 0.f;
    else __pipeline_memcpy_async(row.mu(tid), mean + (valid ? r : 0), sizeof(float), valid ? 0 : sizeof(float));
  }
}

// The staged rows of one stage into registers (after __pipeline_wait_prior says they landed).
template <typename G, typename T, int kPer, int kRows>
__device__ __forceinline__ void take_rows(char* stage, float (&xv)[kRows][kPer], float (&gv)[kRows][kPer],
                                          float (&mu)[kRows], float (&rs)[kRows]) {
  using Row = StagedRow<G, T, kPer>;
  using SX = typename Row::SX;
  using SG = typename Row::SG;
  const int tid = threadIdx.x, threads = blockDim.x;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const Row row{stage + (size_t)k * threads * Row::bytes_per_thread, threads};
    constexpr int nx = SX::unit / sizeof(T), ng = SG::unit / sizeof(G);
#pragma unroll
    for (int q = 0; q < SX::bytes / SX::unit; ++q) {
      const Pack<T, nx> pk = *reinterpret_cast<const Pack<T, nx>*>(row.x_piece(q, tid));
#pragma unroll
      for (int i = 0; i < nx; ++i) xv[k][q * nx + i] = to_float(pk.v[i]);
    }
#pragma unroll
    for (int q = 0; q < SG::bytes / SG::unit; ++q) {
      const Pack<G, ng> pk = *reinterpret_cast<const Pack<G, ng>*>(row.g_piece(q, tid));
#pragma unroll
      for (int i = 0; i < ng; ++i) gv[k][q * ng + i] = to_float(pk.v[i]);
    }
    mu[k] = *row.mu(tid);
    rs[k] = *row.rs(tid);
  }
}

// Dynamic shared memory of one block: the stages, or the end's dw/db reduction if larger (it reuses them).
template <typename G, typename T, int kPer, int kRows, int kStages>
size_t norm_bwd_smem(int threads) {
  const size_t reduce = sizeof(float) * 2 * (size_t)threads * kPer;
  const size_t staged = (size_t)kStages * kRows * threads * StagedRow<G, T, kPer>::bytes_per_thread;
  return staged > reduce ? staged : reduce;
}

template <typename G, typename T, bool kRms, int kPer, int kRows, int kStages, int kMaxThreads, int kMinBlocks>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks) norm_bwd_kernel(const G* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ weight,
                                const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
                                float* __restrict__ partial_w, float* __restrict__ partial_b, int64_t rows, int cols,
                                int group, bool packed) {
  static_assert(kStages == 0 || kStages >= 2, "kStages: 0 (loads into registers) or at least 2");
  // Two scratch halves, one per iteration parity: one barrier per reduction (group_sums) suffices.
  __shared__ float scratch[2][32 * 2 * kRows];
  extern __shared__ __align__(16) char smem[];  // the stages; at the end the dw/db reduction
  const int groups = blockDim.x / group, g = threadIdx.x / group, t = threadIdx.x % group, wpg = group / 32;
  float w[kPer], dw[kPer], db[kPer];
  load_row<float, kPer>(weight, packed, t, group, cols, w);
#pragma unroll
  for (int j = 0; j < kPer; ++j) dw[j] = db[j] = 0.f;
  // Every thread runs the same number of iterations (the barriers in group_sums need it).
  const int64_t rows_per_block = (int64_t)groups * kRows, stride = (int64_t)gridDim.x * rows_per_block;
  const int64_t first = (int64_t)blockIdx.x * rows_per_block;
  const size_t stage_bytes = (size_t)kRows * blockDim.x * StagedRow<G, T, kPer>::bytes_per_thread;
  if constexpr (kStages >= 2) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (first + s * stride < rows)
        stage_rows<G, T, kRms, kPer, kRows>(smem + s * stage_bytes, dy, x, mean, rstd, first + s * stride, rows, cols,
                                            groups, g, t, group, packed);
      __pipeline_commit();
    }
  }
  int it = 0;
  for (int64_t base = first; base < rows; base += stride, ++it) {
    float xv[kRows][kPer], gv[kRows][kPer], mu[kRows], rs[kRows], sums[2 * kRows];
    if constexpr (kStages >= 2) {
      const int64_t ahead = base + (kStages - 1) * stride;
      if (ahead < rows)
        stage_rows<G, T, kRms, kPer, kRows>(smem + ((it + kStages - 1) % kStages) * stage_bytes, dy, x, mean, rstd,
                                            ahead, rows, cols, groups, g, t, group, packed);
      __pipeline_commit();
      __pipeline_wait_prior(kStages - 1);  // this iteration's group has landed
      take_rows<G, T, kPer, kRows>(smem + (it % kStages) * stage_bytes, xv, gv, mu, rs);
    } else {
      load_rows<G, T, kRms, kPer, kRows>(dy, x, mean, rstd, base, rows, cols, groups, g, t, group, packed, xv, gv, mu,
                                         rs);
    }
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const float xhat = (xv[k][j] - mu[k]) * rs[k];  // 0 past the row end: xv = 0 there and the terms vanish
        const float gw = gv[k][j] * w[j];
        dw[j] += gv[k][j] * xhat;
        if constexpr (!kRms) db[j] += gv[k][j];
        sum_g += gw;
        sum_gx += gw * xhat;
        xv[k][j] = xhat;
        gv[k][j] = gw;
      }
      sums[2 * k] = sum_g;
      sums[2 * k + 1] = sum_gx;
    }
    group_sums<2 * kRows>(sums, scratch[it & 1], g, wpg);
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const int64_t r = base + (int64_t)k * groups + g;
      if (r < rows) {
        const float mean_g = kRms ? 0.f : sums[2 * k] / cols, mean_gx = sums[2 * k + 1] / cols;
#pragma unroll
        for (int j = 0; j < kPer; ++j) xv[k][j] = rs[k] * (gv[k][j] - mean_g - xv[k][j] * mean_gx);
        store_row<T, kPer>(dx + r * cols, packed, t, group, cols, xv[k]);
      }
    }
  }
  // Sum dw / db over the row groups of this block, then write one partial row.
  if constexpr (kStages >= 2) {
    __pipeline_wait_prior(0);
    __syncthreads();  // the reduction below overwrites every thread's stages
  }
  float* reduce = reinterpret_cast<float*>(smem);  // groups x 2 x (group * kPer) floats
  const int span = group * kPer;
  float* mine = reduce + (size_t)g * 2 * span;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    mine[t * kPer + j] = dw[j];
    if constexpr (!kRms) mine[span + t * kPer + j] = db[j];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < span; i += blockDim.x) {
    float a = 0.f, b = 0.f;
    for (int k = 0; k < groups; ++k) {
      a += reduce[(size_t)k * 2 * span + i];
      if constexpr (!kRms) b += reduce[(size_t)k * 2 * span + span + i];
    }
    // i = t' * kPer + j' holds column col_of(packed, t', j', group).
    const int c = col_of<kPer>(packed, i / kPer, i % kPer, group);
    if (c < cols) {
      partial_w[(int64_t)blockIdx.x * cols + c] = a;
      if constexpr (!kRms) partial_b[(int64_t)blockIdx.x * cols + c] = b;
    }
  }
}

// The most blocks the workspace is sized for: one wave at the hardware's 2048 threads per SM
// (the occupancy API's answer never exceeds it).
int64_t max_grid(int64_t rows, int cols, bool rms) {
  const RowLayout l = layout_for(cols, rms);
  const int64_t rows_per_block = (int64_t)l.groups * rows_per_group(cols, rms);
  const int64_t needed = (rows + rows_per_block - 1) / rows_per_block;
  const int64_t fill = (int64_t)sm_count() * (2048 / l.threads() > 0 ? 2048 / l.threads() : 1);
  return needed < fill ? needed : fill;
}

// Blocks of `kernel` resident per SM (cached: the host runs this for every norm of every step).
int resident_blocks(const void* kernel, int threads, size_t smem) {
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

bool rows_packed(const void* p, int cols, int elem_bytes, int per) {
  return cols % per == 0 && is_aligned(p, 16) && (cols * elem_bytes) % 16 == 0;
}

int dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

template <bool kRms, int kPer, int kRows, int kStages, int kMaxThreads, int kMinBlocks>
cudaError_t launch_shape(const void* dy, const void* x, const float* weight, const float* mean, const float* rstd,
                         void* dx, float* partial_w, float* partial_b, int64_t rows, int cols, DType dy_dtype,
                         DType x_dtype, const RowLayout& l, int grid_limit, int* grid_out, cudaStream_t stream) {
  const bool packed = rows_packed(x, cols, dtype_bytes(x_dtype), kPer) &&
                      rows_packed(dy, cols, dtype_bytes(dy_dtype), kPer) &&
                      rows_packed(dx, cols, dtype_bytes(x_dtype), kPer) && is_aligned(weight, 16);
  cudaError_t err = cudaSuccess;
  TOOLKIT_DISPATCH(dy_dtype, G, {
    TOOLKIT_DISPATCH(x_dtype, T, {
      auto kernel = norm_bwd_kernel<G, T, kRms, kPer, kRows, kStages, kMaxThreads, kMinBlocks>;
      const size_t smem = norm_bwd_smem<G, T, kPer, kRows, kStages>(l.threads());
      if (smem > 48 * 1024) {
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess) return err;
      }
      const int64_t wave = (int64_t)sm_count() * resident_blocks(reinterpret_cast<const void*>(kernel), l.threads(), smem);
      const int grid = (int)(wave < grid_limit ? wave : grid_limit);
      *grid_out = grid;
      kernel<<<grid, l.threads(), smem, stream>>>(static_cast<const G*>(dy), static_cast<const T*>(x), weight, mean,
                                                  rstd, static_cast<T*>(dx), partial_w, partial_b, rows, cols,
                                                  l.group, packed);
    });
  });
  return cudaGetLastError();
}

}  // namespace

int64_t norm_bwd_workspace(int64_t rows, int cols, bool rms) { return 2 * max_grid(rows, cols, rms) * cols; }

cudaError_t launch_norm_bwd(const void* dy, const void* x, const float* weight, const float* mean, const float* rstd,
                            void* dx, float* dweight, float* dbias, float* workspace, int64_t rows, int cols,
                            DType dy_dtype, DType x_dtype, bool rms, cudaStream_t stream) {
  if (cols <= 0 || cols > kNormMaxCols) return cudaErrorInvalidValue;
  if (rows == 0) {
    cudaError_t err = cudaMemsetAsync(dweight, 0, sizeof(float) * cols, stream);
    if (err == cudaSuccess && !rms) err = cudaMemsetAsync(dbias, 0, sizeof(float) * cols, stream);
    return err;
  }
  const RowLayout l = layout_for(cols, rms);
  const int limit = (int)max_grid(rows, cols, rms);
  float* partial_w = workspace;
  float* partial_b = workspace + (int64_t)limit * cols;
  int grid = 0;
  cudaError_t err;
  if (!narrow(cols, rms))
    err = rms ? launch_shape<true, kWidePer, 1, 0, kWideBlock, 1>(dy, x, weight, mean, rstd, dx, partial_w,
                                                                      partial_b, rows, cols, dy_dtype, x_dtype, l,
                                                                      limit, &grid, stream)
              : launch_shape<false, kWidePer, 1, 0, kWideBlock, 1>(dy, x, weight, mean, rstd, dx, partial_w,
                                                                       partial_b, rows, cols, dy_dtype, x_dtype, l,
                                                                       limit, &grid, stream);
  else if (rms)
    err = launch_shape<true, kRmsPer, kRmsRows, kRmsStages, kRmsBlock, kRmsMinBlocks>(
        dy, x, weight, mean, rstd, dx, partial_w, partial_b, rows, cols, dy_dtype, x_dtype, l, limit, &grid, stream);
  else
    err = launch_shape<false, kLnPer, kLnRows, kLnStages, kLnBlock, kLnMinBlocks>(
        dy, x, weight, mean, rstd, dx, partial_w, partial_b, rows, cols, dy_dtype, x_dtype, l, limit, &grid, stream);
  if (err != cudaSuccess) return err;
  // dw and db partials summed by one launch (blockIdx.y picks which).
  const dim3 reduce_grid((cols + 31) / 32, rms ? 1 : 2);
  column_sum_kernel<<<reduce_grid, dim3(32, 32), 0, stream>>>(partial_w, dweight, partial_b, dbias, grid, cols);
  return cudaGetLastError();
}

}  // namespace toolkit
