"""ZeRO stage 0: plain data parallelism. Every rank holds the whole model, the
whole gradient and the whole optimizer (the AdamW the engine chose, toolkit.runtime.optim); gradients
are averaged across ranks with bucketed all-reduces overlapped with backward.

Gradients live in flat buckets (consecutive parameters in reverse registration
order, about backward's order, up to zero.reduce_bucket_size elements) and each
parameter's .grad is a view into its bucket, so accumulation is in place and a
finished bucket is all-reduced as is, with no copies. Only the last micro-step
of an accumulation (the boundary) communicates, like DDP's no_sync: a bucket's
all-reduce starts from the post-accumulate-grad hook of its last parameter, in
bucket order on every rank, while backward carries on with earlier layers.
One process needs no buckets: its gradients are torch's own tensors, set to
None after each step, so the next backward writes them instead of adding into
zeroed memory (GPT-2 1.5B: 7 ms of a 390 ms step spent zeroing and adding).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from toolkit.observe.comm_ledger import expected_step_bytes
from toolkit.ops.fused_adamw import FusedAdamW
from toolkit.runtime.communicator import Communicator
from toolkit.runtime.int8_adamw import Int8AdamW
from toolkit.runtime.optim import build_optimizer, optimizer_param_groups
from toolkit.runtime.precision import has_inf_or_nan
from toolkit.distributed import DistInfo
from toolkit.runtime.strategy import StrategyBase, tensor_bytes, weak_method_hook
from toolkit.runtime.zero.flat import bucket_params
from toolkit.specs import OptimizerSpec, ZeroSpec


class OnePassStep:
    """Stage 0's step over the toolkit's FusedAdamW, reading the gradients once.

    The engine drives a strategy with grads_overflow() -> scale_grads(1/scale) -> clip_grad_norm(max)
    -> optimizer_step(): four passes over the gradients with torch AdamW. Over a FusedAdamW the first
    call measures the norm and the inf/NaN flag in one pass, scale_grads and clip_grad_norm only
    compute a multiplier, and the fused step applies it. The norm and the multiplier stay on the
    device: only grads_overflow (the fp16 loss scaler's decision) waits for the GPU.
    """

    def __init__(self, optimizer: FusedAdamW):
        self._optimizer = optimizer
        self._measured: tuple[torch.Tensor, torch.Tensor] | None = None  # (norm of the gradients as they are, any inf/NaN)
        self._factor = 1.0  # scale_grads factors so far

    def _measure(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._measured is None:
            self._measured = self._optimizer.measure_grads()
        return self._measured

    def grads_overflow(self) -> bool:
        """Any inf/NaN in the gradients (stage 0: identical on every rank after the all-reduce). Syncs."""
        return bool(self._measure()[1])

    def scale_grads(self, factor: float) -> None:
        """Deferred: the fused step multiplies by it."""
        self._factor *= factor

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The norm of the scaled gradients (0-dim, on the device); the clip coefficient
        (torch.nn.utils.clip_grad_norm_'s, none for a non-finite norm) joins the step's multiplier."""
        norm = self._measure()[0] * self._factor
        if max_norm > 0:
            clip = torch.where(torch.isfinite(norm), (max_norm / (norm + 1e-6)).clamp(max=1.0), 1.0)
            self._optimizer.set_grad_multiplier(clip * self._factor)
        else:
            self._optimizer.set_grad_multiplier(self._factor)
        return norm

    def reset(self) -> None:
        """Forget this step's measurement and multiplier (after the optimizer step, or zero_grad)."""
        self._measured, self._factor = None, 1.0


class DataParallel(StrategyBase):
    """Stage 0 strategy: replicated model and optimizer, averaged gradients."""

    stage = 0

    def __init__(self, model: nn.Module, zero: ZeroSpec, optimizer: OptimizerSpec, device: torch.device,
                 info: DistInfo, adamw: str, comm: Communicator):
        self.model, self.device, self.info, self.comm = model, device, info, comm
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        self.flat_grads: list[torch.Tensor] = []  # several ranks: the all-reduce buckets the .grad views live in
        for bucket in bucket_params(list(reversed(named)), zero.reduce_bucket_size):
            params = [p for _, p in bucket]
            self.buckets.append(params)
            if not info.active:
                continue
            flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            self.flat_grads.append(flat)
        self.params = [p for bucket in self.buckets for p in bucket]
        # the AdamW the engine chose (optim.choose_adamw), or 1-bit Adam's state over the buckets' order
        self.optimizer = build_optimizer(optimizer, optimizer_param_groups(model, optimizer), adamw,
                                         flat_order=self.params, world=info.world_size)
        # Over the toolkit's fused AdamW: overflow check, unscale and clip in one read of the gradients.
        self._one_pass = OnePassStep(self.optimizer) if isinstance(self.optimizer, FusedAdamW) else None
        self._names = {id(p): n for n, p in named}
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._reducing = False
        self._reset_round()
        if info.active:
            for p in self.params:
                p.register_post_accumulate_grad_hook(weak_method_hook(self._on_grad_ready))

    def describe(self) -> str:
        """One line for the start-up table."""
        if not self.info.active:
            return "stage 0 (data parallel) over 1 rank: one process, no communication"
        size = max(f.numel() for f in self.flat_grads)
        comm = (f"gradients all-reduced in {len(self.buckets)} bucket(s) of up to {size:,} elements, overlapped "
                f"with the last micro-step's backward")
        return f"stage 0 (data parallel) over {self.info.world_size} rank(s): {comm}"

    # -- backward: bucketed all-reduce at the boundary -------------------------------

    def _reset_round(self) -> None:
        self._missing = [len(b) for b in self.buckets]
        self._launched = 0
        self._works = []

    def begin_micro_step(self, boundary: bool) -> None:
        """Called before backward: communicate only on the boundary micro-step."""
        self._reducing = boundary and self.info.active
        self._reset_round()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._reducing:
            return
        self._missing[self._bucket_of[id(param)]] -= 1
        while self._launched < len(self.buckets) and self._missing[self._launched] == 0:
            self._launch(self._launched)

    def _launch(self, b: int) -> None:
        flat = self.flat_grads[b]
        flat.div_(self.info.world_size)  # NOTE: pre-divide: exact for power-of-two worlds
        self._works.append(self.comm.all_reduce(flat))
        self._launched = b + 1

    def end_micro_step(self) -> None:
        """Called after backward: launch buckets whose gradients never came (unused parameters), wait."""
        if not self._reducing:
            return
        while self._launched < len(self.buckets):
            self._launch(self._launched)
        for work in self._works:
            work.wait()
        self._reset_round()
        self._reducing = False

    # -- the step (the same calls as one process always made) -------------------------

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients as they are held: the flat buckets, or (one process) each parameter's .grad."""
        if self.info.active:
            return self.flat_grads
        return [p.grad for p in self.params if p.grad is not None]

    def grads_overflow(self) -> bool:
        """True when the (already averaged, identical on every rank) gradients hold an inf or NaN."""
        if self._one_pass is not None:
            return self._one_pass.grads_overflow()
        return self.comm.any_true(has_inf_or_nan(self.grad_tensors()))

    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient by `factor`."""
        if self._one_pass is not None:
            self._one_pass.scale_grads(factor)
            return
        grads = self.grad_tensors()
        if grads:
            torch._foreach_mul_(grads, factor)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ over all parameters (0 or less: measure only); the norm stays on the device."""
        if self._one_pass is not None:
            return self._one_pass.clip_grad_norm(max_norm)
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else math.inf)

    def optimizer_step(self) -> None:
        """torch AdamW step on the full model."""
        self.optimizer.step()
        if self._one_pass is not None:
            self._one_pass.reset()

    def zero_grad(self) -> None:
        """Zero the flat gradient buckets in place (the .grad views stay); one process: drop the gradients."""
        for flat in self.flat_grads:
            flat.zero_()
        if not self.info.active:
            for p in self.params:
                p.grad = None
        if self._one_pass is not None:
            self._one_pass.reset()

    def expected_bytes_per_step(self, grad_accum_steps: int) -> dict[str, int]:
        """The formula's bytes per rank per step: the gradients all-reduced once (toolkit/observe/comm_ledger.py)."""
        numel = sum(p.numel() for p in self.params)
        element = self.params[0].element_size() if self.params else 4
        return expected_step_bytes(0, numel, self.info.world_size, element, grad_accum_steps)

    # -- checkpoint state (toolkit/checkpoint/zero_shards.py) --------------------------------------

    def owned_pieces(self) -> list[tuple[str, int, int, dict[str, torch.Tensor]]]:
        """Rank 0 owns every parameter whole (the state is replicated); other ranks nothing."""
        if self.info.rank != 0:
            return []
        pieces = []
        # NOTE: optimizer.state_dtype int8 holds codes in `state`; its fp32 moments are dequantized for the pieces
        states = self.optimizer.fp32_states() if isinstance(self.optimizer, Int8AdamW) else self.optimizer.state
        for name, p in self.model.named_parameters():
            state = states.get(p, {})
            zeros = torch.zeros(p.numel(), dtype=torch.float32)
            # Muon's matrices: the momentum is saved as exp_avg, no second moment (as the ZeRO shards)
            first = state.get("exp_avg", state.get("momentum_buffer"))
            pieces.append((name, 0, p.numel(), {"param": p.detach().reshape(-1),
                                                "exp_avg": first.reshape(-1) if first is not None else zeros,
                                                "exp_avg_sq": state["exp_avg_sq"].reshape(-1) if "exp_avg_sq" in
                                                state else zeros}))
        return pieces

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape by name."""
        return {name: tuple(p.shape) for name, p in self.model.named_parameters()}

    def optimizer_steps(self) -> int:
        """AdamW steps applied so far."""
        steps = [float(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        return int(steps[0]) if steps else 0

    @torch.no_grad()
    def load_pieces(self, reader) -> None:
        """Whole parameters and torch AdamW state from any checkpoint reader (a sharded one included)."""
        for group in self.optimizer.param_groups:
            fused = bool(group.get("fused"))
            for p in group["params"]:
                name = self._names[id(p)]
                p.copy_(reader.read("param", name, 0, p.numel()).view_as(p))
                if reader.step == 0:
                    continue
                step_device = p.device if fused else "cpu"
                if group.get("muon"):  # torch.optim.Muon's one buffer, saved as exp_avg
                    self.optimizer.state[p] = {
                        "momentum_buffer": reader.read("exp_avg", name, 0, p.numel()).view_as(p).to(p.device, p.dtype)}
                    continue
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(reader.step), dtype=torch.float32, device=step_device),
                    "exp_avg": reader.read("exp_avg", name, 0, p.numel()).view_as(p).to(p.device, p.dtype),
                    "exp_avg_sq": reader.read("exp_avg_sq", name, 0, p.numel()).view_as(p).to(p.device, p.dtype)}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by name."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def describe_tiers(self) -> str:
        """One line for the start-up table: the bytes per rank of parameters, gradients and optimizer states, all
        on the device (the memory line at the end counts the same tensors)."""
        from toolkit.observe.estimate import format_bytes

        mem = self.memory_bytes()
        # NOTE: torch's Adam(W) makes its moments at the first step: none exist yet to count
        made = ("Muon's momentum for the matrices, AdamW's two moments for the rest" if
                self.optimizer.param_groups[0].get("muon") else "two moments as large as the parameters")
        moments = (f"({format_bytes(mem['mem_optim_bytes'])})" if mem["mem_optim_bytes"] else
                   f"(made at the first step: {made})")
        return (f"params device ({format_bytes(mem['mem_params_bytes'])}); grads device "
                f"({format_bytes(mem['mem_grads_bytes'])}); optimizer states device {moments}")

    def memory_bytes(self) -> dict:
        """Model-state bytes held now, from live tensors."""
        optim = [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        params = tensor_bytes(p.detach() for p in self.params)
        # one process: gradients live from backward to the step, as large as the parameters
        return {"mem_params_bytes": params,
                "mem_grads_bytes": tensor_bytes(self.flat_grads) if self.info.active else params,
                "mem_optim_bytes": tensor_bytes(optim), "mem_master_bytes": 0, "mem_offload_bytes": 0}
