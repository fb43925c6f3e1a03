"""DeepSpeed config sections -> recipe keys: one function per DeepSpeed block, each saying for every key
it meets whether it is carried over (to which recipe key), left to the recipe ("auto"), or not carried
over and why. convert.py reads the file, calls these and assembles the recipe.

Names and defaults are DeepSpeed's (deepspeed/runtime/config.py, zero/config.py, zero/offload_config.py,
lr_schedules.py; microsoft/DeepSpeed, commit 38327e07). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.errors import UserError

# Why a key is not carried over, in the three kinds the report uses.
NO_EFFECT = "no effect here"
UNSUPPORTED = "unsupported"


@dataclass
class Conversion:
    """What a DeepSpeed config became: the recipe keys it sets, and one line per key about what happened."""
    recipe: dict = field(default_factory=dict)              # nested recipe keys, only those the config sets
    carried: list[str] = field(default_factory=list)        # "ds.key -> recipe.key = value"
    dropped: list[str] = field(default_factory=list)        # "ds.key: not carried over: why"
    auto: list[tuple[str, str]] = field(default_factory=list)  # ("ds.key", "recipe.path") left to the recipe
    notes: list[str] = field(default_factory=list)          # facts about the result the config does not say
    fp16_if_auto: dict = field(default_factory=dict)       # fp16 loss-scale keys under fp16.enabled "auto"

    def put(self, ds_key: str, recipe_path: str, value) -> None:
        """Carry `value` (DeepSpeed's `ds_key`) to the recipe key `recipe_path` ("zero.stage"); "auto" is left to the recipe."""
        if value == "auto":
            self.auto.append((ds_key, recipe_path))
            return
        node = self.recipe
        *parents, last = recipe_path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
        self.carried.append(f"{ds_key} -> {recipe_path} = {_json(value)}")

    def drop(self, ds_key: str, why: str) -> None:
        """Report `ds_key` as not carried over, with why (NO_EFFECT, UNSUPPORTED, or `replaced by ...`)."""
        self.dropped.append(f"{ds_key}: not carried over: {why}")


def _json(value) -> str:
    import json

    return json.dumps(value)


def _block(ds: dict, key: str) -> dict:
    value = ds.get(key, {})
    if not isinstance(value, dict):
        raise UserError(f"deepspeed config: {key}: expected an object, got {_json(value)}")
    return value


def _enabled(block: dict) -> bool | str:
    return block.get("enabled", False)


def _rest(c: Conversion, prefix: str, block: dict, handled: set[str], reasons: dict[str, str]) -> None:
    """Every key of `block` not in `handled`: dropped, with its reason from `reasons` or UNSUPPORTED."""
    for key in block:
        if key not in handled:
            c.drop(f"{prefix}.{key}", reasons.get(key, UNSUPPORTED))


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
    fp16, bf16 = _block(ds, "fp16"), _block(ds, "bf16") or _block(ds, "bfloat16")
    bf16_name = "bf16" if "bf16" in ds else "bfloat16"
    if _enabled(fp16) is True and _enabled(bf16) is True:
        raise UserError("deepspeed config: fp16.enabled and bf16.enabled are both true; DeepSpeed refuses that too")
    if "fp16" in ds:
        on = _enabled(fp16)
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
        _rest(c, "fp16", fp16, {"enabled", *LOSS_SCALE}, {
            "auto_cast": f"{NO_EFFECT}: the toolkit runs fp16 as torch autocast over fp32 weights, casting "
                         "inside the model whatever the inputs are",
            "fp16_master_weights_and_grads": f"{UNSUPPORTED}: master weights and gradients stay fp32",
            "initial_scale": f"{UNSUPPORTED}: give fp16.initial_scale_power"})
    if bf16_name in ds:
        on = _enabled(bf16)
        if on is True or on == "auto":
            c.put(f"{bf16_name}.enabled", "precision.dtype", "bf16" if on is True else "auto")
        _rest(c, bf16_name, bf16, {"enabled"}, {
            "immediate_grad_update": f"{NO_EFFECT}: gradients accumulate in fp32",
            "check_grad_overflow": f"{NO_EFFECT}: bf16 needs no loss scaling; a non-finite loss stops the run",
            "bf16_master_weights_and_grads": f"{UNSUPPORTED}: master weights and gradients stay fp32",
            "bf16_optimizer_states": f"{UNSUPPORTED}: Adam states stay fp32"})
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


def _offload_optimizer(c: Conversion, z: dict) -> None:
    off = z["offload_optimizer"]
    if not isinstance(off, dict):
        raise UserError(f"deepspeed config: zero_optimization.offload_optimizer: expected an object, got {_json(off)}")
    device = off.get("device", "none")
    if device in ("cpu", "none", "auto"):
        c.put("zero_optimization.offload_optimizer.device", "zero.offload_optimizer", device)
    else:
        c.drop("zero_optimization.offload_optimizer.device", f"{UNSUPPORTED}: {device!r}; offload goes to the CPU "
               "(zero.offload_optimizer cpu)")
    if "ratio" in off:
        c.put("zero_optimization.offload_optimizer.ratio", "zero.offload_ratio", off["ratio"])
    _rest(c, "zero_optimization.offload_optimizer", off, {"device", "ratio"}, {
        "pin_memory": f"{NO_EFFECT}: the offloaded step's staging buffers are always pinned on a GPU",
        "buffer_count": f"{NO_EFFECT}: NVMe only", "nvme_path": f"{NO_EFFECT}: NVMe only",
        "pipeline_read": f"{NO_EFFECT}: NVMe only", "pipeline_write": f"{NO_EFFECT}: NVMe only",
        "fast_init": f"{NO_EFFECT}: NVMe only"})


def zero(c: Conversion, ds: dict) -> None:
    """zero_optimization: stage, optimizer offload (device, ratio), bucket sizes, overlap_comm; the rest reported."""
    if isinstance(ds.get("zero_optimization"), bool):  # DeepSpeed's deprecated form: true is stage 1
        c.put("zero_optimization (legacy boolean)", "zero.stage", 1 if ds["zero_optimization"] else 0)
        return
    z = _block(ds, "zero_optimization")
    if "stage" in z:
        c.put("zero_optimization.stage", "zero.stage", z["stage"])
    if "offload_optimizer" in z:
        _offload_optimizer(c, z)
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
    off_param = z.get("offload_param")
    handled = {"stage", "offload_optimizer", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm"}
    if isinstance(off_param, dict) and off_param.get("device", "none") == "none":
        handled.add("offload_param")
    if z.get("cpu_offload") is not True:
        reasons = {**ZERO_NO_EFFECT, "cpu_offload": f"{NO_EFFECT}: false"}
    else:
        reasons, handled = ZERO_NO_EFFECT, handled | {"cpu_offload"}
    reasons = {**reasons, "offload_param": f"{UNSUPPORTED}: parameter offload; zero.offload_optimizer cpu offloads "
                                           "the optimizer state (the largest part)"}
    _rest(c, "zero_optimization", z, handled, reasons)


ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay")


def optimizer(c: Conversion, ds: dict) -> None:
    """optimizer: Adam / AdamW (DeepSpeed's Adam is AdamW unless adam_w_mode is false) and their params."""
    opt = _block(ds, "optimizer")
    if not opt:
        return
    name = str(opt.get("type", "")).lower()
    params = opt.get("params", {})
    if name == "onebitadam":
        _onebit_adam(c, opt, params)
        return
    if name == "muon":
        _muon(c, opt, params)
        return
    if name not in ("adam", "adamw"):
        c.drop("optimizer.type", f"{UNSUPPORTED}: {opt.get('type')!r}; the toolkit trains with AdamW, Adam or "
               "OneBitAdam (optimizer.type), so its params are not carried over either")
        return
    # NOTE: deepspeed/runtime/engine.py _configure_basic_optimizer: effective_adam_w_mode = name == adamw or
    # adam_w_mode (default True), so {"type": "Adam"} steps decoupled weight decay, as AdamW.
    decoupled = name == "adamw" or params.get("adam_w_mode", True) is not False
    c.put("optimizer.type", "optimizer.type", "adamw" if decoupled else "adam")
    for key in ADAM_PARAMS:
        if key in params:
            c.put(f"optimizer.params.{key}", f"optimizer.{key}", params[key])
    if "weight_decay" not in params:  # DeepSpeed's FusedAdam default; the recipe's is 0.01
        c.put("optimizer.params.weight_decay (absent: DeepSpeed's 0)", "optimizer.weight_decay", 0.0)
    if params.get("torch_adam") is True:
        c.put("optimizer.params.torch_adam", "optimizer.implementation", "torch")
    handled = {*ADAM_PARAMS, "adam_w_mode", "torch_adam"}
    reasons = {"bias_correction": f"{UNSUPPORTED}: Adam always corrects the moments' bias",
               "amsgrad": f"{UNSUPPORTED}: no AMSGrad"}
    for key, default in (("bias_correction", True), ("amsgrad", False)):
        if params.get(key) == default:
            handled.add(key)
    _rest(c, "optimizer.params", params, handled, reasons)
    _rest(c, "optimizer", opt, {"type", "params"}, {})
    if isinstance(c.recipe.get("optimizer", {}).get("weight_decay"), (int, float)) and c.recipe["optimizer"]["weight_decay"]:
        c.notes.append("optimizer.weight_decay: applied to matrices only, biases and norm weights are not decayed "
                       "(as Hugging Face's Trainer groups them); DeepSpeed decays whatever groups the model passes")


def _onebit_adam(c: Conversion, opt: dict, params: dict) -> None:
    """DeepSpeed's OneBitAdam: optimizer.type onebit_adam with the same freeze_step and Adam params."""
    c.put("optimizer.type", "optimizer.type", "onebit_adam")
    for key in (*ADAM_PARAMS, "freeze_step"):
        if key in params:
            c.put(f"optimizer.params.{key}", f"optimizer.{key}", params[key])
    collectives = f"{NO_EFFECT}: the collectives are torch.distributed's, on gloo or NCCL"
    reasons = {"cuda_aware": collectives, "comm_backend_name": collectives,
               "bias_correction": f"{NO_EFFECT}: 1-bit Adam corrects no bias, as DeepSpeed's OnebitAdam"}
    _rest(c, "optimizer.params", params, {*ADAM_PARAMS, "freeze_step"}, reasons)
    _rest(c, "optimizer", opt, {"type", "params"}, {})


def _muon(c: Conversion, opt: dict, params: dict) -> None:
    """DeepSpeed's Muon (deepspeed/runtime/engine.py, zero/muon/original_muon.py MuonWithAuxAdam): lr is both
    groups' unless muon_lr / adam_lr name one; weight_decay is both groups'; absent keys take its defaults."""
    c.put("optimizer.type", "optimizer.type", "muon")
    defaults = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-10, "weight_decay": 0.0}  # MuonWithAuxAdam's Adam group
    for key in ADAM_PARAMS:
        ds_key = "adam_lr" if key == "lr" and "adam_lr" in params else key
        if ds_key in params:
            c.put(f"optimizer.params.{ds_key}", f"optimizer.{key}", params[ds_key])
        else:
            c.put(f"optimizer.params.{key} (absent: DeepSpeed's {defaults[key]})", f"optimizer.{key}", defaults[key])
    for ds_key, key in (("muon_lr", "muon_lr"), ("lr", "muon_lr"), ("momentum", "muon_momentum"),
                        ("weight_decay", "muon_weight_decay")):
        if ds_key in params and not (ds_key == "lr" and "muon_lr" in params):
            c.put(f"optimizer.params.{ds_key}", f"optimizer.{key}", params[ds_key])
    reasons = {"ns_method": f"{UNSUPPORTED}: {params.get('ns_method')!r}; the toolkit runs torch.optim.Muon's standard "
                            "quintic Newton-Schulz iteration (DeepSpeed's ns_method 'standard')"}
    handled = {*ADAM_PARAMS, "adam_lr", "muon_lr", "momentum"} | ({"ns_method"} if params.get("ns_method") == "standard"
                                                                  else set())
    _rest(c, "optimizer.params", params, handled, reasons)
    _rest(c, "optimizer", opt, {"type", "params"}, {})
    c.notes.append("optimizer.type muon: Muon takes the 2-D parameters except embeddings and the output head, found "
                   "by module (DeepSpeed: by the names 'embed' and 'lm_head'; GPT-2's wte and wpe differ); Nesterov "
                   "momentum and the lr scale sqrt(max(1, rows/cols)) are DeepSpeed's too")


SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                 "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"),
    "LRRangeTest": ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase"),
}
# Per-parameter-group values DeepSpeed accepts as lists (one per optimizer param group).
PER_GROUP = ("warmup_min_lr", "warmup_max_lr", "lr_range_test_min_lr")


def _per_group(c: Conversion, key: str, value):
    """A per-group list whose values are all equal is that value; else None after reporting it."""
    if not isinstance(value, list):
        return value
    if value and all(v == value[0] for v in value):
        c.notes.append(f"scheduler.params.{key}: {_json(value)} is the same for every group: {_json(value[0])}")
        return value[0]
    c.drop(f"scheduler.params.{key}", f"{UNSUPPORTED}: different values per param group {_json(value)}; the toolkit "
           "builds its own two groups (decayed matrices, the rest) and schedules them alike")
    return None


def scheduler(c: Conversion, ds: dict) -> None:
    """scheduler: the five DeepSpeed schedules the toolkit runs, their params under the same names."""
    sch = _block(ds, "scheduler")
    if not sch:
        return
    kind = sch.get("type")
    if kind not in SCHEDULER_PARAMS:
        c.drop("scheduler.type", f"{UNSUPPORTED}: {kind!r}; the toolkit runs {', '.join(SCHEDULER_PARAMS)} (its "
               "params are not carried over either)")
        return
    c.put("scheduler.type", "scheduler.type", kind)
    params = sch.get("params", {})
    for key in SCHEDULER_PARAMS[kind]:
        if key in params:
            value = _per_group(c, key, params[key]) if key in PER_GROUP else params[key]
            if value is not None:
                c.put(f"scheduler.params.{key}", f"scheduler.{key}", value)
    _rest(c, "scheduler.params", params, set(SCHEDULER_PARAMS[kind]), {
        "last_batch_iteration": f"{NO_EFFECT}: a resumed run continues its schedule from the checkpoint",
        "cycle_first_stair_count": f"{NO_EFFECT}: DeepSpeed's OneCycle stores it and never reads it",
        "cycle_second_stair_count": f"{NO_EFFECT}: DeepSpeed's OneCycle stores it and never reads it"})
    _rest(c, "scheduler", sch, {"type", "params"}, {})


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
    block = _block(ds, "activation_checkpointing")
    # NOTE: in DeepSpeed the block configures deepspeed.checkpointing, which the model's own code calls; a
    # config that has it is one whose model checkpoints, so the recipe turns the toolkit's checkpointing on.
    c.put("activation_checkpointing", "model.activation_checkpointing", True)
    _rest(c, "activation_checkpointing", block, set(), {
        "partition_activations": f"{NO_EFFECT}: no model parallelism to partition across",
        "cpu_checkpointing": f"{UNSUPPORTED}: checkpointed activations stay on the device",
        "contiguous_memory_optimization": f"{NO_EFFECT}: the caching allocator places them",
        "number_checkpoints": f"{NO_EFFECT}: one checkpoint per transformer block",
        "synchronize_checkpoint_boundary": NO_EFFECT, "profile": NO_EFFECT})


def logging(c: Conversion, ds: dict) -> None:
    """tensorboard and wandb -> logging; csv_monitor is replaced by metrics.jsonl."""
    if "tensorboard" in ds:
        tb = _block(ds, "tensorboard")
        c.put("tensorboard.enabled", "logging.tensorboard", tb.get("enabled", False))
        _rest(c, "tensorboard", tb, {"enabled"}, {"output_path": "replaced by <run_dir>/tensorboard",
                                                   "job_name": "replaced by the run directory's name"})
    if "wandb" in ds:
        wb = _block(ds, "wandb")
        # NOTE: DeepSpeed's wandb monitor calls wandb.init with the environment's mode (online unless WANDB_MODE).
        c.put("wandb.enabled", "logging.wandb.mode", "online" if wb.get("enabled", False) is True else "disabled")
        if "project" in wb:
            c.put("wandb.project", "logging.wandb.project", wb["project"])
        _rest(c, "wandb", wb, {"enabled", "project"}, {"group": f"{UNSUPPORTED}: W&B groups",
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
    "communication_data_type": f"{UNSUPPORTED}: gradients are reduced in fp32",
    "sparse_gradients": UNSUPPORTED,
    "comms_logger": UNSUPPORTED,
    "autotuning": "replaced by `toolkit tune RECIPE`",
}
HANDLED = {*BATCH, "fp16", "bf16", "bfloat16", "amp", "zero_optimization", "optimizer", "scheduler",
           "gradient_clipping", "steps_per_print", "activation_checkpointing", "tensorboard", "wandb", "csv_monitor"}


def convert_sections(ds: dict) -> Conversion:
    """Every section of a DeepSpeed config dict converted; keys outside the sections reported."""
    c = Conversion()
    for section in (batch, precision, zero, optimizer, scheduler, training, activation_checkpointing, logging):
        section(c, ds)
    _rest(c, "(top level)", ds, HANDLED, TOP_LEVEL)
    c.dropped = [line.replace("(top level).", "") for line in c.dropped]
    return c
