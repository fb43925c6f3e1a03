// fused_norm.cu: LayerNorm (GPT-2) and RMSNorm (Llama), forward and backward,
// over the last dimension of a [rows, cols] tensor, fp32 math whatever the dtype.
//
// What it computes (w, b fp32 [cols]; mean, rstd fp32 [rows] saved for backward):
//   LayerNorm  mu = mean(x), rstd = 1/sqrt(mean((x - mu)^2) + eps), y = (x - mu) * rstd * w + b
//   RMSNorm    mu = 0,       rstd = 1/sqrt(mean(x^2) + eps),        y = x * rstd * w
//   backward   xhat = (x - mu) * rstd, g = dy * w
//              dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm: no mean(g) term)
//              dw = sum over rows of dy * xhat, db = sum over rows of dy
//
// How it is launched: a *row group* of W warps (W = 1 up to 1600-2048 columns,
// more for wider rows) owns one row; thread t of the group holds the 4-element
// packs t, t + 32W, t + 64W, ... of the row in registers (fp32: one 16-byte load
// each, consecutive threads on consecutive packs), so x is read once and y written
// once. Row sums are warp shuffles, plus one shared-memory step when W > 1; with
// W = 1 no barrier stops a warp, so each warp's loads overlap the others' maths.
// A block holds 256 / (32 W) row groups (or one group of 32 W > 256 threads).
// The backward grid is sized to fill the GPU once; each row group walks rows,
// keeps its dw/db in registers, the block sums its groups into one partial row,
// and column_sum_kernel adds the partials in a fixed order (deterministic).
#include "common.cuh"

namespace toolkit {
namespace {

constexpr int kVec = 4;             // elements per pack
constexpr int kBlockThreads = 256;  // threads per block, unless one row group needs more
constexpr int kMaxWarps = kNormMaxCols / (32 * kVec);  // warps of a row group with one pack per thread

struct NormLayout {
  int warps;  // warps per row group
  int packs;  // packs per thread (a compiled variant)
  int group() const { return 32 * warps; }
  int threads() const { return group() > kBlockThreads ? group() : kBlockThreads; }
  int groups() const { return threads() / group(); }
};

// The fewest warps per row whose threads hold at most `max_packs` packs each, then the
// smallest compiled variant that covers the row.
NormLayout norm_layout(int cols, int max_packs, const int* variants, int num_variants) {
  const int packs = (cols + kVec - 1) / kVec;
  NormLayout l{1, 0};
  while (l.warps < kMaxWarps && (packs + l.group() - 1) / l.group() > max_packs) l.warps *= 2;
  const int need = (packs + l.group() - 1) / l.group();
  l.packs = variants[num_variants - 1];
  for (int i = num_variants - 1; i >= 0; --i)
    if (variants[i] >= need) l.packs = variants[i];
  return l;
}

constexpr int kFwdVariants[] = {1, 2, 4, 6, 8};  // forward: x in registers only
constexpr int kBwdVariants[] = {1, 2, 3, 4};     // backward: x, dy, dw, db in registers

NormLayout fwd_layout(int cols) { return norm_layout(cols, 8, kFwdVariants, 5); }
NormLayout bwd_layout(int cols) { return norm_layout(cols, 4, kBwdVariants, 4); }

// The pack starting at column c (a multiple of 4): one wide access when rows are packed,
// else element by element; past the row end reads give 0 and writes are dropped.
template <typename T>
__device__ __forceinline__ void load4(const T* __restrict__ row, int c, int cols, bool packed, float (&v)[kVec]) {
  if (packed && c < cols) {
    load_pack<T, kVec>(row + c, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = (!packed && c + j < cols) ? to_float(row[c + j]) : 0.f;
}

template <typename T>
__device__ __forceinline__ void store4(T* __restrict__ row, int c, int cols, bool packed, const float (&v)[kVec]) {
  if (packed) {
    if (c < cols) store_pack<T, kVec>(row + c, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    if (c + j < cols) row[c + j] = from_float<T>(v[j]);
}

// Sums of (a, b) over a row group of `warps` warps; every thread gets its group's sums.
// `warps` is the same for the whole block, so either no thread or every thread reaches the
// barriers. scratch: one float2 per warp of the block.
__device__ __forceinline__ float2 row_sum2(float a, float b, int warps, float2* scratch) {
  a = warp_sum(a);
  b = warp_sum(b);
  if (warps == 1) return make_float2(a, b);
  const int warp = threadIdx.x >> 5, first = warp / warps * warps;
  __syncthreads();  // the previous sums have been read
  if ((threadIdx.x & 31) == 0) scratch[warp] = make_float2(a, b);
  __syncthreads();
  float2 s = make_float2(0.f, 0.f);
  for (int w = 0; w < warps; ++w) {
    s.x += scratch[first + w].x;
    s.y += scratch[first + w].y;
  }
  return s;
}

template <typename T, typename O, bool kRms, int kPacks>
__global__ void __launch_bounds__(kBlockThreads) norm_fwd_kernel(
    const T* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias, O* __restrict__ y,
    float* __restrict__ mean, float* __restrict__ rstd, int64_t rows, int cols, float eps, int warps, bool packed) {
  __shared__ float2 scratch[kMaxWarps];
  const int group = 32 * warps, t = threadIdx.x % group, stride = group * kVec;
  const int64_t r = (int64_t)blockIdx.x * (blockDim.x / group) + threadIdx.x / group;
  const bool valid = r < rows;
  const int bound = valid ? cols : 0;  // a row past the end reads as zeros (it still joins the barriers)
  const T* xr = x + (valid ? r : 0) * cols;
  float v[kPacks][kVec];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) load4(xr, t * kVec + k * stride, bound, packed, v[k]);
  float mu = 0.f;
  if (!kRms) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kPacks; ++k)
#pragma unroll
      for (int j = 0; j < kVec; ++j) s += v[k][j];
    mu = row_sum2(s, 0.f, warps, scratch).x / cols;
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float d = t * kVec + k * stride + j < cols ? v[k][j] - mu : 0.f;
      ss += d * d;
    }
  const float rs = rsqrtf(row_sum2(ss, 0.f, warps, scratch).x / cols + eps);
  if (!valid) return;
  O* yr = y + r * cols;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int c = t * kVec + k * stride;
    float w[kVec], b[kVec];
    load4(weight, c, cols, packed, w);
    if (!kRms) load4(bias, c, cols, packed, b);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[k][j] = (v[k][j] - mu) * rs * w[j] + (kRms ? 0.f : b[j]);
    store4(yr, c, cols, packed, v[k]);
  }
  if (t == 0) {
    if (!kRms) mean[r] = mu;
    rstd[r] = rs;
  }
}

template <typename G, typename T, bool kRms, int kPacks>
// NOTE: launch bounds of 512 threads (a 16-warp group at 8192 columns) cap registers at 128.
__global__ void __launch_bounds__(2 * kBlockThreads) norm_bwd_kernel(
    const G* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ weight,
    const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ partial_w,
    float* __restrict__ partial_b, int64_t rows, int cols, int warps, bool packed) {
  __shared__ float2 scratch[kMaxWarps];
  extern __shared__ float reduce[];  // groups x 2 x span floats, used once at the end
  const int group = 32 * warps, groups = blockDim.x / group, g = threadIdx.x / group, t = threadIdx.x % group;
  const int stride = group * kVec;
  float w[kPacks][kVec], dw[kPacks][kVec], db[kPacks][kVec];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    load4(weight, t * kVec + k * stride, cols, packed, w[k]);
#pragma unroll
    for (int j = 0; j < kVec; ++j) dw[k][j] = db[k][j] = 0.f;
  }
  // Every thread runs the same number of iterations (row_sum2's barriers need it when W > 1).
  for (int64_t base = (int64_t)blockIdx.x * groups; base < rows; base += (int64_t)gridDim.x * groups) {
    const int64_t r = base + g;
    const bool valid = r < rows;
    const int bound = valid ? cols : 0;
    const int64_t offset = (valid ? r : 0) * cols;
    float xv[kPacks][kVec], gv[kPacks][kVec];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      load4(x + offset, t * kVec + k * stride, bound, packed, xv[k]);
      load4(dy + offset, t * kVec + k * stride, bound, packed, gv[k]);
    }
    const float mu = (!kRms && valid) ? mean[r] : 0.f, rs = valid ? rstd[r] : 0.f;
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int k = 0; k < kPacks; ++k)
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float xhat = (xv[k][j] - mu) * rs;  // past the row end dy = 0, so every term below vanishes
        const float gw = gv[k][j] * w[k][j];
        dw[k][j] += gv[k][j] * xhat;
        db[k][j] += gv[k][j];
        sum_g += gw;
        sum_gx += gw * xhat;
        xv[k][j] = xhat;
        gv[k][j] = gw;
      }
    const float2 s = row_sum2(sum_g, sum_gx, warps, scratch);
    if (valid) {
      const float mean_g = kRms ? 0.f : s.x / cols, mean_gx = s.y / cols;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) xv[k][j] = rs * (gv[k][j] - mean_g - xv[k][j] * mean_gx);
        store4(dx + offset, t * kVec + k * stride, cols, packed, xv[k]);
      }
    }
  }
  // Sum dw / db over the row groups of this block, then write one partial row. A thread's
  // element (k, j) sits at column (k * group + t) * kVec + j: the shared layout is by column.
  const int span = group * kPacks * kVec;
  float* mine = reduce + (size_t)g * 2 * span;
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      mine[(k * group + t) * kVec + j] = dw[k][j];
      mine[span + (k * group + t) * kVec + j] = db[k][j];
    }
  __syncthreads();
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    float a = 0.f, b = 0.f;
    for (int k = 0; k < groups; ++k) {
      a += reduce[(size_t)k * 2 * span + c];
      b += reduce[(size_t)k * 2 * span + span + c];
    }
    partial_w[(int64_t)blockIdx.x * cols + c] = a;
    if (!kRms) partial_b[(int64_t)blockIdx.x * cols + c] = b;
  }
}

// The body once, with NAME a compile-time pack count: the forward's and the backward's variants.
#define TOOLKIT_NORM_CASE(N, NAME, ...) \
  case N: {                             \
    constexpr int NAME = N;             \
    __VA_ARGS__;                        \
    break;                              \
  }
#define TOOLKIT_NORM_FWD_PACKS(PACKS, NAME, ...)                                                       \
  switch (PACKS) {                                                                                     \
    TOOLKIT_NORM_CASE(1, NAME, __VA_ARGS__) TOOLKIT_NORM_CASE(2, NAME, __VA_ARGS__)                    \
    TOOLKIT_NORM_CASE(4, NAME, __VA_ARGS__) TOOLKIT_NORM_CASE(6, NAME, __VA_ARGS__)                    \
    TOOLKIT_NORM_CASE(8, NAME, __VA_ARGS__)                                                            \
    default: return cudaErrorInvalidValue;                                                             \
  }
#define TOOLKIT_NORM_BWD_PACKS(PACKS, NAME, ...)                                                       \
  switch (PACKS) {                                                                                     \
    TOOLKIT_NORM_CASE(1, NAME, __VA_ARGS__) TOOLKIT_NORM_CASE(2, NAME, __VA_ARGS__)                    \
    TOOLKIT_NORM_CASE(3, NAME, __VA_ARGS__) TOOLKIT_NORM_CASE(4, NAME, __VA_ARGS__)                    \
    default: return cudaErrorInvalidValue;                                                             \
  }

size_t bwd_shared_bytes(const NormLayout& l) { return sizeof(float) * 2 * (size_t)l.group() * l.packs * kVec * l.groups(); }

// Blocks of the backward kernel that fit on the GPU at once (at least one per SM).
template <typename Kernel>
int bwd_grid(Kernel kernel, int64_t rows, const NormLayout& l) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, l.threads(), bwd_shared_bytes(l)) != cudaSuccess ||
      per_sm < 1)
    per_sm = 1;
  const int64_t blocks_needed = (rows + l.groups() - 1) / l.groups();
  const int64_t fill = (int64_t)sm_count() * per_sm;
  return (int)(blocks_needed < fill ? blocks_needed : fill);
}

// Upper bound of bwd_grid (the workspace is sized before the kernel is chosen).
int64_t max_bwd_grid(int64_t rows, const NormLayout& l) {
  const int64_t blocks_needed = (rows + l.groups() - 1) / l.groups();
  const int64_t fill = (int64_t)sm_count() * (2048 / l.threads());
  return blocks_needed < fill ? blocks_needed : fill;
}

bool rows_packed(const void* p, int cols, int elem_bytes) {
  return cols % kVec == 0 && is_aligned(p, kVec * elem_bytes);
}

int dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

}  // namespace

cudaError_t launch_norm_fwd(const void* x, const float* weight, const float* bias, void* y, float* mean, float* rstd,
                            int64_t rows, int cols, float eps, DType x_dtype, DType y_dtype, bool rms,
                            cudaStream_t stream) {
  if (cols <= 0 || cols > kNormMaxCols) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const NormLayout l = fwd_layout(cols);
  const bool packed = rows_packed(x, cols, dtype_bytes(x_dtype)) && rows_packed(y, cols, dtype_bytes(y_dtype)) &&
                      is_aligned(weight, 16) && (rms || is_aligned(bias, 16));
  const int64_t blocks = (rows + l.groups() - 1) / l.groups();
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  TOOLKIT_DISPATCH(x_dtype, T, {
    TOOLKIT_DISPATCH(y_dtype, O, {
      TOOLKIT_NORM_FWD_PACKS(l.packs, P, {
        auto kernel = rms ? norm_fwd_kernel<T, O, true, P> : norm_fwd_kernel<T, O, false, P>;
        kernel<<<(unsigned)blocks, l.threads(), 0, stream>>>(static_cast<const T*>(x), weight, bias,
                                                             static_cast<O*>(y), mean, rstd, rows, cols, eps,
                                                             l.warps, packed);
      });
    });
  });
  return cudaGetLastError();
}

int64_t norm_bwd_workspace(int64_t rows, int cols) {
  return 2 * max_bwd_grid(rows, bwd_layout(cols)) * cols;
}

cudaError_t launch_norm_bwd(const void* dy, const void* x, const float* weight, const float* mean, const float* rstd,
                            void* dx, float* dweight, float* dbias, float* workspace, int64_t rows, int cols,
                            DType dy_dtype, DType x_dtype, bool rms, cudaStream_t stream) {
  if (cols <= 0 || cols > kNormMaxCols) return cudaErrorInvalidValue;
  if (rows == 0) {
    cudaError_t err = cudaMemsetAsync(dweight, 0, sizeof(float) * cols, stream);
    if (err == cudaSuccess && !rms) err = cudaMemsetAsync(dbias, 0, sizeof(float) * cols, stream);
    return err;
  }
  const NormLayout l = bwd_layout(cols);
  const int64_t max_grid = max_bwd_grid(rows, l);
  const bool packed = rows_packed(x, cols, dtype_bytes(x_dtype)) && rows_packed(dy, cols, dtype_bytes(dy_dtype)) &&
                      rows_packed(dx, cols, dtype_bytes(x_dtype)) && is_aligned(weight, 16);
  const size_t smem = bwd_shared_bytes(l);
  int grid = 0;
  TOOLKIT_DISPATCH(dy_dtype, G, {
    TOOLKIT_DISPATCH(x_dtype, T, {
      TOOLKIT_NORM_BWD_PACKS(l.packs, P, {
        auto kernel = rms ? norm_bwd_kernel<G, T, true, P> : norm_bwd_kernel<G, T, false, P>;
        if (smem > 48 * 1024) {
          cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
          if (err != cudaSuccess) return err;
        }
        grid = bwd_grid(kernel, rows, l);
        if (grid > max_grid) grid = (int)max_grid;  // the workspace holds max_grid partial rows
        kernel<<<grid, l.threads(), smem, stream>>>(static_cast<const G*>(dy), static_cast<const T*>(x), weight,
                                                    mean, rstd, static_cast<T*>(dx), workspace,
                                                    workspace + (int64_t)grid * cols, rows, cols, l.warps, packed);
      });
    });
  });
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 reduce_block(32, 32);
  column_sum_kernel<<<(cols + 31) / 32, reduce_block, 0, stream>>>(workspace, dweight, grid, cols);
  if (!rms) column_sum_kernel<<<(cols + 31) / 32, reduce_block, 0, stream>>>(workspace + (int64_t)grid * cols, dbias, grid, cols);
  return cudaGetLastError();
}

}  // namespace toolkit
