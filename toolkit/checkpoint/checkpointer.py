"""Checkpoints: atomic save, verified load, exact resume, and the rules for
resuming under a changed recipe. The loop (toolkit/train/loop.py) drives a
`Checkpointer`; the Hugging Face export (toolkit/checkpoint/export.py) reads what it wrote.

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
pieces, toolkit/checkpoint/zero_shards.py, readable at any world size) and rank 0 writes the rest,
with a manifest covering every file, and renames; at stage 0 rank 0 alone writes.

Here: the loop's side (`find_resume_point` at start; a `Checkpointer` saves on cadence and prunes). The
other files of this package hold the layout, the state format and the resume rules.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from toolkit.checkpoint.engine_state import write_engine_checkpoint
from toolkit.checkpoint.files import find_checkpoint, latest_checkpoint, list_checkpoints, prune_checkpoints, remove_dir
from toolkit.checkpoint.io import Checkpoint
from toolkit.checkpoint.resume import (check_checkpoint_dir_kept, checkpoint_meta, load_training_checkpoint,
                                       resume_changes)
from toolkit.checkpoint.state import capture_rng_state
from toolkit.errors import UserError
from toolkit.specs import Recipe


# ---------------------------------------------------------------------------
# The loop's side: resume at start, save on cadence, prune

@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: the checkpoint it resumes from (None: fresh), and the step directories past it."""
    checkpoint: Checkpoint | None
    stale: tuple[str, ...] = ()  # another trajectory's checkpoints, deleted at this run's first save

    @property
    def step(self) -> int:
        """The step training continues from (0: fresh)."""
        return self.checkpoint.step if self.checkpoint is not None else 0


def find_resume_point(recipe: Recipe, run_dir: Path) -> ResumePoint:
    """The checkpoint `checkpoint.resume` names, verified and checked against the recipe (None: start fresh).

    Called before the engine is built and before the run dir changes: a refused resume leaves both untouched."""
    spec, checkpoint_dir = recipe.checkpoint, Path(run_dir) / recipe.checkpoint.dir
    if spec.resume == "never":
        path = None
    elif spec.resume == "auto":
        path = latest_checkpoint(checkpoint_dir)
        if path is None:
            check_checkpoint_dir_kept(Path(run_dir), spec.dir)
    else:
        try:
            path = find_checkpoint(Path(spec.resume), spec.dir)
        except UserError as exc:
            raise UserError(f"recipe.checkpoint.resume: {exc.lines[0]}") from None
    try:
        ckpt = load_training_checkpoint(path) if path is not None else None
    except UserError as exc:
        raise UserError(f"{exc.lines[0]}; resume from another checkpoint with checkpoint.resume=PATH "
                        "or start fresh with checkpoint.resume=never") from None
    if ckpt is not None:
        _check_resume(ckpt, recipe)
    start = ckpt.step if ckpt is not None else 0
    # Checkpoints past the starting step belong to another trajectory (a fresh start, or a
    # resume from an earlier step): deleted once this run has saved its first checkpoint.
    stale = tuple(path.name for step, path in list_checkpoints(checkpoint_dir) if step > start)
    if stale:
        print(f"warning: {checkpoint_dir}: {len(stale)} checkpoint(s) past step {start} come from an earlier "
              f"run ({stale[-1]} newest); they are deleted when this run saves its first checkpoint",
              file=sys.stderr, flush=True)
    return ResumePoint(ckpt, stale)


def _check_resume(ckpt: Checkpoint, recipe: Recipe) -> None:
    """Refuse a resume the recipe cannot continue (one error naming every reason); warn about allowed changes."""
    refusals, warnings = resume_changes(ckpt.meta, recipe)
    max_steps = recipe.training.max_steps
    if ckpt.step > max_steps:  # before the warnings: a refused resume says one thing
        refusals = [f"recipe.training.max_steps: {max_steps} is below the step the run resumes from: "
                    f"the checkpoint {ckpt.path} is at step {ckpt.step}; raise training.max_steps to train "
                    "further, or start fresh with checkpoint.resume=never (or another --run-dir)", *refusals]
    if refusals:
        raise UserError(*refusals)
    for line in warnings:
        print(f"warning: resume from {ckpt.path}: {line}", file=sys.stderr, flush=True)


def restore_engine_and_stream(ckpt: Checkpoint, engine, stream) -> None:
    """Engine and data position as they were when `ckpt` was saved (the RNGs: `restore_rng_state`)."""
    try:
        engine.load_state_dict(ckpt.state["engine"], checkpoint_dir=ckpt.path)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:  # a foreign or edited state
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{ckpt.path}: the checkpoint does not fit this model: {first}") from None
    stream.load_state_dict(ckpt.state["stream"])


class Checkpointer:
    """One run's saves of one engine and its data stream: every `interval` steps, at the end, on a stop; keeps
    the last N. Built once the engine and stream exist (a resume has restored them) and the trackers have
    named the W&B run; `start` is where the run started (`find_resume_point`; None: fresh, nothing stale)."""

    def __init__(self, recipe: Recipe, run_dir: Path, engine, stream, *, wandb_run_id: str | None = None,
                 start: ResumePoint | None = None):
        start = start or ResumePoint(None)
        self.recipe = recipe  # state.json records the resolved recipe and its hash
        self.spec = recipe.checkpoint
        self.dir = Path(run_dir) / self.spec.dir
        self.engine, self.stream, self.wandb_run_id = engine, stream, wandb_run_id
        resumed = start.checkpoint  # until this run saves, a rerun resumes from where it started
        self.last_saved_step: int | None = resumed.step if resumed is not None else None
        self.last_saved_path: Path | None = resumed.path if resumed is not None else None
        self._stale = list(start.stale)

    def after_step(self) -> Path | None:
        """Save when the step is a multiple of checkpoint.interval."""
        step = self.engine.global_step
        if self.spec.interval and step % self.spec.interval == 0:
            return self.save()
        return None

    def finish(self) -> Path | None:
        """The final save (checkpoint.save_final), unless this step is already saved."""
        if self.spec.save_final and self.last_saved_step != self.engine.global_step:
            return self.save()
        return None

    def save_for_resume(self) -> Path | None:
        """On a stop signal: save this step unless it is saved already, nothing is trained, or saving is off."""
        step = self.engine.global_step
        if step == 0 or self.last_saved_step == step or not (self.spec.interval or self.spec.save_final):
            return self.last_saved_path if self.last_saved_step == step else None
        return self.save()

    def save(self) -> Path:
        """Save now, then delete stale and surplus checkpoints (only after the new one is complete).
        A diverged run (non-finite loss) raises its error instead of saving."""
        engine = self.engine
        engine.check_finite()
        state = {"engine": engine.state_dict(), "stream": self.stream.state_dict(), "rng": capture_rng_state()}
        meta = checkpoint_meta(self.recipe, engine, self.wandb_run_id)
        info = getattr(engine, "dist", None)
        try:
            path = write_engine_checkpoint(self.dir, engine, state, meta)
        except UserError as exc:  # a write failed; the temp dir is gone, the earlier checkpoints are untouched
            kept = f"{self.last_saved_path} is intact" if self.last_saved_path is not None else "none saved before"
            raise UserError(*(f"checkpoint step {engine.global_step}: {line}; earlier checkpoint: {kept}; free "
                              "space or fix the permissions, then rerun the same command to resume"
                              for line in exc.lines)) from None
        self.last_saved_step, self.last_saved_path = engine.global_step, path
        if info is not None and info.active and info.rank != 0:  # rank 0 alone deletes stale and surplus ones
            self._stale = []
            return path
        for name in self._stale:
            if name != path.name and (self.dir / name).is_dir():
                remove_dir(self.dir / name)
        self._stale = []
        prune_checkpoints(self.dir, self.spec.keep_last)
        return path
