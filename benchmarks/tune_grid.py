"""Measure every point of `toolkit tune`'s search space for a recipe, once, to know the best the tuner could find.

Issue 31 holds the tuner to "at least 97% of the best of the full grid". This runs each candidate the tuner would
consider (toolkit/train/tune.py `candidates`, the recipe as written first) the way the tuner runs a trial: a fresh
`toolkit run` process, warm-up steps, measured steps, tokens/s read back from metrics.jsonl. Nothing is skipped by
the throughput model; only what the memory model prunes (beyond the cap plus PRUNE_MARGIN, as the tuner does) and
what the axes leave out (--micros, --offloads) or --skip names is not run. Rows are written as each ends, so a call
cut short keeps them:

    python -m benchmarks.tune_grid gpt2-124m --offloads none --micros 4,8,16,32,64 --out grid.jsonl --md grid.md

A grid measured over several calls: `--missing FILE` runs only the points FILE has no measurement of (the recipe as
written runs anyway, to compare the hosts), `--merge FILE NEW` folds a call's rows into FILE, and `--report FILE...`
holds every measured peak against today's memory model (the figures benchmarks/RESULTS.md quotes).
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


MEASURED = ("ok", "failed")  # a point that ran: its speed, or its failure (out of memory) is the measurement


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def grid(recipe_name: str, space: TuneSpace, *, warmup: int, measure: int, deadline: float, out: Path | None,
         log=print, skip: str | None = None, done: set[str] = frozenset()) -> list[dict]:
    """Every point's row (changes, predicted bytes, status, tokens/s, peak, wall), the recipe as written first.
    `skip`: a regular expression; the candidates whose label it finds are listed as not run (a call's time).
    `done`: labels measured before (--missing), listed as not run."""
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
        elif i and trial.label in done:
            trial.status, trial.why = "not run", "measured before (--missing)"
        elif time.monotonic() > deadline:
            trial.status, trial.why = "not run", "past the deadline"
        else:
            trial = run_trial(path, trial, world_size=1, warmup=warmup, measure=measure,
                              timeout=max(30.0, deadline - time.monotonic()), tokens_per_step=tokens_per_step)
        row = {"recipe": recipe_name, "label": trial.label, "baseline": trial.baseline, "changes": changes,
               "predicted_bytes": predicted, "status": trial.status, "tokens_per_s": trial.tokens_per_s,
               "peak_bytes": trial.peak_bytes, "reserved_bytes": trial.reserved_bytes, "wall_s": round(trial.wall_s, 1),
               "why": trial.why}
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


def merge(rows: list[dict], new: list[dict]) -> list[dict]:
    """`rows` with each point `new` measured and `rows` did not put in its place (new points appended); a point both
    measured keeps `rows`' figure (the recipe as written, rerun on each call to compare hosts, keeps the first)."""
    merged = {r["label"]: r for r in rows}
    for r in new:
        if r["status"] in MEASURED and merged.get(r["label"], {}).get("status") not in MEASURED:
            merged[r["label"]] = r
    return list(merged.values())


def report(paths: list[Path]) -> str:
    """Each measured peak against today's memory model: the range of predicted / measured, and the widest rows."""
    from toolkit.observe.peak import CALIBRATION_TOLERANCE, predict_peak
    from toolkit.recipe.load import load_recipe
    from toolkit.train.tune_space import override_args

    ratios = []
    for path in paths:
        for r in read_rows(path):
            if r["status"] == "ok" and r.get("peak_bytes"):
                recipe = load_recipe(r["recipe"], override_args(None if r["baseline"] else r["changes"]))
                predicted = predict_peak(recipe, on_cuda=True).allocated
                ratios.append((predicted / r["peak_bytes"], path.stem, r["label"], predicted, r["peak_bytes"]))
    if not ratios:
        return "no measured peak"
    ratios.sort()
    outside = [x for x in ratios if abs(x[0] - 1) > CALIBRATION_TOLERANCE]
    lines = [f"{len(ratios)} measured peaks, predicted / measured {ratios[0][0]:.3f}-{ratios[-1][0]:.3f}; "
             f"{len(outside)} outside +-{CALIBRATION_TOLERANCE:.0%}", "",
             "| grid | point | predicted GiB | measured GiB | predicted / measured |", "| --- | --- | --- | --- | --- |"]
    for ratio, grid_name, label, predicted, peak in ratios[:3] + ratios[-3:] if len(ratios) > 6 else ratios:
        lines.append(f"| {grid_name} | {label} | {predicted / 2**30:.1f} | {peak / 2**30:.1f} | {ratio:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipes", nargs="*")
    parser.add_argument("--micros", default="", help="comma-separated micro batches (default: the tuner's)")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--offloads", default="none,cpu,cpu@0.5")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--measure", type=int, default=5)
    parser.add_argument("--skip", help="leave out the candidates whose label this regular expression finds")
    parser.add_argument("--seconds", type=float, default=3600.0, help="no point starts after this many seconds")
    parser.add_argument("--out", type=Path, help="rows as JSON lines, appended as each ends")
    parser.add_argument("--md", type=Path, help="the tables, one per recipe")
    parser.add_argument("--missing", type=Path, help="run only the points this grid file has no measurement of")
    parser.add_argument("--merge", nargs=2, type=Path, metavar=("FILE", "NEW"), help="fold NEW's rows into FILE")
    parser.add_argument("--report", nargs="+", type=Path, metavar="FILE", help="measured peaks against the model")
    args = parser.parse_args(argv)
    if args.merge:
        path, new = args.merge
        path.write_text("".join(json.dumps(r) + "\n" for r in merge(read_rows(path), read_rows(new))))
        return 0
    if args.report:
        print(report(args.report))
        return 0
    if not args.recipes:
        parser.error("name a recipe (or --merge / --report)")
    done = {r["label"] for r in read_rows(args.missing) if r["status"] in MEASURED} if args.missing else set()
    space = TuneSpace(stages=tuple(int(s) for s in args.stages.split(",")),
                      micro_batches=tuple(int(m) for m in args.micros.split(",")) if args.micros else None,
                      offloads=tuple(args.offloads.split(",")))
    deadline = time.monotonic() + args.seconds
    tables = []
    for name in args.recipes:
        rows = grid(name, space, warmup=args.warmup, measure=args.measure, deadline=deadline, out=args.out,
                    log=lambda s: print(s, flush=True), skip=args.skip, done=done)
        tables.append(f"### {name}\n\n{table(rows)}\n")
        print(tables[-1], flush=True)
    if args.md:
        args.md.write_text("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
