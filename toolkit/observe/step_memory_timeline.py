"""Memory across one training step, op by op: forward, backward, optimizer step.

`record_step_memory(engine, batch)` runs one step (`engine(batch)`, `engine.backward(loss)`,
`engine.step()`) under a torch dispatch mode that takes a sample after every operator. On CUDA a
sample is the allocator's `memory_allocated()`; on any other device it is the bytes of the tensor
storages the step's operators created and that are still alive (each storage counted once, when an
operator returns it, and dropped when torch frees it). Either way the figure is relative to what was
live when the step began (parameters, gradients kept from before, optimizer states), so the
timeline starts at 0. Operators that return a view or write in place allocate nothing and add
nothing. (What one forward keeps for backward: toolkit/observe/notebook.py saved_activation_bytes.)
What lives here: the recording and the phase arithmetic; plotting belongs to the caller.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PHASES = ("forward", "backward", "optimizer step")


class _LiveBytes(TorchDispatchMode):
    """Samples the live bytes after every operator (see the module docstring for what a sample is)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.cuda = device.type == "cuda"
        self.start = torch.cuda.memory_allocated(device) if self.cuda else 0
        self.device = device
        self.created = 0  # bytes of the storages created under this mode and still alive (non-CUDA)
        self.known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.samples: list[int] = []

    def _freed(self, nbytes: int) -> None:
        self.created -= nbytes

    def _count_new_storages(self, func, out) -> None:
        returns = func._schema.returns
        for i, tensor in enumerate(tree_flatten(out)[0]):
            aliased = i < len(returns) and returns[i].alias_info is not None
            if not isinstance(tensor, torch.Tensor) or aliased or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            if storage in self.known:
                continue
            self.known[storage] = True
            self.created += storage.nbytes()
            weakref.finalize(storage, self._freed, storage.nbytes())

    def live(self) -> int:
        """Bytes live now above the step's start."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) - self.start
        return self.created

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.cuda:
            self._count_new_storages(func, out)
        self.samples.append(self.live())
        return out


@dataclass(frozen=True)
class StepMemoryTimeline:
    """Live bytes above the step's start after each operator, and where each phase's operators lie."""

    bytes: list[int]
    bounds: dict[str, tuple[int, int]]  # phase -> [first, last) sample index
    source: str                        # what a sample is: "CUDA allocator" or "live tensor storages"

    def phase(self, name: str) -> list[int]:
        """The samples taken during one phase."""
        first, last = self.bounds[name]
        return self.bytes[first:last]

    @property
    def peak(self) -> int:
        """The largest sample of the step."""
        return max(self.bytes)

    def peak_phase(self) -> str:
        """The phase whose operators reached the step's peak."""
        at = self.bytes.index(self.peak)
        return next(name for name, (first, last) in self.bounds.items() if first <= at < last)

    def level_at(self, name: str, end: bool = False) -> int:
        """Bytes live when a phase began (after its first operator) or ended (after its last)."""
        samples = self.phase(name)
        return samples[-1] if end else samples[0]

    def rise(self, name: str) -> int:
        """How far a phase climbed above its first sample: an optimizer step's temporaries, for one."""
        samples = self.phase(name)
        return max(samples) - samples[0]


def record_step_memory(engine, batch: torch.Tensor) -> StepMemoryTimeline:
    """Run one training step of `engine` on one micro batch and return its memory timeline."""
    device = torch.device(engine.device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mode = _LiveBytes(device)
    bounds = {}
    with mode:
        loss = engine(batch)
        bounds["forward"] = (0, len(mode.samples))
        engine.backward(loss)
        bounds["backward"] = (bounds["forward"][1], len(mode.samples))
        del loss
        engine.step()
        bounds["optimizer step"] = (bounds["backward"][1], len(mode.samples))
    source = "CUDA allocator" if mode.cuda else "live tensor storages"
    return StepMemoryTimeline(bytes=mode.samples, bounds=bounds, source=source)
