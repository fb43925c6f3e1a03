"""zero.offload_update exact against delayed on a recipe (default: python-stdlib, real text, on the CPU): held-out
loss along the run and at the end, and the mean step time, with the optimizer offloaded to CPU memory.

    python -m benchmarks.offload_update [--steps N] [--stage S] [--warmup W] [--offload-ratio R] [--fork-at F]
                                        [recipe [key.path=value ...]]

--fork-at F: every mode but the first exact run resumes from that run's checkpoint at step F, so all of them share
the first F steps bit for bit. A recipe whose early descent varies from run to run (gpt2-124m on a GPU leaves its
initial plateau at a step the GPU's non-deterministic reductions decide) is then compared from one state, and an
"exact, resumed" run from the same checkpoint measures how far two exact runs drift apart after F: the noise floor
the delayed modes' gap is read against.

On a CPU-only machine the "device" is the CPU too, so the delayed update's thread competes with the forward and
backward for the same cores: the time column says what that costs or saves here; the GPU's figure is
benchmarks/RESULTS.md's (a GPU run of this script with training.device=cuda).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def run_variant(recipe: str, overrides: list[str], run_dir: Path) -> dict:
    """Train one variant in this process: its eval losses by step and its mean step time (logged windows)."""
    from toolkit.cli.main import main

    code = main(["run", recipe, "logging.console=false", *overrides, "--run-dir", str(run_dir)])
    assert code == 0, f"{recipe} {overrides}: exit {code}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    steps = [r for r in rows if "tokens_per_s" in r]
    timed = steps[1:] or steps  # the first window holds the start-up
    return {"eval": evals, "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed)}


def main(argv: list[str] | None = None) -> dict:
    """Run exact and delayed offload; print one line each: final held-out loss, its ratio to exact, tokens/s."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="python-stdlib")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every variant, e.g. batch.grad_accum_steps=2")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=None, help="zero.offload_update_warmup (default: the schema's)")
    parser.add_argument("--modes", nargs="+", default=["delayed"], choices=["delayed", "delayed_extrapolated"],
                        help="the delayed modes to run beside exact")
    parser.add_argument("--offload-ratio", type=float, default=1.0,
                        help="zero.offload_ratio: the first groups' part (1 - ratio) steps on the device, at once")
    parser.add_argument("--reduce-bucket-size", type=int, default=None,
                        help="zero.reduce_bucket_size (python-stdlib's 1.3M parameters fill one default bucket: "
                             "the ratio splits whole buckets, so give smaller ones, e.g. 100000)")
    parser.add_argument("--fork-at", type=int, default=None,
                        help="the step every other mode resumes from the exact run's checkpoint (adds 'exact, resumed')")
    args = parser.parse_args(argv)
    if args.fork_at is not None and not 0 < args.fork_at < args.steps:
        parser.error(f"--fork-at {args.fork_at}: give a step between 1 and --steps - 1 ({args.steps - 1})")
    common = [*args.overrides, f"training.max_steps={args.steps}", f"training.eval_interval={max(args.steps // 10, 1)}",
              f"zero.stage={args.stage}", "zero.offload_optimizer=cpu", "checkpoint.save_final=false",
              f"zero.offload_ratio={args.offload_ratio}"]
    common += [f"zero.reduce_bucket_size={args.reduce_bucket_size}"] if args.reduce_bucket_size else []
    warmup = [f"zero.offload_update_warmup={args.warmup}"] if args.warmup is not None else []
    variants = {"exact": ["zero.offload_update=exact"], **{m: [f"zero.offload_update={m}", *warmup] for m in args.modes}}
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        if args.fork_at is not None:  # exact saves at the fork; the others (and exact again) continue from there
            variants = {"exact": [*variants["exact"], f"checkpoint.interval={args.fork_at}"],
                        "exact, resumed": variants["exact"], **{m: v for m, v in variants.items() if m != "exact"}}
            fork = Path(folder) / "exact" / "checkpoints" / f"step-{args.fork_at:06d}"
        for name, overrides in variants.items():
            resume = [f"checkpoint.resume={fork}"] if args.fork_at is not None and name != "exact" else []
            results[name] = run_variant(args.recipe, [*common, *overrides, *resume],
                                        Path(folder) / name.replace(", ", "_"))
    base = results["exact"]
    for name, r in results.items():
        final = r["eval"][args.steps]
        print(f"{name:20s} eval loss {final:.4f} ({final / base['eval'][args.steps] - 1:+.2%} vs exact); "
              f"{r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x exact)")
    print("eval losses by step:", json.dumps({n: r["eval"] for n, r in results.items()}))
    return results


if __name__ == "__main__":
    main()
