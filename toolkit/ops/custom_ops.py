"""torch custom ops over the fused kernels, each with its torch reference.

Every op is a `torch.library.custom_op` in the `toolkit` namespace with a fake
(meta) implementation and an autograd formula, so `torch.compile` traces through
the models that use them without graph breaks. Each op runs the CUDA kernel when
its extension is loaded (toolkit/ops/loader.py) and the input is a supported CUDA
tensor, else its torch reference: the same maths in fp32 (fp64 for fp64 inputs,
which is what the gradient checks use). The references are also what the CUDA
tests compare the kernels against.

Public entry points: `layer_norm`, `rms_norm`, `bias_gelu`, `cross_entropy`.
NOTE: in eager mode on CUDA they call the kernels through a plain autograd.Function:
a custom op's dispatch costs several times more host time per call, which an eager
GPT-2 step pays ~40 times per micro batch. While torch.compile traces, they use the
custom ops (the kernels are opaque to it, the ops are not).
What does not live here: choosing kernels (loader.py), swapping modules
(fused_modules.py), AdamW (fused_adamw.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from toolkit.ops.norm_ops import add_layer_norm, add_rms_norm, layer_norm, norm_bwd, norm_fwd, rms_norm  # noqa: F401
from toolkit.ops.op_dispatch import compute_dtype, eager_module, kernel_module

# ---------------------------------------------------------------------------
# bias + GELU (tanh approximation, GPT-2's gelu_new)

_K0 = math.sqrt(2.0 / math.pi)
_K1 = 0.044715


def _bias_gelu_reference(h, bias):
    u = h.to(compute_dtype(h)) + bias.to(compute_dtype(h))
    return (0.5 * u * (1.0 + torch.tanh(_K0 * (u + _K1 * u * u * u)))).to(h.dtype)


@torch.library.custom_op("toolkit::bias_gelu_fwd", mutates_args=())
def bias_gelu_fwd(h: Tensor, bias: Tensor) -> Tensor:
    """gelu_tanh(h + bias) over the last dim, in h's dtype (fp32 math)."""
    module = kernel_module("bias_gelu", h)
    if module is not None:
        return module.bias_gelu_fwd(h.contiguous(), bias.float().contiguous())
    return _bias_gelu_reference(h, bias)


@bias_gelu_fwd.register_fake
def _(h, bias):
    return torch.empty_like(h)


def _bias_gelu_bwd_reference(dy, h, bias):
    acc = compute_dtype(h)
    u = h.to(acc) + bias.to(acc)
    t = torch.tanh(_K0 * (u + _K1 * u * u * u))
    d = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _K0 * (1.0 + 3.0 * _K1 * u * u)
    dh = dy.to(acc) * d
    return dh.to(h.dtype), dh.reshape(-1, h.shape[-1]).sum(0)


@torch.library.custom_op("toolkit::bias_gelu_bwd", mutates_args=())
def bias_gelu_bwd(dy: Tensor, h: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """Backward of bias_gelu_fwd -> (dh in h's dtype, dbias fp32)."""
    module = kernel_module("bias_gelu", h)
    if module is not None:
        dh, dbias = module.bias_gelu_bwd(dy.to(h.dtype).contiguous(), h.contiguous(), bias.float().contiguous())
        return dh, dbias
    return _bias_gelu_bwd_reference(dy, h, bias)


@bias_gelu_bwd.register_fake
def _(dy, h, bias):
    stat = torch.float64 if h.dtype == torch.float64 else torch.float32
    return torch.empty_like(h), h.new_empty((h.shape[-1],), dtype=stat)


def _bias_gelu_setup(ctx, inputs, output):
    h, bias = inputs
    ctx.save_for_backward(h, bias)


def _bias_gelu_backward(ctx, dy):
    h, bias = ctx.saved_tensors
    dh, dbias = bias_gelu_bwd(dy, h, bias)
    return dh, dbias.to(bias.dtype)


bias_gelu_fwd.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)


class _BiasGeluFunction(torch.autograd.Function):
    """Eager path of bias_gelu_fwd / bias_gelu_bwd."""

    @staticmethod
    def forward(ctx, h, bias, module):
        ctx.save_for_backward(h, bias)
        ctx.module = module
        return module.bias_gelu_fwd(h.contiguous(), bias.float().contiguous())

    @staticmethod
    def backward(ctx, dy):
        h, bias = ctx.saved_tensors
        dh, dbias = ctx.module.bias_gelu_bwd(dy.to(h.dtype).contiguous(), h.contiguous(), bias.float().contiguous())
        return dh, dbias.to(bias.dtype), None


def bias_gelu(h: Tensor, bias: Tensor) -> Tensor:
    """gelu_new(h + bias), fused: one read of h, one write of the output."""
    module = eager_module("bias_gelu", h)
    if module is not None:
        return _BiasGeluFunction.apply(h, bias, module)
    return bias_gelu_fwd(h, bias)


# ---------------------------------------------------------------------------
# Cross-entropy over the vocabulary (logits stay in their own dtype)

def _cross_entropy_fwd_reference(logits, targets, ignore_index, classes):
    x = logits[:, :classes].to(compute_dtype(logits))
    lse = torch.logsumexp(x, dim=-1)
    keep = targets != ignore_index
    picked = x.gather(1, torch.where(keep, targets, 0).unsqueeze(1)).squeeze(1)
    return torch.where(keep, lse - picked, 0.0), lse


@torch.library.custom_op("toolkit::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd(logits: Tensor, targets: Tensor, ignore_index: int, classes: int) -> tuple[Tensor, Tensor]:
    """Per-row softmax cross-entropy over the first `classes` columns of [tokens, width] logits ->
    (loss, logsumexp), fp32 [tokens]."""
    module = kernel_module("cross_entropy", logits)
    if module is not None:
        return tuple(module.cross_entropy_fwd(logits.contiguous(), targets.contiguous(), ignore_index, classes))
    return _cross_entropy_fwd_reference(logits, targets, ignore_index, classes)


@cross_entropy_fwd.register_fake
def _(logits, targets, ignore_index, classes):
    stat = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = logits.shape[0]
    return logits.new_empty((rows,), dtype=stat), logits.new_empty((rows,), dtype=stat)


def _cross_entropy_bwd_reference(dloss, logits, targets, lse, ignore_index, classes):
    acc = compute_dtype(logits)
    keep = targets != ignore_index
    probs = torch.exp(logits[:, :classes].to(acc) - lse.to(acc).unsqueeze(1))
    onehot = torch.zeros_like(probs).scatter_(1, torch.where(keep, targets, 0).unsqueeze(1), 1.0)
    scale = torch.where(keep, dloss.to(acc), 0.0).unsqueeze(1)
    return F.pad((probs - onehot) * scale, (0, logits.shape[1] - classes)).to(logits.dtype)


@torch.library.custom_op("toolkit::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd(dloss: Tensor, logits: Tensor, targets: Tensor, lse: Tensor, ignore_index: int,
                      classes: int) -> Tensor:
    """Backward of cross_entropy_fwd -> dlogits in the logits' dtype (0 in the columns past `classes`)."""
    module = kernel_module("cross_entropy", logits)
    if module is not None:
        return module.cross_entropy_bwd(dloss.float().contiguous(), logits.contiguous(), targets.contiguous(),
                                        lse.float().contiguous(), ignore_index, classes)
    return _cross_entropy_bwd_reference(dloss, logits, targets, lse, ignore_index, classes)


@cross_entropy_bwd.register_fake
def _(dloss, logits, targets, lse, ignore_index, classes):
    return torch.empty_like(logits)


def _cross_entropy_setup(ctx, inputs, output):
    logits, targets, ignore_index, classes = inputs
    _, lse = output
    ctx.save_for_backward(logits, targets, lse)
    ctx.ignore_index, ctx.classes = ignore_index, classes


def _cross_entropy_backward(ctx, dloss, _dlse):
    logits, targets, lse = ctx.saved_tensors
    return cross_entropy_bwd(dloss, logits, targets, lse, ctx.ignore_index, ctx.classes), None, None, None


cross_entropy_fwd.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)


class _CrossEntropyFunction(torch.autograd.Function):
    """Eager path of cross_entropy_fwd / cross_entropy_bwd: per-row losses."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, classes, module):
        targets = targets.contiguous()
        loss, lse = module.cross_entropy_fwd(logits.contiguous(), targets, ignore_index, classes)
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index, ctx.classes, ctx.module = ignore_index, classes, module
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, targets, lse = ctx.saved_tensors
        return ctx.module.cross_entropy_bwd(dloss.float().contiguous(), logits.contiguous(), targets, lse,
                                            ctx.ignore_index, ctx.classes), None, None, None, None


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100, classes: int | None = None) -> Tensor:
    """Mean token cross-entropy (fp32) over rows whose target is not ignore_index, like F.cross_entropy,
    without an fp32 copy of the logits. `classes`: the classes are the first `classes` columns (the
    others: a padded LM head's; they get no probability and zero gradient); default all."""
    width = logits.shape[-1]
    classes = width if classes is None else classes
    if not 0 < classes <= width:
        raise ValueError(f"cross_entropy: classes must be in [1, {width}], got {classes}")
    logits, targets = logits.reshape(-1, width), targets.reshape(-1)
    module = eager_module("cross_entropy", logits)
    if module is not None:
        losses = _CrossEntropyFunction.apply(logits, targets, ignore_index, classes, module)
    else:
        losses, _ = cross_entropy_fwd(logits, targets, ignore_index, classes)
    count = (targets != ignore_index).sum().clamp(min=1)
    return losses.sum() / count
