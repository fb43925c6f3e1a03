"""ZeRO stages 1 and 2: optimizer state (1) and gradients too (2) partitioned
across ranks; every rank keeps the full parameters.

Parameters are laid out in reduce buckets (flat.py): consecutive parameters in
reverse registration order, which is about the order backward produces their
gradients, up to zero.reduce_bucket_size elements each, padded to the world
size. Parameters become views into their bucket's flat buffer, so a bucket's
all-gather after the step is one collective with no copies.

Stage 1: gradients accumulate in full flat buffers (the parameters' .grad are
views); at the accumulation boundary each bucket is reduce-scattered as soon as
backward finishes it (post-accumulate-grad hooks, launched in bucket order so
every rank issues the same collectives), and a rank keeps its chunk.
Stage 2: every micro-step, a finished bucket's gradients are copied into a
staging buffer, the .grad tensors dropped, and the bucket reduce-scattered
asynchronously into the rank's fp32 gradient shard; no full-size gradient
survives a micro-step.
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.distributed import DistInfo
from toolkit.runtime.communicator import Communicator
from toolkit.runtime.strategy import weak_method_hook
from toolkit.runtime.zero.flat import FlatGroup, bucket_params, decay_param_ids, muon_ids_for
from toolkit.runtime.zero.sharded import ShardedStrategy
from toolkit.specs import OptimizerSpec, ZeroSpec


class PartitionedStrategy(ShardedStrategy):
    """ZeRO stage 1 or 2 over the process group in `info`."""

    def __init__(self, model: nn.Module, zero: ZeroSpec, optimizer: OptimizerSpec, device: torch.device,
                 info: DistInfo, stage: int, comm: Communicator, grad_accum_steps: int = 1, grad_clip: float = 0.0):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dtype = named[0][1].dtype
        decay_ids = decay_param_ids(model)
        buckets = bucket_params(list(reversed(named)), zero.reduce_bucket_size)
        muon_ids = muon_ids_for(model, optimizer.type)
        groups = [FlatGroup(b, decay_ids, info.world_size, muon_ids) for b in buckets]
        super().__init__(zero, optimizer, device, info, groups, dtype, comm, grad_accum_steps, grad_clip)
        self.stage = stage
        self.model = model
        self.flat_params = []
        for g in groups:
            flat = torch.empty(g.padded_numel, dtype=dtype, device=device)
            g.flatten_into(flat, [p.detach() for p in g.params])
            g.point_params_at(flat)
            self.flat_params.append(flat)
        self.param_chunks = [flat[slice(*g.chunk_range(info.rank))] for g, flat in zip(groups, self.flat_params)]
        self.flat_grads: list[torch.Tensor] = []
        if stage == 1:  # full gradient buffers, .grad are views (accumulation happens in place)
            for g in groups:
                flat = torch.zeros(g.padded_numel, dtype=dtype, device=device)
                for p, view in zip(g.params, g.views(flat)):
                    p.grad = view
                self.flat_grads.append(flat)
        if stage == 1 and dtype == self.grad_dtype:  # the reduced chunk stays where it is, in the full buffer
            self.grad_shard = None
            self.grad_chunks = [flat[slice(*g.chunk_range(info.rank))] for g, flat in zip(groups, self.flat_grads)]
        else:
            self.grad_shard = torch.zeros(self.layout.numel, dtype=self.grad_dtype, device=device)
            self.grad_chunks = [self.layout.chunk_of(self.grad_shard, g) for g in range(len(groups))]
        self._init_master()
        self._group_of = {id(p): gi for gi, g in enumerate(groups) for p in g.params}
        self._reducing = False
        self._reset_round()
        for p in (p for g in groups for p in g.params):
            p.register_post_accumulate_grad_hook(weak_method_hook(self._on_grad_ready))

    # -- backward: bucketed reduce-scatter -------------------------------------------

    def _reset_round(self) -> None:
        self._missing = [len(g.params) for g in self.groups]
        self._launched = 0
        self._pending: list[tuple[int, object, torch.Tensor]] = []

    def begin_micro_step(self, boundary: bool) -> None:
        """Called before backward: stage 2 reduces every micro-step, stage 1 only at the boundary."""
        self._begin_round(boundary)
        self._reducing = self.stage == 2 or boundary
        self._reset_round()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._reducing:
            return
        g = self._group_of[id(param)]
        self._missing[g] -= 1
        # NOTE: launch strictly in bucket order so every rank issues the same collectives in the same order.
        while self._launched < len(self.groups) and self._missing[self._launched] == 0:
            self._launch(self._launched)

    def _launch(self, g: int) -> None:
        group, world = self.groups[g], self.info.world_size
        if self.stage == 1:
            source = self.flat_grads[g]
        else:
            source = torch.zeros(group.padded_numel, dtype=self.param_dtype, device=self.device)
            for p, view in zip(group.params, group.views(source)):
                if p.grad is not None:
                    view.copy_(p.grad)
                    p.grad = None  # the full-size gradient dies here
        self._launched = g + 1
        if not self.info.active:
            self._queue_reduced(g, None, source)
            return
        source.div_(world)  # NOTE: pre-divide: for power-of-two worlds the mean is exact in binary
        out = torch.empty(group.chunk, dtype=source.dtype, device=self.device)
        self._queue_reduced(g, self.comm.reduce_scatter_flat(out, source), out)

    def end_micro_step(self) -> None:
        """Called after backward: launch buckets whose gradients never came, wait, keep this rank's chunks."""
        if not self._reducing:
            return
        while self._launched < len(self.groups):
            self._launch(self._launched)
        self._drain(block=True)
        self._reset_round()
        self._reducing = False

    def _accept_reduced(self, g: int, out: torch.Tensor) -> None:
        target = self.grad_chunks[g]
        if self.stage == 2:  # accumulate over micro-steps
            target.add_(out.to(target.dtype))
        elif target.data_ptr() != out.data_ptr():
            target.copy_(out)

    # -- after the step: all-gather the new weights ------------------------------------

    def after_step(self) -> None:
        if not self.info.active:
            return
        per_piece = max(1, self.zero.allgather_bucket_size // self.info.world_size)
        works = []
        for g, flat in zip(self.groups, self.flat_params):
            lo, hi = g.chunk_range(self.info.rank)
            if g.chunk <= per_piece:
                works.append(self.comm.all_gather_flat(flat, flat[lo:hi].clone()))
                continue
            for a in range(0, g.chunk, per_piece):  # zero.allgather_bucket_size elements per collective
                b = min(a + per_piece, g.chunk)
                outs = [flat[k * g.chunk + a:k * g.chunk + b] for k in range(self.info.world_size)]
                works.append(self.comm.all_gather_list(outs, flat[lo + a:lo + b].clone()))
        for work in works:
            work.wait()

    def zero_grad(self) -> None:
        """Zero the gradient shard (and stage 1's full buffers, whose views the .grad are)."""
        for flat in self.flat_grads:
            flat.zero_()
        if self.grad_shard is not None:
            self.grad_shard.zero_()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by name (each rank has them all)."""
        return {slot.name: view.detach().clone() for g, flat in zip(self.groups, self.flat_params)
                for slot, view in zip(g.slots, g.views(flat))}

    # -- accounting ----------------------------------------------------------------------

    def param_tensors(self) -> list[torch.Tensor]:
        return list(self.flat_params)

    def grad_tensors(self) -> list[torch.Tensor]:
        return list(self.flat_grads) + ([self.grad_shard] if self.grad_shard is not None else [])
