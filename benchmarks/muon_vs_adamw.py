"""Muon against AdamW on a recipe (default: python-stdlib, real text, on the CPU): the optimizer steps each needs to
reach AdamW's final held-out loss, and the time per step, with the two engines stepping in turn (so a busy moment of
a shared machine falls on both alike).

    python -m benchmarks.muon_vs_adamw [--steps N] [--eval-every K] [--muon-lr LR] [recipe [key.path=value ...]]
"""
from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> dict:
    """Train both in turn; print steps to AdamW's final held-out loss and ms per step (median, fastest)."""
    import toolkit
    from toolkit.data.batches import BatchStream, Dataset, eval_batches

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="python-stdlib")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both optimizers, e.g. batch.grad_accum_steps=2")
    parser.add_argument("--steps", type=int, default=None, help="default: the recipe's training.max_steps")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--muon-lr", type=float, default=0.02)
    args = parser.parse_args(argv)
    steps = [f"training.max_steps={args.steps}"] if args.steps else []
    variants = {"adamw": ["optimizer.type=adamw"], "muon": ["optimizer.type=muon", f"optimizer.muon_lr={args.muon_lr}"]}
    recipes = {name: toolkit.load_recipe(args.recipe, [*args.overrides, *steps, *extra]) for name, extra in variants.items()}
    total = recipes["adamw"].training.max_steps
    engines = {name: toolkit.initialize(recipe) for name, recipe in recipes.items()}
    data = Dataset(recipes["adamw"].data)
    streams = {name: BatchStream(data.train, r.batch, rank=0, seed=r.training.seed) for name, r in recipes.items()}
    held_out = eval_batches(data.eval, recipes["adamw"].batch, rank=0, count=args.eval_batches)
    curves, seconds = {n: [] for n in engines}, {n: [] for n in engines}
    for step in range(1, total + 1):
        for name, engine in engines.items():
            batch = streams[name].next_step()
            start = time.perf_counter()
            engine.train_batch(batch).loss  # reading the loss waits for the step
            seconds[name].append(time.perf_counter() - start)
            if step % args.eval_every == 0 or step == total:
                curves[name].append((step, engine.evaluate(held_out)))  # mean held-out loss, dropout off
    target = curves["adamw"][-1][1]
    for name in engines:
        reached = next((s for s, loss in curves[name] if loss <= target), None)
        print(f"{name:5s} held-out {curves[name][-1][1]:.4f} at step {total}; reaches AdamW's final {target:.4f} at "
              f"step {reached}; ms per step median {1e3 * statistics.median(seconds[name]):.1f}, fastest "
              f"{1e3 * min(seconds[name]):.1f}")
    print("held-out losses by step:", {n: [(s, round(v, 4)) for s, v in c] for n, c in curves.items()})
    return {"curves": curves, "seconds": seconds}


if __name__ == "__main__":
    main()
