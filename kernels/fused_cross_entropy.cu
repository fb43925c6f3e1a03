// fused_cross_entropy.cu: softmax cross-entropy over the vocabulary, forward and
// backward, reading the logits in their own dtype (bf16/fp16/fp32): the fp32
// copy of the [tokens, vocab] logits that `F.cross_entropy(logits.float(), y)`
// makes (the largest activation of a small GPT) never exists.
//
// What it computes per row r (target t = targets[r]), in fp32:
//   lse[r]  = log(sum_j exp(x_j))            one pass, online max / rescaled sum
//   loss[r] = lse[r] - x_t                   0 where t == ignore_index; NaN if t is out of range
//   dx_j    = (exp(x_j - lse[r]) - [j == t]) * dloss[r]    0 where t == ignore_index
// over the row's first `classes` columns j. A row holds `width` >= classes columns: an LM
// head padded to a multiple of 128 columns (toolkit/ops/fused_modules.py, so that its GEMMs are
// aligned) leaves columns past `classes` that are no class: the forward skips them and the
// backward writes 0 there.
//
// How it is launched: one block of 512 threads per row. A row starts wherever
// r * width puts it (GPT-2's vocab, 50257, is odd), so each row is read as a
// scalar head up to the first 16-byte boundary, a body of 16-byte packs and a
// scalar tail. Exponentials are exp2 of log2(e)-scaled values.
#include "common.cuh"

namespace toolkit {
namespace {

constexpr int kThreads = 512;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Running (max, sum of exp2(x - max)) in log2 units.
struct OnlineLse {
  float m = -INFINITY, s = 0.f;

  __device__ __forceinline__ void add(float a) {  // a = x * log2(e)
    if (a == -INFINITY) return;
    if (a > m) {
      s = s * exp2f(m - a) + 1.f;  // exp2f(-inf) = 0 covers the first element
      m = a;
    } else {
      s += exp2f(a - m);
    }
  }
  __device__ __forceinline__ void merge(float om, float os) {
    if (om == -INFINITY) return;
    if (m == -INFINITY) { m = om; s = os; return; }
    const float nm = fmaxf(m, om);
    s = s * exp2f(m - nm) + os * exp2f(om - nm);
    m = nm;
  }
};

// Elements before the first 16-byte boundary of `row`, capped at n.
template <typename T>
__device__ __forceinline__ int64_t head_len(const T* row, int64_t n) {
  const int64_t mis = (reinterpret_cast<uintptr_t>(row) % 16) / sizeof(T);
  const int64_t head = mis == 0 ? 0 : (16 / (int64_t)sizeof(T)) - mis;
  return head < n ? head : n;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) cross_entropy_fwd_kernel(const T* __restrict__ logits,
                                                                     const int64_t* __restrict__ targets,
                                                                     float* __restrict__ loss,
                                                                     float* __restrict__ lse, int64_t width,
                                                                     int64_t classes, int64_t ignore_index) {
  constexpr int kPack = 16 / sizeof(T);
  __shared__ float sm[32], ss[32];
  const int64_t r = blockIdx.x;
  const T* row = logits + r * width;
  const bool scalar_only = (reinterpret_cast<uintptr_t>(row) % sizeof(T)) != 0;
  const int64_t head = scalar_only ? classes : head_len(row, classes);
  const int64_t packs = (classes - head) / kPack;
  OnlineLse acc;
  for (int64_t i = threadIdx.x; i < head; i += kThreads) acc.add(to_float(row[i]) * kLog2e);
  const T* body = row + head;
  for (int64_t p = threadIdx.x; p < packs; p += kThreads) {
    float v[kPack];
    load_pack<T, kPack>(body + p * kPack, v);
    float pm = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPack; ++j) pm = fmaxf(pm, v[j] * kLog2e);
    if (pm == -INFINITY) continue;
    if (pm > acc.m) {
      acc.s *= exp2f(acc.m - pm);
      acc.m = pm;
    }
#pragma unroll
    for (int j = 0; j < kPack; ++j) acc.s += exp2f(v[j] * kLog2e - acc.m);
  }
  for (int64_t i = head + packs * kPack + threadIdx.x; i < classes; i += kThreads) acc.add(to_float(row[i]) * kLog2e);
  // Merge: within warps, then across warps.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, acc.m, o), os = __shfl_xor_sync(0xffffffffu, acc.s, o);
    acc.merge(om, os);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { sm[warp] = acc.m; ss[warp] = acc.s; }
  __syncthreads();
  if (threadIdx.x == 0) {
    OnlineLse total;
    for (int w = 0; w < kThreads / 32; ++w) total.merge(sm[w], ss[w]);
    const float l = (total.m + log2f(total.s)) * kLn2;
    const int64_t t = targets[r];
    float value;
    if (t == ignore_index) value = 0.f;
    else if (t < 0 || t >= classes) value = NAN;
    else value = l - to_float(row[t]);
    loss[r] = value;
    lse[r] = l;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) cross_entropy_bwd_kernel(const float* __restrict__ dloss,
                                                                     const T* __restrict__ logits,
                                                                     const int64_t* __restrict__ targets,
                                                                     const float* __restrict__ lse,
                                                                     T* __restrict__ dlogits, int64_t width,
                                                                     int64_t classes, int64_t ignore_index) {
  constexpr int kPack = 16 / sizeof(T);
  const int64_t r = blockIdx.x;
  const int64_t t = targets[r];
  const float scale = t == ignore_index ? 0.f : dloss[r];
  const float shift = lse[r] * kLog2e;
  const T* row = logits + r * width;
  T* out = dlogits + r * width;
  // Packs need the input and output rows equally misaligned (true for same-dtype contiguous tensors).
  const bool scalar_only = (reinterpret_cast<uintptr_t>(row) % 16) != (reinterpret_cast<uintptr_t>(out) % 16) ||
                           (reinterpret_cast<uintptr_t>(row) % sizeof(T)) != 0;
  // The whole row is written: the padded columns past `classes` get 0.
  const int64_t head = scalar_only ? width : head_len(row, width);
  const int64_t packs = (width - head) / kPack;
  // NOTE: the packs wholly inside the classes run without the `j < classes` test: with it in the
  // main loop the backward took 3.25 ms instead of 0.83 (H200, 16384 x 50304 bf16).
  const int64_t inside = classes > head ? (classes - head) / kPack : 0;
  const int64_t full = inside < packs ? inside : packs;
  auto grad = [&](float x, int64_t j) { return (exp2f(x * kLog2e - shift) - (j == t ? 1.f : 0.f)) * scale; };
  auto checked = [&](float x, int64_t j) { return j < classes ? grad(x, j) : 0.f; };
  for (int64_t i = threadIdx.x; i < head; i += kThreads) out[i] = from_float<T>(checked(to_float(row[i]), i));
  for (int64_t p = threadIdx.x; p < full; p += kThreads) {
    const int64_t j0 = head + p * kPack;
    float v[kPack];
    load_pack<T, kPack>(row + j0, v);
#pragma unroll
    for (int j = 0; j < kPack; ++j) v[j] = grad(v[j], j0 + j);
    store_pack<T, kPack>(out + j0, v);
  }
  for (int64_t p = full + threadIdx.x; p < packs; p += kThreads) {  // the packs that reach past the classes
    const int64_t j0 = head + p * kPack;
    float v[kPack];
    load_pack<T, kPack>(row + j0, v);
#pragma unroll
    for (int j = 0; j < kPack; ++j) v[j] = checked(v[j], j0 + j);
    store_pack<T, kPack>(out + j0, v);
  }
  for (int64_t i = head + packs * kPack + threadIdx.x; i < width; i += kThreads)
    out[i] = from_float<T>(checked(to_float(row[i]), i));
}

}  // namespace

cudaError_t launch_cross_entropy_fwd(const void* logits, const int64_t* targets, float* loss, float* lse,
                                     int64_t rows, int64_t width, int64_t classes, int64_t ignore_index, DType dtype,
                                     cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffffLL || classes <= 0 || classes > width) return cudaErrorInvalidValue;
  TOOLKIT_DISPATCH(dtype, T, {
    cross_entropy_fwd_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>(static_cast<const T*>(logits), targets, loss,
                                                                        lse, width, classes, ignore_index);
  });
  return cudaGetLastError();
}

cudaError_t launch_cross_entropy_bwd(const float* dloss, const void* logits, const int64_t* targets, const float* lse,
                                     void* dlogits, int64_t rows, int64_t width, int64_t classes,
                                     int64_t ignore_index, DType dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffffLL || classes <= 0 || classes > width) return cudaErrorInvalidValue;
  TOOLKIT_DISPATCH(dtype, T, {
    cross_entropy_bwd_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>(dloss, static_cast<const T*>(logits),
                                                                        targets, lse, static_cast<T*>(dlogits), width,
                                                                        classes, ignore_index);
  });
  return cudaGetLastError();
}

}  // namespace toolkit
