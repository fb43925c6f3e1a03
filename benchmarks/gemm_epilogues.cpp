// gemm_epilogues.cpp (benchmarks/gemm_epilogues.py): GPT-2's dense layers with their bias, GELU and bias
// gradient in cuBLASLt's GEMM epilogues (host code only: the maths is cuBLASLt's). The shapes follow transformers'
// Conv1D, whose weight is [in, out] row-major: y = x @ W + b. cuBLASLt is column-major, so a row-major [r, c]
// buffer is read as c x r.
//
//   gelu_dense_fwd(x [M, K], w [K, N], b [N])  -> (gelu(x @ w + b), x @ w + b)   GELU_AUX_BIAS
//   wgrad_bgrad(x [M, K], dy [M, N])           -> ((x^T @ dy)^T as [N, K], dy's column sums)  BGRADB
//
// GELU is cuBLASLt's, the tanh approximation (GPT-2's gelu_new); the bias and its gradient are in the inputs'
// 16-bit type, as autocast's addmm has them. The layouts (NN, and NT with the gradient as B) are the ones
// Transformer Engine runs these epilogues with. Not here: DGELU_BGRAD on the backward's GEMM, which took twice
// the plain GEMM's time on an H100 (benchmarks/RESULTS.md, "GEMM epilogues").
#include <cublasLt.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "torch_utils.h"

namespace {

using toolkit::current_stream;

constexpr size_t kWorkspaceBytes = 32u << 20;  // cuBLAS's recommendation for Hopper
constexpr int kCandidates = 8;  // the heuristic's algorithms timed once per GEMM shape
constexpr int kTimedRuns = 3;

void check_lt(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "cuBLASLt ", what, " failed with status ", static_cast<int>(status));
}

cublasLtHandle_t handle_for(int device) {
  static std::mutex mutex;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = handles.find(device);
  if (found != handles.end()) return found->second;
  cublasLtHandle_t handle = nullptr;
  check_lt(cublasLtCreate(&handle), "create");
  handles[device] = handle;
  return handle;
}

cudaDataType_t cuda_type(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: TORCH_CHECK(false, what, ": bfloat16 or float16 expected, got ", t.scalar_type());
  }
  return CUDA_R_16BF;
}

// D (m x n, column-major, ld m) = op(A) op(B) with one epilogue. bias: the bias, or where the bias gradient goes;
// aux: GELU's input (written by GELU_AUX_BIAS), ld m.
struct Gemm {
  cublasOperation_t transa, transb;
  int64_t m, n, k, lda, ldb;
  const void* a;
  const void* b;
  void* d;
  cublasLtEpilogue_t epilogue;
  void* bias;
  void* aux;
};

// The heuristic's first choice per shape, epilogue and operand alignment, asked once (its host cost is tens of
// microseconds). A ZeRO stage's 16-bit weights are views into a flat buffer, so they need not start on 256 bytes.
using AlgoKey = std::tuple<int, int, int, int64_t, int64_t, int64_t, int, uint32_t>;

uint32_t alignment(const void* p) {  // the largest power of two up to 256 dividing the address
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t bytes = 256;
  while (bytes > 1 && address % bytes != 0) bytes /= 2;
  return bytes;
}

void run(const Gemm& g, cudaDataType_t type, const at::Tensor& like) {
  const int device = like.get_device();
  cublasLtHandle_t handle = handle_for(device);
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  check_lt(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  check_lt(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &g.transa, sizeof(g.transa)), "transa");
  check_lt(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &g.transb, sizeof(g.transb)), "transb");
  check_lt(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &g.epilogue, sizeof(g.epilogue)),
           "epilogue");
  check_lt(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)), "bias");
  if (g.aux != nullptr) {
    const int64_t aux_ld = g.m;
    check_lt(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)),
             "aux pointer");
    check_lt(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)),
             "aux ld");
  }
  const bool ta = g.transa == CUBLAS_OP_T, tb = g.transb == CUBLAS_OP_T;
  check_lt(cublasLtMatrixLayoutCreate(&a, type, ta ? g.k : g.m, ta ? g.m : g.k, g.lda), "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&b, type, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb), "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&d, type, g.m, g.n, g.m), "layout D");

  static std::mutex mutex;
  static std::map<AlgoKey, cublasLtMatmulAlgo_t> algos;
  const uint32_t align_a = alignment(g.a), align_b = alignment(g.b), align_d = alignment(g.d);
  const uint32_t aligns = align_a | align_b << 9 | align_d << 18 | std::min(alignment(g.bias), 16u) << 27;
  const AlgoKey key{device, static_cast<int>(type), static_cast<int>(g.transa) * 2 + static_cast<int>(g.transb),
                    g.m, g.n, g.k, static_cast<int>(g.epilogue), aligns};
  at::Tensor workspace = at::empty({static_cast<int64_t>(kWorkspaceBytes)}, like.options().dtype(at::kByte));
  const float one = 1.0f, zero = 0.0f;
  const cudaStream_t stream = current_stream();
  auto matmul = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(handle, op, &one, g.a, a, g.b, b, &zero, g.d, d, g.d, d, &algo, workspace.data_ptr(),
                          kWorkspaceBytes, stream);
  };
  cublasLtMatmulAlgo_t algo;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = algos.find(key);
    if (found != algos.end()) {
      algo = found->second;
    } else {
      check_lt(cublasLtMatmulPreferenceCreate(&preference), "preference");
      check_lt(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &kWorkspaceBytes, sizeof(kWorkspaceBytes)), "workspace size");
      const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> minimums[] = {
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
      for (const auto& [attribute, bytes] : minimums) {
        check_lt(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &bytes, sizeof(bytes)), "alignment");
      }
      cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
      int returned = 0;
      check_lt(cublasLtMatmulAlgoGetHeuristic(handle, op, a, b, d, d, preference, kCandidates, results, &returned),
               "heuristic");
      cublasLtMatmulPreferenceDestroy(preference);
      TORCH_CHECK(returned > 0, "cuBLASLt has no algorithm for this GEMM and epilogue (m ", g.m, ", n ", g.n,
                  ", k ", g.k, ", epilogue ", static_cast<int>(g.epilogue), ")");
      algo = results[0].algo;
      // NOTE: the heuristic's first choice ran these epilogues 0.82-0.96x the unfused ops on an H100
      // (benchmarks/RESULTS.md): time each candidate on the call's own operands, once per key. Running the GEMM
      // again changes nothing (beta 0; the aux it writes is the same each time). Not while a CUDA graph
      // captures the stream.
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      cudaStreamIsCapturing(stream, &capturing);
      if (returned > 1 && capturing == cudaStreamCaptureStatusNone) {
        cudaEvent_t start, end;
        cudaEventCreate(&start);
        cudaEventCreate(&end);
        float best = -1.0f;
        for (int i = 0; i < returned; ++i) {
          if (matmul(results[i].algo) != CUBLAS_STATUS_SUCCESS) continue;  // the warm-up; a failing one is skipped
          cudaEventRecord(start, stream);
          for (int r = 0; r < kTimedRuns; ++r) matmul(results[i].algo);
          cudaEventRecord(end, stream);
          cudaEventSynchronize(end);
          float ms = 0.0f;
          cudaEventElapsedTime(&ms, start, end);
          if (best < 0.0f || ms < best) best = ms, algo = results[i].algo;
        }
        cudaEventDestroy(start);
        cudaEventDestroy(end);
      }
      algos[key] = algo;
    }
  }
  const cublasStatus_t status = matmul(algo);
  cublasLtMatrixLayoutDestroy(d);
  cublasLtMatrixLayoutDestroy(b);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatmulDescDestroy(op);
  check_lt(status, "matmul");
}

void check_matrix(const at::Tensor& t, const at::Tensor& like, const char* what) {
  toolkit::check_cuda_contiguous(t, like, what);
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == like.scalar_type(), what, " must be a 2-d ", like.scalar_type(),
              " matrix, got ", t.sizes(), " ", t.scalar_type());
}

std::vector<at::Tensor> gelu_dense_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const cudaDataType_t type = cuda_type(x, "gelu_dense x");
  check_matrix(x, x, "x");
  check_matrix(w, x, "w");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(1);
  TORCH_CHECK(w.size(0) == k && bias.numel() == n && bias.scalar_type() == x.scalar_type(),
              "gelu_dense: w must be [", k, ", N] and bias [N] of x's dtype");
  TORCH_CHECK(n % 8 == 0, "gelu_dense: N must be a multiple of 8 (cuBLASLt's aux leading dimension)");
  toolkit::check_cuda_contiguous(bias, x, "bias");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor pre = at::empty({rows, n}, x.options());
  // out^T (n x rows) = w^T (n x k, w's buffer as is) times x^T (k x rows, x's buffer as is)
  run({CUBLAS_OP_N, CUBLAS_OP_N, n, rows, k, n, k, w.data_ptr(), x.data_ptr(), out.data_ptr(),
       CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias.data_ptr(), pre.data_ptr()}, type, x);
  return {out, pre};
}

std::vector<at::Tensor> wgrad_bgrad(const at::Tensor& x, const at::Tensor& dy) {
  const cudaDataType_t type = cuda_type(x, "wgrad_bgrad x");
  check_matrix(x, x, "x");
  check_matrix(dy, x, "dy");
  const int64_t rows = x.size(0), k = x.size(1), n = dy.size(1);
  TORCH_CHECK(dy.size(0) == rows, "wgrad_bgrad: x and dy must have the same rows");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dw_t = at::empty({n, k}, x.options());  // (x^T dy)^T: Conv1D's weight gradient, transposed
  at::Tensor dbias = at::empty({n}, x.options());
  // dw_t read column-major is k x n = x^T (x's buffer: k x rows) times dy (dy's buffer rows... : n x rows, transposed)
  run({CUBLAS_OP_N, CUBLAS_OP_T, k, n, rows, k, n, x.data_ptr(), dy.data_ptr(), dw_t.data_ptr(),
       CUBLASLT_EPILOGUE_BGRADB, dbias.data_ptr(), nullptr}, type, x);
  return {dw_t, dbias};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "GPT-2 dense layers with cuBLASLt epilogues (benchmarks/gemm_epilogues.cpp)";
  m.def("gelu_dense_fwd", &gelu_dense_fwd, "-> (gelu_tanh(x @ w + bias), x @ w + bias)", py::arg("x"), py::arg("w"),
        py::arg("bias"));
  m.def("wgrad_bgrad", &wgrad_bgrad, "-> ((x^T @ dy)^T, column sums of dy)", py::arg("x"), py::arg("dy"));
}
