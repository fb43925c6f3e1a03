// fused_adamw_binding.cpp: torch-facing side of fused_adamw.cu.
//
// Checks the tensor lists, packs one table of (pointers, numel) plus chunk prefix
// sums into pinned host memory, copies it to the GPU on the current stream
// (non-blocking) and launches. Python calls `adamw_step` and `grad_norm`
// through toolkit/fused_adamw.py; a flat ZeRO shard is a list of one tensor.
#include <cstring>
#include <vector>

#include "torch_utils.h"

namespace {

using toolkit::AdamWTensor;
using toolkit::check_launch;
using toolkit::DType;
using toolkit::dtype_of;

void check_tensor(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), what, " must be on ", like.device());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
  TORCH_CHECK(t.numel() == like.numel(), what, " has ", t.numel(), " elements, the parameter ", like.numel());
}

// The table (tensors, then num_tensors + 1 chunk prefix sums) in device memory.
struct Table {
  at::Tensor device_bytes;
  int64_t num_chunks = 0;
  int num_tensors = 0;
  const AdamWTensor* tensors() const { return reinterpret_cast<const AdamWTensor*>(device_bytes.data_ptr()); }
  const int64_t* chunk_starts() const {
    return reinterpret_cast<const int64_t*>(static_cast<const char*>(device_bytes.data_ptr()) +
                                            num_tensors * sizeof(AdamWTensor));
  }
};

Table upload(const std::vector<AdamWTensor>& entries, const at::Device& device) {
  static_assert(sizeof(AdamWTensor) % sizeof(int64_t) == 0, "chunk_starts must stay 8-byte aligned");
  Table table;
  table.num_tensors = static_cast<int>(entries.size());
  const size_t bytes = entries.size() * sizeof(AdamWTensor) + (entries.size() + 1) * sizeof(int64_t);
  at::Tensor host = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  char* base = static_cast<char*>(host.data_ptr());
  std::memcpy(base, entries.data(), entries.size() * sizeof(AdamWTensor));
  int64_t* starts = reinterpret_cast<int64_t*>(base + entries.size() * sizeof(AdamWTensor));
  starts[0] = 0;
  for (size_t i = 0; i < entries.size(); ++i)
    starts[i + 1] = starts[i] + (entries[i].numel + toolkit::kAdamWChunk - 1) / toolkit::kAdamWChunk;
  table.num_chunks = starts[entries.size()];
  // NOTE: torch records the copy on the current stream, so the pinned block is not reused before it lands.
  table.device_bytes = host.to(at::TensorOptions().device(device), /*non_blocking=*/true);
  return table;
}

const float* optional_float(const c10::optional<at::Tensor>& t, const at::Tensor& like, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_cuda() && t->device() == like.device() && t->scalar_type() == at::kFloat && t->numel() >= 1,
              what, " must be a float32 tensor on ", like.device());
  return t->data_ptr<float>();
}

int* optional_flag(const c10::optional<at::Tensor>& t, const at::Tensor& like, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_cuda() && t->device() == like.device() && t->scalar_type() == at::kInt && t->numel() >= 1,
              what, " must be an int32 tensor on ", like.device());
  return t->data_ptr<int>();
}

void adamw_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& lowps, double lr, double beta1, double beta2, double eps,
                double weight_decay, double bias_correction1, double bias_correction2_sqrt, double grad_scale,
                const c10::optional<at::Tensor>& grad_scale_dev, const c10::optional<at::Tensor>& skip,
                const c10::optional<at::Tensor>& nonfinite) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "adamw_step: params, grads, exp_avgs and exp_avg_sqs must have the same length");
  TORCH_CHECK(lowps.empty() || lowps.size() == n, "adamw_step: lowps must be empty or one per parameter");
  if (n == 0) return;
  const at::Tensor& first = params[0];
  const DType grad_dtype = dtype_of(grads[0], "grad");
  const DType lowp_dtype = lowps.empty() ? DType::kFloat32 : dtype_of(lowps[0], "lowp");
  TORCH_CHECK(lowps.empty() || lowp_dtype != DType::kFloat32, "adamw_step: the low-precision copy must be bf16 or fp16");
  std::vector<AdamWTensor> entries;
  entries.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.scalar_type() == at::kFloat, "adamw_step: parameters must be float32 (master weights)");
    check_tensor(p, first, "param");
    check_tensor(grads[i], p, "grad");
    check_tensor(exp_avgs[i], p, "exp_avg");
    check_tensor(exp_avg_sqs[i], p, "exp_avg_sq");
    TORCH_CHECK(exp_avgs[i].scalar_type() == at::kFloat && exp_avg_sqs[i].scalar_type() == at::kFloat,
                "adamw_step: optimizer state must be float32");
    TORCH_CHECK(dtype_of(grads[i], "grad") == grad_dtype, "adamw_step: every gradient in one call must share a dtype");
    void* lowp = nullptr;
    if (!lowps.empty()) {
      check_tensor(lowps[i], p, "lowp");
      TORCH_CHECK(dtype_of(lowps[i], "lowp") == lowp_dtype, "adamw_step: every lowp copy in one call must share a dtype");
      lowp = lowps[i].data_ptr();
    }
    if (p.numel() == 0) continue;
    entries.push_back({p.data_ptr<float>(), grads[i].data_ptr(), exp_avgs[i].data_ptr<float>(),
                       exp_avg_sqs[i].data_ptr<float>(), lowp, p.numel()});
  }
  if (entries.empty()) return;
  const c10::cuda::CUDAGuard guard(first.device());
  const Table table = upload(entries, first.device());
  toolkit::AdamWHyper h{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                        static_cast<float>(eps), static_cast<float>(weight_decay), static_cast<float>(bias_correction1),
                        static_cast<float>(bias_correction2_sqrt), static_cast<float>(grad_scale)};
  check_launch(toolkit::launch_adamw(table.tensors(), table.chunk_starts(), table.num_tensors, table.num_chunks,
                                     grad_dtype, !lowps.empty(), lowp_dtype, h,
                                     optional_float(grad_scale_dev, first, "grad_scale_dev"),
                                     optional_flag(skip, first, "skip"), optional_flag(nonfinite, first, "nonfinite"),
                                     toolkit::current_stream()),
               "adamw");
}

// Returns float32 [2]: the global L2 norm of grad_scale * grads and the AdamW gradient multiplier.
at::Tensor grad_norm(const std::vector<at::Tensor>& grads, double grad_scale, double max_norm,
                     const c10::optional<at::Tensor>& nonfinite) {
  TORCH_CHECK(!grads.empty(), "grad_norm: no gradients");
  const at::Tensor& first = grads[0];
  const DType grad_dtype = dtype_of(first, "grad");
  std::vector<AdamWTensor> entries;
  for (const at::Tensor& g : grads) {
    TORCH_CHECK(g.is_cuda() && g.device() == first.device() && g.is_contiguous(), "grad_norm: gradients must be contiguous on ", first.device());
    TORCH_CHECK(dtype_of(g, "grad") == grad_dtype, "grad_norm: every gradient in one call must share a dtype");
    if (g.numel() > 0) entries.push_back({nullptr, g.data_ptr(), nullptr, nullptr, nullptr, g.numel()});
  }
  const c10::cuda::CUDAGuard guard(first.device());
  at::Tensor out = at::empty({2}, first.options().dtype(at::kFloat));
  Table table;
  if (!entries.empty()) table = upload(entries, first.device());
  at::Tensor partial = at::empty({std::max<int64_t>(table.num_chunks, 1)}, first.options().dtype(at::kFloat));
  check_launch(toolkit::launch_grad_norm(entries.empty() ? nullptr : table.tensors(),
                                         entries.empty() ? nullptr : table.chunk_starts(), table.num_tensors,
                                         table.num_chunks, grad_dtype, static_cast<float>(grad_scale),
                                         static_cast<float>(max_norm), partial.data_ptr<float>(), out.data_ptr<float>(),
                                         optional_flag(nonfinite, first, "nonfinite"), toolkit::current_stream()),
               "grad_norm");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "toolkit fused AdamW (kernels/fused_adamw.cu)";
  m.def("adamw_step", &adamw_step, "Multi-tensor fused AdamW step (in place)", py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("lowps"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("bias_correction1"),
        py::arg("bias_correction2_sqrt"), py::arg("grad_scale"), py::arg("grad_scale_dev") = py::none(),
        py::arg("skip") = py::none(), py::arg("nonfinite") = py::none());
  m.def("grad_norm", &grad_norm, "Global gradient L2 norm and the AdamW gradient multiplier", py::arg("grads"),
        py::arg("grad_scale"), py::arg("max_norm"), py::arg("nonfinite") = py::none());
}
