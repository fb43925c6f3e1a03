"""What `toolkit tune` writes: the tuned recipe (`extends` the original, only the keys that changed; only when the
A/B decision says the candidate is faster), the trial table (markdown and JSON: the baseline row marked,
predicted vs measured memory, tokens/s, or why pruned, skipped or failed; the decision with its margin) and a plot
(matplotlib, optional: without it the plot is left out with one note)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from toolkit.observe.estimate import format_bytes
from toolkit.train.tune import PRUNE_MARGIN, TuneResult
from toolkit.train.tune_decide import MIN_GAIN
from toolkit.train.tune_space import changes_as_keys


def tuned_recipe(result: TuneResult, out: Path) -> dict:
    """The winning candidate as a recipe extending the original: only the keys whose values differ."""
    best, decision = result.tuned, result.decision
    original = changes_as_keys(result.original)
    changed = {k: v for k, v in changes_as_keys(best.changes).items()
               if original.get(k, "unset") != v
               and not (k == "zero.offload_ratio" and best.changes.get("offload") == "none")}
    tokens_per_s = sum(decision.candidate_runs) / len(decision.candidate_runs)
    recipe: dict = {"extends": os.path.relpath(result.recipe_path.absolute(), out.absolute().parent),
                    "description": (f"{result.recipe_path.stem} tuned by `toolkit tune` for {result.world_size} "
                                    f"{result.device} rank(s): {best.label}, {tokens_per_s:,.0f} tokens/s measured"
                                    + (f", {decision.speedup:.2f}x the recipe as written" if decision.speedup else ""))}
    for key, value in sorted(changed.items()):
        section, name = key.split(".", 1)
        recipe.setdefault(section, {})[name] = value
    return recipe


def _runs(values) -> str:
    return ", ".join(f"{v:,.0f}" for v in values)


def decision_text(result: TuneResult, out: Path | None = None) -> str:
    """The answer in one line: the candidate written (with its A/B margin), or "keep your recipe" and why."""
    d, base = result.decision, result.baseline
    if d is None:
        return f"no configuration ran: the recipe as written failed ({base.why}) and no candidate ran"
    written = f"written to {out}" if out is not None else "a recipe to write"
    if d.change and not d.baseline_runs:
        return (f"candidate {d.candidate} runs at {d.candidate_runs[0]:,.0f} tokens/s and {d.why}; {written}")
    name = "search, then one A/B pair (the budget's)" if d.with_search else "/".join("AB" * (len(d.reruns) // 2))
    ab = (f"{name} tokens/s: baseline {_runs(d.baseline_runs)}, candidate {_runs(d.candidate_runs)}; "
          f"spread {d.spread:.1%}" if d.baseline_runs and d.candidate_runs else "")
    if d.change:
        return f"candidate {d.candidate} is {d.speedup:.2f}x the baseline ({ab}; {d.why}); {written}"
    if d.untried:
        return f"not tuned, {d.why} (the recipe as written: {base.tokens_per_s:,.0f} tokens/s); no recipe written"
    if not d.candidate:
        runner_up = max((t for t in result.trials if t.status == "ok" and not t.baseline),
                        key=lambda t: t.tokens_per_s, default=None)
        other = (f"; best candidate {runner_up.label} {runner_up.tokens_per_s / base.tokens_per_s:.2f}x"
                 if runner_up else "; no candidate ran")
        return f"keep your recipe: {d.why} ({base.tokens_per_s:,.0f} tokens/s{other}); no recipe written"
    if d.speedup is None:
        return f"keep your recipe: best candidate {d.candidate}: {d.why}; no recipe written"
    return (f"keep your recipe: best candidate {d.candidate} {d.speedup:.2f}x, within the spread {d.spread:.0%} "
            f"({ab}; {d.why}); no recipe written")


def trial_rows(result: TuneResult) -> list[dict]:
    """One plain dict per trial (the JSON table); `baseline` marks the recipe as written and its reruns."""
    return [{"trial": i, "config": t.label, "baseline": t.baseline, "status": t.status,
             "predicted_gib": round(t.predicted_bytes / 2**30, 3),
             "measured_peak_gib": round(t.peak_bytes / 2**30, 3) if t.peak_bytes else None,
             **({"measured_reserved_gib": round(t.reserved_bytes / 2**30, 3)} if t.reserved_bytes else {}),
             "tokens_per_s": round(t.tokens_per_s, 1) if t.tokens_per_s else None, "wall_s": round(t.wall_s, 1),
             "why": t.why, **({"rerun_of": t.rerun_of} if t.rerun_of is not None else {})}
            for i, t in enumerate(result.trials)]


def trial_table(result: TuneResult, out: Path | None = None) -> str:
    """The markdown table of every trial (the baseline row marked), after the cap, budget and decision lines."""
    head = (f"Tuning {result.recipe_path.name} on {result.world_size} {result.device} rank(s): memory cap "
            f"{result.cap_bytes / 2**30:.2f} GiB ({result.cap_where}; pruned beyond +{PRUNE_MARGIN:.0%}), "
            f"{result.elapsed_s:.0f} s of a {result.budget_s:.0f} s budget.")
    rule = (f"Decision (the candidate's slowest A/B rerun must beat the baseline's fastest by more than "
            f"{MIN_GAIN:.0%}): {decision_text(result, out)}.")
    lines = [head, "", rule, "", "| # | config | status | predicted | measured peak | tokens/s | wall s | why |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in trial_rows(result):
        tps = f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] else ""
        config = f"**baseline** {row['config']}" if row["baseline"] else row["config"]
        why = "; ".join(filter(None, (f"A/B rerun of #{row['rerun_of']}" if "rerun_of" in row else "", row["why"])))
        trial = result.trials[row["trial"]]
        predicted, peak = (format_bytes(n) if n else "" for n in (trial.predicted_bytes, trial.peak_bytes))
        peak += f" (reserved {format_bytes(trial.reserved_bytes)})" if trial.reserved_bytes else ""
        lines.append(f"| {row['trial']} | {config} | {row['status']} | {predicted} | {peak} | {tps} | "
                     f"{row['wall_s']} | {why.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def decision_json(result: TuneResult, out: Path | None) -> dict:
    """The decision as plain values (the JSON file's `decision`)."""
    d = result.decision
    if d is None:
        return {"change": False, "text": decision_text(result, out)}
    return {"change": d.change, "candidate": d.candidate or None, "baseline_runs": list(d.baseline_runs),
            "candidate_runs": list(d.candidate_runs), "speedup": d.speedup, "spread": d.spread,
            "worst_case": d.worst_case, "min_gain": MIN_GAIN, "reruns": list(d.reruns),
            "with_search": d.with_search, "why": d.why,
            "written": str(out) if d.change and out is not None else None, "text": decision_text(result, out)}


def trial_name(result: TuneResult, trial) -> str:
    """A bar's label: `#3 stage 1, micro 8`, the baseline and A/B reruns marked."""
    marks = (["baseline"] if trial.baseline else []) + ([f"rerun of #{trial.rerun_of}"] if trial.rerun_of
                                                         is not None else [])
    return f"#{result.trials.index(trial)} {trial.label}" + (f" ({', '.join(marks)})" if marks else "")


def bar_colors(result: TuneResult, trials) -> list[str]:
    """Gray for the baseline, green for the written candidate (its reruns too), blue for the rest."""
    tuned = result.tuned.changes if result.tuned is not None else None
    return ["tab:gray" if t.baseline else "tab:green" if t.changes == tuned else "tab:blue" for t in trials]


def plot_trials(result: TuneResult, path: Path) -> bool:
    """Tokens/s per trial and predicted vs measured memory, as a PNG; False when matplotlib is missing."""
    try:  # NOTE: a Figure without pyplot: no backend switched under a notebook that plots too
        from matplotlib.figure import Figure
    except ImportError:
        return False
    ran = [t for t in result.trials if t.tokens_per_s]
    fig = Figure(figsize=(12, 4.5))
    left, right = fig.subplots(1, 2)
    left.barh([trial_name(result, t) for t in ran], [t.tokens_per_s for t in ran], color=bar_colors(result, ran))
    left.set_xlabel("tokens/s (measured steps, warm-up excluded)")
    left.invert_yaxis()
    gib = 2**30
    right.scatter([t.predicted_bytes / gib for t in ran], [t.peak_bytes / gib for t in ran], label="ran")
    pruned = [t for t in result.trials if t.status == "pruned" and t.predicted_bytes]
    right.scatter([t.predicted_bytes / gib for t in pruned], [0] * len(pruned), marker="x", color="tab:red",
                  label="pruned (not run)")
    right.axvline(result.cap_bytes / gib, color="gray", linestyle="--", label="memory cap")
    right.set_xlabel("predicted GiB per rank (toolkit estimate)")
    right.set_ylabel("measured peak GiB")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def write_outputs(result: TuneResult, out: Path) -> list[Path]:
    """out (the tuned recipe, only when the decision is to change), out's stem + .trials.md / .trials.json /
    .trials.png; returns what was written."""
    stem = out.with_suffix("")
    written = []
    if result.tuned is not None:  # NOTE: "keep your recipe" writes no recipe
        out.write_text(json.dumps(tuned_recipe(result, out), indent=2) + "\n")
        written.append(out)
    md, js, png = (Path(f"{stem}.trials.{ext}") for ext in ("md", "json", "png"))
    md.write_text(trial_table(result, out))
    js.write_text(json.dumps({"recipe": str(result.recipe_path), "device": result.device,
                              "world_size": result.world_size, "cap_bytes": result.cap_bytes,
                              "prune_margin": PRUNE_MARGIN, "budget_s": result.budget_s,
                              "elapsed_s": round(result.elapsed_s, 1), "decision": decision_json(result, out),
                              "trials": trial_rows(result)}, indent=2) + "\n")
    written += [md, js]
    if plot_trials(result, png):
        written.append(png)
    return written
