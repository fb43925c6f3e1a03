"""Benchmark of the real-text data pipeline alone (no model): first-time
tokenization of a recipe's corpus (BPE training included) into a fresh cache,
the cached reload, and the tokens per second that `BatchStream` delivers as
int64 micro batches (packed, shuffled, batched), at the recipe's own shape and
at GPT-2 124M's (seq_len 1024, micro batch 16).

    python -m benchmarks.data_build [RECIPE] [--seconds S] [key=value ...]

The target is 35M tokens/s: 10x the ~3.5M tokens/s that GPT-2 124M trains at on
one H200 (the figure issue 6 gives). Current figures: benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from toolkit.cli.doctor import cpu_name

TARGET_TOKENS_PER_S = 35e6
H200_GPT2_124M_TOKENS_PER_S = 3.5e6


def batches_per_second(dataset, batch, seed: int, seconds: float) -> tuple[float, int]:
    """Input tokens per second of BatchStream.next_step over `seconds`, and the epochs walked."""
    from toolkit.data.batches import BatchStream

    stream = BatchStream(dataset.train, batch, rank=0, seed=seed)
    tokens, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for micro in stream.next_step():
            tokens += micro.shape[0] * (micro.shape[1] - 1)
    return tokens / elapsed, stream.epoch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_build", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="python-stdlib", help="a real-text recipe (default python-stdlib)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    parser.add_argument("--seconds", type=float, default=3.0, help="time per throughput measurement")
    args = parser.parse_args(argv)

    from toolkit.data.batches import Dataset
    from toolkit.recipe.load import load_recipe

    print(f"machine | {cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory(prefix="toolkit-data-bench-") as cache:
        recipe = load_recipe(args.recipe, [*args.overrides, f"data.cache_dir={cache}"])
        start = time.perf_counter()
        dataset = Dataset(recipe.data, log=print)
        first = time.perf_counter() - start
        start = time.perf_counter()
        dataset = Dataset(recipe.data)
        cached = time.perf_counter() - start
        meta = dataset.corpus.meta
        mb = sum(os.path.getsize(p) for p in dataset.corpus.files) / 1e6
        print(f"corpus  | {meta['files']} files, {mb:.1f} MB, {meta['train_tokens'] + meta['valid_tokens']:,} tokens "
              f"({recipe.data.tokenizer}, vocab {meta['vocab_size']})")
        print(f"tokenize| first time {first:.1f}s (tokenizer training included), cached reload {cached:.2f}s")
        shapes = [("recipe", recipe), ("gpt2-124m shape", load_recipe(args.recipe, [
            *args.overrides, f"data.cache_dir={cache}", "data.seq_len=1024", "batch.micro_batch_per_rank=16",
            "batch.grad_accum_steps=1"]))]
        for name, r in shapes:
            data = Dataset(r.data)
            rate, epochs = batches_per_second(data, r.batch, r.training.seed, args.seconds)
            verdict = "ok" if rate >= TARGET_TOKENS_PER_S else "BELOW TARGET"
            print(f"pipeline| {name}: micro {r.batch.micro_batch_per_rank} x seq {r.data.seq_len}: "
                  f"{rate / 1e6:.0f}M tokens/s over {epochs} epochs = {rate / TARGET_TOKENS_PER_S:.1f}x the 35M target, "
                  f"{rate / H200_GPT2_124M_TOKENS_PER_S:.0f}x GPT-2 124M on an H200 ({verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
