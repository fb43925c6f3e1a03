// fused_adamw_binding.cpp: torch-facing side of fused_adamw.cu.
//
// Checks the tensor lists, packs one table of (pointers, numel) plus chunk prefix
// sums into pinned host memory, copies it to the GPU on the current stream
// (non-blocking) and launches. Python calls `adamw_step` and `grad_norm`
// through toolkit/ops/fused_adamw.py; a flat ZeRO shard is a list of one tensor.
#include <cstring>
#include <vector>

#include "torch_utils.h"

namespace {

using toolkit::AdamWTensor;
using toolkit::check_launch;
using toolkit::DType;
using toolkit::dtype_of;

bool is_float_type(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

// Tensors the kernel takes: on `like`'s device, contiguous, as many elements as the parameter.
bool takes(const at::Tensor& t, const at::Tensor& like, const at::Tensor& param) {
  return t.is_cuda() && t.device() == like.device() && t.is_contiguous() && t.numel() == param.numel();
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

// Returns false, touching nothing, when a tensor is not one the kernel takes (the caller falls back to torch).
bool adamw_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& lowps, double lr, double beta1, double beta2, double eps,
                double weight_decay, double bias_correction1, double bias_correction2_sqrt, double grad_scale,
                const c10::optional<at::Tensor>& grad_scale_dev, const c10::optional<at::Tensor>& skip,
                const c10::optional<at::Tensor>& nonfinite) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "adamw_step: params, grads, exp_avgs and exp_avg_sqs must have the same length");
  TORCH_CHECK(lowps.empty() || lowps.size() == n, "adamw_step: lowps must be empty or one per parameter");
  if (n == 0) return true;
  const at::Tensor& first = params[0];
  if (!first.is_cuda() || !is_float_type(grads[0]) || (!lowps.empty() && !is_float_type(lowps[0]))) return false;
  const at::ScalarType grad_type = grads[0].scalar_type();
  const at::ScalarType lowp_type = lowps.empty() ? at::kBFloat16 : lowps[0].scalar_type();
  if (lowp_type == at::kFloat) return false;
  std::vector<AdamWTensor> entries;
  entries.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    if (p.scalar_type() != at::kFloat || !takes(p, first, p) || !takes(grads[i], first, p) ||
        !takes(exp_avgs[i], first, p) || !takes(exp_avg_sqs[i], first, p) || grads[i].scalar_type() != grad_type ||
        exp_avgs[i].scalar_type() != at::kFloat || exp_avg_sqs[i].scalar_type() != at::kFloat)
      return false;
    void* lowp = nullptr;
    if (!lowps.empty()) {
      if (!takes(lowps[i], first, p) || lowps[i].scalar_type() != lowp_type) return false;
      lowp = lowps[i].data_ptr();
    }
    if (p.numel() == 0) continue;
    entries.push_back({p.data_ptr<float>(), grads[i].data_ptr(), exp_avgs[i].data_ptr<float>(),
                       exp_avg_sqs[i].data_ptr<float>(), lowp, p.numel()});
  }
  if (entries.empty()) return true;
  const DType grad_dtype = dtype_of(grads[0], "grad");
  const DType lowp_dtype = lowps.empty() ? DType::kBFloat16 : dtype_of(lowps[0], "lowp");
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
  return true;
}

// Returns float32 [2]: the global L2 norm of grad_scale * grads and the AdamW gradient multiplier;
// an empty tensor, launching nothing, when a gradient is not one the kernel takes.
at::Tensor grad_norm(const std::vector<at::Tensor>& grads, double grad_scale, double max_norm,
                     const c10::optional<at::Tensor>& nonfinite) {
  TORCH_CHECK(!grads.empty(), "grad_norm: no gradients");
  const at::Tensor& first = grads[0];
  if (!first.is_cuda() || !is_float_type(first)) return at::Tensor();
  std::vector<AdamWTensor> entries;
  for (const at::Tensor& g : grads) {
    if (!takes(g, first, g) || g.scalar_type() != first.scalar_type()) return at::Tensor();
    if (g.numel() > 0) entries.push_back({nullptr, g.data_ptr(), nullptr, nullptr, nullptr, g.numel()});
  }
  const DType grad_dtype = dtype_of(first, "grad");
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
  m.def("adamw_step", &adamw_step, "Multi-tensor fused AdamW step (in place); False if it cannot take the tensors", py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("lowps"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("bias_correction1"),
        py::arg("bias_correction2_sqrt"), py::arg("grad_scale"), py::arg("grad_scale_dev") = py::none(),
        py::arg("skip") = py::none(), py::arg("nonfinite") = py::none());
  m.def("grad_norm", &grad_norm, "Global gradient L2 norm and the AdamW gradient multiplier", py::arg("grads"),
        py::arg("grad_scale"), py::arg("max_norm"), py::arg("nonfinite") = py::none());
}
