"""Which fused kernels a run uses, known before its engine exists: the engine resolves them (toolkit/ops/loader.py
`resolve`), and `toolkit run` starts their builds first, so nvcc works while the model and the data are made."""
from __future__ import annotations

import torch

from toolkit.ops import loader
from toolkit.runtime.optim import adamw_implementation, adamw_kernel_applies
from toolkit.specs import KernelsSpec, OptimizerSpec


def kernels_of(family: str, optimizer: OptimizerSpec, kernels: KernelsSpec, zero_stage: int,
               parallel_active: bool) -> tuple[str, ...]:
    """The fused kernels a run considers: its model family's, and AdamW's only where stage 0's optimizer can
    step with it (optim.adamw_kernel_applies)."""
    use_adamw_kernel = adamw_kernel_applies(adamw_implementation(optimizer, kernels), zero_stage, parallel_active,
                                            optimizer.type, optimizer.state_dtype)
    return loader.needed_kernels(family, use_adamw_kernel)


def start_kernel_builds(names, kernels: KernelsSpec, device: torch.device) -> None:
    """On a CUDA device, build the kernels `names` (those not `off`) in the background from now on; the engine's
    kernel choice waits for them. Nothing on the CPU, where no fused kernel runs."""
    if device.type == "cuda":
        loader.build_in_background([n for n in names if getattr(kernels, n) != "off"])
