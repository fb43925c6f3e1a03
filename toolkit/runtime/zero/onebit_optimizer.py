"""1-bit Adam's optimizer state over a flat layout and its update (DeepSpeed's): Adam moments, the variance
frozen after freeze_step, then a momentum averaged over the ranks by a compressed all-reduce that the
strategy (onebit_adam.py) passes in. Built by toolkit.runtime.optim.build_optimizer."""
from __future__ import annotations

import torch
from torch import nn

from toolkit.specs import OptimizerSpec


class OnebitAdam:
    """The optimizer state of 1-bit Adam over a flat layout (stage 0's parameter order), and its update."""

    def __init__(self, groups: list[dict], params: list[nn.Parameter], spec: OptimizerSpec, world: int):
        self.spec, self.params = spec, params
        self.param_groups = groups  # toolkit.runtime.optim.param_groups; the schedule writes "lr" here
        for group in self.param_groups:
            group["lr"] = spec.lr
        device = params[0].device
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        unit = 8 * world  # every rank's chunk a whole number of bytes
        self.padded = -(-self.numel // unit) * unit
        self.lengths = self.sizes + [self.padded - self.numel]  # the padding is its own segment (scale 0)
        self.exp_avg = torch.zeros(self.padded, device=device)
        self.exp_avg_sq = torch.zeros(self.numel, device=device)
        self.worker_error = torch.zeros(self.padded, device=device)
        self.server_error = torch.zeros(self.padded // world, device=device)
        self.step_count = 0

    def state_dict(self) -> dict:
        """torch AdamW's format (index order: decayed group, then the other), so any stage resumes from it."""
        index = {id(p): i for i, p in enumerate(self.params)}
        m, v = self.exp_avg[:self.numel].split(self.sizes), self.exp_avg_sq.split(self.sizes)
        state, groups, k = {}, [], 0
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                i = index[id(p)]
                state[k] = {"step": torch.tensor(float(self.step_count)), "exp_avg": m[i].view_as(p),
                            "exp_avg_sq": v[i].view_as(p)}
                ids.append(k)
                k += 1
            groups.append({**{key: val for key, val in group.items() if key != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, saved: dict) -> None:
        """Moments and step count from state_dict() (or a torch AdamW's: the same format)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        m, v = self.exp_avg[:self.numel].split(self.sizes), self.exp_avg_sq.split(self.sizes)
        k = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = saved["state"].get(k) or saved["state"].get(str(k))
                if state:
                    m[index[id(p)]].copy_(state["exp_avg"].reshape(-1))
                    v[index[id(p)]].copy_(state["exp_avg_sq"].reshape(-1))
                    self.step_count = int(float(state["step"]))
                k += 1

    @torch.no_grad()
    def update(self, grads: torch.Tensor, average_momentum) -> None:
        """One step from the flat gradient `grads`: Adam moments (the variance frozen once
        `average_momentum` is given: it averages exp_avg over the ranks in place), then the weights."""
        beta1, beta2 = self.spec.betas
        m = self.exp_avg[:self.numel]
        m.mul_(beta1).add_(grads, alpha=1 - beta1)
        if average_momentum is None:
            self.exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
        else:
            average_momentum(self.exp_avg)
        update = m / self.exp_avg_sq.sqrt().add_(self.spec.eps)
        pieces = dict(zip((id(p) for p in self.params), update.split(self.sizes)))
        for group in self.param_groups:
            ps = group["params"]
            steps = [pieces[id(p)].view_as(p) for p in ps]
            if group["weight_decay"] > 0:
                torch._foreach_add_(steps, ps, alpha=group["weight_decay"])
            torch._foreach_add_(ps, steps, alpha=-group["lr"])
        self.step_count += 1
