"""Which candidate `toolkit tune` runs next: the search space as changes, a throughput model, and the rules that
skip a candidate without running it. Plain dicts of changes in, no processes here (toolkit/train/tune.py runs them).

The throughput model is a prior, relative tokens/s (one number per candidate, no units):

    prior = micro / (micro + 1)           # a larger micro batch fills the device better, with diminishing returns
          x CKPT_FACTOR if checkpointing  # the forward runs twice: ~4/3 of the compute
          x STAGE_FACTOR[stage]           # more partitioning, more collectives (stage 3 gathers every layer);
                                          # with 16-bit precision STAGE_FACTOR_16BIT (stage 0's fp32 weights)
          x OFFLOAD_FACTOR if offloaded   # the optimizer step over PCIe and on the host

Each measured trial refines it: a pending candidate's expected tokens/s is the measured tokens/s of its nearest
measured trial (fewest axes changed, then the closest micro batch) times prior(candidate) / prior(that trial).
So once something ran, its neighbourhood is ranked by what was measured there, and the best so far pulls the
search toward its own neighbours. The order, after the recipe as written (trial 0, run by tune.py):

1. For each ZeRO stage (without offload), the largest micro batch predicted to fit WITHOUT checkpointing, before
   anything else; on one rank stages 0-1 before 2-3 (one rank's ZeRO partitions over one rank: no memory saved,
   only overhead).
2. Then the pending candidate with the highest expected tokens/s.

Skipped, never run: a candidate of a (stage, checkpointing, offload) configuration at a micro batch at least
that of a failed trial of it (an out-of-memory there rules out larger ones); checkpointing at a micro batch no
larger than one that ran without it at the same stage and offload (checkpointing only pays when it lets a larger
micro batch fit); offload while any configuration without offload ran or may still run.
"""
from __future__ import annotations

import math

MICRO, STAGE, CKPT, OFFLOAD = ("batch.micro_batch_per_rank", "zero.stage", "model.activation_checkpointing",
                               "offload")
CKPT_FACTOR = 0.75  # NOTE: recompute = one more forward, a third of forward + backward's compute
STAGE_FACTOR = {0: 1.0, 1: 0.98, 2: 0.95, 3: 0.85}
# NOTE: empirical. With bf16/fp16, stage 0 keeps fp32 weights under autocast (a cast of every weight in every
# forward) where stages 1-3 hold 16-bit weights and the fp32 master in the optimizer. On one GPU, at the same micro
# batch, stage 0 measured 0.91-0.95 of stage 1 in all four recipes measured at both (gpt2-124m 0.91, gpt2-medium
# 0.94, gpt2-1.5b 0.95, llama-1b 0.93; H100 and H200, benchmarks/RESULTS.md: the tunings and the shipped gpt2-124m),
# stage 2 0.98-1.0, stage 3 0.97-0.99.
STAGE_FACTOR_16BIT = {0: 0.94, 1: 1.0, 2: 0.99, 3: 0.97}
OFFLOAD_FACTOR = 0.5  # NOTE: a guess that only orders offload after the rest; rule 3 gates it anyway


def candidates(micros: list[int], per_rank: int, stages, checkpointing, offloads) -> list[dict]:
    """Every point of the space as changes (the global batch kept: accumulation follows the micro batch), in a
    fixed order (the table's order for those never run)."""
    micros = sorted((m for m in micros if per_rank % m == 0), reverse=True)
    return [{STAGE: stage, MICRO: micro, "batch.grad_accum_steps": per_rank // micro, CKPT: ckpt, OFFLOAD: off}
            for off in offloads for ckpt in checkpointing for stage in stages for micro in micros
            if not (stage == 0 and off != "none")]  # NOTE: stage 0 has no partitioned optimizer to offload


def prior(changes: dict, sixteen_bit: bool = False) -> float:
    """Relative tokens/s the model expects of a candidate before anything is measured (module docstring);
    `sixteen_bit`: the recipe trains in bf16 or fp16."""
    micro = changes[MICRO]
    factor = CKPT_FACTOR if changes.get(CKPT) else 1.0
    factor *= 1.0 if changes.get(OFFLOAD, "none") == "none" else OFFLOAD_FACTOR
    return micro / (micro + 1) * factor * (STAGE_FACTOR_16BIT if sixteen_bit else STAGE_FACTOR)[changes[STAGE]]


def _distance(a: dict, b: dict) -> tuple[int, float]:
    axes = sum(a.get(k) != b.get(k) for k in (STAGE, CKPT, OFFLOAD))
    return axes, abs(math.log2(a[MICRO]) - math.log2(b[MICRO]))


def expected(changes: dict, ran: list[tuple[int, dict, float | None]], sixteen_bit: bool = False) -> float:
    """Expected tokens/s: the prior scaled by the nearest measured trial; the bare prior before any measurement."""
    measured = [(done, tokens_per_s) for _, done, tokens_per_s in ran if tokens_per_s]
    if not measured:
        return prior(changes, sixteen_bit)
    near, tokens_per_s = min(measured, key=lambda m: _distance(changes, m[0]))
    return tokens_per_s * prior(changes, sixteen_bit) / prior(near, sixteen_bit)


def _config(changes: dict) -> tuple:
    return changes[STAGE], bool(changes.get(CKPT)), changes.get(OFFLOAD, "none")


def _plain(changes: dict) -> bool:
    """Neither checkpointing nor offload."""
    return not changes.get(CKPT) and changes.get(OFFLOAD, "none") == "none"


def skip_reason(changes: dict, ran: list[tuple[int, dict, float | None]], pending: list[dict]) -> str:
    """Why a pending candidate is not to run now ("" if it may); `ran` holds (trial index, changes, tokens/s or
    None when it failed). "wait" means not yet: offload waits for the candidates without it."""
    for index, done, tokens_per_s in ran:
        if not tokens_per_s and _config(done) == _config(changes) and changes[MICRO] >= done[MICRO]:
            return f"micro {done[MICRO]} of this configuration failed (#{index})"
        if (tokens_per_s and changes.get(CKPT) and not done.get(CKPT) and done[MICRO] >= changes[MICRO]
                and (done[STAGE], done.get(OFFLOAD, "none")) == (changes[STAGE], changes.get(OFFLOAD, "none"))):
            return f"micro {done[MICRO]} ran without checkpointing (#{index})"
    if changes.get(OFFLOAD, "none") != "none":
        fits = [i for i, done, tokens_per_s in ran if tokens_per_s and done.get(OFFLOAD, "none") == "none"]
        if fits:
            return f"a configuration without offload fits (#{fits[0]})"
        if any(c.get(OFFLOAD, "none") == "none" for c in pending):
            return "wait"
    return ""


def _heads(pending: list[dict], ran: list[tuple[int, dict, float | None]], world_size: int) -> list[dict]:
    """Rule 1: per stage, its largest pending micro batch without checkpointing and offload, unless one at least
    as large already ran; on one rank stages 0-1 first."""
    largest: dict[int, int] = {}
    for _, done, tokens_per_s in ran:
        if tokens_per_s and _plain(done):
            largest[done[STAGE]] = max(largest.get(done[STAGE], 0), done[MICRO])
    heads: dict[int, dict] = {}
    for c in pending:
        if _plain(c) and c[MICRO] > largest.get(c[STAGE], 0) and c[MICRO] > heads.get(c[STAGE], {MICRO: 0})[MICRO]:
            heads[c[STAGE]] = c
    first = [c for stage, c in heads.items() if world_size > 1 or stage <= 1]
    return first or list(heads.values())


def next_candidate(pending: list[dict], ran: list[tuple[int, dict, float | None]], world_size: int,
                   sixteen_bit: bool = False) -> dict | None:
    """The candidate to run next among `pending` (those skip_reason lets run now), or None when none is left."""
    pool = _heads(pending, ran, world_size) or pending
    return max(pool, key=lambda c: expected(c, ran, sixteen_bit)) if pool else None
