"""How the engine calls a model with a batch, and what it reads from the answer.

This is the contract for any model, recipe-built or the user's own
(`toolkit.initialize(recipe, model=m)`), as the engine's `engine(batch)` applies it:

A batch is one of
  - a tensor of token ids, [micro_batch, seq_len + 1] int64: what the data layer
    (toolkit/data/batches.py) yields. The engine calls `model(tokens[:, :-1])` and the labels
    are `tokens[:, 1:]` (each position predicts the next token);
  - a dict of tensors: the engine calls `model(**batch)`; labels are `batch["labels"]`
    when present (aligned with the logits position by position: the engine does not
    shift them; -100 marks a position that does not count);
  - a tuple or list: the engine calls `model(*batch)` (no labels).
Tensors move to the engine's device; other values pass as they are.

The model's forward returns one of
  - a 0-dim loss tensor: used as it is;
  - an output with a `loss` (attribute or key) that is not None: that loss (Hugging Face
    models given labels);
  - logits, [..., vocab] (a tensor, or an output's `logits`): the engine's token
    cross-entropy against the batch's labels (above).
Anything else is a UserError saying what the engine expects.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from toolkit.errors import UserError

IGNORE_INDEX = -100  # labels equal to this do not count (torch's and Hugging Face's convention)

EXPECTED_OUTPUT = ("the engine expects a 0-dim loss tensor, an output with .loss, or logits [..., vocab] "
                   "(a tensor or an output's .logits) that it scores against the batch's labels")


def _to_device(value, device: torch.device):
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def call_model(model: torch.nn.Module, batch, device: torch.device):
    """Run the model on one batch; returns (its output, the labels for logits or None)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() != 2 or batch.dtype.is_floating_point or batch.dtype == torch.bool or batch.size(1) < 2:
            raise UserError(f"batch: a tensor batch is token ids [micro_batch, seq_len + 1] (int64), got "
                            f"{batch.dtype} {list(batch.shape)}; pass other inputs as a dict (model(**batch)) "
                            "or a tuple (model(*batch))")
        tokens = batch.to(device, non_blocking=True)
        return model(tokens[:, :-1]), tokens[:, 1:]
    if isinstance(batch, Mapping):
        moved = {key: _to_device(value, device) for key, value in batch.items()}
        return model(**moved), moved.get("labels")
    if isinstance(batch, (tuple, list)):
        return model(*(_to_device(value, device) for value in batch)), None
    raise UserError(f"batch: a {type(batch).__name__}; a batch is token ids [micro_batch, seq_len + 1], "
                    "a dict of tensors (model(**batch)) or a tuple (model(*batch))")


def _field(output, name: str):
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def read_output(output, model_name: str) -> tuple[str, torch.Tensor]:
    """("loss", 0-dim tensor) or ("logits", [..., vocab] tensor) from what a forward returned."""
    where = f"{model_name}.forward"
    if isinstance(output, torch.Tensor):
        kind, value = ("loss", output) if output.dim() == 0 else ("logits", output)
    elif isinstance(_field(output, "loss"), torch.Tensor):
        kind, value = "loss", _field(output, "loss")
    elif isinstance(_field(output, "logits"), torch.Tensor):
        kind, value = "logits", _field(output, "logits")
    else:
        raise UserError(f"{where} returned a {type(output).__name__}; {EXPECTED_OUTPUT}")
    if not value.dtype.is_floating_point:
        raise UserError(f"{where} returned {kind} of dtype {value.dtype}; {EXPECTED_OUTPUT}")
    if kind == "loss" and value.numel() != 1:
        raise UserError(f"{where} returned a loss of shape {list(value.shape)}; reduce it to one number "
                        "(e.g. .mean())")
    if kind == "logits" and value.dim() < 2:
        raise UserError(f"{where} returned a tensor of shape {list(value.shape)}; {EXPECTED_OUTPUT}")
    return kind, value.reshape(()) if kind == "loss" else value


def check_labels(logits: torch.Tensor, labels, model_name: str) -> torch.Tensor:
    """The labels for the logits, or a UserError saying why there are none that fit."""
    if labels is None:
        raise UserError(f"{model_name}.forward returned logits but the batch has no labels: pass token ids "
                        "[micro_batch, seq_len + 1], a dict with 'labels', or return the loss from forward")
    if not isinstance(labels, torch.Tensor) or labels.shape != logits.shape[:-1]:
        shape = list(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise UserError(f"batch labels {shape} do not match the logits {list(logits.shape)} "
                        "(labels are aligned with the logits position by position, [..., vocab] -> [...])")
    return labels.long()
