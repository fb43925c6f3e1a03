"""Resume rules: what a changed recipe may and may not do to a checkpoint (refused:
model shape, optimizer type, data order; allowed with a warning: the rest), the meta
that state.json carries for that comparison and the structure a training checkpoint
must have (`load_training_checkpoint`: resume, export and generate read through it, so
a hand-edited state.json is one line naming the key, never a KeyError), and trimming
metrics.jsonl back to the resumed step. The `Checkpointer` (toolkit/checkpoint/checkpointer.py)
applies them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from toolkit.checkpoint.files import (STATE_FILE, TEMP_PREFIX, MapOf, is_plain_file_name, latest_checkpoint,
                                      recorded_checkpoint_dirname, structure_problem)
from toolkit.checkpoint.io import Checkpoint, load_checkpoint
from toolkit.checkpoint.state import check_rng_state
from toolkit.errors import UserError
from toolkit.specs import ModelSpec, Recipe

# NOTE: the checkpoint holds fp32 weights and fp32 AdamW moments in every precision
# (autocast computes in bf16/fp16, the weights stay fp32), so a precision change loads
# cleanly; it is allowed with a warning, and the fp16 loss scaler starts fresh when a
# run switches to fp16. Model shape, optimizer type and anything that moves the data
# position (data source, global batch, data-order seed) are refused: the state would
# not load, or would silently train on other samples than the saved position means.
_SHAPE_KEYS = {"family": "model.family", "n_layer": "model.n_layer", "n_embd": "model.n_embd",
               "n_head": "model.n_head", "n_kv_head": "model.n_kv_head",
               "intermediate_size": "model.intermediate_size", "max_positions": "model.max_positions",
               "vocab_size": "data.vocab_size"}
# held-out only / reported as a shape change / where tokens are cached (the stream compares the corpus itself)
_DATA_ORDER_EXEMPT = {"data.eval_samples", "data.vocab_size", "data.cache_dir"}
_IGNORED = {"checkpoint.resume", "name", "description"}  # how the checkpoint was chosen or named, not what it holds
_NOTES = {
    "precision.dtype": "weights and AdamW state are fp32 in every precision, so they carry over",
    "batch.micro_batch_per_rank": "same global batch, same samples per step, summed in another order",
    "batch.grad_accum_steps": "same global batch, same samples per step, summed in another order",
}


def model_shape(spec: ModelSpec) -> dict:
    """The fields of a ModelSpec that decide the weights' shapes."""
    return {key: getattr(spec, key) for key in _SHAPE_KEYS}


def _leaves(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: node}


_UNSET = object()


def _show(value) -> str:
    if value is _UNSET:
        return "(unset)"
    return value if isinstance(value, str) else json.dumps(value)


def resume_changes(meta: dict, recipe: Recipe) -> tuple[list[str], list[str]]:
    """(refusals, warnings) for continuing the checkpoint described by `meta` under `recipe`."""
    refusals = []
    saved_shape = meta["model_shape"]
    shape = [f"recipe.{_SHAPE_KEYS[k]} {_show(saved_shape.get(k, _UNSET))} -> {_show(v)}"
             for k, v in model_shape(recipe.model).items() if saved_shape.get(k, _UNSET) != v]
    if shape:
        refusals.append(f"resume: model shape changed: {', '.join(shape)} (the saved weights do not fit; "
                        "start fresh with checkpoint.resume=never or use another run dir)")
    old, new = _leaves(meta["recipe"]), _leaves(recipe.resolved)
    changed = sorted(k for k in old.keys() | new.keys()
                     if old.get(k, _UNSET) != new.get(k, _UNSET) and k not in _IGNORED)

    def describe(key: str) -> str:
        return f"recipe.{key} {_show(old.get(key, _UNSET))} -> {_show(new.get(key, _UNSET))}"

    if "optimizer.type" in changed:
        refusals.append(f"resume: optimizer changed: {describe('optimizer.type')} (the saved optimizer state "
                        "belongs to the old one; start fresh with checkpoint.resume=never)")
    order = [describe(k) for k in changed
             if (k.startswith("data.") and k not in _DATA_ORDER_EXEMPT) or k == "training.seed"]
    if meta["global_batch"] != recipe.batch.global_batch:
        order.append(f"recipe.batch.global_batch {meta['global_batch']} -> {recipe.batch.global_batch}")
    if order:
        refusals.append(f"resume: data order changed: {', '.join(order)} (the saved data position would point "
                        f"at other samples; {_keep_global_batch(meta, recipe)}start fresh with "
                        "checkpoint.resume=never)")
    if refusals:
        return refusals, []
    notes = dict(_NOTES)
    if recipe.scheduler.type != "constant" and "total_num_steps" not in recipe.resolved["scheduler"]:
        notes["training.max_steps"] = ("scheduler.total_num_steps follows it, so the lr schedule stretches to the "
                                       "new length from here on")
    shape_paths = set(_SHAPE_KEYS.values())
    warnings = [describe(k) + (f" ({notes[k]})" if k in notes else "") for k in changed if k not in shape_paths]
    if meta.get("world_size", 1) != recipe.batch.world_size:
        warnings.append(f"world size {meta.get('world_size', 1)} -> {recipe.batch.world_size} "
                        "(same global batch, same samples per step)")
    return refusals, warnings


def _keep_global_batch(meta: dict, recipe: Recipe) -> str:
    """The way to resume at another world size with the saved global batch (empty when that is not the change)."""
    saved, b = meta["global_batch"], recipe.batch
    if saved == b.global_batch or meta.get("world_size", 1) == b.world_size:
        return ""
    if saved % b.world_size:
        return f"the saved global batch {saved} does not split over {b.world_size} ranks; "
    per_step = b.micro_batch_per_rank * b.world_size
    how = (f"batch.grad_accum_steps={saved // per_step}" if saved % per_step == 0 else
           f"batch.global_batch={saved} with a batch.micro_batch_per_rank that divides {saved // b.world_size}")
    return f"to continue at world size {b.world_size} with the saved global batch {saved}, set {how}; or "


# What state.json holds in a training checkpoint (checkpoint_meta below, Engine.state_dict,
# BatchStream.state_dict, capture_rng_state), after its tensors are put back.
_NUMBER = (int, float)
_TRAINING = {
    "recipe": dict, "model_shape": dict, "global_batch": int, "world_size?": int,
    "model_config?": (dict, type(None)), "recipe_hash?": str, "wandb_run_id?": (str, type(None)),
    "state": {
        "engine": {"scheduler": {"last_batch_iteration": int}, "global_step": int, "skipped_steps": int,
                   "loss_scaler?": (dict, type(None)), "model?": MapOf(torch.Tensor),
                   "optimizer?": {"state": MapOf(MapOf((torch.Tensor, int, float))),
                                  "param_groups": [{"params": [int]}]},
                   "buffers?": (dict, type(None)),
                   "zero?": {"files": [str], "step": int, "stage": int, "world_size": int, "aliases?": MapOf(str)}},
        "stream": {"epoch": int, "step_in_epoch": int, "sequences?": int, "corpus?": (str, type(None))},
        "rng": {"python": (tuple, list), "numpy": dict, "torch": torch.Tensor, "cuda?": (list, type(None))},
    },
}
_SCALER = {"cur_scale": _NUMBER, "cur_iter": int, "last_overflow_iter": int, "cur_hysteresis": int,
           "overflows_at_min_scale": int}


def _training_problem(ckpt: Checkpoint) -> str | None:
    data = {**ckpt.meta, "state": ckpt.state}
    problem = structure_problem(data, _TRAINING)
    if problem:
        return problem
    engine = ckpt.state["engine"]
    if ("model" in engine) == ("zero" in engine):
        return "state.engine: holds neither or both of model and zero"
    if engine.get("loss_scaler") is not None:
        problem = structure_problem(engine["loss_scaler"], _SCALER, "state.engine.loss_scaler")
        if problem:
            return problem
    for name in engine.get("zero", {}).get("files", ()):
        if not is_plain_file_name(name) or name not in ckpt.files:
            return f"state.engine.zero.files: {name!r} is not a shard file that manifest.json lists"
    rng = check_rng_state(ckpt.state["rng"])
    return f"state.{rng}" if rng else None


def load_training_checkpoint(step_dir: Path) -> Checkpoint:
    """`load_checkpoint`, then the structure a training run saves checked key by key (one line naming it)."""
    ckpt = load_checkpoint(step_dir)
    problem = _training_problem(ckpt)
    if problem:
        raise UserError(f"{ckpt.path / STATE_FILE}: {problem} (a hand-edited or foreign checkpoint)")
    return ckpt


def check_checkpoint_dir_kept(run_dir: Path, checkpoint_dir: str) -> None:
    """Refuse a fresh start that would hide the checkpoints which the run dir's last run (its recipe.json)
    saved under another checkpoint.dir: it would rewrite the run's metrics over them without a word."""
    before = recorded_checkpoint_dirname(Path(run_dir), checkpoint_dir)
    found = latest_checkpoint(Path(run_dir) / before) if before != checkpoint_dir else None
    if found is not None:
        raise UserError(f"recipe.checkpoint.dir: {checkpoint_dir!r} holds no checkpoint, but this run dir's last run "
                        f"saved to {before!r} ({found.name}); set checkpoint.dir back to resume from it, or "
                        "checkpoint.resume=never to start fresh")


def checkpoint_meta(recipe: Recipe, engine, wandb_run_id: str | None) -> dict:
    """What state.json carries besides the state: recipe, shapes, model config, W&B run id."""
    config = getattr(engine.model, "config", None)
    return {
        "recipe_name": recipe.name,
        "recipe_hash": recipe.hash,
        "recipe": recipe.resolved,
        "model_shape": model_shape(recipe.model),
        "model_config": config.to_dict() if hasattr(config, "to_dict") else None,
        "global_batch": recipe.batch.global_batch,
        "world_size": recipe.batch.world_size,
        "wandb_run_id": wandb_run_id,
    }


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only metrics.jsonl lines up to `step` (a resumed run logs the later steps again)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the crash
    tmp = path.with_name(f"{TEMP_PREFIX}{path.name}")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
