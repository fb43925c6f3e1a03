"""DeepSpeed config sections -> recipe keys: one function per DeepSpeed block, each saying for every key
it meets whether it is carried over (to which recipe key), left to the recipe ("auto"), or not carried
over and why (the optimizer and scheduler blocks: optimizer_sections.py). convert.py reads the file, calls these
and assembles the recipe.

Names and defaults are DeepSpeed's (deepspeed/runtime/config.py, zero/config.py, zero/offload_config.py,
lr_schedules.py; microsoft/DeepSpeed, commit 38327e07). Torch-free.
"""
from __future__ import annotations

from toolkit.errors import UserError
from toolkit.recipe.deepspeed.conversion import (NO_EFFECT, UNSUPPORTED, Conversion, as_json, drop_unhandled, is_enabled,
                                                 section_block)
from toolkit.recipe.deepspeed.optimizer_sections import optimizer, scheduler

BATCH = {"train_batch_size": "batch.global_batch", "train_micro_batch_size_per_gpu": "batch.micro_batch_per_rank",
         "gradient_accumulation_steps": "batch.grad_accum_steps"}


def batch(c: Conversion, ds: dict) -> None:
    """The batch triple as given; the recipe derives the missing ones at run time by DeepSpeed's rules
    (toolkit/recipe/assemble.py resolve_batch, deepspeed/runtime/config.py _set_batch_related_parameters)."""
    for ds_key, path in BATCH.items():
        if ds_key in ds:
            c.put(ds_key, path, ds[ds_key])


LOSS_SCALE = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
              "min_loss_scale")


def precision(c: Conversion, ds: dict) -> None:
    """fp16 (dynamic or static loss scale) or bf16 -> precision.dtype and precision.fp16."""
    fp16, bf16 = section_block(ds, "fp16"), section_block(ds, "bf16") or section_block(ds, "bfloat16")
    bf16_name = "bf16" if "bf16" in ds else "bfloat16"
    if is_enabled(fp16) is True and is_enabled(bf16) is True:
        raise UserError("deepspeed config: fp16.enabled and bf16.enabled are both true; DeepSpeed refuses that too")
    if "fp16" in ds:
        on = is_enabled(fp16)
        if on is True or on == "auto":
            c.put("fp16.enabled", "precision.dtype", "fp16" if on is True else "auto")
        for key in LOSS_SCALE:
            if key in fp16:
                if on is False:
                    c.drop(f"fp16.{key}", f"{NO_EFFECT}: fp16 is not enabled")
                elif on == "auto":  # NOTE: carried only if "auto" leaves the recipe on fp16 (settle_fp16_auto)
                    c.fp16_if_auto[key] = fp16[key]
                else:
                    c.put(f"fp16.{key}", f"precision.fp16.{key}", fp16[key])
        drop_unhandled(c, "fp16", fp16, {"enabled", *LOSS_SCALE}, {
            "auto_cast": f"{NO_EFFECT}: the toolkit runs fp16 as torch autocast over fp32 weights, casting "
                         "inside the model whatever the inputs are",
            "fp16_master_weights_and_grads": f"{UNSUPPORTED}: master weights and gradients stay fp32",
            "initial_scale": f"{UNSUPPORTED}: give fp16.initial_scale_power"})
    if bf16_name in ds:
        on = is_enabled(bf16)
        if on is True or on == "auto":
            c.put(f"{bf16_name}.enabled", "precision.dtype", "bf16" if on is True else "auto")
        handled = {"enabled"}
        if bf16.get("bf16_master_weights_and_grads") is True and bf16.get("bf16_optimizer_states") is True:
            # NOTE: the toolkit's 16-bit layout: bf16 weights as the master, bf16 moments, a bf16 gradient shard
            c.put(f"{bf16_name}.bf16_optimizer_states", "optimizer.state_dtype", "bf16")
            c.put(f"{bf16_name}.bf16_master_weights_and_grads", "zero.grad_dtype", "bf16")
            handled |= {"bf16_master_weights_and_grads", "bf16_optimizer_states"}
        drop_unhandled(c, bf16_name, bf16, handled, {
            "immediate_grad_update": f"{NO_EFFECT}: gradients accumulate in zero.grad_dtype",
            "check_grad_overflow": f"{NO_EFFECT}: bf16 needs no loss scaling; a non-finite loss stops the run",
            "bf16_master_weights_and_grads": f"{UNSUPPORTED}: bf16 master weights with fp32 Adam states; "
                                             "optimizer.state_dtype bf16 keeps master and moments in bf16 (set "
                                             "bf16_optimizer_states too)",
            "bf16_optimizer_states": f"{UNSUPPORTED}: bf16 Adam states need bf16_master_weights_and_grads"})
    if "amp" in ds:
        c.drop("amp", f"{UNSUPPORTED}: NVIDIA Apex AMP; replaced by precision.dtype fp16 or bf16 (torch autocast)")


def settle_fp16_auto(c: Conversion, dtype: str) -> None:
    """The loss-scale keys held back under fp16.enabled "auto", now that "auto" resolved to precision.dtype
    `dtype` (the base recipe's or the default): carried for fp16, else not carried over, with why."""
    for key, value in c.fp16_if_auto.items():
        if dtype == "fp16":
            c.put(f"fp16.{key}", f"precision.fp16.{key}", value)
        else:
            c.drop(f"fp16.{key}", f"{NO_EFFECT}: fp16.enabled is \"auto\" and the recipe's precision.dtype is "
                   f"{dtype}, which scales no loss")
    c.fp16_if_auto = {}


ZERO_NO_EFFECT = {
    "contiguous_gradients": f"{NO_EFFECT}: gradients are always kept in flat contiguous buffers",
    "reduce_scatter": f"{NO_EFFECT}: stages 2-3 always reduce-scatter",
    "allgather_partitions": f"{NO_EFFECT}: parameters are always all-gathered in buckets",
    "round_robin_gradients": NO_EFFECT,
    "sub_group_size": f"{NO_EFFECT}: the optimizer steps the shard in pieces of its own size",
    "stage3_prefetch_bucket_size": "replaced by zero.prefetch_units (transformer blocks gathered ahead, not elements)",
    "stage3_param_persistence_threshold": f"{NO_EFFECT}: stage 3 gathers whole units (blocks)",
    "stage3_max_live_parameters": f"{NO_EFFECT}: stage 3 frees each unit after its forward and backward",
    "stage3_max_reuse_distance": f"{NO_EFFECT}: stage 3 frees each unit after its forward and backward",
    "stage3_gather_16bit_weights_on_model_save": "replaced by `toolkit export` (a Hugging Face folder from any stage)",
    "stage3_gather_fp16_weights_on_model_save": "replaced by `toolkit export` (a Hugging Face folder from any stage)",
    "elastic_checkpoint": f"{NO_EFFECT}: checkpoints load at any world size and stage",
    "load_from_fp32_weights": f"{NO_EFFECT}: resume always loads the fp32 master weights",
    "ignore_unused_parameters": f"{NO_EFFECT}: a parameter without a gradient is stepped with a zero gradient",
    "save_muon_momentum_buffer_in_memory": f"{NO_EFFECT}: Muon's momentum always stays in the rank's shard",
    "legacy_stage1": UNSUPPORTED,
}


SWAP_NO_EFFECT = {
    "pin_memory": f"{NO_EFFECT}: the offloaded step's staging buffers are always pinned on a GPU",
    "buffer_count": f"{NO_EFFECT}: the swapped optimizer step streams through three buffer slots",
    "buffer_size": f"{NO_EFFECT}: swap files are read a unit (or a step's piece) at a time",
    "pipeline_read": f"{NO_EFFECT}: swap reads always overlap the CPU step",
    "pipeline_write": f"{NO_EFFECT}: swap writes always overlap the CPU step",
    "fast_init": NO_EFFECT, "max_in_cpu": f"{NO_EFFECT}: offload_param nvme keeps no parameter in CPU memory"}


def _offload_block(c: Conversion, z: dict, key: str) -> None:
    """zero_optimization.offload_optimizer / offload_param: the device (none, cpu, nvme), nvme_path, the optimizer's
    ratio; the rest reported."""
    off, name = z[key], f"zero_optimization.{key}"
    if not isinstance(off, dict):
        raise UserError(f"deepspeed config: {name}: expected an object, got {as_json(off)}")
    device = off.get("device", "none")
    if device in ("cpu", "nvme", "none", "auto"):
        c.put(f"{name}.device", f"zero.{key}", device)
    else:
        c.drop(f"{name}.device", f"{UNSUPPORTED}: {device!r}; offload goes to 'cpu' or 'nvme'")
    handled = {"device"}
    if "nvme_path" in off and device == "nvme":
        if "nvme_path" in c.recipe.get("zero", {}) and c.recipe["zero"]["nvme_path"] != off["nvme_path"]:
            c.drop(f"{name}.nvme_path", f"{UNSUPPORTED}: a second folder; zero.nvme_path holds every swap file")
        else:
            c.put(f"{name}.nvme_path", "zero.nvme_path", off["nvme_path"])
        handled.add("nvme_path")
    if key == "offload_optimizer" and "ratio" in off:
        c.put(f"{name}.ratio", "zero.offload_ratio", off["ratio"])
        handled.add("ratio")
    drop_unhandled(c, name, off, handled, {**SWAP_NO_EFFECT, "nvme_path": f"{NO_EFFECT}: device is not 'nvme'"})


def zero(c: Conversion, ds: dict) -> None:
    """zero_optimization: stage, optimizer offload (device, ratio), bucket sizes, overlap_comm; the rest reported."""
    if isinstance(ds.get("zero_optimization"), bool):  # DeepSpeed's deprecated form: true is stage 1
        c.put("zero_optimization (legacy boolean)", "zero.stage", 1 if ds["zero_optimization"] else 0)
        return
    z = section_block(ds, "zero_optimization")
    if "stage" in z:
        c.put("zero_optimization.stage", "zero.stage", z["stage"])
    for key in ("offload_optimizer", "offload_param"):
        if key == "offload_param" and z.get(key) and z.get("stage") in (0, 1, 2):  # DeepSpeed ignores it there
            c.drop("zero_optimization.offload_param", f"{NO_EFFECT}: parameter offload needs stage 3 (stage is "
                                                      f"{z['stage']})")
        elif key in z:
            _offload_block(c, z, key)
    if z.get("cpu_offload") is True:  # DeepSpeed's legacy spelling of offload_optimizer.device cpu
        c.put("zero_optimization.cpu_offload", "zero.offload_optimizer", "cpu")
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if key in z:
            value = z[key]
            # NOTE: DeepSpeed configs write sizes as floats (5e8); the recipe counts whole elements.
            c.put(f"zero_optimization.{key}", f"zero.{key}", int(value) if isinstance(value, float)
                  and value.is_integer() else value)
    if "overlap_comm" in z:  # false: every collective waited for when issued, as DeepSpeed's overlap_comm false
        c.put("zero_optimization.overlap_comm", "zero.overlap_comm", z["overlap_comm"])
    handled = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "allgather_bucket_size",
               "overlap_comm"}
    if z.get("cpu_offload") is not True:
        reasons = {**ZERO_NO_EFFECT, "cpu_offload": f"{NO_EFFECT}: false"}
    else:
        reasons, handled = ZERO_NO_EFFECT, handled | {"cpu_offload"}
    drop_unhandled(c, "zero_optimization", z, handled, reasons)


def data_types(c: Conversion, ds: dict) -> None:
    """data_types.grad_accum_dtype -> zero.grad_dtype (bf16 only with bf16 optimizer states, as the recipe checks)."""
    block = section_block(ds, "data_types")
    dtype = block.get("grad_accum_dtype")
    handled = set()
    if dtype == "fp32" or (dtype == "bf16" and c.recipe.get("optimizer", {}).get("state_dtype") == "bf16"):
        c.put("data_types.grad_accum_dtype", "zero.grad_dtype", dtype)
        handled.add("grad_accum_dtype")
    drop_unhandled(c, "data_types", block, handled, {
        "grad_accum_dtype": f"{UNSUPPORTED}: {as_json(dtype)}; zero.grad_dtype is fp32, or bf16 with bf16 optimizer "
                            "states (bf16.bf16_master_weights_and_grads and bf16_optimizer_states)"})


def training(c: Conversion, ds: dict) -> None:
    """gradient_clipping (absent: DeepSpeed does not clip) and steps_per_print."""
    if "gradient_clipping" in ds:
        c.put("gradient_clipping", "training.grad_clip", ds["gradient_clipping"])
    else:
        c.put("gradient_clipping (absent: DeepSpeed's 0, no clipping)", "training.grad_clip", 0.0)
    if "steps_per_print" in ds:
        c.put("steps_per_print", "training.log_interval", ds["steps_per_print"])


def activation_checkpointing(c: Conversion, ds: dict) -> None:
    """The block's presence: the model checkpoints activations (the toolkit does it per transformer block)."""
    if "activation_checkpointing" not in ds:
        return
    block = section_block(ds, "activation_checkpointing")
    # NOTE: in DeepSpeed the block configures deepspeed.checkpointing, which the model's own code calls; a
    # config that has it is one whose model checkpoints, so the recipe turns the toolkit's checkpointing on.
    c.put("activation_checkpointing", "model.activation_checkpointing", True)
    drop_unhandled(c, "activation_checkpointing", block, set(), {
        "partition_activations": f"{NO_EFFECT}: no model parallelism to partition across",
        "cpu_checkpointing": f"{UNSUPPORTED}: checkpointed activations stay on the device",
        "contiguous_memory_optimization": f"{NO_EFFECT}: the caching allocator places them",
        "number_checkpoints": f"{NO_EFFECT}: one checkpoint per transformer block",
        "synchronize_checkpoint_boundary": NO_EFFECT, "profile": NO_EFFECT})


def logging(c: Conversion, ds: dict) -> None:
    """tensorboard and wandb -> logging; csv_monitor is replaced by metrics.jsonl."""
    if "tensorboard" in ds:
        tb = section_block(ds, "tensorboard")
        c.put("tensorboard.enabled", "logging.tensorboard", tb.get("enabled", False))
        drop_unhandled(c, "tensorboard", tb, {"enabled"}, {"output_path": "replaced by <run_dir>/tensorboard",
                                                   "job_name": "replaced by the run directory's name"})
    if "wandb" in ds:
        wb = section_block(ds, "wandb")
        # NOTE: DeepSpeed's wandb monitor calls wandb.init with the environment's mode (online unless WANDB_MODE).
        c.put("wandb.enabled", "logging.wandb.mode", "online" if wb.get("enabled", False) is True else "disabled")
        if "project" in wb:
            c.put("wandb.project", "logging.wandb.project", wb["project"])
        drop_unhandled(c, "wandb", wb, {"enabled", "project"}, {"group": f"{UNSUPPORTED}: W&B groups",
                                                       "team": f"{UNSUPPORTED}: set WANDB_ENTITY"})
    if "csv_monitor" in ds:
        c.drop("csv_monitor", "replaced by <run_dir>/metrics.jsonl, always written (one JSON object per line)")


# Top-level keys never carried over, with why; any other key not handled above is UNSUPPORTED.
TOP_LEVEL = {
    "wall_clock_breakdown": "replaced by the metrics lines (step time, tokens/s) and the console summary",
    "memory_breakdown": "replaced by the mem_* fields of the metrics lines",
    "flops_profiler": "replaced by the MFU field of the metrics lines (toolkit/observe/flops.py)",
    "prescale_gradients": f"{NO_EFFECT}: gradients are averaged in fp32 after the reduction",
    "gradient_predivide_factor": f"{NO_EFFECT}: gradients are averaged in fp32 after the reduction",
    "zero_allow_untested_optimizer": f"{NO_EFFECT}: the optimizer is the recipe's",
    "zero_force_ds_cpu_optimizer": f"{NO_EFFECT}: CPU offload always steps with the toolkit's CPU Adam",
    "dump_state": NO_EFFECT,
    "checkpoint": "replaced by the recipe's checkpoint section",
    "communication_data_type": f"{UNSUPPORTED}: gradients are reduced in the weights' dtype",
    "sparse_gradients": UNSUPPORTED,
    "comms_logger": UNSUPPORTED,
    "autotuning": "replaced by `toolkit tune RECIPE`",
}
HANDLED = {*BATCH, "fp16", "bf16", "bfloat16", "amp", "zero_optimization", "optimizer", "scheduler",
           "gradient_clipping", "steps_per_print", "activation_checkpointing", "tensorboard", "wandb", "csv_monitor",
           "data_types"}


def convert_sections(ds: dict) -> Conversion:
    """Every section of a DeepSpeed config dict converted; keys outside the sections reported."""
    c = Conversion()
    for section in (batch, precision, zero, data_types, optimizer, scheduler, training, activation_checkpointing,
                    logging):
        section(c, ds)
    drop_unhandled(c, "(top level)", ds, HANDLED, TOP_LEVEL)
    c.dropped = [line.replace("(top level).", "") for line in c.dropped]
    return c
