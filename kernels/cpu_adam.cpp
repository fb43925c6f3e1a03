// CPU AdamW: one fused pass over fp32 parameters, gradients and both moments.
//
// What it computes (torch.optim.AdamW, decoupled weight decay, no amsgrad), per element:
//   p  = p * (1 - lr * wd)                       decoupled weight decay
//   m  = m + (1 - beta1) * (g - m)               torch's lerp, same as beta1*m + (1-beta1)*g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p  = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)   bc1 = 1 - beta1^t, bc2 = 1 - beta2^t
// Optionally, in the same pass: writes the new parameters as bf16 into `param_bf16` (ZeRO-Offload's
// copy back to the device wants 16-bit weights) and zeroes the gradient it consumed (`zero_grad`:
// the next accumulation starts from zero without another pass over the buffer). `grad_scales`: the
// step reads the gradient multiplied by each, a tile at a time (a delayed offload update's clip or fp16
// unscale, cpu_adam_bf16.h scale_into).
//
// How it runs: OpenMP splits the tensor into contiguous, cache-line aligned blocks, one per thread;
// each thread walks its block with AVX-512 (16 floats), else AVX2+FMA (8 floats), else a scalar
// loop the compiler vectorises. The pass reads 16 bytes and writes 12 per element, so it is memory
// bound: the win over torch's fused CPU AdamW comes from one pass, wide vectors and all cores.
// Built by toolkit/ops/cpu_adam.py (torch.utils.cpp_extension, -O3 -march=native -fopenmp, cached).
// Reference it is checked against: torch.optim.AdamW (tests/ops/test_cpu_adam.py).

// NOTE: not <torch/extension.h>: it pulls in torch/all.h (the whole C++ frontend: nn, optim, data,
// autograd), which is most of this file's cold build. The kernel needs the Tensor and pybind11 with
// torch's type casters only (benchmarks/RESULTS.md, "CPU Adam kernel build").
#include <torch/csrc/utils/pybind.h>

#include "cpu_adam_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

struct AdamScalars {
  float decay;      // 1 - lr * wd
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
};

// bf16 by round-to-nearest-even of the fp32 bits (NaN kept quiet).
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// ---------------------------------------------------------------------------
// Kernels: one contiguous range [begin, end) each.

inline void adam_scalar(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end,
                        const AdamScalars& s) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float param = p[i] * s.decay;
    float grad = g[i];
    float mi = m[i] + s.one_minus_beta1 * (grad - m[i]);
    float vi = s.beta2 * v[i] + s.one_minus_beta2 * grad * grad;
    float denom = std::sqrt(vi) * s.inv_bc2_sqrt + s.eps;
    param = param + s.neg_step_size * mi / denom;
    p[i] = param;
    m[i] = mi;
    v[i] = vi;
  }
}

#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
// NOTE: vsqrtps and vdivps on 16 lanes cost more cycles than the loads they wait for, so the
// kernel would be compute bound on one core. Both become a 14-bit hardware estimate refined by one
// Newton-Raphson step (error ~2^-27, a few ulp), which keeps the pass memory bound; results stay
// within 1e-6 relative of torch's exact sqrt and division (tests/ops/test_cpu_adam.py).
inline __m512 sqrt_nr(__m512 v) {
  const __m512 r0 = _mm512_rsqrt14_ps(v);  // 1/sqrt(v); inf at 0
  const __m512 half_v = _mm512_mul_ps(v, _mm512_set1_ps(0.5f));
  const __m512 r = _mm512_mul_ps(r0, _mm512_fnmadd_ps(_mm512_mul_ps(half_v, r0), r0, _mm512_set1_ps(1.5f)));
  const __m512 s = _mm512_mul_ps(v, r);
  // v == 0 gives 0 * inf = NaN above: take exact sqrt there (and for inf/NaN inputs).
  const __mmask16 finite_positive = _mm512_cmp_ps_mask(v, _mm512_set1_ps(0.0f), _CMP_GT_OQ) &
                                    _mm512_cmp_ps_mask(v, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
  if (finite_positive == static_cast<__mmask16>(0xFFFF)) return s;
  return _mm512_mask_sqrt_ps(s, static_cast<__mmask16>(~finite_positive), v);
}
inline __m512 reciprocal_nr(__m512 d) {  // d >= eps > 0
  const __m512 r0 = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r0, _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(2.0f)));
}
inline void adam_vector(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end,
                        const AdamScalars& s) {
  const __m512 decay = _mm512_set1_ps(s.decay), b1c = _mm512_set1_ps(s.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(s.beta2), b2c = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 inv_bc2 = _mm512_set1_ps(s.inv_bc2_sqrt), eps = _mm512_set1_ps(s.eps);
  const __m512 step = _mm512_set1_ps(s.neg_step_size);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    __m512 grad = _mm512_loadu_ps(g + i);
    __m512 mi = _mm512_loadu_ps(m + i);
    __m512 vi = _mm512_loadu_ps(v + i);
    __m512 param = _mm512_mul_ps(_mm512_loadu_ps(p + i), decay);
    mi = _mm512_fmadd_ps(b1c, _mm512_sub_ps(grad, mi), mi);
    vi = _mm512_fmadd_ps(b2c, _mm512_mul_ps(grad, grad), _mm512_mul_ps(b2, vi));
    __m512 denom = _mm512_fmadd_ps(sqrt_nr(vi), inv_bc2, eps);
    param = _mm512_fmadd_ps(step, _mm512_mul_ps(mi, reciprocal_nr(denom)), param);
    _mm512_storeu_ps(p + i, param);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
  }
  adam_scalar(p, g, m, v, i, end, s);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kWidth = 8;
inline void adam_vector(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end,
                        const AdamScalars& s) {
  const __m256 decay = _mm256_set1_ps(s.decay), b1c = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(s.beta2), b2c = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 inv_bc2 = _mm256_set1_ps(s.inv_bc2_sqrt), eps = _mm256_set1_ps(s.eps);
  const __m256 step = _mm256_set1_ps(s.neg_step_size);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    __m256 grad = _mm256_loadu_ps(g + i);
    __m256 mi = _mm256_loadu_ps(m + i);
    __m256 vi = _mm256_loadu_ps(v + i);
    __m256 param = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    mi = _mm256_fmadd_ps(b1c, _mm256_sub_ps(grad, mi), mi);
    vi = _mm256_fmadd_ps(b2c, _mm256_mul_ps(grad, grad), _mm256_mul_ps(b2, vi));
    __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vi), inv_bc2, eps);
    param = _mm256_fmadd_ps(step, _mm256_div_ps(mi, denom), param);
    _mm256_storeu_ps(p + i, param);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
  }
  adam_scalar(p, g, m, v, i, end, s);
}
#else
constexpr int64_t kWidth = 1;
inline void adam_vector(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end,
                        const AdamScalars& s) {
  adam_scalar(p, g, m, v, begin, end, s);
}
#endif

// One pass over [begin, end) in tiles that stay in L1/L2: the AdamW update, then, while the tile is
// still cached, the bf16 copy of the new weights and the zeroing of the consumed gradient.
// `extrapolate` (zero.offload_update delayed_extrapolated): the bf16 copy is new + (new - old), the
// weights one update ahead, from the tile's old weights kept on the stack; as torch's add(p, p - old).
inline void adam_range(float* p, float* g, float* m, float* v, uint16_t* out16, bool zero_grad, bool extrapolate,
                       int64_t begin, int64_t end, const AdamScalars& s, const std::vector<float>& scales) {
  constexpr int64_t kTile = toolkit_cpu_adam::kScaledTile;  // 2048: 4 arrays x 8 KiB
  float old[kTile], scaled[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t stop = std::min(end, t + kTile);
    if (extrapolate) std::memcpy(old, p + t, sizeof(float) * (stop - t));
    if (scales.empty()) {
      adam_vector(p, g, m, v, t, stop, s);
    } else {  // the multiplied gradient in a stack tile (cpu_adam_bf16.h scale_into), `g` unchanged
      toolkit_cpu_adam::scale_into(scaled, g + t, stop - t, scales.data(), static_cast<int>(scales.size()));
      adam_vector(p + t, scaled, m + t, v + t, 0, stop - t, s);
    }
    if (out16 != nullptr && extrapolate)
      for (int64_t i = t; i < stop; ++i) out16[i] = to_bf16(p[i] + (p[i] - old[i - t]));
    else if (out16 != nullptr)
      for (int64_t i = t; i < stop; ++i) out16[i] = to_bf16(p[i]);
    if (zero_grad) std::memset(g + t, 0, sizeof(float) * (stop - t));
  }
}

void check(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel);
}

AdamScalars adam_scalars(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay) {
  TORCH_CHECK(step >= 1, "step must be >= 1 (1-based), got ", step);
  // Scalars in double first, as torch computes them in Python floats, then rounded once.
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamScalars s;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-lr / bc1);
  return s;
}

// The gradient's multipliers as torch applies a Python float to a float32 tensor: rounded to float first.
std::vector<float> float_scales(const std::vector<double>& scales) {
  return std::vector<float>(scales.begin(), scales.end());
}

void check_bf16(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == numel,
              name, " must be a contiguous CPU bfloat16 tensor of ", numel, " elements");
}

}  // namespace

// ---------------------------------------------------------------------------
// Launcher: AdamW step `step` (1-based) on contiguous fp32 CPU tensors, in place.

void adamw_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                c10::optional<at::Tensor> param_bf16, bool zero_grad, bool extrapolate,
                const std::vector<double>& grad_scales) {
  const int64_t n = param.numel();
  check(param, "param", n);
  check(grad, "grad", n);
  check(exp_avg, "exp_avg", n);
  check(exp_avg_sq, "exp_avg_sq", n);
  uint16_t* out16 = nullptr;
  if (param_bf16.has_value()) {
    const auto& t = *param_bf16;
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == n,
                "param_bf16 must be a contiguous CPU bfloat16 tensor of param's size");
    out16 = reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
  }
  TORCH_CHECK(!extrapolate || out16 != nullptr, "extrapolate writes the bf16 copy: pass param_bf16");
  const AdamScalars s = adam_scalars(step, lr, beta1, beta2, eps, weight_decay);
  const std::vector<float> scales = float_scales(grad_scales);
  float* p = param.data_ptr<float>();
  float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  // NOTE: blocks of 64K floats (whole cache lines, so no two threads write one line) handed out
  // dynamically: a thread whose core is busy with another process takes fewer blocks instead of
  // making the others wait at the end, which a static split into one block per thread would.
  constexpr int64_t kBlock = 1 << 16;
  if (n <= kBlock) {
    adam_range(p, g, m, v, out16, zero_grad, extrapolate, 0, n, s, scales);
    return;
  }
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    adam_range(p, g, m, v, out16, zero_grad, extrapolate, begin, end, s, scales);
  }
}

// Launcher: AdamW step `step` (1-based) on bf16 param/exp_avg/exp_avg_sq and an fp32 grad, in place, with
// stochastic rounding keyed by (seed, step, offset + index): kernels/cpu_adam_bf16.cpp. Optionally, in the same
// pass, `param_bf16` gets the new weights (`extrapolate`: new + (new - old)), as adamw_step's.
void adamw_step_bf16(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, int64_t step,
                     double lr, double beta1, double beta2, double eps, double weight_decay, int64_t seed,
                     int64_t offset, c10::optional<at::Tensor> param_bf16, bool extrapolate,
                     const std::vector<double>& grad_scales) {
  const int64_t n = param.numel();
  check_bf16(param, "param", n);
  check(grad, "grad", n);
  check_bf16(exp_avg, "exp_avg", n);
  check_bf16(exp_avg_sq, "exp_avg_sq", n);
  uint16_t* out16 = nullptr;
  if (param_bf16.has_value()) {
    check_bf16(*param_bf16, "param_bf16", n);
    out16 = reinterpret_cast<uint16_t*>(param_bf16->data_ptr<at::BFloat16>());
  }
  TORCH_CHECK(!extrapolate || out16 != nullptr, "extrapolate writes the bf16 copy: pass param_bf16");
  const AdamScalars a = adam_scalars(step, lr, beta1, beta2, eps, weight_decay);
  toolkit_cpu_adam::Bf16StepScalars s;
  s.decay = a.decay;
  s.one_minus_beta1 = a.one_minus_beta1;
  s.beta2 = a.beta2;
  s.one_minus_beta2 = a.one_minus_beta2;
  s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  s.eps = a.eps;
  s.neg_step_size = a.neg_step_size;
  s.step_key = toolkit_cpu_adam::rounding_step_key(seed, step);
  s.offset = offset;
  s.extrapolate = extrapolate;
  const std::vector<float> scales = float_scales(grad_scales);
  toolkit_cpu_adam::adamw_bf16_states(reinterpret_cast<uint16_t*>(param.data_ptr<at::BFloat16>()),
                                      grad.data_ptr<float>(),
                                      reinterpret_cast<uint16_t*>(exp_avg.data_ptr<at::BFloat16>()),
                                      reinterpret_cast<uint16_t*>(exp_avg_sq.data_ptr<at::BFloat16>()), out16, n, s,
                                      scales.data(), static_cast<int>(scales.size()));
}

std::string simd_width() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

int omp_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "toolkit CPU AdamW (fused, OpenMP, AVX-512/AVX2)";
  m.def("adamw_step", &adamw_step, "AdamW step in place on contiguous fp32 CPU tensors",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("param_bf16") = py::none(), py::arg("zero_grad") = false, py::arg("extrapolate") = false,
        py::arg("grad_scales") = std::vector<double>(),
        // NOTE: the GIL is released for the pass, so a delayed offload update (toolkit/runtime/zero/
        // delayed_update.py) steps on its thread while the main thread runs the next forward and backward
        py::call_guard<py::gil_scoped_release>());
  m.def("adamw_step_bf16", &adamw_step_bf16,
        "AdamW step in place on bf16 param and moments (fp32 grad), stochastic rounding keyed by seed, step, index",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("step"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("seed"),
        py::arg("offset"), py::arg("param_bf16") = py::none(), py::arg("extrapolate") = false,
        py::arg("grad_scales") = std::vector<double>(), py::call_guard<py::gil_scoped_release>());
  m.def("simd_width", &simd_width, "the vector width this build uses");
  m.def("omp_threads", &omp_threads, "OpenMP threads a step uses");
}
