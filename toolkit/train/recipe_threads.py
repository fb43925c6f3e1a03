"""training.cpu_threads for a whole recipe: the runtime's thread choice (toolkit/runtime/cpu_threads.py, which
takes specs) fed from the recipe's training, model, batch and data sections, for `toolkit run`'s loop, its
start-up table and the tutorials."""
from __future__ import annotations

from toolkit.runtime.cpu_threads import ThreadChoice, apply_threads, choose_threads
from toolkit.specs import Recipe


def choose_cpu_threads(recipe: Recipe) -> ThreadChoice:
    """The thread count a run of `recipe` on this machine uses, and why."""
    return choose_threads(recipe.training.cpu_threads, recipe.model,
                          recipe.batch.micro_batch_per_rank * recipe.data.seq_len)


def apply_cpu_threads(recipe: Recipe) -> ThreadChoice:
    """Set torch's intra-op threads as `toolkit run` does for `recipe`; the choice made."""
    return apply_threads(choose_cpu_threads(recipe))
