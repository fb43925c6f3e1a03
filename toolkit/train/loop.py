"""The training loop behind `toolkit run` and `toolkit.run(recipe)`: run
directory, accumulation through the engine, evaluation and logging cadence,
summary. The engine (toolkit/runtime/engine.py) does the maths; the start-up
table lives in toolkit/train/startup_table.py.

Run directory contract: recipe.json (resolved recipe + hash), metrics.jsonl
(one JSON object per logged step: step, loss, lr, grad_norm, tokens_per_s,
elapsed_s, mfu where the device's peak is known, the memory fields of
toolkit/observe/memory_monitor.py, ...; evaluation lines carry eval_loss), memory.png
(the memory timeline), tensorboard/, checkpoints/, and .toolkit-run.lock (one run at a time:
toolkit/train/run_dir.py).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.checkpoint.checkpointer import Checkpointer, find_resume_point, restore_engine_and_stream
from toolkit.checkpoint.resume import truncate_metrics
from toolkit.checkpoint.state import restore_rng_state
from toolkit.runtime.cpu_threads import apply_cpu_threads
from toolkit.data.batches import BatchStream, Dataset, eval_batches
from toolkit.runtime.engine import Engine, check_device, pick_device
from toolkit.errors import UserError, write_failure
from toolkit.observe.flops import mfu_basis, unknown_peak_warning
from toolkit.observe.comm import per_step
from toolkit.observe.memory_monitor import MemoryMonitor
from toolkit.train.preflight import checkpoint_dir_of, preflight
from toolkit.train.run_dir import check_room_for_checkpoint, check_writable, claim_run_dir, default_run_dir
from toolkit.train.startup_table import MESH_NOT_COUNTED, startup_table
from toolkit.train.stop import RunStopped, StopSignals, under_elastic_launcher
from toolkit.specs import Recipe
from toolkit.observe.trackers import Trackers, build_trackers
from toolkit.distributed import any_true, barrier, broadcast_object, shutdown, start_process_group


@dataclass
class RunResult:
    """What a finished run produced."""
    run_dir: Path
    metrics: list[dict] = field(default_factory=list)

    @property
    def train_metrics(self) -> list[dict]:
        return [m for m in self.metrics if "loss" in m]

    @property
    def eval_metrics(self) -> list[dict]:
        return [m for m in self.metrics if "eval_loss" in m]

    @property
    def first_loss(self) -> float:
        return self.train_metrics[0]["loss"]

    @property
    def final_loss(self) -> float:
        return self.train_metrics[-1]["loss"]


def run(recipe: Recipe, run_dir: str | Path | None = None, *, quiet: bool = False) -> RunResult:
    """Train a recipe to the end; returns the run directory and the logged metrics.

    Under torchrun every rank calls this; rank 0 alone prints, logs and writes the run directory's
    files (checkpoints: every rank writes its ZeRO shard), each rank trains on its slots of the data.
    SIGTERM/SIGINT stop it at a step boundary with a checkpoint: `RunStopped` (toolkit/train/stop.py).
    """
    check_device(recipe)  # a recipe this machine cannot run leaves no run dir behind
    info = start_process_group(recipe.world_size, recipe.training.device)
    run_dir = Path(broadcast_object(str(run_dir or default_run_dir(recipe)), info))  # one run dir for all
    num_parameters = _preflight_every_rank(recipe, run_dir, info)  # before anything slow or the run dir
    apply_cpu_threads(recipe)
    lock = _agree(lambda: claim_run_dir(run_dir), info)  # rank 0 holds it (or the --nproc launcher does)
    stop = StopSignals(under_elastic_launcher()).install(run_dir, recipe.training.max_steps)
    try:
        return _train(recipe, run_dir, info, stop, num_parameters, quiet=quiet or not info.is_main)
    except OSError as exc:  # recipe.json, metrics, events, the memory plot: one line naming the file
        raise (write_failure(exc, run_dir) or exc) from None
    finally:
        stop.restore()
        if lock is not None:
            lock.release()


def _preflight_every_rank(recipe: Recipe, run_dir: Path, info) -> int | None:
    """The pre-flight on this rank (its device, its disks: toolkit/train/preflight.py); a refusal on any rank
    stops every rank (those that found none silently). Returns the estimator's parameter count."""
    device = pick_device(recipe.training.device)
    found = preflight(recipe, run_dir, device)
    found.say()
    if any_true(bool(found.refusals), info, device):
        raise UserError(*found.refusals)
    return found.num_parameters


def _agree(claim, info):
    """Rank 0 runs `claim()`; its UserError stops every rank (the others silently: rank 0 says it)."""
    problem = None
    result = None
    if info.is_main:
        try:
            result = claim()
        except UserError as exc:
            problem = exc
    if broadcast_object(problem.lines if problem is not None else None, info) is not None:
        raise problem if problem is not None else UserError()
    return result


def _check_steps_left(recipe: Recipe, resumed, *, warn: bool) -> None:
    """A checkpoint at training.max_steps leaves nothing to train (a warning; past it, find_resume_point refuses)."""
    if resumed is None or resumed.step != recipe.training.max_steps:
        return
    where = f"the checkpoint {resumed.path} is at step {resumed.step}"
    if warn:
        print(f"warning: recipe.training.max_steps: nothing to train: {where}, which is training.max_steps; "
              "raise training.max_steps to train further", file=sys.stderr, flush=True)


def _train(recipe: Recipe, run_dir: Path, info, stop: StopSignals, num_parameters: int | None, *,
           quiet: bool) -> RunResult:
    """The run behind `run`, in a run directory this process (or its launcher) holds; `num_parameters` is the
    pre-flight's count (None: the checkpoint's room is checked here, once the model is built)."""
    saves_to = checkpoint_dir_of(recipe, run_dir)  # None: the run saves no checkpoint
    _agree(lambda: check_writable(run_dir, saves_to), info)
    start = find_resume_point(recipe, run_dir)  # before the run dir changes: a refused resume leaves it as it was
    resumed, start_step = start.checkpoint, start.step
    _check_steps_left(recipe, resumed, warn=info.is_main)
    engine = Engine(recipe)
    if saves_to is not None and num_parameters is None:
        _agree(lambda: check_room_for_checkpoint(saves_to, engine.num_parameters), info)
    barrier(info)  # every rank has read the checkpoint before rank 0 touches the run dir
    if info.is_main:
        (run_dir / "recipe.json").write_text(recipe.to_json())

    monitor = MemoryMonitor(engine)
    mfu = mfu_basis(engine.model, recipe.data.seq_len, recipe.precision.dtype, engine.device, recipe.batch.world_size,
                    recipe.training.peak_tflops)
    peak_warning = unknown_peak_warning(mfu)  # None on a CPU: the start-up table says how to set a peak
    if peak_warning and info.is_main:
        print(peak_warning, file=sys.stderr, flush=True)
    dataset = Dataset(recipe.data, run_dir=run_dir, log=None if quiet else print)
    data_rank = engine.strategy.mesh.dp_rank if recipe.parallel.active else info.rank  # tp/pp ranks share data
    stream = BatchStream(dataset.train, recipe.batch, rank=data_rank, seed=recipe.training.seed)
    held_out = eval_batches(dataset.eval, recipe.batch, rank=data_rank, count=recipe.training.eval_batches)
    training = recipe.training
    if resumed is not None:
        restore_engine_and_stream(resumed, engine, stream)
        if info.is_main:
            truncate_metrics(run_dir / "metrics.jsonl", resumed.step)  # steps past the checkpoint are logged again
    trackers = Trackers([])  # ranks other than 0 log nothing
    if info.is_main:
        trackers = build_trackers(recipe.logging, run_dir, training.max_steps, console=not quiet,
                                  append=resumed is not None, config=recipe.resolved,
                                  wandb_run_id=resumed.wandb_run_id if resumed is not None else None,
                                  steps_per_epoch=training.steps_per_epoch)
    checkpointer = Checkpointer(recipe, run_dir, engine, stream, wandb_run_id=trackers.wandb_run_id, start=start)
    if not quiet:
        print(startup_table(recipe, engine, dataset, mfu), flush=True)
        print(f"run dir | {run_dir}", flush=True)
        if resumed is not None:
            print(f"resume  | {resumed.path} (step {resumed.step} of {training.max_steps})", flush=True)
    if resumed is not None:
        restore_rng_state(resumed.state["rng"])  # last before the loop, so nothing draws from them in between

    result = RunResult(run_dir)
    tokens_per_step = recipe.batch.global_batch * recipe.data.seq_len

    def log(metrics: dict) -> None:
        result.metrics.append(metrics)
        trackers.log(metrics)

    def evaluate(step: int) -> None:
        if held_out:
            log({"step": step, "eval_loss": engine.evaluate(held_out)})

    start = window_start = time.perf_counter()
    window_steps = stopped_by = 0
    window_comm: dict = {}  # summed comm_* fields of the steps since the last logged one
    stop.deferring = True  # from here a signal stops the run at the next step boundary, with a checkpoint
    try:
        while engine.global_step < training.max_steps:
            # NOTE: several ranks agree on the stop flag through a collective, which waits for the GPU: so only
            # at logging steps, where the loop waits anyway to read the loss (one process: every step).
            if not info.active or engine.global_step % training.log_interval == 0:
                stopped_by = stop.agreed(info, engine.device)
            if stopped_by:
                break
            step_result = engine.train_batch(stream.next_step())
            step, window_steps = engine.global_step, window_steps + 1
            for key, value in step_result.comm.items():
                window_comm[key] = window_comm.get(key, 0) + value
            if step % training.log_interval == 0 or step == training.max_steps:
                now = time.perf_counter()
                tokens_per_s = window_steps * tokens_per_step / (now - window_start)
                log({
                    "step": step,
                    "loss": step_result.loss,
                    "lr": step_result.lr,
                    "grad_norm": step_result.grad_norm,
                    "loss_scale": step_result.loss_scale,
                    "skipped_steps": engine.skipped_steps,
                    "tokens_per_s": tokens_per_s,
                    "elapsed_s": now - start,
                    **({"mfu": mfu.mfu(tokens_per_s)} if mfu.peak_flops is not None else {}),
                    **monitor.window_metrics(step),  # with the engine's offload_metrics()
                    **per_step(window_comm, window_steps),  # comm_bytes, comm_exposed_s, ... per step
                })
                window_start, window_steps, window_comm = now, 0, {}
            if training.eval_interval and step % training.eval_interval == 0 and step != training.max_steps:
                evaluate(step)
            checkpointer.after_step()
        if stopped_by:
            checkpointer.save_for_resume()
        else:
            if engine.global_step > start_step:  # a checkpoint already at max_steps has nothing left to do
                evaluate(engine.global_step)
            checkpointer.finish()
    finally:
        trackers.close()
        monitor.close()
    memory_note = monitor.write_timeline(run_dir / "memory.png") if info.is_main else ""
    shutdown(info)
    if stopped_by:
        raise RunStopped(stopped_by, run_dir, engine.global_step, training.max_steps, checkpointer.last_saved_path,
                         why="no step was trained" if engine.global_step == 0 else
                         "checkpoint.interval is 0 and checkpoint.save_final is false")
    if not quiet:
        wall = time.perf_counter() - start
        train = result.train_metrics
        summary = f"done: {engine.global_step} steps in {wall:.1f}s"
        if train:
            summary += f", loss {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}"
        if result.eval_metrics:
            summary += f", eval loss {result.eval_metrics[-1]['eval_loss']:.4f}"
        print(summary + f" ({dataset.loss_reference()})", flush=True)
        if checkpointer.last_saved_path is not None:
            print(f"checkpoint | {checkpointer.last_saved_path}", flush=True)
        print(monitor.summary() + "\n" + memory_note, flush=True)
        if info.active:
            mesh = f" [{MESH_NOT_COUNTED}]" if recipe.parallel.active else ""
            print(engine.comm.ledger.summary() + mesh, flush=True)
    return result
