"""benchmarks/kernels.py's timing helpers, on the CPU with a fake profiler (the benchmarks themselves need a GPU)."""
import pytest
import torch

from benchmarks import kernels as bench


def test_cold_l2_timing_counts_only_the_timed_calls_kernels(monkeypatch):
    """kernel_us(cold_l2=True): the flushes' kernel is dropped, or subtracted (once per flush, also one
    fn makes itself between its forward and backward) where fn launches the same kernel."""
    monkeypatch.setattr(bench, "_L2", {"buffer": None, "on": False, "flushes": 0})  # the module's state, fresh
    monkeypatch.setattr(bench, "_overwrite_l2", lambda: None)  # no GPU: the flush itself is faked

    x = torch.randn(8, requires_grad=True)

    def fwd_bwd():  # forward; a flush, where kernel_us asks for one, from the hook; backward
        torch.autograd.grad(bench.backward_after_flush((x * 2).sum()), x)

    def profiled(fn, iters):  # stands in for torch.profiler on a GPU: us per call, by kernel name
        for _ in range(iters + 1):
            fn()
        if fn is bench._overwrite_l2:
            return {"fill": 70.0}
        if not bench._L2["on"]:  # back to back: x partly in L2
            return {"norm_fwd": 50.0, "norm_bwd": 83.0, "fill": 2.0}
        return {"norm_fwd": 51.0, "norm_bwd": 91.0, "fill": 142.5, "flush_noise_only": 0.4}  # two flushes a call

    monkeypatch.setattr(bench, "_profiled_us", profiled)
    assert bench.kernel_us(fwd_bwd) == {"norm_fwd": 50.0, "norm_bwd": 83.0, "fill": 2.0}
    assert bench._L2["flushes"] == 0  # flush_l2 is a no-op outside the cold timing
    assert bench.kernel_us(fwd_bwd, cold_l2=True) == pytest.approx({"norm_fwd": 51.0, "norm_bwd": 91.0, "fill": 2.5})
    assert bench.gpu_ms(fwd_bwd, cold_l2=True) == pytest.approx(0.1445)
    assert not bench._L2["on"]
