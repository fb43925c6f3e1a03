"""ZeRO on torch.distributed: how the model states are split across data-parallel ranks.

One strategy per recipe.zero.stage, each a `Strategy` (toolkit/runtime/strategy.py: what the engine,
checkpoints, the communication ledger and the loop may ask of it), so the engine's step reads the
same for every stage.

Files: flat.py (flat sharded layout), adamw.py (the shard's AdamW: torch's, or the
CPU Adam kernel of toolkit/ops/cpu_adam.py under offload), offload.py (the CPU step, in pieces),
overlapped_update.py and delayed_update.py (zero.offload_update: that step started during backward, or run
behind the next step; their thread: step_thread.py), swap.py and swapped_moments.py (swap files),
param_offload.py (where stage 3's parameter shard lives), ddp.py (stage 0, and its one-pass step over the fused
AdamW), onebit_adam.py and onebit_optimizer.py (1-bit Adam), partition.py (stages 1-2), stage3.py (stage 3),
sharded.py (what 1-3 share), shard_part.py (one tier of the optimizer shard: device, CPU memory or swap file),
muon.py (Muon over a shard: sharded momentum, each matrix's update all-gathered for its Newton-Schulz iteration).
The process group is toolkit/distributed.py; the shard checkpoint format toolkit/checkpoint/zero_shards.py; the
benchmarks benchmarks/zero_cpu.py and benchmarks/zero_gpu.py.
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.distributed import DistInfo
from toolkit.runtime.communicator import Communicator
from toolkit.runtime.precision import sixteen_bit_weights
from toolkit.specs import OptimizerSpec, ZeroSpec


def broadcast_parameters(model: nn.Module, comm: Communicator) -> None:
    """Every rank starts from rank 0's weights (a user's model may be initialised unseeded)."""
    if not comm.info.active:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            comm.broadcast(tensor.data, src=0)


def build_strategy(model: nn.Module, zero: ZeroSpec, optimizer: OptimizerSpec, dtype: str, device: torch.device,
                   info: DistInfo, *, adamw: str | None, comm: Communicator, zero3_units=None,
                   grad_accum_steps: int = 1, grad_clip: float = 0.0):
    """The strategy for `zero` (stage 0-3, offload) stepping `optimizer` in precision `dtype` over the process
    group in `info`, issuing its collectives through `comm` (counted: toolkit/runtime/communicator.py); `zero3_units`
    names stage 3's units (toolkit/runtime/zero/stage3.py find_units); `adamw` is stage 0's optimizer,
    as the engine chose it (toolkit.runtime.optim.choose_adamw). Stages 1-3 step their shards with
    ShardedAdamW (adamw.py), which never uses the CUDA AdamW kernel; `grad_accum_steps` counts their swap reads;
    `grad_clip` (training.grad_clip) tells an overlapped offload step that a clip coefficient will come (speculation.py)."""
    stage = zero.stage
    broadcast_parameters(model, comm)
    weights = sixteen_bit_weights(dtype, stage)
    if stage == 0 and optimizer.state_dtype == "bf16":  # NOTE: the bf16 weights are the master (low_precision_adamw.py)
        weights = torch.bfloat16
    if weights is not None:
        model.to(weights)
    if optimizer.type == "onebit_adam":  # zero.stage 0 (toolkit/recipe/checks.py refuses the others)
        from toolkit.runtime.zero.onebit_adam import OnebitAdamStrategy

        return OnebitAdamStrategy(model, zero, optimizer, device, info, comm)
    if stage == 0:
        from toolkit.runtime.zero.ddp import DataParallel

        if adamw is None:
            raise ValueError("zero stage 0 needs the AdamW the engine chose (toolkit.runtime.optim.choose_adamw)")
        return DataParallel(model, zero, optimizer, device, info, adamw, comm)
    if stage in (1, 2):
        from toolkit.runtime.zero.partition import PartitionedStrategy

        return PartitionedStrategy(model, zero, optimizer, device, info, stage, comm, grad_accum_steps, grad_clip)
    from toolkit.runtime.zero.stage3 import Stage3Strategy

    return Stage3Strategy(model, zero, optimizer, device, info, zero3_units, comm, grad_accum_steps, grad_clip)
