"""Turn a freshly built GPT-2 or Llama model into this rank's part of a (pp, dp, tp) run: the mesh, the
pipeline stages (pipeline.py), the tensor-parallel shards (tensor_parallel.py) and the strategy the
engine drives (strategy.py: MeshStrategy, or PipelineStrategy, whose schedule runs each micro step)."""
from __future__ import annotations

import torch
from torch import nn

from toolkit.distributed import DistInfo
from toolkit.runtime.parallel.mesh import build_mesh
from toolkit.runtime.parallel.pipeline import PipelineRunner, prune_to_stages, stage_indices
from toolkit.runtime.parallel.strategy import MeshStrategy, PipelineStrategy
from toolkit.runtime.parallel.tensor_parallel import apply_tensor_parallel
from toolkit.specs import OptimizerSpec, ParallelSpec


def build_parallel(model: nn.Module, spec: ParallelSpec, family: str, zero_stage: int, optimizer: OptimizerSpec,
                   dtype: str, device: torch.device, info: DistInfo, adamw: str) -> MeshStrategy:
    """The strategy for `spec` over a model of `family` (gpt2, llama), cut and sharded in place; it steps
    `optimizer` with `adamw`, the engine's choice (toolkit.runtime.optim.choose_adamw), at `zero_stage` 0 or 1,
    and a pipeline's schedule runs under autocast to `dtype` (precision.dtype)."""
    mesh = build_mesh(spec, info, device)
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    modules = stages = None
    n_stages = spec.pipeline * (2 if spec.pipeline_schedule == "interleaved_1f1b" else 1)
    if spec.pipeline > 1:
        stages = stage_indices(mesh.pp_rank, spec.pipeline, spec.pipeline_schedule)
        modules = prune_to_stages(model, stages, n_stages)
    layouts = apply_tensor_parallel(model, family, mesh.tp_mesh, spec.tensor) if spec.tensor > 1 else {}
    args = (model, optimizer, zero_stage, device, info, mesh, layouts, full_shapes, adamw)
    if spec.pipeline == 1:
        return MeshStrategy(*args)
    runner = PipelineRunner(modules, stages, n_stages, spec.pipeline_schedule, spec.pipeline_microbatches,
                            device, mesh.group("pp"))
    return PipelineStrategy(*args, pipeline=runner, dtype=dtype)
