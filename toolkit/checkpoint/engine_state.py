"""An engine's checkpoint state, and DeepSpeed's `engine.save_checkpoint(save_dir,
tag=None, client_state={})` / `engine.load_checkpoint(load_dir, tag=None) ->
(path, client_state)` over the toolkit's checkpoints (atomic, verified,
ZeRO-sharded, readable at any world size and stage: files.py, io.py).

What an engine's state holds (`engine_state`): at stage 0 the model and torch
optimizer state dicts; at stages 1-3 where the shards are (each rank writes its
own, zero_shards.py), the model's buffers and tied-weight aliases; at every stage
the schedule, loss scaler and step counters. `load_engine_state` reads either
kind into any stage at any world size. The engine is used through its
attributes (model, strategy, scheduler, loss_scaler, optimizer, dist, counters),
so this layer sits below toolkit.runtime, which calls it.

A save writes <save_dir>/<tag> (default tag: step-NNNNNN, the engine's optimizer
step, the layout `toolkit run` writes, so `toolkit export` and `generate` read it)
and points <save_dir>/latest at it. It holds the engine's state (model, optimizer,
schedule, loss scale, step counters) and `client_state`: anything of tensors,
numbers, strings, lists and dicts (nothing is pickled; rank 0's is saved). Under
several ranks every rank calls both, as in DeepSpeed. The data position and RNGs
are the caller's own (`toolkit run` saves them; its checkpoints load here too).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from toolkit.checkpoint.files import LATEST_FILE, MANIFEST_FILE, TEMP_PREFIX, find_checkpoint, latest_checkpoint
from toolkit.checkpoint.io import load_checkpoint, save_checkpoint, save_distributed_checkpoint
from toolkit.checkpoint.resume import checkpoint_meta
from toolkit.checkpoint.state import flatten_state
from toolkit.checkpoint.zero_shards import (FullStateReader, ShardFilesReader, parameter_aliases, shard_file_name,
                                             write_shard)
from toolkit.errors import UserError


def is_sharded(engine) -> bool:
    """True when each rank saves its own shard (ZeRO stages 1-3, the mesh); stage 0 saves one replicated state.
    The engine's strategy is a toolkit.runtime.strategy.Strategy (a layer above: used, not imported)."""
    return engine.strategy.sharded_checkpoint


def engine_state(engine) -> dict:
    """Everything needed to continue exactly (model, optimizer, schedule, scaler, counters).

    Stage 0: the model and torch optimizer state dicts. Stages 1-3: where the shards are
    (`shard_writer` writes this rank's), the model's buffers and tied-weight aliases.
    """
    engine.strategy.complete_pending_update()  # NOTE: a delayed offload update lands first (every rank saves)
    counters = {
        "scheduler": engine.scheduler.state_dict(),
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "global_step": engine.global_step,
        "skipped_steps": engine.skipped_steps,
    }
    if not is_sharded(engine):
        if engine.strategy.extra_state():  # 1-bit Adam: each rank's error buffers in its own file
            counters["error_feedback_files"] = [error_feedback_file_name(r, engine.dist.world_size)
                                                for r in range(engine.dist.world_size)]
        return {"model": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict(), **counters}
    world = engine.dist.world_size
    zero = {"stage": engine.strategy.stage, "world_size": world, "step": engine.strategy.optimizer_steps(),
            "files": [shard_file_name(r, world) for r in range(world)], "aliases": parameter_aliases(engine.model)}
    return {"zero": zero, "buffers": persistent_buffers(engine.model), **counters}


def shard_writer(engine):
    """A function that writes this rank's ZeRO shard file into a directory (returning its name), or None at
    stage 0 (nothing per rank)."""
    if not is_sharded(engine):
        return extra_state_writer(engine) if engine.strategy.extra_state() else None

    def write(directory) -> str:
        name = shard_file_name(engine.dist.rank, engine.dist.world_size)
        write_shard(Path(directory) / name, engine.strategy.owned_pieces(), engine.strategy.param_shapes())
        return name
    return write


def error_feedback_file_name(rank: int, world_size: int) -> str:
    """onebit-rank-00001-of-00004.safetensors: a rank's 1-bit Adam error-feedback buffers."""
    return f"onebit-rank-{rank:05d}-of-{world_size:05d}.safetensors"


def extra_state_writer(engine):
    """A function that writes this rank's strategy.extra_state() (1-bit Adam's error buffers) into a directory
    (returning its name)."""
    from safetensors.torch import save_file

    def write(directory) -> str:
        name = error_feedback_file_name(engine.dist.rank, engine.dist.world_size)
        save_file({k: v.detach().cpu().contiguous() for k, v in engine.strategy.extra_state().items()},
                  str(Path(directory) / name))
        return name
    return write


def write_engine_checkpoint(directory: Path, engine, state: dict, meta: dict, name: str | None = None) -> Path:
    """Save `state` (the engine's and the caller's) atomically as the engine's step: one process, or every
    rank (ZeRO shards from each, the rest from rank 0)."""
    info = getattr(engine, "dist", None)
    if info is not None and info.active:
        return save_distributed_checkpoint(directory, engine.global_step, state, meta, info, shard_writer(engine),
                                           name=name)
    return save_checkpoint(directory, engine.global_step, state, meta, shard_writer(engine), name=name)


def load_engine_state(engine, state: dict, checkpoint_dir, param_names: list[str]) -> None:
    """Restore what engine_state() saved, from any stage and world size (sharded checkpoints read their shard
    files in `checkpoint_dir`; `param_names` is the torch AdamW index order a stage 0 state is keyed by)."""
    if "zero" in state or is_sharded(engine):
        _load_model_states(engine, state, checkpoint_dir, param_names)
    else:
        _load_replicated(engine, state)
    if state.get("error_feedback_files"):  # a strategy without extra state ignores them
        engine.strategy.load_extra_state(checkpoint_dir, state["error_feedback_files"])
    engine.scheduler.load_state_dict(state["scheduler"])
    if engine.loss_scaler is not None and state.get("loss_scaler") is not None:
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
    engine.global_step = int(state["global_step"])
    engine.skipped_steps = int(state["skipped_steps"])


def _load_model_states(engine, state: dict, checkpoint_dir, param_names: list[str]) -> None:
    """Weights and AdamW moments through a reader of per-parameter ranges (any stage, any world size)."""
    if "zero" in state:
        if checkpoint_dir is None:
            raise ValueError("a ZeRO checkpoint needs checkpoint_dir (where its shard files are)")
        reader = ShardFilesReader(checkpoint_dir, state["zero"]["files"], state["zero"]["step"])
        buffers = state.get("buffers") or {}
    else:
        reader = FullStateReader(state["model"], state.get("optimizer"), param_names)
        params = {n for n, _ in engine.model.named_parameters(remove_duplicate=False)}
        buffers = {k: v for k, v in state["model"].items() if k not in params}
    engine.strategy.complete_pending_update()  # a delayed update in flight must not land over the loaded states
    try:
        engine.strategy.load_pieces(reader)
    finally:
        reader.close()
    own = persistent_buffers(engine.model)
    with torch.no_grad():
        for name, value in buffers.items():
            if name in own:
                own[name].copy_(value)


def _load_replicated(engine, state: dict) -> None:
    engine.model.load_state_dict(state["model"])
    # NOTE: torch's Optimizer.load_state_dict replaces each param group's settings with
    # the saved ones (fused/foreach flags included); keep the recipe's and take only the
    # per-parameter state (moments, step). The schedule writes lr just below.
    settings = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
    engine.optimizer.load_state_dict(state["optimizer"])
    for group, own in zip(engine.optimizer.param_groups, settings):
        group.update(own)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers that its state_dict carries (non-persistent ones excluded)."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = buf
    return out


def _check_tag(tag) -> str | None:
    if tag is None:
        return None
    tag = str(tag)
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..", LATEST_FILE) or tag.startswith(TEMP_PREFIX):
        raise UserError(f"save_checkpoint: tag {tag!r} is not a plain directory name (no '/', not "
                        f"'{LATEST_FILE}', not starting with '{TEMP_PREFIX}')")
    return tag


def save_engine_checkpoint(engine, save_dir, tag=None, client_state=None) -> Path:
    """Save the engine (and `client_state`) to <save_dir>/<tag>, atomically; every rank calls it. Returns the dir."""
    tag = _check_tag(tag)
    client_state = {} if client_state is None else client_state
    try:
        flatten_state(client_state)  # on every rank: a refusal must not leave the others waiting
    except TypeError as exc:
        raise UserError(f"save_checkpoint: client_state: {str(exc).split(': ', 1)[-1]}") from None
    engine.check_finite()
    if engine.micro_step:
        print(f"warning: save_checkpoint: {engine.micro_step} micro batch(es) since the last step(); their "
              "accumulated gradients are not saved", file=sys.stderr, flush=True)
    state = {"engine": engine.state_dict(), "client_state": client_state}
    return write_engine_checkpoint(save_dir, engine, state, checkpoint_meta(engine.recipe, engine, None), name=tag)


def _manifest_step(step_dir: Path) -> int:
    try:
        return int(json.loads((step_dir / MANIFEST_FILE).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def newest_checkpoint(load_dir: Path) -> Path | None:
    """The checkpoint <load_dir>/latest names, unless a step-NNNNNN dir of a later step exists (a save that
    crashed before updating the pointer); a step dir or run dir given directly; None when there is none."""
    if (load_dir / MANIFEST_FILE).is_file():
        return load_dir
    newest = latest_checkpoint(load_dir)
    try:
        pointed = load_dir / (load_dir / LATEST_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        pointed = None
    if pointed is not None and (pointed / MANIFEST_FILE).is_file():
        if newest is None or _manifest_step(pointed) >= _manifest_step(newest):
            return pointed
    if newest is not None:
        return newest
    try:
        return find_checkpoint(load_dir)  # a run dir: its checkpoint.dir
    except UserError:
        return None


def load_engine_checkpoint(engine, load_dir, tag=None):
    """Restore the engine from <load_dir>/<tag> (default: the newest); returns (its path, client_state),
    or (None, None) with a warning when load_dir holds no checkpoint (as DeepSpeed does)."""
    load_dir = Path(load_dir)
    if tag is not None:
        path = load_dir / str(tag)
    else:
        path = newest_checkpoint(load_dir)
        if path is None:
            print(f"warning: load_checkpoint: {load_dir}: no checkpoint there; nothing loaded",
                  file=sys.stderr, flush=True)
            return None, None
    ckpt = load_checkpoint(path)  # verified against its manifest; UserError if not
    try:
        engine.load_state_dict(ckpt.state["engine"], checkpoint_dir=ckpt.path)
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{ckpt.path}: the checkpoint does not fit this model: {first}") from None
    return ckpt.path, ckpt.state.get("client_state", {})
