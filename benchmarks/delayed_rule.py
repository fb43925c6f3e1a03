"""The delayed offload update (zero.offload_update delayed) against its rule written out by hand, and against exact
offload, on any recipe and device: is a gap between delayed and exact the rule's own, or the implementation's?

    python -m benchmarks.delayed_rule [--steps N] [--warmup W] [--eval-every K] [recipe [key.path=value ...]]

"rule": an exact engine (ZeRO stage 1, optimizer in CPU memory) whose forward and backward are given the weights one
update old after the warm-up (the rule of tests/runtime/zero_helpers.py `delayed_reference`, at any size, in the
same numerics as the other two); "delayed" and "exact": the same engine in those modes. The three step in turn on
the same batches. Printed: the held-out loss of each
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
    variants = {"rule": [*offload, "zero.offload_update=exact"],
                "delayed": [*offload, "zero.offload_update=delayed"],
                "exact": [*offload, "zero.offload_update=exact"]}
    recipes = {name: toolkit.load_recipe(args.recipe, [*common, *extra]) for name, extra in variants.items()}
    engines = {name: toolkit.initialize(recipe) for name, recipe in recipes.items()}
    data = Dataset(recipes["rule"].data)
    streams = {name: BatchStream(data.train, r.batch, rank=0, seed=r.training.seed) for name, r in recipes.items()}
    steps = args.steps or recipes["rule"].training.max_steps
    held_out = eval_batches(data.eval, recipes["rule"].batch, rank=0, count=args.eval_batches)

    # The rule on an exact engine of the same numerics: its step writes every weight from the CPU master, so the
    # weights the forward sees can be set between steps without touching the master
    params = dict(engines["rule"].model.named_parameters())

    def snapshot() -> dict:
        return {n: p.detach().clone() for n, p in params.items()}

    def put(weights: dict) -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[n])

    losses = {name: [] for name in engines}
    curves = {name: [] for name in engines}
    newest = snapshot()
    for t in range(1, steps + 1):
        for name, engine in engines.items():
            losses[name].append(engine.train_batch(streams[name].next_step()).loss)
        previous, newest = newest, snapshot()  # the weights of M_{t-1} and M_t
        if t > args.warmup:  # the next forward sees the weights before this update
            put(previous)
        if t % args.eval_every == 0 or t == steps:
            put(newest)  # evaluation lands the update in flight: the next step's forward sees it too
            for name, engine in engines.items():
                curves[name].append((t, engine.evaluate(held_out)))
            print(f"step {t}: held-out " + ", ".join(f"{n} {c[-1][1]:.4f}" for n, c in curves.items()), flush=True)
    gaps = [abs(a / b - 1) for a, b in zip(losses["delayed"], losses["rule"])]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    print(f"training loss, delayed against the rule: largest relative gap {gaps[worst]:.2e} at step {worst + 1}; "
          f"at the last step {gaps[-1]:.2e}")
    print("training losses:", {n: [round(v, 4) for v in ls] for n, ls in losses.items()})
    return {"curves": curves, "losses": losses}


if __name__ == "__main__":
    main()
