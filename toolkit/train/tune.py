"""`toolkit tune RECIPE`: the fastest variant of a recipe that fits, found by short timed trials.

The search space is ZeRO stage x micro batch (grad_accum_steps follows, so the global batch stays the
recipe's) x activation checkpointing x optimizer offload (ratio 1 or 0.5); then, on a GPU, the best of
those with training.compile and the fused kernels toggled. Every candidate is first validated and
sized by the memory estimator (toolkit/observe/memory_fit.py size_terms, as `toolkit estimate` counts);
those over the memory cap are pruned without running. Survivors run in order (per configuration the
largest micro batch first, configurations round-robin, so a short budget sees every kind once) as
fresh `toolkit run` processes (`--nproc N` for several ranks, the launcher of toolkit/train/launch.py):
a crash or OOM ends that trial only. Each trial runs warm-up steps then measured steps and is read
back from its metrics.jsonl (tokens/s over the measured steps only, peak memory). Trials stop at the
budget; the best is rerun once to confirm. Writing the outputs: toolkit/train/tune_report.py.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from toolkit.errors import UserError
from toolkit.observe.estimate import USABLE_FRACTION, format_bytes
from toolkit.observe.memory_fit import host_available_bytes, size_terms
from toolkit.recipe.load import find_recipe_file, load_recipe

# Recipe keys a trial sets, whatever the candidate, so it is short, quiet and leaves nothing behind.
TRIAL_KEYS = ["training.eval_batches=0", "training.eval_interval=0", "training.log_interval=1",
              "checkpoint.save_final=false", "checkpoint.interval=0", "checkpoint.resume=never",
              "logging.console=false", "logging.tensorboard=false", "logging.wandb.mode=disabled",
              "training.memory_check=warn"]
OFFLOADS = {"none": {"zero.offload_optimizer": "none"},
            "cpu": {"zero.offload_optimizer": "cpu", "zero.offload_ratio": 1.0},
            "cpu@0.5": {"zero.offload_optimizer": "cpu", "zero.offload_ratio": 0.5}}
KERNELS = ("adamw", "layernorm", "rmsnorm", "bias_gelu", "cross_entropy")


@dataclass(frozen=True)
class TuneSpace:
    """The values each axis may take; None: the default for the recipe and device (module docstring)."""
    stages: tuple[int, ...] | None = None
    micro_batches: tuple[int, ...] | None = None
    checkpointing: tuple[bool, ...] = (False, True)
    offloads: tuple[str, ...] = ("none", "cpu", "cpu@0.5")
    refine: bool | None = None  # compile / kernels toggles on the best; None: on a GPU only


@dataclass
class Trial:
    """One candidate: what it changes, what the estimator predicted, and what running it gave (or why not)."""
    changes: dict
    predicted_bytes: int = 0
    status: str = "pending"  # ok, pruned, failed, not run (budget), confirm
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    wall_s: float = 0.0
    why: str = ""
    confirms: int | None = None  # index of the trial a confirm rerun repeats

    @property
    def label(self) -> str:
        """The changes in a few words (`stage 2, micro 16, ckpt, offload cpu`)."""
        c = self.changes
        words = [f"stage {c['zero.stage']}", f"micro {c['batch.micro_batch_per_rank']}"]
        words += ["ckpt"] if c.get("model.activation_checkpointing") else []
        words += [f"offload {c['offload']}"] if c.get("offload", "none") != "none" else []
        words += ["compile"] if c.get("training.compile") else []
        words += ["kernels off"] if c.get("kernels") == "off" else []
        return ", ".join(words)


def _overrides(changes: dict) -> dict:
    """A candidate's changes as recipe keys (offload and kernels expand to several)."""
    out = {k: v for k, v in changes.items() if k not in ("offload", "kernels")}
    out.update(OFFLOADS[changes.get("offload", "none")])
    if "kernels" in changes:
        out.update({f"kernels.{k}": changes["kernels"] for k in KERNELS})
    return out


def _as_override(key: str, value) -> str:
    return f"{key}={json.dumps(value) if not isinstance(value, str) else value}"


def original_changes(recipe) -> dict:
    """The original recipe's point in the space (what the candidates' changes are compared with)."""
    z = recipe.zero
    offload = "none" if z.offload_optimizer == "none" else ("cpu" if z.offload_ratio == 1 else f"cpu@{z.offload_ratio:g}")
    return {"zero.stage": z.stage, "batch.micro_batch_per_rank": recipe.batch.micro_batch_per_rank,
            "batch.grad_accum_steps": recipe.batch.grad_accum_steps,
            "model.activation_checkpointing": recipe.model.activation_checkpointing, "offload": offload,
            "training.compile": recipe.training.compile}


def candidates(recipe, space: TuneSpace, world_size: int) -> list[dict]:
    """Every point of the space as changes, in trial order: per (stage, checkpointing, offload) the largest micro
    batch first, those configurations taken round-robin (no checkpointing and no offload first)."""
    per_rank = recipe.batch.global_batch // world_size
    micros = space.micro_batches or tuple(m for m in (1, 2, 4, 8, 16, 32, 64) if per_rank % m == 0)
    micros = sorted((m for m in micros if per_rank % m == 0), reverse=True)
    configs = [(ckpt, off, stage) for ckpt in space.checkpointing for off in space.offloads
               for stage in (space.stages or (0, 1, 2, 3)) if not (stage == 0 and off != "none")]
    configs.sort(key=lambda c: (c[1] != "none", c[0]))
    groups = [[{"zero.stage": stage, "batch.micro_batch_per_rank": micro, "batch.grad_accum_steps": per_rank // micro,
                "model.activation_checkpointing": ckpt, "offload": off} for micro in micros]
              for ckpt, off, stage in configs]
    return [c for tier in itertools.zip_longest(*groups) for c in tier if c is not None]


def memory_cap(on_cuda: bool) -> tuple[int, str]:
    """Bytes a rank may use (USABLE_FRACTION of the GPU's free memory, or of the host's available RAM), and where."""
    if on_cuda:
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(USABLE_FRACTION * free), f"{USABLE_FRACTION:.0%} of {torch.cuda.get_device_name()}'s free memory"
    available, what = host_available_bytes()
    return int(USABLE_FRACTION * available), f"{USABLE_FRACTION:.0%} of {what}"


def predict(recipe_path, changes: dict, world_size: int, on_cuda: bool) -> tuple[int, str]:
    """(predicted bytes per rank, "") or (0, the recipe error) for one candidate, torch-free."""
    overrides = [_as_override(k, v) for k, v in _overrides(changes).items()]
    try:
        recipe = load_recipe(recipe_path, overrides, world_size=world_size)
    except UserError as exc:
        return 0, exc.lines[0]
    device, host = size_terms(recipe, on_cuda=on_cuda)
    return sum(t.nbytes for t in (device if on_cuda else host)), ""


def _read_metrics(path: Path, warmup: int, tokens_per_step: int) -> tuple[float, int]:
    """(tokens/s over the steps after `warmup`, peak bytes) from a run's metrics.jsonl."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [line for line in lines if "tokens_per_s" in line and line.get("step", 0) > warmup]
    if not steps:
        raise ValueError("no measured steps in metrics.jsonl")
    seconds = sum(tokens_per_step / line["tokens_per_s"] for line in steps)  # log_interval 1: one step a line
    peak = max(line.get("mem_peak_bytes", 0) for line in lines)
    return len(steps) * tokens_per_step / seconds, peak


def run_trial(recipe_path, trial: Trial, *, world_size: int, warmup: int, measure: int, timeout: float,
              tokens_per_step: int) -> Trial:
    """Run one candidate in a fresh process (`toolkit run`, `--nproc` for several ranks) and read its metrics."""
    run_dir = Path(tempfile.mkdtemp(prefix="toolkit-tune-"))
    overrides = [_as_override(k, v) for k, v in _overrides(trial.changes).items()]
    cmd = [sys.executable, "-m", "toolkit", "run", str(recipe_path), *overrides, *TRIAL_KEYS,
           f"training.max_steps={warmup + measure}", "--run-dir", str(run_dir / "run")]
    if world_size > 1:
        cmd += ["--nproc", str(world_size)]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout),
                              env={**os.environ, "TOOLKIT_TUNE_TRIAL": "1"})
        trial.wall_s = time.monotonic() - start
        if done.returncode != 0:
            last = [line for line in done.stderr.splitlines() if line.strip()] or [f"exit code {done.returncode}"]
            errors = [line for line in last if line.startswith("error:")]
            return replace(trial, status="failed", why=(errors or last)[-1][:200], wall_s=trial.wall_s)
        tps, peak = _read_metrics(run_dir / "run" / "metrics.jsonl", warmup, tokens_per_step)
        return replace(trial, status="ok", tokens_per_s=tps, peak_bytes=peak, wall_s=trial.wall_s)
    except subprocess.TimeoutExpired:
        return replace(trial, status="failed", why=f"over the time left ({timeout:.0f} s)",
                       wall_s=time.monotonic() - start)
    except (OSError, ValueError) as exc:
        return replace(trial, status="failed", why=str(exc)[:200], wall_s=time.monotonic() - start)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class TuneResult:
    """Every trial in the order run (pruned ones too), the best, and what the tuning was about."""
    recipe_path: Path
    original: dict
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None
    cap_bytes: int = 0
    cap_where: str = ""
    device: str = ""
    world_size: int = 1
    budget_s: float = 0.0
    elapsed_s: float = 0.0


def tune(recipe_path, *, budget_s: float = 600.0, world_size: int = 1, space: TuneSpace = TuneSpace(),
         warmup: int = 2, measure: int = 3, cap_bytes: int | None = None, confirm: bool = True,
         log=print) -> TuneResult:
    """Search the space for the fastest candidate that fits; see the module docstring."""
    from toolkit.runtime.engine import pick_device

    path = find_recipe_file(recipe_path)
    recipe = load_recipe(path, world_size=world_size)
    on_cuda = pick_device(recipe.training.device).type == "cuda"
    cap, where = (cap_bytes, "given") if cap_bytes is not None else memory_cap(on_cuda)
    result = TuneResult(path, original_changes(recipe), cap_bytes=cap, cap_where=where, world_size=world_size,
                        device="cuda" if on_cuda else "cpu", budget_s=budget_s)
    tokens_per_step = recipe.batch.global_batch * recipe.data.seq_len
    start = time.monotonic()

    def left() -> float:
        return budget_s - (time.monotonic() - start)

    def attempt(trial: Trial, slots: int = 2) -> Trial:
        # NOTE: the slowest trial so far stands for the next one; a search trial also keeps one such slot for
        # the confirm rerun, which then spends it (slots=1).
        slowest = max((t.wall_s for t in result.trials if t.status in ("ok", "failed")), default=0.0)
        if left() < slots * slowest:
            trial = replace(trial, status="not run", why="budget spent")
        else:
            trial = run_trial(path, trial, world_size=world_size, warmup=warmup, measure=measure,
                              timeout=left() - slowest, tokens_per_step=tokens_per_step)
        result.trials.append(trial)
        log(f"tune: {trial.label}: {trial.status}"
            + (f", {trial.tokens_per_s:,.0f} tokens/s" if trial.tokens_per_s else f" ({trial.why})"))
        return trial

    for changes in candidates(recipe, space, world_size):
        predicted, error = predict(path, changes, world_size, on_cuda)
        trial = Trial(changes, predicted_bytes=predicted)
        if error or predicted > cap:
            trial.status, trial.why = "pruned", error or f"predicted {format_bytes(predicted)} > cap {format_bytes(cap)}"
            result.trials.append(trial)
            continue
        attempt(trial)
    best = _best(result.trials)
    if best is not None and (space.refine if space.refine is not None else on_cuda):
        for toggle in ({"training.compile": not best.changes.get("training.compile", False)}, {"kernels": "off"}):
            changes = {**best.changes, **toggle}
            attempt(Trial(changes, predicted_bytes=predict(path, changes, world_size, on_cuda)[0]))
        best = _best(result.trials)
    if best is not None and confirm:
        confirm = attempt(Trial(best.changes, predicted_bytes=best.predicted_bytes), slots=1)
        confirm.confirms = result.trials.index(best)
        confirm.status = "confirm" if confirm.status == "ok" else confirm.status
    result.best, result.elapsed_s = best, time.monotonic() - start
    return result


def _best(trials: list[Trial]) -> Trial | None:
    measured = [t for t in trials if t.status == "ok"]
    return max(measured, key=lambda t: t.tokens_per_s) if measured else None
