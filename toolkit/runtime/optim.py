"""AdamW and the learning-rate schedule, built from `OptimizerSpec` and `SchedulerSpec`.

What lives here: the decay / no-decay parameter groups, the choice of AdamW
implementation (`adamw_implementation`, `choose_adamw`: the toolkit's fused CUDA kernel, toolkit/ops/fused_adamw.py,
when the engine's kernel choice loaded it; torch's fused or foreach AdamW otherwise), the one optimizer
factory every strategy builds with (`build_optimizer`: a new optimizer.type is one branch there), and
DeepSpeed's schedules (constant, WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) with
DeepSpeed's formulas, as pure functions `lr_at` (and `betas_at`, OneCycle's momentum) and a small
stateful `Schedule`. What does not: gradient clipping, loss
scaling and ZeRO partitioning of the optimizer state (precision.py, zero/).

How the schedule lines up with optimizer steps (DeepSpeed's behaviour as run, from
deepspeed/runtime/lr_schedules.py and engine.py `_take_model_step`): the scheduler
starts at last_batch_iteration = -1 and writes that iteration's lr into the optimizer
at construction; the engine calls `lr_scheduler.step()` after every optimizer step
that was not skipped for fp16 overflow. So optimizer step k (0-based, counting only
applied steps) runs with `lr_at(spec, base_lr, k - 1)`: step 0 uses the "before the
start" value (warmup_min_lr for WarmupLR/WarmupDecayLR, 0 for WarmupCosineLR).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.specs import KernelsSpec, OptimizerSpec, SchedulerSpec


# ---------------------------------------------------------------------------
# Parameter groups

def _is_norm(module: nn.Module) -> bool:
    # NOTE: by class name too, so transformers' own norms (LlamaRMSNorm, T5LayerNorm,
    # Qwen2RMSNorm, ...) count without importing transformers here.
    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or name.endswith(("LayerNorm", "RMSNorm"))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices decayed; biases, norm weights and any parameter with ndim < 2 not."""
    norm_params = {id(p) for m in model.modules() if _is_norm(m) for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    # named_parameters() yields a tied parameter (GPT-2's wte / lm_head) once.
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or name.endswith("bias") or id(p) in norm_params:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]



def muon_param_groups(model: nn.Module, spec: OptimizerSpec) -> list[dict]:
    """[Muon's group, AdamW's decayed group, AdamW's undecayed group] (`param_groups` less Muon's matrices).

    Muon's group carries `lr_scale` = muon_lr / lr: the Schedule writes lr x lr_scale into it, so both lrs
    follow the schedule's factor (toolkit/runtime/optim.py Schedule)."""
    from toolkit.runtime.muon import muon_group_settings, muon_param_ids

    ids = muon_param_ids(model)
    adamw = param_groups(model, spec.weight_decay)
    matrices = [p for group in adamw for p in group["params"] if id(p) in ids]
    for group in adamw:
        group["params"] = [p for p in group["params"] if id(p) not in ids]
    return [{"params": matrices, **muon_group_settings(spec)}, *adamw]


def optimizer_param_groups(model: nn.Module, spec: OptimizerSpec) -> list[dict]:
    """Whole-tensor param groups for spec.type: Muon's matrices then AdamW's two (toolkit/runtime/muon.py), or
    AdamW's two (`param_groups`)."""
    if spec.type == "muon":
        return muon_param_groups(model, spec)
    return param_groups(model, spec.weight_decay)


def adamw_param_names(model: nn.Module, spec: OptimizerSpec | None = None) -> list[str]:
    """Parameter names in the stage 0 optimizer's index order (AdamW's param_groups: decayed, then not; Muon's
    matrices first under `spec` type muon): how a stage 0 checkpoint's optimizer state is keyed."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = optimizer_param_groups(model, spec) if spec is not None else param_groups(model, 1.0)
    return [names[id(p)] for group in groups for p in group["params"]]


# ---------------------------------------------------------------------------
# The optimizer factory: every strategy builds its optimizer here (a new optimizer.type is one branch below)

def adamw_implementation(optimizer: OptimizerSpec, kernels: KernelsSpec) -> str:
    """recipe.optimizer.implementation, the one key that decides the AdamW, with the deprecated
    recipe.kernels.adamw folded in: 'off' reads as 'torch_fused' ('on' keeps its old meaning: the kernel is
    required; toolkit/recipe/checks.py warns about both)."""
    if kernels.adamw == "off" and optimizer.implementation in ("auto", "fused"):
        return "torch_fused"
    return optimizer.implementation


def adamw_kernel_applies(implementation: str, zero_stage: int, mesh: bool = False, optimizer_type: str = "adamw",
                         state_dtype: str = "fp32") -> bool:
    """Whether the run's AdamW could step with kernels/fused_adamw.cu, so the engine should resolve it (not under
    Muon, whose AdamW part is torch's, nor with bf16 or int8 optimizer states, which step their own: build_optimizer)."""
    # NOTE: only stage 0 steps whole parameters with a torch-style optimizer (FusedAdamW); stages 1-3
    # step flat shards (toolkit/runtime/zero/adamw.py: torch's fused AdamW, or the CPU Adam kernel
    # under offload), and the mesh steps DTensors' local shards with torch's, so building the CUDA
    # AdamW for them would be a minute spent on nothing.
    return (zero_stage == 0 and not mesh and implementation in ("auto", "fused") and optimizer_type != "muon"
            and state_dtype == "fp32")


def choose_adamw(implementation: str, device_type: str, fused_kernel: bool) -> str:
    """The AdamW for an implementation (`adamw_implementation`) on this device: 'toolkit-fused', 'torch-fused'
    or 'torch'; `fused_kernel` says whether the run's kernels loaded the toolkit's."""
    if implementation == "torch" or (implementation == "torch_fused" and device_type != "cuda"):
        return "torch"
    if device_type == "cuda":
        return "toolkit-fused" if fused_kernel and implementation != "torch_fused" else "torch-fused"
    if implementation == "fused":
        raise UserError("recipe.optimizer.implementation: 'fused' needs a CUDA device; use 'auto' or 'torch'")
    return "torch"


@dataclass(frozen=True)
class FlatShard:
    """What a ZeRO 1-3 rank steps: `numel` fp32 elements of master weights, on `device` (CPU under offload);
    Muon also needs the shard's `layout` (flat.ShardLayout: which slots are matrices) and the `comm` that
    gathers them."""
    numel: int
    device: torch.device
    offload: bool
    layout: object = None
    comm: object = None
    compute_device: torch.device | None = None  # Muon offloaded: its gathers and Newton-Schulz run here, not `device`


def build_optimizer(spec: OptimizerSpec, params, adamw: str = "torch", *, flat_order=(), world: int = 1,
                    shard_group=None):
    """The optimizer for `spec` (type, lr, betas, eps, weight decay) over `params`: a ZeRO rank's `FlatShard`,
    or torch-style parameter groups (`optimizer_param_groups`) of whole tensors, stepped with the AdamW
    `choose_adamw` returned (Muon: torch's Muon beside it). 1-bit Adam lays its state out in `flat_order` over `world` ranks; `shard_group` wraps torch's
    optimizer in its ZeroRedundancyOptimizer over that process group (the mesh's ZeRO-1)."""
    if isinstance(params, FlatShard) and spec.type == "muon":  # gathers each matrix's update (zero/muon.py)
        from toolkit.runtime.zero.muon import ShardedMuon

        return ShardedMuon(spec, params.numel, params.device, params.layout, params.comm,
                           compute_device=params.compute_device)
    if isinstance(params, FlatShard):  # adamw and adam (L2 decay) share the shard's step (zero/adamw.py)
        from toolkit.runtime.zero.adamw import ShardedAdamW

        return ShardedAdamW(spec, params.numel, params.device, offload=params.offload)
    if spec.type == "onebit_adam":
        from toolkit.runtime.zero.onebit_optimizer import OnebitAdam

        return OnebitAdam(params, list(flat_order), spec, world)
    if spec.type == "muon":  # torch's Muon and AdamW over muon_param_groups (toolkit/runtime/muon.py)
        from toolkit.runtime.muon import MuonAdamW

        # NOTE: the toolkit's fused kernel steps a FusedAdamW whole; Muon's AdamW part takes torch's fused one.
        return MuonAdamW(params, _whole_tensor_optimizer(spec, "torch-fused" if adamw == "toolkit-fused" else adamw)[1])
    if spec.state_dtype == "bf16":  # whole tensors (stage 0): bf16 weights and moments, stochastic rounding
        from toolkit.runtime.low_precision_adamw import BF16AdamW

        return BF16AdamW(params, spec.lr, tuple(spec.betas), spec.eps, spec.weight_decay, l2=spec.type == "adam")
    if spec.state_dtype == "int8":  # whole tensors (stage 0): fp32 weights, 8-bit blockwise moments
        from toolkit.runtime.int8_adamw import Int8AdamW

        return Int8AdamW(params, spec.lr, tuple(spec.betas), spec.eps, spec.weight_decay, l2=spec.type == "adam")
    cls, settings = _whole_tensor_optimizer(spec, adamw)
    if shard_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, cls, process_group=shard_group, **settings)
    return cls(params, **settings)


def _whole_tensor_optimizer(spec: OptimizerSpec, adamw: str) -> tuple[type, dict]:
    """(optimizer class, its settings) for whole tensors: torch Adam (L2 decay in the gradient), the toolkit's
    fused AdamW kernel, or torch's AdamW (fused, or its default: foreach where it can)."""
    settings = dict(lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay)
    fused = {"fused": True} if adamw in ("toolkit-fused", "torch-fused") else {}
    if spec.type == "adam":  # the toolkit's kernel is AdamW only
        return torch.optim.Adam, {**settings, **fused}
    if adamw == "toolkit-fused":
        from toolkit.ops.fused_adamw import FusedAdamW

        return FusedAdamW, settings
    return torch.optim.AdamW, {**settings, **fused}


# ---------------------------------------------------------------------------
# Learning-rate schedules (DeepSpeed's formulas, deepspeed/runtime/lr_schedules.py)

def _warmup_fraction(spec: SchedulerSpec, iteration: int, warmup: int) -> float:
    # DeepSpeed's _get_gamma during warmup: log climbs fast early, linear evenly.
    if spec.warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup)  # inverse_log_warm_up * log(it + 1)
    return iteration / warmup


def lr_at(spec: SchedulerSpec, base_lr: float, iteration: int) -> float:
    """The learning rate after DeepSpeed's scheduler reached last_batch_iteration = `iteration` (-1: at start)."""
    if spec.type == "constant":
        return base_lr
    warmup = max(2, spec.warmup_num_steps)  # DeepSpeed: 1 / log(warmup) needs warmup >= 2
    if spec.type in ("WarmupLR", "WarmupDecayLR"):
        # NOTE: these two go from warmup_min_lr to warmup_max_lr; base_lr is not read here (for WarmupLR
        # the recipe fills an absent warmup_max_lr with optimizer.lr, as DeepSpeed 0.19 does).
        if iteration < 0:
            return spec.warmup_min_lr
        if iteration < warmup:
            gamma = _warmup_fraction(spec, iteration, warmup)
        elif spec.type == "WarmupLR":
            gamma = 1.0
        else:  # linear decay to 0 at total_num_steps, never below
            gamma = max(0.0, (spec.total_num_steps - iteration) / max(1.0, spec.total_num_steps - warmup))
        return spec.warmup_min_lr + (spec.warmup_max_lr - spec.warmup_min_lr) * gamma
    if spec.type == "WarmupCosineLR":
        if iteration < 0:
            return 0.0
        if iteration < warmup:  # 1) warm up from warmup_min_ratio to 1
            ratio = spec.warmup_min_ratio + (1.0 - spec.warmup_min_ratio) * _warmup_fraction(spec, iteration, warmup)
            return base_lr * ratio
        # 2) cosine from 1 down to cos_min_ratio; progress counts from 1 at iteration == warmup
        progress = min(1.0, (iteration - warmup + 1) / max(1, spec.total_num_steps - warmup))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2
        # 3) held at cos_min_ratio past total_num_steps (progress clamped, as DeepSpeed master)
        return base_lr * max(0.0, spec.cos_min_ratio + (1.0 - spec.cos_min_ratio) * cosine)
    if spec.type == "LRRangeTest":  # DeepSpeed's LRRangeTest.get_lr (iteration -1: lr_range_test_min_lr)
        interval = (iteration + 1) / spec.lr_range_test_step_size
        if spec.lr_range_test_staircase:
            interval = math.floor(interval)
        return spec.lr_range_test_min_lr * (1 + spec.lr_range_test_step_rate * interval)
    if spec.type == "OneCycle":
        if iteration < _one_cycle_size(spec):
            return spec.cycle_min_lr + (spec.cycle_max_lr - spec.cycle_min_lr) * _one_cycle_scale(spec, iteration)
        if spec.decay_step_size == 0 or spec.decay_lr_rate == 0:  # DeepSpeed's skip_lr_decay
            return spec.cycle_min_lr
        decay_steps = iteration - _one_cycle_size(spec) + 1
        return spec.cycle_min_lr / (1 + spec.decay_lr_rate * decay_steps / spec.decay_step_size)
    raise ValueError(f"unknown scheduler type {spec.type!r}")  # the recipe schema validated it: a toolkit bug


def _one_cycle_size(spec: SchedulerSpec) -> int:
    return spec.cycle_first_step_size + (spec.cycle_second_step_size or spec.cycle_first_step_size)


def _one_cycle_scale(spec: SchedulerSpec, iteration: int) -> float:
    # DeepSpeed's OneCycle._get_scale_factor: 0 -> 1 over the first half, 1 -> 0 over the second.
    total = _one_cycle_size(spec)
    step_ratio = spec.cycle_first_step_size / total
    batch_iteration = iteration + 1
    x = 1.0 + batch_iteration / total - math.floor(1 + batch_iteration / total)
    return x / step_ratio if x <= step_ratio else (x - 1) / (step_ratio - 1)


def betas_at(spec: SchedulerSpec, iteration: int) -> tuple[float, float] | None:
    """OneCycle with cycle_momentum: Adam's betas after `iteration` (DeepSpeed's get_mom); None: the optimizer's."""
    if spec.type != "OneCycle" or not spec.cycle_momentum:
        return None
    # NOTE: as DeepSpeed's OneCycle: beta2 becomes 0.99 whatever optimizer.betas says, and its constructor
    # starts beta1 at cycle_min_mom although the cycle's formula gives cycle_max_mom there.
    if iteration < 0:
        return spec.cycle_min_mom, 0.99
    if iteration < _one_cycle_size(spec):
        return spec.cycle_max_mom - (spec.cycle_max_mom - spec.cycle_min_mom) * _one_cycle_scale(spec, iteration), 0.99
    if spec.decay_step_size == 0 or spec.decay_mom_rate == 0:
        return spec.cycle_max_mom, 0.99
    decay_steps = iteration - _one_cycle_size(spec) + 1
    return spec.cycle_max_mom * (1 + spec.decay_mom_rate * decay_steps / spec.decay_step_size), 0.99


class Schedule:
    """DeepSpeed-style scheduler: writes `lr_at(spec, base_lr, last_batch_iteration)` into every param group
    (times the group's `lr_scale` where it has one: Muon's matrices, whose lr follows the same factor).

    Construct it after the optimizer (it starts at iteration -1 and sets the lr the first
    optimizer step uses); call `step()` after each applied optimizer step, not after one
    skipped for fp16 overflow. `current_lr` is the lr the next optimizer step will use.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, spec: SchedulerSpec, base_lr: float):
        self.optimizer = optimizer
        self.spec = spec
        self.base_lr = base_lr  # optimizer.lr: DeepSpeed's org_lr, the peak for WarmupCosineLR
        self.last_batch_iteration = -1
        self._write_lr()

    @property
    def current_lr(self) -> float:
        """The learning rate now in the optimizer's param groups."""
        return lr_at(self.spec, self.base_lr, self.last_batch_iteration)

    def step(self) -> None:
        """Advance one applied optimizer step and write the new lr into every param group."""
        self.last_batch_iteration += 1
        self._write_lr()

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume the schedule (plain ints)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved iteration and write its lr into the optimizer."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._write_lr()

    def _write_lr(self) -> None:
        base_lr = self.current_lr
        betas = betas_at(self.spec, self.last_batch_iteration)
        for group in self.optimizer.param_groups:
            lr = base_lr * group["lr_scale"] if "lr_scale" in group else base_lr
            if betas is not None and not group.get("muon"):  # Muon's group has a momentum, no betas
                group["betas"] = betas
            # NOTE: a tensor lr (capturable / fused setups) is updated in place, as DeepSpeed's update_lr keeps its type.
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
