"""The peer every GPU benchmark compares against: a hand-written PyTorch training step.

bf16 autocast, transformers' GPT-2 with SDPA attention, F.cross_entropy on fp32 logits,
clip_grad_norm_ at 1.0, torch.optim.AdamW(fused=True) with the toolkit's decay groups:
what a careful user writes without any framework (benchmarks/end_to_end.py,
benchmarks/zero_gpu.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def plain_step(model, compiled: bool = False, lr: float = 6e-4, forward=None, fused: bool = True):
    """step(tokens) -> loss for `model` (fp32 weights): forward, backward, clip, AdamW.

    `forward`: what runs the model when it is wrapped (DDP, FSDP2); `fused=False` gives torch's
    foreach AdamW (for parameters the fused kernel does not take).
    """
    from toolkit.runtime.optim import param_groups

    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=fused)
    forward = forward if forward is not None else torch.compile(model) if compiled else model

    def step(tokens):
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            logits = forward(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
