"""The engine's strategy over a (pp, dp, tp) mesh: the Strategy of toolkit/runtime/strategy.py
(begin/end_micro_step, grads_overflow, scale_grads, clip_grad_norm, optimizer_step, zero_grad, the
checkpoint pieces) for a model that tensor_parallel.py sharded and pipeline.py cut into stages.

Gradients: each rank's are those of its stage's parameters (a DTensor's local shard under tensor
parallelism); at the accumulation boundary they are averaged over the data-parallel group, and GPT-2's
tied embedding is summed over the pipeline (the first stage's input use plus the last stage's head use).
The norm for clipping is global: each parameter counted once (a tensor shard by every tensor rank, a
replicated parameter by tensor rank 0, the tied embedding by stage 0), summed over the whole mesh.
The optimizer is the recipe's (optimizer.type adamw or adam, optimizer.implementation: torch's fused or
default step; toolkit.runtime.optim.build_optimizer), on each rank's local tensors, so each element sees
the one-process arithmetic. Under zero.stage 1 it is wrapped in torch's ZeroRedundancyOptimizer over the
dp group: each dp rank keeps the moments of about 1/dp of its local tensors, steps those and broadcasts
them (ZeRO-1, DeepSpeed's "3D").

Checkpoints are the ZeRO shard format (toolkit/checkpoint/zero_shards.py) with whole parameters: the
(dp 0, tp 0) rank of each stage writes its stage's parameters gathered over the tensor group, with the
optimizer moments (under ZeRO-1 broadcast from the dp rank that owns them), so a checkpoint loads at
any layout, stage 0 on one process included, and `toolkit export` reads it as it reads any sharded
checkpoint.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from toolkit.distributed import DistInfo, any_true
from toolkit.runtime.optim import build_optimizer, param_groups
from toolkit.runtime.parallel.mesh import ParallelMesh
from toolkit.runtime.parallel.tensor_parallel import ShardLayout
from toolkit.errors import UserError
from toolkit.runtime.parallel.pipeline import PipelineRunner
from toolkit.runtime.precision import autocast_context, has_inf_or_nan
from toolkit.runtime.strategy import StrategyBase
from toolkit.specs import OptimizerSpec

TIED_EMBEDDING = "transformer.wte.weight"  # GPT-2's token embedding, also its LM head


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class MeshStrategy(StrategyBase):
    """Data parallelism (zero.stage 0, or 1: optimizer states sharded) over the mesh's dp dimension, for a
    tensor- and/or pipeline-parallel model."""

    sharded_checkpoint = True  # whole parameters in ZeRO shard files (see the module docstring)

    def __init__(self, model: nn.Module, optimizer: OptimizerSpec, stage: int, device: torch.device, info: DistInfo,
                 mesh: ParallelMesh, layouts: dict[str, ShardLayout], full_shapes: dict[str, tuple[int, ...]],
                 adamw: str):
        self.model, self.device, self.info, self.mesh = model, device, info, mesh
        self.layouts, self.full_shapes = layouts, full_shapes
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        with torch.no_grad():  # the optimizer steps each rank's local tensors (aliases of the DTensors' storage)
            self._local_of = {id(p): _local(p) for p in self.params}
        groups = [{**g, "params": [self._local_of[id(p)] for p in g["params"]]}
                  for g in param_groups(model, optimizer.weight_decay)]
        self.stage = stage  # zero.stage 0 or 1 (recipe/assemble.py refuses more)
        # NOTE: `adamw` is torch's (the engine resolves the toolkit's AdamW kernel for stage 0 only)
        self.optimizer = build_optimizer(optimizer, groups, adamw,
                                         shard_group=mesh.group("dp") if self.stage == 1 else None)
        # the optimizer over the tensors this dp rank owns (ZeRO-1: the wrapped one)
        self._local_optimizer = self.optimizer.optim if self.stage == 1 else self.optimizer
        self._owner = self._moment_owners()
        self._steps = 0
        self._boundary = False
        # each parameter once in the global norm: shards on every tensor rank, the rest on tensor rank 0
        self._counted = [p for n, p in self.named
                         if (n in layouts or mesh.tp_rank == 0) and (n != TIED_EMBEDDING or mesh.pp_rank == 0)]

    def _moment_owners(self) -> dict[int, int]:
        """id(local tensor) -> the global rank holding its AdamW moments in this rank's dp group (stage 1)."""
        if self.stage == 0:
            return {}
        mine = {id(t) for g in self._local_optimizer.param_groups for t in g["params"]}
        owned = [i for i, (_, p) in enumerate(self.named) if id(self._local_of[id(p)]) in mine]
        everyone = [None] * self.mesh.dp
        dist.all_gather_object(everyone, (self.info.rank, owned), group=self.mesh.group("dp"))
        return {id(self._local_of[id(self.named[i][1])]): rank for rank, indices in everyone for i in indices}

    def describe(self) -> str:
        """One line for the start-up table."""
        what = ("stage 1 (optimizer states sharded, torch ZeroRedundancyOptimizer)" if self.stage == 1
                else "stage 0 (data parallel)")
        return f"{what} over dp {self.mesh.dp}; {self.mesh.describe()}"

    def describe_tiers(self) -> str:
        """One line for the start-up table: everything on the device, this rank's bytes (its shards and stages)."""
        from toolkit.observe.estimate import format_bytes

        mem = self.memory_bytes()
        return (f"params device ({format_bytes(mem['mem_params_bytes'])}); grads device "
                f"({format_bytes(mem['mem_grads_bytes'])}); optimizer states device "
                f"({format_bytes(mem['mem_optim_bytes'])})")

    @property
    def data_rank(self) -> int:
        """This rank's index along the mesh's dp dimension: tensor and pipeline ranks of a replica share data."""
        return self.mesh.dp_rank

    def expected_bytes_per_step(self, grad_accum_steps: int) -> dict[str, int]:
        """None by formula: DTensor and torch.distributed.pipelining issue the mesh's collectives themselves,
        outside the Communicator that counts (toolkit/runtime/communicator.py)."""
        return {}

    # -- gradients -----------------------------------------------------------------------

    def begin_micro_step(self, boundary: bool) -> None:
        """Called before backward: only the boundary micro-step communicates."""
        self._boundary = boundary

    def end_micro_step(self) -> None:
        """At the boundary: average gradients over dp, sum the tied embedding's over the pipeline."""
        if not self._boundary:
            return
        self._boundary = False
        for name, p in self.named:
            if p.grad is None and name == TIED_EMBEDDING and self.mesh.pp > 1:
                p.grad = torch.zeros_like(p)  # a middle stage holds it unused; it steps with the sum too
            if p.grad is None:
                continue
            grad = _local(p.grad)
            if name == TIED_EMBEDDING and self.mesh.pp > 1:
                dist.all_reduce(grad, group=self.mesh.group("pp"))
            if self.mesh.dp > 1:
                grad.div_(self.mesh.dp)
                dist.all_reduce(grad, group=self.mesh.group("dp"))

    def _grads(self, params=None) -> list[torch.Tensor]:
        return [_local(p.grad) for p in (params or self.params) if p.grad is not None]

    def grads_overflow(self) -> bool:
        """True when any rank's gradients hold an inf or NaN (the same answer everywhere)."""
        return any_true(has_inf_or_nan(self._grads()), self.info, self.device)

    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient by `factor`."""
        grads = self._grads()
        if grads:
            torch._foreach_mul_(grads, factor)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm over the whole mesh (each parameter once), clipped to max_norm (<= 0: measure)."""
        grads = self._grads(self._counted)
        square = sum((g.detach().float().pow(2).sum() for g in grads), torch.zeros((), device=self.device))
        total = square.double().reshape(1)
        dist.all_reduce(total)  # dp replicas hold the same averaged gradients: each counted dp times
        norm = (total[0] / self.mesh.dp).sqrt().float()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            grads = self._grads()
            if grads:
                torch._foreach_mul_(grads, coef)
        return norm

    def optimizer_step(self) -> None:
        """torch AdamW on this rank's local tensors."""
        for p in self.params:
            local = self._local_of[id(p)]
            if local is not p:
                local.grad = None if p.grad is None else _local(p.grad)
        self.optimizer.step()
        self._steps += 1

    def zero_grad(self) -> None:
        """Drop the gradients (the next backward writes them)."""
        for p in self.params:
            p.grad = None
            self._local_of[id(p)].grad = None

    # -- checkpoint pieces (toolkit/checkpoint/zero_shards.py) ----------------------------------

    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a parameter (or a moment) from its local shard: gathered over tp."""
        layout = self.layouts.get(name)
        if layout is None:
            return local
        shards = [torch.empty_like(local) for _ in range(self.mesh.tp)]
        dist.all_gather(shards, local.contiguous(), group=self.mesh.group("tp"))
        return layout.unshard(shards)

    def _owns(self, name: str) -> bool:
        return self.mesh.dp_rank == 0 and self.mesh.tp_rank == 0 and (name != TIED_EMBEDDING or self.mesh.pp_rank == 0)

    def owned_pieces(self) -> list[tuple[str, int, int, dict[str, torch.Tensor]]]:
        """Whole parameters and moments of this stage (on its dp 0, tp 0 rank; every rank gathers with it)."""
        pieces = []
        for name, p in self.named:
            local = self._local_of[id(p)].detach()
            state = self._local_optimizer.state.get(self._local_of[id(p)], {})
            views = {"param": local, "exp_avg": state.get("exp_avg", torch.zeros_like(local)),
                     "exp_avg_sq": state.get("exp_avg_sq", torch.zeros_like(local))}
            owner = self._owner.get(id(self._local_of[id(p)]))
            if owner is not None and self.mesh.dp > 1:  # ZeRO-1: the moments come from the dp rank that steps them
                for kind in ("exp_avg", "exp_avg_sq"):
                    views[kind] = views[kind].clone()
                    dist.broadcast(views[kind], src=owner, group=self.mesh.group("dp"))
            full = {kind: self._full(name, t).reshape(-1) for kind, t in views.items()}
            if self._owns(name):
                pieces.append((name, 0, full["param"].numel(), full))
        return pieces

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's whole shape by name (the whole model's, whatever this rank holds)."""
        return dict(self.full_shapes)

    def optimizer_steps(self) -> int:
        """AdamW steps applied so far (counted: under ZeRO-1 a dp rank may own no moments)."""
        return self._steps

    @torch.no_grad()
    def load_pieces(self, reader) -> None:
        """This rank's shards of whole parameters and moments from any checkpoint reader."""
        for name, p in self.named:
            local = self._local_of[id(p)]
            shape = self.full_shapes[name]

            def read(kind: str) -> torch.Tensor:
                full = reader.read(kind, name, 0, math.prod(shape)).view(shape)
                layout = self.layouts.get(name)
                part = layout.shard(full, self.mesh.tp, self.mesh.tp_rank) if layout is not None else full
                return part.to(local.device, local.dtype)
            local.copy_(read("param"))
            if reader.step and self._owner.get(id(local), self.info.rank) == self.info.rank:
                self._local_optimizer.state[local] = {"step": torch.tensor(float(reader.step)),
                                                      "exp_avg": read("exp_avg"), "exp_avg_sq": read("exp_avg_sq")}
        self._steps = reader.step

    def memory_bytes(self) -> dict:
        """Model-state bytes this rank holds now, from live tensors."""
        def size(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)
        locals_ = list(self._local_of.values())
        optim = [t for s in self._local_optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim()]
        params = size(locals_)
        return {"mem_params_bytes": params, "mem_grads_bytes": params, "mem_optim_bytes": size(optim),
                "mem_master_bytes": 0, "mem_offload_bytes": 0}


class PipelineStrategy(MeshStrategy):
    """The mesh's strategy when parallel.pipeline > 1: the pipeline schedule (pipeline.py) runs each micro
    batch's forward and backward together, so engine(batch) is for evaluation only."""

    def __init__(self, *args, pipeline: PipelineRunner, dtype: str):
        super().__init__(*args)
        self.pipeline, self.dtype = pipeline, dtype  # dtype: recipe.precision.dtype, for autocast

    def micro_batch_loss(self, batch, loss) -> torch.Tensor:
        """The loss through the forward-only schedule (evaluation); refused where gradients are on."""
        if torch.is_grad_enabled():
            raise UserError("engine(batch): with parallel.pipeline > 1 the schedule runs forward and backward "
                            "together; call engine.train_batch(micro_batches)")
        with autocast_context(self.dtype, self.device.type):
            return self.pipeline.evaluate(batch.to(self.device))

    def train_micro_batch(self, batch, loss, factor: float) -> torch.Tensor:
        """Forward and backward of the micro batch's pipeline micro-batches through the schedule; its mean loss."""
        with autocast_context(self.dtype, self.device.type):
            return self.pipeline.train(batch.to(self.device), factor)
