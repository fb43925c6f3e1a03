"""LayerNorm and RMSNorm as torch custom ops over kernels/fused_norm*.cu, each with its torch reference, and the
residual add before a norm fused into the norm's backward (add_layer_norm, add_rms_norm).

As in custom_ops.py (which re-exports the entry points): each op is a `torch.library.custom_op` with a fake
implementation and an autograd formula, so torch.compile traces through it; eager calls on CUDA go through a plain
autograd.Function (a custom op's dispatch costs several times more host time per call).

The fused residual add: a transformer block computes s = x + r (the attention's output and the residual stream),
then norm(s) for the MLP, and later s + mlp(...). The forward is torch's add and the norm kernel; the backward is
one kernel that adds the gradient that reached s by its other path into the norm's dx, instead of the norm's
backward and then autograd's add (H100: 1.38-1.47x the pair's kernel time at the recipes' shapes,
benchmarks/RESULTS.md). It sums after dx's own rounding, as autograd sums, so results are the unfused ops' bit for
bit. A forward kernel that also added was measured too, and was slower than torch's add and the norm at GPT-2
124M's width (0.72x): it is not used.
"""
from __future__ import annotations

import torch
from torch import Tensor

from toolkit.ops.op_dispatch import CODE_DTYPES, DTYPE_CODES, compute_dtype, eager_module, kernel_module

NORM_MAX_COLS = 8192  # kernels/launchers.h kNormMaxCols


def _fits(x: Tensor) -> bool:
    return 0 < x.shape[-1] <= NORM_MAX_COLS


def _one_dtype(*dtypes: torch.dtype) -> bool:
    """The backward's residual variant takes one dtype throughout (dy, the sum and its other gradient: a block's 16-bit
    stream under autocast, or fp32 throughout); elsewhere the two gradients are added in torch, and a block whose
    attention output and stream differ in dtype (stage 0 under autocast) takes the two ops."""
    return len(set(dtypes)) == 1


def _norm_fwd_reference(x, weight, bias, eps, rms, out_dtype):
    acc = compute_dtype(x)
    xf = x.to(acc)
    if rms:
        mean = xf.new_empty((0,))
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        y = xf * rstd.unsqueeze(-1) * weight.to(acc)
    else:
        var, mean = torch.var_mean(xf, dim=-1, unbiased=False)
        rstd = torch.rsqrt(var + eps)
        y = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1) * weight.to(acc) + bias.to(acc)
        mean = mean.reshape(-1)
    return y.to(out_dtype), mean, rstd.reshape(-1)


def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.custom_op("toolkit::norm_fwd", mutates_args=())
def norm_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool,
             out_code: int) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm (rms=False) or RMSNorm over the last dim -> (y, mean [rows] or empty, rstd [rows])."""
    out_dtype = CODE_DTYPES.get(out_code, x.dtype)
    module = kernel_module("norm", x)
    if module is not None and _fits(x):
        y, mean, rstd = module.norm_fwd(x.contiguous(), weight.float().contiguous(),
                                        None if rms else bias.float().contiguous(), eps, rms, DTYPE_CODES[out_dtype])
        return y, mean, rstd
    return _norm_fwd_reference(x, weight, bias, eps, rms, out_dtype)


def _norm_fwd_fake(x, rms, out_code):
    rows = x.numel() // x.shape[-1]
    out_dtype = CODE_DTYPES.get(out_code, x.dtype)
    stat = _stat_dtype(x)
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty((0 if rms else rows,), dtype=stat),
            x.new_empty((rows,), dtype=stat))


@norm_fwd.register_fake
def _(x, weight, bias, eps, rms, out_code):
    return _norm_fwd_fake(x, rms, out_code)


def _norm_bwd_reference(dy, x, weight, mean, rstd, rms, dresidual=None):
    acc = compute_dtype(x)
    cols = x.shape[-1]
    xf, g = x.to(acc).reshape(-1, cols), dy.to(acc).reshape(-1, cols)
    r = rstd.to(acc).unsqueeze(-1)
    xhat = xf * r if rms else (xf - mean.to(acc).unsqueeze(-1)) * r
    gw = g * weight.to(acc)
    dx = gw - xhat * (gw * xhat).mean(-1, keepdim=True)
    if not rms:
        dx = dx - gw.mean(-1, keepdim=True)
    dx = (dx * r).reshape(x.shape).to(x.dtype)
    if dresidual is not None:  # after dx's rounding, as autograd sums the two paths
        dx = dx + dresidual
    dweight = (g * xhat).sum(0)
    dbias = g.new_empty((0,)) if rms else g.sum(0)
    return dx, dweight, dbias


def _kernel_backward(module, dy, x, weight, mean, rstd, rms, dresidual):
    """The kernel's (dx, dweight, dbias); `dresidual` added into dx by the kernel's residual variant where dy, x and
    it share a dtype, else by torch after it (the same sum, after dx's rounding)."""
    fused = dresidual is not None and _one_dtype(dy.dtype, x.dtype, dresidual.dtype)
    dx, dweight, dbias = module.norm_bwd(dy.contiguous(), x.contiguous(), weight.float().contiguous(), mean, rstd, rms,
                                         dresidual.contiguous() if fused else None)
    return (dx if fused or dresidual is None else dx + dresidual), dweight, dbias


@torch.library.custom_op("toolkit::norm_bwd", mutates_args=())
def norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, rms: bool,
             dresidual: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of norm_fwd -> (dx in x's dtype, dweight fp32, dbias fp32 or empty); `dresidual` (x's dtype) is
    added into dx: the gradient of add_norm_fwd's sum by its other path."""
    module = kernel_module("norm", x, dy)
    if module is not None and _fits(x):
        return _kernel_backward(module, dy, x, weight, mean, rstd, rms, dresidual)
    return _norm_bwd_reference(dy, x, weight, mean, rstd, rms, dresidual)


@norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, rms, dresidual=None):
    cols = x.shape[-1]
    stat = _stat_dtype(x)
    return x.new_empty(x.shape), x.new_empty((cols,), dtype=stat), x.new_empty((0 if rms else cols,), dtype=stat)


def _norm_setup(ctx, inputs, output):
    x, weight, bias, eps, rms, out_code = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.rms = rms
    ctx.bias_dtype = None if bias is None else bias.dtype


def _norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = norm_bwd(dy, x, weight, mean, rstd, ctx.rms)
    dbias = None if ctx.bias_dtype is None else dbias.to(ctx.bias_dtype)
    return dx, dweight.to(weight.dtype), dbias, None, None, None


norm_fwd.register_autograd(_norm_backward, setup_context=_norm_setup)


@torch.library.custom_op("toolkit::add_norm_fwd", mutates_args=())
def add_norm_fwd(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool,
                 out_code: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """s = x + residual (torch's add), then norm_fwd of s -> (s, y, mean, rstd); one op so that its backward is one
    kernel (norm_bwd with the sum's other gradient)."""
    s = x + residual
    return (s, *norm_fwd(s, weight, bias, eps, rms, out_code))


@add_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, rms, out_code):
    return (torch.empty_like(x), *_norm_fwd_fake(x, rms, out_code))


def _add_norm_setup(ctx, inputs, output):
    x, residual, weight, bias, eps, rms, out_code = inputs
    s, _, mean, rstd = output
    ctx.save_for_backward(s, weight, mean, rstd)
    ctx.rms = rms
    ctx.bias_dtype = None if bias is None else bias.dtype


def _add_norm_backward(ctx, ds, dy, _dmean, _drstd):
    s, weight, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = norm_bwd(dy, s, weight, mean, rstd, ctx.rms, ds)
    dbias = None if ctx.bias_dtype is None else dbias.to(ctx.bias_dtype)
    return dx, dx, dweight.to(weight.dtype), dbias, None, None, None


add_norm_fwd.register_autograd(_add_norm_backward, setup_context=_add_norm_setup)


class _NormFunction(torch.autograd.Function):
    """Eager path of norm_fwd / norm_bwd (and, given a residual, add_norm_fwd): the same kernels, no custom-op
    dispatch. Returns y, or (s, y) with a residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms, out_code, module):
        s = x if residual is None else x + residual
        y, mean, rstd = module.norm_fwd(s.contiguous(), weight.float().contiguous(),
                                        None if rms else bias.float().contiguous(), eps, rms, out_code)
        ctx.save_for_backward(s, weight, mean, rstd)
        ctx.rms, ctx.module, ctx.bias_dtype = rms, module, None if bias is None else bias.dtype
        ctx.residual = residual is not None
        return (s, y) if ctx.residual else y

    @staticmethod
    def backward(ctx, *grads):
        ds, dy = grads if ctx.residual else (None, grads[0])
        s, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = _kernel_backward(ctx.module, dy, s, weight, mean, rstd, ctx.rms, ds)
        dbias = None if ctx.bias_dtype is None else dbias.to(ctx.bias_dtype)
        return dx, dx if ctx.residual else None, dweight.to(weight.dtype), dbias, None, None, None, None


def _norm(x, weight, bias, eps, rms, out_dtype):
    code = DTYPE_CODES.get(out_dtype, -1)
    module = eager_module("norm", x)
    if module is not None and _fits(x):
        return _NormFunction.apply(x, None, weight, bias, eps, rms, code, module)
    return norm_fwd(x, weight, bias, eps, rms, code)[0]


def _add_norm(x, residual, weight, bias, eps, rms, out_dtype) -> tuple[Tensor, Tensor]:
    if x.shape != residual.shape or not _one_dtype(x.dtype, residual.dtype):
        s = x + residual  # e.g. a bf16 branch onto an fp32 stream (stage 0 under autocast): the two ops
        return s, _norm(s, weight, bias, eps, rms, out_dtype)
    code = DTYPE_CODES.get(out_dtype, -1)
    module = eager_module("norm", x, residual)
    if module is not None and _fits(x):
        return _NormFunction.apply(x, residual, weight, bias, eps, rms, code, module)
    s, y, _, _ = add_norm_fwd(x, residual, weight, bias, eps, rms, code)
    return s, y


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """LayerNorm over the last dim in fp32; the output in out_dtype (default: x's dtype)."""
    return _norm(x, weight, bias, eps, False, out_dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """RMSNorm (x * rsqrt(mean(x^2) + eps) * weight) in fp32; the output in out_dtype (default: x's dtype)."""
    return _norm(x, weight, None, eps, True, out_dtype)


def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float,
                   out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(s, layer_norm(s)) for s = x + residual; where both share a dtype one op, whose backward is one kernel (else
    the two ops)."""
    return _add_norm(x, residual, weight, bias, eps, False, out_dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(s, rms_norm(s)) for s = x + residual; where both share a dtype one op, whose backward is one kernel (else
    the two ops)."""
    return _add_norm(x, residual, weight, None, eps, True, out_dtype)
