"""The typed, frozen specs a `Recipe` is made of: one per recipe section, each
builder takes only its own. Built (and validated) by toolkit/recipe/assemble.py; the
meaning and default of every field is in schemas/recipe.schema.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    family: str
    size: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    intermediate_size: int
    max_positions: int
    vocab_size: int
    pretrained: Path | None
    dropout: float
    activation_checkpointing: bool
    pretrained_type: str | None = None  # a pretrained folder's config.json model_type ("qwen2", ...)
    reshaped: tuple[str, ...] = ()  # shape keys the recipe sets to other values than its size preset's

    @property
    def label(self) -> str:
        """What the model is, for people: `gpt2-tiny`, `llama-1b reshaped (n_layer 26, n_embd 3200)`, or
        `qwen2 from /path/to/folder` for a pretrained folder."""
        if self.pretrained is None and self.reshaped:
            changed = ", ".join(f"{k} {getattr(self, k)}" for k in self.reshaped)
            return f"{self.family}-{self.size} reshaped ({changed})"
        if self.pretrained is None:
            return f"{self.family}-{self.size}"
        return f"{self.pretrained_type or 'model'} from {self.pretrained}"


@dataclass(frozen=True)
class DataSpec:
    kind: str
    seq_len: int
    vocab_size: int  # the model's vocabulary: synthetic tokens, or the tokenizer's size
    seed: int
    # synthetic only (0 for real text)
    branching: int = 0
    num_samples: int = 0
    eval_samples: int = 0
    # text, jsonl, parquet only: paths with ${variables} expanded, absolute
    paths: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    field: str | None = None
    column: str | None = None
    errors: str = "strict"
    tokenizer: str | None = None
    tokenizer_path: Path | None = None
    validation_fraction: float = 0.0
    cache_dir: Path | None = None


@dataclass(frozen=True)
class BatchSpec:
    micro_batch_per_rank: int
    grad_accum_steps: int
    global_batch: int
    world_size: int


@dataclass(frozen=True)
class LossScaleSpec:
    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_loss_scale: float
    max_overflows_at_min_scale: int


@dataclass(frozen=True)
class PrecisionSpec:
    dtype: str
    fp16: LossScaleSpec


# zero.offload_update values whose CPU step lands one step late (zero/delayed_update.py); exact and overlapped
# step within their own optimizer step
DELAYED_UPDATES = ("delayed", "delayed_extrapolated")

# zero.offload_update overlapped with training.grad_clip > 0 (zero/speculation.py): the CPU step may step this share
# of an offloaded part's elements before the clip coefficient is known, keeping their states to roll back to
SPECULATED_SHARE = 0.5


@dataclass(frozen=True)
class ZeroSpec:
    stage: int
    offload_optimizer: str
    offload_ratio: float
    offload_param: str
    nvme_path: str | None
    reduce_bucket_size: int
    allgather_bucket_size: int
    prefetch_units: int
    overlap_comm: bool = True
    nvme_ratio: float = 1.0  # of the offloaded optimizer, the part in swap files (the rest: CPU memory)
    offload_update: str = "exact"  # overlapped: the CPU step starts during backward (zero/overlapped_update.py);
    # delayed: the CPU step of step t overlaps step t+1 (zero/delayed_update.py)
    offload_update_warmup: int = 100  # applied steps taken exactly before updates are delayed
    grad_dtype: str = "fp32"  # the reduced gradient shard (stages 1-3): fp32, or bf16 under bf16 states


@dataclass(frozen=True)
class ParallelSpec:
    """recipe.parallel: ranks per model replica along the tensor and pipeline dimensions (1, 1: data parallel only)."""
    tensor: int = 1
    pipeline: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_microbatches: int = 4

    @property
    def model_ranks(self) -> int:
        """Ranks holding one replica of the model: tensor x pipeline."""
        return self.tensor * self.pipeline

    @property
    def active(self) -> bool:
        """True when tensor or pipeline parallelism is on (else today's data-parallel path, unchanged)."""
        return self.model_ranks > 1


@dataclass(frozen=True)
class OptimizerSpec:
    type: str
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    implementation: str
    freeze_step: int = 100000  # onebit_adam's uncompressed warm-up (schema)
    # muon only (schema: the matrices' lr, momentum, Nesterov, Newton-Schulz steps, decay, per-shape lr rule)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_weight_decay: float = 0.0
    muon_adjust_lr: str = "original"
    muon_ns_dtype: str = "bf16"
    state_dtype: str = "fp32"  # bf16: bf16 weights (the master) and moments, stochastic rounding; int8: 8-bit moments


@dataclass(frozen=True)
class CommunicationSpec:
    simulated_link_gbps: float | None = None  # a simulated link speed (toolkit/runtime/communicator.py); None: the real one


@dataclass(frozen=True)
class SchedulerSpec:
    type: str
    warmup_num_steps: int
    warmup_type: str
    warmup_min_lr: float
    warmup_max_lr: float
    total_num_steps: int
    warmup_min_ratio: float
    cos_min_ratio: float
    # OneCycle and LRRangeTest only (the schema fills them for those types; DeepSpeed's defaults here)
    cycle_min_lr: float = 0.0
    cycle_max_lr: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: int | None = None  # None: cycle_first_step_size
    decay_step_size: int = 0
    decay_lr_rate: float = 0.0
    cycle_momentum: bool = False
    cycle_min_mom: float = 0.8
    cycle_max_mom: float = 0.9
    decay_mom_rate: float = 0.0
    lr_range_test_min_lr: float = 0.001
    lr_range_test_step_size: int = 2000
    lr_range_test_step_rate: float = 1.0
    lr_range_test_staircase: bool = False


@dataclass(frozen=True)
class TrainingSpec:
    max_steps: int
    grad_clip: float
    seed: int
    eval_interval: int
    eval_batches: int
    log_interval: int
    device: str
    compile: bool = False
    peak_tflops: float | None = None  # per device, for MFU; None: the datasheet table (toolkit/observe/flops.py)
    steps_per_epoch: int | None = None  # set when the recipe gives training.epochs (the progress line shows them)
    memory_check: str = "refuse"
    cpu_threads: int | str = "auto"


@dataclass(frozen=True)
class WandbSpec:
    mode: str
    project: str
    run_name: str | None


@dataclass(frozen=True)
class LoggingSpec:
    console: bool
    tensorboard: bool
    wandb: WandbSpec


@dataclass(frozen=True)
class CheckpointSpec:
    dir: str
    interval: int
    keep_last: int
    save_final: bool
    resume: str


@dataclass(frozen=True)
class KernelsSpec:
    adamw: str
    layernorm: str
    rmsnorm: str
    bias_gelu: str
    cross_entropy: str


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    source: Path | None
    resolved: dict = field(repr=False)  # the validated recipe with every default filled in
    hash: str
    model: ModelSpec
    data: DataSpec
    batch: BatchSpec
    precision: PrecisionSpec
    zero: ZeroSpec
    optimizer: OptimizerSpec
    scheduler: SchedulerSpec
    training: TrainingSpec
    logging: LoggingSpec
    checkpoint: CheckpointSpec
    kernels: KernelsSpec
    # Choices that run but may not be what the user meant, one line each naming the key; the CLI prints them.
    warnings: tuple[str, ...] = ()
    communication: CommunicationSpec = CommunicationSpec()
    parallel: ParallelSpec = ParallelSpec()

    @property
    def world_size(self) -> int:
        """Processes the run needs: data-parallel ranks (batch.world_size) x tensor x pipeline."""
        return self.batch.world_size * self.parallel.model_ranks

    def to_json(self) -> str:
        """The resolved recipe as written to <run_dir>/recipe.json: a recipe that reruns as it stands, with its hash."""
        return json.dumps({**self.resolved, "recipe_hash": self.hash}, indent=2) + "\n"
