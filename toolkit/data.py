"""Training data as micro batches of token ids, shape [micro, seq_len + 1]
(inputs are [:, :-1], targets [:, 1:]).

`synthetic`: a seeded random Markov chain over `vocab_size` tokens where each
token has `branching` equally likely successors, so the best achievable loss is
ln(branching) nats while an untrained model starts near ln(vocab_size).

`BatchStream` walks a per-epoch permutation (seeded by training.seed and the
epoch) one global batch per optimizer step; rank r's micro-step m takes slots
[(m * world + r) * micro, ... + micro) of it, so ranks never overlap and the
samples of a step do not depend on how the global batch is split.
"""
from __future__ import annotations

import math

import torch

from toolkit.specs import BatchSpec, DataSpec


def markov_chain_tokens(spec: DataSpec, num_samples: int, stream: int) -> torch.Tensor:
    """[num_samples, seq_len + 1] int64 tokens from the recipe's chain; `stream` picks independent samples."""
    chain_gen = torch.Generator().manual_seed(spec.seed)
    successors = torch.randint(0, spec.vocab_size, (spec.vocab_size, spec.branching), generator=chain_gen)
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + 7919 * (stream + 1))
    tokens = torch.empty(num_samples, spec.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, spec.vocab_size, (num_samples,), generator=gen)
    choices = torch.randint(0, spec.branching, (num_samples, spec.seq_len), generator=gen)
    for t in range(spec.seq_len):
        tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
    return tokens


class Dataset:
    """Train and eval token tensors for a DataSpec."""

    def __init__(self, spec: DataSpec):
        self.spec = spec
        self.train = markov_chain_tokens(spec, spec.num_samples, stream=0)
        self.eval = markov_chain_tokens(spec, spec.eval_samples, stream=1)
        self.vocab_size = spec.vocab_size

    @property
    def entropy_floor(self) -> float:
        """The best achievable loss in nats."""
        return math.log(self.spec.branching)


class BatchStream:
    """Resumable, rank-sharded micro batches over epochs of a token tensor."""

    def __init__(self, tokens: torch.Tensor, batch: BatchSpec, rank: int, seed: int):
        self.tokens, self.batch, self.rank, self.seed = tokens, batch, rank, seed
        self.steps_per_epoch = len(tokens) // batch.global_batch
        self.epoch, self.step_in_epoch = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 7_368_787 + epoch)
        return torch.randperm(len(self.tokens), generator=gen)

    def next_step(self) -> list[torch.Tensor]:
        """This rank's grad_accum_steps micro batches for the next optimizer step."""
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        b = self.batch
        base = self.step_in_epoch * b.global_batch
        micro_batches = []
        for m in range(b.grad_accum_steps):
            start = base + (m * b.world_size + self.rank) * b.micro_batch_per_rank
            micro_batches.append(self.tokens[self._perm[start:start + b.micro_batch_per_rank]])
        self.step_in_epoch += 1
        return micro_batches

    def state_dict(self) -> dict:
        """Position in the stream (plain ints) for checkpoints."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where a saved stream stopped."""
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        self._perm = self._permutation(self.epoch)


def eval_batches(tokens: torch.Tensor, batch: BatchSpec, rank: int, count: int) -> list[torch.Tensor]:
    """The same `count` micro batches of held-out data at every evaluation, sharded by rank."""
    micro, world = batch.micro_batch_per_rank, batch.world_size
    usable = len(tokens) // (micro * world)
    out = []
    for i in range(min(count, usable)):
        start = (i * world + rank) * micro
        out.append(tokens[start:start + micro])
    return out
