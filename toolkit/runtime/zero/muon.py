"""Muon over one rank's ZeRO shard (optimizer.type muon at zero.stage 1-3): the matrices' momentum is sharded
like AdamW's exp_avg, their Newton-Schulz orthogonalization runs on whole matrices gathered for it.

Per step, for every flat group (a stage 1-2 bucket, a stage 3 unit) holding a Muon matrix:
  1. momentum (elementwise, on this rank's slices): m.lerp_(g, 1 - momentum); the update is
     g.lerp(m, momentum) (Nesterov) or m, written in bf16 (torch's Newton-Schulz casts its input to
     bf16 first, so the cast is exact to what torch.optim.Muon computes) into a chunk-sized buffer;
  2. all-gather of that bf16 chunk through the Communicator: every rank then holds the group's whole
     updates (the ledger counts 2 bytes per element of the group's padded buffer);
  3. every rank orthogonalizes the matrices it owns a slice of (a matrix cut between two ranks is
     orthogonalized by both: simpler than assigning matrices and gathering results, same bits) and applies
     torch's step to its slice: p *= 1 - lr * wd; p -= adjusted_lr * O.
The other parameters (embeddings, head, norms, biases) step with ShardedAdamW on their slices. The momentum
lives in ShardedAdamW's exp_avg at the matrices' positions (checkpoints name it exp_avg); exp_avg_sq is
compact, AdamW's elements only, so a matrix element holds 4 bytes of state instead of 8 (checkpoints read
it as zero there: `second_moment_chunk`).

Offloaded (zero.offload_optimizer cpu): the momentum, AdamW's moments and the fp32 master live in CPU memory and
step there; the bf16 updates are gathered and orthogonalized on the training device (`compute_device`), and each
rank's slice of the result comes back to the CPU. In swap files (zero.offload_optimizer nvme) the same states are
streamed a piece at a time (`step_group_streamed`). What does not live here: the maths per matrix
(toolkit/runtime/muon.py), the shard's tiers (shard_part.py).
"""
from __future__ import annotations

import torch

from toolkit.runtime.muon import NS_DTYPES, adjusted_lr, muon_group_settings, orthogonalize
from toolkit.runtime.zero.adamw import ShardedAdamW
from toolkit.specs import OptimizerSpec


class ShardedMuon:
    """Muon on the matrices of one rank's shard (gathering each group's updates), ShardedAdamW on the rest."""

    whole_matrices = True  # ShardPart steps it with step_chunks (it needs the slots, not decay segments)
    moments = None  # fp32 moments: optimizer.state_dtype int8 is not built for Muon (recipe checks refuse it)

    def __init__(self, spec: OptimizerSpec, numel: int, device: torch.device, layout, comm,
                 compute_device: torch.device | None = None):
        self.adamw = ShardedAdamW(spec, numel, device, offload=False)
        self.layout, self.comm, self.device = layout, comm, device
        # offloaded (states in CPU memory): the updates are gathered and orthogonalized on the training device
        self.compute_device = compute_device or device
        self.muon_group = muon_group_settings(spec)
        self.ns_dtype = NS_DTYPES[spec.muon_ns_dtype]  # what is gathered: the Newton-Schulz input
        self.mode = f"{self.adamw.mode}; Muon on gathered matrices"
        # per group: (slot, start, stop) of each slot's piece in this rank's chunk, chunk coordinates
        self.pieces = []
        for group in layout.groups:
            lo, hi = group.chunk_range(layout.rank)
            self.pieces.append([(s, max(lo, s.offset) - lo, min(hi, s.offset + s.numel) - lo) for s in group.slots
                                if max(lo, s.offset) < min(hi, s.offset + s.numel)])
        # per group: (start, stop, offset in the compact exp_avg_sq) of each AdamW piece
        self.second_at, offset = [], 0
        for pieces in self.pieces:
            self.second_at.append([])
            for slot, a, b in (piece for piece in pieces if not piece[0].muon):
                self.second_at[-1].append((a, b, offset))
                offset += b - a
        # NOTE: a swapped part (numel 0) keeps exp_avg_sq in its file in the chunk layout (`step_group_streamed`)
        self.adamw.exp_avg_sq = torch.zeros(offset if numel else 0, dtype=torch.float32, device=device)

    # -- what ShardPart and the strategy read, as from ShardedAdamW ------------------------

    @property
    def param_groups(self) -> list[dict]:
        """Muon's group, then AdamW's two: the same dicts the steps read, so the Schedule's writes reach both."""
        return [self.muon_group, *self.adamw.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        # NOTE: a second ShardPart (offload_ratio < 1) shares the first one's dicts, so one schedule drives both
        self.muon_group, *self.adamw.param_groups = groups

    @property
    def exp_avg(self) -> torch.Tensor:
        """AdamW's first moment, and Muon's momentum at the matrices' positions."""
        return self.adamw.exp_avg

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        """AdamW's second moment, AdamW's elements only (compact)."""
        return self.adamw.exp_avg_sq

    def second_moment_chunk(self, g: int) -> torch.Tensor:
        """Group g's chunk of exp_avg_sq in the shard's layout (a copy; zero at the matrices' elements)."""
        chunk = torch.zeros(self.layout.groups[g].chunk, dtype=torch.float32, device=self.device)
        for a, b, offset in self.second_at[g]:
            chunk[a:b] = self.adamw.exp_avg_sq[offset:offset + b - a]
        return chunk

    def store_second_moment_chunk(self, g: int, chunk: torch.Tensor) -> None:
        """Write back what `second_moment_chunk` returned, after filling it (a checkpoint load)."""
        for a, b, offset in self.second_at[g]:
            self.adamw.exp_avg_sq[offset:offset + b - a] = chunk[a:b]

    @property
    def step_count(self) -> int:
        """Applied steps."""
        return self.adamw.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.adamw.step_count = value

    def state_dict(self) -> dict:
        """The step count (momentum and moments travel with the shard)."""
        return self.adamw.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the step count."""
        self.adamw.load_state_dict(state)

    def memory_bytes(self) -> int:
        """Bytes of the moment buffers."""
        return self.adamw.memory_bytes()

    def moment_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the momentum and AdamW's moments."""
        return self.adamw.moment_tensors()

    # -- the step ------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Count the step (AdamW's bias corrections); then `step_group_streamed` each group (a swapped part's way)."""
        self.adamw.begin_step()

    @torch.no_grad()
    def step_chunks(self, masters: list[torch.Tensor], grads: list[torch.Tensor],
                    moments: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One step over the shard: per group g, `masters[g]` (fp32), `grads[g]` and `moments[g][0]` (exp_avg)
        are this rank's chunk of it (exp_avg_sq: the compact buffer). AdamW's pieces of every group in one call."""
        self.begin_step()
        self._apply_adamw(range(len(self.pieces)), masters, grads, [m for m, _ in moments])
        for g in range(len(self.pieces)):
            self._muon_group_step(g, masters[g], grads[g], moments[g][0])

    @torch.no_grad()
    def step_group_streamed(self, g: int, read, write, grad: torch.Tensor, publish, piece_numel: int) -> None:
        """Group g's part of the step (after `begin_step`) with its states in a swap file, never more than
        `piece_numel` elements of them in memory: `read(kind, a, b)` returns elements a:b of the chunk's master (kind
        0), exp_avg (1) or exp_avg_sq (2, the chunk layout, not the compact buffer), `write(kind, a, values)` puts
        them back, `publish(a, master)` gives the model new weights. Two passes: AdamW's pieces and Muon's momentum,
        then, after the gather, Muon's update of the master (read twice: 4 bytes more of I/O per matrix element)."""
        settings = self.muon_group
        beta = settings["momentum"]
        chunk = self._update_buffer(g)
        for slot, a, b in self.pieces[g]:
            for lo, hi in _runs(a, b, piece_numel):
                grad_piece = grad[lo:hi].to("cpu")
                if slot.muon:  # the momentum, and the update the gather sends
                    m = read(1, lo, hi)
                    m.lerp_(grad_piece, 1 - beta)
                    chunk[lo:hi].copy_(grad_piece.lerp(m, beta) if settings["nesterov"] else m)
                    write(1, lo, m)
                    continue
                master, m, v = (read(kind, lo, hi) for kind in range(3))
                self.adamw.apply({slot.decay: [master], not slot.decay: []}, {slot.decay: [grad_piece],
                                 not slot.decay: []}, {slot.decay: ([m], [v]), not slot.decay: ([], [])})
                for kind, values in enumerate((master, m, v)):
                    write(kind, lo, values)
                publish(lo, master)
        for slot, lo, hi, update in self._orthogonalized(g, chunk, piece_numel):
            master = read(0, lo, hi)
            master.mul_(1 - float(settings["lr"]) * settings["weight_decay"])
            master.add_(update.to(master.device), alpha=-adjusted_lr(float(settings["lr"]), settings["adjust_lr_fn"],
                                                                     slot.shape))
            write(0, lo, master)
            publish(lo, master)

    def _apply_adamw(self, groups, masters, grads, exp_avgs, exp_avg_sqs=None) -> None:
        """AdamW on the non-Muon pieces of `groups` (indexable by group); exp_avg_sq from `exp_avg_sqs[g]` (chunk
        layout) or, when None, the compact buffer."""
        views = {decay: ([], [], [], []) for decay in (True, False)}
        for g in groups:
            adamw = [slot for slot, _, _ in self.pieces[g] if not slot.muon]
            for slot, (a, b, offset) in zip(adamw, self.second_at[g]):
                second = (self.adamw.exp_avg_sq[offset:offset + b - a] if exp_avg_sqs is None
                          else exp_avg_sqs[g][a:b])
                for into, tensor in zip(views[slot.decay], (masters[g][a:b], grads[g][a:b], exp_avgs[g][a:b], second)):
                    into.append(tensor)
        self.adamw.apply({d: v[0] for d, v in views.items()}, {d: v[1] for d, v in views.items()},
                         {d: (v[2], v[3]) for d, v in views.items()})

    def _muon_group_step(self, g: int, master: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor) -> None:
        settings = self.muon_group
        beta, lr = settings["momentum"], float(settings["lr"])
        chunk = self._update_buffer(g)
        if chunk is None:
            return
        for slot, a, b in self.pieces[g]:  # torch.optim.Muon's momentum, on this rank's slices of the matrices
            if slot.muon:
                m, grad_slice = momentum[a:b], grad[a:b]
                m.lerp_(grad_slice, 1 - beta)
                chunk[a:b].copy_(grad_slice.lerp(m, beta) if settings["nesterov"] else m)
        for slot, a, b, update in self._orthogonalized(g, chunk):
            p = master[a:b]
            p.mul_(1 - lr * settings["weight_decay"])
            p.add_(update.to(p.device), alpha=-adjusted_lr(lr, settings["adjust_lr_fn"], slot.shape))

    def _update_buffer(self, g: int) -> torch.Tensor | None:
        """Group g's chunk of updates to gather, zeros in the Newton-Schulz dtype on the compute device; None when the
        group holds no Muon matrix (nothing is gathered for it)."""
        group = self.layout.groups[g]
        if not any(slot.muon for slot in group.slots):
            return None
        return torch.zeros(group.chunk, dtype=self.ns_dtype, device=self.compute_device)

    def _orthogonalized(self, g: int, chunk: torch.Tensor | None, piece_numel: int | None = None):
        """Gather group g's updates (`chunk`: this rank's, in the Newton-Schulz dtype) and yield (slot, a, b, its
        orthogonalized update at chunk elements a:b), runs of at most `piece_numel` (None: whole slices), per Muon
        matrix this rank owns a slice of. Every rank joins the gather of a group holding a matrix, owning a slice of
        one or not."""
        group = self.layout.groups[g]
        if chunk is None:  # no Muon matrix in the group (`_update_buffer`)
            return
        if group.world_size > 1:
            whole = torch.empty(group.padded_numel, dtype=self.ns_dtype, device=self.compute_device)
            self.comm.all_gather_flat(whole, chunk).wait()
        else:
            whole = chunk
        lo = group.chunk_range(self.layout.rank)[0]
        for slot, a, b in self.pieces[g]:
            if not slot.muon:
                continue
            ortho = orthogonalize(whole[slot.offset:slot.offset + slot.numel].view(slot.shape),
                                  self.muon_group["ns_steps"], self.ns_dtype).reshape(-1)
            for start, stop in _runs(a, b, piece_numel or b - a):
                yield slot, start, stop, ortho[lo + start - slot.offset:lo + stop - slot.offset]


def _runs(a: int, b: int, size: int):
    """a:b cut into runs of at most `size` elements (offload.py's PIECE_NUMEL, a multiple of every vector width, so
    elementwise ops give the bits they give on a:b whole)."""
    for start in range(a, b, max(1, size)):
        yield start, min(b, start + max(1, size))
