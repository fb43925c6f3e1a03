"""Page-locked CPU buffers of exactly their size.

torch's `pin_memory=True` goes through its caching host allocator, which rounds every allocation up to the next
power of two before pinning it (ATen/core/CachingHostAllocator.h: `PowerOf2Ceil(size)`). For the buffers that scale
with the model that wastes up to half: ZeRO-Infinity's 52.9 GiB bf16 parameter shard of a 28.4B model pinned 64 GiB,
and the run's host peak came out 13 GiB above its estimate (benchmarks/RESULTS.md, ZeRO-Infinity on one H200).
Buffers of LARGE bytes or more are therefore ordinary CPU memory registered with cudaHostRegister: page-locked, as
fast for copies, and exactly as big as asked. The registration ends when the last tensor on the memory is gone.
"""
from __future__ import annotations

import weakref

import torch

LARGE = 1 << 28  # 256 MiB: below it the rounding costs little and the caching allocator's reuse helps


def pinned_empty(numel: int, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements, page-locked (and exactly that big) when `pinned` and CUDA is available."""
    if not (pinned and torch.cuda.is_available()):
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < LARGE:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    import numpy

    # NOTE: numpy owns the memory and supports weak references; torch.from_numpy keeps the array alive for as long
    # as any tensor on it, and the array's finalizer ends the registration before numpy frees the memory
    owner = numpy.empty(nbytes, dtype=numpy.uint8)
    pointer = owner.ctypes.data
    try:
        cudart = torch.cuda.cudart()
        registered = int(cudart.cudaHostRegister(pointer, nbytes, 0)) == 0  # cudaHostRegisterDefault
    except (AttributeError, RuntimeError, TypeError):  # a torch without the binding
        registered = False
    if not registered:  # torch's way, rounded up, rather than no pinned memory
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    weakref.finalize(owner, cudart.cudaHostUnregister, pointer)
    return torch.from_numpy(owner).view(dtype)
