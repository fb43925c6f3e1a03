"""The toolkit's fused AdamW: a functional step over tensor lists or flat shards,
the global gradient norm, and `FusedAdamW`, a torch Optimizer over them.

`adamw_step` updates fp32 master parameters in one pass per call (kernels/
fused_adamw.cu): gradient unscaling (and clipping) by `grad_scale`, an inf/NaN
flag, decoupled weight decay, the Adam moments and, optionally, a bf16/fp16 copy
of the updated parameters. A ZeRO flat shard is a list of one tensor. Without the
CUDA extension (or for tensors it does not take) the same maths runs in torch.

`FusedAdamW` keeps torch.optim.AdamW's parameter groups (lr, betas, eps,
weight_decay) and state layout (step, exp_avg, exp_avg_sq), so its state dicts
load into torch's AdamW and back. Its `measure_grads` makes the engine's overflow
check, unscale and clip one read of the gradients instead of four passes.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from toolkit.ops import loader


def _extension(first: Tensor):
    """The adamw extension when `first` is a CUDA tensor and it is loaded (it checks the rest itself)."""
    return loader.loaded_extension("adamw") if first.is_cuda else None


@torch.no_grad()
def adamw_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
               grad_scale: float = 1.0, grad_scale_tensor: Tensor | None = None, lowp: list[Tensor] | None = None,
               skip: Tensor | None = None, nonfinite: Tensor | None = None) -> None:
    """One AdamW step in place, torch.optim.AdamW's maths in fp32, `step` counted from 1.

    Gradients are multiplied by grad_scale (and by grad_scale_tensor, a CUDA float, if given);
    elements with a non-finite gradient are left unchanged and set nonfinite (int32 [1]) to 1;
    nothing happens where skip (int32 [1]) is non-zero; lowp receives bf16/fp16 copies.
    """
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    if not params:
        return
    module = _extension(params[0])
    if module is not None and module.adamw_step(params, grads, exp_avgs, exp_avg_sqs, list(lowp or []), lr, beta1,
                                                beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
                                                grad_scale, grad_scale_tensor, skip, nonfinite):
        return
    if skip is not None and bool(skip.reshape(-1)[0] != 0):
        return
    scale = grad_scale if grad_scale_tensor is None else grad_scale * grad_scale_tensor.reshape(-1)[0].float()
    any_bad = False
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        g32 = g.float() * scale
        finite = torch.isfinite(g32)
        any_bad = any_bad or not bool(finite.all())
        p32 = p.float()
        new_p = p32 - lr * weight_decay * p32
        new_m = beta1 * m.float() + (1.0 - beta1) * g32
        new_v = beta2 * v.float() + (1.0 - beta2) * g32 * g32
        denom = new_v.sqrt() / bias_correction2_sqrt + eps
        new_p = new_p - (lr / bias_correction1) * new_m / denom
        p.copy_(torch.where(finite, new_p, p32))
        m.copy_(torch.where(finite, new_m, m.float()))
        v.copy_(torch.where(finite, new_v, v.float()))
        if lowp:
            lowp[i].copy_(p)
    if any_bad and nonfinite is not None:
        nonfinite.fill_(1)


@torch.no_grad()
def global_grad_norm(grads: list[Tensor], grad_scale: float = 1.0, max_norm: float = 0.0,
                     nonfinite: Tensor | None = None) -> Tensor:
    """float32 [2]: the L2 norm of all grad_scale * grads, and the AdamW gradient multiplier
    grad_scale * min(1, max_norm / (norm + 1e-6)) (no clipping when max_norm <= 0). One read of the gradients."""
    grads = [g for g in grads if g is not None]
    module = _extension(grads[0]) if grads else None
    if module is not None:
        out = module.grad_norm(grads, grad_scale, max_norm, nonfinite)
        if out.numel():
            return out
    device = grads[0].device if grads else torch.device("cpu")
    sumsq = torch.zeros((), dtype=torch.float64, device=device)
    bad = torch.zeros((), dtype=torch.bool, device=device)
    for g in grads:
        scaled = g.float() * grad_scale
        bad |= ~torch.isfinite(scaled).all()
        sumsq += scaled.double().pow(2).sum()
    norm = sumsq.sqrt().float()
    clip = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else torch.ones_like(norm)
    if nonfinite is not None:
        nonfinite.copy_(torch.maximum(nonfinite, bad.to(nonfinite.dtype)))
    return torch.stack([norm, grad_scale * clip]).float()


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's semantics, one fused kernel launch per parameter group (CUDA), torch maths elsewhere."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._grad_scale: float | Tensor = 1.0  # what the next step() multiplies gradients by
        self._buckets: dict[int, tuple] = {}  # group index -> (parameter ids, [_Bucket]); see _buckets_for

    @torch.no_grad()
    def measure_grads(self, grad_scale: float = 1.0) -> tuple[Tensor, Tensor]:
        """(global L2 norm of grad_scale * grads, any inf/NaN) as 0-dim tensors on the gradients' device:
        one read of the gradients and no host sync (reading either value waits for it)."""
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return torch.zeros(()), torch.zeros((), dtype=torch.bool)
        flag = torch.zeros(1, dtype=torch.int32, device=grads[0].device)
        by_kind: dict = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        if len(by_kind) == 1:
            norm = global_grad_norm(grads, grad_scale, 0.0, flag)[0]
        else:  # mixed dtypes: norms per kind, combined
            norms = torch.stack([global_grad_norm(gs, grad_scale, 0.0, flag)[0].to(flag.device) for gs in by_kind.values()])
            norm = norms.double().pow(2).sum().sqrt().float()
        norm = norm.to(flag.device)
        return norm, (flag[0] != 0) | ~torch.isfinite(norm)

    def set_grad_multiplier(self, multiplier: float | Tensor) -> None:
        """What the next step() multiplies the gradients by (unscale and clip); a tensor stays on the device."""
        self._grad_scale = multiplier

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient (times the set_grad_multiplier() value, then 1 again)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, self._grad_scale = self._grad_scale, 1.0
        scale_tensor = grad_scale.reshape(1).float() if isinstance(grad_scale, Tensor) else None
        grad_scale = 1.0 if scale_tensor is not None else grad_scale
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            for bucket in self._buckets_for(index, params):
                bucket.step += 1
                adamw_step(bucket.params, [p.grad for p in bucket.params], bucket.exp_avgs, bucket.exp_avg_sqs,
                           lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                           weight_decay=group["weight_decay"], step=bucket.step, grad_scale=grad_scale,
                           grad_scale_tensor=scale_tensor)
        return loss

    # NOTE: host time per step matters (GPT-2 124M's whole update is ~0.9 ms of GPU time), so the
    # per-parameter work is done once: each group's parameters are cached in buckets of one step
    # count and gradient dtype, and the per-parameter `step` tensors torch's state layout keeps are
    # written only when someone reads the state (state_dict) or the buckets change.

    def _buckets_for(self, index: int, params: list[Tensor]) -> list["_Bucket"]:
        key = tuple(map(id, params))
        cached = self._buckets.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        self._write_steps()
        buckets: dict = {}
        for p in params:
            state = self._state_of(p)
            kind = (p.device, p.grad.dtype, int(state["step"].item()))
            buckets.setdefault(kind, _Bucket(kind[2])).add(p, state)
        self._buckets[index] = (key, list(buckets.values()))
        return self._buckets[index][1]

    def _state_of(self, p: Tensor) -> dict:
        if p.grad.is_sparse:
            raise RuntimeError("FusedAdamW does not support sparse gradients")
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device.type != "cpu":  # loaded from torch's fused AdamW: count on the host
            state["step"] = state["step"].detach().to("cpu", torch.float32)
        return state

    def _write_steps(self) -> None:
        """Bring every cached parameter's state["step"] up to date."""
        for _, buckets in self._buckets.values():
            for bucket in buckets:
                for p in bucket.params:
                    self.state[p]["step"].fill_(float(bucket.step))

    def state_dict(self):
        self._write_steps()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._buckets = {}
        super().load_state_dict(state_dict)


class _Bucket:
    """Parameters of one group with one step count: one kernel launch."""

    def __init__(self, step: int):
        self.step = step
        self.params, self.exp_avgs, self.exp_avg_sqs = [], [], []

    def add(self, p: Tensor, state: dict) -> None:
        self.params.append(p)
        self.exp_avgs.append(state["exp_avg"])
        self.exp_avg_sqs.append(state["exp_avg_sq"])
