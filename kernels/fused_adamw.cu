// fused_adamw.cu: one-pass AdamW over many tensors (or one flat ZeRO shard).
//
// What it computes, per element, in fp32 (torch.optim.AdamW's order of operations):
//   g  = grad * grad_scale                       unscale by the loss scale (and clip)
//   if g is inf/NaN: raise *nonfinite, leave this element's p, m, v unchanged
//   p -= lr * weight_decay * p                   decoupled weight decay
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   lowp = (bf16 | fp16) p                       optional low-precision copy
// Bytes per parameter: 16 read (p, g, m, v) + 12 written (p, m, v) = 28 with fp32
// gradients, + 2 for the low-precision copy. Memory-bound: the only goal is to
// stream those bytes at copy bandwidth.
//
// How it is launched: the host splits every tensor into chunks of kAdamWChunk
// elements and uploads a table of tensors and the prefix sums of their chunk
// counts; block b finds its tensor by binary search in that table and updates
// one chunk with 16-byte loads, every load of the chunk issued before the math.
// A second kernel family computes the global gradient norm the same way
// (per-chunk partial sums, then one deterministic reduction).
#include "common.cuh"

namespace toolkit {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;                                 // elements per pack (16 B of fp32)
constexpr int kUnroll = kAdamWChunk / (kThreads * kVec);  // packs per thread per chunk
static_assert(kUnroll * kThreads * kVec == kAdamWChunk, "chunk must be a whole number of block passes");

// The tensor whose chunk range holds `chunk`: largest t with chunk_starts[t] <= chunk.
__device__ __forceinline__ int find_tensor(const int64_t* __restrict__ chunk_starts, int num_tensors, int64_t chunk) {
  int lo = 0, hi = num_tensors - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (chunk_starts[mid] <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

struct AdamWMath {
  float lr, beta1, beta2, eps, decay, step_size, bc2_sqrt, scale;

  __device__ __forceinline__ AdamWMath(const AdamWHyper& h, float scale_)
      : lr(h.lr), beta1(h.beta1), beta2(h.beta2), eps(h.eps), decay(h.lr * h.weight_decay),
        step_size(h.lr / h.bias_correction1), bc2_sqrt(h.bias_correction2_sqrt), scale(scale_) {}

  // Updates p, m, v in place; returns false (and changes nothing) for a non-finite gradient.
  __device__ __forceinline__ bool update(float& p, float grad, float& m, float& v) const {
    const float g = grad * scale;
    if (!isfinite(g)) return false;
    p -= decay * p;
    m = beta1 * m + (1.f - beta1) * g;
    v = beta2 * v + (1.f - beta2) * g * g;
    const float denom = sqrtf(v) / bc2_sqrt + eps;
    p -= step_size * m / denom;
    return true;
  }
};

template <typename G, typename L, bool kLowp>
__global__ void __launch_bounds__(kThreads) adamw_kernel(const AdamWTensor* __restrict__ tensors,
                                                         const int64_t* __restrict__ chunk_starts, int num_tensors,
                                                         AdamWHyper h, const float* __restrict__ grad_scale_dev,
                                                         const int* __restrict__ skip_dev, int* nonfinite_dev) {
  if (skip_dev != nullptr && *skip_dev != 0) return;  // uniform across the grid: no barrier is skipped unevenly
  const int64_t chunk = blockIdx.x;
  const int t = find_tensor(chunk_starts, num_tensors, chunk);
  const AdamWTensor ten = tensors[t];
  const int64_t begin = (chunk - chunk_starts[t]) * kAdamWChunk;
  const int64_t end = min(begin + kAdamWChunk, ten.numel);
  const AdamWMath math(h, h.grad_scale * (grad_scale_dev != nullptr ? *grad_scale_dev : 1.f));

  float* __restrict__ P = ten.param;
  const G* __restrict__ Gr = static_cast<const G*>(ten.grad);
  float* __restrict__ M = ten.exp_avg;
  float* __restrict__ V = ten.exp_avg_sq;
  L* __restrict__ Lo = static_cast<L*>(ten.lowp);
  bool bad = false;

  const bool packed = end - begin == kAdamWChunk && is_aligned(P, 16) && is_aligned(M, 16) && is_aligned(V, 16) &&
                      is_aligned(Gr, pack_alignment<G, kVec>()) && (!kLowp || is_aligned(Lo, pack_alignment<L, kVec>()));
  if (packed) {
    // A whole, aligned chunk: issue every load first (4 x kUnroll 16-byte loads in flight).
    float p[kUnroll][kVec], g[kUnroll][kVec], m[kUnroll][kVec], v[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = begin + (int64_t)(u * kThreads + threadIdx.x) * kVec;
      load_pack<float, kVec>(P + i, p[u]);
      load_pack<G, kVec>(Gr + i, g[u]);
      load_pack<float, kVec>(M + i, m[u]);
      load_pack<float, kVec>(V + i, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = begin + (int64_t)(u * kThreads + threadIdx.x) * kVec;
#pragma unroll
      for (int k = 0; k < kVec; ++k) bad |= !math.update(p[u][k], g[u][k], m[u][k], v[u][k]);
      store_pack<float, kVec>(P + i, p[u]);
      store_pack<float, kVec>(M + i, m[u]);
      store_pack<float, kVec>(V + i, v[u]);
      if (kLowp) store_pack<L, kVec>(Lo + i, p[u]);
    }
  } else {
    // The tail of a tensor, or misaligned views: one element at a time.
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      float p = P[i], m = M[i], v = V[i];
      bad |= !math.update(p, to_float(Gr[i]), m, v);
      P[i] = p;
      M[i] = m;
      V[i] = v;
      if (kLowp) Lo[i] = from_float<L>(p);
    }
  }
  if (nonfinite_dev != nullptr && __syncthreads_or(bad) && threadIdx.x == 0) *nonfinite_dev = 1;
}

template <typename G>
__global__ void __launch_bounds__(kThreads) grad_sumsq_kernel(const AdamWTensor* __restrict__ tensors,
                                                              const int64_t* __restrict__ chunk_starts,
                                                              int num_tensors, float scale,
                                                              float* __restrict__ partial, int* nonfinite_dev) {
  __shared__ float scratch[32];
  const int64_t chunk = blockIdx.x;
  const int t = find_tensor(chunk_starts, num_tensors, chunk);
  const AdamWTensor ten = tensors[t];
  const int64_t begin = (chunk - chunk_starts[t]) * kAdamWChunk;
  const int64_t end = min(begin + kAdamWChunk, ten.numel);
  const G* __restrict__ Gr = static_cast<const G*>(ten.grad);
  float acc = 0.f;
  bool bad = false;
  if (end - begin == kAdamWChunk && is_aligned(Gr, pack_alignment<G, kVec>())) {
    float g[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_pack<G, kVec>(Gr + begin + (int64_t)(u * kThreads + threadIdx.x) * kVec, g[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float x = g[u][k] * scale;
        bad |= !isfinite(x);
        acc += x * x;
      }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const float x = to_float(Gr[i]) * scale;
      bad |= !isfinite(x);
      acc += x * x;
    }
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) partial[chunk] = acc;
  if (nonfinite_dev != nullptr && __syncthreads_or(bad) && threadIdx.x == 0) *nonfinite_dev = 1;
}

// One block: sum the per-chunk partials in fp64 (fixed order per thread, then a tree).
__global__ void grad_norm_finish_kernel(const float* __restrict__ partial, int64_t n, float grad_scale,
                                        float max_norm, float* __restrict__ out) {
  __shared__ double sums[1024];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sums[threadIdx.x] += sums[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const float norm = (float)sqrt(sums[0]);
    // NOTE: torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6), clamped to 1.
    const float clip = max_norm > 0.f ? fminf(1.f, max_norm / (norm + 1e-6f)) : 1.f;
    out[0] = norm;
    out[1] = grad_scale * clip;
  }
}

template <typename G, typename L, bool kLowp>
cudaError_t launch_adamw_typed(const AdamWTensor* tensors, const int64_t* chunk_starts, int num_tensors,
                               int64_t num_chunks, AdamWHyper h, const float* grad_scale_dev, const int* skip_dev,
                               int* nonfinite_dev, cudaStream_t stream) {
  adamw_kernel<G, L, kLowp><<<(unsigned)num_chunks, kThreads, 0, stream>>>(tensors, chunk_starts, num_tensors, h,
                                                                           grad_scale_dev, skip_dev, nonfinite_dev);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_adamw(const AdamWTensor* tensors, const int64_t* chunk_starts, int num_tensors,
                         int64_t num_chunks, DType grad_dtype, bool has_lowp, DType lowp_dtype, AdamWHyper h,
                         const float* grad_scale_dev, const int* skip_dev, int* nonfinite_dev, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  if (num_chunks > 0x7fffffffLL) return cudaErrorInvalidValue;
  TOOLKIT_DISPATCH(grad_dtype, G, {
    if (!has_lowp)
      return launch_adamw_typed<G, float, false>(tensors, chunk_starts, num_tensors, num_chunks, h, grad_scale_dev,
                                                 skip_dev, nonfinite_dev, stream);
    TOOLKIT_DISPATCH(lowp_dtype, L, {
      return launch_adamw_typed<G, L, true>(tensors, chunk_starts, num_tensors, num_chunks, h, grad_scale_dev,
                                            skip_dev, nonfinite_dev, stream);
    });
  });
  return cudaErrorInvalidValue;
}

cudaError_t launch_grad_norm(const AdamWTensor* tensors, const int64_t* chunk_starts, int num_tensors,
                             int64_t num_chunks, DType grad_dtype, float grad_scale, float max_norm, float* partial,
                             float* out, int* nonfinite_dev, cudaStream_t stream) {
  if (num_chunks > 0x7fffffffLL) return cudaErrorInvalidValue;
  if (num_chunks > 0) {
    TOOLKIT_DISPATCH(grad_dtype, G, {
      grad_sumsq_kernel<G><<<(unsigned)num_chunks, kThreads, 0, stream>>>(tensors, chunk_starts, num_tensors,
                                                                          grad_scale, partial, nonfinite_dev);
    });
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  grad_norm_finish_kernel<<<1, 1024, 0, stream>>>(partial, num_chunks, grad_scale, max_norm, out);
  return cudaGetLastError();
}

}  // namespace toolkit
