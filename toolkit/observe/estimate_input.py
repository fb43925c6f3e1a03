"""The estimators' one input: what they read of a recipe for one rank (`EstimateInput.from_recipe` is the one
place a recipe becomes it). `toolkit estimate`, the calibrated peak (peak.py, which the pre-flight's memory fit
and `toolkit tune` read), the tier table (tiers.py), the parallel layout (parallel_estimate.py) and the dry run
all start from it; the formulas it feeds are estimate.py's. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from toolkit.observe.estimate import (MemoryEstimate, ModelStateBytes, estimate_memory, estimate_model_state_bytes,
                                      muon_parameter_count, parameter_count, resolve_model_shape)
from toolkit.specs import ModelSpec, ParallelSpec, Recipe


@dataclass(frozen=True)
class EstimateInput:
    """What the estimators read of a recipe for one rank: the model, the batch, the precision, ZeRO's stage and
    offload tiers, the fused kernels and the parallel layout (build it with `from_recipe`)."""

    model: ModelSpec
    micro_batch: int
    seq_len: int
    dtype: str
    world_size: int  # data-parallel ranks (recipe.batch.world_size)
    stage: int = 0
    grad_accum_steps: int = 1
    offload_optimizer: str = "none"
    offload_param: str = "none"
    offload_ratio: float = 1.0
    nvme_ratio: float = 1.0
    vocab_size: int | None = None  # data.vocab_size: the tokenizer's, where it differs from the model's
    fused: tuple[bool, bool, bool] = (True, True, True)  # the (norm, GELU, cross-entropy) kernels not `off`
    token_buffer_bytes: int = 0  # the synthetic data's in-memory token tensors
    parallel: ParallelSpec = ParallelSpec()
    optimizer: str = "adamw"  # optimizer.type: muon keeps one moment for the block matrices
    state_dtype: str = "fp32"  # optimizer.state_dtype: bf16 keeps the weights (the master) and moments in 2 bytes;
    # int8 keeps the moments in 1 byte each plus an fp32 scale per 256 elements
    offload_update: str = "exact"  # zero.offload_update: delayed adds host copies of gradients and weights
    grad_dtype: str = "fp32"  # zero.grad_dtype: bf16 halves the reduced gradient shard (stages 1-3)
    clipped: bool = False  # training.grad_clip > 0: an overlapped update keeps rollback copies (zero/speculation.py)

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> EstimateInput:
        """The estimators' input for one rank of `recipe` (reads no file: a pretrained shape is read on first use)."""
        m, d, b, z, k = recipe.model, recipe.data, recipe.batch, recipe.zero, recipe.kernels
        norm = k.layernorm if m.family == "gpt2" else k.rmsnorm
        # NOTE: the synthetic chain holds its tokens as int64 tensors, seq_len + 1 per sample
        # (toolkit/data/batches.py); real text reads its token files a window at a time (num_samples 0).
        tokens = (d.num_samples + d.eval_samples) * (d.seq_len + 1) * 8
        return cls(model=m, micro_batch=b.micro_batch_per_rank, seq_len=d.seq_len, dtype=recipe.precision.dtype,
                   world_size=b.world_size, stage=z.stage, grad_accum_steps=b.grad_accum_steps,
                   offload_optimizer=z.offload_optimizer, offload_param=z.offload_param,
                   offload_ratio=z.offload_ratio, nvme_ratio=z.nvme_ratio, vocab_size=d.vocab_size,
                   fused=(norm != "off", k.bias_gelu != "off", k.cross_entropy != "off"),
                   token_buffer_bytes=tokens, parallel=recipe.parallel, optimizer=recipe.optimizer.type,
                   state_dtype=recipe.optimizer.state_dtype, offload_update=z.offload_update,
                   grad_dtype=z.grad_dtype, clipped=recipe.training.grad_clip > 0)

    @cached_property
    def _resolved(self) -> tuple[ModelSpec, bool | None]:
        return resolve_model_shape(self.model)

    @property
    def shape(self) -> ModelSpec:
        """The model's shape: a pretrained folder's config.json (read once), else the spec as is."""
        return self._resolved[0]

    @property
    def tied(self) -> bool | None:
        """Whether the head shares the embedding's weights (None: the family's default)."""
        return self._resolved[1]

    @cached_property
    def num_params(self) -> int:
        """The model's parameter count, from its shape."""
        return parameter_count(self.shape, tied_embeddings=self.tied)

    @property
    def muon_params(self) -> int:
        """Parameters Muon orthogonalizes (optimizer.type muon; 0 otherwise)."""
        return muon_parameter_count(self.shape) if self.optimizer == "muon" else 0

    def model_states(self, num_params: int | None = None, offload_ratio: float | None = None) -> ModelStateBytes:
        """Per-rank model-state bytes at this stage and optimizer offload, for `num_params` (default the model's)."""
        return estimate_model_state_bytes(self.num_params if num_params is None else num_params, stage=self.stage,
                                          world_size=self.world_size, dtype=self.dtype,
                                          offload=self.offload_optimizer,
                                          offload_ratio=self.offload_ratio if offload_ratio is None else offload_ratio,
                                          muon_params=self.muon_params, state_dtype=self.state_dtype,
                                          grad_dtype=self.grad_dtype)

    def memory(self, stage: int, offload: str = "none") -> MemoryEstimate:
        """Model states and activations of one rank at `stage` and `offload` (the rest as this input says)."""
        return estimate_memory(self.model, micro_batch=self.micro_batch, seq_len=self.seq_len, dtype=self.dtype,
                               world_size=self.world_size, stage=stage, offload=offload,
                               offload_ratio=self.offload_ratio, muon_params=self.muon_params,
                               state_dtype=self.state_dtype, grad_dtype=self.grad_dtype)
