"""`toolkit export`: a training checkpoint -> a Hugging Face folder (config.json,
model.safetensors, generation_config.json) that `AutoModelForCausalLM.from_pretrained`
loads with no toolkit installed, and the run's tokenizer (tokenizer.json,
tokenizer_config.json) that `AutoTokenizer.from_pretrained` loads and that encodes
exactly as the run did (byte-level, BPE, the pretrained folder's, or synthetic data's
ids as words).
NOTE: a pretrained tokenizer keeps its own post-processor: where it adds a BOS token,
AutoTokenizer adds it by default as the original folder does, while the run's documents
carried none (`encode(text, add_special_tokens=False)` gives the run's ids).

The config is the trained model's own transformers config, stored in the checkpoint
(for recipe-built models it is `toolkit.models.build.build_config(recipe.model)`; for a
`model.pretrained` start it is that folder's config), so the export needs nothing
but the checkpoint. Weights are fp32, as trained; tied weights (GPT-2's lm_head =
wte) are written once, as transformers itself writes them. What does not live here:
reading and verifying checkpoints (toolkit/checkpoint/checkpointer.py).
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.checkpoint.files import find_checkpoint, make_temp_dir
from toolkit.checkpoint.io import Checkpoint
from toolkit.checkpoint.resume import load_training_checkpoint
from toolkit.errors import WRITE_ERRNOS, UserError, describe_os_error, os_errno
from toolkit.data.tokenizer import (TOKENIZER_FILE, TextTokenizer, byte_tokenizer, load_tokenizer_folder, run_tokenizer_dir,
                               synthetic_tokenizer)


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
    try:
        config = CONFIG_MAPPING[stored.pop("model_type")].from_dict(stored)
    except Exception as exc:  # NOTE: transformers' field validation raises huggingface_hub's own Exception types
        raise UserError(f"{ckpt.path / 'state.json'}: model_config: {_first_line(exc.__cause__ or exc)}") from None
    config.use_cache = True  # NOTE: training turns the KV cache off; generation wants it
    return config


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def checkpoint_model_state(ckpt: Checkpoint) -> dict:
    """The whole model state dict: as saved (stage 0), or consolidated from the ZeRO shards (stages 1-3)."""
    engine = ckpt.state["engine"]
    if "zero" in engine:
        from toolkit.checkpoint.zero_shards import consolidated_model_state

        return consolidated_model_state(engine, ckpt.path)
    return engine["model"]


def max_positions(config) -> int:
    """The model's context length in tokens (GPT-2 names it n_positions, Llama max_position_embeddings)."""
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 1024


def build_hf_model(ckpt: Checkpoint):
    """The checkpoint's weights in a transformers model, built on the meta device (no random init)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(ckpt)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError, ArithmeticError, AttributeError, KeyError) as exc:
        # NOTE: only a stored config a person edited gets here (sizes <= 0, heads that do not divide the width)
        raise UserError(f"{ckpt.path / 'state.json'}: model_config does not build a "
                        f"{config.model_type} model: {type(exc).__name__}: {_first_line(exc)}") from None
    try:
        model.load_state_dict(checkpoint_model_state(ckpt), strict=True, assign=True)
    except RuntimeError as exc:
        raise UserError(f"{ckpt.path}: the weights do not fit the stored model config: "
                        f"{str(exc).strip().splitlines()[0]}") from None
    model.tie_weights()  # assign=True gave lm_head and wte separate (equal) tensors: tie them again
    return model.eval()


def run_tokenizer_folder(ckpt: Checkpoint) -> Path:
    """Where the checkpoint's run saved its tokenizer: <run_dir>/tokenizer."""
    checkpoint_dir = ((ckpt.meta.get("recipe") or {}).get("checkpoint") or {}).get("dir", "checkpoints")
    return run_tokenizer_dir(ckpt.path, checkpoint_dir)


def run_tokenizer(ckpt: Checkpoint, vocab_size: int) -> TextTokenizer | None:
    """The tokenizer the checkpoint's run trained with (from <run_dir>/tokenizer), or None when it is lost."""
    data = (ckpt.meta.get("recipe") or {}).get("data") or {}
    folder = run_tokenizer_folder(ckpt)
    if (folder / TOKENIZER_FILE).is_file():
        tokenizer = load_tokenizer_folder(folder, where="tokenizer", need_eot=False)
    elif data.get("kind", "synthetic") == "synthetic":  # ids as words (runs before it was saved have no folder)
        tokenizer = synthetic_tokenizer(data.get("vocab_size") or vocab_size)
    elif data.get("tokenizer") == "byte":  # nothing trained: the same tokenizer again
        tokenizer = byte_tokenizer()
    else:
        print(f"warning: {ckpt.path}: the run's {data.get('tokenizer')} tokenizer is not at {folder}; the export has "
              "no tokenizer (copy the run's tokenizer folder into it, or pass --tokenizer to toolkit generate)",
              file=sys.stderr, flush=True)
        return None
    if tokenizer.vocab_size > vocab_size:
        raise UserError(f"{folder}: the tokenizer has {tokenizer.vocab_size} tokens but the model only {vocab_size}; "
                        "it is not this run's tokenizer")
    return tokenizer


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir}: exists and is not empty; export into a new or empty folder")


def _export_write_error(exc: BaseException, out_dir: Path) -> UserError | None:
    """One line for an export that could not be written (read-only, forbidden, full disk), naming the
    target rather than the hidden temporary folder; None when `exc` is not a failed write."""
    if os_errno(exc) not in WRITE_ERRNOS:
        return None
    return UserError(f"{out_dir}: cannot write: {describe_os_error(exc)}; free space, or export into a folder "
                     "you can write")


def _give_umask_permissions(folder: Path) -> None:
    """Files as a plain `open` would create them (0644 under umask 022): safetensors writes model.safetensors 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def export_hf(source: str | os.PathLike, out_dir: str | os.PathLike) -> Export:
    """The latest checkpoint of a run dir (or a given checkpoints or step dir) -> a Hugging Face folder."""
    from transformers.utils import logging as hf_logging

    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    step_dir = find_checkpoint(Path(source))
    ckpt = load_training_checkpoint(step_dir)
    model = build_hf_model(ckpt)
    tokenizer = run_tokenizer(ckpt, model.config.vocab_size)
    # Written beside the target and renamed into place: never a half-written export.
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(out_dir.parent, out_dir.name)
    except OSError as exc:
        raise (_export_write_error(exc, out_dir) or exc) from None
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if not (tmp / "generation_config.json").is_file():
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(model.config).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save(tmp, model_max_length=max_positions(model.config))
        _give_umask_permissions(tmp)
        _check_out_dir(out_dir)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked just above
        os.rename(tmp, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        error = _export_write_error(exc, out_dir)
        if error is not None:
            raise error from None
        raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return Export(out_dir=out_dir, checkpoint=step_dir, step=ckpt.step,
                  recipe_hash=ckpt.meta.get("recipe_hash", "?"), files=sorted(p.name for p in out_dir.iterdir()))
