"""The delayed offload update (zero.offload_update delayed) against its rule written out by hand, and against exact
offload, on any recipe and device: is a gap between delayed and exact the rule's own, or the implementation's?

    python -m benchmarks.delayed_rule [--steps N] [--warmup W] [--eval-every K] [recipe [key.path=value ...]]

"rule": a stage-0 engine whose forward and backward see the weights one update old after the warm-up (the rule of
tests/runtime/zero_helpers.py `delayed_reference`, at any size); "delayed" and "exact": the engine at ZeRO stage 1
with the optimizer in CPU memory. The three step in turn on the same batches. Printed: the held-out loss of each
every K steps (an evaluation lands the update in flight, in the rule as in the engine), and the largest
relative gap between the rule's and delayed's training losses.
"""
from __future__ import annotations

import argparse

import torch


def main(argv: list[str] | None = None) -> dict:
    import toolkit
    from toolkit.data.batches import BatchStream, Dataset, eval_batches

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="quickstart")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for all three, e.g. batch.grad_accum_steps=2")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps to train (default: training.max_steps, which also sets the schedule's length)")
    parser.add_argument("--warmup", type=int, default=20, help="zero.offload_update_warmup")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=4)
    args = parser.parse_args(argv)
    common = [*args.overrides, "checkpoint.save_final=false"]
    offload = ["zero.stage=1", "zero.offload_optimizer=cpu", f"zero.offload_update_warmup={args.warmup}"]
    variants = {"rule": ["zero.stage=0", "zero.offload_optimizer=none"],
                "delayed": [*offload, "zero.offload_update=delayed"],
                "exact": [*offload, "zero.offload_update=exact"]}
    recipes = {name: toolkit.load_recipe(args.recipe, [*common, *extra]) for name, extra in variants.items()}
    engines = {name: toolkit.initialize(recipe) for name, recipe in recipes.items()}
    data = Dataset(recipes["rule"].data)
    streams = {name: BatchStream(data.train, r.batch, rank=0, seed=r.training.seed) for name, r in recipes.items()}
    steps = args.steps or recipes["rule"].training.max_steps
    held_out = eval_batches(data.eval, recipes["rule"].batch, rank=0, count=args.eval_batches)

    rule = engines["rule"]
    params = dict(rule.model.named_parameters())
    master = {n: p.detach().clone() for n, p in params.items()}

    def put(weights: dict) -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[n])

    losses = {name: [] for name in engines}
    curves = {name: [] for name in engines}
    for t in range(1, steps + 1):
        for batch in streams["rule"].next_step():  # gradients at the weights the model holds
            rule.backward(rule(batch))
        put(master)  # the optimizer steps the master
        losses["rule"].append(rule.step().loss)
        stepped = {n: p.detach().clone() for n, p in params.items()}
        if t > args.warmup:  # the next forward sees the master before this update
            put(master)
        master = stepped
        for name in ("delayed", "exact"):
            losses[name].append(engines[name].train_batch(streams[name].next_step()).loss)
        if t % args.eval_every == 0 or t == steps:
            put(master)  # evaluation lands the update in flight: the next step's forward sees it too
            curves["rule"].append((t, rule.evaluate(held_out)))
            for name in ("delayed", "exact"):
                curves[name].append((t, engines[name].evaluate(held_out)))
            print(f"step {t}: held-out " + ", ".join(f"{n} {c[-1][1]:.4f}" for n, c in curves.items()), flush=True)
    gaps = [abs(a / b - 1) for a, b in zip(losses["delayed"], losses["rule"])]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    print(f"training loss, delayed against the rule: largest relative gap {gaps[worst]:.2e} at step {worst + 1}; "
          f"at the last step {gaps[-1]:.2e}")
    print("training losses:", {n: [round(v, 4) for v in ls] for n, ls in losses.items()})
    return {"curves": curves, "losses": losses}


if __name__ == "__main__":
    main()
