"""What the engine, the checkpoint code, the communication ledger and the training loop may ask of a
strategy: the typed `Strategy` protocol every strategy implements (data parallel and 1-bit Adam in
zero/ddp.py and zero/onebit_adam.py, ZeRO 1-3 in zero/partition.py and zero/stage3.py, the tensor/pipeline
mesh and its pipeline in parallel/strategy.py), and `StrategyBase`, the defaults most of them share.

A new strategy subclasses `StrategyBase` and fills in the rest; tests/architecture/test_strategy.py checks
that every strategy class has every member here, and that no code asks a strategy with hasattr/getattr.
The checkpoint layer (toolkit/checkpoint/engine_state.py) sits below this one: it uses these members
without importing the protocol.
"""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import torch

from toolkit.distributed import DistInfo


@runtime_checkable
class Strategy(Protocol):
    """How the model states are split and stepped over the ranks (see the module docstring for who asks what)."""

    # -- identity -------------------------------------------------------------------------
    stage: int                  # the ZeRO stage it runs (0-3)
    offload: bool               # True when part of the optimizer lives in CPU memory or swap files
    sharded_checkpoint: bool    # True: every rank writes its shard file (zero_shards.py); False: one replicated state
    info: DistInfo              # the process group it runs over
    optimizer: object           # has param_groups with "lr" (toolkit.runtime.optim.Schedule writes it)

    # -- the engine's micro step and optimizer step ---------------------------------------
    def micro_batch_loss(self, batch, loss: Callable) -> torch.Tensor:
        """engine(batch): the loss of one micro batch; `loss(batch)` is the engine's forward and loss."""

    def train_micro_batch(self, batch, loss: Callable, factor: float) -> torch.Tensor:
        """One micro batch of train_batch: the gradients of loss x `factor`; returns the loss, detached, fp32."""

    def begin_micro_step(self, boundary: bool) -> None:
        """Before backward; `boundary`: this is the accumulation's last micro step."""

    def end_micro_step(self) -> None:
        """After backward: flush gradient buckets, wait for collectives."""

    def grads_overflow(self) -> bool:
        """Any inf/NaN in any rank's gradients (every rank gets the same answer)."""

    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient by `factor` (unscaling after fp16 loss scaling)."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor | float:
        """Global L2 norm over all ranks' gradients, clipped to max_norm (<= 0: measure only)."""

    def optimizer_step(self) -> None:
        """The optimizer's update; afterwards every rank has the new weights (or gathers them lazily)."""

    def zero_grad(self) -> None:
        """Clear the accumulated gradients."""

    def complete_pending_update(self) -> None:
        """Land an optimizer update still running in the background (zero.offload_update delayed); the engine
        calls it, on every rank, before anything reads the weights or the optimizer states."""

    # -- the start-up table, the memory line, the loop's data slots ------------------------
    def describe(self) -> str:
        """One line for the start-up table: what is split over which ranks."""

    def describe_tiers(self) -> str:
        """One line for the start-up table: where parameters, gradients and optimizer states live, in bytes."""

    def memory_bytes(self) -> dict:
        """mem_params_bytes, mem_grads_bytes, mem_optim_bytes, mem_master_bytes, mem_offload_bytes held now."""

    @property
    def data_rank(self) -> int:
        """Which data-parallel replica this rank is: the slot of the data it trains on."""

    # -- the communication ledger (toolkit/observe/comm_ledger.py) --------------------------------
    def expected_bytes_per_step(self, grad_accum_steps: int) -> dict[str, int]:
        """The formula's bytes per rank per optimizer step, by collective kind ({}: the strategy has none)."""

    # -- checkpoints (toolkit/checkpoint/engine_state.py, zero_shards.py) ------------------
    def owned_pieces(self) -> list[tuple[str, int, int, dict[str, torch.Tensor]]]:
        """(name, start, stop, {param, exp_avg, exp_avg_sq}) for each parameter piece this rank saves."""

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's whole shape by name."""

    def optimizer_steps(self) -> int:
        """Optimizer steps applied so far."""

    def load_pieces(self, reader) -> None:
        """Weights and moments from any checkpoint reader (any stage, any world size)."""

    def extra_state(self) -> dict[str, torch.Tensor]:
        """This rank's state beyond the pieces, saved in a file of its own ({}: none)."""

    def load_extra_state(self, directory: Path, files: list[str]) -> None:
        """Restore what extra_state() saved: `files` holds every rank's file name, in rank order."""


def backward_scaled(loss: torch.Tensor, factor: float) -> torch.Tensor:
    """Gradients of loss x factor (1 / accumulation steps, times the fp16 loss scale); the loss, detached, fp32."""
    (loss * factor).backward()
    return loss.detach().float()


class StrategyBase:
    """The defaults of `Strategy`: no offload, a replicated checkpoint, no extra state, data slot = rank."""

    stage = 0
    offload = False
    sharded_checkpoint = False
    info: DistInfo

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel index: its rank (every rank is a data-parallel replica)."""
        return self.info.rank

    def micro_batch_loss(self, batch, loss: Callable) -> torch.Tensor:
        """The engine's forward and loss, as they are."""
        return loss(batch)

    def train_micro_batch(self, batch, loss: Callable, factor: float) -> torch.Tensor:
        """Forward, then backward of loss x factor (a pipeline runs both in its schedule instead)."""
        return backward_scaled(loss(batch), factor)

    def complete_pending_update(self) -> None:
        """Nothing runs in the background: every update is done when optimizer_step returns."""

    def extra_state(self) -> dict[str, torch.Tensor]:
        """None: the pieces hold everything."""
        return {}

    def load_extra_state(self, directory: Path, files: list[str]) -> None:
        """Nothing to restore."""


def weak_method_hook(method: Callable) -> Callable:
    """`method` as a tensor hook that does not keep its object alive. A parameter's hooks are invisible to Python's
    garbage collector, so a strategy's bound method there (strategy -> parameter -> hook -> strategy) would be a
    cycle it never frees: every engine built in the process would keep its model and model states to the end."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


def tensor_bytes(tensors) -> int:
    """Bytes of the storage behind each distinct tensor (a resized-away buffer counts 0)."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
