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
// walks rows, keeps its dw/db in registers, and writes one partial row. Aligned rows
// of the narrow shape reach the threads through shared memory: the copy engine brings a
// block's rows in two iterations ahead (bulk copies, bulk_copy.cuh; sm_90 and later). One
// column-sum launch (common.cuh) sums the partials of dw and db in a fixed order
// (deterministic). P, R and B: below, from benchmarks/norm_tune.py's sweeps.
// NOTE: a warp-per-row layout like the forward's (4-element packs, dw/db for up to
// 16 columns per thread) measured slower here on an H200 (RMSNorm 2048 columns:
// 0.134 vs 0.114 ms; LayerNorm 768: equal) at 97-128 registers per thread.
#include "bulk_copy.cuh"
#include "common.cuh"

namespace toolkit {
namespace {

// The launch shape of both norms: P elements per thread, R rows per row group and iteration,
// B threads per block at most, M blocks per SM promised to __launch_bounds__ (caps registers),
// prefetch of the next rows into registers. Chosen on an H200 with benchmarks/norm_tune.py (backward
// GPU ms, 16384 rows, x fp32, dy bf16; LayerNorm 768 / LayerNorm 1600 / RMSNorm 2048):
//   (8, 1, 256, 4, 0)  0.044 / 0.091 / 0.094   torch.compile 0.048 / 0.109 / 0.093
//   (8, 2, 256, 3, 0)  0.045 / 0.093 / 0.110   (two rows in flight: RMSNorm spills)
//   the next rows staged in shared memory by cp.async, 2 or 3 stages: 0.049 / 0.095 / 0.118
//   (8, 1, 256, 4, 0), LayerNorm with streaming hints and w read per row (below): 0.041 / 0.085
//   (8, 1, 256, 2 or 3, 1): the next row prefetched at 2 or 3 blocks per SM: RMSNorm 0.124 / 0.103
// The tuner sets all five TOOLKIT_NORM_BWD_* macros.
#ifndef TOOLKIT_NORM_BWD_PER
#define TOOLKIT_NORM_BWD_PER 8
#define TOOLKIT_NORM_BWD_ROWS 1
#define TOOLKIT_NORM_BWD_BLOCK 256
#define TOOLKIT_NORM_BWD_MIN_BLOCKS 4
#define TOOLKIT_NORM_BWD_PREFETCH 0
#endif
constexpr int kPer = TOOLKIT_NORM_BWD_PER, kRows = TOOLKIT_NORM_BWD_ROWS, kBlock = TOOLKIT_NORM_BWD_BLOCK,
              kMinBlocks = TOOLKIT_NORM_BWD_MIN_BLOCKS;
constexpr bool kPrefetch = TOOLKIT_NORM_BWD_PREFETCH != 0;
// Per norm (_LN, _RMS): cache hints on what is touched once, as common.cuh's hint mask (1 streaming
// loads of x and dy, 2 streaming stores of dx, 4 loads that skip L1); and W_REGS: 1 keeps w in
// registers for the whole kernel, 0 reads it again (from L1) for every row, which frees kPer
// registers a thread.
// Measured (tuner, GPU ms, LayerNorm 768 / 1600 / RMSNorm 2048): no hints, w held 0.0445 / 0.0915 /
// 0.0937; hints 3, w held 0.0417 / 0.0857 / 0.0982; hints 3, w per row 0.0415 / 0.0843 / 0.1001;
// no hints, w per row 0.0417 / 0.0866 / 0.0970. Hence LayerNorm 3 and 0, RMSNorm 0 and 1.
#ifndef TOOLKIT_NORM_BWD_STREAM_LN
#define TOOLKIT_NORM_BWD_STREAM_LN 3
#define TOOLKIT_NORM_BWD_STREAM_RMS 0
#endif
#ifndef TOOLKIT_NORM_BWD_W_REGS_LN
#define TOOLKIT_NORM_BWD_W_REGS_LN 0
#define TOOLKIT_NORM_BWD_W_REGS_RMS 1
#endif
// BULK: stages of rows the copy engine brings into shared memory ahead of the row loop (bulk_copy.cuh;
// sm_90+, aligned rows of the narrow shape), 0 loads them into registers. More bytes in flight
// without registers: the backward's rows move 20 bytes a column (RMSNorm, x fp32, dy bf16) through
// 64-register threads that hold no room for a prefetch.
// Measured (tuner, GPU ms, LayerNorm 768 / 1600 / RMSNorm 2048; registers 0.0415 / 0.0848 / 0.0934):
// 2 stages 0.0391 / 0.0714 / 0.0932; 3 stages 0.0408 / 0.0725 / 0.0957; 4 stages 0.0417 / 0.0730 /
// 0.0957; 512- or 1024-thread blocks (2 or 1 per SM) with 2-3 stages, or two rows per iteration, slower;
// blocks in clusters of 2 / 4 summing their dw in distributed shared memory into one partial row
// (RMSNorm 0.0950 / 0.1256 against 0.0943; the code: commit f74aae8, since removed).
#ifndef TOOLKIT_NORM_BWD_BULK_LN
#define TOOLKIT_NORM_BWD_BULK_LN 2
#define TOOLKIT_NORM_BWD_BULK_RMS 2
#endif
template <bool kRms>
struct BackwardHints {
  static constexpr int stream = kRms ? TOOLKIT_NORM_BWD_STREAM_RMS : TOOLKIT_NORM_BWD_STREAM_LN;
  static constexpr int load_in = load_hint(stream), store_out = store_hint(stream);
  static constexpr bool weight_in_registers = (kRms ? TOOLKIT_NORM_BWD_W_REGS_RMS : TOOLKIT_NORM_BWD_W_REGS_LN) != 0;
  static constexpr int bulk_stages = kRms ? TOOLKIT_NORM_BWD_BULK_RMS : TOOLKIT_NORM_BWD_BULK_LN;
};
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

bool narrow(int cols) { return cols <= kPer * kBlock; }

RowLayout layout_for(int cols) {
  return narrow(cols) ? row_layout(cols, kPer, kBlock) : row_layout(cols, kWidePer, kWideTarget);
}

int rows_per_group(int cols) { return narrow(cols) ? kRows : 1; }

// Column of this thread's j-th element: packed rows are kPer contiguous elements per thread.
template <int kPer>
__device__ __forceinline__ int col_of(bool packed, int t, int j, int group) {
  return packed ? t * kPer + j : t + j * group;
}

template <typename T, int kPer, int kHint = kCacheDefault>
__device__ __forceinline__ void load_row(const T* __restrict__ row, bool packed, int t, int group, int cols,
                                         float (&v)[kPer]) {
  if (packed) {
    if (t * kPer < cols) load_pack<T, kPer, kHint>(row + t * kPer, v);
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

template <typename T, int kPer, int kHint = kCacheDefault>
__device__ __forceinline__ void store_row(T* __restrict__ row, bool packed, int t, int group, int cols,
                                          const float (&v)[kPer]) {
  if (packed) {
    if (t * kPer < cols) store_pack<T, kPer, kHint>(row + t * kPer, v);
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = t + j * group;
      if (c < cols) row[c] = from_float<T>(v[j]);
    }
  }
}

// This thread's weights, read again for each row: asm volatile keeps the compiler from hoisting the
// loads out of the row loop (which would hold w in registers again). L1 hits after the first row.
template <int kPer>
__device__ __forceinline__ void reload_weight(const float* __restrict__ weight, bool packed, int t, int group,
                                              int cols, float (&w)[kPer]) {
  if (packed && kPer % 4 == 0) {
    const bool inside = t * kPer < cols;
#pragma unroll
    for (int q = 0; q < kPer; q += 4) {
      float a = 0.f, b = 0.f, c = 0.f, d = 0.f;
      if (inside)
        asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(a), "=f"(b), "=f"(c), "=f"(d)
                     : "l"(weight + t * kPer + q));
      w[q] = a, w[q + 1] = b, w[q + 2] = c, w[q + 3] = d;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = col_of<kPer>(packed, t, j, group);
    float v = 0.f;
    if (c < cols) asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(weight + c));
    w[j] = v;
  }
}

// v[i] summed over each row group; every thread gets its group's sums.
// scratch: 32 x N floats, not the ones of the previous call (their readers may not be done: the
// one barrier here orders this call's writes before its reads, the next call's barrier these
// reads before the writes of the call after). Every thread of the block must call it.
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
    constexpr int kHint = BackwardHints<kRms>::load_in;
    load_row<T, kPer, kHint>(x + (valid ? r : 0) * cols, packed && valid, valid ? t : cols, group, cols, xv[k]);
    load_row<G, kPer, kHint>(dy + (valid ? r : 0) * cols, packed && valid, valid ? t : cols, group, cols, gv[k]);
    mu[k] = (!kRms && valid) ? mean[r] : 0.f;
    rs[k] = valid ? rstd[r] : 0.f;
  }
}

// The bulk-copied rows: stage s of the dynamic shared memory holds one iteration's rows of a block
// (rows first .. first + rows_per_block - 1, contiguous in memory), all of x then all of dy.
template <typename G, typename T>
struct RowStages {
  unsigned char* memory;
  int64_t cols;
  int rows_per_block;
  __device__ int64_t x_bytes() const { return rows_per_block * cols * (int64_t)sizeof(T); }
  __device__ int64_t stage_bytes() const { return x_bytes() + rows_per_block * cols * (int64_t)sizeof(G); }
  // One thread: start copying the rows from `first` into `stage`; `landed` completes when they are in.
  __device__ void start(int stage, uint64_t* landed, const T* x, const G* dy, int64_t first, int64_t rows) const {
    const int64_t n = rows - first < rows_per_block ? rows - first : rows_per_block;
    const uint32_t xb = (uint32_t)(n * cols * sizeof(T)), gb = (uint32_t)(n * cols * sizeof(G));
    unsigned char* at = memory + stage * stage_bytes();
    barrier_expect_bytes(landed, xb + gb);
    bulk_copy_to_shared(at, x + first * cols, xb, landed);
    bulk_copy_to_shared(at + x_bytes(), dy + first * cols, gb, landed);
  }
  __device__ const T* x_row(int stage, int i) const {
    return reinterpret_cast<const T*>(memory + stage * stage_bytes()) + i * cols;
  }
  __device__ const G* dy_row(int stage, int i) const {
    return reinterpret_cast<const G*>(memory + stage * stage_bytes() + x_bytes()) + i * cols;
  }
};

// load_rows from a stage (packed rows only): the statistics from global memory first, so their
// latency overlaps the wait for the stage to land.
template <typename G, typename T, bool kRms, int kPer, int kRows>
__device__ __forceinline__ void load_staged_rows(const RowStages<G, T>& stages, int stage, uint64_t* landed,
                                                 uint32_t parity,
                                                 const float* __restrict__ mean, const float* __restrict__ rstd,
                                                 int64_t base, int64_t rows, int cols, int groups, int g, int t,
                                                 float (&xv)[kRows][kPer], float (&gv)[kRows][kPer],
                                                 float (&mu)[kRows], float (&rs)[kRows]) {
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int64_t r = base + (int64_t)k * groups + g;
    mu[k] = (!kRms && r < rows) ? mean[r] : 0.f;
    rs[k] = r < rows ? rstd[r] : 0.f;
  }
  barrier_wait(landed, parity);
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    if (base + (int64_t)k * groups + g < rows && t * kPer < cols) {
      load_pack<T, kPer>(stages.x_row(stage, k * groups + g) + t * kPer, xv[k]);
      load_pack<G, kPer>(stages.dy_row(stage, k * groups + g) + t * kPer, gv[k]);
    } else {
#pragma unroll
      for (int j = 0; j < kPer; ++j) xv[k][j] = gv[k][j] = 0.f;
    }
  }
}

// kRes: dres (the gradient of a residual add's sum by its other path) is added into dx; a variant of its own, so
// the plain backward keeps its registers.
template <typename G, typename T, bool kRms, int kPer, int kRows, bool kPrefetch, int kStages, int kMaxThreads,
          int kMinBlocks, bool kRes>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks)
    norm_bwd_kernel(const G* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ weight,
                    const float* __restrict__ mean, const float* __restrict__ rstd, const T* __restrict__ dres,
                    T* __restrict__ dx, float* __restrict__ partial_w, float* __restrict__ partial_b, int64_t rows,
                    int cols, int group, bool packed, bool dres_packed) {
  static_assert(!(kPrefetch && kStages > 0), "the bulk-copied stages replace the register prefetch");
  __shared__ float scratch[2][32 * 2 * kRows];  // halves alternate by iteration: one barrier per group_sums
  __shared__ uint64_t landed[kStages > 0 ? kStages : 1];  // a barrier per stage (bulk copies)
  // The bulk-copied stages while rows are walked; at the end groups x 2 x (group * kPer) floats.
  extern __shared__ __align__(128) float reduce[];
  const int groups = blockDim.x / group, g = threadIdx.x / group, t = threadIdx.x % group, wpg = group / 32;
  constexpr bool kWeightInRegisters = BackwardHints<kRms>::weight_in_registers;
  float w[kPer], dw[kPer], db[kPer];
  if (kWeightInRegisters) load_row<float, kPer>(weight, packed, t, group, cols, w);
#pragma unroll
  for (int j = 0; j < kPer; ++j) dw[j] = db[j] = 0.f;
  // Every thread runs the same number of iterations (the barriers in group_sums need it).
  const int64_t rows_per_block = (int64_t)groups * kRows, stride = (int64_t)gridDim.x * rows_per_block;
  float xn[kRows][kPer], gn[kRows][kPer], mun[kRows], rsn[kRows];  // the next iteration's rows (prefetch)
  const RowStages<G, T> stages{reinterpret_cast<unsigned char*>(reduce), cols, (int)rows_per_block};
  if constexpr (kStages > 0) {
    if (threadIdx.x == 0)
      for (int s = 0; s < kStages; ++s) barrier_init(&landed[s], 1);
    __syncthreads();
    if (threadIdx.x == 0)
      for (int s = 0; s < kStages; ++s) {
        const int64_t first = (int64_t)blockIdx.x * rows_per_block + s * stride;
        if (first < rows) stages.start(s, &landed[s], x, dy, first, rows);
      }
  }
  if (kPrefetch)
    load_rows<G, T, kRms, kPer, kRows>(dy, x, mean, rstd, (int64_t)blockIdx.x * rows_per_block, rows, cols, groups, g,
                                       t, group, packed, xn, gn, mun, rsn);
  int it = 0;
  for (int64_t base = (int64_t)blockIdx.x * rows_per_block; base < rows; base += stride, ++it) {
    float xv[kRows][kPer], gv[kRows][kPer], mu[kRows], rs[kRows], sums[2 * kRows];
    if constexpr (kStages > 0) {
      load_staged_rows<G, T, kRms, kPer, kRows>(stages, it % kStages, &landed[it % kStages], (it / kStages) & 1, mean,
                                                rstd, base, rows, cols, groups, g, t, xv, gv, mu, rs);
    } else if (kPrefetch) {
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        mu[k] = mun[k];
        rs[k] = rsn[k];
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          xv[k][j] = xn[k][j];
          gv[k][j] = gn[k][j];
        }
      }
      if (base + stride < rows)
        load_rows<G, T, kRms, kPer, kRows>(dy, x, mean, rstd, base + stride, rows, cols, groups, g, t, group, packed,
                                           xn, gn, mun, rsn);
    } else {
      load_rows<G, T, kRms, kPer, kRows>(dy, x, mean, rstd, base, rows, cols, groups, g, t, group, packed, xv, gv, mu,
                                         rs);
    }
    if (!kWeightInRegisters) reload_weight<kPer>(weight, packed, t, group, cols, w);
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
    // Its barrier saw every thread read this stage: refill it with the rows kStages iterations on.
    if constexpr (kStages > 0)
      if (threadIdx.x == 0 && base + kStages * stride < rows)
        stages.start(it % kStages, &landed[it % kStages], x, dy, base + kStages * stride, rows);
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const int64_t r = base + (int64_t)k * groups + g;
      if (r < rows) {
        const float mean_g = kRms ? 0.f : sums[2 * k] / cols, mean_gx = sums[2 * k + 1] / cols;
#pragma unroll
        for (int j = 0; j < kPer; ++j) xv[k][j] = rs[k] * (gv[k][j] - mean_g - xv[k][j] * mean_gx);
        if constexpr (kRes) {  // the residual's gradient summed in, after dx's own rounding, as autograd sums them
          // NOTE: element loads where dres is not 16-byte aligned, so its alignment never changes `packed` (the
          // columns a thread holds, hence the order of the row sums: dx must be the plain backward's, bit for
          // bit); __fadd_rn: no contraction into an FMA with dx's last multiply (fp32 rounds once more there)
          const T* row = dres + r * cols;
          float rv[kPer];
          if (dres_packed) {
            load_row<T, kPer>(row, true, t, group, cols, rv);
          } else {
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
              const int c = col_of<kPer>(packed, t, j, group);
              rv[j] = c < cols ? to_float(row[c]) : 0.f;
            }
          }
#pragma unroll
          for (int j = 0; j < kPer; ++j) xv[k][j] = __fadd_rn(to_float(from_float<T>(xv[k][j])), rv[j]);
        }
        store_row<T, kPer, BackwardHints<kRms>::store_out>(dx + r * cols, packed, t, group, cols, xv[k]);
      }
    }
  }
  // Sum dw / db over the row groups of this block, then write one partial row.
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
int64_t max_grid(int64_t rows, int cols) {
  const RowLayout l = layout_for(cols);
  const int64_t rows_per_block = (int64_t)l.groups * rows_per_group(cols);
  const int64_t needed = (rows + rows_per_block - 1) / rows_per_block;
  const int64_t fill = (int64_t)sm_count() * (2048 / l.threads() > 0 ? 2048 / l.threads() : 1);
  return needed < fill ? needed : fill;
}

bool rows_packed(const void* p, int cols, int elem_bytes, int per) {
  return cols % per == 0 && is_aligned(p, 16) && (cols * elem_bytes) % 16 == 0;
}

int dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

// At least the kernel's static shared memory (scratch and barriers: 1 KB at two rows per iteration).
constexpr size_t kStaticSmemBound = 4096;

template <typename X>
struct TypeTag {  // a type passed to a generic lambda (std::type_identity is C++20)
  using type = X;
};

// kStages: the bulk-copied stages where the rows are packed and the GPU has bulk copies, else none.
template <bool kRms, int kPer, int kRows, bool kPrefetch, int kStages, int kMaxThreads, int kMinBlocks>
cudaError_t launch_shape(const void* dy, const void* x, const float* weight, const float* mean, const float* rstd,
                         const void* dres, void* dx, float* partial_w, float* partial_b, int64_t rows, int cols,
                         DType dy_dtype, DType x_dtype, const RowLayout& l, int grid_limit, int* grid_out,
                         cudaStream_t stream) {
  const bool packed = rows_packed(x, cols, dtype_bytes(x_dtype), kPer) &&
                      rows_packed(dy, cols, dtype_bytes(dy_dtype), kPer) &&
                      rows_packed(dx, cols, dtype_bytes(x_dtype), kPer) && is_aligned(weight, 16);
  const bool dres_packed = packed && dres != nullptr && rows_packed(dres, cols, dtype_bytes(x_dtype), kPer);
  const bool staged = kStages > 0 && packed && bulk_copy_supported();
  const size_t reduce_bytes = sizeof(float) * 2 * (size_t)l.group * kPer * l.groups;
  const size_t stage_bytes = (size_t)l.groups * kRows * cols * (dtype_bytes(x_dtype) + dtype_bytes(dy_dtype));
  const size_t smem = staged && kStages * stage_bytes > reduce_bytes ? kStages * stage_bytes : reduce_bytes;
  cudaError_t err = cudaSuccess;
  // One launch of the kernel for G, T, S stages and kRes (a generic lambda: they are compile-time).
  auto launch = [&](auto g_tag, auto t_tag, auto stages, auto res) -> cudaError_t {
    using G = typename decltype(g_tag)::type;
    using T = typename decltype(t_tag)::type;
    constexpr int S = decltype(stages)::value;
    constexpr bool kRes = decltype(res)::value;
    auto kernel = norm_bwd_kernel<G, T, kRms, kPer, kRows, kPrefetch, S, kMaxThreads, kMinBlocks, kRes>;
    if (smem + kStaticSmemBound > 48 * 1024) {  // the default cap counts static shared memory too
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
      if (err != cudaSuccess) return err;
    }
    const int64_t wave =
        (int64_t)sm_count() * resident_blocks(reinterpret_cast<const void*>(kernel), l.threads(), smem);
    const int grid = (int)(wave < grid_limit ? wave : grid_limit);
    *grid_out = grid;
    kernel<<<grid, l.threads(), smem, stream>>>(static_cast<const G*>(dy), static_cast<const T*>(x), weight, mean,
                                                rstd, static_cast<const T*>(dres), static_cast<T*>(dx), partial_w,
                                                partial_b, rows, cols, l.group, packed, dres_packed);
    return cudaGetLastError();
  };
  auto run = [&](auto stages) -> cudaError_t {
    // NOTE: the residual variants only where dy has x's dtype (a block's 16-bit stream under autocast, or fp32
    // throughout): 3 more instantiations per shape, not 9
    if (dres != nullptr) {
      if (dy_dtype != x_dtype) return cudaErrorInvalidValue;
      TOOLKIT_DISPATCH(x_dtype, T, {
        return launch(TypeTag<T>{}, TypeTag<T>{}, stages, std::true_type{});
      });
      return cudaErrorInvalidValue;
    }
    TOOLKIT_DISPATCH(dy_dtype, G, {
      TOOLKIT_DISPATCH(x_dtype, T, {
        return launch(TypeTag<G>{}, TypeTag<T>{}, stages, std::false_type{});
      });
    });
    return cudaErrorInvalidValue;
  };
  return staged ? run(std::integral_constant<int, kStages>{}) : run(std::integral_constant<int, 0>{});
}

}  // namespace

int64_t norm_bwd_workspace(int64_t rows, int cols) { return 2 * max_grid(rows, cols) * cols; }

cudaError_t launch_norm_bwd(const void* dy, const void* x, const float* weight, const float* mean, const float* rstd,
                            const void* dresidual, void* dx, float* dweight, float* dbias, float* workspace,
                            int64_t rows, int cols, DType dy_dtype, DType x_dtype, bool rms, cudaStream_t stream) {
  if (cols <= 0 || cols > kNormMaxCols) return cudaErrorInvalidValue;
  if (rows == 0) {
    cudaError_t err = cudaMemsetAsync(dweight, 0, sizeof(float) * cols, stream);
    if (err == cudaSuccess && !rms) err = cudaMemsetAsync(dbias, 0, sizeof(float) * cols, stream);
    return err;
  }
  const RowLayout l = layout_for(cols);
  const int limit = (int)max_grid(rows, cols);
  float* partial_w = workspace;
  float* partial_b = workspace + (int64_t)limit * cols;
  int grid = 0;
  cudaError_t err;
  if (!narrow(cols))
    err = rms ? launch_shape<true, kWidePer, 1, false, 0, kWideBlock, 1>(dy, x, weight, mean, rstd, dresidual, dx,
                                                                         partial_w, partial_b, rows, cols, dy_dtype,
                                                                         x_dtype, l, limit, &grid, stream)
              : launch_shape<false, kWidePer, 1, false, 0, kWideBlock, 1>(dy, x, weight, mean, rstd, dresidual, dx,
                                                                          partial_w, partial_b, rows, cols, dy_dtype,
                                                                          x_dtype, l, limit, &grid, stream);
  else
    err = rms ? launch_shape<true, kPer, kRows, kPrefetch, BackwardHints<true>::bulk_stages, kBlock, kMinBlocks>(
                    dy, x, weight, mean, rstd, dresidual, dx, partial_w, partial_b, rows, cols, dy_dtype, x_dtype, l,
                    limit, &grid, stream)
              : launch_shape<false, kPer, kRows, kPrefetch, BackwardHints<false>::bulk_stages, kBlock, kMinBlocks>(
                    dy, x, weight, mean, rstd, dresidual, dx, partial_w, partial_b, rows, cols, dy_dtype, x_dtype, l,
                    limit, &grid, stream);
  if (err != cudaSuccess) return err;
  // dw and db partials summed by one launch.
  return launch_column_sum(partial_w, dweight, rms ? nullptr : partial_b, rms ? nullptr : dbias, grid, cols, stream);
}

}  // namespace toolkit
