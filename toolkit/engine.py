"""The training engine, DeepSpeed-shaped: `engine = initialize(recipe)`, then per
micro batch `loss = engine(batch)`, `engine.backward(loss)`, `engine.step()`
(the optimizer update happens at accumulation boundaries), or
`engine.train_batch(micro_batches)` for one whole optimizer step.

The engine owns the model, the optimizer, the schedule and the loss scaler.
The loop (toolkit/train.py) owns data, logging and checkpoint cadence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.errors import UserError
from toolkit.models import build_model, count_parameters
from toolkit.optim import Schedule, build_optimizer
from toolkit.precision import autocast_context, has_inf_or_nan, make_loss_scaler
from toolkit.specs import Recipe


def pick_device(choice: str) -> torch.device:
    """training.device: auto -> CUDA when present, else the CPU."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("recipe.training.device: 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def refuse_unbuilt(recipe: Recipe) -> None:
    """Settings the schema allows but this version cannot honour yet: refuse, never ignore."""
    problems = []
    if recipe.zero.stage > 0:
        problems.append(f"recipe.zero.stage: {recipe.zero.stage} needs the ZeRO engine, which this version "
                        "does not have yet; use stage 0")
    if recipe.batch.world_size > 1:
        problems.append(f"world size {recipe.batch.world_size}: multi-process training needs the ZeRO engine, "
                        "which this version does not have yet; run one process")
    for name, mode in vars(recipe.kernels).items():
        if mode == "on":
            problems.append(f"recipe.kernels.{name}: 'on' but this version has no fused kernels yet; "
                            "use 'auto' or 'off'")
    if problems:
        raise UserError(*problems)


@dataclass
class StepResult:
    """What one optimizer step did (floats are synced to the host)."""
    loss: float
    grad_norm: float
    lr: float
    loss_scale: float
    skipped: bool


class Engine:
    """Model + AdamW + schedule + mixed precision for one process."""

    def __init__(self, recipe: Recipe, model: nn.Module | None = None):
        refuse_unbuilt(recipe)
        self.recipe = recipe
        self.device = pick_device(recipe.training.device)
        if recipe.precision.dtype == "fp16" and self.device.type == "cpu":
            raise UserError("recipe.precision.dtype: 'fp16' needs a CUDA device (CPUs lack fast fp16); use 'bf16'")
        torch.manual_seed(recipe.training.seed)
        self.model = (model if model is not None else build_model(recipe.model, recipe.training.seed)).to(self.device)
        self.model.train()
        self.num_parameters = count_parameters(self.model)
        self.optimizer = build_optimizer(self.model, recipe.optimizer, self.device.type)
        self.scheduler = Schedule(self.optimizer, recipe.scheduler, recipe.optimizer.lr)
        self.loss_scaler = make_loss_scaler(recipe.precision)
        self.grad_accum_steps = recipe.batch.grad_accum_steps
        self.micro_step = 0        # micro batches since the last optimizer update
        self.global_step = 0       # optimizer steps taken (skipped fp16 steps included)
        self.skipped_steps = 0
        self._loss_sum = 0.0

    # -- DeepSpeed-style API -------------------------------------------------

    def __call__(self, batch) -> torch.Tensor:
        """Forward one micro batch; returns the mean token loss (fp32)."""
        with autocast_context(self.recipe.precision.dtype, self.device.type):
            if isinstance(batch, dict):
                batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                return self.model(**batch).loss.float()
            tokens = batch.to(self.device, non_blocking=True)
            logits = self.model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of loss / grad_accum_steps (times the loss scale in fp16)."""
        self._loss_sum += loss.detach().float()
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        (loss * (scale / self.grad_accum_steps)).backward()
        self.micro_step += 1

    def is_accumulation_boundary(self) -> bool:
        """True when the next step() call updates the weights."""
        return self.micro_step >= self.grad_accum_steps

    def step(self) -> StepResult | None:
        """Update the weights at an accumulation boundary (else do nothing and return None)."""
        if not self.is_accumulation_boundary():
            return None
        params = [p for p in self.model.parameters() if p.grad is not None]
        lr = self.current_lr  # the rate this update uses (the schedule then moves on)
        skipped = False
        scale = 1.0
        if self.loss_scaler is not None:
            scale = self.loss_scaler.scale
            skipped = self.loss_scaler.update(has_inf_or_nan(p.grad for p in params))
            if not skipped:
                torch._foreach_mul_([p.grad for p in params], 1.0 / scale)
        grad_norm = float("nan")
        if not skipped:
            clip = self.recipe.training.grad_clip
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf))
            self.optimizer.step()
            self.scheduler.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        loss = float(self._loss_sum) / self.micro_step
        self._loss_sum, self.micro_step = 0.0, 0
        self.global_step += 1
        if not math.isfinite(loss) and self.loss_scaler is None:
            raise UserError(f"training diverged at step {self.global_step}: loss is {loss}; "
                            "lower recipe.optimizer.lr or add warmup (recipe.scheduler)")
        return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, loss_scale=scale, skipped=skipped)

    def train_batch(self, micro_batches) -> StepResult:
        """One optimizer step over this rank's micro batches (grad_accum_steps of them)."""
        if len(micro_batches) != self.grad_accum_steps:
            raise ValueError(f"expected {self.grad_accum_steps} micro batches, got {len(micro_batches)}")
        for micro_batch in micro_batches:
            self.backward(self(micro_batch))
        return self.step()

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss over held-out micro batches (dropout off)."""
        self.model.eval()
        try:
            losses = [self(batch) for batch in batches]
        finally:
            self.model.train()
        return float(torch.stack(losses).mean()) if losses else float("nan")

    @property
    def current_lr(self) -> float:
        """Learning rate of the first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])

    # -- state for checkpoints -------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to continue exactly (model, optimizer, schedule, scaler, counters)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() saved; settings (betas, eps, weight decay, implementation) stay the recipe's."""
        self.model.load_state_dict(state["model"])
        # NOTE: torch's Optimizer.load_state_dict replaces each param group's settings with
        # the saved ones (fused/foreach flags included); keep the recipe's and take only the
        # per-parameter state (moments, step). The schedule writes lr just below.
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, own in zip(self.optimizer.param_groups, settings):
            group.update(own)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.global_step = int(state["global_step"])
        self.skipped_steps = int(state["skipped_steps"])


def initialize(recipe, model: nn.Module | None = None) -> Engine:
    """DeepSpeed-style entry point: a Recipe, a recipe path or a dict -> Engine."""
    from toolkit.recipe import load_recipe, recipe_from_dict

    if isinstance(recipe, dict):
        recipe = recipe_from_dict(recipe)
    elif not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    return Engine(recipe, model=model)
