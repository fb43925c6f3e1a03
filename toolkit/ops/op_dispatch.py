"""What the custom ops share (custom_ops.py, norm_ops.py): the kernels' dtype codes, and which extension a call uses.

An op runs its CUDA kernel when the extension is loaded (toolkit/ops/loader.py) and every input is a CUDA tensor of a
dtype the kernels take, else its torch reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from toolkit.ops import loader

# Output dtypes cross the op boundary as small ints (the kernels' DType codes).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def kernel_module(extension: str, *tensors: Tensor):
    """The loaded extension when every tensor is a CUDA tensor of a dtype the kernels take, else None."""
    module = loader.loaded_extension(extension)
    if module is None:
        return None
    if all(t.is_cuda and t.dtype in DTYPE_CODES for t in tensors):
        return module
    return None


def eager_module(extension: str, *tensors: Tensor):
    """The extension for an eager call (not while torch.compile traces) on supported CUDA tensors, else None."""
    if torch.compiler.is_compiling():
        return None
    return kernel_module(extension, *tensors)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The references' arithmetic: fp64 for fp64 inputs (the gradient checks), else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
