// fused_bias_gelu.cu: bias add + GELU (tanh approximation, GPT-2's gelu_new),
// forward and backward, over h [rows, cols] (fp32, bf16 or fp16) and bias fp32 [cols].
//
// What it computes, in fp32:
//   u  = h + bias,  t = tanh(k0 * (u + k1 * u^3)),  k0 = sqrt(2 / pi), k1 = 0.044715
//   y  = 0.5 * u * (1 + t)
//   dh = dy * (0.5 * (1 + t) + 0.5 * u * (1 - t^2) * k0 * (1 + 3 * k1 * u^2))
//   dbias = sum over rows of dh (from the fp32 values, before rounding dh)
// so the MLP's first matmul runs without its bias and the ~8 elementwise kernels
// of eager gelu_new become one read of h and one write of y.
//
// How it is launched: blocks of 32 x 8 threads cover 256 columns (one 16-byte pack
// of 8 per thread when rows are aligned, else 8 strided columns) and walk the rows
// 8 at a time, gridDim.y slices apart; the backward keeps each thread's 8 bias
// sums in registers, folds the 8 row lanes in shared memory and writes one
// partial row per slice; a second kernel sums the partials in a fixed order.
#include "common.cuh"

namespace toolkit {
namespace {

constexpr int kPer = 8, kLanesX = 32, kLanesY = 8, kCols = kLanesX * kPer;
constexpr float kK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kK1 = 0.044715f;

__device__ __forceinline__ int column(bool packed, int j) {
  return blockIdx.x * kCols + (packed ? threadIdx.x * kPer + j : threadIdx.x + j * kLanesX);
}

template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ row, bool packed, int cols, float (&v)[kPer]) {
  if (packed) {
    const int c = column(true, 0);
    if (c < cols) load_pack<T, kPer>(row + c, v);
    else
#pragma unroll
      for (int j = 0; j < kPer; ++j) v[j] = 0.f;
    return;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = column(false, j);
    v[j] = c < cols ? to_float(row[c]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ row, bool packed, int cols, const float (&v)[kPer]) {
  if (packed) {
    const int c = column(true, 0);
    if (c < cols) store_pack<T, kPer>(row + c, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = column(false, j);
    if (c < cols) row[c] = from_float<T>(v[j]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kLanesX * kLanesY) bias_gelu_fwd_kernel(const T* __restrict__ h,
                                                                          const float* __restrict__ bias,
                                                                          T* __restrict__ y, int64_t rows, int cols,
                                                                          bool packed) {
  float b[kPer];
  load8(bias, packed, cols, b);
  for (int64_t r = (int64_t)blockIdx.y * kLanesY + threadIdx.y; r < rows; r += (int64_t)gridDim.y * kLanesY) {
    float v[kPer];
    load8(h + r * cols, packed, cols, v);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const float u = v[j] + b[j];
      const float t = tanhf(kK0 * (u + kK1 * u * u * u));
      v[j] = 0.5f * u * (1.f + t);
    }
    store8(y + r * cols, packed, cols, v);
  }
}

template <typename T>
__global__ void __launch_bounds__(kLanesX * kLanesY) bias_gelu_bwd_kernel(const T* __restrict__ dy,
                                                                          const T* __restrict__ h,
                                                                          const float* __restrict__ bias,
                                                                          T* __restrict__ dh,
                                                                          float* __restrict__ partial, int64_t rows,
                                                                          int cols, bool packed) {
  __shared__ float fold[kLanesY][kCols + 1];
  float b[kPer], db[kPer];
  load8(bias, packed, cols, b);
#pragma unroll
  for (int j = 0; j < kPer; ++j) db[j] = 0.f;
  for (int64_t r = (int64_t)blockIdx.y * kLanesY + threadIdx.y; r < rows; r += (int64_t)gridDim.y * kLanesY) {
    float v[kPer], g[kPer];
    load8(h + r * cols, packed, cols, v);
    load8(dy + r * cols, packed, cols, g);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const float u = v[j] + b[j];
      const float t = tanhf(kK0 * (u + kK1 * u * u * u));
      const float d = 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * kK0 * (1.f + 3.f * kK1 * u * u);
      g[j] *= d;
      db[j] += g[j];
    }
    store8(dh + r * cols, packed, cols, g);
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) fold[threadIdx.y][packed ? threadIdx.x * kPer + j : threadIdx.x + j * kLanesX] = db[j];
  __syncthreads();
  for (int i = threadIdx.y * kLanesX + threadIdx.x; i < kCols; i += kLanesX * kLanesY) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kLanesY; ++k) s += fold[k][i];
    const int c = blockIdx.x * kCols + i;
    if (c < cols) partial[(int64_t)blockIdx.y * cols + c] = s;
  }
}

dim3 grid_for(int64_t rows, int cols) {
  const int col_blocks = (cols + kCols - 1) / kCols;
  const int64_t row_slices_needed = (rows + kLanesY - 1) / kLanesY;
  int64_t slices = (int64_t)sm_count() * 8 / col_blocks;  // 8 blocks of 256 threads fill an SM
  if (slices < 1) slices = 1;
  if (slices > row_slices_needed) slices = row_slices_needed;
  if (slices > 65535) slices = 65535;
  return dim3(col_blocks, (unsigned)(slices > 0 ? slices : 1));
}

bool is_packed(const void* p, int cols, int elem_bytes) {
  return cols % kPer == 0 && is_aligned(p, 16) && ((int64_t)cols * elem_bytes) % 16 == 0;
}

}  // namespace

cudaError_t launch_bias_gelu_fwd(const void* h, const float* bias, void* y, int64_t rows, int cols, DType dtype,
                                 cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const int bytes = dtype == DType::kFloat32 ? 4 : 2;
  const bool packed = is_packed(h, cols, bytes) && is_packed(y, cols, bytes) && is_aligned(bias, 16);
  const dim3 grid = grid_for(rows, cols), block(kLanesX, kLanesY);
  TOOLKIT_DISPATCH(dtype, T, {
    bias_gelu_fwd_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(h), bias, static_cast<T*>(y), rows,
                                                        cols, packed);
  });
  return cudaGetLastError();
}

int64_t bias_gelu_bwd_workspace(int64_t rows, int cols) {
  return (int64_t)grid_for(rows, cols).y * cols;
}

cudaError_t launch_bias_gelu_bwd(const void* dy, const void* h, const float* bias, void* dh, float* dbias,
                                 float* workspace, int64_t rows, int cols, DType dtype, cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  if (rows == 0) return cudaMemsetAsync(dbias, 0, sizeof(float) * cols, stream);
  const int bytes = dtype == DType::kFloat32 ? 4 : 2;
  const bool packed =
      is_packed(h, cols, bytes) && is_packed(dy, cols, bytes) && is_packed(dh, cols, bytes) && is_aligned(bias, 16);
  const dim3 grid = grid_for(rows, cols), block(kLanesX, kLanesY);
  TOOLKIT_DISPATCH(dtype, T, {
    bias_gelu_bwd_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(dy), static_cast<const T*>(h), bias,
                                                        static_cast<T*>(dh), workspace, rows, cols, packed);
  });
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_column_sum(workspace, dbias, nullptr, nullptr, (int)grid.y, cols, stream);
}

}  // namespace toolkit
