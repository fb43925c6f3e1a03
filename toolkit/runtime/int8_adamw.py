"""AdamW (or Adam with L2 decay) over whole fp32 tensors with 8-bit blockwise moments (optimizer.state_dtype int8
at zero.stage 0; built by toolkit.runtime.optim.build_optimizer). What does not live here: the quantization and the
windowed step (int8_moments.py), ZeRO 1-3's shard (zero/adamw.py).

The fp32 parameters are their own master (stage 0 keeps fp32 weights under autocast). Both moments of every
parameter live in one `BlockwiseMoments` run, the parameters laid end to end in param_groups order, so the
optimizer holds exactly 2 bytes per parameter plus 8 per BLOCK of them (ceil(P / BLOCK) scales per moment: what
toolkit/observe/estimate.py counts); a block may span the end of one parameter and the start of the next.
Each parameter's state holds its step (a float, not a tensor: no bytes beside the run's) and views into the run, so
the memory monitor counts the run once and exactly the estimate's bytes.

Checkpoints: `state_dict` gives torch AdamW's layout, fp32 exp_avg / exp_avg_sq per parameter (dequantized), so any
stage and world size can read it; loading one (or a ZeRO shard's fp32 pieces, ddp.py load_pieces) quantizes the
whole run at once: at the same layout the codes and scales come back bit for bit (int8_moments.py's NOTE).
"""
from __future__ import annotations

import torch

from toolkit.runtime.int8_moments import BLOCK, BlockwiseMoments, Piece, blockwise_adam_step


class Int8AdamW(torch.optim.Optimizer):
    """torch AdamW's maths (or Adam's with `l2`) on fp32 parameters, exp_avg/exp_avg_sq in 8-bit blockwise codes."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 l2: bool = False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.l2 = l2  # torch Adam: weight decay added to the gradient, not decoupled
        self.offsets: dict[torch.Tensor, int] = {}
        for p in (p for group in self.param_groups for p in group["params"]):
            if p.dtype != torch.float32:
                raise ValueError(f"Int8AdamW steps fp32 parameters (their own master), not {p.dtype}")
            self.offsets[p] = sum(q.numel() for q in self.offsets)
        device = next(iter(self.offsets)).device if self.offsets else torch.device("cpu")
        self.moments = BlockwiseMoments.zeros(sum(p.numel() for p in self.offsets), device)
        self.steps = 0  # applied steps (every parameter steps together: the run's blocks span parameters)
        for p in self.offsets:  # the run exists from the start: the start-up table's tiers row counts it
            self.state[p] = {"step": 0.0, **self._views(p)}

    def _views(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter p's codes and the scales of the blocks it touches: views into the run."""
        a, b = self.offsets[p], self.offsets[p] + p.numel()
        blocks = slice(a // BLOCK, -(-b // BLOCK))
        m = self.moments
        return {"exp_avg": m.exp_avg[a:b], "exp_avg_absmax": m.exp_avg_absmax[blocks],
                "exp_avg_sq": m.exp_avg_sq[a:b], "exp_avg_sq_absmax": m.exp_avg_sq_absmax[blocks]}

    def _absorb_fp32_state(self) -> None:
        """Quantize fp32 moments a load put in `state` (torch's load_state_dict, ddp.py load_pieces) into the run."""
        loaded = [p for p, s in self.state.items()
                  if torch.is_tensor(s.get("exp_avg")) and s["exp_avg"].is_floating_point()]
        if not loaded:
            return
        exp_avg, exp_avg_sq = self.moments.read(0, self.moments.numel)
        for p in loaded:
            a, b = self.offsets[p], self.offsets[p] + p.numel()
            exp_avg[a:b] = self.state[p]["exp_avg"].reshape(-1)
            exp_avg_sq[a:b] = self.state[p]["exp_avg_sq"].reshape(-1)
        self.moments.write(0, exp_avg, exp_avg_sq)
        self.steps = int(float(self.state[loaded[0]]["step"]))
        for p in loaded:
            self.state[p] = {"step": float(self.steps), **self._views(p)}

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step on every parameter with a gradient (the others' moments stay as they are)."""
        loss = None if closure is None else closure()
        self._absorb_fp32_state()
        stepped = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not stepped:
            return loss
        self.steps += 1
        pieces = [Piece(self.offsets[p], p.data.view(-1), p.grad.reshape(-1).float(), float(group["lr"]),
                        float(group["weight_decay"])) for p, group in stepped]
        group = self.param_groups[0]
        blockwise_adam_step(self.moments, pieces, step=self.steps, betas=tuple(group["betas"]), eps=group["eps"],
                            l2=self.l2)
        for p, _ in stepped:
            self.state[p] = {"step": float(self.steps), **self._views(p)}
        return loss

    def fp32_states(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Per parameter: step and its fp32 exp_avg / exp_avg_sq (dequantized copies), torch AdamW's names."""
        self._absorb_fp32_state()
        exp_avg, exp_avg_sq = self.moments.read(0, self.moments.numel)
        states = {}
        for p in self.offsets:
            a, b = self.offsets[p], self.offsets[p] + p.numel()
            states[p] = {"step": torch.tensor(float(self.steps)), "exp_avg": exp_avg[a:b].view_as(p).clone(),
                         "exp_avg_sq": exp_avg_sq[a:b].view_as(p).clone()}
        return states

    def state_dict(self) -> dict:
        """torch AdamW's layout: per parameter index, step and fp32 exp_avg / exp_avg_sq (dequantized)."""
        states = self.fp32_states()
        state = super().state_dict()
        for index, p in enumerate(self.offsets):
            state["state"][index] = states[p]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the fp32 moments quantized into the run (bit for bit at the same layout)."""
        super().load_state_dict(state_dict)
        self._absorb_fp32_state()
