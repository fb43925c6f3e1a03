"""`toolkit export`: a training checkpoint -> a Hugging Face folder (config.json,
model.safetensors, generation_config.json) that `AutoModelForCausalLM.from_pretrained`
loads with no toolkit installed.

The config is the trained model's own transformers config, stored in the checkpoint
(for recipe-built models it is `toolkit.models.build_config(recipe.model)`; for a
`model.pretrained` start it is that folder's config), so the export needs nothing
but the checkpoint. Weights are fp32, as trained; tied weights (GPT-2's lm_head =
wte) are written once, as transformers itself writes them. What does not live here:
reading and verifying checkpoints (toolkit/checkpoint.py).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.checkpoint import Checkpoint, find_checkpoint, load_checkpoint, make_temp_dir
from toolkit.errors import UserError


@dataclass
class Export:
    """What `export_hf` wrote."""
    out_dir: Path
    checkpoint: Path
    step: int
    recipe_hash: str
    files: list[str]


def hf_config(ckpt: Checkpoint):
    """The transformers config of the checkpoint's model, with the KV cache on for generation."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    stored = ckpt.meta.get("model_config")
    if not stored or stored.get("model_type") not in CONFIG_MAPPING:
        raise UserError(f"{ckpt.path}: the model is not a transformers model (no config in the checkpoint); "
                        "only recipe-built or pretrained models export")
    stored = dict(stored)
    config = CONFIG_MAPPING[stored.pop("model_type")].from_dict(stored)
    config.use_cache = True  # NOTE: training turns the KV cache off; generation wants it
    return config


def checkpoint_model_state(ckpt: Checkpoint) -> dict:
    """The whole model state dict: as saved (stage 0), or consolidated from the ZeRO shards (stages 1-3)."""
    engine = ckpt.state["engine"]
    if "zero" in engine:
        from toolkit.zero.state import consolidated_model_state

        return consolidated_model_state(engine, ckpt.path)
    return engine["model"]


def build_hf_model(ckpt: Checkpoint):
    """The checkpoint's weights in a transformers model, built on the meta device (no random init)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        model.load_state_dict(checkpoint_model_state(ckpt), strict=True, assign=True)
    except RuntimeError as exc:
        raise UserError(f"{ckpt.path}: the weights do not fit the stored model config: "
                        f"{str(exc).strip().splitlines()[0]}") from None
    model.tie_weights()  # assign=True gave lm_head and wte separate (equal) tensors: tie them again
    return model.eval()


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir}: exists and is not empty; export into a new or empty folder")


def export_hf(source: str | os.PathLike, out_dir: str | os.PathLike) -> Export:
    """The latest checkpoint of a run dir (or a given checkpoints or step dir) -> a Hugging Face folder."""
    from transformers.utils import logging as hf_logging

    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    step_dir = find_checkpoint(Path(source))
    ckpt = load_checkpoint(step_dir)
    model = build_hf_model(ckpt)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed into place: never a half-written export.
    tmp = make_temp_dir(out_dir.parent, out_dir.name)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if not (tmp / "generation_config.json").is_file():
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(model.config).save_pretrained(tmp)
        _check_out_dir(out_dir)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked just above
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return Export(out_dir=out_dir, checkpoint=step_dir, step=ckpt.step,
                  recipe_hash=ckpt.meta.get("recipe_hash", "?"), files=sorted(p.name for p in out_dir.iterdir()))
