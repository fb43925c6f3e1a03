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
// them, may be none): each block's gradient is first multiplied by each in turn, in place (scale_in_place).
void adamw_bf16_states(uint16_t* p, float* g, uint16_t* m, uint16_t* v, uint16_t* out, int64_t n,
                       const Bf16StepScalars& s, const float* scales = nullptr, int n_scales = 0);

// g[begin, end) *= scales[0], then *= scales[1], ...: each product rounded to float, as torch's in-place multiply
// by a Python float rounds it (the scalar taken as float) on a CPU or a GPU. A delayed offload update's gradient
// copy was taken before a clip or an fp16 unscale multiplied the device's gradients: the kernels multiply it here,
// a cache-sized block at a time just before stepping it, instead of copying the whole gradient again. The
// products go through memory, so the compiler cannot fuse one into the next operation (an FMA would round once).
inline void scale_in_place(float* g, int64_t begin, int64_t end, const float* scales, int n_scales) {
  for (int k = 0; k < n_scales; ++k) {
    const float factor = scales[k];
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) g[i] = g[i] * factor;
  }
}

}  // namespace toolkit_cpu_adam
