// torch_utils.h: helpers shared by the *_binding.cpp files (torch side only).
#pragma once

// NOTE: not <torch/extension.h>: its torch/all.h (the whole C++ frontend) was most of each binding's
// host compile (benchmarks/RESULTS.md, "CPU Adam kernel build"). The bindings need the Tensor, pybind11
// with torch's casters, and the two ATen ops they call.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launchers.h"

namespace toolkit {

inline DType dtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", t.scalar_type(), " (float32, bfloat16, float16)");
  }
  return DType::kFloat32;
}

inline at::ScalarType scalar_type_of(DType d) {
  return d == DType::kFloat32 ? at::kFloat : d == DType::kBFloat16 ? at::kBFloat16 : at::kHalf;
}

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " launch failed: ", cudaGetErrorString(err));
}

inline void check_cuda_contiguous(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), what, " must be on ", like.device());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

}  // namespace toolkit
