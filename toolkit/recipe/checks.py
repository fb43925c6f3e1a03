"""Semantic checks beyond what the schema can say that build no spec: the step count,
the rules that join sections (offload and stage, sizes, precision and device), the
pipeline's cut of the batch, warnings, and the world size. Each returns error (or
warning) lines. The checks that come with building a spec (the batch triple, the
model's shape, the data section, recipe.parallel) are in assemble.py.
"""
from __future__ import annotations

import math
import os
import shutil

from toolkit.recipe.schema import load_schema, section_defaults
from toolkit.specs import DELAYED_UPDATES, BatchSpec, ParallelSpec


def training_max_steps(training: dict, data: dict, batch: BatchSpec) -> tuple[int, list[str]]:
    """The run's length in optimizer steps: training.max_steps, or training.epochs over synthetic data."""
    if "max_steps" in training:
        return int(training["max_steps"]), []
    if data["kind"] != "synthetic":
        return 0, [f"recipe.training.epochs: needs data.kind synthetic (a {data['kind']} corpus's sequence count is "
                   "known only once it is tokenized); give training.max_steps"]
    return max(math.ceil(training["epochs"] * steps_per_epoch(data, batch)), 1), []


def steps_per_epoch(data: dict, batch: BatchSpec) -> int:
    """Optimizer steps in one pass over synthetic data: the whole global batches that fit (the stream drops the rest)."""
    return data["num_samples"] // batch.global_batch


def overlapped_update_errors(r: dict) -> list[str]:
    """What keeps zero.offload_update overlapped from giving exact mode's results for the resolved recipe `r`, one
    error line per key (none: it may step overlapped). The thread steps each bucket during backward, before anything
    global about the step is known."""
    errors = []
    # clipping: the pieces speculate on the coefficient and roll back from saved states (runtime/zero/speculation.py),
    # which needs the states in memory as a master and two moments
    unsaved = ("the optimizer in swap files (zero.offload_optimizer 'nvme')" if r["zero"]["offload_optimizer"] == "nvme"
               else "int8 moments (optimizer.state_dtype 'int8')" if r["optimizer"]["state_dtype"] == "int8" else None)
    if r["training"]["grad_clip"] > 0 and unsaved:
        errors.append(f"recipe.training.grad_clip: {r['training']['grad_clip']:g} with zero.offload_update "
                      "'overlapped': the CPU step starts during backward, before the global gradient norm exists, and "
                      f"its speculation cannot save {unsaved} to roll back to; set training.grad_clip 0, or "
                      "zero.offload_update 'exact'")
    if r["precision"]["dtype"] == "fp16":
        errors.append("recipe.precision.dtype: 'fp16' with zero.offload_update 'overlapped': the CPU step starts "
                      "during backward, before the loss scaler's overflow check has seen every gradient; use "
                      "'bf16', or zero.offload_update 'exact'")
    return errors


def cross_section_errors(r: dict, given: dict, batch: BatchSpec, max_steps: int) -> list[str]:
    """The rules that join keys of different sections (scheduler, zero offload, data sizes, precision, device).

    `r` has the schema defaults filled in; `given` is the recipe as written."""
    errors = []
    sched = r["scheduler"]
    if sched["type"] != "constant":
        total = sched.get("total_num_steps")
        if total is not None and total <= sched["warmup_num_steps"]:
            errors.append(f"recipe.scheduler.total_num_steps: {total} must exceed warmup_num_steps "
                          f"{sched['warmup_num_steps']}")
    zero = r["zero"]
    if zero["offload_optimizer"] != "none" and zero["stage"] < 1:
        errors.append(f"recipe.zero.offload_optimizer: {zero['offload_optimizer']!r} needs zero.stage >= 1 (stage is 0)")
    if zero["offload_ratio"] != 1 and zero["offload_optimizer"] == "none":
        errors.append(f"recipe.zero.offload_ratio: {zero['offload_ratio']} needs zero.offload_optimizer "
                      "'cpu' (it is the part of the optimizer kept in CPU memory) or 'nvme' (in swap files)")
    if zero["nvme_ratio"] != 1 and zero["offload_optimizer"] != "nvme":
        errors.append(f"recipe.zero.nvme_ratio: {zero['nvme_ratio']} needs zero.offload_optimizer 'nvme' (it is the "
                      "part of the offloaded optimizer kept in swap files; the rest stays in CPU memory)")
    if zero["offload_update"] != "exact" and zero["offload_optimizer"] == "none":
        errors.append(f"recipe.zero.offload_update: {zero['offload_update']!r} moves the CPU optimizer step (under "
                      "the backward or the next step), so it needs zero.offload_optimizer 'cpu' or 'nvme' (it is 'none')")
    if zero["offload_update"] == "overlapped" and zero["offload_optimizer"] != "none":
        errors += overlapped_update_errors(r)
    if zero["offload_param"] != "none" and zero["stage"] != 3:
        errors.append(f"recipe.zero.offload_param: {zero['offload_param']!r} needs zero.stage 3 (stage is "
                      f"{zero['stage']}; only stage 3 partitions the parameters)")
    nvme = [key for key in ("offload_optimizer", "offload_param") if zero[key] == "nvme"]
    if nvme and not zero["nvme_path"]:
        errors.append(f"recipe.zero.nvme_path: needed by zero.{nvme[0]} 'nvme' (a folder for the swap files)")
    mesh = r["parallel"]["tensor"] * r["parallel"]["pipeline"] > 1  # its DTensors reduce their own gradients
    if r["optimizer"]["type"] == "onebit_adam" and (r["zero"]["stage"] != 0 or r["precision"]["dtype"] == "fp16" or mesh):
        what = (f"zero.stage {r['zero']['stage']}" if r["zero"]["stage"] != 0 else "parallel.tensor/pipeline > 1"
                if mesh else "precision.dtype 'fp16'")
        errors.append(f"recipe.optimizer.type: 'onebit_adam' runs on zero.stage 0 in fp32 or bf16, not with {what} "
                      "(as DeepSpeed's 1-bit Adam, it replaces stage 0's gradient all-reduce); use 'adamw' there")
    # Muon offloaded (cpu or nvme, any offload_ratio and offload_param) steps exactly: the delayed update's thread
    # would run its all-gathers beside the training thread's collectives
    muon_delayed = zero["offload_optimizer"] != "none" and zero["offload_update"] != "exact"
    if r["optimizer"]["type"] == "muon" and (muon_delayed or mesh):
        what = ("parallel.tensor/pipeline > 1 (its local shards are not whole matrices)" if mesh else
                f"zero.offload_update {zero['offload_update']!r} (its gathers would run on the update's thread; "
                "use 'exact')")
        errors.append(f"recipe.optimizer.type: 'muon' runs at zero.stage 0-3, on the device or offloaded, not with "
                      f"{what}")
    errors += state_dtype_errors(r, mesh)
    if zero["grad_dtype"] != "fp32":
        needs = ("zero.stage 1-3 (stage 0's gradients are the weights' own)" if zero["stage"] == 0 else
                 f"optimizer.state_dtype 'bf16' (it is {r['optimizer']['state_dtype']!r})"
                 if r["optimizer"]["state_dtype"] != "bf16" else "")
        if needs:
            errors.append(f"recipe.zero.grad_dtype: {zero['grad_dtype']!r} needs {needs}")
    data, training = r["data"], r["training"]
    if data["kind"] != "synthetic":
        pass  # a real corpus's sizes are checked when it is read (toolkit/data/batches.py)
    elif training["eval_batches"] > 0 and data["eval_samples"] < batch.micro_batch_per_rank:
        errors.append(f"recipe.data.eval_samples: {data['eval_samples']} is fewer than one micro batch "
                      f"({batch.micro_batch_per_rank}); add samples or set training.eval_batches to 0")
    if data["kind"] == "synthetic" and data["num_samples"] < batch.global_batch:
        errors.append(f"recipe.data.num_samples: {data['num_samples']} is fewer than one global batch "
                      f"({batch.global_batch})")
    if r["precision"]["dtype"] == "fp16" and training["device"] == "cpu":
        errors.append("recipe.precision.dtype: 'fp16' needs a CUDA device but training.device is 'cpu'; "
                      "use 'bf16' (or 'fp32') on a CPU")
    fp16_defaults = section_defaults(load_schema()["properties"]["precision"]["properties"]["fp16"])
    changed = [k for k, v in given.get("precision", {}).get("fp16", {}).items() if v != fp16_defaults.get(k)]
    if r["precision"]["dtype"] != "fp16" and changed:
        errors.append(f"recipe.precision.fp16.{changed[0]}: loss scaling applies only to precision.dtype 'fp16'")
    return errors


def state_dtype_errors(r: dict, mesh: bool) -> list[str]:
    """optimizer.state_dtype bf16 and int8 are built for zero.stage 0-3 with AdamW/Adam, the states on the device,
    in CPU memory or in swap files (bf16 needs bf16 precision), with any zero.offload_param: one line per combination
    refused."""
    opt = r["optimizer"]
    dtype = opt["state_dtype"]
    if dtype == "fp32":
        return []
    errors = []
    # NOTE: every offload tier is built: bf16 through the CPU Adam kernel's bf16 step, int8 moments through torch ops
    if opt["type"] in ("muon", "onebit_adam"):
        errors.append(f"recipe.optimizer.state_dtype: {dtype!r} steps optimizer.type adamw or adam, not "
                      f"{opt['type']!r} (not built yet); use 'fp32'")
    if mesh:
        errors.append(f"recipe.optimizer.state_dtype: {dtype!r} is not built for parallel.tensor/pipeline > 1; "
                      "use 'fp32'")
    if dtype == "bf16" and r["precision"]["dtype"] != "bf16":
        errors.append(f"recipe.optimizer.state_dtype: 'bf16' keeps the weights in bf16, so it needs "
                      f"precision.dtype 'bf16' (not {r['precision']['dtype']!r})")
    return errors


def recipe_warnings(r: dict, given: dict, max_steps: int) -> list[str]:
    """Choices that run but may not be what the user meant, one line each (`toolkit validate` and `run` print them).

    `r` has the schema defaults filled in; `given` is the recipe as written.
    """
    warnings = []
    sched, lr = r["scheduler"], r["optimizer"]["lr"]
    if sched["type"] != "constant" and sched["warmup_num_steps"] >= max_steps:
        # NOTE: DeepSpeed accepts this too; a short trial run of a shipped recipe is the usual cause.
        peak = sched.get("warmup_max_lr", lr) if sched["type"] != "WarmupCosineLR" else lr
        warnings.append(f"recipe.scheduler.warmup_num_steps: {sched['warmup_num_steps']} is not shorter than the run "
                        f"({max_steps} optimizer steps): the schedule is cut at the run's end, still warming up "
                        f"(the lr never reaches {peak:g})")
    if sched["type"] == "WarmupDecayLR" and "warmup_max_lr" not in given.get("scheduler", {}) \
            and sched["warmup_max_lr"] != lr:
        warnings.append(f"recipe.scheduler.warmup_max_lr: not given, so WarmupDecayLR warms up to "
                        f"{sched['warmup_max_lr']:g} (DeepSpeed's default), not optimizer.lr {lr:g}; set it")
    zero = r["zero"]
    if zero["offload_update"] in DELAYED_UPDATES and sched["type"] != "constant" \
            and zero["offload_update_warmup"] < sched["warmup_num_steps"]:
        # NOTE: measured (benchmarks/RESULTS.md "Delayed offload update"): on python-stdlib a delay from step 10 of
        # a 50-step lr warm-up ended 25.7% above exact offload's held-out loss after 1,000 steps
        warnings.append(f"recipe.zero.offload_update_warmup: {zero['offload_update_warmup']} is shorter than "
                        f"scheduler.warmup_num_steps {sched['warmup_num_steps']}: stale gradients while the lr still "
                        "rises cost the most held-out loss (benchmarks/RESULTS.md); start the delay after the warm-up")
    adamw = r["kernels"]["adamw"]
    if adamw != "auto":  # NOTE: kept for old recipes; toolkit/runtime/optim.py adamw_implementation reads it
        meaning = ("reads as optimizer.implementation 'torch_fused'" if adamw == "off" else
                   "still makes the toolkit's AdamW kernel required where optimizer.implementation takes it")
        warnings.append(f"recipe.kernels.adamw: deprecated, recipe.optimizer.implementation decides the AdamW; "
                        f"'{adamw}' {meaning}")
    return warnings


def gpu_driver_visible() -> bool:
    """True when this machine shows an NVIDIA or ROCm GPU driver: a cheap look that imports no torch."""
    return (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/kfd")
            or shutil.which("nvidia-smi") is not None)


def fp16_device_warning(dtype: str, device: str) -> str | None:
    """`validate`'s warning for fp16 on 'auto' where no GPU driver shows (no torch import: a cheap look)."""
    if dtype != "fp16" or device != "auto" or gpu_driver_visible():
        return None
    return ("recipe.precision.dtype: 'fp16' needs a CUDA device and this machine shows no NVIDIA driver: "
            "`toolkit run` here refuses it (training.device 'auto' falls back to the CPU); use 'bf16' on a CPU")


def resolve_world_size(world_size: int | None) -> tuple[int, list[str]]:
    """The data-parallel world size: the argument, else $WORLD_SIZE (torchrun sets it), else 1."""
    if world_size is None:
        env = os.environ.get("WORLD_SIZE", "1")
        try:
            world_size = int(env)
        except ValueError:
            return 1, [f"WORLD_SIZE: {env!r} is not an integer"]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        return 1, [f"world size: {world_size!r} must be a positive integer (--world-size N, WORLD_SIZE)"]
    return world_size, []


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
