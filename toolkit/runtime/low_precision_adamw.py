"""AdamW (or Adam with L2 decay) whose weights and moments live in bf16, written back with stochastic rounding
(optimizer.state_dtype bf16 at zero.stage 0; built by toolkit.runtime.optim.build_optimizer).

What lives here: `stochastic_round_to_bf16` (the reference rounding, in torch ops) and `BF16AdamW`, a torch
optimizer over bf16 parameters. Each step reads the bf16 weight, gradient and moments as fp32, runs the same ops in
the same order as torch/optim/adam.py `_single_tensor_adam`, and writes the three results back to bf16 with
stochastic rounding. What does not: fp32 state (torch's AdamW, optim.py), ZeRO shards (zero/adamw.py).

NOTE: round-to-nearest would drop every update smaller than half a bf16 ulp of the weight (about 2^-9 of it):
with lr 1e-3 most AdamW steps on a weight near 1 vanish. Stochastic rounding keeps them in expectation.
The random bits come from a generator seeded with (torch.initial_seed() at construction: the run's
training.seed, set by the engine before it builds the optimizer) and the step, so a run, and its resume from a
checkpoint, draw the same bits.
"""
from __future__ import annotations

import torch

_LOW_BITS = 1 << 16  # the fp32 mantissa bits bf16 drops
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as an int32: sign, exponent and bf16's 7 mantissa bits


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` (fp32) rounded to bf16 up or down with probability by distance: E[result] = x (finite x)."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, _LOW_BITS, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # NOTE: adding below the cut carries into bit 16 with probability (low bits) / 2^16, on the magnitude (the sign
    # bit sits above), then truncation drops the rest; the low 16 bits are then zero, so .to(bf16) is exact.
    return ((bits + noise) & _HIGH_MASK).view(torch.float32).to(torch.bfloat16)


class BF16AdamW(torch.optim.Optimizer):
    """torch AdamW's maths (or Adam's with `l2`) on bf16 parameters, bf16 exp_avg/exp_avg_sq, stochastic rounding."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 l2: bool = False, seed: int | None = None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.l2 = l2  # torch Adam: weight decay added to the gradient, not decoupled
        self.seed = torch.initial_seed() if seed is None else int(seed)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"BF16AdamW steps bf16 parameters, not {p.dtype} (the strategy casts the model)")

    def _generator(self, device: torch.device, step: int) -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed((self.seed * 1_000_003 + step * 7919) % (2**63))
        return generator

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step on every parameter with a gradient."""
        loss = None if closure is None else closure()
        generators: dict[torch.device, torch.Generator] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                if p.device not in generators:
                    generators[p.device] = self._generator(p.device, step)
                self._update(p, state, group, step, generators[p.device])
        return loss

    def _update(self, p: torch.Tensor, state: dict, group: dict, step: int, generator: torch.Generator) -> None:
        from toolkit.runtime.zero.adamw import adam_reference_update_

        param, exp_avg, exp_avg_sq = p.float(), state["exp_avg"].float(), state["exp_avg_sq"].float()
        adam_reference_update_(param, p.grad.float(), exp_avg, exp_avg_sq, step=step, lr=float(group["lr"]),
                               wd=float(group["weight_decay"]), betas=group["betas"], eps=group["eps"], l2=self.l2)
        p.copy_(stochastic_round_to_bf16(param, generator))
        state["exp_avg"].copy_(stochastic_round_to_bf16(exp_avg, generator))
        state["exp_avg_sq"].copy_(stochastic_round_to_bf16(exp_avg_sq, generator))
