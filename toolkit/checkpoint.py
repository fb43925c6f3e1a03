"""Checkpoints: atomic save, verified load, exact resume, and the rules for
resuming under a changed recipe. The loop (toolkit/train.py) drives a
`Checkpointer`; the Hugging Face export (toolkit/export.py) reads what it wrote.

Layout, one directory per saved optimizer step:

    <run_dir>/<checkpoint.dir>/step-000200/state.safetensors  every tensor, keyed by its path in the state
                                          /state.json         everything else; tensors appear as {"__tensor__": key}
                                          /manifest.json      sha256 and size of the two files above
    <run_dir>/<checkpoint.dir>/latest                         the name of the newest complete step directory

The state is {"engine": Engine.state_dict(), "stream": BatchStream.state_dict(),
"rng": python/numpy/torch/CUDA generator states}; state.json also carries the step,
the resolved recipe and its hash, the model's transformers config and the W&B run id.
Nothing is pickled: tensors go through safetensors, the rest through JSON.

Atomic: files are written into a temp directory beside the final one (`.tmp-*`),
fsynced, then the directory is renamed to step-NNNNNN (the commit point) and only
then is `latest` replaced (temp file + rename). Readers ignore `.tmp-*` entries and
trust complete step directories over the pointer: a crash between the rename and the
pointer update leaves a complete, newer step directory, which wins.

Several ranks (`save_distributed_checkpoint`): under ZeRO stages 1-3 each rank also
writes zero-rank-RRRRR-of-WWWWW.safetensors into the same temp directory (per-parameter
pieces, toolkit/zero/state.py, readable at any world size) and rank 0 writes the rest,
with a manifest covering every file, and renames; at stage 0 rank 0 alone writes.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolkit.errors import UserError
from toolkit.specs import ModelSpec, Recipe

FORMAT = "toolkit-checkpoint"
FORMAT_VERSION = 1
TENSORS_FILE = "state.safetensors"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
TEMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    """step-000200: zero padded so names sort by step."""
    return f"step-{step:06d}"


# ---------------------------------------------------------------------------
# Flattening: nested state <-> (JSON skeleton, flat dict of tensors)

_TENSOR, _TUPLE, _ITEMS, _NDARRAY = "__tensor__", "__tuple__", "__items__", "__ndarray__"
_MARKERS = (_TENSOR, _TUPLE, _ITEMS, _NDARRAY)


def flatten_state(state) -> tuple[object, dict[str, torch.Tensor]]:
    """Nested dicts/lists/tuples of tensors and plain values -> a JSON-able skeleton and {key: tensor}.

    Tensors are keyed by their path ("engine.optimizer.state.0.exp_avg"). Dicts with
    non-string keys (optimizer state is keyed by int) and tuples are tagged so that
    `unflatten_state` gives back exactly the same types.
    """
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def store(tensor: torch.Tensor, path: str) -> dict:
        t = tensor.detach().cpu()
        storage = t.untyped_storage()
        whole = (t.is_contiguous() and t.storage_offset() == 0
                 and t.numel() * t.element_size() == storage.nbytes())
        # NOTE: safetensors refuses tensors that share memory (GPT-2's lm_head is wte) and
        # views into a larger storage; those are copied, everything else is written as is.
        if not whole or storage.data_ptr() in storages:
            t = t.contiguous().clone()
        storages.add(t.untyped_storage().data_ptr())
        key, n = path or "tensor", 1
        while key in tensors:  # a dict key with dots could collide with a nested path
            key, n = f"{path}#{n}", n + 1
        tensors[key] = t
        return {_TENSOR: key}

    def walk(node, path: str):
        if isinstance(node, torch.Tensor):
            return store(node, path)
        if isinstance(node, dict):
            plain = all(isinstance(k, str) for k in node) and not (len(node) == 1 and next(iter(node)) in _MARKERS)
            if plain:
                return {k: walk(v, f"{path}.{k}" if path else k) for k, v in node.items()}
            for k in node:
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise TypeError(f"checkpoint state at {path or '<root>'}: dict key {k!r} is not a JSON scalar")
            return {_ITEMS: [[k, walk(v, f"{path}.{k}")] for k, v in node.items()]}
        if isinstance(node, tuple):
            return {_TUPLE: [walk(v, f"{path}.{i}") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(node)]
        if isinstance(node, np.ndarray):
            return {_NDARRAY: {"dtype": str(node.dtype), "shape": list(node.shape), "data": node.ravel().tolist()}}
        if isinstance(node, np.generic):
            return node.item()
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"checkpoint state at {path or '<root>'}: cannot store a {type(node).__name__} "
                        "(tensors, numbers, strings, lists and dicts only; nothing is pickled)")

    return walk(state, ""), tensors


def unflatten_state(skeleton, tensors: dict[str, torch.Tensor]):
    """Inverse of `flatten_state`."""
    def build(node):
        if isinstance(node, list):
            return [build(v) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            (tag, value), = node.items()
            if tag == _TENSOR:
                if value not in tensors:
                    raise KeyError(value)
                return tensors[value]
            if tag == _TUPLE:
                return tuple(build(v) for v in value)
            if tag == _ITEMS:
                return {k: build(v) for k, v in value}
            if tag == _NDARRAY:
                return np.array(value["data"], dtype=value["dtype"]).reshape(value["shape"])
        return {k: build(v) for k, v in node.items()}

    return build(skeleton)


# ---------------------------------------------------------------------------
# Random number generators

def capture_rng_state() -> dict:
    """Every generator training may draw from: python `random`, numpy, torch CPU, CUDA when present."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(legacy=False),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Put back what `capture_rng_state` saw."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    saved_cuda = state.get("cuda")
    if saved_cuda is not None and torch.cuda.is_available():
        if len(saved_cuda) != torch.cuda.device_count():
            print(f"warning: resume: the checkpoint has CUDA generator states for {len(saved_cuda)} devices, "
                  f"this machine has {torch.cuda.device_count()}; restoring the first "
                  f"{min(len(saved_cuda), torch.cuda.device_count())}", file=sys.stderr)
        for device, rng in enumerate(saved_cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, device)


# ---------------------------------------------------------------------------
# Files: fsync, checksums, atomic writes

def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # NOTE: some platforms (Windows) cannot open a directory; rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_pointer(path: Path, name: str) -> None:
    """Replace a small text file atomically: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f"{TEMP_PREFIX}{path.name}-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A fresh `.tmp-*` directory in `parent`, with the permissions a plain mkdir would give (mkdtemp gives 0700)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{prefix}-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def _remove_dir(path: Path) -> None:
    """Rename out of sight first, so a crash mid-delete never leaves a step dir with missing files."""
    doomed = path.with_name(f"{TEMP_PREFIX}delete-{path.name}-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# ---------------------------------------------------------------------------
# Save and load

def _write_state_files(tmp: Path, step: int, state: dict, meta: dict, shard_files: dict | None = None) -> None:
    """Write state.safetensors, state.json and the manifest (with any rank shards' checksums) into tmp, fsynced."""
    from safetensors.torch import save_file

    skeleton, tensors = flatten_state(state)
    save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": FORMAT})
    _fsync_file(tmp / TENSORS_FILE)
    _write_json(tmp / STATE_FILE, {"format": FORMAT, "version": FORMAT_VERSION, "step": step,
                                   **meta, "state": skeleton})
    files = {f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size}
             for f in (TENSORS_FILE, STATE_FILE)}
    files.update(shard_files or {})
    _write_json(tmp / MANIFEST_FILE, {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "files": files})
    _fsync_dir(tmp)


def save_checkpoint(ckpt_dir: Path, step: int, state: dict, meta: dict) -> Path:
    """Write <ckpt_dir>/step-NNNNNN atomically, then point `latest` at it; returns the step dir."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = step_dir_name(step)
    final = ckpt_dir / name
    tmp = make_temp_dir(ckpt_dir, name)
    try:
        _write_state_files(tmp, step, state, meta)
        if final.exists():  # the same step saved again (a fresh run in an old run dir): replace it
            _remove_dir(final)
        os.rename(tmp, final)
        _fsync_dir(ckpt_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_pointer(ckpt_dir / LATEST_FILE, name)  # last: `latest` only ever names a complete checkpoint
    return final


def save_distributed_checkpoint(ckpt_dir: Path, step: int, state: dict, meta: dict, info, write_shard=None) -> Path:
    """Every rank's part of one checkpoint: each writes its ZeRO shard (`write_shard(tmp_dir) -> file name`,
    stage 1-3) into one temp dir, then rank 0 writes the state files and a manifest covering every file and
    renames the directory into place (stage 0: rank 0 alone writes; the state is replicated)."""
    import torch.distributed as dist

    ckpt_dir, name = Path(ckpt_dir), step_dir_name(step)
    final = ckpt_dir / name
    box = [None]
    if info.rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        box = [str(make_temp_dir(ckpt_dir, name))]
    dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    report = None
    try:
        if write_shard is not None:
            shard = write_shard(tmp)
            _fsync_file(tmp / shard)
            report = (shard, {"sha256": sha256_file(tmp / shard), "bytes": (tmp / shard).stat().st_size})
    except Exception as exc:  # every rank must hear of it, or the others wait forever
        report = ("error", f"rank {info.rank}: {type(exc).__name__}: {exc}")
    reports = [None] * info.world_size
    dist.all_gather_object(reports, report)
    errors = [r[1] for r in reports if r is not None and r[0] == "error"]
    if info.rank == 0:
        try:
            if errors:
                raise RuntimeError(f"checkpoint step {step}: a rank could not write its shard: {errors[0]}")
            _write_state_files(tmp, step, state, meta, shard_files={r[0]: r[1] for r in reports if r is not None})
            if final.exists():
                _remove_dir(final)
            os.rename(tmp, final)
            _fsync_dir(ckpt_dir)
            _write_pointer(ckpt_dir / LATEST_FILE, name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            dist.barrier()
            raise
    dist.barrier()  # rank 0 renamed (or cleaned up): the checkpoint is complete for everyone
    if errors:
        raise RuntimeError(f"checkpoint step {step}: a rank could not write its shard: {errors[0]}")
    return final


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint: `state` feeds the engine, stream and RNGs; `meta` is the rest of state.json."""
    path: Path
    step: int
    state: dict
    meta: dict

    @property
    def wandb_run_id(self) -> str | None:
        return self.meta.get("wandb_run_id")


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: missing ({what})") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: corrupt checkpoint file ({what}): {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path}: not a toolkit checkpoint file ({what})")
    if data.get("version") != FORMAT_VERSION:
        raise UserError(f"{path}: checkpoint format version {data.get('version')!r}; "
                        f"this toolkit reads version {FORMAT_VERSION}")
    return data


def verify_checkpoint(step_dir: Path) -> dict:
    """Check every file against manifest.json (size, then sha256); returns the manifest or raises UserError."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise UserError(f"{step_dir}: no such checkpoint directory")
    manifest = _read_json(step_dir / MANIFEST_FILE, "the checkpoint's manifest; the save did not complete")
    for name, entry in manifest.get("files", {}).items():
        path = step_dir / name
        if not path.is_file():
            raise UserError(f"{path}: missing from the checkpoint")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise UserError(f"{path}: truncated or altered: {size} bytes, manifest.json says {entry['bytes']}")
        if sha256_file(path) != entry["sha256"]:
            raise UserError(f"{path}: checksum mismatch: the file is corrupt (sha256 differs from manifest.json)")
    return manifest


def load_checkpoint(step_dir: Path) -> Checkpoint:
    """Verify and read a step directory; tensors land on the CPU."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    step_dir = Path(step_dir)
    verify_checkpoint(step_dir)
    data = _read_json(step_dir / STATE_FILE, "the checkpoint's state")
    try:
        tensors = load_file(str(step_dir / TENSORS_FILE), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{step_dir / TENSORS_FILE}: unreadable: {str(exc).splitlines()[0]}") from None
    try:
        state = unflatten_state(data.pop("state"), tensors)
    except KeyError as exc:
        raise UserError(f"{step_dir / STATE_FILE}: names tensor {exc.args[0]!r}, "
                        f"which {TENSORS_FILE} does not have") from None
    return Checkpoint(path=step_dir, step=int(data["step"]), state=state, meta=data)


# ---------------------------------------------------------------------------
# Finding checkpoints

def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete step directories (with a manifest), oldest first; `.tmp-*` leftovers of a crash are ignored."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for entry in ckpt_dir.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete step directory, or None."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def _checkpoint_dirname(run_dir: Path, default: str) -> str:
    """checkpoint.dir from a run directory's recipe.json, else `default`."""
    try:
        return json.loads((run_dir / "recipe.json").read_text())["checkpoint"]["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return default


def find_checkpoint(path: Path, checkpoint_dirname: str = "checkpoints") -> Path:
    """A step dir, a checkpoints dir (its newest) or a run dir (its newest) -> a step dir; UserError if none."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise UserError(f"{path}: not a directory; expected a run dir, a checkpoints dir or a step-NNNNNN dir")
    if STEP_DIR.match(path.name) or (path / MANIFEST_FILE).exists():
        return path
    inside = path / _checkpoint_dirname(path, checkpoint_dirname)
    for candidate in (path, inside):
        latest = latest_checkpoint(candidate)
        if latest is not None:
            return latest
    raise UserError(f"{path}: no complete checkpoint (no step-NNNNNN directory with a manifest.json "
                    f"in {path} or {inside})")


# ---------------------------------------------------------------------------
# Resume rules: what a changed recipe may and may not do to a checkpoint

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
_DATA_ORDER_EXEMPT = {"data.eval_samples", "data.vocab_size"}  # held-out only / reported as a shape change
_IGNORED = {"checkpoint.resume"}  # how the checkpoint was chosen, not what it holds
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
                        "at other samples; start fresh with checkpoint.resume=never)")
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


# ---------------------------------------------------------------------------
# The loop's side: resume at start, save on cadence, prune

class Checkpointer:
    """A run's checkpoints: resolve `checkpoint.resume`, save every `interval` steps and at the end, keep the last N."""

    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe = recipe
        self.spec = recipe.checkpoint
        self.dir = Path(run_dir) / self.spec.dir
        self.last_saved_step: int | None = None
        self._stale: list[str] = []

    def resume_point(self) -> Checkpoint | None:
        """The checkpoint `checkpoint.resume` names, verified and checked against the recipe (None: start fresh)."""
        resume = self.spec.resume
        if resume == "never":
            path = None
        elif resume == "auto":
            path = latest_checkpoint(self.dir)
        else:
            try:
                path = find_checkpoint(Path(resume), self.spec.dir)
            except UserError as exc:
                raise UserError(f"recipe.checkpoint.resume: {exc.lines[0]}") from None
        try:
            ckpt = load_checkpoint(path) if path is not None else None
        except UserError as exc:
            raise UserError(f"{exc.lines[0]}; resume from another checkpoint with checkpoint.resume=PATH "
                            "or start fresh with checkpoint.resume=never") from None
        start = 0
        if ckpt is not None:
            missing = [k for k in ("recipe", "model_shape", "global_batch") if k not in ckpt.meta]
            if missing:
                raise UserError(f"{ckpt.path / STATE_FILE}: lacks {', '.join(missing)}; not a training checkpoint")
            refusals, warnings = resume_changes(ckpt.meta, self.recipe)
            if refusals:
                raise UserError(*refusals)
            for line in warnings:
                print(f"warning: resume from {ckpt.path}: {line}", file=sys.stderr, flush=True)
            start = ckpt.step
        # Checkpoints past the starting step belong to another trajectory (a fresh start, or a
        # resume from an earlier step): deleted once this run has saved its first checkpoint.
        self._stale = [path.name for step, path in list_checkpoints(self.dir) if step > start]
        if self._stale:
            print(f"warning: {self.dir}: {len(self._stale)} checkpoint(s) past step {start} come from an earlier "
                  f"run ({self._stale[-1]} newest); they are deleted when this run saves its first checkpoint",
                  file=sys.stderr, flush=True)
        return ckpt

    def restore(self, ckpt: Checkpoint, engine, stream) -> None:
        """Engine and data position as they were when `ckpt` was saved (the RNGs: `restore_rng_state`)."""
        try:
            engine.load_state_dict(ckpt.state["engine"], checkpoint_dir=ckpt.path)
        except (RuntimeError, KeyError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"{ckpt.path}: the checkpoint does not fit this model: {first}") from None
        stream.load_state_dict(ckpt.state["stream"])
        self.last_saved_step = ckpt.step

    def after_step(self, engine, stream, wandb_run_id: str | None) -> Path | None:
        """Save when the step is a multiple of checkpoint.interval."""
        step = engine.global_step
        if self.spec.interval and step % self.spec.interval == 0:
            return self.save(engine, stream, wandb_run_id)
        return None

    def finish(self, engine, stream, wandb_run_id: str | None) -> Path | None:
        """The final save (checkpoint.save_final), unless this step is already saved."""
        if self.spec.save_final and self.last_saved_step != engine.global_step:
            return self.save(engine, stream, wandb_run_id)
        return None

    def save(self, engine, stream, wandb_run_id: str | None) -> Path:
        """Save now, then delete stale and surplus checkpoints (only after the new one is complete)."""
        state = {"engine": engine.state_dict(), "stream": stream.state_dict(), "rng": capture_rng_state()}
        meta = checkpoint_meta(self.recipe, engine, wandb_run_id)
        info = getattr(engine, "dist", None)
        if info is not None and info.active:  # several ranks: ZeRO shards from each, the rest from rank 0
            shards = engine.write_shard if engine.sharded_checkpoint else None
            path = save_distributed_checkpoint(self.dir, engine.global_step, state, meta, info, shards)
            self.last_saved_step = engine.global_step
            if info.rank != 0:  # rank 0 alone deletes stale and surplus checkpoints
                self._stale = []
                return path
        else:
            path = save_checkpoint(self.dir, engine.global_step, state, meta)
        self.last_saved_step = engine.global_step
        for name in self._stale:
            if name != path.name and (self.dir / name).is_dir():
                _remove_dir(self.dir / name)
        self._stale = []
        prune_checkpoints(self.dir, self.spec.keep_last)
        return path


def prune_checkpoints(ckpt_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, and leftovers of crashed saves."""
    removed = []
    for _, path in list_checkpoints(ckpt_dir)[:-keep_last]:
        _remove_dir(path)
        removed.append(path)
    for entry in Path(ckpt_dir).iterdir():
        if entry.name.startswith(TEMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    return removed
