"""Benchmark (not a test): seconds to make a recipe's synthetic tokens (`markov_chain_tokens`), part of every
run's start. Times the toolkit on PYTHONPATH, so an older tree can be timed with this script:

    python -m benchmarks.synthetic_data [RECIPE] [--rounds N]
"""
from __future__ import annotations

import argparse
import time

import torch

from toolkit.data.batches import markov_chain_tokens
from toolkit.recipe.load import load_recipe


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="gpt2-124m")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    spec = load_recipe(args.recipe).data
    times, tokens = [], None
    for _ in range(args.rounds):
        start = time.perf_counter()
        tokens = markov_chain_tokens(spec, spec.num_samples, stream=0)
        times.append(time.perf_counter() - start)
    digest = int(tokens.sum()) ^ int((tokens[:, ::97] * 31).sum())  # the same tokens in every tree compared
    print(f"{args.recipe}: {tuple(tokens.shape)} tokens in {min(times):.2f} s (best of {args.rounds}: "
          f"{', '.join(f'{t:.2f}' for t in times)}), {torch.get_num_threads()} threads, checksum {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
