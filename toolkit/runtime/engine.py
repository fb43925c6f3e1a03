"""The training engine, DeepSpeed-shaped: `engine = initialize(recipe)`, then per
micro batch `loss = engine(batch)`, `engine.backward(loss)`, `engine.step()`
(the optimizer update happens at accumulation boundaries), or
`engine.train_batch(micro_batches)` for one whole optimizer step;
`engine.save_checkpoint(dir)` / `engine.load_checkpoint(dir)` (toolkit/checkpoint/engine_state.py).
`initialize(recipe, model=m)` trains any nn.Module: what a batch is and what the model's
forward may return (a loss, an output with .loss, or logits) is toolkit/models/forward.py.

The engine owns the model, the ZeRO strategy (toolkit/runtime/zero/: how gradients,
optimizer states and parameters are split across ranks, and the AdamW that
steps them), the schedule and the loss scaler; it joins the process group
torchrun describes (one process needs none). The loop (toolkit/train/loop.py) owns
data, logging and checkpoint cadence.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.ops import custom_ops, loader
from toolkit.checkpoint.engine_state import engine_state, load_engine_state
from toolkit.errors import UserError
from toolkit.ops.fused_modules import pad_lm_head, swap_fused_modules
from toolkit.models.forward import IGNORE_INDEX, call_model, check_labels, read_output
from toolkit.models.build import build_model, count_parameters
from toolkit.runtime.optim import (Schedule, adamw_implementation, adamw_param_names,
                                   choose_adamw)
from toolkit.runtime.cpu_threads import apply_threads, choose_threads
from toolkit.runtime.cpu_matmul import slow_bf16_warning_once
from toolkit.runtime.kernel_choice import kernels_of
from toolkit.runtime.precision import autocast_context, check_precision_device, make_loss_scaler
from toolkit.runtime.step_result import StepResult
from toolkit.specs import Recipe
from toolkit.runtime.strategy import backward_scaled
from toolkit.runtime.zero import build_strategy
from toolkit.runtime.communicator import Communicator
from toolkit.distributed import init_distributed, select_cuda_device


def pick_device(choice: str) -> torch.device:
    """training.device: auto -> CUDA when present, else the CPU."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("recipe.training.device: 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def check_device(recipe: Recipe) -> torch.device:
    """The device a recipe trains on, refusing what it cannot run there; `toolkit run` calls it before writing."""
    device = pick_device(recipe.training.device)
    # NOTE: training.device 'cpu' with fp16 never gets here: the recipe's checks refuse it; 'auto' may.
    check_precision_device(recipe.precision.dtype, device)
    return device


def kernels_of_recipe(recipe: Recipe) -> tuple[str, ...]:
    """The fused kernels a run of `recipe` considers (runtime/kernel_choice.py), from its specs."""
    return kernels_of(recipe.model.family, recipe.optimizer, recipe.kernels, recipe.zero.stage, recipe.parallel.active)


class Engine:
    """Model + ZeRO strategy (AdamW inside) + schedule + mixed precision for this rank."""

    def __init__(self, recipe: Recipe, model: nn.Module | None = None, zero3_units=None):
        self.recipe = recipe
        self._join(recipe, own_model=model is None)
        self._place_model(recipe, model)
        self._choose_kernels(recipe)
        adamw = self._choose_adamw(recipe)
        self._swap_fused_modules(recipe)
        self._pad_head(recipe)
        self._build_strategy(recipe, adamw, model_given=model is not None, zero3_units=zero3_units)
        self._init_step_state(recipe)

    # -- set-up, in order ------------------------------------------------------------

    def _join(self, recipe: Recipe, own_model: bool) -> None:
        """The device, the process group, torch's CPU threads and the seed."""
        select_cuda_device(recipe.training.device)  # cuda:LOCAL_RANK under torchrun
        self.device = check_device(recipe)
        self.dist = init_distributed(recipe.world_size, self.device)  # dp x tensor x pipeline processes
        if own_model or recipe.training.cpu_threads != "auto":
            # training.cpu_threads, as `toolkit run` applies it; "auto" sizes by the recipe's model, so a
            # model of the user's own keeps torch's setting unless the recipe names a count.
            apply_threads(choose_threads(recipe.training.cpu_threads, recipe.model,
                                         recipe.batch.micro_batch_per_rank * recipe.data.seq_len))
        warning = slow_bf16_warning_once(recipe.precision.dtype, self.device) if self.dist.is_main else None
        if warning:  # measured with the run's threads, before anything else runs
            print(warning, file=sys.stderr, flush=True)
        torch.manual_seed(recipe.training.seed)

    def _place_model(self, recipe: Recipe, model: nn.Module | None) -> None:
        """The user's model, or the recipe's (seeded), on the device and in training mode."""
        if model is None:
            model = build_model(recipe.model, recipe.training.seed, self.device)
        self.model = model.to(self.device)
        self._model_name = type(model).__name__
        self.model.train()
        self.num_parameters = count_parameters(self.model)

    def _choose_kernels(self, recipe: Recipe) -> None:
        """recipe.kernels -> fused kernel or torch, per kernel (builds on first use; `on` that fails is an error)."""
        self.kernels = loader.resolve(recipe.kernels, self.device.type, kernels_of_recipe(recipe))

    def _choose_adamw(self, recipe: Recipe) -> str | None:
        """The AdamW of stage 0 and the mesh, from optimizer.implementation and the kernels just chosen
        (toolkit.runtime.optim.choose_adamw); None at stages 1-3, which step their shards."""
        if recipe.zero.stage == 0 or recipe.parallel.active:
            implementation = adamw_implementation(recipe.optimizer, recipe.kernels)
            return choose_adamw(implementation, self.device.type, self.kernels.active("adamw"))
        return None

    def _swap_fused_modules(self, recipe: Recipe) -> None:
        """Fused norm and bias-GELU modules where their kernels are active."""
        # NOTE: not under recipe.parallel: the tensor-parallel plans name transformers' own modules.
        swap_fused_modules(self.model, {name: True for name in ("layernorm", "rmsnorm", "bias_gelu")
                                        if self.kernels.active(name) and not recipe.parallel.active})

    def _pad_head(self, recipe: Recipe) -> None:
        """The LM head padded to aligned GEMM shapes on a GPU (the loss skips the extra columns); on the CPU
        they would only be extra work."""
        self._padded_head = (pad_lm_head(self.model) if self.device.type == "cuda" and not recipe.parallel.active
                             else None)

    def _build_strategy(self, recipe: Recipe, adamw: str | None, model_given: bool, zero3_units) -> None:
        """self.comm, then the strategy (toolkit/runtime/strategy.py) for recipe.zero or recipe.parallel."""
        # Every collective the engine issues goes through self.comm, which counts it (toolkit/runtime/communicator.py).
        self.comm = Communicator(self.dist, self.device, overlap_comm=recipe.zero.overlap_comm,
                                 simulated_link_gbps=recipe.communication.simulated_link_gbps)
        if recipe.parallel.active:  # tensor/pipeline parallelism over a device mesh: toolkit/runtime/parallel/
            if model_given:
                raise UserError("recipe.parallel: tensor/pipeline parallelism splits the gpt2 and llama models the "
                                "recipe builds, not a model passed to initialize(); set parallel.tensor and "
                                "parallel.pipeline to 1")
            from toolkit.runtime.parallel.build import build_parallel

            self.strategy = build_parallel(self.model, recipe.parallel, recipe.model.family, recipe.zero.stage,
                                           recipe.optimizer, recipe.precision.dtype, self.device, self.dist, adamw)
        else:
            self.strategy = self._data_parallel_strategy(recipe, zero3_units, adamw)
        self.comm.ledger.discard_open_step()  # the start-up broadcast is no step's traffic
        self.optimizer = self.strategy.optimizer  # torch AdamW (stage 0) or the shard's AdamW

    def _data_parallel_strategy(self, recipe: Recipe, zero3_units, adamw: str | None):
        """ZeRO stage 0-3 over every rank (toolkit/runtime/zero/)."""
        if zero3_units is not None and recipe.zero.stage != 3:
            print(f"warning: zero3_units: ignored with zero.stage {recipe.zero.stage} (only stage 3 gathers "
                  "parameters by unit)", file=sys.stderr, flush=True)
        if recipe.zero.stage == 3 and recipe.training.compile:
            raise UserError("recipe.training.compile: not with zero.stage 3 yet (its hooks gather and release "
                            "parameters around each block, which torch.compile would trace through); use zero.stage 2 "
                            "or training.compile false")
        return build_strategy(self.model, recipe.zero, recipe.optimizer, recipe.precision.dtype, self.device,
                              self.dist, adamw=adamw, comm=self.comm, zero3_units=zero3_units,
                              grad_accum_steps=recipe.batch.grad_accum_steps, grad_clip=recipe.training.grad_clip)

    def _init_step_state(self, recipe: Recipe) -> None:
        """torch.compile, the schedule, the loss scaler and the step counters."""
        if recipe.training.compile:
            self.model.compile()  # in place: parameter names (checkpoints) unchanged
        self.scheduler = Schedule(self.optimizer, recipe.scheduler, recipe.optimizer.lr)
        self.loss_scaler = make_loss_scaler(recipe.precision)
        self.grad_accum_steps = recipe.batch.grad_accum_steps
        self.micro_step = 0        # micro batches since the last optimizer update
        self.global_step = 0       # optimizer steps taken (skipped fp16 steps included)
        self.skipped_steps = 0
        self._loss_sum = 0.0
        # The first step whose loss was not finite (0: none yet), kept on the device so that a step
        # does not wait for the GPU; check_finite() reads it. fp16 runs skip such steps instead.
        self._first_nonfinite_step = torch.zeros((), dtype=torch.int64, device=self.device)

    # -- DeepSpeed-style API -------------------------------------------------

    def __call__(self, batch) -> torch.Tensor:
        """Forward one micro batch; returns the loss (fp32, 0-dim). What a batch is and what the model may
        return (a loss, an output with .loss, or logits the engine scores): toolkit/models/forward.py."""
        return self.strategy.micro_batch_loss(batch, self._loss)

    def _loss(self, batch) -> torch.Tensor:
        """The model's forward on one micro batch, and its loss (the strategy's default micro step runs it)."""
        # Token ids: logits padded past the vocabulary (the loss below skips those columns). Not for a dict
        # batch: a Hugging Face model given labels computes its own loss over all the columns it gets.
        head = self._padded_head if isinstance(batch, torch.Tensor) else None
        if head is not None:
            head.padded = True
        try:
            with autocast_context(self.recipe.precision.dtype, self.device.type):
                output, labels = call_model(self.model, batch, self.device)
                kind, value = read_output(output, self._model_name)
        except RuntimeError as exc:
            error = self._released_parameter_error(exc)
            if error is None:
                raise
            raise error from None
        finally:
            if head is not None:
                head.padded = False
        if kind == "loss":
            return value.float()
        labels = check_labels(value, labels, self._model_name)
        logits, targets = value.reshape(-1, value.size(-1)), labels.reshape(-1)
        classes = head.out_features if head is not None else logits.size(1)
        if self.kernels.active("cross_entropy"):  # the logits stay in their dtype: no fp32 copy
            return custom_ops.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, classes=classes)
        return F.cross_entropy(logits[:, :classes].float(), targets, ignore_index=IGNORE_INDEX)

    def _released_parameter_error(self, exc: RuntimeError) -> UserError | None:
        """ZeRO stage 3: a parameter read outside its unit's forward (storage released) -> what to do."""
        if self.strategy.stage != 3 or "storage of size 0" not in str(exc):
            return None
        return UserError(f"zero stage 3: {self._model_name}.forward read a parameter outside the forward of the "
                         "unit holding it (units: toolkit/runtime/zero/stage3.py find_units); name the units with "
                         "initialize(..., zero3_units=[module names]) so that each unit's parameters are used only "
                         "inside its own forward")

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of loss / grad_accum_steps (times the loss scale in fp16)."""
        self._check_differentiable(loss)
        self._micro_step(lambda factor: backward_scaled(loss, factor))

    def _check_differentiable(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss`, refused when backward could not reach the model's parameters."""
        if not loss.requires_grad:
            raise UserError(f"engine.backward: the loss does not depend on the model's parameters (no grad_fn); "
                            f"compute it from {self._model_name}'s output, outside torch.no_grad()")
        return loss

    def _micro_step(self, run) -> None:
        """One micro step: `run(loss factor)` computes the gradients of loss x factor and returns the detached
        loss, which joins the step's mean; the strategy reduces the gradients around it."""
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self.strategy.begin_micro_step(boundary=self.micro_step + 1 >= self.grad_accum_steps)
        self._loss_sum += run(scale / self.grad_accum_steps)
        self.strategy.end_micro_step()  # gradients reduced (at the boundary, or every micro-step from stage 2)
        self.micro_step += 1

    def is_accumulation_boundary(self) -> bool:
        """True when the next step() call updates the weights."""
        return self.micro_step >= self.grad_accum_steps

    def step(self) -> StepResult | None:
        """Update the weights at an accumulation boundary (else do nothing and return None)."""
        if not self.is_accumulation_boundary():
            return None
        strategy = self.strategy
        lr = self.current_lr  # the rate this update uses (the schedule then moves on)
        skipped = False
        scale = 1.0
        if self.loss_scaler is not None:
            scale = self.loss_scaler.scale
            skipped = self.loss_scaler.update(strategy.grads_overflow())  # the same verdict on every rank
            if not skipped:
                strategy.scale_grads(1.0 / scale)
        grad_norm: torch.Tensor | float = float("nan")
        if not skipped:
            grad_norm = strategy.clip_grad_norm(self.recipe.training.grad_clip)  # global norm over all ranks
            strategy.optimizer_step()
            self.scheduler.step()
        else:
            self.skipped_steps += 1
            # a delayed update may have landed groups during this backward (zero/delayed_update.py EarlyLanding):
            # land the rest now, before the next forward reads them
            strategy.complete_pending_update()
        strategy.zero_grad()
        loss = self._mean_loss_over_ranks(self._loss_sum / self.micro_step)
        self._loss_sum, self.micro_step = 0.0, 0
        self.global_step += 1
        if self.loss_scaler is None:
            first = self._first_nonfinite_step
            first.masked_fill_(~torch.isfinite(loss) & (first == 0), self.global_step)
        return StepResult(loss, grad_norm, lr, scale, skipped, check_finite=self.check_finite,
                          comm=self.comm.ledger.take_step())

    def check_finite(self) -> None:
        """Raise the divergence error if any step's loss so far was inf/NaN (bf16 and fp32; waits for the GPU).
        Reading a StepResult's loss and saving a checkpoint call it."""
        first = int(self._first_nonfinite_step)
        if first:
            raise UserError(f"training diverged at step {first}: the loss is not finite; "
                            "lower recipe.optimizer.lr or add warmup (recipe.scheduler)")

    def train_batch(self, micro_batches) -> StepResult:
        """One optimizer step over this rank's micro batches (grad_accum_steps of them)."""
        if len(micro_batches) != self.grad_accum_steps:
            raise ValueError(f"expected {self.grad_accum_steps} micro batches, got {len(micro_batches)}")
        for micro_batch in micro_batches:  # the strategy's micro step: a pipeline's schedule runs its own forward
            self._micro_step(lambda factor, batch=micro_batch: self.strategy.train_micro_batch(
                batch, self._differentiable_loss, factor))
        return self.step()

    def _differentiable_loss(self, batch) -> torch.Tensor:
        return self._check_differentiable(self(batch))

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss over held-out micro batches (dropout off)."""
        self.strategy.complete_pending_update()  # the loss of the weights after the last step, delayed or not
        self.model.eval()
        self.comm.ledger.paused = True  # evaluation's collectives are no optimizer step's
        try:
            losses = [self(batch) for batch in batches]
            mean = torch.stack(losses).mean() if losses else torch.tensor(float("nan"), device=self.device)
            return float(self._mean_loss_over_ranks(mean))
        finally:
            self.model.train()
            self.comm.ledger.paused = False

    def _mean_loss_over_ranks(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over all ranks of this rank's loss (0-dim, fp32), without waiting for it."""
        if not self.dist.active:
            return loss.detach().float()
        total = loss.detach().double().reshape(1)
        self.comm.all_reduce(total, async_op=False)
        return (total[0] / self.dist.world_size).float()

    def offload_metrics(self) -> dict:
        """mem_offload_bytes (CPU memory ZeRO-Offload holds on this rank) when offload is on, else nothing."""
        if not self.strategy.offload:
            return {}
        return {"mem_offload_bytes": self.strategy.memory_bytes()["mem_offload_bytes"]}

    def model_state_bytes(self):
        """This rank's model-state bytes from live tensors (toolkit.observe.memory_monitor's protocol)."""
        from toolkit.observe.memory_monitor import StateBytes

        m = self.strategy.memory_bytes()
        return StateBytes(params=m["mem_params_bytes"], grads=m["mem_grads_bytes"], optim=m["mem_optim_bytes"],
                          master=m["mem_master_bytes"])

    @property
    def current_lr(self) -> float:
        """The schedule's learning rate: that of the first parameter group it does not scale (Muon's matrices run
        at lr x muon_lr / lr)."""
        groups = self.optimizer.param_groups
        return float(next((g for g in groups if "lr_scale" not in g), groups[0])["lr"])

    # -- checkpoints, DeepSpeed's names (toolkit/checkpoint/engine_state.py) -------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None) -> Path:
        """Save model, optimizer, schedule and `client_state` to <save_dir>/<tag> (default step-NNNNNN)
        atomically and point <save_dir>/latest at it; every rank calls it. Returns the directory."""
        from toolkit.checkpoint.engine_state import save_engine_checkpoint

        return save_engine_checkpoint(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir, tag=None):
        """Restore from <load_dir>/<tag> (default: the newest), saved at any world size and ZeRO stage;
        returns (path, client_state), or (None, None) when load_dir holds no checkpoint."""
        from toolkit.checkpoint.engine_state import load_engine_checkpoint

        return load_engine_checkpoint(self, load_dir, tag)

    # -- state for checkpoints (toolkit/checkpoint/engine_state.py owns what it holds) -------------

    def state_dict(self) -> dict:
        """Everything needed to continue exactly (model, optimizer, schedule, scaler, counters)."""
        return engine_state(self)

    def load_state_dict(self, state: dict, checkpoint_dir=None) -> None:
        """Restore what state_dict() saved, from any stage and world size (sharded checkpoints read their
        shard files in `checkpoint_dir`); settings (betas, eps, weight decay, implementation) stay the recipe's."""
        load_engine_state(self, state, checkpoint_dir, adamw_param_names(self.model, self.recipe.optimizer))


def initialize(recipe, model: nn.Module | None = None, zero3_units=None) -> Engine:
    """DeepSpeed-style entry point: a Recipe, a recipe path, a recipe dict or a DeepSpeed config dict
    (converted as `toolkit convert` does; needs `model`) (+ your own model) -> Engine.

    Without `model` the recipe's model section builds one. With it, any nn.Module trains (the recipe's
    model section is then unused): what a batch is and what its forward may return is in
    toolkit/models/forward.py. `zero3_units` names stage 3's units (module names; toolkit/runtime/zero/stage3.py).
    """
    from toolkit.recipe.deepspeed import is_deepspeed_config, recipe_from_deepspeed
    from toolkit.recipe.load import load_recipe, recipe_from_dict

    if isinstance(recipe, dict) and is_deepspeed_config(recipe):  # deepspeed.initialize(config=...) ports as is
        if model is None:
            raise UserError("initialize: a DeepSpeed config names no model; pass model=your nn.Module")
        recipe = recipe_from_deepspeed(recipe)
    elif isinstance(recipe, dict):
        recipe = recipe_from_dict(recipe)
    elif not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    return Engine(recipe, model=model, zero3_units=zero3_units)
