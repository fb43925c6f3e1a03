// fused_norm_binding.cpp: torch-facing side of fused_norm.cu (LayerNorm, RMSNorm).
// Python (toolkit/ops/custom_ops.py) upcasts weight / bias to fp32 and picks out_dtype.
#include <vector>

#include "torch_utils.h"

namespace {

using toolkit::check_cuda_contiguous;
using toolkit::check_launch;
using toolkit::dtype_of;

int cols_of(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1, "norm: input must have at least one dimension");
  const int64_t cols = x.size(-1);
  TORCH_CHECK(cols >= 1 && cols <= toolkit::kNormMaxCols, "norm: last dimension ", cols, " outside [1, ",
              toolkit::kNormMaxCols, "]");
  TORCH_CHECK(weight.numel() == cols && weight.scalar_type() == at::kFloat, "norm: weight must be float32 [", cols, "]");
  return static_cast<int>(cols);
}

// Returns (y, mean, rstd); mean is empty for RMSNorm. out_dtype: -1 = x's dtype, else toolkit::DType.
std::vector<at::Tensor> norm_fwd(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                 double eps, bool rms, int64_t out_dtype) {
  const int cols = cols_of(x, weight);
  check_cuda_contiguous(x, x, "x");
  check_cuda_contiguous(weight, x, "weight");
  if (!rms) {
    TORCH_CHECK(bias.has_value() && bias->numel() == cols && bias->scalar_type() == at::kFloat,
                "layer_norm: bias must be float32 [", cols, "]");
    check_cuda_contiguous(*bias, x, "bias");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const toolkit::DType x_dtype = dtype_of(x, "x");
  const toolkit::DType y_dtype = out_dtype < 0 ? x_dtype : static_cast<toolkit::DType>(out_dtype);
  const int64_t rows = x.numel() / cols;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(toolkit::scalar_type_of(y_dtype)));
  at::Tensor mean = at::empty({rms ? 0 : rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  check_launch(toolkit::launch_norm_fwd(x.data_ptr(), weight.data_ptr<float>(), rms ? nullptr : bias->data_ptr<float>(),
                                        y.data_ptr(), rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                        rows, cols, static_cast<float>(eps), x_dtype, y_dtype, rms,
                                        toolkit::current_stream()),
               rms ? "rms_norm forward" : "layer_norm forward");
  return {y, mean, rstd};
}

// Returns (dx, dweight, dbias): dx in x's dtype, dweight / dbias float32 (dbias empty for RMSNorm). dresidual: the
// gradient that reached a residual add's sum by its other path (the norm's input x is that sum), added into dx.
std::vector<at::Tensor> norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& mean, const at::Tensor& rstd, bool rms,
                                 const c10::optional<at::Tensor>& dresidual) {
  const int cols = cols_of(x, weight);
  check_cuda_contiguous(x, x, "x");
  check_cuda_contiguous(dy, x, "dy");
  check_cuda_contiguous(weight, x, "weight");
  check_cuda_contiguous(rstd, x, "rstd");
  TORCH_CHECK(dy.sizes() == x.sizes(), "norm backward: dy ", dy.sizes(), " does not match x ", x.sizes());
  const int64_t rows = x.numel() / cols;
  TORCH_CHECK(rstd.numel() == rows && (rms || mean.numel() == rows), "norm backward: saved statistics do not match x");
  if (!rms) check_cuda_contiguous(mean, x, "mean");
  if (dresidual.has_value()) {
    check_cuda_contiguous(*dresidual, x, "dresidual");
    TORCH_CHECK(dresidual->sizes() == x.sizes() && dresidual->scalar_type() == x.scalar_type(),
                "norm backward: dresidual must match x's shape and dtype");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  at::Tensor dweight = at::empty({cols}, x.options().dtype(at::kFloat));
  at::Tensor dbias = at::empty({rms ? 0 : cols}, x.options().dtype(at::kFloat));
  at::Tensor workspace = at::empty({std::max<int64_t>(toolkit::norm_bwd_workspace(rows, cols), 1)},
                                   x.options().dtype(at::kFloat));
  check_launch(toolkit::launch_norm_bwd(dy.data_ptr(), x.data_ptr(), weight.data_ptr<float>(),
                                        rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                        dresidual.has_value() ? dresidual->data_ptr() : nullptr, dx.data_ptr(),
                                        dweight.data_ptr<float>(), rms ? nullptr : dbias.data_ptr<float>(),
                                        workspace.data_ptr<float>(), rows, cols, dtype_of(dy, "dy"),
                                        dtype_of(x, "x"), rms, toolkit::current_stream()),
               rms ? "rms_norm backward" : "layer_norm backward");
  return {dx, dweight, dbias};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "toolkit fused LayerNorm / RMSNorm (kernels/fused_norm.cu)";
  m.def("norm_fwd", &norm_fwd, "LayerNorm / RMSNorm forward -> (y, mean, rstd)", py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("eps"), py::arg("rms"), py::arg("out_dtype"));
  m.def("norm_bwd", &norm_bwd, "LayerNorm / RMSNorm backward -> (dx, dweight, dbias)", py::arg("dy"), py::arg("x"),
        py::arg("weight"), py::arg("mean"), py::arg("rstd"), py::arg("rms"), py::arg("dresidual") = py::none());
}
