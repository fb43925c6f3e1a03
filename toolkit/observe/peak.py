"""One rank's memory peak during training, predicted from a recipe: the number the run's memory line
will show (on CUDA the allocator's max allocated and max reserved bytes; on the CPU the process's
peak resident set). `toolkit estimate`, the pre-flight check, `toolkit tune` and the tutorials all
read it from here.

The terms: the model states where the engine keeps them (toolkit/observe/tiers.py), the saved
activations (estimate.py), and what the step adds at its peak moment. The committed calibration
tables (benchmarks/memory_calibration/*.jsonl, measured by benchmarks/memory_calibration.py) hold
the prediction to CALIBRATION_TOLERANCE of measured, row by row (tests/observe/test_memory_calibration.py).

Torch-free, like estimate.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from toolkit.observe.estimate import estimate_memory, parameter_count, resolve_model_shape
from toolkit.observe.tiers import estimate_tiers
from toolkit.specs import Recipe

CALIBRATION_TOLERANCE = 0.10  # |predicted / measured - 1| allowed for each calibration row


@dataclass(frozen=True)
class PeakPrediction:
    """One rank's predicted peak, with the terms it is made of."""

    states: int          # model states on the training device (params, grads, optimizer, master)
    activations: int     # saved activations of one micro batch (checkpointed when the recipe says so)
    transient: int       # what the peak moment adds on top: logits and loss buffers, the gradient in flight
    allocated: int       # the allocator's max allocated bytes (CUDA) or the process's peak RSS (CPU)
    reserved: int        # the allocator's max reserved bytes (CUDA); the same as allocated on the CPU
    host: int            # CPU memory besides: offloaded optimizer and parameters


def predict_peak(recipe: Recipe, *, on_cuda: bool) -> PeakPrediction:
    """The predicted peak of one rank of `recipe` on a CUDA device (`on_cuda`) or the CPU."""
    m, d, b, z = recipe.model, recipe.data, recipe.batch, recipe.zero
    dtype = recipe.precision.dtype
    shape, tied = resolve_model_shape(m)
    n_params = parameter_count(shape, tied_embeddings=tied)
    tiers = estimate_tiers(n_params, stage=z.stage, world_size=b.world_size, dtype=dtype,
                           offload_optimizer=z.offload_optimizer, offload_param=z.offload_param,
                           offload_ratio=z.offload_ratio, nvme_ratio=z.nvme_ratio)
    est = estimate_memory(m, micro_batch=b.micro_batch_per_rank, seq_len=d.seq_len, dtype=dtype,
                          world_size=b.world_size, stage=z.stage)
    activations = est.activations.checkpointed if m.activation_checkpointing else est.activations.full
    transient = 0
    allocated = tiers.gpu + activations + transient
    return PeakPrediction(tiers.gpu, activations, transient, allocated, allocated, tiers.cpu)


def compare_row(row: dict) -> dict:
    """A calibration row's measured peak beside the prediction for its recipe (and the ratio)."""
    from toolkit.recipe.load import load_recipe

    recipe = load_recipe(row["recipe"], row["overrides"])
    cuda = "cpu" not in row["device"]
    p = predict_peak(recipe, on_cuda=cuda)
    measured = row["mem_peak_bytes"]
    return {"measured": measured, "predicted": p.allocated, "ratio": p.allocated / measured,
            "measured_reserved": row.get("mem_reserved_peak_bytes") or 0, "predicted_reserved": p.reserved,
            "prediction": p}
