"""optimizer.state_dtype int8 with zero.offload_optimizer nvme: the 8-bit blockwise moments of an offloaded part in
a swap file, read and written a run of whole blocks at a time.

The file holds both code arrays, then both absmax arrays:

    exp_avg codes (n bytes) | exp_avg_sq codes (n) | exp_avg absmax (4 per block) | exp_avg_sq absmax (4 per block)

2 + 8/256 bytes an element, as in memory. `SwappedMoments` answers what `BlockwiseMoments` (int8_moments.py)
answers, `read(start, stop)` and `write(start, ...)`, so the offloaded step's open blocks (zero/adamw.py
`_open_window`) read each block from the disk once a step and write it back once, quantized the same way: the
results equal int8 moments in CPU memory bit for bit. A fresh file reads as zeros: zero codes with a zero absmax
dequantize to 0, the moments' start. The fp32 master lives in the part's other swap file (shard_part.py).
"""
from __future__ import annotations

import torch

from toolkit.runtime.int8_moments import BLOCK, SIGNED_MAP, UNSIGNED_MAP, dequantize_blockwise, quantize_blockwise


def swapped_moments_bytes(numel: int) -> int:
    """Bytes of the file holding the int8 moments of `numel` elements."""
    return 2 * numel + 8 * -(-numel // BLOCK)


class SwappedMoments:
    """The int8 moments of `numel` consecutive elements in `file` (swap.SwapFile), laid out as the module says."""

    def __init__(self, file, numel: int):
        self.file, self._numel = file, numel
        self.blocks = -(-numel // BLOCK)

    @property
    def numel(self) -> int:
        """Elements held."""
        return self._numel

    def tensors(self) -> list[torch.Tensor]:
        """Nothing in memory: the moments are on the disk."""
        return []

    def _regions(self, start: int, stop: int):
        """(codes offset, absmax offset, codes length, blocks) of each moment for elements [start, stop)."""
        first, last = start // BLOCK, -(-stop // BLOCK)
        for kind in range(2):
            yield kind * self._numel + start, 2 * self._numel + 4 * (kind * self.blocks + first), stop - start, last - first

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (exp_avg, exp_avg_sq) of elements [start, stop); `start` is a multiple of BLOCK."""
        assert start % BLOCK == 0, start
        out = []
        for (codes_at, absmax_at, n, blocks), code_map in zip(self._regions(start, stop), (SIGNED_MAP, UNSIGNED_MAP)):
            codes = self.file.read(torch.empty(n, dtype=torch.uint8), codes_at)
            absmax = self.file.read(torch.empty(blocks, dtype=torch.float32), absmax_at)
            out.append(dequantize_blockwise(codes, absmax, code_map))
        return out[0], out[1]

    def write(self, start: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Quantize fp32 moments into elements [start, start + len): whole blocks (or up to the end)."""
        stop = start + exp_avg.numel()
        assert start % BLOCK == 0 and (stop % BLOCK == 0 or stop == self._numel), (start, stop)
        for (codes_at, absmax_at, _, _), values, code_map in zip(self._regions(start, stop), (exp_avg, exp_avg_sq),
                                                                 (SIGNED_MAP, UNSIGNED_MAP)):
            codes, absmax = quantize_blockwise(values, code_map)
            self.file.write(codes.contiguous(), codes_at)
            self.file.write(absmax.contiguous(), absmax_at)
