"""`toolkit tune RECIPE`: the fastest variant of a recipe that fits, and never a slower one than the recipe.

The search space is ZeRO stage x micro batch (grad_accum_steps follows, so the global batch stays the recipe's)
x activation checkpointing x optimizer offload (ratio 1 or 0.5); then, on a GPU, the best of those with
training.compile and the fused kernels toggled. In order:

1. Trial 0 is the recipe as written (the baseline), always run, whatever the budget or the memory estimate says
   (an out-of-memory ends only that trial). On a GPU the kernels are built before it, so no trial's time holds a
   build.
2. Every candidate is validated and sized by the memory estimator (toolkit/observe/memory_fit.py size_terms, as
   `toolkit estimate` counts). One is pruned only when its prediction exceeds the cap by more than PRUNE_MARGIN
   (10%, the model's stated accuracy): a candidate near the cap runs anyway.
3. The rest run in the order of toolkit/train/tune_order.py (a throughput model refined by each measured trial:
   the largest micro batch that fits without checkpointing first, offload only when nothing else fits), each as
   a fresh `toolkit run` process (`--nproc N` for several ranks): warm-up steps, then measured steps, read back
   from its metrics.jsonl (tokens/s over the measured steps only, peak memory). A crash or OOM ends that trial.
4. From the start, time is kept for the A/B re-measurement (AB_PAIRS x the baseline's time plus the slowest
   candidate's, the baseline's until one ran): a trial starts only when the budget left covers it and that reserve.
   When a slow baseline leaves no room for a candidate beside two pairs, one pair is kept, and the search trials
   of the two join its samples (tune_decide.py).
5. The best candidate and the baseline rerun interleaved A/B/A/B, each in a fresh process; the candidate wins
   only when its slowest rerun beats the baseline's fastest by more than MIN_GAIN (1%; the rule and why:
   toolkit/train/tune_decide.py). Otherwise, or when the baseline was itself the fastest, the answer is "keep
   your recipe" and no recipe is written.

The space's points and a candidate's recipe keys: tune_space.py. Writing the outputs (the tuned recipe, the trial
table with the baseline row and the decision): tune_report.py.
"""
from __future__ import annotations

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
from toolkit.recipe.checks import overlapped_update_errors
from toolkit.recipe.load import find_recipe_file, load_recipe
from toolkit.train import tune_order
from toolkit.train.tune_decide import AB_PAIRS, Decision, measure_ab
from toolkit.train.tune_space import Trial, TuneSpace, original_changes, override_args, trial_overrides

# Recipe keys a trial sets, whatever the candidate, so it is short, quiet and leaves nothing behind.
TRIAL_KEYS = ["training.eval_batches=0", "training.eval_interval=0", "training.log_interval=1",
              "checkpoint.save_final=false", "checkpoint.interval=0", "checkpoint.resume=never",
              "logging.console=false", "logging.tensorboard=false", "logging.wandb.mode=disabled",
              "training.memory_check=warn"]
PRUNE_MARGIN = 0.10  # NOTE: the memory model is held to +-10% of measured (its calibration test): prune beyond that
BASELINE_TIMEOUT_S = 600  # the baseline runs even past a spent budget, but not forever


def candidates(recipe, space: TuneSpace, world_size: int, on_cuda: bool = False) -> list[dict]:
    """Every point of the space but the recipe's own, as changes (tune_order.candidates: the table's order).
    Offloading candidates step overlapped where that is exact and measured faster (`overlapped_for_offload`) on a GPU:
    the same results, the CPU step started under the backward (1.39x exact's tokens/s on GPT-2 1.5B,
    benchmarks/RESULTS.md)."""
    per_rank = recipe.batch.global_batch // world_size
    micros = space.micro_batches or tuple(m for m in (1, 2, 4, 8, 16, 32, 64) if per_rank % m == 0)
    original = original_changes(recipe)
    found = [c for c in tune_order.candidates(list(micros), per_rank, space.stages or (0, 1, 2, 3),
                                              space.checkpointing, space.offloads)
             if any(original.get(k) != v for k, v in c.items())]
    if on_cuda and overlapped_for_offload(recipe):
        found = [{**c, "zero.offload_update": "overlapped"} if c.get("offload", "none") != "none" else c for c in found]
    return found


def overlapped_for_offload(recipe) -> bool:
    """True when zero.offload_update overlapped gives the recipe's exact results and its speed-up is measured: it steps
    exactly (not delayed), nothing the recipe checks refuses for overlapped (fp16, clipping with swap files or int8
    moments: recipe/checks.py) or for any non-exact update (Muon), and it clips nothing (training.grad_clip 0: the
    speculation of a clipped run, zero/speculation.py, is exact but not yet timed on a GPU)."""
    return (recipe.zero.offload_update == "exact" and recipe.optimizer.type != "muon"
            and recipe.training.grad_clip == 0 and not overlapped_update_errors(recipe.resolved))


def memory_cap(on_cuda: bool) -> tuple[int, str]:
    """Bytes a rank may use (USABLE_FRACTION of the GPU's free memory, or of the host's available RAM), and where."""
    if on_cuda:
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(USABLE_FRACTION * free), f"{USABLE_FRACTION:.0%} of {torch.cuda.get_device_name()}'s free memory"
    available, what = host_available_bytes()
    return int(USABLE_FRACTION * available), f"{USABLE_FRACTION:.0%} of {what}"


def predict(recipe_path, changes: dict | None, world_size: int, on_cuda: bool) -> tuple[int, str]:
    """(predicted bytes per rank, "") or (0, the recipe error) for one candidate (None: the recipe as written),
    torch-free."""
    try:
        recipe = load_recipe(recipe_path, override_args(changes), world_size=world_size)
    except UserError as exc:
        return 0, exc.lines[0]
    device, host = size_terms(recipe, on_cuda=on_cuda)
    return sum(t.nbytes for t in (device if on_cuda else host)), ""


def _read_metrics(path: Path, warmup: int, tokens_per_step: int) -> tuple[float, int, int | None]:
    """(tokens/s over the steps after `warmup`, peak bytes, reserved peak bytes or None on the CPU) from a run's
    metrics.jsonl."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [line for line in lines if "tokens_per_s" in line and line.get("step", 0) > warmup]
    if not steps:
        raise ValueError("no measured steps in metrics.jsonl")
    seconds = sum(tokens_per_step / line["tokens_per_s"] for line in steps)  # log_interval 1: one step a line
    peak = max(line.get("mem_peak_bytes", 0) for line in lines)
    reserved = max((line["mem_reserved_peak_bytes"] for line in lines if "mem_reserved_peak_bytes" in line),
                   default=None)
    return len(steps) * tokens_per_step / seconds, peak, reserved


def run_trial(recipe_path, trial: Trial, *, world_size: int, warmup: int, measure: int, timeout: float,
              tokens_per_step: int) -> Trial:
    """Run one candidate in a fresh process (`toolkit run`, `--nproc` for several ranks) and read its metrics."""
    run_dir = Path(tempfile.mkdtemp(prefix="toolkit-tune-"))
    cmd = [sys.executable, "-m", "toolkit", "run", str(recipe_path), *trial_overrides(trial), *TRIAL_KEYS,
           f"training.max_steps={warmup + measure}", "--run-dir", str(run_dir / "run")]
    if world_size > 1:
        cmd += ["--nproc", str(world_size)]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout),
                              env={**os.environ, "TOOLKIT_TUNE_TRIAL": "1"})
        wall_s = time.monotonic() - start
        if done.returncode != 0:
            last = [line for line in done.stderr.splitlines() if line.strip()] or [f"exit code {done.returncode}"]
            errors = [line for line in last if line.startswith("error:")]
            return replace(trial, status="failed", why=(errors or last)[-1][:200], wall_s=wall_s)
        tps, peak, reserved = _read_metrics(run_dir / "run" / "metrics.jsonl", warmup, tokens_per_step)
        return replace(trial, status="ok", tokens_per_s=tps, peak_bytes=peak, reserved_bytes=reserved, wall_s=wall_s)
    except subprocess.TimeoutExpired:
        return replace(trial, status="failed", why=f"over the time left ({timeout:.0f} s)",
                       wall_s=time.monotonic() - start)
    except (OSError, ValueError) as exc:
        return replace(trial, status="failed", why=str(exc)[:200], wall_s=time.monotonic() - start)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class TuneResult:
    """Every trial (the baseline first, then in the order run; A/B reruns; then those not run), the best search
    trial, the decision, and what the tuning was about."""
    recipe_path: Path
    original: dict
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None  # the fastest search trial, the baseline included
    decision: Decision | None = None  # None: nothing ran
    cap_bytes: int = 0
    cap_where: str = ""
    device: str = ""
    world_size: int = 1
    budget_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def baseline(self) -> Trial:
        """Trial 0: the recipe as written."""
        return self.trials[0]

    @property
    def tuned(self) -> Trial | None:
        """The candidate to write, or None: keep your recipe."""
        return self.best if self.decision is not None and self.decision.change else None


def tune(recipe_path, *, budget_s: float = 600.0, world_size: int = 1, space: TuneSpace = TuneSpace(),
         warmup: int = 2, measure: int = 3, cap_bytes: int | None = None, ab_pairs: int = AB_PAIRS,
         log=print) -> TuneResult:
    """Search the space for a candidate faster than the recipe as written; see the module docstring."""
    from toolkit.runtime.engine import pick_device

    path = find_recipe_file(recipe_path)
    recipe = load_recipe(path, world_size=world_size)
    on_cuda = pick_device(recipe.training.device).type == "cuda"
    cap, where = (cap_bytes, "given") if cap_bytes is not None else memory_cap(on_cuda)
    result = TuneResult(path, original_changes(recipe), cap_bytes=cap, cap_where=where, world_size=world_size,
                        device="cuda" if on_cuda else "cpu", budget_s=budget_s)
    prune_above = int(cap * (1 + PRUNE_MARGIN))
    tokens_per_step = recipe.batch.global_batch * recipe.data.seq_len
    start = time.monotonic()
    pairs = ab_pairs

    def left() -> float:
        return budget_s - (time.monotonic() - start)

    def reserve() -> float:
        # NOTE: the A/B reruns: per pair the baseline's time and the slowest candidate's (the baseline's until one
        # ran); none when the baseline failed. A slow baseline (offload, checkpointing) no longer counts 4 times.
        if result.trials[0].status != "ok":
            return 0.0
        candidates_ok = [t.wall_s for t in result.trials[1:] if t.status == "ok"]
        return pairs * (result.trials[0].wall_s + max(candidates_ok, default=result.trials[0].wall_s))

    def run(trial: Trial, timeout: float) -> Trial:
        trial = run_trial(path, trial, world_size=world_size, warmup=warmup, measure=measure, timeout=timeout,
                          tokens_per_step=tokens_per_step)
        if trial.rerun_of is not None and trial.status == "ok":
            trial.status = "rerun"  # NOTE: "ok" marks search trials only, those `best` is chosen from
        result.trials.append(trial)
        name = ("baseline " if trial.baseline else "") + (f"A/B rerun of #{trial.rerun_of}, " if trial.rerun_of
                                                                   is not None else "")
        log(f"tune: #{len(result.trials) - 1} {name}{trial.label}: {trial.status}"
            + (f", {trial.tokens_per_s:,.0f} tokens/s" if trial.tokens_per_s else f" ({trial.why})"))
        return trial

    def room() -> float | None:
        """The time a next trial may take, or None: the budget left does not cover one more and the A/B."""
        slowest = max(t.wall_s for t in result.trials)
        return left() - reserve() if left() >= slowest + reserve() else None

    if on_cuda:  # NOTE: built once here, so that no trial's time (the A/B reserve is counted from them) holds a build
        log(f"tune: kernels ready in {build_kernels():.0f} s")
    predicted = predict(path, None, world_size, on_cuda)[0]
    over = f"predicted {format_bytes(predicted)} > cap {format_bytes(cap)}" if predicted > prune_above else ""
    base = run(Trial(result.original, predicted_bytes=predicted, baseline=True), max(left(), BASELINE_TIMEOUT_S))
    base.why = "; ".join(filter(None, (over, base.why)))  # the recipe as written runs even so
    if pairs > 1 and room() is None:  # NOTE: a slow baseline: one A/B pair, so that candidates run at all
        pairs = 1
        if room() is None:
            pairs = ab_pairs  # not even then: no candidate runs, and the answer says "not tuned"
        else:
            log(f"tune: one A/B pair, not {ab_pairs}: the baseline took {base.wall_s:.0f} s of the budget; the "
                f"search trials count as the second samples")

    all_changes = candidates(recipe, space, world_size, on_cuda)
    pending, not_run = _sized(path, all_changes, world_size, on_cuda, cap, prune_above)
    _search(pending, not_run, result, run, room, sixteen_bit=recipe.precision.dtype in ("bf16", "fp16"))
    best = _best(result.trials)
    if best is not None and (space.refine if space.refine is not None else on_cuda):
        compile_on = best.changes.get("training.compile", result.original["training.compile"])
        for toggle in ({"training.compile": not compile_on}, {"kernels": "off"}):
            if room() is not None:
                changes = {**best.changes, **toggle}
                run(Trial(changes, predicted_bytes=predict(path, changes, world_size, on_cuda)[0]), room())
        best = _best(result.trials)
    result.best, result.decision = best, _decide(result, base, best, pairs, run, len(pending), ab_pairs)
    order = {id(c): i for i, c in enumerate(all_changes)}  # those not run: in the space's order
    result.trials += sorted([replace(t, status="not run", why="budget spent") for t in pending] + not_run,
                            key=lambda t: order[id(t.changes)])
    result.elapsed_s = time.monotonic() - start
    return result


def build_kernels() -> float:
    """Build (or find in the cache) every kernel a trial may load, the CPU Adam of offload among them: seconds taken.
    A kernel that cannot build is the trials' business: they fall back to torch's ops and say so."""
    from toolkit.ops import loader

    start = time.monotonic()
    loader.build_all((*loader.KERNELS, "cpu_adam"))
    return time.monotonic() - start


def _sized(path, all_changes: list[dict], world_size: int, on_cuda: bool, cap: int,
           prune_above: int) -> tuple[list[Trial], list[Trial]]:
    """Every candidate as a Trial with its prediction: (those to run, those pruned beyond the cap + margin)."""
    pending, pruned = [], []
    for changes in all_changes:
        predicted, error = predict(path, changes, world_size, on_cuda)
        trial = Trial(changes, predicted_bytes=predicted)
        if error or predicted > prune_above:
            trial.status = "pruned"
            trial.why = error or f"predicted {format_bytes(predicted)} > cap {format_bytes(cap)} + {PRUNE_MARGIN:.0%}"
            pruned.append(trial)
        else:
            pending.append(trial)
    return pending, pruned


def _search(pending: list[Trial], not_run: list[Trial], result: TuneResult, run, room, sixteen_bit: bool) -> None:
    """Run the pending candidates in tune_order's order while room() allows one more; those skipped move from
    `pending` to `not_run`, those left in `pending` are the budget's. `sixteen_bit`: tune_order.prior's."""
    while pending:
        ran = [(i, t.changes, t.tokens_per_s) for i, t in enumerate(result.trials)]
        runnable = []
        for trial in list(pending):
            why = tune_order.skip_reason(trial.changes, ran, [t.changes for t in pending])
            if why and why != "wait":
                pending.remove(trial)
                not_run.append(replace(trial, status="skipped", why=why))
            elif not why:
                runnable.append(trial)
        choice = tune_order.next_candidate([t.changes for t in runnable], ran, result.world_size, sixteen_bit)
        timeout = room()
        if choice is None or timeout is None:
            return
        trial = next(t for t in runnable if t.changes is choice)
        pending.remove(trial)
        run(trial, timeout)


def _decide(result: TuneResult, base: Trial, best: Trial | None, pairs: int, run, waiting: int,
            ab_pairs: int) -> Decision | None:
    """The A/B/A/B reruns and the decision (tune_decide.py); None when nothing ran. `waiting`: candidates the
    budget left unrun; `pairs` below `ab_pairs`: the budget's, and the search trials join the reruns' samples."""
    if best is None:
        return None
    if best is base and waiting and not any(t.status == "ok" for t in result.trials[1:]):
        return Decision(False, why=f"no candidate ran: the budget left after the baseline ({base.wall_s:.0f} s) did "
                                   f"not cover one more trial and the A/B reruns; a longer --budget-minutes tunes",
                        untried=True)
    if best is base:
        return Decision(False, why="the recipe as written was the fastest trial")
    if base.status != "ok":
        return Decision(True, best.label, (), (best.tokens_per_s,), f"the recipe as written failed ({base.why})")
    index = {True: 0, False: result.trials.index(best)}
    timeout = 2 * max(base.wall_s, best.wall_s) + 60  # NOTE: the time was reserved; a stuck run still ends

    def rerun(is_baseline: bool) -> tuple[int, float | None]:
        source = result.trials[index[is_baseline]]
        trial = run(replace(source, status="pending", why="", tokens_per_s=None, peak_bytes=None, reserved_bytes=None,
                            rerun_of=index[is_baseline]), timeout)
        return len(result.trials) - 1, trial.tokens_per_s

    earlier = ([base.tokens_per_s], [best.tokens_per_s]) if pairs < ab_pairs else ([], [])
    return measure_ab(rerun, best.label, pairs, earlier)


def _best(trials: list[Trial]) -> Trial | None:
    measured = [t for t in trials if t.status == "ok"]
    return max(measured, key=lambda t: t.tokens_per_s) if measured else None
