"""What `toolkit tune` writes: the tuned recipe (`extends` the original, only the keys that changed), the
trial table (markdown and JSON: predicted vs measured memory, tokens/s, or why pruned or failed) and a
plot (matplotlib, optional: without it the plot is left out with one note)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from toolkit.train.tune import TuneResult, _overrides


def tuned_recipe(result: TuneResult, out: Path) -> dict:
    """The best candidate as a recipe extending the original: only the keys whose values differ."""
    best = result.best.changes
    changed = {k: v for k, v in _overrides(best).items()
               if _overrides(result.original).get(k, "unset") != v and not (k == "zero.offload_ratio"
                                                                             and best.get("offload") == "none")}
    recipe: dict = {"extends": os.path.relpath(result.recipe_path.absolute(), out.absolute().parent),
                    "description": (f"{result.recipe_path.stem} tuned by `toolkit tune` for {result.world_size} "
                                    f"{result.device} rank(s): {result.best.label}, "
                                    f"{result.best.tokens_per_s:,.0f} tokens/s measured")}
    for key, value in sorted(changed.items()):
        section, name = key.split(".", 1)
        recipe.setdefault(section, {})[name] = value
    return recipe


def _gib(n) -> str:
    return f"{n / 2**30:.2f}" if n else ""


def trial_rows(result: TuneResult) -> list[dict]:
    """One plain dict per trial (the JSON table)."""
    return [{"trial": i, "config": t.label, "status": t.status, "predicted_gib": round(t.predicted_bytes / 2**30, 3),
             "measured_peak_gib": round(t.peak_bytes / 2**30, 3) if t.peak_bytes else None,
             "tokens_per_s": round(t.tokens_per_s, 1) if t.tokens_per_s else None, "wall_s": round(t.wall_s, 1),
             "why": t.why, **({"confirms": t.confirms} if t.confirms is not None else {})}
            for i, t in enumerate(result.trials)]


def trial_table(result: TuneResult) -> str:
    """The markdown table of every trial, with a header line saying the cap, budget and best."""
    best = result.best
    head = (f"Tuning {result.recipe_path.name} on {result.world_size} {result.device} rank(s): memory cap "
            f"{result.cap_bytes / 2**30:.2f} GiB ({result.cap_where}), {result.elapsed_s:.0f} s of a "
            f"{result.budget_s:.0f} s budget. Best: " + (f"{best.label}, {best.tokens_per_s:,.0f} tokens/s."
                                                        if best else "none ran."))
    lines = [head, "", "| # | config | status | predicted GiB | measured peak GiB | tokens/s | wall s | why |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in trial_rows(result):
        tps = f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] else ""
        why = "; ".join(filter(None, (row["why"], f"rerun of #{row['confirms']}" if "confirms" in row else "")))
        lines.append(f"| {row['trial']} | {row['config']} | {row['status']} | {row['predicted_gib']:.2f} | "
                     f"{_gib(result.trials[row['trial']].peak_bytes)} | {tps} | {row['wall_s']} | {why.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def plot_trials(result: TuneResult, path: Path) -> bool:
    """Tokens/s per trial and predicted vs measured memory, as a PNG; False when matplotlib is missing."""
    try:  # NOTE: a Figure without pyplot: no backend switched under a notebook that plots too
        from matplotlib.figure import Figure
    except ImportError:
        return False
    ran = [t for t in result.trials if t.tokens_per_s]
    fig = Figure(figsize=(12, 4.5))
    left, right = fig.subplots(1, 2)
    left.barh([t.label + (" (confirm)" if t.confirms is not None else "") for t in ran],
              [t.tokens_per_s for t in ran], color=["tab:green" if t is result.best else "tab:blue" for t in ran])
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
    """out (the tuned recipe), out's stem + .trials.md / .trials.json / .trials.png; returns what was written."""
    stem = out.with_suffix("")
    written = []
    if result.best is not None:
        out.write_text(json.dumps(tuned_recipe(result, out), indent=2) + "\n")
        written.append(out)
    md, js, png = (Path(f"{stem}.trials.{ext}") for ext in ("md", "json", "png"))
    md.write_text(trial_table(result))
    js.write_text(json.dumps({"recipe": str(result.recipe_path), "device": result.device,
                              "world_size": result.world_size, "cap_bytes": result.cap_bytes,
                              "budget_s": result.budget_s, "elapsed_s": round(result.elapsed_s, 1),
                              "trials": trial_rows(result)}, indent=2) + "\n")
    written += [md, js]
    if plot_trials(result, png):
        written.append(png)
    return written
