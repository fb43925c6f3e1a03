"""DeepSpeed's optimizer and scheduler blocks -> recipe keys (the other blocks: sections.py). Names and defaults
are DeepSpeed's (deepspeed/runtime/config.py, lr_schedules.py; microsoft/DeepSpeed, commit 38327e07). Torch-free."""
from __future__ import annotations

from toolkit.recipe.deepspeed.conversion import (NO_EFFECT, UNSUPPORTED, Conversion, as_json, drop_unhandled,
                                                 section_block)


ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay")


def optimizer(c: Conversion, ds: dict) -> None:
    """optimizer: Adam / AdamW (DeepSpeed's Adam is AdamW unless adam_w_mode is false) and their params."""
    opt = section_block(ds, "optimizer")
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
    drop_unhandled(c, "optimizer.params", params, handled, reasons)
    drop_unhandled(c, "optimizer", opt, {"type", "params"}, {})
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
    drop_unhandled(c, "optimizer.params", params, {*ADAM_PARAMS, "freeze_step"}, reasons)
    drop_unhandled(c, "optimizer", opt, {"type", "params"}, {})


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
    drop_unhandled(c, "optimizer.params", params, handled, reasons)
    drop_unhandled(c, "optimizer", opt, {"type", "params"}, {})
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
        c.notes.append(f"scheduler.params.{key}: {as_json(value)} is the same for every group: {as_json(value[0])}")
        return value[0]
    c.drop(f"scheduler.params.{key}", f"{UNSUPPORTED}: different values per param group {as_json(value)}; the toolkit "
           "builds its own two groups (decayed matrices, the rest) and schedules them alike")
    return None


def scheduler(c: Conversion, ds: dict) -> None:
    """scheduler: the five DeepSpeed schedules the toolkit runs, their params under the same names."""
    sch = section_block(ds, "scheduler")
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
    drop_unhandled(c, "scheduler.params", params, set(SCHEDULER_PARAMS[kind]), {
        "last_batch_iteration": f"{NO_EFFECT}: a resumed run continues its schedule from the checkpoint",
        "cycle_first_stair_count": f"{NO_EFFECT}: DeepSpeed's OneCycle stores it and never reads it",
        "cycle_second_stair_count": f"{NO_EFFECT}: DeepSpeed's OneCycle stores it and never reads it"})
    drop_unhandled(c, "scheduler", sch, {"type", "params"}, {})
