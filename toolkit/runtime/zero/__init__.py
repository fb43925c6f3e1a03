"""ZeRO on torch.distributed: how the model states are split across data-parallel ranks.

One strategy per recipe.zero.stage, each a `Strategy` (toolkit/runtime/strategy.py: what the engine,
checkpoints, the communication ledger and the loop may ask of it), so the engine's step reads the
same for every stage.

Files: flat.py (flat sharded layout), adamw.py (the shard's AdamW: torch's, or the
CPU Adam kernel of toolkit/ops/cpu_adam.py under offload), offload.py (the CPU step),
ddp.py (stage 0, and its one-pass step over the fused AdamW), onebit_adam.py and onebit_optimizer.py (1-bit Adam), partition.py (stages 1-2), stage3.py (stage 3), sharded.py (what 1-3
share), shard_part.py (one tier of the optimizer shard: device, CPU memory or swap file). The process group is toolkit/distributed.py; the shard checkpoint format
toolkit/checkpoint/zero_shards.py; the benchmarks benchmarks/zero_cpu.py and
benchmarks/zero_gpu.py.
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.distributed import DistInfo
from toolkit.runtime.comm import Communicator
from toolkit.runtime.precision import sixteen_bit_weights


def broadcast_parameters(model: nn.Module, comm: Communicator) -> None:
    """Every rank starts from rank 0's weights (a user's model may be initialised unseeded)."""
    if not comm.info.active:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            comm.broadcast(tensor.data, src=0)


def build_strategy(model: nn.Module, recipe, device: torch.device, info: DistInfo, zero3_units=None, *,
                   adamw: str | None, comm: Communicator):
    """The strategy for recipe.zero (stage 0-3, offload) over the process group in `info`, issuing its
    collectives through `comm` (counted: toolkit/runtime/comm.py); `zero3_units`
    names stage 3's units (toolkit/runtime/zero/stage3.py find_units); `adamw` is stage 0's optimizer,
    as the engine chose it (toolkit.runtime.optim.choose_adamw). Stages 1-3 step their shards with
    ShardedAdamW (adamw.py), which never uses the CUDA AdamW kernel."""
    stage = recipe.zero.stage
    if stage == 3 and recipe.training.compile:
        from toolkit.errors import UserError

        raise UserError("recipe.training.compile: not with zero.stage 3 yet (its hooks gather and release "
                        "parameters around each block, which torch.compile would trace through); use zero.stage 2 "
                        "or training.compile false")
    broadcast_parameters(model, comm)
    weights = sixteen_bit_weights(recipe.precision.dtype, stage)
    if weights is not None:
        model.to(weights)
    if recipe.optimizer.type == "onebit_adam":  # zero.stage 0 (toolkit/recipe/checks.py refuses the others)
        from toolkit.runtime.zero.onebit_adam import OnebitAdamStrategy

        return OnebitAdamStrategy(model, recipe, device, info, comm)
    if stage == 0:
        from toolkit.runtime.zero.ddp import DataParallel

        if adamw is None:
            raise ValueError("zero stage 0 needs the AdamW the engine chose (toolkit.runtime.optim.choose_adamw)")
        return DataParallel(model, recipe, device, info, adamw, comm)
    if stage in (1, 2):
        from toolkit.runtime.zero.partition import PartitionedStrategy

        return PartitionedStrategy(model, recipe, device, info, stage, comm)
    from toolkit.runtime.zero.stage3 import Stage3Strategy

    return Stage3Strategy(model, recipe, device, info, zero3_units, comm)
