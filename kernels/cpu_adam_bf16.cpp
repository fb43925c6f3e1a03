// bf16 states (optimizer.state_dtype bf16 with zero.offload_optimizer cpu or nvme): the master weight and both
// moments are bf16, the gradient fp32. Per element: the three read as fp32, torch's AdamW in fp32, then each
// written back with stochastic rounding: 16 random bits added below bf16's mantissa of the fp32 result, then
// truncated (unbiased: E[result] = the fp32 value). The bits are a hash of (seed, step, the element's index in the
// shard), so the result does not depend on how the shard is cut into pieces or threads. Optionally, in the same
// pass, `out` gets the new weights' bf16 bits (the copy an offloaded step sends to the device), or with
// `extrapolate` (zero.offload_update delayed_extrapolated) new + (new - old) rounded to nearest, as torch's
// add(p, p - old) into a bf16 tensor.
//
// The fp32 maths are the ops of torch's vectorised single-tensor AdamW, in its order, so the kernel and its torch
// reference (toolkit/runtime/low_precision_adamw.py `hashed_bf16_adam_update_`, also the fallback) agree but for
// rare one-ulp differences (tests/ops/test_cpu_adam.py):
//   p = p * (1 - lr wd);  m = fma(1 - b1, g - m, m) (lerp);  v = b2 v + ((1 - b2) g) g;
//   denom = sqrt(v) / sqrt(bc2) + eps;  p = p + (-lr / bc1) m / denom.
// Exact sqrt and division (the fp32 kernel's estimates would move roundings); the pass is still memory bound on
// AVX-512 hosts. Every element goes through the same vector lanes: the last few of a range are padded into a full
// vector rather than stepped by a scalar loop, so a cut between pieces never changes a result.
#include "cpu_adam_bf16.h"

// NOTE: every multiply and add rounds as written, so the AVX-512, AVX2 and scalar builds give the same bits: the
// build passes -ffp-contract=off (toolkit/ops/loader.py), since GCC fuses the vector intrinsics' a * b + c into an
// FMA on its own and a file's `#pragma GCC optimize` does not stop it there.
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace toolkit_cpu_adam {
namespace {

constexpr uint32_t kHash1 = 0x7feb352du, kHash2 = 0x846ca68bu;  // Chris Wellons' lowbias32

inline uint32_t lowbias32_scalar(uint32_t x) {
  x ^= x >> 16;
  x *= kHash1;
  x ^= x >> 15;
  x *= kHash2;
  return x ^ (x >> 16);
}

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;

inline __m512i lowbias32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kHash1)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kHash2)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

inline __m512 widen(const uint16_t* src) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// x's bf16 bits: stochastic rounding (noise16 added below the mantissa, then truncated), NaN kept quiet.
inline __m256i narrow(__m512 x, __m512i noise16) {
  const __m512i bits = _mm512_castps_si512(x);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, noise16), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));  // NaN stays NaN
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// x's bf16 bits by round-to-nearest-even (torch's float -> bfloat16), NaN kept quiet: `narrow` with the noise
// 0x7fff plus the lowest kept bit.
inline __m256i nearest(__m512 x) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16), _mm512_set1_epi32(1));
  return narrow(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

inline __m512 widen_bits(__m256i words) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

inline void store(uint16_t* dst, __m256i words) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), words); }

// kLanes elements from `index` (their index in the shard) on.
inline void step_lanes(uint16_t* p, const float* g, uint16_t* m, uint16_t* v, uint16_t* out, uint64_t index,
                       const Bf16StepScalars& s) {
  const __m512i lo0 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(index)));
  const __m512i lo = _mm512_add_epi32(lo0, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  // NOTE: the inner hash depends only on the index's high word, the same for every lane but those past a carry:
  // two scalar hashes per vector instead of a vector one (the same bits)
  const uint32_t hi0 = static_cast<uint32_t>(index >> 32);
  const __m512i inner = _mm512_mask_blend_epi32(
      _mm512_cmplt_epu32_mask(lo, lo0), _mm512_set1_epi32(static_cast<int>(lowbias32_scalar(hi0 ^ s.step_key))),
      _mm512_set1_epi32(static_cast<int>(lowbias32_scalar((hi0 + 1u) ^ s.step_key))));
  const __m512i r = lowbias32(_mm512_xor_si512(lo, inner));
  const __m512i low16 = _mm512_set1_epi32(0xffff);

  const __m512 grad = _mm512_loadu_ps(g), m0 = widen(m), v0 = widen(v);
  const __m512 old = widen(p);
  __m512 param = _mm512_mul_ps(old, _mm512_set1_ps(s.decay));
  const __m512 mi = _mm512_fmadd_ps(_mm512_set1_ps(s.one_minus_beta1), _mm512_sub_ps(grad, m0), m0);
  const __m512 vi = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(s.beta2), v0),
                                  _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(s.one_minus_beta2), grad), grad));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(s.bc2_sqrt)),
                                     _mm512_set1_ps(s.eps));
  param = _mm512_add_ps(param, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(s.neg_step_size), mi), denom));
  const __m256i p16 = narrow(param, _mm512_and_si512(r, low16));
  store(p, p16);
  store(m, narrow(mi, _mm512_srli_epi32(r, 16)));
  store(v, narrow(vi, _mm512_and_si512(lowbias32(r), low16)));
  if (out != nullptr) {
    const __m512 now = widen_bits(p16);
    store(out, s.extrapolate ? nearest(_mm512_add_ps(now, _mm512_sub_ps(now, old))) : p16);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;

inline __m256i lowbias32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kHash1)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kHash2)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

inline __m256 widen(const uint16_t* src) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline __m128i pack_words(__m256i words) {  // each 0..0xffff: packus keeps it
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(words, words), 0x08));
}

// x's bf16 bits: stochastic rounding (noise16 added below the mantissa, then truncated), NaN kept quiet.
inline __m128i narrow(__m256 x, __m256i noise16) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, noise16), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  return pack_words(_mm256_blendv_epi8(rounded, quiet, nan));
}

// x's bf16 bits by round-to-nearest-even (torch's float -> bfloat16), NaN kept quiet: `narrow` with the noise
// 0x7fff plus the lowest kept bit.
inline __m128i nearest(__m256 x) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), _mm256_set1_epi32(1));
  return narrow(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}

inline __m256 widen_bits(__m128i words) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
}

inline void store(uint16_t* dst, __m128i words) { _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), words); }

inline void step_lanes(uint16_t* p, const float* g, uint16_t* m, uint16_t* v, uint16_t* out, uint64_t index,
                       const Bf16StepScalars& s) {
  const __m256i lo0 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(index)));
  const __m256i lo = _mm256_add_epi32(lo0, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i carry = _mm256_cmpgt_epi32(_mm256_xor_si256(lo0, sign), _mm256_xor_si256(lo, sign));  // lo < lo0
  const uint32_t hi0 = static_cast<uint32_t>(index >> 32);  // the inner hash: two scalars, as in the AVX-512 lanes
  const __m256i inner = _mm256_blendv_epi8(_mm256_set1_epi32(static_cast<int>(lowbias32_scalar(hi0 ^ s.step_key))),
                                           _mm256_set1_epi32(static_cast<int>(lowbias32_scalar((hi0 + 1u) ^ s.step_key))),
                                           carry);
  const __m256i r = lowbias32(_mm256_xor_si256(lo, inner));
  const __m256i low16 = _mm256_set1_epi32(0xffff);

  const __m256 grad = _mm256_loadu_ps(g), m0 = widen(m), v0 = widen(v);
  const __m256 old = widen(p);
  __m256 param = _mm256_mul_ps(old, _mm256_set1_ps(s.decay));
  const __m256 mi = _mm256_fmadd_ps(_mm256_set1_ps(s.one_minus_beta1), _mm256_sub_ps(grad, m0), m0);
  const __m256 vi = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(s.beta2), v0),
                                  _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(s.one_minus_beta2), grad), grad));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(s.bc2_sqrt)),
                                     _mm256_set1_ps(s.eps));
  param = _mm256_add_ps(param, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(s.neg_step_size), mi), denom));
  const __m128i p16 = narrow(param, _mm256_and_si256(r, low16));
  store(p, p16);
  store(m, narrow(mi, _mm256_srli_epi32(r, 16)));
  store(v, narrow(vi, _mm256_and_si256(lowbias32(r), low16)));
  if (out != nullptr) {
    const __m256 now = widen_bits(p16);
    store(out, s.extrapolate ? nearest(_mm256_add_ps(now, _mm256_sub_ps(now, old))) : p16);
  }
}
#else
constexpr int64_t kLanes = 1;

inline uint32_t lowbias32(uint32_t x) { return lowbias32_scalar(x); }

inline float widen(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline uint16_t narrow(float x, uint32_t noise16) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + noise16) >> 16);
}

inline uint16_t nearest(float x) {  // round-to-nearest-even (torch's float -> bfloat16): `narrow`, as above
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return narrow(x, 0x7fffu + ((bits >> 16) & 1u));
}

inline void step_lanes(uint16_t* p, const float* g, uint16_t* m, uint16_t* v, uint16_t* out, uint64_t index,
                       const Bf16StepScalars& s) {
  const uint32_t r = lowbias32(static_cast<uint32_t>(index) ^ lowbias32(static_cast<uint32_t>(index >> 32) ^ s.step_key));
  const float grad = g[0], m0 = widen(m[0]), v0 = widen(v[0]);
  const float old = widen(p[0]);
  float param = old * s.decay;
  const float mi = std::fma(s.one_minus_beta1, grad - m0, m0);
  const float vi = s.beta2 * v0 + (s.one_minus_beta2 * grad) * grad;
  const float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
  param = param + (s.neg_step_size * mi) / denom;
  p[0] = narrow(param, r & 0xffffu);
  m[0] = narrow(mi, r >> 16);
  v[0] = narrow(vi, lowbias32(r) & 0xffffu);
  if (out != nullptr) {
    const float now = widen(p[0]);
    out[0] = s.extrapolate ? nearest(now + (now - old)) : p[0];
  }
}
#endif

void step_range(uint16_t* p, const float* g, uint16_t* m, uint16_t* v, uint16_t* out, int64_t begin, int64_t end,
                const Bf16StepScalars& s) {
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes)
    step_lanes(p + i, g + i, m + i, v + i, out == nullptr ? nullptr : out + i, static_cast<uint64_t>(s.offset + i), s);
  if (i < end) {  // the last few, padded into a full vector: the same lanes as every other element
    uint16_t pp[kLanes] = {}, mm[kLanes] = {}, vv[kLanes] = {}, oo[kLanes] = {};
    float gg[kLanes] = {};
    const int64_t n = end - i;
    std::memcpy(pp, p + i, sizeof(uint16_t) * n);
    std::memcpy(mm, m + i, sizeof(uint16_t) * n);
    std::memcpy(vv, v + i, sizeof(uint16_t) * n);
    std::memcpy(gg, g + i, sizeof(float) * n);
    step_lanes(pp, gg, mm, vv, out == nullptr ? nullptr : oo, static_cast<uint64_t>(s.offset + i), s);
    std::memcpy(p + i, pp, sizeof(uint16_t) * n);
    std::memcpy(m + i, mm, sizeof(uint16_t) * n);
    std::memcpy(v + i, vv, sizeof(uint16_t) * n);
    if (out != nullptr) std::memcpy(out + i, oo, sizeof(uint16_t) * n);
  }
}


}  // namespace

uint32_t rounding_step_key(int64_t seed, int64_t step) {
  const uint64_t useed = static_cast<uint64_t>(seed);
  return lowbias32_scalar(static_cast<uint32_t>(useed) ^
                          lowbias32_scalar(static_cast<uint32_t>(step) ^ lowbias32_scalar(static_cast<uint32_t>(useed >> 32))));
}

void adamw_bf16_states(uint16_t* p, const float* g, uint16_t* m, uint16_t* v, uint16_t* out, int64_t n,
                       const Bf16StepScalars& s, const float* scales, int n_scales) {
  constexpr int64_t kBlock = 1 << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(dynamic, 1) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(n, (b + 1) * kBlock);
    if (n_scales == 0) {
      step_range(p, g, m, v, out, begin, end, s);
      continue;
    }
    // the multiplied gradient a tile at a time (scale_into); each tile is stepped at its own offset, so the
    // rounding bits and the padded last vector are those of the whole range's
    float scaled[kScaledTile];
    Bf16StepScalars at = s;
    for (int64_t t = begin; t < end; t += kScaledTile) {
      const int64_t len = std::min(end - t, kScaledTile);
      scale_into(scaled, g + t, len, scales, n_scales);
      at.offset = s.offset + t;
      step_range(p + t, scaled, m + t, v + t, out == nullptr ? nullptr : out + t, 0, len, at);
    }
  }
}

}  // namespace toolkit_cpu_adam
