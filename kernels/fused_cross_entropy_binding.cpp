// fused_cross_entropy_binding.cpp: torch-facing side of fused_cross_entropy.cu.
#include <vector>

#include "torch_utils.h"

namespace {

using toolkit::check_cuda_contiguous;
using toolkit::check_launch;
using toolkit::dtype_of;

void check_inputs(const at::Tensor& logits, const at::Tensor& targets, int64_t classes) {
  TORCH_CHECK(logits.dim() == 2, "cross_entropy: logits must be [tokens, vocab], got ", logits.sizes());
  TORCH_CHECK(classes > 0 && classes <= logits.size(1), "cross_entropy: classes must be in [1, ", logits.size(1),
              "], got ", classes);
  check_cuda_contiguous(logits, logits, "logits");
  check_cuda_contiguous(targets, logits, "targets");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.numel() == logits.size(0),
              "cross_entropy: targets must be int64 [", logits.size(0), "]");
}

// Returns (loss, lse), both float32 [tokens]; the classes are the first `classes` columns.
std::vector<at::Tensor> cross_entropy_fwd(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                                          int64_t classes) {
  check_inputs(logits, targets, classes);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), width = logits.size(1);
  at::Tensor loss = at::empty({rows}, logits.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({rows}, logits.options().dtype(at::kFloat));
  check_launch(toolkit::launch_cross_entropy_fwd(logits.data_ptr(), targets.data_ptr<int64_t>(), loss.data_ptr<float>(),
                                                 lse.data_ptr<float>(), rows, width, classes, ignore_index,
                                                 dtype_of(logits, "logits"), toolkit::current_stream()),
               "cross_entropy forward");
  return {loss, lse};
}

at::Tensor cross_entropy_bwd(const at::Tensor& dloss, const at::Tensor& logits, const at::Tensor& targets,
                             const at::Tensor& lse, int64_t ignore_index, int64_t classes) {
  check_inputs(logits, targets, classes);
  check_cuda_contiguous(dloss, logits, "dloss");
  check_cuda_contiguous(lse, logits, "lse");
  const int64_t rows = logits.size(0), width = logits.size(1);
  TORCH_CHECK(dloss.scalar_type() == at::kFloat && dloss.numel() == rows, "cross_entropy backward: dloss must be float32 [", rows, "]");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.numel() == rows, "cross_entropy backward: lse must be float32 [", rows, "]");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor dlogits = at::empty_like(logits);
  check_launch(toolkit::launch_cross_entropy_bwd(dloss.data_ptr<float>(), logits.data_ptr(), targets.data_ptr<int64_t>(),
                                                 lse.data_ptr<float>(), dlogits.data_ptr(), rows, width, classes,
                                                 ignore_index, dtype_of(logits, "logits"), toolkit::current_stream()),
               "cross_entropy backward");
  return dlogits;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "toolkit fused cross-entropy (kernels/fused_cross_entropy.cu)";
  m.def("cross_entropy_fwd", &cross_entropy_fwd, "-> (loss, lse) per row", py::arg("logits"), py::arg("targets"),
        py::arg("ignore_index"), py::arg("classes"));
  m.def("cross_entropy_bwd", &cross_entropy_bwd, "-> dlogits (0 past classes)", py::arg("dloss"), py::arg("logits"),
        py::arg("targets"), py::arg("lse"), py::arg("ignore_index"), py::arg("classes"));
}
