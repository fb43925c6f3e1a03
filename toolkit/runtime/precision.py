"""Mixed precision: the autocast policy, which precision a device can run, the 16-bit
weights of ZeRO stages 1-3, the fp16 loss scaler and the overflow check.

`DynamicLossScaler` follows DeepSpeed's `DynamicLossScaler.update_scale`
(deepspeed/runtime/fp16/loss_scaler.py) step for step, so a recipe's `precision.fp16`
block behaves like DeepSpeed's `fp16` block. What does not live here: unscaling and
clipping the gradients (engine.py) and the optimizer step (optim.py).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch

from toolkit.errors import UserError
from toolkit.specs import LossScaleSpec, PrecisionSpec

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(dtype: str, device_type: str):
    """torch.autocast for bf16/fp16 on `device_type` ("cpu", "cuda"); a no-op context for fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"unknown precision dtype {dtype!r} (expected fp32, bf16 or fp16)")
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[dtype])


def check_precision_device(dtype: str, device: torch.device) -> None:
    """Refuse a precision the device cannot run: fp16 on the CPU (CPUs lack fast fp16 and torch's CPU autocast
    has no loss-scaled fp16 path)."""
    if dtype == "fp16" and device.type == "cpu":
        raise UserError("recipe.precision.dtype: 'fp16' needs a CUDA device and torch sees none ('auto' chose "
                        "the CPU); CPUs lack fast fp16: use 'bf16'")


def sixteen_bit_weights(dtype: str, zero_stage: int) -> torch.dtype | None:
    """The 16-bit dtype the device's weights and gradients take under ZeRO stages 1-3 with bf16/fp16; None where
    they stay as built (fp32 precision; stage 0 keeps fp32 weights under autocast, as torch AMP and DDP do)."""
    # NOTE: ZeRO's mixed precision: 16-bit weights and gradients on the device, the fp32 master
    # copy in the optimizer's shard (autocast still keeps softmax, norms and the loss in fp32).
    return AUTOCAST_DTYPES.get(dtype) if zero_stage >= 1 else None


def describe_precision(spec: PrecisionSpec, zero_stage: int, state_dtype: str = "fp32") -> str:
    """One line for the start-up table: the autocast dtype, the weights' dtype, the optimizer's moments when not fp32
    (state_dtype int8) and, under fp16, the loss scale."""
    moments = ", int8 blockwise moments (256 per fp32 scale)" if state_dtype == "int8" else ""
    if spec.dtype == "fp32":
        return "fp32" + moments
    weights = ("16-bit weights, fp32 master in the ZeRO shard" if sixteen_bit_weights(spec.dtype, zero_stage)
               else "bf16 weights (the master) and bf16 moments, stochastic rounding" if state_dtype == "bf16"
               else "fp32 weights")
    if spec.dtype == "bf16":
        return f"bf16 autocast, {weights}{moments}"
    return (f"fp16 autocast, {weights}{moments}, "
            + ("dynamic loss scale" if spec.fp16.loss_scale == 0 else "static loss scale"))


def has_inf_or_nan(grads: Iterable[torch.Tensor | None]) -> bool:
    """True when any gradient holds an inf or NaN; one fused reduction and one host sync per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        if grad is not None and grad.numel():  # an empty one (stage 3's root unit of a model all blocks) has none
            by_device.setdefault(grad.device, []).append(grad)
    for tensors in by_device.values():
        # NOTE: the max-abs (inf) norm is finite for every finite tensor, so unlike the
        # 2-norm it cannot overflow on large but legal fp16 gradients; inf and NaN propagate.
        norms = torch._foreach_norm(tensors, math.inf, dtype=torch.float32)
        if not bool(torch.stack(norms).isfinite().all()):
            return True
    return False


class DynamicLossScaler:
    """fp16 loss scale with DeepSpeed's dynamic rule (or a static scale when spec.loss_scale > 0).

    Call `update(overflow)` once per optimizer step, after the overflow check; it returns
    whether the step must be skipped.
    """

    scale_factor = 2.0

    def __init__(self, spec: LossScaleSpec):
        self.dynamic = spec.loss_scale == 0
        self.scale_window = spec.loss_scale_window
        self.min_scale = float(spec.min_loss_scale)
        self.delayed_shift = spec.hysteresis  # DeepSpeed's name for the hysteresis
        self.consecutive_hysteresis = spec.consecutive_hysteresis
        self.max_overflows_at_min_scale = spec.max_overflows_at_min_scale
        self.cur_scale = float(2 ** spec.initial_scale_power) if self.dynamic else float(spec.loss_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = spec.hysteresis
        self.overflows_at_min_scale = 0  # consecutive overflow steps with the scale at min_scale

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale."""
        return loss * self.cur_scale

    def update(self, overflow: bool) -> bool:
        """Advance the scale after a step's overflow check; True means skip this step."""
        overflow = bool(overflow)
        if not self.dynamic:
            return overflow
        self._count_overflow_at_min_scale(overflow)
        # Transcribed from DeepSpeed's DynamicLossScaler.update_scale (with
        # raise_error_at_min_scale=False: the stop rule above replaces it).
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                # NOTE: as in DeepSpeed, halving does not refill the hysteresis credit: once it is
                # spent, every overflow halves until a doubling (or consecutive_hysteresis) refills it.
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        return overflow

    def _count_overflow_at_min_scale(self, overflow: bool) -> None:
        if not overflow:
            self.overflows_at_min_scale = 0
            return
        if self.cur_scale > self.min_scale:
            return
        self.overflows_at_min_scale += 1
        if self.overflows_at_min_scale >= self.max_overflows_at_min_scale:
            raise UserError(
                f"precision.fp16: gradients overflowed {self.overflows_at_min_scale} steps in a row even at "
                f"min_loss_scale {self.min_scale:g} (max_overflows_at_min_scale); the run diverged in fp16: "
                f"use precision.dtype=bf16 or a lower optimizer.lr")

    def state_dict(self) -> dict:
        """The scaler's state as plain Python values (for checkpoints)."""
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis, "overflows_at_min_scale": self.overflows_at_min_scale}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`; the settings stay those of the recipe."""
        missing = [key for key in self.state_dict() if key not in state]
        if missing:
            raise UserError(f"loss scaler state: missing {', '.join(missing)} (corrupt or foreign checkpoint)")
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.overflows_at_min_scale = int(state["overflows_at_min_scale"])


LossScaler = DynamicLossScaler  # the one scaler class; static scaling is its `dynamic=False` mode


def make_loss_scaler(precision: PrecisionSpec) -> DynamicLossScaler | None:
    """The loss scaler a precision needs: one for fp16, None for fp32 and bf16."""
    if precision.dtype != "fp16":
        return None
    return DynamicLossScaler(precision.fp16)
