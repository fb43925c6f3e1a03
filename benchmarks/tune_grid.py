"""Measure every point of `toolkit tune`'s search space for a recipe, once, to know the best the tuner could find.

Issue 31 holds the tuner to "at least 97% of the best of the full grid". This runs each candidate the tuner would
consider (toolkit/train/tune.py `candidates`, the recipe as written first) the way the tuner runs a trial: a fresh
`toolkit run` process, warm-up steps, measured steps, tokens/s read back from metrics.jsonl. Nothing is skipped by
the throughput model; only what the memory model prunes (beyond the cap plus PRUNE_MARGIN, as the tuner does) and
what the axes leave out (--micros, --offloads) or --skip names is not run. Rows are written as each ends, so a call
cut short keeps them:

    python -m benchmarks.tune_grid gpt2-124m --offloads none --micros 4,8,16,32,64 --out grid.jsonl --md grid.md
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from toolkit.observe.estimate import format_bytes
from toolkit.recipe.load import find_recipe_file, load_recipe
from toolkit.train.tune import PRUNE_MARGIN, build_kernels, candidates, memory_cap, predict, run_trial
from toolkit.train.tune_space import Trial, TuneSpace, original_changes


def grid(recipe_name: str, space: TuneSpace, *, warmup: int, measure: int, deadline: float, out: Path | None,
         log=print, skip: str | None = None) -> list[dict]:
    """Every point's row (changes, predicted bytes, status, tokens/s, peak, wall), the recipe as written first.
    `skip`: a regular expression; the candidates whose label it finds are listed as not run (a call's time)."""
    from toolkit.runtime.engine import pick_device

    path = find_recipe_file(recipe_name)
    recipe = load_recipe(path)
    on_cuda = pick_device(recipe.training.device).type == "cuda"  # as tune() decides it
    cap, _ = memory_cap(on_cuda)
    tokens_per_step = recipe.batch.global_batch * recipe.data.seq_len
    if on_cuda:
        log(f"kernels ready in {build_kernels():.0f} s")
    points = [original_changes(recipe), *candidates(recipe, space, 1, on_cuda=on_cuda)]
    rows = []
    for i, changes in enumerate(points):
        predicted, error = predict(path, changes, 1, on_cuda)
        trial = Trial(changes, predicted_bytes=predicted, baseline=i == 0)
        if error or (i and predicted > cap * (1 + PRUNE_MARGIN)):
            trial.status, trial.why = "pruned", error or f"predicted {format_bytes(predicted)} over the cap"
        elif i and skip and re.search(skip, trial.label):
            trial.status, trial.why = "not run", f"left out (--skip {skip})"
        elif time.monotonic() > deadline:
            trial.status, trial.why = "not run", "past the deadline"
        else:
            trial = run_trial(path, trial, world_size=1, warmup=warmup, measure=measure,
                              timeout=max(30.0, deadline - time.monotonic()), tokens_per_step=tokens_per_step)
        row = {"recipe": recipe_name, "label": trial.label, "baseline": trial.baseline, "changes": changes,
               "predicted_bytes": predicted, "status": trial.status, "tokens_per_s": trial.tokens_per_s,
               "peak_bytes": trial.peak_bytes, "wall_s": round(trial.wall_s, 1), "why": trial.why}
        rows.append(row)
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        log(f"{recipe_name} #{i} {trial.label}: {trial.status}"
            + (f" {trial.tokens_per_s:,.0f} tokens/s" if trial.tokens_per_s else f" ({trial.why})"))
    return rows


def table(rows: list[dict]) -> str:
    """The measured points fastest first, each as a fraction of the best; the baseline marked."""
    ran = sorted((r for r in rows if r["tokens_per_s"]), key=lambda r: -r["tokens_per_s"])
    if not ran:
        return "no point ran"
    best = ran[0]["tokens_per_s"]
    lines = ["| point | tokens/s | of the best | peak GiB | predicted GiB |", "| --- | --- | --- | --- | --- |"]
    for r in ran:
        name = ("**baseline** " if r["baseline"] else "") + r["label"]
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / best:.3f} | "
                     f"{(r['peak_bytes'] or 0) / 2**30:.1f} | {r['predicted_bytes'] / 2**30:.1f} |")
    others = [r for r in rows if not r["tokens_per_s"]]
    lines.append(f"\n{len(ran)} points ran; not measured: " + (", ".join(f"{r['label']} ({r['status']}: {r['why']})"
                                                                       for r in others) or "none"))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--micros", default="", help="comma-separated micro batches (default: the tuner's)")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--offloads", default="none,cpu,cpu@0.5")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--measure", type=int, default=5)
    parser.add_argument("--skip", help="leave out the candidates whose label this regular expression finds")
    parser.add_argument("--seconds", type=float, default=3600.0, help="no point starts after this many seconds")
    parser.add_argument("--out", type=Path, help="rows as JSON lines, appended as each ends")
    parser.add_argument("--md", type=Path, help="the tables, one per recipe")
    args = parser.parse_args(argv)
    space = TuneSpace(stages=tuple(int(s) for s in args.stages.split(",")),
                      micro_batches=tuple(int(m) for m in args.micros.split(",")) if args.micros else None,
                      offloads=tuple(args.offloads.split(",")))
    deadline = time.monotonic() + args.seconds
    tables = []
    for name in args.recipes:
        rows = grid(name, space, warmup=args.warmup, measure=args.measure, deadline=deadline, out=args.out,
                    log=lambda s: print(s, flush=True), skip=args.skip)
        tables.append(f"### {name}\n\n{table(rows)}\n")
        print(tables[-1], flush=True)
    if args.md:
        args.md.write_text("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
