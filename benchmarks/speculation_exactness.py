"""Is the overlapped offload step with clipping (zero.offload_update overlapped, speculation.py) exact mode's run on
this machine? Tutorial 18's clipped experiment, each run's losses and norms printed in full:

    exact, exact again   the machine's run-to-run noise (0 where the kernels are deterministic)
    overlapped           speculating on the clip coefficient (rolled back where a step clips)
    overlapped, waiting  the arena left empty (SPECULATED_SHARE 0): every piece waits for the coefficient

    PYTHONPATH=. python -m benchmarks.speculation_exactness [--device cuda] [--steps 12] [recipe overrides ...]

A difference that the second exact run does not show, in the speculating run only, is the speculation's; in both
overlapped runs, the clip's ordering against the thread's gradient copies.
"""
from __future__ import annotations

import argparse
import statistics

import toolkit
import toolkit.runtime.zero.speculation as speculation_module
from toolkit.data.batches import BatchStream, Dataset


def run(overrides: list[str], steps: int):
    recipe = toolkit.load_recipe("quickstart", overrides)
    engine = toolkit.initialize(recipe)
    stream = BatchStream(Dataset(recipe.data).train, recipe.batch, rank=0, seed=recipe.training.seed)
    results = [engine.train_batch(stream.next_step()) for _ in range(steps)]
    part = engine.strategy.parts[-1]
    speculation = part.overlapped.speculation if part.overlapped is not None else None
    return [r.loss for r in results], [r.grad_norm for r in results], list(speculation.outcomes) if speculation else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.device == "cuda":  # tutorial 18's GPU variant
        model = ["training.device=cuda", "precision.dtype=bf16", "model.size=124m", "data.seq_len=1024",
                 "batch.micro_batch_per_rank=8", "zero.reduce_bucket_size=20000000"]
    else:
        model = ["training.device=cpu", "model.n_layer=2", "model.n_embd=384", "model.n_head=6", "data.seq_len=32",
                 "batch.micro_batch_per_rank=2", "zero.reduce_bucket_size=500000"]
    base = [*model, "zero.stage=1", "zero.offload_optimizer=cpu", "checkpoint.save_final=false", *args.overrides]
    _, norms, _ = run([*base, "training.grad_clip=0"], args.steps)
    max_norm = statistics.median(norms)
    clipped = [*base, f"training.grad_clip={max_norm}"]
    print(f"max_norm {max_norm!r} (the median of an unclipped run's {args.steps} norms)")
    runs = {"exact": run([*clipped, "zero.offload_update=exact"], args.steps),
            "exact again": run([*clipped, "zero.offload_update=exact"], args.steps),
            "overlapped": run([*clipped, "zero.offload_update=overlapped"], args.steps)}
    speculation_module.SPECULATED_SHARE = 0.0
    runs["overlapped, waiting"] = run([*clipped, "zero.offload_update=overlapped"], args.steps)
    reference = runs["exact"][0]
    for name, (losses, norms, outcomes) in runs.items():
        first = next((t for t, (a, b) in enumerate(zip(losses, reference)) if a != b), None)
        worst = max(abs(a / b - 1) for a, b in zip(losses, reference))
        print(f"\n{name}: first step off exact's {first}, largest relative difference {worst:.3e}")
        print("  losses:", " ".join(repr(x) for x in losses))
        print("  norms: ", " ".join(f"{x:.6f}" for x in norms))
        if outcomes:
            print("  guesses:", ", ".join(outcomes))


if __name__ == "__main__":
    main()
