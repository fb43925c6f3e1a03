"""What `Engine.step()` and `Engine.train_batch()` return: one optimizer step's loss, gradient norm, lr, loss scale
and communication, kept on the device until read (toolkit/runtime/engine.py)."""
from __future__ import annotations

import torch


class StepResult:
    """What one optimizer step did.

    The loss and the gradient norm stay where they were computed until read: reading `loss` or
    `grad_norm` waits for the step (and reading `loss` checks the run has not diverged, see
    Engine.check_finite), so a loop that logs every N steps lets the GPU run ahead in between.
    """

    def __init__(self, loss: torch.Tensor, grad_norm: torch.Tensor | float, lr: float, loss_scale: float,
                 skipped: bool, check_finite=None, comm: dict | None = None):
        self.loss_tensor = loss  # 0-dim fp32, on the device (no sync)
        self._grad_norm = grad_norm
        self.lr, self.loss_scale, self.skipped = lr, loss_scale, skipped
        self.comm = comm or {}  # this step's comm_bytes, comm_exposed_s, ... (toolkit/observe/comm_ledger.py)
        self._check_finite = check_finite

    @property
    def loss(self) -> float:
        """Mean loss of the step's micro batches over all ranks (syncs)."""
        if self._check_finite is not None:
            self._check_finite()
        return float(self.loss_tensor)

    @property
    def grad_norm(self) -> float:
        """Global L2 norm of the unscaled gradients before clipping; NaN for a skipped step (syncs)."""
        return float(self._grad_norm)
