"""The training loop behind `toolkit run` and `toolkit.run(recipe)`, read top to bottom: set up (the run
directory's checks, the resume point, engine, data, trackers, checkpointer: one `Run` record), the loop
(accumulation through the engine, evaluation, logging and checkpoint cadence), then the report. The engine
(toolkit/runtime/engine.py) does the maths; the start-up table lives in toolkit/train/startup_table.py.

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

import torch

from toolkit.checkpoint.checkpointer import (Checkpointer, ResumePoint, find_resume_point,
                                             restore_engine_and_stream)
from toolkit.checkpoint.resume import truncate_metrics
from toolkit.checkpoint.state import restore_rng_state
from toolkit.train.recipe_threads import apply_cpu_threads
from toolkit.data.batches import BatchStream, Dataset, eval_batches
from toolkit.runtime.engine import Engine, check_device, kernels_of_recipe, pick_device
from toolkit.runtime.kernel_choice import start_kernel_builds
from toolkit.errors import UserError, write_failure
from toolkit.observe.flops import MfuBasis, mfu_basis, unknown_peak_warning
from toolkit.observe.comm_ledger import per_step
from toolkit.observe.memory_monitor import MemoryMonitor
from toolkit.train.preflight import checkpoint_dir_of, preflight
from toolkit.train.run_dir import check_room_for_checkpoint, check_writable, claim_run_dir, default_run_dir
from toolkit.train.startup_table import MESH_NOT_COUNTED, startup_table
from toolkit.train.stop import RunStopped, StopSignals, leave_note, under_elastic_launcher
from toolkit.specs import Recipe
from toolkit.observe.trackers import Trackers, build_trackers
from toolkit.distributed import DistInfo, any_true, barrier, broadcast_object, shutdown, start_process_group


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


@dataclass
class Run:
    """One run's parts, built once by `_set_up`; the loop and the report read them."""
    recipe: Recipe
    run_dir: Path
    info: DistInfo
    engine: Engine
    dataset: Dataset
    stream: BatchStream
    held_out: list[torch.Tensor]  # the same micro batches at every evaluation
    mfu: MfuBasis
    monitor: MemoryMonitor
    trackers: Trackers  # empty on ranks other than 0: they log nothing
    checkpointer: Checkpointer
    start_step: int  # the resumed checkpoint's step (0: fresh)
    result: RunResult

    def log(self, metrics: dict) -> None:
        """Keep a metrics line for the result and hand it to the trackers."""
        self.result.metrics.append(metrics)
        self.trackers.log(metrics)

    def evaluate(self, step: int) -> None:
        """Log the held-out loss at `step` (nothing without held-out batches: training.eval_batches=0)."""
        if self.held_out:
            self.log({"step": step, "eval_loss": self.engine.evaluate(self.held_out)})


def run(recipe: Recipe, run_dir: str | Path | None = None, *, quiet: bool = False) -> RunResult:
    """Train a recipe to the end; returns the run directory and the logged metrics.

    Under torchrun every rank calls this; rank 0 alone prints, logs and writes the run directory's
    files (checkpoints: every rank writes its ZeRO shard), each rank trains on its slots of the data.
    SIGTERM/SIGINT stop it at a step boundary with a checkpoint: `RunStopped` (toolkit/train/stop.py).
    """
    device = check_device(recipe)  # a recipe this machine cannot run leaves no run dir behind
    info = start_process_group(recipe.world_size, recipe.training.device)
    run_dir = Path(broadcast_object(str(run_dir or default_run_dir(recipe)), info))  # one run dir for all
    num_parameters = _preflight_every_rank(recipe, run_dir, info)  # before anything slow or the run dir
    apply_cpu_threads(recipe)
    lock = _agree(lambda: claim_run_dir(run_dir), info)  # rank 0 holds it (or the --nproc launcher does)
    start_kernel_builds(kernels_of_recipe(recipe), recipe.kernels, device)  # nvcc works while the model is made
    stop = StopSignals(under_elastic_launcher()).install(run_dir, recipe.training.max_steps)
    try:
        # logging.console false: no start-up table, progress or summary (rank 0's metrics files stay)
        quiet = quiet or not info.is_main or not recipe.logging.console
        return _train(recipe, run_dir, info, stop, num_parameters, quiet=quiet)
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


def _train(recipe: Recipe, run_dir: Path, info: DistInfo, stop: StopSignals, num_parameters: int | None, *,
           quiet: bool) -> RunResult:
    """The run behind `run`, in a run directory this process (or its launcher) holds; `num_parameters` is the
    pre-flight's count (None: the checkpoint's room is checked here, once the model is built)."""
    run = _set_up(recipe, run_dir, info, num_parameters, quiet=quiet)
    start = time.perf_counter()
    stopped = None
    try:
        stopped_by = _loop(run, stop, start)
        if stopped_by:
            stopped = RunStopped(stopped_by, run_dir, run.engine.global_step, recipe.training.max_steps,
                                 run.checkpointer.last_saved_path,
                                 why="no step was trained" if run.engine.global_step == 0 else
                                 "checkpoint.interval is 0 and checkpoint.save_final is false")
            # NOTE: said now, before the teardown (trackers, memory.png, the group): a launcher whose shutdown
            # timeout kills this rank meanwhile still prints where the run stopped (end_rank says it again)
            leave_note(stopped.exit_code, [stopped.describe()])
    finally:
        run.trackers.close()
        run.monitor.close()
    memory_note = run.monitor.write_timeline(run_dir / "memory.png") if info.is_main else ""
    shutdown(info)
    if stopped is not None:
        raise stopped
    if not quiet:
        _report(run, time.perf_counter() - start, memory_note)
    return run.result


# ---------------------------------------------------------------------------
# Set up

def _set_up(recipe: Recipe, run_dir: Path, info: DistInfo, num_parameters: int | None, *, quiet: bool) -> Run:
    """Everything before the first step: resume point and engine, data, restore, trackers, start-up table."""
    start, engine = _start_engine(recipe, run_dir, info, num_parameters)
    resumed = start.checkpoint
    monitor = MemoryMonitor(engine)
    mfu = mfu_basis(engine.model, recipe.data.seq_len, recipe.precision.dtype, engine.device, recipe.batch.world_size,
                    recipe.training.peak_tflops)
    peak_warning = unknown_peak_warning(mfu)  # None on a CPU: the start-up table says how to set a peak
    if peak_warning and info.is_main:
        print(peak_warning, file=sys.stderr, flush=True)
    dataset = Dataset(recipe.data, run_dir=run_dir, log=None if quiet else print)
    data_rank = engine.strategy.data_rank  # tensor/pipeline ranks of one replica share its data
    stream = BatchStream(dataset.train, recipe.batch, rank=data_rank, seed=recipe.training.seed)
    held_out = eval_batches(dataset.eval, recipe.batch, rank=data_rank, count=recipe.training.eval_batches)
    if resumed is not None:
        restore_engine_and_stream(resumed, engine, stream)
        if info.is_main:
            truncate_metrics(run_dir / "metrics.jsonl", resumed.step)  # steps past the checkpoint are logged again
    trackers = _build_trackers(recipe, run_dir, info, resumed, quiet=quiet)
    checkpointer = Checkpointer(recipe, run_dir, engine, stream, wandb_run_id=trackers.wandb_run_id, start=start)
    if not quiet:
        print(startup_table(recipe, engine, dataset, mfu), flush=True)
        print(f"run dir | {run_dir}", flush=True)
        if resumed is not None:
            print(f"resume  | {resumed.path} (step {resumed.step} of {recipe.training.max_steps})", flush=True)
    if resumed is not None:
        restore_rng_state(resumed.state["rng"])  # last before the loop, so nothing draws from them in between
    return Run(recipe, run_dir, info, engine, dataset, stream, held_out, mfu, monitor, trackers, checkpointer,
               start.step, RunResult(run_dir))


def _start_engine(recipe: Recipe, run_dir: Path, info: DistInfo,
                  num_parameters: int | None) -> tuple[ResumePoint, Engine]:
    """The run dir's checks, the resume point and the engine; then rank 0 writes recipe.json (the first change
    to the run dir, so a refused resume or a run dir that cannot take files leaves it as it was)."""
    saves_to = checkpoint_dir_of(recipe, run_dir)  # None: the run saves no checkpoint
    _agree(lambda: check_writable(run_dir, saves_to), info)
    start = find_resume_point(recipe, run_dir)
    _check_steps_left(recipe, start.checkpoint, warn=info.is_main)
    engine = Engine(recipe)
    if saves_to is not None and num_parameters is None:
        _agree(lambda: check_room_for_checkpoint(saves_to, engine.num_parameters), info)
    barrier(info)  # every rank has read the checkpoint before rank 0 touches the run dir
    if info.is_main:
        (run_dir / "recipe.json").write_text(recipe.to_json())
    return start, engine


def _check_steps_left(recipe: Recipe, resumed, *, warn: bool) -> None:
    """A checkpoint at training.max_steps leaves nothing to train (a warning; past it, find_resume_point refuses)."""
    if resumed is None or resumed.step != recipe.training.max_steps:
        return
    where = f"the checkpoint {resumed.path} is at step {resumed.step}"
    if warn:
        print(f"warning: recipe.training.max_steps: nothing to train: {where}, which is training.max_steps; "
              "raise training.max_steps to train further", file=sys.stderr, flush=True)


def _build_trackers(recipe: Recipe, run_dir: Path, info: DistInfo, resumed, *, quiet: bool) -> Trackers:
    """Rank 0's trackers (a resumed run appends to its metrics and continues its W&B run); none elsewhere."""
    if not info.is_main:
        return Trackers([])
    training = recipe.training
    return build_trackers(recipe.logging, run_dir, training.max_steps, console=not quiet,
                          append=resumed is not None, config=recipe.resolved,
                          wandb_run_id=resumed.wandb_run_id if resumed is not None else None,
                          steps_per_epoch=training.steps_per_epoch)


# ---------------------------------------------------------------------------
# The loop

@dataclass
class _Window:
    """The steps since the last logged one: when the first began, how many, their summed comm_* fields."""
    start: float
    steps: int = 0
    comm: dict = field(default_factory=dict)

    def add(self, comm: dict) -> None:
        self.steps += 1
        for key, value in comm.items():
            self.comm[key] = self.comm.get(key, 0) + value


def _loop(run: Run, stop: StopSignals, start: float) -> int:
    """Train to training.max_steps, logging, evaluating and saving on cadence, then the last evaluation and save;
    returns the signal that stopped it early (0: none), after a checkpoint for the resume."""
    engine, training, info = run.engine, run.recipe.training, run.info
    window = _Window(start)
    stopped_by = 0
    stop.deferring = True  # from here a signal stops the run at the next step boundary, with a checkpoint
    while engine.global_step < training.max_steps:
        # NOTE: several ranks agree on the stop flag through a collective, which waits for the GPU: so only
        # at logging steps, where the loop waits anyway to read the loss (one process: every step).
        if not info.active or engine.global_step % training.log_interval == 0:
            stopped_by = stop.agreed(info, engine.device)
        if stopped_by:
            break
        step_result = engine.train_batch(run.stream.next_step())
        step = engine.global_step
        window.add(step_result.comm)
        if step % training.log_interval == 0 or step == training.max_steps:
            now = time.perf_counter()
            run.log(_step_metrics(run, step_result, window, now - window.start, now - start))
            window = _Window(now)
        if training.eval_interval and step % training.eval_interval == 0 and step != training.max_steps:
            run.evaluate(step)
        run.checkpointer.after_step()
    engine.strategy.complete_pending_update()  # zero.offload_update delayed: the model ends with the last update
    if stopped_by:
        run.checkpointer.save_for_resume()
        return stopped_by
    if engine.global_step > run.start_step:  # a checkpoint already at max_steps has nothing left to do
        run.evaluate(engine.global_step)
    run.checkpointer.finish()
    return 0


def _step_metrics(run: Run, step_result, window: _Window, window_s: float, elapsed_s: float) -> dict:
    """A logged step's metrics.jsonl line (the keys in the module docstring's order)."""
    tokens_per_s = window.steps * run.recipe.batch.global_batch * run.recipe.data.seq_len / window_s
    return {
        "step": run.engine.global_step,
        "loss": step_result.loss,
        "lr": step_result.lr,
        "grad_norm": step_result.grad_norm,
        "loss_scale": step_result.loss_scale,
        "skipped_steps": run.engine.skipped_steps,
        "tokens_per_s": tokens_per_s,
        "elapsed_s": elapsed_s,
        **({"mfu": run.mfu.mfu(tokens_per_s)} if run.mfu.peak_flops is not None else {}),
        **run.monitor.window_metrics(run.engine.global_step),  # with the engine's offload_metrics()
        **per_step(window.comm, window.steps),  # comm_bytes, comm_exposed_s, ... per step
    }


# ---------------------------------------------------------------------------
# The report

def _report(run: Run, wall_s: float, memory_note: str) -> None:
    """The closing lines: steps, time and losses; the last checkpoint; memory; communication under several ranks."""
    train, evals = run.result.train_metrics, run.result.eval_metrics
    summary = f"done: {run.engine.global_step} steps in {wall_s:.1f}s"
    if train:
        summary += f", loss {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}"
    if evals:
        summary += f", eval loss {evals[-1]['eval_loss']:.4f}"
    print(summary + f" ({run.dataset.loss_reference()})", flush=True)
    if run.checkpointer.last_saved_path is not None:
        print(f"checkpoint | {run.checkpointer.last_saved_path}", flush=True)
    print(run.monitor.summary() + "\n" + memory_note, flush=True)
    if run.info.active:
        mesh = f" [{MESH_NOT_COUNTED}]" if run.recipe.parallel.active else ""
        print(run.engine.comm.ledger.summary() + mesh, flush=True)
