"""GPT-2's dense layers with their bias, GELU and bias gradients in cuBLASLt's GEMM epilogues (kernels/fused_dense.cpp).

transformers' Conv1D is y = x @ W + b with W [in, out]. Two autograd Functions over the `dense` extension:

- `gelu_mlp`: GPT-2's MLP, c_proj(gelu_new(c_fc(x))). The forward writes the GELU's output and its input (kept for
  the backward) from c_fc's GEMM (GELU_AUX_BIAS): no bias + GELU pass. The backward multiplies c_proj's input
  gradient by GELU's derivative with the bias + GELU kernel's backward, which also sums c_fc's bias gradient
  (cuBLASLt's DGELU_BGRAD, measured, was slower: `_gelu_backward`).
- `conv1d`: a Conv1D whose weight gradient GEMM also sums the bias gradient (BGRADB), instead of a pass over the
  output gradient of its own. c_proj in the MLP does the same.

What changes against the unfused ops: the bias is added to the fp32 accumulator before the one rounding to 16 bits
(torch's addmm under autocast does the same; the unfused bias + GELU kernel adds it to the rounded product), and
the bias gradients of BGRADB come out in the 16-bit type, as autocast's addmm gives them. Inputs are 16-bit
(autocast's dtype); the callers cast the parameters as autocast would, so their gradients come back in the
parameters' dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor

from toolkit.ops import custom_ops
from toolkit.ops.op_dispatch import compute_dtype, kernel_module

_ALIGN = 16  # bytes: cuBLASLt's 16-bit kernels want rows and pointers on 16 bytes (checked, else the caller falls back)


def usable(*tensors: Tensor) -> bool:
    """Every tensor 16-bit, on CUDA, with a last dim and start the epilogue kernels can take."""
    return all(t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and t.shape[-1] % 8 == 0
               and t.data_ptr() % _ALIGN == 0 for t in tensors)


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


class _GeluMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj, module):
        x2 = _rows(x)
        a, pre = module.gelu_dense_fwd(x2, w_fc.contiguous(), b_fc.contiguous())
        y = torch.addmm(b_proj, a, w_proj)
        ctx.save_for_backward(x2, w_fc, a, pre, w_proj)
        ctx.module, ctx.shape = module, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, w_fc, a, pre, w_proj = ctx.saved_tensors
        dy2 = _rows(dy)
        dw_proj_t, db_proj = ctx.module.wgrad_bgrad(a, dy2)
        dh, db_fc = _gelu_backward(dy2 @ w_proj.t(), pre)
        dx = dh @ w_fc.t()
        dw_fc = x2.t() @ dh
        return dx.view(ctx.shape), dw_fc, db_fc, dw_proj_t.t(), db_proj, None


def _gelu_backward(da: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    """(da * gelu'(pre), its column sums): the bias + GELU kernel's backward with a zero bias (its torch reference
    where that kernel is not loaded). NOTE: not cuBLASLt's DGELU_BGRAD epilogue on the GEMM before it: that GEMM
    took twice the plain one's time on an H100 (benchmarks/RESULTS.md, "GEMM epilogues")."""
    zero = torch.zeros(pre.shape[-1], dtype=torch.float32, device=pre.device)
    module = kernel_module("bias_gelu", da, pre)
    if module is not None:
        dh, dbias = module.bias_gelu_bwd(da.contiguous(), pre, zero)
    else:
        dh, dbias = custom_ops._bias_gelu_bwd_reference(da, pre, zero.to(compute_dtype(pre)))
    return dh, dbias.to(pre.dtype)


class _Conv1D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, module):
        x2 = _rows(x)
        y = torch.addmm(b, x2, w)
        ctx.save_for_backward(x2, w)
        ctx.module, ctx.shape = module, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dy2 = _rows(dy)
        dw_t, db = ctx.module.wgrad_bgrad(x2, dy2)
        dx = dy2 @ w.t()
        return dx.view(ctx.shape), dw_t.t(), db, None


class _Reference:
    """The dense extension's functions in torch, for the CPU tests: the custom ops' bias + GELU reference (fp32
    maths, fp64 for fp64) on a product taken in the same precision, the bias added before the rounding."""

    @staticmethod
    def gelu_dense_fwd(x, w, bias):
        acc = compute_dtype(x)
        pre = x.to(acc) @ w.to(acc) + bias.to(acc)
        return [custom_ops._bias_gelu_reference(pre, pre.new_zeros(pre.shape[-1])).to(x.dtype), pre.to(x.dtype)]

    @staticmethod
    def wgrad_bgrad(x, dy):
        acc = compute_dtype(x)
        return [(dy.to(acc).t() @ x.to(acc)).to(x.dtype), dy.to(acc).sum(0).to(dy.dtype)]


REFERENCE = _Reference()


def gelu_mlp(x: Tensor, w_fc: Tensor, b_fc: Tensor, w_proj: Tensor, b_proj: Tensor, module) -> Tensor:
    """gelu_new(x @ w_fc + b_fc) @ w_proj + b_proj, every operand in x's 16-bit dtype."""
    return _GeluMLP.apply(x, w_fc, b_fc, w_proj, b_proj, module)


def conv1d(x: Tensor, w: Tensor, b: Tensor, module) -> Tensor:
    """x @ w + b, the bias gradient summed by the weight gradient's GEMM; every operand in x's 16-bit dtype."""
    return _Conv1D.apply(x, w, b, module)
