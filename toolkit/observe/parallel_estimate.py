"""Per-rank memory of a tensor/pipeline/data-parallel layout (recipe.parallel), before running: the
busiest rank's model states and activations for any (dp, tp, pp, ZeRO stage), from the same formulas
as estimate.py.

Approximations (stated, not hidden): a rank holds n_layer / pp blocks with their matrices split over
tp, plus the whole embeddings and head (the first and last stages hold them; counting both bounds the
busiest rank from above); the blocks' activations divide by tp (the replicated norm inputs and residual
stream do not, so that share is a lower bound); the pipeline keeps min(pp, m) pipeline micro-batches in
flight under 1F1B and interleaved 1F1B and all m under GPipe, each micro_batch / m sequences.
"""
from __future__ import annotations

from dataclasses import replace

from toolkit.observe.estimate import (MemoryEstimate, estimate_activation_bytes, estimate_model_state_bytes,
                                      format_bytes, parameter_count, resolve_model_shape)
from toolkit.observe.estimate_input import EstimateInput
from toolkit.specs import ModelSpec, ParallelSpec


def parameters_per_rank(model: ModelSpec, parallel: ParallelSpec) -> int:
    """Parameters the busiest rank holds: its stage's blocks split over tp, plus embeddings and head."""
    model, tied = resolve_model_shape(model)
    outside = parameter_count(replace(model, n_layer=0), tied_embeddings=tied)
    blocks = parameter_count(model, tied_embeddings=tied) - outside
    return -(-blocks // parallel.model_ranks) + outside


def estimate_parallel_memory(model: ModelSpec, parallel: ParallelSpec, *, micro_batch: int, seq_len: int,
                             dtype: str, dp: int, stage: int) -> MemoryEstimate:
    """The busiest rank's model states and activations at (dp, parallel.tensor, parallel.pipeline, stage)."""
    states = estimate_model_state_bytes(parameters_per_rank(model, parallel), stage=stage, world_size=dp, dtype=dtype)
    shape, _ = resolve_model_shape(model)
    pp, m = parallel.pipeline, parallel.pipeline_microbatches if parallel.pipeline > 1 else 1
    in_flight = m if parallel.pipeline_schedule == "gpipe" else min(pp, m)
    stage_model = replace(shape, n_layer=max(shape.n_layer // pp, 1))
    per_chunk = estimate_activation_bytes(stage_model, micro_batch=max(micro_batch // m, 1), seq_len=seq_len,
                                          dtype=dtype)
    blocks = per_chunk.full - per_chunk.logits
    full = in_flight * (blocks // parallel.tensor + per_chunk.logits)
    checkpointed = in_flight * (per_chunk.checkpointed - per_chunk.logits) // parallel.tensor + in_flight * \
        per_chunk.logits
    return MemoryEstimate(stage, "none", states, type(per_chunk)(full=full, checkpointed=checkpointed,
                                                                 logits=in_flight * per_chunk.logits))


def format_parallel_estimate(inp: EstimateInput) -> str:
    """The lines `toolkit estimate` prints for an input with tensor/pipeline parallelism (the busiest rank)."""
    model, parallel, dp, stage = inp.model, inp.parallel, inp.world_size, inp.stage
    est = estimate_parallel_memory(model, parallel, micro_batch=inp.micro_batch, seq_len=inp.seq_len, dtype=inp.dtype,
                                   dp=dp, stage=stage)
    ranks = dp * parallel.model_ranks
    return "\n".join([
        f"layout: dp {dp} x tp {parallel.tensor} x pp {parallel.pipeline} = {ranks} ranks, zero stage {stage}, "
        f"{parallel.pipeline_schedule} over {parallel.pipeline_microbatches} micro-batches" if parallel.pipeline > 1
        else f"layout: dp {dp} x tp {parallel.tensor} = {ranks} ranks, zero stage {stage}",
        f"per rank (the busiest): {parameters_per_rank(model, parallel):,} parameters; model states "
        f"{format_bytes(est.states.gpu)}; activations {format_bytes(est.activations.full)} "
        f"(checkpointed {format_bytes(est.activations.checkpointed)}); total {format_bytes(est.total)}"])
