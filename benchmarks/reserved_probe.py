"""Where the CUDA allocator's reserved bytes grow during a recipe's first steps (issue 31: the reserved peak).

Builds the recipe's engine in this process and runs a few optimizer steps micro-step by micro-step, printing after
each micro-step and each optimizer step the allocated and reserved bytes and their peaks since the last line; then
the allocator's segments by size (a segment that holds nothing at the end is cache that no later request fitted).
Device only:

    python -m benchmarks.reserved_probe llama-1b zero.stage=1 optimizer.state_dtype=bf16 --steps 2
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

GIB = 2**30


def _line(label: str) -> str:
    torch.cuda.synchronize()
    line = (f"{label:<22} allocated {torch.cuda.memory_allocated() / GIB:7.2f} (peak {torch.cuda.max_memory_allocated() / GIB:7.2f})"
            f"  reserved {torch.cuda.memory_reserved() / GIB:7.2f} (peak {torch.cuda.max_memory_reserved() / GIB:7.2f}) GiB")
    torch.cuda.reset_peak_memory_stats()
    return line


def segments_table(top: int = 20) -> list[str]:
    """The allocator's segments, largest first: size, bytes in use, count."""
    sizes = Counter((s["total_size"], s["allocated_size"]) for s in torch.cuda.memory_snapshot())
    rows = sorted(sizes.items(), key=lambda kv: -kv[0][0] * kv[1])
    lines = ["| segment MiB | in use MiB | count |", "| --- | --- | --- |"]
    lines += [f"| {total / 2**20:,.1f} | {used / 2**20:,.1f} | {n} |" for (total, used), n in rows[:top]]
    idle = sum(total * n for (total, used), n in sizes.items() if used == 0)
    lines.append(f"segments holding nothing: {idle / GIB:.2f} GiB of {torch.cuda.memory_reserved() / GIB:.2f} reserved")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    import toolkit
    from toolkit import cuda_allocator
    from toolkit.data.batches import BatchStream, Dataset

    cuda_allocator.use_expandable_segments_by_default()  # as `toolkit run` does (before the first CUDA allocation)
    print(cuda_allocator.describe(), flush=True)
    recipe = toolkit.load_recipe(args.recipe, args.overrides)
    engine = toolkit.initialize(recipe)
    stream = BatchStream(Dataset(recipe.data).train, recipe.batch, rank=0, seed=recipe.training.seed)
    print(_line("engine built"), flush=True)
    micro_step, step = engine._micro_step, engine.step
    count = [0]

    def logged_micro_step(*a, **k):
        out = micro_step(*a, **k)
        count[0] += 1
        print(_line(f"  micro-step {count[0]}"), flush=True)
        return out

    def logged_step(*a, **k):
        out = step(*a, **k)
        print(_line("  optimizer step"), flush=True)
        return out

    engine._micro_step, engine.step = logged_micro_step, logged_step
    for _ in range(args.steps):
        engine.train_batch(stream.next_step())
    print("\n".join(segments_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
