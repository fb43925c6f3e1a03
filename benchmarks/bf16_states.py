"""optimizer.state_dtype fp32 against bf16 on a recipe (default: quickstart, precision bf16, on the CPU): held-out
loss, optimizer bytes per parameter held, and bf16 with round-to-nearest writes instead of stochastic rounding
(the measurement that chose stochastic rounding: toolkit/runtime/low_precision_adamw.py).

    python -m benchmarks.bf16_states [--steps N] [--lr LR] [recipe]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

VARIANTS = {"fp32 states": [], "bf16 states, stochastic rounding": ["optimizer.state_dtype=bf16"],
            "bf16 states, round to nearest": ["optimizer.state_dtype=bf16"]}


@contextlib.contextmanager
def round_to_nearest(on: bool):
    """Swap the stochastic rounding for torch's round-to-nearest-even cast while `on`."""
    import toolkit.runtime.low_precision_adamw as low

    kept = low.stochastic_round_to_bf16
    if on:
        low.stochastic_round_to_bf16 = lambda x, generator=None: x.to(low.torch.bfloat16)
    try:
        yield
    finally:
        low.stochastic_round_to_bf16 = kept


def run_variant(recipe: str, overrides: list[str], nearest: bool, run_dir: Path) -> dict:
    """Train one variant in this process; its eval losses by step and the last logged optimizer bytes."""
    from toolkit.cli.main import main

    with round_to_nearest(nearest):
        code = main(["run", recipe, "precision.dtype=bf16", "logging.console=false", *overrides,
                     "--run-dir", str(run_dir)])
    assert code == 0, f"{recipe} {overrides}: exit {code}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    last = [r for r in rows if "mem_optim_bytes" in r][-1]
    return {"eval": evals, "optim_bytes": last["mem_optim_bytes"], "param_bytes": last["mem_params_bytes"]}


def main(argv: list[str] | None = None) -> dict:
    """Run the three variants and print one line each: final held-out loss, its ratio to fp32 states, bytes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="quickstart")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=None, help="optimizer.lr (default: the recipe's)")
    args = parser.parse_args(argv)
    common = [f"training.max_steps={args.steps}", f"training.eval_interval={max(args.steps // 10, 1)}"]
    common += [f"optimizer.lr={args.lr}"] if args.lr is not None else []
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for i, (name, overrides) in enumerate(VARIANTS.items()):
            results[name] = run_variant(args.recipe, [*common, *overrides], "nearest" in name, Path(folder) / str(i))
    base = results["fp32 states"]["eval"][args.steps]
    for name, r in results.items():
        final = r["eval"][args.steps]
        print(f"{name:34s} eval loss {final:.4f} ({final / base - 1:+.2%} vs fp32 states); optimizer "
              f"{r['optim_bytes']:,} B, weights {r['param_bytes']:,} B")
    return results


if __name__ == "__main__":
    main()
