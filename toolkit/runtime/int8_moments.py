"""Adam's two moments held in 8 bits per element, blockwise (optimizer.state_dtype int8), in plain torch ops.

What lives here: the two dynamic code maps (`SIGNED_MAP` for exp_avg, `UNSIGNED_MAP` for exp_avg_sq), blockwise
`quantize_blockwise` / `dequantize_blockwise`, `BlockwiseMoments` (a flat run of both moments: one uint8 code per
element, one fp32 absmax per block of BLOCK elements) and `blockwise_adam_step`, which steps pieces of weights laid
over such a run a window at a time: dequantize the window to fp32, torch's AdamW (Adam) maths
(low_precision_adamw.py `adam_reference_update_`), quantize back. What does not: the stage 0 optimizer
(int8_adamw.py) and the ZeRO shard that holds one `BlockwiseMoments` per rank (zero/adamw.py, zero/shard_part.py).

The code maps follow bitsandbytes' dynamic map (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"): values spread over seven decades, 10^-6 to 1, with more codes near 1. NOTE: unlike bitsandbytes'
signed map (1.0 but not -1.0), ours is symmetric, 0 and +-1 included, so a block's largest magnitude maps to
exactly +-absmax: dequantizing and quantizing again gives back the same codes and absmax (a checkpoint stores
dequantized fp32 moments and a resume at the same layout re-quantizes them bit for bit).
NOTE: exp_avg_sq is quantized as is (unsigned map, as bitsandbytes and torchao do), not as its square root:
benchmarks/bf16_states.py measured both, and both ended at held-out 1.4161 after 1,000 quickstart steps (fp32
states 1.4157; RESULTS.md "Optimizer states in bf16 and int8"), so the simpler one is built.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 256  # elements per absmax scale: 8 / BLOCK bytes of scales per element for the two moments
WINDOW = BLOCK * 4096  # elements dequantized at a time by a step: 8 MiB of fp32 temporaries for both moments


def _dynamic_magnitudes(per_decade_exponent: int) -> list[float]:
    """bitsandbytes' dynamic-map magnitudes: for decade i (10^-6 .. 10^0), 2^(i + k) midpoints of linspace(0.1, 1)."""
    values = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** (i + per_decade_exponent) + 1, dtype=torch.float64)
        values += ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
    return values


def _signed_map() -> torch.Tensor:
    """255 codes: 0, and +-127 magnitudes (bitsandbytes' signed ones with the largest replaced by 1.0)."""
    positive = sorted(_dynamic_magnitudes(0))[:-1] + [1.0]
    return torch.tensor(sorted([-v for v in positive] + [0.0] + positive), dtype=torch.float32)


def _unsigned_map() -> torch.Tensor:
    """256 codes: 0, 254 dynamic magnitudes and 1.0 (bitsandbytes' unsigned map)."""
    return torch.tensor(sorted([0.0] + _dynamic_magnitudes(1) + [1.0]), dtype=torch.float32)


SIGNED_MAP = _signed_map()
UNSIGNED_MAP = _unsigned_map()
assert len(SIGNED_MAP) == 255 and len(UNSIGNED_MAP) == 256 and SIGNED_MAP[0] == -1 and UNSIGNED_MAP[-1] == 1


def _per_element(absmax: torch.Tensor, numel: int) -> torch.Tensor:
    return absmax.repeat_interleave(BLOCK)[:numel]


def quantize_blockwise(x: torch.Tensor, code_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, fp32 absmax per block) of a flat fp32 `x`: each element divided by its block's absmax and
    rounded to the nearest value of `code_map`."""
    blocks = -(-x.numel() // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:x.numel()] = x
    absmax = padded.view(blocks, BLOCK).abs().amax(dim=1)
    scale = _per_element(torch.where(absmax > 0, absmax, torch.ones_like(absmax)), x.numel())
    code_map = code_map.to(x.device)
    midpoints = (code_map[1:] + code_map[:-1]) / 2
    return torch.bucketize(x / scale, midpoints).to(torch.uint8), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code_map: torch.Tensor) -> torch.Tensor:
    """The fp32 values `codes` and `absmax` hold (inverse of `quantize_blockwise` up to one code step)."""
    return code_map.to(codes.device)[codes.long()] * _per_element(absmax, codes.numel())


@dataclass
class BlockwiseMoments:
    """exp_avg and exp_avg_sq of `numel` consecutive elements: uint8 codes, and an fp32 absmax per BLOCK of them."""

    exp_avg: torch.Tensor         # uint8 codes into SIGNED_MAP
    exp_avg_absmax: torch.Tensor  # fp32, one per block
    exp_avg_sq: torch.Tensor      # uint8 codes into UNSIGNED_MAP
    exp_avg_sq_absmax: torch.Tensor

    @classmethod
    def zeros(cls, numel: int, device: torch.device) -> BlockwiseMoments:
        """Moments of `numel` elements, all zero (a zero absmax dequantizes every code to 0)."""
        blocks = -(-numel // BLOCK)
        return cls(torch.zeros(numel, dtype=torch.uint8, device=device),
                   torch.zeros(blocks, dtype=torch.float32, device=device),
                   torch.zeros(numel, dtype=torch.uint8, device=device),
                   torch.zeros(blocks, dtype=torch.float32, device=device))

    @property
    def numel(self) -> int:
        """Elements held."""
        return self.exp_avg.numel()

    def tensors(self) -> list[torch.Tensor]:
        """The four tensors that hold the moments (what memory accounting counts)."""
        return [self.exp_avg, self.exp_avg_absmax, self.exp_avg_sq, self.exp_avg_sq_absmax]

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (exp_avg, exp_avg_sq) of elements [start, stop); `start` is a multiple of BLOCK."""
        assert start % BLOCK == 0, start
        blocks = slice(start // BLOCK, -(-stop // BLOCK))
        return (dequantize_blockwise(self.exp_avg[start:stop], self.exp_avg_absmax[blocks], SIGNED_MAP),
                dequantize_blockwise(self.exp_avg_sq[start:stop], self.exp_avg_sq_absmax[blocks], UNSIGNED_MAP))

    def write(self, start: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Quantize fp32 moments into elements [start, start + len): whole blocks (or up to the end)."""
        stop = start + exp_avg.numel()
        assert start % BLOCK == 0 and (stop % BLOCK == 0 or stop == self.numel), (start, stop)
        blocks = slice(start // BLOCK, -(-stop // BLOCK))
        self.exp_avg[start:stop], self.exp_avg_absmax[blocks] = quantize_blockwise(exp_avg, SIGNED_MAP)
        self.exp_avg_sq[start:stop], self.exp_avg_sq_absmax[blocks] = quantize_blockwise(exp_avg_sq, UNSIGNED_MAP)


@dataclass(frozen=True)
class Piece:
    """Weights laid over a run of BlockwiseMoments: `param` and `grad` (flat fp32 views) at `offset`, stepped with
    the group's `lr` and weight decay `wd`."""
    offset: int
    param: torch.Tensor
    grad: torch.Tensor
    lr: float
    wd: float


def blockwise_adam_step(moments: BlockwiseMoments, pieces: list[Piece], *, step: int, betas: tuple[float, float],
                        eps: float, l2: bool) -> None:
    """One AdamW (Adam with `l2`) step of every piece, a WINDOW of the moments at a time: dequantize the window,
    torch's fp32 maths on each piece's part of it, quantize the window back. Elements no piece covers (padding)
    keep their values up to one code step."""
    from toolkit.runtime.low_precision_adamw import adam_reference_update_

    pieces = sorted(pieces, key=lambda piece: piece.offset)
    for start in range(0, moments.numel, WINDOW):
        stop = min(start + WINDOW, moments.numel)
        exp_avg, exp_avg_sq = moments.read(start, stop)
        for piece in pieces:
            a, b = max(start, piece.offset), min(stop, piece.offset + piece.param.numel())
            if a >= b:
                continue
            local, window = slice(a - piece.offset, b - piece.offset), slice(a - start, b - start)
            adam_reference_update_(piece.param[local], piece.grad[local], exp_avg[window], exp_avg_sq[window],
                                   step=step, lr=piece.lr, wd=piece.wd, betas=betas, eps=eps, l2=l2)
        moments.write(start, exp_avg, exp_avg_sq)
