// fused_norm.cu: LayerNorm (GPT-2) and RMSNorm (Llama), the forward pass (the backward
// pass is fused_norm_backward.cu), over the last dimension of a [rows, cols] tensor, fp32 math.
//
// What it computes (w, b fp32 [cols]; mean, rstd fp32 [rows] saved for backward):
//   LayerNorm  mu = mean(x), rstd = 1/sqrt(mean((x - mu)^2) + eps), y = (x - mu) * rstd * w + b
//   RMSNorm    mu = 0,       rstd = 1/sqrt(mean(x^2) + eps),        y = x * rstd * w
//   backward   xhat = (x - mu) * rstd, g = dy * w
//              dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm: no mean(g) term)
//              dw = sum over rows of dy * xhat, db = sum over rows of dy
//
// How the forward pass is launched: a *row group* of W warps (W = 1 up to 1024
// columns, 2 up to 2048, at most 8) owns one row; thread t of the group holds the
// 4-element packs t, t + 32W, t + 64W, ... of the row in registers (fp32: one
// 16-byte load each, consecutive threads on consecutive packs), so x is read once
// and y written once. Row sums are warp shuffles, plus one shared-memory step when
// W > 1; with W = 1 no barrier stops a warp, so each warp's loads overlap the
// others' maths. A block holds 256 / (32 W) row groups; the grid is one wave (as many
// blocks as fit on the GPU at once) and each row group walks rows, holding w (and b) in
// registers across them where that costs at most 48 registers a thread. x and y take
// cache hints chosen per norm (below). Measured on an H200 with
// benchmarks/norm_tune.py (16384 rows, x fp32, y bf16; LayerNorm 768 / 1600 / RMSNorm 2048, GPU ms):
//   shipped                                  0.0207 / 0.0511 / 0.0507   torch.compile 0.0194 / 0.0682 / 0.0501
//   a block per 256 / (32 W) rows, no hints  0.0238 / 0.0606 / 0.0559
//   the same with the hints                  0.0201 / 0.0518 / 0.0519
// The streaming hints are per norm: RMSNorm's loads of x measured slower with them (0.0528 vs
// 0.0519 for stores alone), LayerNorm's faster.
#include "common.cuh"

namespace toolkit {
namespace {

constexpr int kVec = 4;             // elements per pack
constexpr int kBlockThreads = 256;  // threads per block
constexpr int kMaxWarps = kBlockThreads / 32;  // 8 warps x 32 threads x 8 packs x 4 = kNormMaxCols

struct NormLayout {
  int warps;  // warps per row group
  int packs;  // packs per thread (a compiled variant)
  int group() const { return 32 * warps; }
  int threads() const { return kBlockThreads; }  // a group has at most 8 warps
  int groups() const { return threads() / group(); }
};

// Packs per thread of the widest variant (TOOLKIT_NORM_PACKS: 1, 2, 4, 6, 8); benchmarks/norm_tune.py
// tries others through TOOLKIT_NORM_FWD_MAX_PACKS.
#ifndef TOOLKIT_NORM_FWD_MAX_PACKS
#define TOOLKIT_NORM_FWD_MAX_PACKS 8
#endif
constexpr int kMaxPacks = TOOLKIT_NORM_FWD_MAX_PACKS;
// Per norm (_LN, _RMS): cache hints on x and y, which are touched once, as common.cuh's hint mask
// (1 streaming loads of x, 2 streaming stores of y, 4 loads of x that skip L1).
#ifndef TOOLKIT_NORM_FWD_STREAM_LN
#define TOOLKIT_NORM_FWD_STREAM_LN 3
#define TOOLKIT_NORM_FWD_STREAM_RMS 2
#endif
// 0: a block per `groups` rows; 1: one wave of blocks, each row group walking rows; 2: the same,
// and w (and b) held in registers across rows where they take at most kAffineRegisters a thread.
#ifndef TOOLKIT_NORM_FWD_PERSISTENT
#define TOOLKIT_NORM_FWD_PERSISTENT 2
#endif
// Blocks per SM promised to __launch_bounds__ by the variants that do not hold w and b (caps
// registers; 1 leaves them to the compiler).
#ifndef TOOLKIT_NORM_FWD_MIN_BLOCKS
#define TOOLKIT_NORM_FWD_MIN_BLOCKS 3
#endif
constexpr bool kPersistent = TOOLKIT_NORM_FWD_PERSISTENT >= 1;
constexpr int kAffineRegisters = 48;
template <bool kRms, int kPacks>
struct ForwardHints {
  static constexpr int stream = kRms ? TOOLKIT_NORM_FWD_STREAM_RMS : TOOLKIT_NORM_FWD_STREAM_LN;
  static constexpr int load_x = load_hint(stream), store_y = store_hint(stream);
  static constexpr bool affine_in_registers =
      TOOLKIT_NORM_FWD_PERSISTENT >= 2 && kPacks * kVec * (kRms ? 1 : 2) <= kAffineRegisters;
  static constexpr int min_blocks = affine_in_registers ? 1 : TOOLKIT_NORM_FWD_MIN_BLOCKS;
};

// The fewest warps per row whose threads hold at most kMaxPacks packs each, then the
// smallest compiled variant that covers the row.
NormLayout norm_layout(int cols) {
  const int packs = (cols + kVec - 1) / kVec;
  NormLayout l{1, 0};
  while (l.warps < kMaxWarps && (packs + l.group() - 1) / l.group() > kMaxPacks) l.warps *= 2;
  const int need = (packs + l.group() - 1) / l.group();
  l.packs = need <= 2 ? need : need <= 4 ? 4 : need <= 6 ? 6 : 8;
  return l;
}

// The pack starting at column c (a multiple of 4): one wide access when rows are packed,
// else element by element; past the row end reads give 0 and writes are dropped.
template <int kHint, typename T>
__device__ __forceinline__ void load4(const T* __restrict__ row, int c, int cols, bool packed, float (&v)[kVec]) {
  if (packed && c < cols) {
    load_pack<T, kVec, kHint>(row + c, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = (!packed && c + j < cols) ? to_float(row[c + j]) : 0.f;
}

template <int kHint, typename T>
__device__ __forceinline__ void store4(T* __restrict__ row, int c, int cols, bool packed, const float (&v)[kVec]) {
  if (packed) {
    if (c < cols) store_pack<T, kVec, kHint>(row + c, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    if (c + j < cols) row[c + j] = from_float<T>(v[j]);
}

// Sums of (a, b) over a row group of `warps` warps; every thread gets its group's sums.
// The barrier is the row group's own (bar.sync with an id per group, 0 being __syncthreads'):
// a group waits for its warps only, not the block's other rows. scratch: one float2 per warp of
// the block, used by this call only (so one barrier, between its writes and its reads, suffices).
__device__ __forceinline__ float2 row_sum2(float a, float b, int warps, float2* scratch) {
  a = warp_sum(a);
  b = warp_sum(b);
  if (warps == 1) return make_float2(a, b);
  const int warp = threadIdx.x >> 5, first = warp / warps * warps;
  if ((threadIdx.x & 31) == 0) scratch[warp] = make_float2(a, b);
  asm volatile("bar.sync %0, %1;" ::"r"(1 + warp / warps), "r"(32 * warps) : "memory");
  float2 s = make_float2(0.f, 0.f);
  for (int w = 0; w < warps; ++w) {
    s.x += scratch[first + w].x;
    s.y += scratch[first + w].y;
  }
  return s;
}

// Row r of x normalised into y (and its mean / rstd saved) by a row group; scratch: this call's.
// wh and bh: the thread's packs of w and b held in registers (ForwardHints), else w and b are read here.
template <typename T, typename O, bool kRms, int kPacks, int kHeld>
__device__ __forceinline__ void norm_fwd_row(const T* __restrict__ x, const float* __restrict__ weight,
                                             const float* __restrict__ bias, O* __restrict__ y,
                                             float* __restrict__ mean, float* __restrict__ rstd, int64_t r, int cols,
                                             float eps, int warps, bool packed, int t, float2 (&scratch)[2][kMaxWarps],
                                             const float (&wh)[kHeld][kVec], const float (&bh)[kHeld][kVec]) {
  using Hints = ForwardHints<kRms, kPacks>;
  const int stride = 32 * warps * kVec;
  const T* xr = x + r * cols;
  float v[kPacks][kVec];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) load4<Hints::load_x>(xr, t * kVec + k * stride, cols, packed, v[k]);
  float mu = 0.f;
  if (!kRms) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kPacks; ++k)
#pragma unroll
      for (int j = 0; j < kVec; ++j) s += v[k][j];
    mu = row_sum2(s, 0.f, warps, scratch[0]).x / cols;
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float d = t * kVec + k * stride + j < cols ? v[k][j] - mu : 0.f;
      ss += d * d;
    }
  const float rs = rsqrtf(row_sum2(ss, 0.f, warps, scratch[1]).x / cols + eps);
  O* yr = y + r * cols;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int c = t * kVec + k * stride;
    float w[kVec], b[kVec];
    if (Hints::affine_in_registers) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) w[j] = wh[k % kHeld][j], b[j] = bh[k % kHeld][j];
    } else {
      load4<kCacheDefault>(weight, c, cols, packed, w);
      if (!kRms) load4<kCacheDefault>(bias, c, cols, packed, b);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[k][j] = (v[k][j] - mu) * rs * w[j] + (kRms ? 0.f : b[j]);
    store4<Hints::store_y>(yr, c, cols, packed, v[k]);
  }
  if (t == 0) {
    if (!kRms) mean[r] = mu;
    rstd[r] = rs;
  }
}

template <typename T, typename O, bool kRms, int kPacks>
__global__ void __launch_bounds__(kBlockThreads, (ForwardHints<kRms, kPacks>::min_blocks)) norm_fwd_kernel(
    const T* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias, O* __restrict__ y,
    float* __restrict__ mean, float* __restrict__ rstd, int64_t rows, int cols, float eps, int warps, bool packed) {
  // [iteration parity][row_sum2 call]: a group's warps are at most one iteration apart (the
  // barrier in row_sum2), so alternating halves keep a fast warp off the slots a slow one reads.
  __shared__ float2 scratch[2][2][kMaxWarps];
  const int group = 32 * warps, t = threadIdx.x % group, groups = blockDim.x / group;
  constexpr bool kHold = ForwardHints<kRms, kPacks>::affine_in_registers;
  constexpr int kHeld = kHold ? kPacks : 1;
  float wh[kHeld][kVec], bh[kHeld][kVec];
  if (kHold)
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      load4<kCacheDefault>(weight, t * kVec + k * group * kVec, cols, packed, wh[k]);
      if (!kRms) load4<kCacheDefault>(bias, t * kVec + k * group * kVec, cols, packed, bh[k]);
    }
  // A row group's threads share r, so they agree on the iterations (the barriers are the group's).
  int64_t r = (int64_t)blockIdx.x * groups + threadIdx.x / group;
  if (!kPersistent) {
    if (r < rows)
      norm_fwd_row<T, O, kRms, kPacks, kHeld>(x, weight, bias, y, mean, rstd, r, cols, eps, warps, packed, t,
                                              scratch[0], wh, bh);
    return;
  }
  for (int it = 0; r < rows; r += (int64_t)gridDim.x * groups, ++it)
    norm_fwd_row<T, O, kRms, kPacks, kHeld>(x, weight, bias, y, mean, rstd, r, cols, eps, warps, packed, t,
                                            scratch[it & 1], wh, bh);
}

// The body once, with NAME a compile-time pack count (norm_layout's variants).
#define TOOLKIT_NORM_CASE(N, NAME, ...) \
  case N: {                             \
    constexpr int NAME = N;             \
    __VA_ARGS__;                        \
    break;                              \
  }
#define TOOLKIT_NORM_PACKS(PACKS, NAME, ...)                                    \
  switch (PACKS) {                                                              \
    TOOLKIT_NORM_CASE(1, NAME, __VA_ARGS__) TOOLKIT_NORM_CASE(2, NAME, __VA_ARGS__) \
    TOOLKIT_NORM_CASE(4, NAME, __VA_ARGS__) TOOLKIT_NORM_CASE(6, NAME, __VA_ARGS__) \
    TOOLKIT_NORM_CASE(8, NAME, __VA_ARGS__)                                     \
    default: return cudaErrorInvalidValue;                                      \
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
  const NormLayout l = norm_layout(cols);
  const bool packed = rows_packed(x, cols, dtype_bytes(x_dtype)) && rows_packed(y, cols, dtype_bytes(y_dtype)) &&
                      is_aligned(weight, 16) && (rms || is_aligned(bias, 16));
  int64_t blocks = (rows + l.groups() - 1) / l.groups();
  if (blocks > 0x7fffffffLL && !kPersistent) return cudaErrorInvalidValue;
  TOOLKIT_DISPATCH(x_dtype, T, {
    TOOLKIT_DISPATCH(y_dtype, O, {
      TOOLKIT_NORM_PACKS(l.packs, P, {
        auto kernel = rms ? norm_fwd_kernel<T, O, true, P> : norm_fwd_kernel<T, O, false, P>;
        if (kPersistent) {
          const int64_t wave = (int64_t)sm_count() * resident_blocks(reinterpret_cast<const void*>(kernel),
                                                                     l.threads(), 0);
          blocks = blocks < wave ? blocks : wave;
        }
        kernel<<<(unsigned)blocks, l.threads(), 0, stream>>>(static_cast<const T*>(x), weight, bias,
                                                             static_cast<O*>(y), mean, rstd, rows, cols, eps,
                                                             l.warps, packed);
      });
    });
  });
  return cudaGetLastError();
}

}  // namespace toolkit
