"""zero.offload_update overlapped with global-norm clipping: the CPU step's pieces run before the clip coefficient
exists, on the guess that it will be 1 (no clipping), and are redone when it is not.

The overlapped step (overlapped_update.py) starts each bucket's CPU AdamW during backward, but a clipped run's
update needs coef = min(max_norm / (norm + 1e-6), 1), and the norm needs every gradient. SuperOffload's answer,
speculate and then validate, kept bit for bit exact:

    thread, during backward:   piece k's master and moments -> the rollback arena; AdamW on the unclipped gradient
    optimizer step:            the norm -> coef; the part's gradient chunks clipped in place as exact mode clips
                               them (the same op on the same device, so the same bits), ordered after the
                               gradient fetches issued so far and before those issued after
    thread, after the verdict: coef 1: the speculated pieces stand. coef < 1: each is restored from the arena,
                               its clipped gradient fetched and stepped, its weights sent again; a piece fetched
                               before the verdict but not yet stepped is fetched again.

The arena holds the states of at most SPECULATED_SHARE of the part's elements (allocated once, with the part); a
piece that would not fit waits for the verdict, as would every piece of a step that follows a clipped one (a run
that clips tends to keep clipping, and a redo costs more than the wait it saved).
"""
from __future__ import annotations

import math
import threading
from collections import deque

import torch

from toolkit.specs import SPECULATED_SHARE


class ClipSpeculation:
    """The clip coefficient the pieces wait for (`deliver`), and the states of the pieces stepped before it."""

    def __init__(self, states: list[torch.Tensor]):
        self.states = states  # master, exp_avg, exp_avg_sq: flat, aligned by element
        self.limit = math.ceil(SPECULATED_SHARE * states[0].numel())
        # NOTE: allocated up front, so the start-up lines and the memory check see it (toolkit estimate counts it)
        self.arena = [torch.empty(self.limit, dtype=t.dtype) for t in states]
        self.lock = threading.Condition()
        self.coef: float | None = None
        self.cancelled = False
        self.enabled = False
        self.saved: list[tuple[int, int, int]] = []  # (piece, shard offset, numel), stored in that order in the arena
        self.used = 0
        self.last_clipped = False
        # each recent step's outcome: "stood" (speculated, coefficient 1), "rolled back" (speculated, clipped) or
        # "waited" (no piece speculated: the step after a clipped one, or the verdict came first)
        self.outcomes: deque[str] = deque(maxlen=1000)

    def reset(self) -> None:
        """A new step: no verdict yet; speculate unless the last step clipped."""
        with self.lock:
            self.coef, self.cancelled, self.saved, self.used = None, False, [], 0
            self.enabled = not self.last_clipped

    def deliver(self, coef: float, scale) -> None:
        """The step's clip coefficient (1.0: no clipping), from the optimizer step's thread; `scale()` clips the part's
        gradient chunks in place (when coef is not 1), between the fetches before the verdict and those after."""
        with self.lock:
            if coef != 1.0:  # NOTE: not `< 1`: a NaN norm's coefficient scales too, as exact mode's multiply does
                scale()
            self.coef = coef
            self.last_clipped = coef != 1.0
            self.lock.notify_all()

    def cancel(self) -> None:
        """Wake a waiting thread for good (the step will not finish)."""
        with self.lock:
            self.cancelled = True
            self.lock.notify_all()

    def wait(self) -> float | None:
        """The coefficient, once delivered; None when cancelled."""
        with self.lock:
            while self.coef is None and not self.cancelled:
                self.lock.wait()
            return None if self.cancelled else self.coef

    def fetch(self, copy) -> bool:
        """Issue a piece's gradient fetch (`copy()`) under the verdict's lock; True when it reads the unclipped
        gradient (issued before the verdict). In a step that does not guess, only after the verdict: an unclipped
        copy would have to be fetched again (GPT-2 1.5B clipping every step: 468 against exact's 440 ms a step)."""
        with self.lock:
            while not self.enabled and self.coef is None and not self.cancelled:
                self.lock.wait()
            copy()
            return self.coef is None

    def before_update(self, k: int, offset: int, numel: int, unclipped: bool) -> bool:
        """Whether piece k, fetched `unclipped` or not, must be fetched again before its update: after the verdict,
        when it was fetched unclipped and the coefficient is not 1. A piece that may speculate (no verdict yet,
        room in the arena) has its states saved first; one that may not waits for the verdict."""
        with self.lock:
            speculate = self.coef is None and not self.cancelled and self.enabled and self.used + numel <= self.limit
        if not speculate:
            coef = self.wait()
            return unclipped and coef is not None and coef != 1.0
        for saved, state in zip(self.arena, self.states):
            saved[self.used:self.used + numel].copy_(state[offset:offset + numel])
        self.saved.append((k, offset, numel))
        self.used += numel
        return False

    def restore(self) -> list[int]:
        """After a verdict other than 1: the speculated pieces' states put back; the pieces to step again."""
        at = 0
        for _, offset, numel in self.saved:
            for saved, state in zip(self.arena, self.states):
                state[offset:offset + numel].copy_(saved[at:at + numel])
            at += numel
        return [k for k, _, _ in self.saved]

    def host_tensors(self) -> list[torch.Tensor]:
        """The rollback arena: a master and two moments for SPECULATED_SHARE of the part's elements."""
        return list(self.arena)

