"""Flat, padded, rank-sharded buffers: the memory layout every ZeRO stage uses.

A `FlatGroup` lays a list of parameters end to end in one flat buffer, decayed
parameters first (so a rank's chunk meets at most two weight-decay regions),
padded to a multiple of the world size. Rank r owns chunk r, elements
[r * chunk, (r + 1) * chunk). Stages 1-2 make one group per reduce bucket,
stage 3 one per unit (transformer block or root), so a bucket's reduce-scatter
and all-gather are single collectives on contiguous memory with no copies.

A rank's shard of a whole model is the concatenation of its chunks of every
group, in group order: `ShardLayout` gives each group's offset there and the
`Segment`s (contiguous runs with one weight-decay setting) the optimizer walks.

What does not live here: hooks and collectives (ddp.py, partition.py, stage3.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its group's flat buffer."""
    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    decay: bool
    muon: bool = False  # optimizer.type muon orthogonalizes it (toolkit/runtime/muon.py muon_param_ids)


class FlatGroup:
    """Parameters laid end to end (decayed first), padded to a multiple of `world_size`."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], decay_ids: set[int], world_size: int,
                 muon_ids: set[int] = frozenset()):
        ordered = [(n, p) for n, p in named_params if id(p) in decay_ids] + \
                  [(n, p) for n, p in named_params if id(p) not in decay_ids]
        self.params = [p for _, p in ordered]
        self.slots: list[Slot] = []
        offset = 0
        for name, p in ordered:
            self.slots.append(Slot(name, offset, p.numel(), tuple(p.shape), id(p) in decay_ids, id(p) in muon_ids))
            offset += p.numel()
        self.numel = offset
        self.decay_numel = sum(s.numel for s in self.slots if s.decay)
        self.world_size = world_size
        self.chunk = -(-offset // world_size)  # ceil
        self.padded_numel = self.chunk * world_size

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of rank's chunk in this group's flat buffer."""
        return rank * self.chunk, (rank + 1) * self.chunk

    def flatten_into(self, flat: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Copy `tensors` (one per slot, in slot order) into `flat`; zero the padding."""
        for slot, t in zip(self.slots, tensors):
            flat[slot.offset:slot.offset + slot.numel].copy_(t.reshape(-1))
        flat[self.numel:].zero_()
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views into a flat buffer of this group's layout."""
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter's data a view into `flat` (which already holds their values)."""
        for p, view in zip(self.params, self.views(flat)):
            p.data = view


@dataclass(frozen=True)
class Segment:
    """A contiguous run of a rank's shard with one weight-decay setting."""
    group: int         # index of the FlatGroup
    start: int         # within the group's chunk (0 = chunk start)
    stop: int
    shard_offset: int  # where `start` sits in the rank's shard buffer
    decay: bool


class ShardLayout:
    """One rank's shard of a list of FlatGroups: offsets and weight-decay segments."""

    def __init__(self, groups: list[FlatGroup], rank: int):
        self.groups, self.rank = groups, rank
        self.offsets, self.segments = [], []
        offset = 0
        for gi, g in enumerate(groups):
            self.offsets.append(offset)
            lo, hi = g.chunk_range(rank)
            cut = min(max(g.decay_numel, lo), hi)  # decayed elements end at decay_numel
            for a, b, decay in ((lo, cut, True), (cut, hi, False)):
                if b > a:
                    self.segments.append(Segment(gi, a - lo, b - lo, offset + a - lo, decay))
            offset += g.chunk
        self.numel = offset

    def chunk_of(self, shard: torch.Tensor, group: int) -> torch.Tensor:
        """This rank's chunk of `group` inside a shard-shaped buffer."""
        start = self.offsets[group]
        return shard[start:start + self.groups[group].chunk]

    def segment_views(self, per_group: list[torch.Tensor], decay: bool) -> list[torch.Tensor]:
        """Views of the segments with this decay setting; `per_group[g]` is a chunk-sized tensor of group g."""
        return [per_group[s.group][s.start:s.stop] for s in self.segments if s.decay == decay]

    def flat_segment_views(self, shard: torch.Tensor, decay: bool) -> list[torch.Tensor]:
        """Segment views into one contiguous shard-shaped buffer."""
        return [shard[s.shard_offset:s.shard_offset + s.stop - s.start] for s in self.segments if s.decay == decay]


def decay_param_ids(model: nn.Module) -> set[int]:
    """ids of the parameters AdamW decays (the groups of toolkit.runtime.optim.param_groups)."""
    from toolkit.runtime.optim import param_groups

    return {id(p) for p in param_groups(model, 1.0)[0]["params"]}


def muon_ids_for(model: nn.Module, optimizer_type: str) -> set[int]:
    """ids of the matrices Muon orthogonalizes under optimizer.type muon (none otherwise)."""
    if optimizer_type != "muon":
        return set()
    from toolkit.runtime.muon import muon_param_ids

    return muon_param_ids(model)


def bucket_params(named_params: list[tuple[str, nn.Parameter]], bucket_numel: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of parameters holding up to `bucket_numel` elements (a larger one stands alone)."""
    buckets, current, size = [], [], 0
    for name, p in named_params:
        if current and size + p.numel() > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += p.numel()
    if current:
        buckets.append(current)
    return buckets
