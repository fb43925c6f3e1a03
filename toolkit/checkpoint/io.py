"""Saving and loading one step directory. One process writes the state files; under
ZeRO several ranks each write their shard into one temp dir, which rank 0 completes
and renames. Loading verifies every file first. The layout and integrity helpers are
in toolkit/checkpoint/files.py, the state's flattening in toolkit/checkpoint/state.py.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from toolkit.checkpoint.files import (FORMAT, FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE, STATE_FILE, TENSORS_FILE,
                                      fsync_dir, fsync_file, make_temp_dir, read_checkpoint_json, remove_dir,
                                      sha256_file, step_dir_name, verify_checkpoint, write_json, write_pointer)
from toolkit.checkpoint.files import structure_problem
from toolkit.checkpoint.state import flatten_state, unflatten_state
from toolkit.errors import UserError, failed_write


@contextmanager
def _naming_failed_writes(path: Path):
    """A write that fails inside (full disk, file-size limit, read-only) is one UserError line naming the file:
    the error's own file name where it has one, else `path`. Other errors keep their traceback."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        line = failed_write(exc, path)
        if line is None:
            raise
        raise UserError(line) from None


def _write_state_files(tmp: Path, step: int, state: dict, meta: dict, shard_files: dict | None = None) -> None:
    """Write state.safetensors, state.json and the manifest (with any rank shards' checksums) into tmp, fsynced."""
    from safetensors.torch import save_file

    skeleton, tensors = flatten_state(state)
    with _naming_failed_writes(tmp / TENSORS_FILE):
        save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": FORMAT})
        fsync_file(tmp / TENSORS_FILE)
    with _naming_failed_writes(tmp / STATE_FILE):
        write_json(tmp / STATE_FILE, {"format": FORMAT, "version": FORMAT_VERSION, "step": step,
                                       **meta, "state": skeleton})
    files = {f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size}
             for f in (TENSORS_FILE, STATE_FILE)}
    files.update(shard_files or {})
    with _naming_failed_writes(tmp / MANIFEST_FILE):
        write_json(tmp / MANIFEST_FILE, {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "files": files})
        fsync_dir(tmp)


def _write_shard_file(tmp: Path, write_shard) -> tuple[str, dict]:
    """A rank's ZeRO shard written into tmp and fsynced: (file name, its manifest entry)."""
    with _naming_failed_writes(tmp):
        shard = write_shard(tmp)
        fsync_file(tmp / shard)
    return shard, {"sha256": sha256_file(tmp / shard), "bytes": (tmp / shard).stat().st_size}


def save_checkpoint(ckpt_dir: Path, step: int, state: dict, meta: dict, write_shard=None, name=None) -> Path:
    """Write <ckpt_dir>/step-NNNNNN (or <ckpt_dir>/`name`) atomically, then point `latest` at it; returns the
    step dir. `write_shard(tmp_dir) -> file name` adds a one-process ZeRO run's shard (stages 1-3, no group)."""
    ckpt_dir = Path(ckpt_dir)
    name = name or step_dir_name(step)
    final = ckpt_dir / name
    with _naming_failed_writes(ckpt_dir):
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(ckpt_dir, name)
    try:
        shard_files = dict([_write_shard_file(tmp, write_shard)]) if write_shard is not None else {}
        _write_state_files(tmp, step, state, meta, shard_files=shard_files)
        with _naming_failed_writes(final):
            if final.exists():  # the same step saved again (a fresh run in an old run dir): replace it
                remove_dir(final)
            os.rename(tmp, final)
            fsync_dir(ckpt_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with _naming_failed_writes(ckpt_dir / LATEST_FILE):
        write_pointer(ckpt_dir / LATEST_FILE, name)  # last: `latest` only ever names a complete checkpoint
    return final


def save_distributed_checkpoint(ckpt_dir: Path, step: int, state: dict, meta: dict, info, write_shard=None,
                                name=None) -> Path:
    """Every rank's part of one checkpoint: each writes its ZeRO shard (`write_shard(tmp_dir) -> file name`,
    stage 1-3) into one temp dir, then rank 0 writes the state files and a manifest covering every file and
    renames the directory into place (stage 0: rank 0 alone writes; the state is replicated). `name`: the
    directory's name instead of step-NNNNNN."""
    import torch.distributed as dist

    ckpt_dir, name = Path(ckpt_dir), name or step_dir_name(step)
    final = ckpt_dir / name
    box = [None]
    if info.rank == 0:
        try:
            with _naming_failed_writes(ckpt_dir):
                ckpt_dir.mkdir(parents=True, exist_ok=True)
                box = [str(make_temp_dir(ckpt_dir, name))]
        except UserError as exc:
            box = [exc]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserError):  # every rank stops; rank 0 alone says why
        raise box[0] if info.rank == 0 else UserError()
    tmp = Path(box[0])
    report = None
    try:
        if write_shard is not None:
            report = _write_shard_file(tmp, write_shard)
    except Exception as exc:  # every rank must hear of it, or the others wait forever
        why = exc.lines[0] if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        report = ("error", f"rank {info.rank}: {why}", isinstance(exc, UserError))
    reports = [None] * info.world_size
    dist.all_gather_object(reports, report)
    errors = [r for r in reports if r is not None and r[0] == "error"]
    outcome = [None]  # rank 0's verdict: None (complete), or why the checkpoint was abandoned
    if info.rank == 0:
        try:
            if errors:
                raise (UserError if errors[0][2] else RuntimeError)(errors[0][1])
            _write_state_files(tmp, step, state, meta, shard_files={r[0]: r[1] for r in reports if r is not None})
            with _naming_failed_writes(final):
                if final.exists():
                    remove_dir(final)
                os.rename(tmp, final)
                fsync_dir(ckpt_dir)
            with _naming_failed_writes(ckpt_dir / LATEST_FILE):
                write_pointer(ckpt_dir / LATEST_FILE, name)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            dist.broadcast_object_list([str(exc) or type(exc).__name__], src=0)
            raise
    dist.broadcast_object_list(outcome, src=0)  # rank 0 renamed (or cleaned up): complete for everyone
    if outcome[0] is not None:
        raise UserError()  # rank 0 raises the reason
    return final


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint: `state` feeds the engine, stream and RNGs; `meta` is the rest of state.json;
    `files` are the names manifest.json verified."""
    path: Path
    step: int
    state: dict
    meta: dict
    files: tuple[str, ...] = ()

    @property
    def wandb_run_id(self) -> str | None:
        return self.meta.get("wandb_run_id")


def load_checkpoint(step_dir: Path) -> Checkpoint:
    """Verify and read a step directory; tensors land on the CPU."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    step_dir = Path(step_dir)
    manifest = verify_checkpoint(step_dir)
    state_path = step_dir / STATE_FILE
    data = read_checkpoint_json(state_path, "the checkpoint's state")
    problem = structure_problem(data, {"step": int, "state": object})
    if problem is None and data["step"] != manifest["step"]:
        problem = f"step: {data['step']}, but {MANIFEST_FILE} says {manifest['step']}"
    if problem:
        raise UserError(f"{state_path}: {problem} (a hand-edited or foreign checkpoint)")
    try:
        tensors = load_file(str(step_dir / TENSORS_FILE), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{step_dir / TENSORS_FILE}: unreadable: {str(exc).splitlines()[0]}") from None
    try:
        state = unflatten_state(data.pop("state"), tensors)
    except KeyError as exc:
        raise UserError(f"{state_path}: names tensor {exc.args[0]!r}, which {TENSORS_FILE} does not have") from None
    except ValueError as exc:
        raise UserError(f"{state_path}: {exc} (a hand-edited checkpoint)") from None
    except RecursionError:
        raise UserError(f"{state_path}: state: nested too deeply (a hand-edited checkpoint)") from None
    return Checkpoint(path=step_dir, step=data["step"], state=state, meta=data, files=tuple(manifest["files"]))
