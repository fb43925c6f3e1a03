"""Whether this CPU multiplies bf16 matrices at speed, and a warning for a CPU run in bf16 where it does not.

torch runs CPU bf16 matmuls through oneDNN where it reports oneDNN bf16 support (CPUs with AVX-512 or AMX); on
others (AVX2 only, as this project's 2-core VM of 2026-12-06, an AMD EPYC) through its generic kernel, tens of
times slower than fp32 (benchmarks/RESULTS.md, "CPU matmuls by dtype"). A bf16 CPU run there pays
that on every matmul for no gain, so the run says so, with the slowdown measured on this CPU when it starts.
"""
from __future__ import annotations

import math
import time

import torch

SIDE = 256  # the measured matmul: SIDE x SIDE by SIDE x SIDE (a few ms even without oneDNN)
WARN_RATIO = 2.0  # bf16 slower than fp32 by more than this: say so


def describe_bf16_matmuls() -> str:
    """For `toolkit doctor`: how torch multiplies bf16 matrices on this CPU (measures nothing)."""
    answer = has_onednn_bf16()
    return {True: "oneDNN", False: "torch's generic kernel (slow: a bf16 CPU run measures and warns)",
            None: "unknown (this torch does not say)"}[answer]


def has_onednn_bf16() -> bool | None:
    """torch's own answer: does oneDNN serve bf16 matmuls on this CPU (None: this torch does not say)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


def matmul_ms(dtype: torch.dtype, side: int = SIDE, repeats: int = 3) -> float:
    """Best of `repeats` of one side x side matmul in `dtype` on the CPU, in ms (after one untimed call)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(side, side, generator=generator).to(dtype)
    b = torch.randn(side, side, generator=generator).to(dtype)
    a @ b
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def slow_bf16_warning(dtype: str, device: torch.device) -> str | None:
    """The warning for a CPU run in bf16 where torch has no oneDNN bf16 matmul, with the bf16 / fp32 time ratio
    measured now; None elsewhere (a GPU, fp32, a CPU with oneDNN bf16, or a ratio under WARN_RATIO)."""
    if dtype != "bf16" or device.type != "cpu" or has_onednn_bf16() is not False:
        return None
    ratio = matmul_ms(torch.bfloat16) / matmul_ms(torch.float32)
    if ratio < WARN_RATIO:
        return None
    return (f"warning: recipe.precision.dtype: 'bf16' on this CPU ({torch.backends.cpu.get_cpu_capability()}, "
            f"no oneDNN bf16): its bf16 matmuls take torch's generic kernel, {ratio:.0f}x the time of fp32 ones "
            f"({SIDE}x{SIDE}, measured now); precision.dtype=fp32 trains faster here")


_said = False  # this process has printed the warning (a notebook or a tune builds many engines)


def slow_bf16_warning_once(dtype: str, device: torch.device) -> str | None:
    """`slow_bf16_warning` the first time it has something to say in this process, then None (nothing measured)."""
    global _said
    if _said:
        return None
    warning = slow_bf16_warning(dtype, device)
    _said = warning is not None
    return warning
