"""toolkit/runtime/pinned.py: page-locked buffers of exactly their size (torch's pin_memory rounds each allocation up to
a power of two). On a CPU-only machine the buffers are plain; the GPU tests measure the page-locked ones: pinned,
as big as asked in resident memory, copied asynchronously, unregistered when gone, and a run using them trains bit
for bit as one using torch's pinned memory."""
import gc

import pytest
import torch

from toolkit.runtime.pinned import LARGE, pinned_empty


def test_without_cuda_or_unasked_the_buffer_is_plain_memory():
    t = pinned_empty(1000, torch.bfloat16, pinned=False)
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and not t.is_pinned()


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class RecordingCudart:
    """torch.cuda.cudart() with its cudaHostUnregister calls recorded. NOTE: the test must not call cudaHostUnregister
    on memory that is not registered itself: the failure stays as CUDA's last error and fails the next CUDA call
    (it did, on an H100, 2026-12-05)."""

    def __init__(self, real):
        self.real, self.unregistered = real, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def cudaHostUnregister(self, pointer):
        self.unregistered.append(pointer)
        return self.real.cudaHostUnregister(pointer)


@pytest.mark.cuda
def test_a_large_buffer_is_pinned_and_exactly_its_size(monkeypatch):
    torch.cuda.init()
    cudart = RecordingCudart(torch.cuda.cudart())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    numel = (LARGE * 9 // 2) // 2  # 4.5 x LARGE bytes of bf16: torch's allocator would pin 8 x LARGE
    before = resident_bytes()
    t = pinned_empty(numel, torch.bfloat16)
    grown = resident_bytes() - before
    assert t.is_pinned() and t.untyped_storage().nbytes() == 2 * numel
    assert 2 * numel * 0.95 < grown < 2 * numel * 1.1, grown  # page-locked pages are resident; not 8 x LARGE
    t.fill_(1.5)
    on_gpu = t.to("cuda", non_blocking=True)
    back = torch.empty_like(t)
    back.copy_(on_gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, t)
    pointer = t.data_ptr()
    view = t[10:20]
    del t
    gc.collect()
    assert view.is_pinned() and cudart.unregistered == []  # a view keeps the memory and its registration
    del view
    gc.collect()
    assert cudart.unregistered == [pointer]  # the last tensor gone: unregistered, once


@pytest.mark.cuda
def test_stage_3_with_parameters_in_registered_memory_trains_as_with_torchs(monkeypatch, tmp_path):
    from tests.runtime.zero_helpers import SMALL_BUCKETS, train

    base = ["training.device=cuda", "zero.stage=3", SMALL_BUCKETS, "zero.offload_param=cpu",
            "zero.offload_optimizer=cpu", "precision.dtype=bf16", "optimizer.state_dtype=bf16"]
    monkeypatch.setattr("toolkit.runtime.pinned.LARGE", 1 << 62)
    torch_pinned = train(1, base)
    monkeypatch.setattr("toolkit.runtime.pinned.LARGE", 1)  # every buffer through cudaHostRegister
    engine, _, losses, _ = train(1, base)
    assert engine.strategy.weights.shard.is_pinned()
    assert losses == torch_pinned[2]
    want = torch_pinned[0].strategy.full_parameters()
    assert all(torch.equal(got.cpu(), want[name].cpu()) for name, got in engine.strategy.full_parameters().items())
