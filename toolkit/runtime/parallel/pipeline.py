"""Pipeline parallelism for the GPT-2 and Llama families on torch.distributed.pipelining.

The transformer blocks split into equal consecutive runs, one per stage (two per rank, v = 0 and 1, for
interleaved 1F1B: rank r holds stages r and r + pp). Every rank keeps the transformers model object but
only its own blocks (the others are dropped from the ModuleList without renumbering, so parameter names
are the full model's and checkpoints stay layout-independent); the first stage keeps the embeddings,
the last the final norm and LM head. GPT-2 ties its LM head to the token embedding: every stage keeps
`wte` (the last one needs it as the head) and strategy.py sums its gradient over the pipeline.

A `StageModule` runs one stage's forward (what the model's own forward does, cut at the stage's
borders); the schedules (GPipe, 1F1B, interleaved 1F1B) come from torch.distributed.pipelining. The loss
of each pipeline micro-batch is the engine's token cross-entropy times `loss_factor` (loss scale /
(accumulation steps x micro-batches), so gradients accumulate as a sum: `scale_grads=False`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from toolkit.models.forward import IGNORE_INDEX
from toolkit.runtime.parallel.tensor_parallel import blocks_of

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out  # transformers < 5.2x blocks return tuples


class StageModule(nn.Module):
    """One pipeline stage of a GPT-2 or Llama causal LM: token ids or hidden states in, hidden states or
    logits out."""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool):
        super().__init__()
        self.model, self.layers, self.first, self.last = model, layers, first, last
        self.gpt2 = hasattr(model, "transformer")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = blocks_of(self.model)[1]._modules
        # NOTE: no attention mask: transformers' sdpa attention is then causal (is_causal), as the whole
        # model's forward is for unpadded token ids.
        if self.gpt2:
            t = self.model.transformer
            if self.first:
                x = t.drop(t.wte(x) + t.wpe(torch.arange(x.size(1), device=x.device)))
            for i in self.layers:
                x = _hidden(blocks[str(i)](x))
            return self.model.lm_head(t.ln_f(x)) if self.last else x
        m = self.model.model
        if self.first:
            x = m.embed_tokens(x)
        positions = torch.arange(x.size(1), device=x.device).unsqueeze(0)
        rotary = m.rotary_emb(x, positions)
        for i in self.layers:
            x = _hidden(blocks[str(i)](x, attention_mask=None, position_ids=positions, position_embeddings=rotary))
        return self.model.lm_head(m.norm(x)) if self.last else x


def stage_indices(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The pipeline stages this rank runs: its own, or (interleaved 1F1B) rank r and r + pp."""
    return [pp_rank, pp_rank + pp] if schedule == "interleaved_1f1b" else [pp_rank]


def prune_to_stages(model: nn.Module, stages: list[int], n_stages: int) -> list[StageModule]:
    """Drop the blocks, embeddings and head this rank's stages do not run (in place); one module per stage."""
    prefix, blocks = blocks_of(model)
    n_layer = len(blocks)
    per_stage = n_layer // n_stages
    own = {s: list(range(s * per_stage, (s + 1) * per_stage)) for s in stages}
    keep = {str(i) for layers in own.values() for i in layers}
    for index in list(blocks._modules):
        if index not in keep:
            del blocks._modules[index]
    first, last = 0 in stages, n_stages - 1 in stages
    if hasattr(model, "transformer"):
        t = model.transformer
        if not first:
            t.wpe = None
        if not last:
            t.ln_f = None
    else:
        if not first:
            model.model.embed_tokens = None
        if not last:
            model.model.norm, model.lm_head = None, None
    return [StageModule(model, own[s], s == 0, s == n_stages - 1) for s in stages]


class PipelineRunner:
    """The schedule over this rank's stages: one call runs every pipeline micro-batch of one micro batch,
    forward and backward."""

    def __init__(self, stage_modules: list[StageModule], stages: list[int], n_stages: int, schedule: str,
                 microbatches: int, device: torch.device, pp_group):
        self.stages = [PipelineStage(module, s, n_stages, device, group=pp_group)
                       for module, s in zip(stage_modules, stages)]
        self.is_last = any(s == n_stages - 1 for s in stages)
        self.is_first = 0 in stages
        self.loss_factor = 1.0
        cls = SCHEDULES[schedule]
        stage_arg = self.stages if schedule == "interleaved_1f1b" else self.stages[0]
        self.schedule = cls(stage_arg, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False)
        self.forward_only = cls(stage_arg, n_microbatches=microbatches)  # no loss_fn: no backward (evaluation)
        self.microbatches = microbatches
        self.pp_group = pp_group

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        return loss * self.loss_factor

    def _shared(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss on every stage (each holds zero before: a sum over the pipeline)."""
        loss = loss.detach().float().reshape(1)
        dist.all_reduce(loss, group=self.pp_group)
        return loss[0]

    def _inputs(self, tokens: torch.Tensor) -> tuple:
        """The first stage's input ids, contiguous: torch 2.11's PipelineStage checks strides against its
        contiguous example and refuses the [:, :-1] view (2.13 accepts it)."""
        return (tokens[:, :-1].contiguous(),) if self.is_first else ()

    def train(self, tokens: torch.Tensor, loss_factor: float) -> torch.Tensor:
        """Forward and backward of one micro batch of token ids [micro, seq + 1]; its mean loss (the last
        stage's, on every stage), detached, fp32."""
        self.loss_factor = loss_factor / self.microbatches
        losses: list[torch.Tensor] = []
        inputs = self._inputs(tokens)
        self.schedule.step(*inputs, target=tokens[:, 1:] if self.is_last else None, losses=losses)
        if not self.is_last:
            return self._shared(torch.zeros((), device=tokens.device))
        return self._shared(torch.stack([loss.detach().float() for loss in losses]).sum()
                            / (self.loss_factor * self.microbatches))

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor) -> torch.Tensor:
        """The mean loss of one micro batch through the forward-only schedule (on every stage)."""
        inputs = self._inputs(tokens)
        logits = self.forward_only.step(*inputs)
        if not self.is_last:
            return self._shared(torch.zeros((), device=tokens.device))
        self.loss_factor = 1.0
        return self._shared(self._loss(logits, tokens[:, 1:]))
