// fused_bias_gelu_binding.cpp: torch-facing side of fused_bias_gelu.cu.
#include <vector>

#include "torch_utils.h"

namespace {

using toolkit::check_cuda_contiguous;
using toolkit::check_launch;
using toolkit::dtype_of;

int cols_of(const at::Tensor& h, const at::Tensor& bias) {
  TORCH_CHECK(h.dim() >= 1 && h.size(-1) <= INT32_MAX, "bias_gelu: bad input shape ", h.sizes());
  const int64_t cols = h.size(-1);
  TORCH_CHECK(bias.numel() == cols && bias.scalar_type() == at::kFloat, "bias_gelu: bias must be float32 [", cols, "]");
  return static_cast<int>(cols);
}

at::Tensor bias_gelu_fwd(const at::Tensor& h, const at::Tensor& bias) {
  const int cols = cols_of(h, bias);
  check_cuda_contiguous(h, h, "h");
  check_cuda_contiguous(bias, h, "bias");
  const c10::cuda::CUDAGuard guard(h.device());
  at::Tensor y = at::empty_like(h);
  const int64_t rows = cols == 0 ? 0 : h.numel() / cols;
  check_launch(toolkit::launch_bias_gelu_fwd(h.data_ptr(), bias.data_ptr<float>(), y.data_ptr(), rows, cols,
                                             dtype_of(h, "h"), toolkit::current_stream()),
               "bias_gelu forward");
  return y;
}

// Returns (dh, dbias): dh in h's dtype, dbias float32.
std::vector<at::Tensor> bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& bias) {
  const int cols = cols_of(h, bias);
  check_cuda_contiguous(h, h, "h");
  check_cuda_contiguous(dy, h, "dy");
  check_cuda_contiguous(bias, h, "bias");
  TORCH_CHECK(dy.sizes() == h.sizes() && dy.scalar_type() == h.scalar_type(), "bias_gelu backward: dy must match h");
  const c10::cuda::CUDAGuard guard(h.device());
  const int64_t rows = cols == 0 ? 0 : h.numel() / cols;
  at::Tensor dh = at::empty_like(h);
  at::Tensor dbias = at::empty({cols}, h.options().dtype(at::kFloat));
  at::Tensor workspace = at::empty({std::max<int64_t>(toolkit::bias_gelu_bwd_workspace(rows, cols), 1)},
                                   h.options().dtype(at::kFloat));
  check_launch(toolkit::launch_bias_gelu_bwd(dy.data_ptr(), h.data_ptr(), bias.data_ptr<float>(), dh.data_ptr(),
                                             dbias.data_ptr<float>(), workspace.data_ptr<float>(), rows, cols,
                                             dtype_of(h, "h"), toolkit::current_stream()),
               "bias_gelu backward");
  return {dh, dbias};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "toolkit fused bias + GELU (kernels/fused_bias_gelu.cu)";
  m.def("bias_gelu_fwd", &bias_gelu_fwd, "gelu_tanh(h + bias)", py::arg("h"), py::arg("bias"));
  m.def("bias_gelu_bwd", &bias_gelu_bwd, "-> (dh, dbias)", py::arg("dy"), py::arg("h"), py::arg("bias"));
}
