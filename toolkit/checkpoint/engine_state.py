"""`engine.save_checkpoint(save_dir, tag=None, client_state={})` and
`engine.load_checkpoint(load_dir, tag=None) -> (path, client_state)`: DeepSpeed's
names and shapes over the toolkit's checkpoints (toolkit/checkpoint/checkpointer.py: atomic,
verified, ZeRO-sharded, readable at any world size and stage).

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

from toolkit.checkpoint.checkpointer import (LATEST_FILE, MANIFEST_FILE, TEMP_PREFIX, checkpoint_meta, find_checkpoint,
                                flatten_state, latest_checkpoint, load_checkpoint, save_checkpoint,
                                save_distributed_checkpoint)
from toolkit.errors import UserError


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
    meta = checkpoint_meta(engine.recipe, engine, None)
    shard = engine.write_shard if engine.sharded_checkpoint else None
    if engine.dist.active:
        return save_distributed_checkpoint(save_dir, engine.global_step, state, meta, engine.dist, shard, name=tag)
    return save_checkpoint(save_dir, engine.global_step, state, meta, shard, name=tag)


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
