// The bf16-state AdamW step (kernels/cpu_adam_bf16.cpp), as kernels/cpu_adam.cpp's binding calls it.
#pragma once

#include <cstdint>

namespace toolkit_cpu_adam {

// One step's scalars, rounded to float once from torch's double maths (cpu_adam.cpp adam_scalars).
struct Bf16StepScalars {
  float decay;            // 1 - lr * wd
  float one_minus_beta1;
  float beta2, one_minus_beta2;
  float bc2_sqrt;         // sqrt(1 - beta2^t): torch divides by it
  float eps;
  float neg_step_size;    // -lr / (1 - beta1^t)
  uint32_t step_key;      // the hash of (seed, step) the rounding bits start from
  int64_t offset;         // element 0's index in the shard (the bits are keyed by it)
  bool extrapolate;       // `out` gets new + (new - old) (zero.offload_update delayed_extrapolated)
};

// The hash of (seed, step) a step's rounding bits start from.
uint32_t rounding_step_key(int64_t seed, int64_t step);

// AdamW on n elements of bf16 p, m, v (in place) with an fp32 gradient; OpenMP over blocks, AVX-512 or AVX2 lanes.
// `out` (may be null): the new weights' bits too (or, extrapolating, one update beyond them). `scales` (n_scales of
// them, may be none): the step reads the gradient multiplied by each in turn (scale_into), `g` itself unchanged.
void adamw_bf16_states(uint16_t* p, const float* g, uint16_t* m, uint16_t* v, uint16_t* out, int64_t n,
                       const Bf16StepScalars& s, const float* scales = nullptr, int n_scales = 0);

// The gradient tile a step reads when it has multipliers: into[0, n) = g[0, n) * scales[0], then * scales[1], ...,
// each product rounded to float, as torch's in-place multiply by a Python float rounds it (the scalar taken as
// float) on a CPU or a GPU. A delayed offload update's gradient copy was taken before a clip or an fp16 unscale
// multiplied the device's gradients: the kernels multiply it here, a cache-resident tile at a time just before
// stepping it, instead of copying the whole gradient again. The tile is a stack buffer: writing the products back
// into `g` would add 4 bytes of memory traffic per element to a memory-bound pass (16-23% slower on AVX2). The
// products go through memory, so the compiler cannot fuse one into the next operation (an FMA would round once).
constexpr int64_t kScaledTile = 2048;
inline void scale_into(float* into, const float* g, int64_t n, const float* scales, int n_scales) {
  const float first = scales[0];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) into[i] = g[i] * first;
  for (int k = 1; k < n_scales; ++k) {
    const float factor = scales[k];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) into[i] = into[i] * factor;
  }
}

}  // namespace toolkit_cpu_adam
