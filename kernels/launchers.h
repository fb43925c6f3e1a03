// launchers.h: the host-side entry points of the toolkit's kernels.
//
// Plain C++ over raw pointers and a cudaStream_t, so the .cu files need no torch
// headers and each `*_binding.cpp` (which does include torch) only checks tensors
// and calls these. Every launcher returns the cudaError_t of its launch.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace toolkit {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// ---------------------------------------------------------------------------
// fused_adamw.cu

// One tensor of a multi-tensor AdamW step. The optimizer state and the master
// parameter are fp32; the gradient is `grad_dtype`; `lowp` (nullable) receives
// a `lowp_dtype` copy of the updated parameter.
struct AdamWTensor {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* lowp;
  int64_t numel;
};

struct AdamWHyper {
  float lr, beta1, beta2, eps, weight_decay;
  float bias_correction1;       // 1 - beta1^step
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float grad_scale;             // gradients are multiplied by this (1 / loss scale, times a clip coefficient)
};

// Elements one block handles; the host splits every tensor into chunks of this size.
constexpr int64_t kAdamWChunk = 4096;

// tensors / chunk_starts live in device memory; chunk_starts has num_tensors + 1
// entries (prefix sums of ceil(numel / kAdamWChunk)). grad_scale_dev (nullable)
// multiplies h.grad_scale; skip_dev (nullable): the step does nothing where
// *skip_dev != 0; nonfinite_dev (nullable) is set to 1 when a gradient is inf/NaN
// (those elements are left unchanged).
cudaError_t launch_adamw(const AdamWTensor* tensors, const int64_t* chunk_starts, int num_tensors,
                         int64_t num_chunks, DType grad_dtype, bool has_lowp, DType lowp_dtype, AdamWHyper h,
                         const float* grad_scale_dev, const int* skip_dev, int* nonfinite_dev, cudaStream_t stream);

// Global L2 norm of grad_scale * grad over the tensors (only .grad and .numel are
// read). partial holds num_chunks floats. out[0] = the norm, out[1] = the gradient
// multiplier for the AdamW step: grad_scale * min(1, max_norm / (norm + 1e-6))
// (max_norm <= 0: no clipping). nonfinite_dev (nullable) is set to 1 on inf/NaN.
cudaError_t launch_grad_norm(const AdamWTensor* tensors, const int64_t* chunk_starts, int num_tensors,
                             int64_t num_chunks, DType grad_dtype, float grad_scale, float max_norm, float* partial,
                             float* out, int* nonfinite_dev, cudaStream_t stream);

// ---------------------------------------------------------------------------
// fused_norm.cu: LayerNorm (rms = false) and RMSNorm (rms = true) over the last
// dimension of a [rows, cols] tensor; weight and bias are fp32; mean (LayerNorm
// only) and rstd are fp32 [rows], saved for the backward pass.

// Largest `cols` the norm kernels take (a row group of up to 16 warps holds a row in registers).
constexpr int kNormMaxCols = 8192;

cudaError_t launch_norm_fwd(const void* x, const float* weight, const float* bias, void* y, float* mean, float* rstd,
                            int64_t rows, int cols, float eps, DType x_dtype, DType y_dtype, bool rms,
                            cudaStream_t stream);

// Floats of workspace launch_norm_bwd needs.
int64_t norm_bwd_workspace(int64_t rows, int cols);

// dx has x's dtype; dweight / dbias are fp32 (dbias ignored when rms). dresidual (nullable, x's dtype) is added to
// dx after dx's rounding (the gradient of a residual add before the norm, as autograd sums the two).
cudaError_t launch_norm_bwd(const void* dy, const void* x, const float* weight, const float* mean, const float* rstd,
                            const void* dresidual, void* dx, float* dweight, float* dbias, float* workspace,
                            int64_t rows, int cols, DType dy_dtype, DType x_dtype, bool rms, cudaStream_t stream);

// ---------------------------------------------------------------------------
// fused_bias_gelu.cu: y = gelu_tanh(h + bias) over [rows, cols]; bias fp32 [cols].

cudaError_t launch_bias_gelu_fwd(const void* h, const float* bias, void* y, int64_t rows, int cols, DType dtype,
                                 cudaStream_t stream);

int64_t bias_gelu_bwd_workspace(int64_t rows, int cols);

// dh = dy * gelu_tanh'(h + bias) (h's dtype); dbias = column sums of dh (fp32).
cudaError_t launch_bias_gelu_bwd(const void* dy, const void* h, const float* bias, void* dh, float* dbias,
                                 float* workspace, int64_t rows, int cols, DType dtype, cudaStream_t stream);

// ---------------------------------------------------------------------------
// fused_cross_entropy.cu: per-row softmax cross-entropy over [rows, width] logits
// in their own dtype (never upcast in memory), whose first `classes` columns are the
// classes (the rest: a padded LM head's columns, ignored). Rows whose target ==
// ignore_index get loss 0 and zero gradient.

cudaError_t launch_cross_entropy_fwd(const void* logits, const int64_t* targets, float* loss, float* lse,
                                     int64_t rows, int64_t width, int64_t classes, int64_t ignore_index, DType dtype,
                                     cudaStream_t stream);

// dlogits = (softmax(logits) - onehot(target)) * dloss[row], in the logits' dtype; 0 in the
// columns past `classes`.
cudaError_t launch_cross_entropy_bwd(const float* dloss, const void* logits, const int64_t* targets, const float* lse,
                                     void* dlogits, int64_t rows, int64_t width, int64_t classes,
                                     int64_t ignore_index, DType dtype, cudaStream_t stream);

}  // namespace toolkit
