"""AdamW (or Adam with L2 decay) whose weights and moments live in bf16, written back with stochastic rounding
(optimizer.state_dtype bf16; built by toolkit.runtime.optim.build_optimizer).

What lives here: `stochastic_round_to_bf16` (the reference rounding, in torch ops), `adam_reference_update_` (torch's
single-tensor AdamW in fp32, which ZeRO's reference step runs too) and `BF16AdamW`, a torch
optimizer over bf16 parameters. Each step reads the bf16 weight, gradient and moments as fp32, runs the same ops in
the same order as torch/optim/adam.py `_single_tensor_adam`, and writes the three results back to bf16 with
stochastic rounding (`bf16_adam_update_`, which ZeRO 1-3's ShardedAdamW calls on its bf16 shard segments too). What
does not: fp32 state (torch's AdamW, optim.py), the flat shards themselves (zero/adamw.py, shard_part.py).

NOTE: round-to-nearest would drop every update smaller than half a bf16 ulp of the weight (about 2^-9 of it):
with lr 1e-3 most AdamW steps on a weight near 1 vanish. Stochastic rounding keeps them in expectation.
The random bits come from a generator seeded with (torch.initial_seed() at construction: the run's
training.seed, set by the engine before it builds the optimizer) and the step, so a run, and its resume from a
checkpoint, draw the same bits.
"""
from __future__ import annotations

import torch

# NOTE: the fp32 maths holds about six fp32 temporaries of what it updates at once (the three copies, the
# denominator, the rounding bits and their sum): stepped whole, a ZeRO shard segment of llama-1b (496M elements)
# took 11.1 GiB for them, as much as its activations (benchmarks/RESULTS.md, the reserved peak). A window of 2^25
# elements bounds them to about 0.8 GiB. Below it the bits are drawn as before, so results up to that size are
# unchanged.
STEP_WINDOW = 1 << 25
_LOW_BITS = 1 << 16  # the fp32 mantissa bits bf16 drops
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as an int32: sign, exponent and bf16's 7 mantissa bits


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` (fp32) rounded to bf16 up or down with probability by distance: E[result] = x (finite x)."""
    noise = torch.randint(0, _LOW_BITS, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return _add_below_the_cut(x, noise)


def _add_below_the_cut(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`x` (fp32) plus `noise` (int32, below 2^16) under bf16's last mantissa bit, truncated to bf16."""
    # NOTE: adding below the cut carries into bit 16 with probability (low bits) / 2^16, on the magnitude (the sign
    # bit sits above), then truncation drops the rest; the low 16 bits are then zero, so .to(bf16) is exact.
    return ((x.contiguous().view(torch.int32) + noise) & _HIGH_MASK).view(torch.float32).to(torch.bfloat16)


def adam_reference_update_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int,
                           lr: float, wd: float, betas: tuple[float, float], eps: float, l2: bool) -> None:
    """One AdamW (or, with `l2`, Adam) step on fp32 tensors in place, as torch's single-tensor path rounds it."""
    # Transcribed from torch/optim/adam.py `_single_tensor_adam` (decoupled weight decay, or L2 for
    # optimizer.type adam; no amsgrad): the same ops in the same order, so every element rounds the same way.
    beta1, beta2 = betas
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2_sqrt = (1 - beta2 ** float(step)) ** 0.5
    step_size = lr / bias_correction1
    if wd != 0 and l2:
        g = g.add(p, alpha=wd)
    elif wd != 0:
        p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


def rounding_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """The generator of step `step`'s rounding bits: a function of the run's seed and the step only."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + step * 7919) % (2**63))
    return generator


def bf16_adam_update_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, generator: torch.Generator,
                      **settings) -> None:
    """One AdamW (Adam) step on bf16 `p`, `m`, `v` in place: the fp32 maths of `adam_reference_update_`
    (`settings`: step, lr, wd, betas, eps, l2) on fp32 copies, written back with stochastic rounding; at most
    STEP_WINDOW elements at a time."""
    def update(*tensors):
        _update_in_fp32_(*tensors, lambda value, _: stochastic_round_to_bf16(value, generator), **settings)

    tensors = (p, g, m, v)
    if p.numel() <= STEP_WINDOW or not all(t.is_contiguous() for t in tensors):
        update(*tensors)
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, p.numel(), STEP_WINDOW):
        update(*(t[start:start + STEP_WINDOW] for t in flat))


def _update_in_fp32_(p, g, m, v, round_to_bf16, **settings) -> None:
    """`adam_reference_update_` on fp32 copies of bf16 `p`, `m`, `v`, written back in that order through
    `round_to_bf16(value, index)` (index 0, 1, 2: weight, exp_avg, exp_avg_sq)."""
    values = (p.float(), m.float(), v.float())
    adam_reference_update_(values[0], g.float(), values[1], values[2], **settings)
    for index, (target, value) in enumerate(zip((p, m, v), values)):
        target.copy_(round_to_bf16(value, index))


# -- hashed rounding bits: the CPU Adam kernel's bf16 step (kernels/cpu_adam_bf16.cpp) in torch ops --------------
_M32 = 0xFFFFFFFF


def _lowbias32(x):
    """Chris Wellons' 32-bit hash, on Python ints or int64 tensors holding uint32 values (as the kernel's)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32  # NOTE: int64 products wrap; their low 32 bits are the uint32 product's
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hashed_rounding_bits(seed: int, step: int, offset: int, numel: int) -> tuple[torch.Tensor, ...]:
    """The 16 random bits (int32 tensors) the kernel adds below the weight's, exp_avg's and exp_avg_sq's bf16
    mantissa for elements offset .. offset + numel - 1 of a shard: a hash of (seed, step, index)."""
    seed &= (1 << 64) - 1
    step_key = _lowbias32((seed & _M32) ^ _lowbias32((step & _M32) ^ _lowbias32(seed >> 32)))
    index = torch.arange(offset, offset + numel, dtype=torch.int64)
    r = _lowbias32((index & _M32) ^ _lowbias32((index >> 32) ^ step_key))
    return ((r & 0xFFFF).to(torch.int32), (r >> 16).to(torch.int32), (_lowbias32(r) & 0xFFFF).to(torch.int32))


def _round_with_bits(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`x` (fp32) rounded to bf16 by adding `noise` below the cut and truncating; NaN stays NaN."""
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), _add_below_the_cut(x, noise))


def hashed_bf16_adam_update_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, seed: int,
                             offset: int, **settings) -> None:
    """One AdamW (Adam) step on bf16 CPU `p`, `m`, `v` in place with the kernel's hashed rounding bits (`settings`:
    step, lr, wd, betas, eps, l2): the fallback of kernels/cpu_adam_bf16.cpp, adamw_step_bf16, and its reference."""
    bits = hashed_rounding_bits(seed, settings["step"], offset, p.numel())
    _update_in_fp32_(p, g, m, v, lambda value, index: _round_with_bits(value, bits[index]), **settings)


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
                    generators[p.device] = rounding_generator(self.seed, step, p.device)
                bf16_adam_update_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], generators[p.device], step=step,
                                  lr=float(group["lr"]), wd=float(group["weight_decay"]), betas=group["betas"],
                                  eps=group["eps"], l2=self.l2)
        return loss
