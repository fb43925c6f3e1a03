"""Muon (recipe.optimizer.type muon): which parameters it orthogonalizes, its optimizer over whole tensors,
and the per-matrix maths the ZeRO shard step shares (toolkit/runtime/zero/muon.py).

Whole tensors (zero.stage 0; optim.py muon_param_groups routes them) step with torch's own implementations: `MuonAdamW` is one torch optimizer whose
first param group is stepped by torch.optim.Muon and whose others by torch.optim.AdamW, over one shared state,
so the Schedule, the strategies and state_dict see a single optimizer. The shard step cannot call
torch.optim.Muon (its parameters are flat slices): `orthogonalize` and `adjusted_lr` transcribe torch's
`_zeropower_via_newtonschulz` and `_adjust_lr` (torch/optim/_muon.py, torch 2.9-2.13) op for op, and
tests/runtime/test_muon.py holds both paths to torch's.

What does not live here: the sharded step and its all-gather (zero/muon.py), the AdamW choice (optim.py).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from toolkit.specs import OptimizerSpec

# torch.optim.Muon's defaults (Keller Jordan's quintic coefficients and normalisation epsilon)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def muon_param_ids(model: nn.Module) -> set[int]:
    """ids of the parameters Muon orthogonalizes: trainable, exactly 2-D, and not the weight of an embedding
    (nn.Embedding: token and position tables) nor of the output head (get_output_embeddings(), else a module
    named lm_head). Everything else (1-D norms and biases, embeddings, the head, >2-D) stays with AdamW."""
    skip = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else dict(model.named_modules()).get("lm_head")
    if head is not None:
        skip |= {id(p) for p in head.parameters(recurse=False)}
    return {id(p) for p in model.parameters() if p.requires_grad and p.ndim == 2 and id(p) not in skip}


def muon_group_settings(spec: OptimizerSpec) -> dict:
    """Muon's param-group settings (torch.optim.Muon's names, plus the toolkit's muon, lr_scale, ns_dtype)."""
    return {"muon": True, "lr": spec.muon_lr, "lr_scale": spec.muon_lr / spec.lr, "weight_decay": spec.muon_weight_decay,
            "momentum": spec.muon_momentum, "nesterov": spec.muon_nesterov, "ns_steps": spec.muon_ns_steps,
            "adjust_lr_fn": spec.muon_adjust_lr, "ns_dtype": spec.muon_ns_dtype}


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the group marked "muon", torch.optim.AdamW (`adamw_settings`) on the others: one
    optimizer, one state (Muon's momentum_buffer; AdamW's step, exp_avg, exp_avg_sq). With ns_dtype fp32
    (torch has bf16 only) the matrices step with `muon_step`, torch's maths with an fp32 Newton-Schulz."""

    def __init__(self, groups: list[dict], adamw_settings: dict):
        muon = [g for g in groups if g.get("muon")]
        rest = [g for g in groups if not g.get("muon")]
        # NOTE: torch's optimizers keep the group dicts they are given, so all three share them.
        self._muon = torch.optim.Muon(muon) if muon and muon[0]["params"] else None
        self._adamw = torch.optim.AdamW(rest, **adamw_settings)
        super().__init__(muon + rest, {})
        self._n_muon = len(muon)
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this one's groups and state (again after load_state_dict)."""
        if self._muon is not None:
            self._muon.param_groups, self._muon.state = self.param_groups[:self._n_muon], self.state
        self._adamw.param_groups, self._adamw.state = self.param_groups[self._n_muon:], self.state

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step on the matrices, one AdamW step on the rest."""
        if self._muon is not None and self.param_groups[0]["ns_dtype"] == "bf16":
            self._muon.step()
        elif self._muon is not None:
            group = self.param_groups[0]
            for p in (p for p in group["params"] if p.grad is not None):
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                muon_step(p, p.grad, buf, group, p.shape)
        self._adamw.step()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (which replaces the groups and state), then relink the inner optimizers."""
        super().load_state_dict(state_dict)
        self._link()


# ---------------------------------------------------------------------------
# The per-matrix maths (torch/optim/_muon.py, transcribed for the ZeRO shard step)

NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # recipe.optimizer.muon_ns_dtype


def orthogonalize(update: torch.Tensor, ns_steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch's `_zeropower_via_newtonschulz`: `ns_steps` quintic Newton-Schulz iterations in `dtype` (torch: bf16)."""
    a, b, c = NS_COEFFICIENTS
    ortho = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=NS_EPS))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def muon_step(param: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, group: dict, shape) -> None:
    """torch's `_single_tensor_muon` for one matrix of `shape` (param, grad, momentum: whole, any layout)."""
    momentum.lerp_(grad, 1 - group["momentum"])
    update = grad.lerp(momentum, group["momentum"]) if group["nesterov"] else momentum
    ortho = orthogonalize(update.view(shape), group["ns_steps"], NS_DTYPES[group["ns_dtype"]])
    lr = float(group["lr"])
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(ortho.reshape(param.shape), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))


def adjusted_lr(lr: float, adjust_lr_fn: str, shape: tuple[int, ...]) -> float:
    """torch's `_adjust_lr`: the lr for a matrix of `shape` (A x B) under `adjust_lr_fn`."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr * math.sqrt(max(1, rows / cols))
