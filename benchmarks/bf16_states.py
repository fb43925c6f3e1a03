"""optimizer.state_dtype fp32 against bf16 and int8 on a recipe (default: quickstart, precision bf16, on the CPU):
held-out loss and optimizer bytes per parameter held; and two variants that chose the built ones: bf16 with
round-to-nearest writes instead of stochastic rounding (toolkit/runtime/low_precision_adamw.py), and int8 moments
with the square root of exp_avg_sq quantized instead of exp_avg_sq itself (toolkit/runtime/int8_moments.py).

    python -m benchmarks.bf16_states [--steps N] [--lr LR] [recipe]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

BF16, INT8 = ["optimizer.state_dtype=bf16"], ["optimizer.state_dtype=int8"]
OFFLOAD = ["zero.stage=1", "zero.offload_optimizer=cpu"]  # the CPU Adam kernel's bf16 step (kernels/cpu_adam.cpp)
VARIANTS = {"fp32 states": [], "bf16 states, stochastic rounding": BF16, "bf16 states, round to nearest": BF16,
            "int8 moments": INT8, "int8 moments, sqrt(exp_avg_sq)": INT8,
            "bf16 states offloaded to CPU memory": [*BF16, *OFFLOAD],
            # zero.grad_dtype: the same stage-2 run with an fp32 and a bf16 gradient shard, 2 micro-steps a step so the
            # shard's sum rounds as well as its clipped values
            "bf16 states, stage 2, 2 micro-steps": [*BF16, "zero.stage=2", "batch.grad_accum_steps=2"],
            "bf16 states, stage 2, 2 micro-steps, bf16 gradient shard": [*BF16, "zero.stage=2",
                                                                         "batch.grad_accum_steps=2",
                                                                         "zero.grad_dtype=bf16"]}


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


@contextlib.contextmanager
def second_moment_as_sqrt(on: bool):
    """While `on`, int8 moments hold sqrt(exp_avg_sq) in the unsigned map (squared again when read)."""
    from toolkit.runtime.int8_moments import BlockwiseMoments

    read, write = BlockwiseMoments.read, BlockwiseMoments.write
    if on:
        BlockwiseMoments.read = lambda self, start, stop: (lambda m, v: (m, v * v))(*read(self, start, stop))
        BlockwiseMoments.write = lambda self, start, m, v: write(self, start, m, v.sqrt())
    try:
        yield
    finally:
        BlockwiseMoments.read, BlockwiseMoments.write = read, write


def run_variant(recipe: str, overrides: list[str], name: str, run_dir: Path) -> dict:
    """Train one variant in this process; its eval losses by step and the last logged optimizer bytes."""
    from toolkit.cli.main import main

    with round_to_nearest("nearest" in name), second_moment_as_sqrt("sqrt" in name):
        code = main(["run", recipe, "precision.dtype=bf16", "logging.console=false", *overrides,
                     "--run-dir", str(run_dir)])
    assert code == 0, f"{recipe} {overrides}: exit {code}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    last = [r for r in rows if "mem_optim_bytes" in r][-1]
    # NOTE: offloaded states are counted in CPU memory (mem_offload_bytes: the master as well as the moments)
    return {"eval": evals, "optim_bytes": last["mem_optim_bytes"] + last.get("mem_offload_bytes", 0),
            "param_bytes": last["mem_params_bytes"]}


def main(argv: list[str] | None = None) -> dict:
    """Run the variants and print one line each: final held-out loss, its ratio to fp32 states, bytes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="quickstart")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=None, help="optimizer.lr (default: the recipe's)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="which to run (fp32 states always runs: the others are compared with it)")
    args = parser.parse_args(argv)
    common = [f"training.max_steps={args.steps}", f"training.eval_interval={max(args.steps // 10, 1)}"]
    common += [f"optimizer.lr={args.lr}"] if args.lr is not None else []
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        chosen = ["fp32 states", *(v for v in args.variants if v != "fp32 states")]
        for i, (name, overrides) in enumerate((v, VARIANTS[v]) for v in chosen):
            results[name] = run_variant(args.recipe, [*common, *overrides], name, Path(folder) / str(i))
    base = results["fp32 states"]["eval"][args.steps]
    for name, r in results.items():
        final = r["eval"][args.steps]
        print(f"{name:34s} eval loss {final:.4f} ({final / base - 1:+.2%} vs fp32 states); optimizer "
              f"{r['optim_bytes']:,} B, weights {r['param_bytes']:,} B")
    return results


if __name__ == "__main__":
    main()
