"""recipe.parallel: the checks that tie tensor and pipeline parallelism to the world size, the model's
shape, the batch and the ZeRO stage, and the `ParallelSpec` they build. Torch-free (`toolkit validate`).

The data-parallel size is world / (tensor x pipeline); the batch triple is resolved over it
(toolkit/recipe/checks.py resolve_batch), so batch.world_size means data-parallel ranks.
"""
from __future__ import annotations

from toolkit.specs import BatchSpec, ModelSpec, ParallelSpec


def parallel_spec(parallel: dict, zero: dict, model: ModelSpec | None, world: int
                  ) -> tuple[ParallelSpec, int, list[str]]:
    """(spec, data-parallel size, errors) for recipe.parallel at `world` processes."""
    spec = ParallelSpec(**parallel)
    tp, pp = spec.tensor, spec.pipeline
    if not spec.active:
        return spec, world, []
    errors = []
    if world % spec.model_ranks:
        errors.append(f"recipe.parallel: tensor {tp} x pipeline {pp} = {spec.model_ranks} ranks per model replica "
                      f"do not divide the world size {world}; launch a multiple of {spec.model_ranks} processes "
                      f"(--nproc, torchrun) or pass --world-size")
    if pp > 1 and zero["stage"] >= 2:
        errors.append(f"recipe.zero.stage: {zero['stage']} with parallel.pipeline {pp}: gradients and parameters "
                      "partitioned across data-parallel ranks do not fit the pipeline's micro-batch schedule (DeepSpeed "
                      "refuses it too); use zero.stage 0 or 1")
    elif zero["stage"] >= 2:
        errors.append(f"recipe.zero.stage: {zero['stage']} with parallel tensor {tp}: the data-parallel dimension of a "
                      "mesh shards optimizer states (stage 1) but not gradients or parameters; use zero.stage 0 or 1")
    if zero["offload_optimizer"] != "none":
        errors.append(f"recipe.zero.offload_optimizer: {zero['offload_optimizer']!r} with parallel tensor {tp} / "
                      f"pipeline {pp}: a mesh steps its optimizer on the device; set it to 'none'")
    if model is not None:
        errors += _model_errors(spec, model)
    return spec, max(world // spec.model_ranks, 1), errors


def _model_errors(spec: ParallelSpec, model: ModelSpec) -> list[str]:
    """The model's shape against the split: heads and MLP width by tensor, layers by pipeline stages."""
    if model.pretrained is not None:
        return ["recipe.parallel: tensor/pipeline parallelism splits the gpt2 and llama families the recipe builds, "
                f"not a pretrained folder ({model.pretrained}); set parallel.tensor and parallel.pipeline to 1"]
    errors = []
    tp, pp = spec.tensor, spec.pipeline
    width = model.intermediate_size or 4 * model.n_embd
    for key, value in (("n_head", model.n_head), ("n_kv_head", model.n_kv_head if model.family == "llama" else
                                                    model.n_head), ("intermediate_size", width)):
        if value % tp:
            errors.append(f"recipe.model.{key}: {value} is not divisible by parallel.tensor {tp} (each tensor-parallel "
                          "rank holds an equal part)")
    stages = pp * (2 if spec.pipeline_schedule == "interleaved_1f1b" else 1)
    if pp > 1 and model.n_layer % stages:
        errors.append(f"recipe.model.n_layer: {model.n_layer} layers do not split into {stages} equal pipeline stages "
                      f"(parallel.pipeline {pp}, schedule {spec.pipeline_schedule})")
    return errors


def pipeline_batch_errors(spec: ParallelSpec, batch: BatchSpec | None) -> list[str]:
    """batch.micro_batch_per_rank must cut into parallel.pipeline_microbatches equal pipeline micro-batches."""
    if batch is None or spec.pipeline == 1:
        return []
    m = spec.pipeline_microbatches
    errors = []
    if batch.micro_batch_per_rank % m:
        errors.append(f"recipe.batch.micro_batch_per_rank: {batch.micro_batch_per_rank} is not divisible by "
                      f"parallel.pipeline_microbatches {m}")
    if spec.pipeline_schedule == "interleaved_1f1b" and m % spec.pipeline:
        errors.append(f"recipe.parallel.pipeline_microbatches: {m} must be a multiple of parallel.pipeline "
                      f"{spec.pipeline} for interleaved_1f1b")
    return errors
