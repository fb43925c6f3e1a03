"""The `toolkit tune` command: the fastest variant of a recipe that fits, never slower than the recipe.
Thin: parse, call toolkit/train/tune.py, print."""
from __future__ import annotations

import sys
from pathlib import Path

from toolkit.errors import UserError


def _cmd_tune(args) -> int:
    from toolkit.train.tune import TuneSpace, tune
    from toolkit.train.tune_report import decision_text, write_outputs

    if args.budget_minutes <= 0 or args.world_size < 1 or args.ab_pairs < 1:
        raise UserError("--budget-minutes must be positive, --world-size and --ab-pairs at least 1")
    space = TuneSpace(stages=_ints(args.stages, "--stages"), micro_batches=_ints(args.micro, "--micro"))
    out = Path(args.out or f"{Path(args.recipe).stem}.tuned.json")
    result = tune(args.recipe, budget_s=60 * args.budget_minutes, world_size=args.world_size, space=space,
                  cap_bytes=int(args.memory_gib * 2**30) if args.memory_gib else None, ab_pairs=args.ab_pairs,
                  log=lambda line: print(line, file=sys.stderr, flush=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    written = write_outputs(result, out)
    print(next(p for p in written if p.name.endswith(".trials.md")).read_text(), end="")
    print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
    print(f"tune: {decision_text(result, out)}", file=sys.stderr)
    return 0 if result.decision is not None else 1


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text}: expected integers separated by commas, e.g. 1,2,3") from None


def add_parser(sub) -> None:
    """The tune sub-command on `toolkit`'s parser."""
    p = sub.add_parser("tune", help="the fastest variant of a recipe that fits, never slower than the recipe: the "
                                    "recipe first, short timed trials, then an A/B/A/B re-measurement")
    p.add_argument("recipe", help="recipe file, or the name of a shipped recipe")
    p.add_argument("--budget-minutes", type=float, default=15, help="stop starting trials after this (default 15)")
    p.add_argument("--out", default=None, metavar="FILE", help="tuned recipe (default RECIPE.tuned.json; written only "
                                                               "when faster than RECIPE); the trial table goes beside "
                                                               "it as FILE.trials.md/.json/.png")
    p.add_argument("--world-size", type=int, default=1, help="ranks per trial (toolkit run --nproc; default 1)")
    p.add_argument("--stages", default=None, help="ZeRO stages to try, e.g. 1,2 (default 0,1,2,3)")
    p.add_argument("--micro", default=None, help="micro batches to try, e.g. 8,16 (default powers of 2 dividing "
                                                 "the global batch)")
    p.add_argument("--ab-pairs", type=int, default=2, help="A/B pairs that re-measure the best candidate against "
                                                           "the recipe as written before deciding (default 2)")
    p.add_argument("--memory-gib", type=float, default=None, help="memory cap per rank (default 90%% of the "
                                                                  "GPU's free memory, or of the host's RAM)")
    p.set_defaults(func=_cmd_tune)
