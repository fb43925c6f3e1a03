"""The delayed offload update (zero.offload_update delayed) against its rule written out by hand, and against exact
offload, on any recipe and device: is a gap between delayed and exact the rule's own, or the implementation's?

    python -m benchmarks.delayed_rule [--steps N] [--warmup W] [--eval-every K] [--delayed-only REGEX]
                                      [--fresh-top F [--fresh-dim D]] [--engines rule,delayed,exact]
                                      [recipe [key.path=value ...]]

"rule": an exact engine (ZeRO stage 1, optimizer in CPU memory) whose forward and backward are given the weights one
update old after the warm-up (the rule of tests/runtime/zero_helpers.py `delayed_reference`, at any size, in the
same numerics as the other two); "delayed" and "exact": the same engine in those modes. The three step in turn on
the same batches. Printed: the held-out loss of each
every K steps (an evaluation lands the update in flight, in the rule as in the engine), and the largest
relative gap between the rule's and delayed's training losses.

--delayed-only REGEX: the rule delays only the parameters whose names match (re.search); the others see the newest
weights, as if their optimizer stepped on the device at once (which parameters must not be stale?). The "delayed"
engine delays all of them, so leave it out then (--engines rule,exact).

--fresh-top F: a split chosen by gradient, as ZenFlow (DeepSpeed, 2025) chooses it: at every step, in each matrix
the rule delays, the fraction F of its slices along --fresh-dim (default 1) with the largest gradient norms in this
step see the newest weights (as if those columns were stepped on the device at once); the other slices see the
weights one update old (--fresh-by random: as many slices drawn at random, the control). Tensors of one dimension
(biases, norms) are not delayed then: they are small enough to stay on the device. Which directions must not be
stale: the sharp ones, and does the gradient find them?
"""
from __future__ import annotations

import argparse
import re

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
    parser.add_argument("--delayed-only", default=None, help="the rule delays only the parameters matching this")
    parser.add_argument("--fresh-top", type=float, default=0.0,
                        help="per delayed matrix, this fraction of its slices with the largest gradients stays fresh")
    parser.add_argument("--fresh-dim", type=int, default=1, help="the slices --fresh-top chooses among")
    parser.add_argument("--fresh-by", choices=("grad", "random"), default="grad",
                        help="random: as many slices drawn at random each step (the control)")
    parser.add_argument("--engines", default="rule,delayed,exact", help="which of the three to run")
    args = parser.parse_args(argv)
    common = [*args.overrides, "checkpoint.save_final=false"]
    offload = ["zero.stage=1", "zero.offload_optimizer=cpu", f"zero.offload_update_warmup={args.warmup}"]
    variants = {"rule": [*offload, "zero.offload_update=exact"],
                "delayed": [*offload, "zero.offload_update=delayed"],
                "exact": [*offload, "zero.offload_update=exact"]}
    variants = {name: extra for name, extra in variants.items() if name in args.engines.split(",")}
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

    stale = {n for n in params if args.delayed_only is None or re.search(args.delayed_only, n)}
    if args.fresh_top:
        stale = {n for n in stale if params[n].dim() > 1}
    grads = {n: torch.zeros_like(params[n]) for n in stale} if args.fresh_top else {}
    draw = torch.Generator().manual_seed(0)
    for n in grads:  # this step's gradient, summed over its micro-steps: what the split is chosen by
        params[n].register_hook(lambda g, n=n: grads[n].add_(g.detach()))
    print(f"the rule delays {sum(params[n].numel() for n in stale):,} of "
          f"{sum(p.numel() for p in params.values()):,} parameters ({len(stale)} of {len(params)} tensors)")

    def put(weights: dict, names=params) -> None:
        with torch.no_grad():
            for n in names:
                params[n].copy_(weights[n])

    def put_split(previous: dict, newest: dict) -> None:
        """The stale weights, but the fraction --fresh-top of each matrix's slices with the largest gradients."""
        with torch.no_grad():
            for n in stale:
                axis = args.fresh_dim % grads[n].dim()
                norms = grads[n].square().sum(dim=[d for d in range(grads[n].dim()) if d != axis])
                if args.fresh_by == "random":
                    norms = torch.rand(norms.shape, generator=draw)
                fresh = torch.zeros_like(norms, dtype=torch.bool)
                fresh[norms.topk(max(1, round(args.fresh_top * norms.numel()))).indices] = True
                shape = [-1 if d == axis else 1 for d in range(grads[n].dim())]
                params[n].copy_(torch.where(fresh.view(shape), newest[n], previous[n]))

    losses = {name: [] for name in engines}
    curves = {name: [] for name in engines}
    newest = snapshot()
    for t in range(1, steps + 1):
        for name, engine in engines.items():
            losses[name].append(engine.train_batch(streams[name].next_step()).loss)
        previous, newest = newest, snapshot()  # the weights of M_{t-1} and M_t
        if t > args.warmup and args.fresh_top:
            put_split(previous, newest)
        elif t > args.warmup:  # the next forward sees the weights before this update
            put(previous, stale)
        for g in grads.values():
            g.zero_()
        if t % args.eval_every == 0 or t == steps:
            put(newest)  # evaluation lands the update in flight: the next step's forward sees it too
            for name, engine in engines.items():
                curves[name].append((t, engine.evaluate(held_out)))
            print(f"step {t}: held-out " + ", ".join(f"{n} {c[-1][1]:.4f}" for n, c in curves.items()), flush=True)
    if "delayed" in losses:
        gaps = [abs(a / b - 1) for a, b in zip(losses["delayed"], losses["rule"])]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        print(f"training loss, delayed against the rule: largest relative gap {gaps[worst]:.2e} at step "
              f"{worst + 1}; at the last step {gaps[-1]:.2e}")
    if "exact" in curves:
        print("held-out at the end against exact: " + ", ".join(
            f"{n} {c[-1][1] / curves['exact'][-1][1] - 1:+.2%}" for n, c in curves.items() if n != "exact"))
    print("training losses:", {n: [round(v, 4) for v in ls] for n, ls in losses.items()})
    return {"curves": curves, "losses": losses}


if __name__ == "__main__":
    main()
