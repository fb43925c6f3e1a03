"""Where a rank's shard of the parameters lives between uses (`zero.offload_param`), and the
one interface the optimizer half (sharded.py, offload.py) and stage 3's gathers use to reach it.

    DeviceWeights  the chunks are tensors on the training device (stages 1-2; stage 3 without
                   offload_param): gathers read them in place, steps write them in place.
    HostWeights    offload_param cpu: the shard is one CPU tensor (pinned on CUDA). A gather copies the
                   unit's chunk to the device (non-blocking on CUDA) and the copy is dropped once the
                   unit is gathered; on a CPU-only run the device is the CPU and the copy is a plain one.
    SwappedWeights offload_param nvme: the shard is a swap file (swap.py); a gather reads the unit's
                   chunk through the I/O pool (started when the unit is prefetched) into a fresh
                   buffer, moved to the device; CPU memory holds no parameter between uses.

Every tier answers `read(g)` (the whole chunk of group g, for set-up and checkpoints), `write(g, start,
values)` (new weights from the optimizer, any device and dtype) and `fetch(g)` / `fetched(handle)` (the
chunk on the training device for a gather; the handle lets a prefetch overlap the read).
"""
from __future__ import annotations

import torch

from toolkit.runtime.pinned import pinned_empty
from toolkit.runtime.zero.flat import ShardLayout
from toolkit.runtime.zero.swap import SwapDir, wait


class DeviceWeights:
    """Parameter chunks that are tensors on the training device."""

    tier = "none"
    on_device = True

    def __init__(self, chunks: list[torch.Tensor]):
        self.chunks = chunks

    def read(self, g: int) -> torch.Tensor:
        """Group g's chunk (a view: no copy)."""
        return self.chunks[g]

    def write(self, g: int, start: int, values: torch.Tensor) -> None:
        """New weights into group g's chunk from element `start`."""
        self.chunks[g][start:start + values.numel()].copy_(values, non_blocking=True)

    def fetch(self, g: int):
        """Start bringing group g's chunk to the device; `fetched(handle)` returns it there."""
        return self.chunks[g]

    def fetched(self, handle) -> torch.Tensor:
        """The chunk a `fetch` started, on the training device."""
        return handle

    def resident_tensors(self) -> list[torch.Tensor]:
        """Tensors of the shard on the training device."""
        return list(self.chunks)

    def host_tensors(self) -> list[torch.Tensor]:
        """Tensors of the shard in CPU memory kept there by offload."""
        return []


class HostWeights(DeviceWeights):
    """offload_param cpu: the shard in CPU memory, copied to the device per unit."""

    tier = "cpu"
    on_device = False

    def __init__(self, layout: ShardLayout, dtype: torch.dtype, device: torch.device):
        self.device = device
        self.shard = pinned_empty(layout.numel, dtype, pinned=device.type == "cuda")  # exactly its size (pinned.py)
        super().__init__([layout.chunk_of(self.shard, g) for g in range(len(layout.groups))])

    def write(self, g: int, start: int, values: torch.Tensor) -> None:
        """New weights into the CPU shard (synchronous: the caller may reuse `values` at once)."""
        self.chunks[g][start:start + values.numel()].copy_(values)

    def fetch(self, g: int):
        """A device copy of the chunk: non-blocking from pinned memory on CUDA, a plain copy on a CPU."""
        if self.device.type == "cpu":
            return self.chunks[g].clone()  # NOTE: the CPU is the device: the gather reads a moved copy
        return self.chunks[g].to(self.device, non_blocking=True)

    def resident_tensors(self) -> list[torch.Tensor]:
        return []

    def host_tensors(self) -> list[torch.Tensor]:
        return [self.shard]


class SwappedWeights(DeviceWeights):
    """offload_param nvme: the shard in a swap file, read per unit."""

    tier = "nvme"
    on_device = False

    def __init__(self, layout: ShardLayout, dtype: torch.dtype, device: torch.device, swap_dir: SwapDir,
                 rank: int):
        self.layout, self.dtype, self.device = layout, dtype, device
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.file = swap_dir.file(f"params-rank{rank}.bin", layout.numel * self.itemsize)
        super().__init__([])

    def _offset(self, g: int, start: int = 0) -> int:
        return (self.layout.offsets[g] + start) * self.itemsize

    def read(self, g: int) -> torch.Tensor:
        """Group g's chunk, read from the file into a new CPU tensor."""
        return self.fetched(self.fetch(g)).to("cpu")

    def write(self, g: int, start: int, values: torch.Tensor) -> None:
        """New weights into the file (synchronous)."""
        host = values.to("cpu", self.dtype).contiguous()
        self.file.write(host, self._offset(g, start))

    def fetch(self, g: int):
        """Start reading group g's chunk into a fresh CPU buffer (pinned on CUDA) on the I/O pool."""
        out = torch.empty(self.layout.groups[g].chunk, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        return out, self.file.read_async(out, self._offset(g))

    def fetched(self, handle) -> torch.Tensor:
        """Wait for the read; the chunk on the device (the host buffer is dropped with the handle)."""
        out, futures = handle
        wait(futures)
        return out.to(self.device, non_blocking=True)

    def resident_tensors(self) -> list[torch.Tensor]:
        return []


def make_weights(tier: str, layout: ShardLayout, dtype: torch.dtype, device: torch.device,
                 swap_dir: SwapDir | None, rank: int):
    """The store for zero.offload_param `tier` (stage 3), empty; the caller fills it with `write`."""
    if tier == "cpu":
        return HostWeights(layout, dtype, device)
    if tier == "nvme":
        return SwappedWeights(layout, dtype, device, swap_dir, rank)
    shard = torch.empty(layout.numel, dtype=dtype, device=device)
    return DeviceWeights([layout.chunk_of(shard, g) for g in range(len(layout.groups))])
